"""Counting what goes on the wire: a dispatch mode over the functional collectives.

``CommDebugMode`` counts collectives; this adds the bytes each rank sends to *other* ranks, which is
what the ring's cost formula speaks of. Works in eager mode (functional collectives dispatch through
``torch.ops._c10d_functional``).
"""

from __future__ import annotations

from collections import Counter

import torch.distributed as dist

from .._compat import TorchDispatchMode, c10d_functional, resolve_process_group

__all__ = ["CommBytes"]

_c10d = c10d_functional


def _group_of(name: str) -> dist.ProcessGroup:
    return resolve_process_group(name)


class CommBytes(TorchDispatchMode):
    """``with CommBytes() as cb: ...`` then ``cb.sent`` (bytes this rank sent to others) and
    ``cb.by_op`` (the same split by collective)."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def sent(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if packet is _c10d.all_to_all_single:
            x, _out_splits, in_splits, group_name = args[:4]
            rank = dist.get_rank(_group_of(group_name))
            row = x[0].numel() * x.element_size() if x.dim() > 0 and x.shape[0] else 0
            self.by_op["all_to_all_single"] += sum(n for r, n in enumerate(in_splits) if r != rank) * row
        elif packet is _c10d.all_gather_into_tensor:
            x, world = args[0], args[1]
            self.by_op["all_gather_into_tensor"] += x.numel() * x.element_size() * (world - 1)
        elif packet is _c10d.reduce_scatter_tensor:  # sends every part but its own: (P - 1) / P of its input
            x, world = args[0], args[2]
            self.by_op["reduce_scatter_tensor"] += x.numel() * x.element_size() * (world - 1) // world
        elif packet in (_c10d.all_reduce, _c10d.broadcast):
            x = args[0]
            self.by_op[packet.__name__] += x.numel() * x.element_size()
        return func(*args, **kwargs)
