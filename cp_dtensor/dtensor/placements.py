"""DTensor placements for the sequence layouts: the types, and reading a sharded tensor back.

Note [Layout placements]
~~~~~~~~~~~~~~~~~~~~~~~~
Each layout of layout.py is one DTensor placement on the CP mesh dimension:

* ``contiguous`` is torch's ``Shard(dim)``.
* ``striped`` is torch's own ``_StridedShard(dim, split_factor=N / P)``: split the N positions into
  N / P groups of P consecutive positions and give rank r the r-th of every group, i.e. positions
  r, r + P, r + 2P, ... -- exactly the striped layout. Because it *is* torch's placement, DTensor
  knows it everywhere: elementwise ops keep it, transposes and views renumber it, reductions and
  sequence-mixing ops redistribute it correctly. ``Striped(dim, seq_len=N, cp_size=P)`` builds it; the
  split factor depends on N, so a striped placement belongs to one sequence length.
* ``headtail`` (rank r holds chunks r and 2P-1-r) is no ``_StridedShard`` of any split factor, so it
  needs a placement of its own: ``HeadTail(dim)``. See Note [HeadTail placement].

Note [HeadTail placement]
~~~~~~~~~~~~~~~~~~~~~~~~~
DTensor in torch 2.13 has no extension point for new placements, so ``HeadTail`` is the soundest
thing available rather than a perfect one:

* A custom ``Placement`` that is neither shard, replicate nor partial is read as *replicated* by the
  sharding propagation (``DTensorSpec.dim_map``): ``x.sum()`` would be silently wrong. Rejected.
* A ``Shard`` subclass fails ``DTensorSpec``'s shard-order check, and if made to pass it would compare
  equal to ``Shard`` and be redistributed as contiguous: silently wrong. Rejected.
* ``HeadTail`` subclasses ``_StridedShard`` with the impossible split factor -1. Redistribution calls
  the placement's own methods (``_to_replicate_tensor``, ``_replicate_to_strided_shard``,
  ``_split_tensor``, ``local_shard_size_and_offset``), which ``HeadTail`` overrides with the head-tail
  index math of layout.py; shape logic treats it as a shard of the sequence dim, so reductions over the
  sequence become ``Partial`` and sequence-mixing ops gather it first -- correct for any permutation.

The catch: torch's propagation rules rebuild strided placements as plain
``_StridedShard(new_dim, split_factor=old.split_factor)`` whenever they renumber dims (transpose,
unsqueeze, broadcasting) or pick a target for an operand (``ht * replicated``). The rebuilt placement
keeps split factor -1, compares equal to ``HeadTail``, and so still *means* head-tail -- but has
torch's methods, which fail loudly on split factor -1 ("Expected num_chunks > 0, got -1") rather than
move data wrongly. ``install_headtail_propagation`` therefore wraps the sharding propagator's entry
points (an instance attribute of DTensor's dispatcher, installed at ``import cp_dtensor``) to turn
every plain ``_StridedShard(d, sf=-1)`` in their results back into ``HeadTail(d)``: same meaning,
right methods. Rules that would do arithmetic on the split factor (views that split or merge the
sequence dim with another) reject -1 and raise; so do rules that rebuild the placement and use its
methods inside propagation, before we see the result (``expand`` of a head-tail tensor). ``distribute_tensor`` bypasses propagation and
rebuilds a plain placement: it raises for ``HeadTail``; ``shard_sequence`` creates head-tail tensors.
The wrap is installed when the first ``HeadTail`` is made (not at import: Note [SDPA dispatch] in
dtensor/sdpa.py says what the package patches, and when).
So head-tail is never silently wrong; where torch cannot carry it, it raises.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement

from .._compat import (
    DTensorSpec,
    _StridedShard,
    _StridedShardOffsetMode,
    all_gather_single,
    plan_strided_redistributions,
    strided_offset_mode,
    wrap_sharding_propagation,
)
from .._deprecated import old_keywords, warn_once
from ..core.plan.layout import check_seq_len, global_order, local_positions, shard_tensor

__all__ = [
    "HeadTail",
    "Striped",
    "sequence_placement",
    "placement_layout",
    "as_layout_placements",
    "full_tensor",
    "install_headtail_propagation",
]

_HEADTAIL_SF = -1  # See Note [HeadTail placement]

# Note [No document placement]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A document layout (core/plan/documents.py) is a per-batch, per-row permutation of the sequence, so no
# placement can carry it: a placement is one rule for every tensor of every batch, and DTensor's
# propagation, redistribution and the SDPA rule read layouts from placements alone (Note [Layout
# placements]). A DTensor placement would also have to hold the batch's ids and exchange plan, which
# torch's placements (hashed, compared and cached by value) cannot. So the DTensor path refuses it by
# name, with the same arguments -- so on every rank, before any communication -- and says where the
# document layout lives: ring_attention with a plan, or the doors that build one per batch.
DOCUMENTS_REFUSED = (
    "the DTensor path has no document layout (got layout={layout}): a DocumentLayout is a per-batch placement "
    "that no DTensor placement carries (Note [No document placement]). Use ring_attention(q, k, v, layout=plan) "
    "on local shards with plan = cp_dtensor.document_layout(ids, P), or a door that builds the plan per batch: "
    "cp_dtensor.apply_context_parallel(model, mesh, layout='documents') or "
    "cp_dtensor.context_parallel(mesh, ..., layout='documents', document_ids=ids).")


class HeadTail(_StridedShard):
    """Head-tail sequence sharding of tensor dim ``dim``: rank r of P holds chunks r and 2P-1-r of 2P.
    See Note [HeadTail placement]."""

    def __init__(self, dim: int) -> None:
        if dim < 0:
            raise ValueError(f"HeadTail needs a non-negative tensor dim (torch renormalises negative ones "
                             f"into a plain _StridedShard); got {dim}. Pass dim % x.ndim.")
        super().__init__(dim, split_factor=_HEADTAIL_SF)
        install_headtail_propagation()  # where head-tail tensors exist, propagation keeps them (idempotent)

    def __repr__(self) -> str:
        return f"HeadTail(dim={self.dim})"

    def __str__(self) -> str:
        return f"HT({self.dim})"

    def _split_tensor(self, tensor, num_chunks, *, with_padding=True, contiguous=True):
        shards = [shard_tensor(tensor, seq_dim=self.dim, layout="headtail", rank=r, cp_size=num_chunks)
                  for r in range(num_chunks)]
        if contiguous:
            shards = [s.contiguous() for s in shards]
        return shards, ([0] * num_chunks if with_padding else [])

    def _select_split_tensor(self, tensor, num_chunks, index, *, with_padding=True, contiguous=True, clone=True):
        return shard_tensor(tensor, seq_dim=self.dim, layout="headtail", rank=int(index), cp_size=num_chunks).contiguous()

    def _replicate_to_strided_shard(self, local_tensor, mesh, mesh_dim, shard_index):
        return self._select_split_tensor(local_tensor, mesh.size(mesh_dim), shard_index)

    def _to_replicate_tensor(self, local_tensor, mesh, mesh_dim, current_logical_shape):
        # every rank's shard, rank-major: x.index_select(dim, order); argsort(order) undoes it
        world, seq_len = mesh.size(mesh_dim), int(current_logical_shape[self.dim])
        gathered = all_gather_single(local_tensor.contiguous(), self.dim, (mesh, mesh_dim))
        if isinstance(gathered, funcol.AsyncCollectiveTensor):
            gathered = gathered.wait()
        undo = torch.argsort(global_order("headtail", world, seq_len)).to(gathered.device)
        return gathered.index_select(self.dim, undo)

    def local_shard_size_and_offset(self, curr_local_size, num_chunks, rank, *mode, **mode_kw):
        # mode: offset_mode (torch 2.13+) or return_first_offset (2.11); Note [torch 2.11 to 2.15] in _compat/torch_versions.py
        positions = local_positions(layout="headtail", rank=int(rank), cp_size=num_chunks, seq_len=int(curr_local_size))
        mode = strided_offset_mode(*mode, **mode_kw)
        if mode is _StridedShardOffsetMode.NONE:
            return len(positions), None
        offsets = positions.tolist()
        return len(positions), (offsets[0] if mode is _StridedShardOffsetMode.FIRST else offsets)

    def _local_shard_size_and_offset(self, curr_local_size, num_chunks, rank, *mode, **mode_kw):
        return self.local_shard_size_and_offset(curr_local_size, num_chunks, rank, *mode, **mode_kw)


@old_keywords("cp_dtensor.Striped", cp="cp_size")
def Striped(dim: int, *, seq_len: int, cp_size: int) -> _StridedShard:  # noqa: N802 -- reads as a placement
    """The striped layout of a length-``seq_len`` tensor dim ``dim`` over ``cp_size`` ranks: torch's
    ``_StridedShard(dim, split_factor=seq_len // cp_size)``. See Note [Layout placements]."""
    plan_strided_redistributions()  # torch 2.11 only: Note [torch 2.11 to 2.15] in _compat/torch_versions.py
    return _StridedShard(dim, split_factor=check_seq_len("striped", cp_size, seq_len))


def _layout_first(fn):
    """``sequence_placement``'s old order ``(layout, dim, ...)`` still works, warning once."""

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        if args and isinstance(args[0], str):
            warn_once("cp_dtensor.sequence_placement(layout, dim, ...)", "cp_dtensor.sequence_placement(dim, layout=...)")
            kwargs = {**kwargs, "layout": args[0]}
            args = args[1:]
        return fn(*args, **kwargs)

    return inner


@_layout_first
@old_keywords("cp_dtensor.sequence_placement", cp="cp_size")
def sequence_placement(dim: int, *, layout: str, seq_len: int, cp_size: int) -> Placement:
    """The placement of ``layout`` for tensor dim ``dim`` (non-negative) of length ``seq_len`` on ``cp_size``
    ranks. A document layout has none: see Note [No document placement]."""
    if layout == "documents" or not isinstance(layout, str):
        raise ValueError(DOCUMENTS_REFUSED.format(layout=layout if isinstance(layout, str) else type(layout).__name__))
    check_seq_len(layout, cp_size, seq_len)
    if layout == "contiguous":
        return Shard(dim)
    return Striped(dim, seq_len=seq_len, cp_size=cp_size) if layout == "striped" else HeadTail(dim)


def placement_layout(p: Placement, *, seq_len: int, cp: int) -> str | None:
    """Which layout ``p`` shards its dim in (None: not a sequence layout, e.g. Replicate or Partial).
    Raises for a strided placement that is no layout of ours (e.g. FSDP's nested sharding)."""
    if type(p) is Shard:
        return "contiguous"
    if isinstance(p, _StridedShard):
        if p.split_factor == _HEADTAIL_SF:
            return "headtail"
        if p.split_factor * cp == seq_len:
            return "striped"
        raise ValueError(f"{p!r} on {cp} ranks over a length-{seq_len} dim is not a sequence layout "
                         f"(striped would be split_factor={seq_len // cp}). Redistribute to Shard, "
                         "Striped or HeadTail first.")
    return None


def as_layout_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with every plain ``_StridedShard(d, sf=-1)`` turned back into ``HeadTail(d)``.
    See Note [HeadTail placement]."""
    return tuple(HeadTail(p.dim) if isinstance(p, _StridedShard) and p.split_factor == _HEADTAIL_SF
                 else p for p in placements)


def full_tensor(x: DTensor) -> torch.Tensor:
    """``x.full_tensor()``, also after a dim-renumbering op left a plain strided head-tail placement
    (see Note [HeadTail placement])."""
    fixed = as_layout_placements(x.placements)
    if any(type(a) is not type(b) for a, b in zip(fixed, x.placements)):
        x = DTensor.from_local(x.to_local(), x.device_mesh, fixed, run_check=False, shape=x.shape, stride=x.stride())
    return x.full_tensor()


def _restore_headtail(result: object) -> object:
    """Turn plain ``_StridedShard(d, sf=-1)`` back into ``HeadTail(d)`` in an ``OutputSharding``'s specs
    (in place; equal placements, so caches keyed on them are unaffected)."""
    def fix(obj: object) -> None:
        if isinstance(obj, DTensorSpec):
            if any(type(p) is _StridedShard and p.split_factor == _HEADTAIL_SF for p in obj.placements):
                obj.placements = as_layout_placements(obj.placements)
        elif isinstance(obj, list | tuple):
            for o in obj:
                fix(o)

    fix(getattr(result, "output_spec", None))
    schema = getattr(result, "redistribute_schema", None)
    if schema is not None:
        fix(schema.args_schema)
        fix(list(schema.kwargs_schema.values()))
    return result


def install_headtail_propagation() -> None:
    """Keep ``HeadTail`` through DTensor's sharding propagation (idempotent); see Note [HeadTail placement]."""
    wrap_sharding_propagation(_restore_headtail)
    plan_strided_redistributions()  # torch 2.11 only: Note [torch 2.11 to 2.15] in _compat/torch_versions.py
