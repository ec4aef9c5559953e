"""Checkpoints that reshard between CP sizes and layouts, crash-safe step directories, and safetensors
export of model weights -- all through torch.distributed.checkpoint (DCP), all in safetensors.

Note [Checkpointing layout shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP describes every saved piece of a tensor as one box (per-dim offsets and sizes) of the global
tensor, and reshards on load by intersecting boxes. A contiguous shard is a box; a striped shard
(positions r, r+P, ...) or a head-tail shard (chunks r and 2P-1-r) is not. DCP asks the DTensor for
its box (``compute_local_shape_and_global_offset``), which for a ``_StridedShard`` answers "first
position, local length": rank 0 and rank 1 of a striped tensor then claim overlapping boxes and
``dcp.save`` refuses ("Failed to validate global plan: ... overlapping chunks").

Ways out, and why we take the first:

* Convert before saving (taken). One all-to-all on the CP group turns each layout shard into the
  contiguous ``Shard(dim)`` shard of the same mesh -- a box -- and one turns it back after loading.
  Rank r sends each of its positions to the rank that holds it in the target layout; split sizes and
  orders come from layout.py's index maps, computed locally on S_local positions, so every buffer is
  one shard: per-rank memory and traffic are O(shard) and no rank ever holds the full tensor (DTensor's
  own ``redistribute`` between a strided placement and ``Shard`` gathers the full tensor first). The
  checkpoint then holds the tensor in natural order, one box per rank: it is the same checkpoint
  whatever layout or CP size saved it, any DCP reader loads it (into Shard, Replicate, plain tensors,
  or -- through us -- any layout at any CP size), and each rank writes exactly one box per tensor,
  which is what DCP's sharded safetensors files can hold (one entry per key per file).
* Several boxes per rank: head-tail is two boxes, but striped is S_local boxes of one position each
  -- O(N) metadata and reads -- and a safetensors file cannot hold two entries of one key.
* Layout coordinates (striped at P as box [:, r] of x.view(N/P, P, ...)): the stored shape depends on
  P and the layout, so a load at another P or layout still needs a strided read plus a local
  permutation, and the files are no longer the tensor other tools expect.
* Making plain ``dcp.save(state)`` work through DCP's hooks (``__create_write_items__``,
  ``__create_chunk_list__``, ``__get_tensor_shard__``): DTensor already implements them with the
  box above; changing that means patching DTensor's methods for everyone or wrapping every local
  shard in a tensor subclass. And the hooks cannot host the conversion: it is a collective, while
  DCP plans each rank locally and has no hook after the reads of a load. So conversion happens in
  ``save_sequence_sharded`` / ``load_sequence_sharded``, around ``dcp.save`` / ``dcp.load``.

Storage: DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` -- every rank writes its boxes to
its own safetensors file with the box offsets in the file's header, and ``HuggingFaceStorageReader``
rebuilds the global metadata from those headers. So loading reads safetensors only; DCP's default
``FileSystemReader`` unpickles a ``.metadata`` file. We do not enable its consolidation for sequence
state: consolidation has one rank rewrite every byte of every tensor.

Note [Crash-safe checkpoint directories]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``save_checkpoint`` writes step N into ``step-N.tmp``; when every rank has written (DCP's save ends with
a collective over all ranks' write results, and we add a barrier), rank 0 renames it to ``step-N`` and
fsyncs the parent. A rename within one file system is atomic, so a directory named ``step-N`` is
complete by construction and a save killed at any point leaves at worst a ``step-N.tmp``, which
``latest_checkpoint`` ignores and the next save of step N replaces. Assumes every rank sees the same
file system (as DCP itself does).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from .layout import layout_unit, local_positions
from .placement import as_layout_placements, placement_layout

__all__ = [
    "relayout",
    "save_sequence_sharded",
    "load_sequence_sharded",
    "save_checkpoint",
    "latest_checkpoint",
    "export_hf_safetensors",
    "load_hf_safetensors",
]


# ---- the O(shard) all-to-all between layouts; see Note [Checkpointing layout shards] ----

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
    to = _owners(dst, world, seq_len, local_positions(src, rank, world, seq_len))
    send = local.movedim(dim, 0).index_select(0, torch.argsort(to, stable=True).to(local.device))
    wanted = local_positions(dst, rank, world, seq_len)
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


def _layout_moves(x: DTensor, placements: Sequence[Placement]) -> list[tuple[int, int, str, str]]:
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
            if n % layout_unit(layout, cp):
                raise ValueError(f"{layout} layout on {cp} ranks needs the sequence length divisible by "
                                 f"{layout_unit(layout, cp)}; tensor dim {d} has {n}. Pad it or change the CP degree.")
        moves.append((md, d, src, dst))
    return moves


def relayout(x: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``x`` in other sequence layouts on the same mesh (e.g. ``[Striped(...)]`` -> ``[Shard(1)]``), by
    one all-to-all per changed mesh dim with O(shard) buffers -- never the full tensor."""
    moves = _layout_moves(x, placements)  # validated on every rank before any collective
    local = x.to_local()
    for md, d, src, dst in moves:
        local = _exchange(local, dim=d, seq_len=x.shape[d], src=src, dst=dst, group=(x.device_mesh, md))
    return DTensor.from_local(local, x.device_mesh, as_layout_placements(placements), run_check=False,
                              shape=x.shape, stride=x.stride())


def _box_placements(placements: Sequence[Placement]) -> list[Placement]:
    """Every striped / head-tail placement as the contiguous ``Shard`` of its dim: a DCP box."""
    return [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]


# ---- save / load of sequence-sharded state ----

def _sorted_items(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return sorted(state.items())  # one collective order on every rank, whatever the dict order


def save_sequence_sharded(state: Mapping[str, Tensor], path: str | os.PathLike, *, thread_count: int = 1) -> None:
    """Save ``state`` (DTensors in any layout, plain or replicated tensors) as sharded safetensors under
    ``path``, loadable at any CP size and layout by ``load_sequence_sharded``. Every rank calls it.
    Per-rank memory O(shard); see Note [Checkpointing layout shards]."""
    boxes = {}
    for key, value in _sorted_items(state):
        if not isinstance(value, Tensor):
            raise TypeError(f"save_sequence_sharded saves tensors only (safetensors); {key!r} is a "
                            f"{type(value).__name__}. Save other state separately.")
        if isinstance(value, DTensor):
            value = relayout(value, _box_placements(value.placements))
        boxes[key] = value
    writer = HuggingFaceStorageWriter(str(path), save_distributed=True, thread_count=thread_count)
    dcp.save(boxes, storage_writer=writer)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(reversed(stride))


def _empty_box(like: DTensor) -> DTensor:
    placements = _box_placements(as_layout_placements(like.placements))
    local_shape, _ = compute_local_shape_and_global_offset(like.shape, like.device_mesh, placements)
    device = like.device_mesh.device_type if like.is_meta else like.to_local().device
    local = torch.empty(local_shape, dtype=like.dtype, device=device)
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False, shape=like.shape,
                              stride=_contiguous_stride(like.shape))


def load_sequence_sharded(path: str | os.PathLike, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """New tensors for every key of ``like``, with its mesh, placements (any layout), shape and dtype,
    read from a checkpoint of ``save_sequence_sharded`` saved at any CP size and layout. Every rank
    calls it; ``like`` may live on the meta device. Reads only safetensors from ``path``: nothing in the
    files is unpickled (DCP pickles only its plans, exchanged between the ranks)."""
    buffers: dict[str, Tensor] = {}
    for key, value in _sorted_items(like):
        if isinstance(value, DTensor):
            _layout_moves(value, _box_placements(value.placements))  # validate before any collective
            buffers[key] = _empty_box(value)
        else:
            buffers[key] = torch.empty(value.shape, dtype=value.dtype, device="cpu" if value.is_meta else value.device)
    dcp.load(buffers, storage_reader=HuggingFaceStorageReader(str(path)))
    out = {}
    for key, value in _sorted_items(like):
        box = buffers.pop(key)  # dropped as we go: one extra shard at a time
        out[key] = relayout(box, value.placements) if isinstance(value, DTensor) else box
    return out


# ---- crash-safe step directories; see Note [Crash-safe checkpoint directories] ----

_STEP_DIR = re.compile(r"step-(\d+)")


def save_checkpoint(state: Mapping[str, Tensor], root: str | os.PathLike, *, step: int) -> str:
    """``save_sequence_sharded`` into ``root/step-{step}``, committed atomically after every rank wrote.
    Every rank calls it; returns the committed directory."""
    final = os.path.join(root, f"step-{step}")
    tmp = final + ".tmp"
    if step < 0:
        raise ValueError(f"step must be >= 0; got {step}.")
    if os.path.exists(final):  # the same answer on every rank: checked before any collective
        raise FileExistsError(f"checkpoint {final} exists; pick a new step or delete it.")
    is_leader = not dist.is_initialized() or dist.get_rank() == 0
    if is_leader and os.path.exists(tmp):  # left by a save that died
        shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()  # nobody writes into a directory that is being removed
    save_sequence_sharded(state, tmp)
    if dist.is_initialized():
        dist.barrier()  # every rank's files are written (and fsynced by DCP's writer)
    if is_leader:
        os.rename(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)  # make the rename itself durable
        finally:
            os.close(fd)
    if dist.is_initialized():
        dist.barrier()  # no rank returns before the commit
    return final


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The committed ``step-N`` directory under ``root`` with the largest N (``.tmp`` ones are partial
    saves and never count), or None."""
    if not os.path.isdir(root):
        return None
    steps = [int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.fullmatch(name))]
    return os.path.join(root, f"step-{max(steps)}") if steps else None


# ---- model weights as Hugging Face safetensors ----

def export_hf_safetensors(model_state: Mapping[str, Tensor], path: str | os.PathLike, *, adapter: Any = None) -> None:
    """Write a model state dict (plain, replicated or sharded tensors) as one Hugging Face safetensors
    checkpoint of full tensors under ``path``. ``adapter`` renames to HF names: anything with
    ``to_hf(state) -> state`` (and optionally ``fqn_to_index_mapping``), e.g. torchtitan's
    ``Llama3StateDictAdapter``. Every rank calls it."""
    state = adapter.to_hf(dict(model_state)) if adapter is not None else dict(model_state)
    mapping = getattr(adapter, "fqn_to_index_mapping", None)
    # each rank writes its share into path/sharded, then DCP consolidates full tensors into path
    writer = HuggingFaceStorageWriter(str(path), fqn_to_index_mapping=mapping, save_distributed=True,
                                      enable_consolidation=True)
    dcp.save(state, storage_writer=writer)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(os.path.join(path, "sharded"), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_hf_safetensors(model: torch.nn.Module, path: str | os.PathLike, *, adapter: Any = None) -> None:
    """Load an HF safetensors checkpoint into ``model`` (weights replicated over CP, or DTensors): each
    rank reads what it holds, with no collectives, and nothing is unpickled. ``adapter`` as in
    ``export_hf_safetensors``, plus ``from_hf``."""
    state = model.state_dict()
    hf_state = adapter.to_hf(state) if adapter is not None else state
    dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    if adapter is not None:
        model.load_state_dict(adapter.from_hf(hf_state), strict=True)
