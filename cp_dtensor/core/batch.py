"""A batch's share on each CP rank, as plain local tensors: ``shard_batch`` and its inverse
``unshard_batch``, and the document ids of packed sequences from position ids that restart at 0.

A batch is a tensor, or a tuple / list / dict of tensors that share one sequence length along
``seq_dim``; the result has the same structure. Every rank passes the same full tensors to
``shard_batch`` (no communication); ``unshard_batch`` gathers every rank's shard (one all-gather per
tensor, differentiable).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .._compat import all_gather_single, all_gather_single_autograd
from .._deprecated import old_keywords, warn_once
from .agreement import Rules, agree_objects
from .checks import check_cp_mesh
from .dynamic import shard_dynamic
from .plan.layout import check_layout, check_seq_len, global_order, layout_unit, shard_tensor, unshard_tensor, wrap_dim

__all__ = ["document_ids_from_positions", "shard_batch", "unshard_batch"]

Batch = Any  # a Tensor, or a tuple / list / dict of Tensors


def _leaves(batch: Batch, where: str) -> list[tuple[str, Tensor]]:
    if isinstance(batch, Tensor):
        return [("", batch)]
    items = batch.items() if isinstance(batch, dict) else enumerate(batch) if isinstance(batch, (tuple, list)) else None
    if items is None:
        raise TypeError(f"{where} takes a tensor, or a tuple / list / dict of tensors; got {type(batch).__name__}.")
    out = []
    for key, t in items:
        if not isinstance(t, Tensor):
            raise TypeError(f"{where}: every entry of the batch must be a tensor; entry {key!r} is "
                            f"{type(t).__name__}. Take it out of the batch before sharding.")
        out.append((f"[{key!r}]", t))
    return out


def _rebuild(batch: Batch, fn: Callable[[Tensor], Tensor]) -> Batch:
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, fn(t)) for k, t in batch.items())
    return type(batch)(fn(t) for t in batch)


def _check(batch: Batch, mesh: DeviceMesh, seq_dim: int, layout: str, where: str, *, local: bool) -> int:
    """The sequence length (local or full) every tensor shares; raises alike on every rank (no collective:
    every rank holds the same full batch, or shards of it that have the same shapes)."""
    check_cp_mesh(mesh)
    if isinstance(layout, str):
        check_layout(layout)
    leaves = _leaves(batch, where)
    if not leaves:
        raise ValueError(f"{where} got an empty batch.")
    lengths = {}
    for key, t in leaves:
        if not -t.dim() <= seq_dim < t.dim():
            raise ValueError(f"{where}: seq_dim={seq_dim} is out of range for batch{key} of shape {tuple(t.shape)}.")
        lengths.setdefault(t.shape[seq_dim], key)
    if len(lengths) != 1:
        raise ValueError(f"{where} needs one sequence length along seq_dim={seq_dim}; got "
                         f"{', '.join(f'{n} (batch{k})' for n, k in lengths.items())}.")
    n = next(iter(lengths))
    if not isinstance(layout, str):  # a DocumentLayout (cp_dtensor.document_layout): built for this batch
        layout.check(mesh.size(), n * mesh.size() if local else n)
    elif not local:
        check_seq_len(layout, mesh.size(), n, fix=f"Pad the batch to a multiple of {layout_unit(layout, mesh.size())}.")
    return n


def shard_batch(batch: Batch, mesh: DeviceMesh | None = None, *more: Tensor, seq_dim: int = 1,
                layout: str = "striped", dynamic: bool = False, document_ids: Tensor | None = None,
                position_ids: Tensor | None = None, windows: Any = None) -> Batch:
    """This rank's share of a full batch (inputs, labels, positions, ...): each tensor sharded alike along
    ``seq_dim`` in ``layout`` over the 1-D CP mesh ``mesh``. Same structure out as in.

        tokens, labels, positions = cp_dtensor.shard_batch((tokens, labels, positions), cp_mesh)
        batch = cp_dtensor.shard_batch({"input_ids": ids, "labels": lab}, cp_mesh)

    Every rank passes the same full tensors; no communication. ``unshard_batch`` is the inverse.
    (The old call ``shard_batch(cp_mesh, *tensors)`` still works and returns a tuple; it warns once.)

    ``dynamic=True`` (with ``layout="documents"``): one plan of the *global* batch over every rank of the
    (dp, cp) mesh ``mesh`` (or its flattened 1-D group), from this dp rank's rows ``batch`` ([B, N, ...]
    each) and their documents (``document_ids=`` or ``position_ids=`` [B, N]; ``windows=``: the layers'
    window sizes). Returns a :class:`~cp_dtensor.core.dynamic.DynamicBatch` ``(batch, plan, mesh)``: this
    rank's tokens ([1, B * N / cp, ...] each, moved by one all-to-all of token ids), the plan to pass to
    the attention (``cp_layout=plan``) and the flattened mesh it runs over. See Note [One plan over the grid].
    """
    if dynamic:
        if more or isinstance(batch, DeviceMesh):
            raise TypeError("shard_batch(dynamic=True) takes the batch, then the mesh: shard_batch(batch, mesh, ...).")
        return shard_dynamic(batch, mesh, leaves=_leaves(batch, "shard_batch(dynamic=True)"), rebuild=_rebuild,
                             seq_dim=seq_dim, layout=layout, document_ids=document_ids, position_ids=position_ids,
                             windows=windows)
    if document_ids is not None or position_ids is not None or windows is not None:
        raise TypeError("shard_batch: document_ids=, position_ids= and windows= go with dynamic=True; a fixed layout "
                        "shards by its plan: shard_batch(batch, mesh, layout=cp_dtensor.document_layout(ids, cp)).")
    if isinstance(batch, DeviceMesh):  # the old order: shard_batch(cp_mesh, *tensors)
        warn_once("cp_dtensor.shard_batch(cp_mesh, *tensors)", "cp_dtensor.shard_batch((t1, t2, ...), cp_mesh)")
        batch, mesh = (() if mesh is None else (mesh,)) + more, batch
        batch = tuple(batch)
    elif more:
        raise TypeError("shard_batch takes one batch (a tensor, or a tuple / list / dict of tensors) and the mesh: "
                        "shard_batch((tokens, labels), cp_mesh).")
    if mesh is None:
        raise TypeError("shard_batch() missing the CP mesh: shard_batch(batch, cp_mesh).")
    _check(batch, mesh, seq_dim, layout, "shard_batch", local=False)
    cp, rank = mesh.size(), mesh.get_local_rank()
    return _rebuild(batch, lambda t: shard_tensor(t, seq_dim=seq_dim, layout=layout, rank=rank, cp_size=cp).contiguous())


def unshard_batch(batch: Batch, mesh: DeviceMesh, *, seq_dim: int = 1, layout: str = "striped") -> Batch:
    """The full tensors, in original order, from every rank's shard (the inverse of ``shard_batch``; one
    all-gather per tensor, differentiable). Same structure out as in.

    Every rank's shards must have the same shapes and dtypes: the ranks compare them first (one small
    host all-gather; skipped while ``torch.compile`` traces) and every rank raises a ``ValueError`` naming
    each rank's shapes otherwise -- never a collective of mismatched sizes."""
    check_cp_mesh(mesh)
    error = None
    try:
        _check(batch, mesh, seq_dim, layout, "unshard_batch", local=True)
    except (TypeError, ValueError) as e:  # raised below on every rank, alike
        error = str(e)
    agree_local_shapes(batch if error is None else None, mesh, error, what="unshard_batch")
    return gather_shards(batch, mesh, seq_dim=seq_dim, layout=layout)


def _shapes(batch: Batch | None, name: str) -> str:
    if batch is None:
        return "?"
    return ", ".join(f"{name + key + ' ' if key else ''}{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                     for key, t in _leaves(batch, "unshard_batch"))


def agree_local_shapes(batch: Batch | None, mesh: DeviceMesh, error: str | None, *, what: str,
                       also: dict[str, Any] | None = None, name: str = "batch") -> None:
    """Every rank raises alike -- this rank's ``error``, or unequal shard shapes / dtypes, each rank's
    named -- before the all-gathers of :func:`gather_shards` (whose mismatched sizes would abort gloo or
    hang NCCL); ``also``: more fields that must be equal (the caller's options). Nothing to compare while
    Dynamo traces: compiled code holds one rank's static shapes."""
    if torch.compiler.is_compiling():
        if error is not None:
            raise ValueError(error)
        return
    also = also or {}
    rules = Rules(what, ("local shapes", *also), advice="Every rank must pass its shard of the same full tensors "
                  "(equal local lengths: shard them with cp_dtensor.shard_batch(batch, cp_mesh) or "
                  "context_parallel, in the same layout).")
    agree_objects(rules, (_shapes(batch, name), *also.values()), error, mesh.get_group())


def gather_shards(batch: Batch, mesh: DeviceMesh, *, seq_dim: int = 1, layout: str = "striped") -> Batch:
    """:func:`unshard_batch` once the ranks agreed on the shapes (:func:`agree_local_shapes`)."""
    cp = mesh.size()

    def gather(x: Tensor) -> Tensor:
        dim = wrap_dim(seq_dim, x.dim())
        every = all_gather_single_autograd(x.contiguous(), dim, mesh)
        return unshard_tensor(list(every.chunk(cp, dim=dim)), seq_dim=dim, layout=layout)

    return _rebuild(batch, gather)


@old_keywords("cp_dtensor.document_ids_from_positions", cp_mesh="mesh")
def document_ids_from_positions(positions: Tensor, mesh: DeviceMesh, *, layout: str = "striped") -> Tensor:
    """Document ids [B, S_local] of this rank's tokens from their position ids [B, S_local] (or [1, S_local])
    that restart at 0 for every document: a document starts at every position 0 of the *global* sequence,
    so one all-gather of the start flags (one byte per token) gives every rank the global count."""
    check_cp_mesh(mesh)
    ids = full_ids_from_positions(positions, mesh, layout=layout)
    return shard_tensor(ids, seq_dim=1, layout=layout, rank=mesh.get_local_rank(), cp_size=mesh.size()).contiguous()


def full_ids_from_positions(positions: Tensor, mesh: DeviceMesh, *, layout: str = "striped") -> Tensor:
    """The *full* batch's document ids [B, N] (the same on every rank) from this rank's ``layout`` shard of
    position ids [B, S_local] that restart at 0 for every document: one all-gather of the start flags (one
    byte per token). What a door that gets sharded positions builds its plan from (Note [One plan per
    batch] in documents.py)."""
    cp = mesh.size()
    starts = (positions == 0).to(torch.uint8).contiguous()  # [B, S_local]
    every = all_gather_single(starts, 0, mesh).view(cp, *starts.shape)
    b, s = starts.shape
    full = torch.empty(b, cp * s, dtype=torch.int64, device=positions.device)
    full[:, global_order(layout, cp, cp * s).to(positions.device)] = every.permute(1, 0, 2).reshape(b, cp * s).long()
    return full.cumsum(1)
