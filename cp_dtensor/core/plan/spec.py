"""The frozen spec of one ring call: the options every piece of the call reads, in one value.

Note [One spec per ring call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A ring call's options -- the group(s), the layout, causality, the scale, the wire dtype, the window,
the exchange -- are the same for every piece of the call: the cross-rank agreement (checks.py), the
mask plan (``blocks.Mask``), the exchange's forward and backward (ring.py, allgather.py) and, on a
(U, R) mesh, the heads all-to-all (ulysses.py). The front doors (``ring_attention`` in attention.py,
the DTensor SDPA rule in dtensor/sdpa.py) build one ``RingSpec`` and pass it whole; nothing downstream
re-lists the options. Per-call *data* travels beside it: the tensors, the document ids, the agreement's
``ready`` token.

``RingSpec`` holds the caller's values as given (a list window becomes a tuple) and never raises: a bad
value on one rank must reach the agreement, which raises on every rank alike (Note [Agreeing before the
ring] in checks.py). Past the agreement its values are valid on every rank.

It is a frozen dataclass of plain values and process groups, so under ``torch.compile`` it is a
constant of the graph: Dynamo reads its fields like arguments, guards on them (another layout or window
compiles another graph, as before), and the autograd Function takes it as one argument (and one
``None`` gradient slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..._deprecated import warn_once

__all__ = ["RingSpec", "as_spec"]


@dataclass(frozen=True)
class RingSpec:
    """One ring call's options, built once at the front door; see Note [One spec per ring call]."""

    group: dist.ProcessGroup  #: the K/V exchange's group (on a (U, R) mesh: the ring dim, R ranks)
    layout: str  #: "striped", "headtail" or "contiguous" (Note [Sequence layouts] in layout.py)
    is_causal: bool = False  #: keep key position <= query position
    scale: float | None = None  #: softmax scale; None: 1/sqrt(Dqk) (:meth:`softmax_scale`)
    comm_dtype: torch.dtype | None = None  #: K/V's dtype on the wire (Note [float8 ring payload] in payload.py)
    window: tuple[int, int] | None = None  #: (left, right) keys around each query; -1 unbounded
    kv_exchange: str = "ring"  #: "ring" (P - 1 rotations) or "allgather" (Note [All-gather K/V])
    ulysses_group: dist.ProcessGroup | None = None  #: a (U, R) mesh's heads all-to-all group; None on 1-D CP

    @property
    def world(self) -> int:
        """The exchange's ranks (R on a (U, R) mesh)."""
        return dist.get_world_size(self.group)

    @property
    def ulysses(self) -> int:
        """U of a (U, R) mesh; 1 on 1-D CP."""
        return 1 if self.ulysses_group is None else dist.get_world_size(self.ulysses_group)

    @property
    def groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Every group the call talks over: (ring,) or (ring, Ulysses) -- the agreement's reach, all P ranks."""
        return (self.group,) if self.ulysses_group is None else (self.group, self.ulysses_group)

    @property
    def ring_ulysses(self) -> int:
        """U as the exchange's mask plan sees it: striped unions are striped shards over R (1), other
        layouts' unions are no 1-D layout (U). See Note [Ulysses unions] in ulysses.py."""
        return 1 if self.layout == "striped" else self.ulysses

    def softmax_scale(self, head_dim: int) -> float:
        """The scale the kernels use: ``scale``, or 1/sqrt(``head_dim``) for None."""
        return 1.0 / math.sqrt(head_dim) if self.scale is None else float(self.scale)


_LEGACY = ("group", "layout", "is_causal", "scale", "comm_dtype")


def as_spec(spec: RingSpec | None, options: dict[str, Any], where: str) -> RingSpec:
    """``spec``, or one built from the keyword options the exchanges took before they took a spec
    (``group=, layout=, is_causal=, scale=, comm_dtype=``; warns once)."""
    if spec is not None:
        if options:
            raise TypeError(f"{where} takes a RingSpec or the options {', '.join(_LEGACY)}, not both; got spec and "
                            f"{', '.join(sorted(options))}. Put the options in the RingSpec.")
        return spec
    unknown = sorted(set(options) - set(_LEGACY))
    if unknown or "group" not in options or "layout" not in options:
        raise TypeError(f"{where} needs a RingSpec (or group= and layout=); got options {sorted(options)}"
                        + (f", unknown: {unknown}" if unknown else "") + ".")
    warn_once(f"{where}(..., group=, layout=, ...)", f"{where}(q, k, v, RingSpec(group, layout, ...), ...)")
    return RingSpec(**options)
