"""torch's context-parallel API -- ``context_parallel`` / ``context_parallel_unshard``, torch's arguments and
semantics -- with its attention run by cp_dtensor's ring, on CPU (gloo) and CUDA (NCCL).

Note [torch's context_parallel on the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's ``torch.distributed.tensor.experimental.context_parallel(mesh, buffers=, buffer_seq_dims=,
no_restore_buffers=)`` (torch 2.13-2.15) opens a context that (1) shards each buffer IN PLACE along its
sequence dim -- ``resize_`` then ``copy_``: the same tensor object holds this rank's shard, head-tail
load balanced -- and restores it on exit (``resize_`` + ``copy_`` from a clone taken at entry) unless it
is in ``no_restore_buffers``; (2) monkey-patches ``F.scaled_dot_product_attention`` so that a call on
those shards becomes its ring over DTensor: flash / efficient / cuDNN kernels, so CUDA only, causal or
no mask, head-tail only. ``context_parallel_unshard(mesh, buffers, seq_dims)`` all-gathers shards and
puts them back in order. Both run under ``no_grad``.

``context_parallel`` here keeps (1)'s semantics and replaces (2):

* Buffers: the same tensor objects hold this rank's shard while the context is open and the full tensor
  again on exit, in ``layout`` ("striped" by default, "headtail" is torch's order, "contiguous"). Each
  buffer swaps its memory rather than writing into it (Note [Buffers swap their storage]): overlapping
  views of one tensor (q, k, v of a packed qkv) are exact and their base never changes. Every buffer is
  one sequence of N tokens along its seq dim (N the same for all: a RoPE table is sliced to N first). A
  leaf that requires grad is sharded and restored too (torch's ``resize_`` refuses it). Its ``.grad``
  is left as is on exit -- after a backward inside the context, the gradient of this rank's shard,
  which ``context_parallel_unshard`` turns into the full gradient (torch's own tests do exactly this).
* SDPA: while the context is open a ``TorchFunctionMode`` (nn/sdpa_mode.py's ``RingSDPA``, Note [Module
  context parallel]) turns each ``F.scaled_dot_product_attention`` on plain tensors into
  ``ring_attention`` on the same shards, forward and backward: ``is_causal``, ``scale``,
  ``enable_gqa``; q, k, v [B, H, S_local, D] (seq dim 2, as torch's). A mode rather than a patch: a
  reference to the function taken before the context opened is routed too, and ``torch.compile`` traces
  through it (Dynamo guards on the mode stack, so a function compiled outside recompiles inside).
* Masks: ``is_causal``, and the options torch does not have, fixed for the context: ``window_size``;
  documents from ``document_ids`` or from ``position_ids`` that restart at 0 -- both full [B | 1, N]
  tensors (they may be buffers too), read at entry, so no communication. An ``attn_mask``, dropout,
  ``enable_gqa=False`` with fewer K/V heads, or a call from transformers' own attention code (its mask
  was built from local shapes: Note [transformers under CP] in hf/attention.py) raises on every rank
  through the ring's agreement (Note [Agreeing before the ring] in core/checks.py), before any K/V
  moves. ``nn.MultiheadAttention``'s SDPA is routed too (Note [SDPA inside multi_head_attention_forward]
  in _compat/__init__.py); ``flex_attention`` is refused.
* Entry: every argument is checked locally, then one small all-gather (``core.agreement.agree_on_call``)
  makes every rank raise alike, before any buffer changes -- torch raises on the rank it fails on only.
* Nothing changes outside the context: no global option is set (torch's sets ``_cp_options`` and its
  dispatch mode); on exit, an exception included, the mode is popped and the buffers restored.
  ``set_rotate_method`` is accepted and ignored: the exchange is ``kv_exchange=`` of each context.

``context_parallel_unshard`` is the inverse of the layout: the full tensors, in order, on every rank.

Packed documents go through the batch's plan (Note [One plan per batch] in core/plan/documents.py): at entry
``plan_batch`` turns ``document_ids`` / ``position_ids`` (the full batch's) into one ``DocumentLayout`` --
``layout="documents"`` places the documents themselves (short ones whole on a rank), a layout name keeps
its order and carries the ids -- and every SDPA call of the context gets it as its ``layout``. Under
``layout="documents"`` the buffers are sharded and ``context_parallel_unshard`` unshards by the plan,
which the context yields (``with context_parallel(...) as plan``); its key joins the entry agreement, so
ids that differ across ranks raise on every rank before any buffer changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .core.agreement import agree_on_call
from .core.batch import agree_local_shapes, gather_shards
from .core.checks import check_cp_mesh, local_error
from .core.plan.documents import DocumentLayout, full_document_ids, plan_batch
from .core.plan.layout import LAYOUTS, layout_unit, shard_tensor
from .nn.sdpa_mode import RingSDPA

__all__ = ["context_parallel", "context_parallel_unshard", "set_rotate_method"]

_ROTATE_METHODS = ("allgather", "alltoall")


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh,
    *,
    buffers: Sequence[Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[Tensor] | None = None,
    layout: str | DocumentLayout = "striped",
    document_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    comm_dtype: torch.dtype | None = None,
    kv_exchange: str = "ring",
) -> Iterator[None]:
    """torch's ``context_parallel`` on cp_dtensor's ring (Note [torch's context_parallel on the ring]).

    While open: each of ``buffers`` (inputs, labels, positions, a RoPE table...) holds, in place, this
    rank's ``layout`` shard along its ``buffer_seq_dims`` entry, and ``F.scaled_dot_product_attention``
    on plain [B, H, S_local, D] shards runs as exact ring attention over ``mesh`` (1-D, the CP group).
    On exit every buffer not in ``no_restore_buffers`` is the full tensor again.

    Beyond torch's arguments, all fixed for the context and the same on every rank:

    * ``layout``: "striped" (default), "headtail" (torch's order) or "contiguous". ``context_parallel_unshard``
      needs the same. ``"documents"``: packed documents placed per batch from ``document_ids`` /
      ``position_ids`` (short ones whole on a rank, long ones in head-tail pieces); the buffers are then
      ``[B | 1, ...]`` with B the ids' rows (a table of ``[1, N]`` ids' plan shards anything along its seq
      dim). The context yields the batch's plan -- ``with context_parallel(...) as plan`` -- for
      ``context_parallel_unshard(..., layout=plan)``; a plan built beforehand (``cp_dtensor.document_layout``)
      is accepted as ``layout`` too. See Note [One plan per batch] in core/plan/documents.py.
    * ``document_ids``: full [B, N] (or [1, N], [N]) ids that never decrease: a query attends only to keys
      of its own document (packed sequences). ``position_ids``: full position ids restarting at 0 for
      every document, the documents derived from them (the Hugging Face packed-sequence convention).
    * ``window_size=(left, right)``: query i attends keys i - left <= j <= i + right (-1: unbounded);
      a model's window W of "the last W tokens, itself included" is ``(W - 1, 0)``.
    * ``comm_dtype``, ``kv_exchange``: as for ``ring_attention``.

    A call the ring cannot serve exactly -- an ``attn_mask``, ``dropout_p > 0`` -- raises ``ValueError``
    on every rank. Every rank raises alike, too, for bad arguments, before any buffer changes.

    Yields the batch's plan: a ``DocumentLayout`` when the context has documents (or ``layout`` is
    "documents"), else the layout name -- what ``context_parallel_unshard(..., layout=)`` takes.
    """
    check_cp_mesh(mesh)
    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    no_restore = set() if no_restore_buffers is None else no_restore_buffers
    error = _entry_error(mesh, buffers, dims, no_restore, layout, document_ids, position_ids, window_size,
                         comm_dtype, kv_exchange)
    rank, world = mesh.get_local_rank(), mesh.size()
    plan = None if error is None else layout
    if error is None:  # See Note [One plan per batch] in core/plan/documents.py
        try:
            plan = plan_batch(layout, world, document_ids=document_ids, position_ids=position_ids,
                              windows=None if window_size is None else [tuple(window_size)], where="context_parallel")
        except ValueError as e:
            error = str(e)
        else:
            error = _plan_error(plan, buffers, dims, world, document_ids, position_ids)
    n = buffers[0].shape[dims[0]] if error is None and buffers else -1
    names = (*LAYOUTS, "documents")
    agree_on_call(error, {"sequence length": n, "layout": names.index(layout) if layout in names else -1,
                          "number of buffers": len(buffers), "plan": plan.key if isinstance(plan, DocumentLayout) else -1},
                  mesh.get_group(), what="context_parallel")
    planned = isinstance(plan, DocumentLayout)
    by = plan if planned and plan.placement == "documents" else plan.placement if planned else layout  # buffers' order
    mode = RingSDPA(mesh, plan.placement if planned else layout, None if window_size is None else tuple(window_size),
                    None, comm_dtype=comm_dtype, kv_exchange=kv_exchange)
    mode.plan = plan if planned else None  # every SDPA call of the context gets it (Note [A plan at the model door])
    with torch.no_grad():
        # See Note [Buffers swap their storage]: every shard is cut before any buffer changes
        kept = [None if any(b is x for x in no_restore) else _memory(b) for b in buffers]
        shards = [shard_tensor(b, seq_dim=d, layout=by, rank=rank, cp_size=world).clone() for b, d in zip(buffers, dims)]
        for b, shard in zip(buffers, shards):
            b.set_(shard)
    try:
        with mode:
            yield plan
    finally:
        with torch.no_grad():
            for b, memory in zip(buffers, kept):
                if memory is not None:
                    b.set_(*memory)


def _plan_error(plan, buffers, dims, world: int, document_ids, position_ids) -> str | None:
    """This rank's problem with the context's plan (a ``DocumentLayout``; a layout name has none here): the
    buffers must be shardable by it, a plan given as ``layout`` must be of these ids."""
    if not isinstance(plan, DocumentLayout):
        return None
    if plan.cp_size != world:
        return (f"context_parallel: the plan was built for {plan.cp_size} ranks; the CP mesh has {world}. Build it "
                f"with cp_dtensor.document_layout(ids, {world}).")
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if b.shape[d] != plan.seq_len:
            return (f"context_parallel: the plan covers {plan.seq_len} tokens; buffer {i} has {b.shape[d]} along "
                    f"its seq dim {d}. Pass the full sequence.")
        if plan.placement == "documents" and plan.batch > 1 and (d % b.dim() == 0 or b.shape[0] != plan.batch):
            return (f"context_parallel(layout='documents'): each of the {plan.batch} rows has its own placement, so "
                    f"every buffer is [{plan.batch}, ..., N, ...] (batch first, seq dim after it); buffer {i} has "
                    f"shape {tuple(b.shape)} with seq dim {d}. Pass [1, N] ids for rows packed alike, or give "
                    "such buffers (a RoPE table) their batch dim.")
    given = full_document_ids(document_ids=document_ids, position_ids=position_ids, where="context_parallel")
    if given is not None and (tuple(given.shape) not in ((1, plan.seq_len), tuple(plan.ids.shape))
                              or not torch.equal(given.to("cpu", torch.int64).expand_as(plan.ids), plan.ids)):
        return ("context_parallel: the plan passed as layout= was built from other document ids than the "
                "document_ids / position_ids given; build it from this batch's ids, or pass only one of them.")
    return None


# Note [Buffers swap their storage]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch shards a buffer with ``resize_`` + ``copy_`` into its own storage and restores it from a clone. That
# is wrong for views: q, k, v = qkv[:, :, i].transpose(1, 2) of one [B, N, 3, H, D] tensor, or q, k =
# x[..., :D], x[..., D:], share one storage, so writing q's shard (contiguous, from q's storage offset) lands
# on k's elements and on the base tensor's, and restoring q copies back q's elements only. Here a buffer
# keeps its Python object but swaps its memory: ``set_`` points it at a fresh tensor holding this rank's
# shard (cut from every buffer's full values before any buffer changes), and on exit ``set_`` points it back
# at its own storage, offset, sizes and strides -- untouched meanwhile. So overlapping views are exact, the
# base tensor never changes (a buffer in ``no_restore_buffers`` keeps its shard in its own memory), and no
# full clone is taken. Under no_grad ``set_`` is allowed on a leaf that requires grad; its ``.grad`` after a
# backward inside the context is the shard's gradient, kept as is on exit (torch's behaviour).


def _memory(buffer: Tensor) -> tuple:
    """What ``set_`` needs to point ``buffer`` back at its own memory: storage, offset, sizes, strides."""
    return buffer.untyped_storage(), buffer.storage_offset(), buffer.shape, buffer.stride()


def _entry_error(mesh, buffers, dims, no_restore, layout, document_ids, position_ids, window_size, comm_dtype,
                 kv_exchange) -> str | None:
    """This rank's first problem with ``context_parallel``'s arguments, or None (raised on every rank)."""
    documents = layout == "documents" or isinstance(layout, DocumentLayout)
    if not documents and layout not in LAYOUTS:
        return (f"context_parallel: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}, 'documents' "
                "or a plan (cp_dtensor.document_layout).")
    if documents and (comm_dtype is not None or kv_exchange != "ring"):
        return (f"context_parallel(layout='documents') sends each needed K/V row once in its own dtype (Note "
                f"[Document exchange]); got comm_dtype={comm_dtype}, kv_exchange={kv_exchange!r}. Drop them, or "
                "use a layout name.")
    if len(buffers) != len(dims):
        return (f"context_parallel: buffer_seq_dims must give one sequence dim per buffer; got {len(buffers)} "
                f"buffers and {len(dims)} dims.")
    for b in no_restore:
        if not any(b is x for x in buffers):
            return "context_parallel: no_restore_buffers must be a subset of buffers (the same tensor objects)."
    lengths = []
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if not isinstance(b, Tensor) or isinstance(b, (DTensor, nn.Parameter)):
            what = type(b).__name__
            return (f"context_parallel: buffer {i} is a {what}; buffers are plain tensors sharded in place "
                    "(inputs, labels, positions, a RoPE table), not parameters or DTensors.")
        if not isinstance(d, int) or not -b.dim() <= d < b.dim():
            return f"context_parallel: buffer {i} has shape {tuple(b.shape)}; its seq dim {d!r} is out of range."
        if b.requires_grad and b.grad_fn is not None:
            return (f"context_parallel: buffer {i} is the output of a differentiable op (it requires grad and has a "
                    "grad_fn); it cannot be sharded in place. Pass its input, or .detach() it first.")
        if b.is_inference() and not torch.is_inference_mode_enabled():
            return f"context_parallel: buffer {i} is an inference tensor, which cannot change in place; pass a .clone()."
        if any(b is x for x in buffers[:i]):
            return f"context_parallel: buffer {i} is also an earlier buffer; pass each tensor once."
        lengths.append(b.shape[d])
    if len(set(lengths)) > 1:
        return (f"context_parallel: every buffer is one sequence of N tokens along its seq dim; got lengths "
                f"{lengths} along dims {dims}. Slice longer buffers (e.g. a RoPE table) to the sequence length.")
    unit = mesh.size() if documents else layout_unit(layout, mesh.size())
    for name, t in (("buffers", lengths[0] if lengths else None), ("document_ids", document_ids),
                    ("position_ids", position_ids)):
        n = t if not isinstance(t, Tensor) else (t.shape[-1] if t.dim() in (1, 2) else None)
        if isinstance(t, Tensor) and (n is None or t.dtype not in (torch.int64, torch.int32)):
            return (f"context_parallel: {name} must be an int64 or int32 tensor [B, N], [1, N] or [N] over the "
                    f"full sequence; got {t.dtype} of shape {tuple(t.shape)}.")
        if n is not None and n % unit:
            return (f"context_parallel: the {'documents' if documents else layout} layout on {mesh.size()} ranks "
                    f"needs the sequence length divisible by {unit}; {name} have {n}. Pad the batch to a multiple "
                    f"of {unit}.")
    given = [t.shape[-1] for t in (document_ids, position_ids) if t is not None]
    if lengths and given and given[0] != lengths[0]:
        return (f"context_parallel: the documents cover {given[0]} tokens, the buffers {lengths[0]}; pass the full "
                "sequence's document_ids / position_ids.")
    if document_ids is not None and position_ids is not None:
        return "context_parallel: pass document_ids or position_ids (documents from positions), not both."
    if document_ids is not None and bool((document_ids.reshape(-1, document_ids.shape[-1]).diff() < 0).any()):
        return ("context_parallel: document_ids must not decrease along the sequence (e.g. a cumulative count "
                "of document starts).")
    if kv_exchange not in ("ring", "allgather"):
        return f"context_parallel: kv_exchange must be 'ring' or 'allgather'; got {kv_exchange!r}."
    # the ring's own checks of window_size and comm_dtype, on a stand-in call
    probe = torch.empty(1, 1, 2, 1)
    return local_error(probe, probe, probe, "contiguous", False, None, comm_dtype, None, window_size)


@torch.no_grad()
def context_parallel_unshard(
    mesh: DeviceMesh,
    buffers: Sequence[Tensor],
    seq_dims: Sequence[int],
    load_balancer: None = None,
    *,
    layout: str | DocumentLayout = "striped",
) -> list[Tensor]:
    """torch's ``context_parallel_unshard``: the full tensors, in global order, from every rank's
    ``layout`` shards (outputs, gradients) along ``seq_dims`` -- the inverse of ``context_parallel``'s
    sharding, so ``layout`` must be the context's. One all-gather per buffer; not differentiable (as
    torch's). ``load_balancer`` is torch's argument, accepted as None only: pass ``layout=`` instead. A
    ``layout="documents"`` context's shards unshard by its plan: ``layout=plan``, the plan the context yielded."""
    check_cp_mesh(mesh)
    buffers, dims = list(buffers), list(seq_dims)
    error = None
    if load_balancer is not None:
        error = ("context_parallel_unshard: a torch load balancer does not apply to cp_dtensor's shards; pass "
                 "layout= (the one context_parallel used: 'headtail' is torch's head-tail order).")
    elif layout == "documents":
        error = ("context_parallel_unshard: a layout='documents' context's shards unshard by its plan: pass "
                 "layout=plan, the plan the context yielded (with context_parallel(...) as plan).")
    elif not isinstance(layout, (str, DocumentLayout)) or isinstance(layout, str) and layout not in LAYOUTS:
        error = f"context_parallel_unshard: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)} or a plan."
    elif len(buffers) != len(dims):
        error = (f"context_parallel_unshard: seq_dims must give one dim per buffer; got {len(buffers)} buffers "
                 f"and {len(dims)} dims.")
    else:
        for i, (b, d) in enumerate(zip(buffers, dims)):
            if not isinstance(b, Tensor) or isinstance(b, DTensor):
                error = f"context_parallel_unshard: buffer {i} is {type(b).__name__}, not a local tensor shard."
            elif not isinstance(d, int) or not -b.dim() <= d < b.dim():
                error = f"context_parallel_unshard: buffer {i} has shape {tuple(b.shape)}; seq dim {d!r} is out of range."
            elif isinstance(layout, DocumentLayout) and (
                    b.shape[d] * mesh.size() != layout.seq_len or mesh.size() != layout.cp_size
                    or layout.batch > 1 and (d % b.dim() == 0 or b.shape[0] != layout.batch)):
                error = (f"context_parallel_unshard: buffer {i} of shape {tuple(b.shape)} (seq dim {d}) on "
                         f"{mesh.size()} ranks is no shard of {layout!r}; pass the plan its context yielded.")
            elif layout == "headtail" and b.shape[d] % 2:
                error = (f"context_parallel_unshard: a headtail shard holds two chunks; buffer {i} has an odd "
                         f"length {b.shape[d]} along dim {d}.")
            if error:
                break
    # the same shapes, dtypes and dims on every rank, or the all-gathers below would not match
    agree_local_shapes(buffers if error is None else None, mesh, error, what="context_parallel_unshard",
                       also={"seq dims": dims, "layout": layout if isinstance(layout, str) else f"plan {layout.key:#x}"},
                       name="buffers")
    return [gather_shards(b, mesh, seq_dim=d, layout=layout) for b, d in zip(buffers, dims)]


def set_rotate_method(rotate_method: str) -> None:
    """torch's ``set_rotate_method``, accepted so that code written for torch runs unchanged, and ignored:
    the K/V exchange is chosen per context, ``context_parallel(..., kv_exchange="ring" | "allgather")``
    (torch's "alltoall" rotation and its "allgather"). Raises as torch does for an unknown method."""
    if rotate_method not in _ROTATE_METHODS:
        raise NotImplementedError(f"Context Parallel does not support using {rotate_method} for kv shards rotation")
