"""Sequence-sharded DTensors: made from a full tensor (``shard_sequence``), moved between layouts, meshes and
CP sizes. Each entry point installs the SDPA-on-DTensor rule (``dispatch.install_sdpa_dispatch``).

``relayout``: between layouts on one mesh (striped <-> head-tail <-> contiguous) with one all-to-all per
changed mesh dim and O(shard) buffers -- never the full tensor. Checkpoints use it to store every
layout as contiguous boxes; see Note [Checkpointing layout shards] in checkpoint/dcp.py. ``to_mesh``: onto
another mesh (another CP size) through the full tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .._compat import _StridedShard
from .._deprecated import seq_dim_argument, warn_once
from ..core.batch import unshard_batch
from ..core.plan.layout import check_seq_len, local_positions, shard_tensor, wrap_dim
from .placements import as_layout_placements, full_tensor, placement_layout, sequence_placement
from .sdpa import install_sdpa_dispatch

__all__ = ["box_placements", "layout_moves", "relayout", "shard_sequence", "to_mesh", "unshard_sequence"]


def _cp_mesh_dim(mesh: DeviceMesh, mesh_dim: int | str | None) -> int:
    if mesh_dim is None:
        if mesh.ndim != 1:
            raise ValueError(f"a {mesh.ndim}-D mesh needs mesh_dim= (the CP dimension's name or index); "
                             f"mesh dims: {mesh.mesh_dim_names}.")
        return 0
    if isinstance(mesh_dim, str):
        names = mesh.mesh_dim_names or ()
        if mesh_dim not in names:
            raise ValueError(f"mesh has no dimension {mesh_dim!r}; its dims are {names}.")
        return names.index(mesh_dim)
    return mesh_dim % mesh.ndim


def shard_sequence(
    x: torch.Tensor, mesh: DeviceMesh, *, seq_dim: int | None = None, layout: str = "striped",
    mesh_dim: int | str | None = None, **deprecated,
) -> DTensor:
    """Shard the full tensor ``x`` (the same on every rank) along ``seq_dim`` in ``layout`` over the CP
    dimension ``mesh_dim`` of ``mesh`` (other mesh dims replicate). Local slicing, no communication.
    ``unshard_sequence`` (or ``full_tensor()``) gives ``x`` back in its original order."""
    seq_dim = seq_dim_argument(seq_dim, deprecated, "cp_dtensor.shard_sequence")
    install_sdpa_dispatch()  # SDPA on what this returns runs the ring (idempotent); Note [SDPA dispatch]
    dim, md = wrap_dim(seq_dim, x.dim()), _cp_mesh_dim(mesh, mesh_dim)
    cp = mesh.size(md)
    placement = sequence_placement(dim, layout=layout, seq_len=x.shape[dim], cp_size=cp)
    placements = [Replicate()] * mesh.ndim
    placements[md] = placement
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is outside the mesh: an empty local shard, as DTensor does
        local = x.new_empty(0)
    else:
        local = shard_tensor(x, seq_dim=dim, layout=layout, rank=coord[md], cp_size=cp).contiguous()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=x.shape, stride=x.stride())



def unshard_sequence(x: DTensor, *args, **kwargs) -> torch.Tensor:
    """The full tensor, in original order, from a sequence-sharded DTensor (the inverse of
    ``shard_sequence``; differentiable). (The old form ``unshard_sequence(local, cp_mesh, layout=, dim=)``
    on a plain local shard still works, warning once: it is ``unshard_batch(local, cp_mesh, seq_dim=,
    layout=)``.)"""
    if isinstance(x, DTensor):
        if args or kwargs:
            raise TypeError("unshard_sequence(x) takes the DTensor alone: its mesh and layout are in its placements.")
        return full_tensor(x)
    warn_once("cp_dtensor.unshard_sequence(local_shard, cp_mesh, ...)",
              "cp_dtensor.unshard_batch(local_shard, cp_mesh, seq_dim=..., layout=...)")
    mesh = args[0] if args else kwargs.pop("cp_mesh", None)
    if mesh is None:
        raise TypeError("unshard_sequence of a plain local shard needs the CP mesh; use "
                        "cp_dtensor.unshard_batch(local_shard, cp_mesh, seq_dim=..., layout=...).")
    return unshard_batch(x, mesh, seq_dim=kwargs.get("dim", 1), layout=kwargs.get("layout", "striped"))

# ---- the O(shard) all-to-all between layouts; see Note [Checkpointing layout shards] in checkpoint/dcp.py ----

def _owners(layout: str, world: int, seq_len: int, positions: Tensor) -> Tensor:
    """The rank that holds each global position in ``layout`` (inverse of ``local_positions``)."""
    s_local = seq_len // world
    if layout == "contiguous":
        return positions // s_local
    if layout == "striped":
        return positions % world
    chunk = positions // (s_local // 2)  # headtail: chunk c < P is rank c's head, else rank 2P-1-c's tail
    return torch.where(chunk < world, chunk, 2 * world - 1 - chunk)


def _exchange(local: Tensor, *, dim: int, seq_len: int, src: str, dst: str, group: tuple) -> Tensor:
    """This rank's ``dst`` shard from its ``src`` shard along ``dim``: one all-to-all, O(shard) buffers."""
    mesh, mesh_dim = group
    world, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    if src == dst or world == 1:
        return local
    # local: [.., S_local (src order), ..] -> send: [S_local, ..] grouped by receiving rank
    to = _owners(dst, world, seq_len, local_positions(layout=src, rank=rank, cp_size=world, seq_len=seq_len))
    send = local.movedim(dim, 0).index_select(0, torch.argsort(to, stable=True).to(local.device))
    wanted = local_positions(layout=dst, rank=rank, cp_size=world, seq_len=seq_len)
    frm = _owners(src, world, seq_len, wanted)
    recv = funcol.all_to_all_single(
        send, torch.bincount(frm, minlength=world).tolist(), torch.bincount(to, minlength=world).tolist(),
        group=group,
    )
    if isinstance(recv, funcol.AsyncCollectiveTensor):
        recv = recv.wait()
    # each sender's rows arrive in increasing position, senders in rank order: recv[k] is
    # wanted[arrival[k]]; scatter them into dst order
    arrival = torch.argsort(frm, stable=True).to(local.device)
    out = torch.empty_like(local, memory_format=torch.contiguous_format)
    out.movedim(dim, 0).index_copy_(0, arrival, recv)
    return out


_SEQ_SHARDS = (Shard, _StridedShard)  # _StridedShard is no Shard subclass in torch 2.13


def layout_moves(x: DTensor, placements: Sequence[Placement]) -> list[tuple[int, int, str, str]]:
    """(mesh dim, tensor dim, src layout, dst layout) for every mesh dim whose placement changes.
    Raises unless each change is between sequence layouts of one tensor dim no other mesh dim shards."""
    mesh, src_pl = x.device_mesh, as_layout_placements(x.placements)
    dst_pl = as_layout_placements(placements)
    if len(dst_pl) != mesh.ndim:
        raise ValueError(f"need one placement per mesh dim ({mesh.ndim}); got {list(dst_pl)}.")
    if any(isinstance(p, Partial) for p in (*src_pl, *dst_pl)):
        raise ValueError(f"cannot checkpoint or relayout a Partial DTensor ({list(src_pl)}); reduce it first.")
    moves = []
    for md, (p, q) in enumerate(zip(src_pl, dst_pl)):
        if p == q and type(p) is type(q):
            continue
        if not (isinstance(p, _SEQ_SHARDS) and isinstance(q, _SEQ_SHARDS) and p.dim == q.dim):
            raise ValueError(f"relayout changes sequence layouts only (Shard, Striped, HeadTail of one dim); "
                             f"mesh dim {md} goes {p} -> {q}. Use DTensor.redistribute for other changes.")
        d, n, cp = p.dim, x.shape[p.dim], mesh.size(md)
        others = [o for i, o in enumerate(src_pl) if i != md and isinstance(o, _SEQ_SHARDS) and o.dim == d]
        if others:
            raise ValueError(f"tensor dim {d} is also sharded by {others}; a sequence layout must be the only "
                             "placement sharding its dim.")
        src, dst = placement_layout(p, seq_len=n, cp=cp), placement_layout(q, seq_len=n, cp=cp)
        for layout in (src, dst):
            check_seq_len(layout, cp, n, fix=f"(tensor dim {d}) Pad it or change the CP degree.")
        moves.append((md, d, src, dst))
    return moves


def relayout(x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``x`` in other sequence layouts on the same mesh (e.g. ``[Striped(...)]`` -> ``[Shard(1)]``), by
    one all-to-all per changed mesh dim with O(shard) buffers -- never the full tensor."""
    install_sdpa_dispatch()  # See Note [SDPA dispatch]
    moves = layout_moves(x, placements)  # validated on every rank before any collective
    local = x.to_local()
    for md, d, src, dst in moves:
        local = _exchange(local, dim=d, seq_len=x.shape[d], src=src, dst=dst, group=(x.device_mesh, md))
    return DTensor.from_local(local, x.device_mesh, as_layout_placements(placements), run_check=False,
                              shape=x.shape, stride=x.stride())


def box_placements(placements: Sequence[Placement]) -> list[Placement]:
    """Every striped / head-tail placement as the contiguous ``Shard`` of its dim: a DCP box."""
    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]


def to_mesh(x: DTensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """``x`` on another mesh (e.g. another CP size) in ``placements`` of that mesh (build them with
    ``sequence_placement`` for the new CP size). Every rank of the default group must call it: the
    full tensor is gathered on ``x``'s mesh and broadcast from that mesh's first rank."""
    install_sdpa_dispatch()  # See Note [SDPA dispatch]
    src_ranks = x.device_mesh.mesh.flatten().tolist()
    if dist.get_rank() in src_ranks:
        full = full_tensor(x).contiguous()
    else:
        full = torch.empty(x.shape, dtype=x.dtype, device=mesh.device_type)
    dist.broadcast(full, src=src_ranks[0])
    placements = as_layout_placements(placements)
    coord = mesh.get_coordinate()
    local = full
    for md, p in enumerate(placements):
        if coord is None:  # outside the new mesh: an empty local shard, as DTensor does
            local = full.new_empty(0)
        elif isinstance(p, Shard | _StridedShard):
            local = p._select_split_tensor(local, mesh.size(md), coord[md], with_padding=False)
    return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=x.shape, stride=full.stride())
