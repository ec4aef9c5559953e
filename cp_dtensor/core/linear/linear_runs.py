"""Linear attention's runs under CP, shared by the delta rule (linear_attention.py) and the conv
(linear_conv.py): the CP group, each rank's contiguous runs and their owners, the agreement's local
checks, and the differentiable all-gather of the runs' summaries. See Note [Linear attention under CP] in
linear_attention.py.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from ..exchange.comm import all_gather, all_gather_host, host_group, reduce_scatter, wait
from ..plan.layout import LAYOUTS
from .linear_plan import linear_layout_error

__all__ = ["run_owner", "run_starts"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ACTIVATIONS = (None, "silu", "swish")


# -- the group, the runs and the agreement's local checks --------------------------------------------------------------


def _group(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, rank, world); None: no process group, one rank."""
    if group is not None and hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"linear attention needs a 1-D CP mesh; got a {group.ndim}-D mesh {group.mesh_dim_names}.")
        group = group.get_group()
    if group is None:
        if not dist.is_initialized():
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def run_starts(layout: str, rank: int, world: int, s_local: int) -> list[tuple[int, int]]:
    """(local start, global run index) of each of this rank's runs, each s_local // runs long."""
    if layout == "contiguous":
        return [(0, rank)]
    return [(0, rank), (s_local // 2, 2 * world - 1 - rank)]


def run_owner(layout: str, world: int, j: int) -> tuple[int, int]:
    """(rank, local run) holding global run ``j``."""
    if layout == "contiguous" or j < world:
        return j, 0
    return 2 * world - 1 - j, 1


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _describe(field: str, value: int):
    """A fingerprint entry as the caller wrote it."""
    if value < 0:
        return "invalid"
    if field == "layout":
        return repr(LAYOUTS[value])
    if field in ("dtype", "weight_dtype"):
        return _FLOATS[value]
    if field == "activation":
        return repr(_ACTIVATIONS[value])
    if field in ("kernel", "kernel_kwargs"):
        return f"#{value & 0xFFFF:04x}"
    return value


def _layout_error(what: str, layout, s_local: int) -> str | None:
    error = linear_layout_error(layout)
    if error is not None:
        return f"{what}: {error}"
    if layout == "headtail" and s_local % 2:
        return (f"{what}: the headtail layout holds two equal runs per rank; got S_local = {s_local} (odd). Pad the "
                "sequence to a multiple of 2 * P.")
    if s_local < 1:
        return f"{what}: empty shard (S_local = 0)."
    return None


def _ids_error(what: str, ids, batch: int, s_local: int) -> str | None:
    if ids is None:
        return None
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        return f"{what}: document_ids must be an integer tensor [B, S_local]; got {got}."
    if tuple(ids.shape) != (batch, s_local):
        return (f"{what}: document_ids must be this rank's shard [B, S_local] = [{batch}, {s_local}], sharded like "
                f"the tokens; got shape {tuple(ids.shape)}.")
    return None



def _gather_last_ids(ids: Tensor, starts, run_len: int, group, world: int) -> Tensor:
    """The id of every run's last token, on the host: [P, B, runs] (int64)."""
    last = ids[:, [s0 + run_len - 1 for s0, _ in starts]].to("cpu", torch.int64)
    if world == 1:
        return last.unsqueeze(0)
    return all_gather_host(last.contiguous(), host_group(group))


class _AllGather(torch.autograd.Function):
    """Differentiable all-gather of a flat buffer: [n] -> [P * n]; backward: the sum-reduce-scatter of the
    gradient (each rank's copy feeds that rank's loss). See Note [Linear attention under CP]."""

    @staticmethod
    def forward(ctx, buf: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return wait(all_gather(buf, group), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return wait(reduce_scatter(grad.contiguous(), ctx.group), ctx.group), None


class _Tie(torch.autograd.Function):
    """``out`` unchanged, whose backward also hands ``dep`` a zero gradient: a rank whose output does not read
    the gathered buffer (rank 0 of the contiguous layout, runs that all start documents) still runs the
    all-gather's backward, the reduce-scatter every other rank waits in."""

    @staticmethod
    def forward(ctx, out: Tensor, dep: Tensor) -> Tensor:
        ctx.dep = (dep.shape, dep.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype = ctx.dep
        return grad, grad.new_zeros(shape, dtype=dtype)


def _gather(buf: Tensor, group, world: int) -> Tensor:
    return buf if world == 1 else _AllGather.apply(buf.contiguous(), group)
