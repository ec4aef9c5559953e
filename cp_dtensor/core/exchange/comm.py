"""Ring rotation, head all-to-all, K/V all-gather: the only module of the ring that talks to the network.

A rotation is one functional collective (``funcol.permute_tensor``): rank i of the group sends a flat
buffer to rank i+1 and receives one from rank i-1. In eager mode the result is an
``AsyncCollectiveTensor`` that waits on first use, so posting the rotation before the block's compute
overlaps the two; under ``torch.compile`` it is an ``all_to_all_single`` + ``wait_tensor`` pair that
Inductor schedules around the attention kernels -- see Note [Ring under torch.compile].

Note [Ring under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When traced, ``funcol``'s wrappers (``permute_tensor`` included) put a ``wait_tensor`` right after
the collective, because a traced graph has no ``AsyncCollectiveTensor`` to wait lazily. That wait
would serialise every ring step in the compiled graph. So under compile ``rotate`` issues the raw
``_c10d_functional.all_to_all_single`` (the op ``permute_tensor`` lowers to, same split sizes) and
``wait`` adds the only ``wait_tensor``: the graph then reads ``all_to_all_single(k/v of step t+1)
-> block_attn(step t) -> wait_tensor``. tests/core/test_compile.py checks that order in the FX graph and in
Inductor's code (with ``torch._inductor.config.reorder_for_peak_memory = False``; by default that pass
may move a wait up). The backward re-sends K/V as eager does, one message a step (Note [Compiled
backward re-sends K/V] and Note [One message per backward step] in ring.py). Eager mode is unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..._compat import all_gather_single, c10d_functional, reduce_scatter_single

__all__ = [
    "RingComm", "all_gather", "all_gather_host", "all_gather_objects", "all_to_all", "gather_ids", "group_size",
    "host_group", "join_bytes", "lost_peer", "pack", "reduce_scatter", "split_bytes", "unpack", "wait",
]

Groups = dist.ProcessGroup | tuple[dist.ProcessGroup, ...]  # one group, or nested groups (see all_gather_host)


def lost_peer(e: RuntimeError, group: Groups) -> RuntimeError:
    """The error to raise when a collective of the CP group fails under us."""
    groups = group if isinstance(group, tuple) else (group,)
    rank, world = _flat_rank(groups), group_size(groups)
    return RuntimeError(
        f"cp_dtensor ring: rank {rank} of {world} lost a transfer of its CP group -- a rank died or "
        "stalled past the process group's timeout (set it with init_process_group(timeout=...); NCCL "
        f"also needs TORCH_NCCL_ASYNC_ERROR_HANDLING). Cause: {e}"
    )


class RingComm:
    """The ring of ``group``: who this rank is, and a non-blocking one-step rotation."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def src_at(self, step: int) -> int:
        """The rank whose block this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world

    def rotate(self, buf: Tensor, *, shift: int = 1) -> Tensor:
        """Post the send of ``buf`` (1-D) to rank + ``shift``; returns the buffer from rank - ``shift``."""
        # permute_tensor splits by numel along dim 0, so the buffer must be flat.
        assert buf.dim() == 1, "ring buffers are flat; see pack()"
        dst = [(i + shift) % self.world for i in range(self.world)]
        if torch.compiler.is_compiling():
            # See Note [Ring under torch.compile]: no wait here, the caller's wait() is the only one.
            n, nxt, prev = buf.numel(), dst[self.rank], (self.rank - shift) % self.world
            send = [n if r == nxt else 0 for r in range(self.world)]
            recv = [n if r == prev else 0 for r in range(self.world)]
            return c10d_functional.all_to_all_single(buf, recv, send, self.group.group_name)
        try:
            return funcol.permute_tensor(buf, dst, self.group)
        except RuntimeError as e:
            raise lost_peer(e, self.group) from e

    def wait(self, buf: Tensor) -> Tensor:
        """Block until a rotated buffer has arrived. Every rotation is waited on exactly once, at the
        point where its data is next needed -- after the current step's compute.

        A dead or stuck neighbour surfaces here: gloo fails as soon as the peer's socket closes, and
        otherwise every transfer gives up after the process group's timeout
        (``init_process_group(..., timeout=...)``, NCCL also with TORCH_NCCL_ASYNC_ERROR_HANDLING)."""
        try:
            return funcol.wait_tensor(buf)
        except RuntimeError as e:
            raise lost_peer(e, self.group) from e


# a cache: one gloo twin per device group, keyed by name and kept with the group it twins -- a process
# group created after destroy_process_group() may reuse a name, and must not get the old twin
_HOST_GROUPS: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def host_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group of the same ranks that moves CPU tensors: ``group`` itself under gloo, else a gloo twin
    created once (by the group's own ranks only). The agreement check and the document ids travel
    there, so they never make the host wait for the device (Note [Agreeing before the ring] in
    checks.py); the K/V ring stays on ``group``."""
    if dist.get_backend(group) == "gloo":
        return group
    name = group.group_name
    if name not in _HOST_GROUPS or _HOST_GROUPS[name][0] is not group:
        ranks = dist.get_process_group_ranks(group)
        _HOST_GROUPS[name] = (group, dist.new_group(ranks, backend="gloo", use_local_synchronization=True))
    return _HOST_GROUPS[name][1]


def join_bytes(*bufs: Tensor) -> Tensor:
    """One flat uint8 message holding flat buffers of any dtypes, in order (one transfer for several)."""
    return torch.cat([b.reshape(-1).view(torch.uint8) for b in bufs])


def split_bytes(buf: Tensor, *parts: tuple[int, torch.dtype]) -> list[Tensor]:
    """Inverse of :func:`join_bytes`: (numel, dtype) per part. A part whose offset is not aligned to
    its dtype is copied out (no view can reinterpret it)."""
    out, offset = [], 0
    for n, dtype in parts:
        size = n * dtype.itemsize
        part = buf.narrow(0, offset, size)
        out.append((part.clone() if offset % dtype.itemsize else part).view(dtype))
        offset += size
    return out


def pack(*xs: Tensor) -> Tensor:
    """Concatenate tensors of one dtype into one flat buffer (one message per ring step)."""
    return torch.cat([x.reshape(-1) for x in xs])


def unpack(buf: Tensor, *likes: Tensor) -> list[Tensor]:
    """Views of ``buf`` shaped like ``likes`` (inverse of :func:`pack`; no copy)."""
    out, offset = [], 0
    for like in likes:
        n = like.numel()
        out.append(buf.narrow(0, offset, n).view(like.shape))
        offset += n
    return out


def gather_ids(ids: Tensor, group: Groups, id_range: tuple[int, int] | None) -> Tensor:
    """Every rank's document ids, [P, B, S_local], from this rank's ids [B, S_local]: one all-gather,
    in the narrowest integer type that holds the global (min, max) ``id_range`` (None: unknown, int64).
    Only equality of ids matters downstream, so they stay shifted by the global minimum.
    See Note [Masks in the ring] in blocks.py."""
    world = group_size(group)
    small = ids.to(torch.int64)
    if id_range is not None:
        lo, hi = id_range
        span = hi - lo
        for dtype in (torch.uint8, torch.int16, torch.int32):
            if span <= torch.iinfo(dtype).max:
                small = (small - lo).to(dtype)
                break
    if world == 1:
        return small.unsqueeze(0)
    dtype = small.dtype
    every = all_gather_host(small.contiguous().view(torch.uint8), group)  # as bytes: gloo gathers no int16
    return every.view(dtype).view(world, *ids.shape)


# -- nested groups: a 2-D mesh's ranks without a group of all of them ---------------------------------


def group_size(groups: Groups) -> int:
    groups = groups if isinstance(groups, tuple) else (groups,)
    n = 1
    for g in groups:
        n *= dist.get_world_size(g)
    return n


def _flat_rank(groups: tuple[dist.ProcessGroup, ...]) -> int:
    """This rank's index in the order of :func:`all_gather_host`: group 0 fastest."""
    rank, stride = 0, 1
    for g in groups:
        rank += dist.get_rank(g) * stride
        stride *= dist.get_world_size(g)
    return rank


def all_gather_host(x: Tensor, groups: Groups) -> Tensor:
    """Every rank's ``x`` stacked on a new dim 0 ([world, *x.shape]), gathered over ``groups`` one after
    the other: over (g0, g1) the entry of the rank at index i1 in g1 and i0 in g0 is i1 * |g0| + i0.
    A 2-D mesh (U, R) passes (ring group, Ulysses group), so entry u * R + r is mesh rank (u, r): every
    rank's view without a group of all P ranks. Waits (host values, small)."""
    groups = groups if isinstance(groups, tuple) else (groups,)
    out = x.unsqueeze(0)
    for g in groups:
        if dist.get_world_size(g) == 1:
            continue
        try:
            got = all_gather_single(out.contiguous(), 0, g)
            out = got if torch.compiler.is_compiling() else funcol.wait_tensor(got)
        except RuntimeError as e:
            raise lost_peer(e, g) from e
    return out.reshape(group_size(groups), *x.shape)


def all_gather_objects(obj, groups: Groups) -> list:
    """Every rank's picklable ``obj``, in the order of :func:`all_gather_host`."""
    groups = groups if isinstance(groups, tuple) else (groups,)
    out = [obj]
    for g in groups:
        every = [None] * dist.get_world_size(g)
        dist.all_gather_object(every, out, group=g)
        out = [o for part in every for o in part]
    return out


# -- Ulysses and all-gather exchanges (ulysses.py, allgather.py) ---------------------------------------


def all_to_all(buf: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Equal-split all-to-all of a flat buffer: part i (of |group| equal parts) goes to rank i, and part
    j of the result came from rank j. Waited (its result is needed at once). The heads exchange of
    Note [Ulysses x ring] in ulysses.py."""
    assert buf.dim() == 1, "all-to-all buffers are flat"
    try:
        out = funcol.all_to_all_single(buf, None, None, group)
        return funcol.wait_tensor(out)
    except RuntimeError as e:
        raise lost_peer(e, group) from e


def all_gather(buf: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Post the all-gather of a flat buffer ([P * n] in rank order); :func:`wait` on it when needed."""
    assert buf.dim() == 1, "all-gather buffers are flat"
    try:
        return all_gather_single(buf, 0, group)
    except RuntimeError as e:
        raise lost_peer(e, group) from e


def reduce_scatter(buf: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Post the sum-reduce-scatter of a flat buffer [P * n]: this rank gets the sum of every rank's part
    ``rank``. :func:`wait` on it when needed."""
    assert buf.dim() == 1, "reduce-scatter buffers are flat"
    try:
        return reduce_scatter_single(buf, "sum", 0, group)
    except RuntimeError as e:
        raise lost_peer(e, group) from e


def all_reduce_sum(buf: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of every rank's ``buf`` over ``group`` (a new tensor; waited): the MoE router loss's sums
    (Note [Router loss under CP] in hf/router.py)."""
    try:
        return funcol.wait_tensor(funcol.all_reduce(buf, "sum", group))
    except RuntimeError as e:
        raise lost_peer(e, group) from e


def wait(buf: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Block until a posted collective's result has arrived (see :meth:`RingComm.wait`)."""
    try:
        return funcol.wait_tensor(buf)
    except RuntimeError as e:
        raise lost_peer(e, group) from e
