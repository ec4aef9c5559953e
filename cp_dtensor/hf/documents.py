"""layout="documents" for transformers models: one plan per batch, built from the full batch, used by every layer.

Note [One plan per batch in transformers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``layout="documents"`` (Note [Document placement] in core/plan/documents.py) the order of a rank's tokens
is the batch's own: no rank can put its shard of the position ids back in global order, as the named
layouts' attention does (Note [transformers under CP] in attention.py), without the placement. So the
documents are derived where the *full* batch is -- before it is sharded -- and the plan travels with the
shard:

* :func:`plan_batch` (``cp_dtensor.hf.plan_batch(model, position_ids=, attention_mask=, document_ids=)``)
  derives the full batch's document ids by transformers' sdpa / eager rules (:func:`documents_of`: the
  one derivation, also used by the named layouts after their gather: position ids that do not advance by
  1 start a document; with a 2-D padding mask each pad token is a document of its own) and returns
  ``cp_dtensor.core.plan.documents.plan_batch(model's layout, P, document_ids=ids, windows=the model's layer
  windows)`` (:func:`model_windows`: ``layer_types`` / ``sliding_window``, so the balance counts every
  layer's kept pairs);
* the batch is sharded with it (``cp_dtensor.shard_batch(batch, cp_mesh, layout=plan)``) and the model is
  called with it: ``model(**shard, cp_layout=plan)``. The top-level pre-hook takes ``cp_layout`` out of
  the call (the model's own code never sees it) into the model's state (``HFState.plan``); every
  attention call of that forward -- and activation checkpointing's recomputation after it -- reads it
  from there and passes it as the ring's ``layout``. The next top-level call replaces it.
* ``with_context_parallel(..., layout="documents")``: the ShardingCollator builds the plan the same way
  from the collated full batch (after its padding to a multiple of P), shards with it, and carries the
  plan object in the batch's private ``CollatedBatch`` (``plan``); the trainer's step hooks hand it to the
  model call as ``cp_layout``. A ``DocumentLayout`` is a frozen dataclass of CPU tensors, so it crosses a
  dataloader worker's queue (pickled) and pin_memory / accelerate's ``send_to_device`` leave it as it is;
  nothing is rebuilt on the model's side, and the collator is the only place that sees the full batch.

Checked at the forward's first attention call, on every rank before any K/V moves (one agreement,
then the exchange's own per layer): a missing plan, a plan for another mesh size or batch shape, and a
plan of another batch or a batch sharded in another order -- a token whose position id is 0 where the
plan has no document start; positions that do not restart at 0 where the plan's documents start, or
do not go up by 1 inside them (``DocumentLayout.positions_error``, Note [A plan fits its batch]: each
token's position against its offset in its plan document, so coarser, finer and shifted plans and pairs
split across ranks are all seen); a pad token (``attention_mask`` 0) the plan does not keep apart, or a
padded row's tokens in more than one plan document -- local checks, no collective. The agreement carries the plan's key and
every rank's error, so all ranks raise when one does, and plans that differ across ranks raise too.

generate() is unchanged: its prompt is one sequence a row, so its prefill runs the striped ring
(:func:`ring_layout`) with the prompt's padding as documents, as for ``layout="striped"``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.plan.documents import DocumentLayout
from ..core.plan.documents import plan_batch as plan_documents
from ..core.plan.layout import LAYOUTS
from .state import HFState, state_of

__all__ = ["KWARG", "check_model_layout", "documents_of", "model_windows", "plan_batch", "plan_error", "ring_layout"]

KWARG = "cp_layout"  # the model call's keyword for the batch's plan: model(**shard, cp_layout=plan)


def check_model_layout(layout: str, *, comm_dtype=None, kv_exchange: str = "ring") -> str:
    """A model's ``layout=``: a named layout or "documents" (whose exchange is its own: no kv_exchange;
    ``comm_dtype`` applies to its rows). The same on every rank: raises before any communication."""
    if layout == "documents":
        if kv_exchange != "ring":
            raise ValueError("layout='documents' sends each needed K/V row once by its own exchange (Note [Document "
                             f"exchange] in core/exchange/doc_exchange.py); got kv_exchange={kv_exchange!r}. Drop it, or use a "
                             "named layout.")
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; expected one of {', '.join(LAYOUTS)} or 'documents'.")
    return layout


def ring_layout(state: HFState) -> str:
    """The named layout a forward without a plan runs: the model's, or striped for ``layout="documents"``
    (generate()'s prefill: Note [One plan per batch in transformers])."""
    return "striped" if state.layout == "documents" else state.layout


def documents_of(pos: Tensor, real: Tensor | None, *, packed: bool = True) -> tuple[Tensor | None, str | None]:
    """(document ids int64 [B, N] or None for one document a row, error or None) of a *full* batch by
    transformers' sdpa / eager rules: ``real`` ([B, N] bool, the 2-D padding mask or None) -- each row's
    tokens one run, each pad token a document of its own; without a mask, and ``packed``, position ids
    ``pos`` [B, N] that do not advance by 1 start a document (transformers' find_packed_sequence_indices)."""
    if real is not None:
        prev = torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)
        runs = (real & ~prev).sum(1)
        if bool((runs > 1).any()):
            row = int(torch.nonzero(runs > 1)[0])
            return None, (f"attention_mask row {row} has padding inside the sequence (its tokens are not one run); "
                          "the ring runs left and right padding only. Pack the sequences with position_ids "
                          "restarting at 0 instead, or pad at the ends.")
        if bool(real.all()):
            return None, None
        return (~real | ~prev).long().cumsum(1), None  # each pad token a document of its own, the tokens one
    if not packed:
        return None, None
    diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    ids = (diff != 1).long().cumsum(1)
    if not bool(ids[:, -1].any()):
        return None, None
    return ids, None


def model_windows(config) -> list[int | None]:
    """Each attention layer's left reach (None: global) from the config: ``layer_types`` with
    ``sliding_window``, else ``sliding_window`` on every layer (unless ``use_sliding_window`` is off).
    transformers' window W keeps q - W < k <= q: a left reach of W - 1. For the plan's balance only."""
    text = getattr(config, "get_text_config", lambda: config)()
    w = getattr(text, "sliding_window", None)
    w = w if isinstance(w, int) and not isinstance(w, bool) and w >= 1 else None
    types = getattr(text, "layer_types", None)
    n = getattr(text, "num_hidden_layers", 1) or 1
    if types:
        return [w - 1 if t == "sliding_attention" and w is not None else None for t in types]
    if w is not None and getattr(text, "use_sliding_window", True):
        return [w - 1] * n
    return [None] * n


def plan_batch(model: nn.Module, *, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
               document_ids: Tensor | None = None):
    """The plan of one *full* batch for ``model`` (under ``cp_dtensor.hf.apply_context_parallel``): build it
    on every rank from the same full tensors, shard the batch with it and pass it to the call::

        plan = cp_dtensor.hf.plan_batch(model, position_ids=pos)          # pos: [B, N], the full batch
        shard = cp_dtensor.shard_batch({"input_ids": ids, "position_ids": pos}, cp_mesh, layout=plan)
        out = model(**shard, cp_layout=plan)

    ``position_ids`` [B, N] (or [1, N]): documents where they do not advance by 1 (restart at 0 for packed
    rows); ``attention_mask`` [B, N]: right / left padding, each pad token a document of its own;
    ``document_ids`` [B, N]: the documents themselves (not with a mask). Returns a ``DocumentLayout``
    (``layout="documents"``: the document placement; a named layout: that layout's order carrying the
    ids). See Note [One plan per batch in transformers]."""
    state = state_of(model)
    if state is None:
        raise ValueError("cp_dtensor.hf.plan_batch takes a model under cp_dtensor.hf.apply_context_parallel(model, "
                         "cp_mesh, layout='documents').")
    return full_plan(state.layout, state.mesh.size(), position_ids=position_ids, attention_mask=attention_mask,
                     document_ids=document_ids, windows=model_windows(model.config))


def full_plan(layout: str, cp_size: int, *, position_ids=None, attention_mask=None, document_ids=None, windows=None,
              where: str = "cp_dtensor.hf.plan_batch") -> DocumentLayout:
    """:func:`plan_batch` from its parts (the ShardingCollator's door): a ``DocumentLayout`` always."""
    if document_ids is not None and attention_mask is not None:
        raise ValueError(f"{where}: pass document_ids= or a padding attention_mask, not both; fold the padding into "
                         "the documents (each pad token a document of its own).")
    ref = next((t for t in (document_ids, position_ids, attention_mask) if t is not None), None)
    if ref is None or not isinstance(ref, Tensor) or ref.dim() != 2:
        raise ValueError(f"{where} takes the full batch's position_ids, attention_mask or document_ids as [B, N] "
                         f"tensors; got {getattr(ref, 'shape', ref)!r}.")
    if document_ids is None:
        b, n = ref.shape[0] if attention_mask is None else attention_mask.shape[0], ref.shape[1]
        pos = torch.arange(n).expand(b, n) if position_ids is None else position_ids.expand(b, -1)
        real = None if attention_mask is None else attention_mask.bool()
        if real is not None and tuple(real.shape) != tuple(pos.shape):
            raise ValueError(f"{where}: attention_mask {tuple(real.shape)} and position_ids {tuple(pos.shape)} must "
                             "be the same full [B, N].")
        ids, err = documents_of(pos.detach().cpu().long(), None if real is None else real.cpu())
        if err is not None:
            raise ValueError(f"{where}: {err}")
        document_ids = torch.zeros(pos.shape, dtype=torch.int64) if ids is None else ids
    return plan_documents(layout, cp_size, document_ids=document_ids.detach().cpu(), windows=windows, where=where)


def plan_error(state: HFState, plan, query: Tensor, pos: Tensor, attention_mask) -> str | None:
    """This rank's error for the forward's plan (Note [One plan per batch in transformers]), or None."""
    p, rank = state.mesh.size(), state.mesh.get_local_rank()
    if plan is None:
        return ("layout='documents' runs each forward with the plan of its batch, built from the full batch: "
                "plan = cp_dtensor.hf.plan_batch(model, position_ids=full_positions); "
                "shard = cp_dtensor.shard_batch(batch, cp_mesh, layout=plan); model(**shard, cp_layout=plan). "
                "See Note [One plan per batch in transformers] in cp_dtensor/hf/documents.py.")
    if not isinstance(plan, DocumentLayout):
        return (f"cp_layout= takes the batch's plan (a DocumentLayout from cp_dtensor.hf.plan_batch); got "
                f"{type(plan).__name__}.")
    want = "documents" if state.layout == "documents" else state.layout
    if plan.placement != want:
        return (f"cp_layout= is a plan in the {plan.placement!r} placement; the model runs layout={state.layout!r}. "
                "Build it with cp_dtensor.hf.plan_batch(model, ...).")
    b, s = query.shape[0], query.shape[2]
    if plan.cp_size != p or plan.seq_len != s * p or plan.batch != b:
        return (f"the plan (cp_layout=) was built for {plan.cp_size} ranks and a batch [{plan.batch}, {plan.seq_len}]; "
                f"this forward has {p} ranks and a shard [{b}, {s}] (a batch [{b}, {s * p}]). Build the plan from "
                "this batch (the full tensors) and shard the batch with it.")
    held = plan.local_positions(rank, p, plan.seq_len)  # [B, S]: the global positions this rank holds
    ids = plan.ids
    start = torch.ones_like(ids, dtype=torch.bool)
    start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    end = torch.ones_like(start)
    end[:, :-1] = start[:, 1:]
    if bool(((pos.detach().expand(b, -1).cpu() == 0) & ~start.gather(1, held)).any()):
        return ("the plan (cp_layout=) was built for another batch: a token with position id 0 (a new document) "
                "is inside one of the plan's documents. Build the plan from this batch's full position_ids.")
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        pad = attention_mask.detach().cpu() == 0
        if bool((pad & ~(start & end).gather(1, held)).any()):
            return ("the plan (cp_layout=) does not keep this batch's padding apart: build it with the padding "
                    "mask, cp_dtensor.hf.plan_batch(model, position_ids=..., attention_mask=full_mask).")
    real = attention_mask.detach().cpu().bool() if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2 else None
    # a coarser, finer or shifted plan, a batch sharded by a layout name: Note [A plan fits its batch]
    return plan.positions_error(rank, pos.detach().expand(b, -1), real=real) if isinstance(pos, Tensor) else None
