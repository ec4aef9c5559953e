"""The per-batch plan of a torchtitan step, for both glues (0.2.2's ``shard_cp_batch`` and 0.3's).

Note [One plan per torchtitan batch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan builds a batch's attention masks from the *full* batch -- 0.2.2's flex flavors from the eos
tokens (``block_causal``: ``flex.document_ids``), 0.3's from the per-document ``positions`` the data gives
(``full_document_ids(position_ids=...)``) -- and only then calls ``prepare_context_parallel_input``, which
the plugin answers with ``shard_cp_batch``. That is where the plan is made, once per batch (Note [One
plan per batch] in core/plan/documents.py): ``batch_plan`` is ``plan_batch`` of the masks' full document ids,
with the masks' windows (gpt_oss: a global layer beside a sliding-window one; the balance counts both).

* ``layout = "documents"``: the plan is a ``DocumentLayout`` (short documents whole on a rank, long ones
  in head-tail pieces). Inputs, labels, positions and every mask's ids are sharded with it, each mask
  carries it, and every ring attention call of the step gets it as ``layout=`` (the mask's ids beside it:
  the ring checks on every rank that they are the plan's, before any K/V moves). RoPE positions are then
  per row, [B, S_local] (rows place their documents differently).
* a layout name: the plan is the name -- the documents travel in the masks' ids, sharded in that layout,
  as before -- so the named paths (and their compiled graphs) are unchanged.

The documents must be the batch's: a mask whose ids differ from the plan's (llama4's chunks) is refused
here, on every rank alike (every CP rank reads the same batch), before anything is sent.

Note [Documents under tensor parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The documents layout (static, and ``dynamic``) needs nothing of its own under TP, for three reasons:

* Every TP rank of one (dp, cp) position gets the same tokens. torchtitan loads a batch per dp rank (the
  TP ranks of a dp rank read the same rows) and the plan is a pure function of the batch's document ids,
  made on every rank; ``dynamic`` gathers the rows and moves the tokens over torchtitan's "loss" mesh
  (dp x cp at this rank's TP index): the TP ranks gather the same rows, make the same plan and receive
  the same tokens, each through its own TP index's mesh.
* Sequence parallelism splits a rank's [B, S_local] tokens over TP only between the blocks (norms,
  residual); the TP plan gathers them back before attention's projections, so attention sees the whole
  [B, S_local] shard with Hq / TP heads (Note [TP heads into the ring]) and the positions [B, S_local] and
  masks, which are never DTensors, as they are without TP. What SP needs is S_local (dynamic: B * N / cp)
  divisible by TP: seq_len a multiple of cp * tp, checked at start.
* The ring runs over the CP group (dynamic: the "loss" mesh) of each TP index on that rank's heads; the
  loss and the gradient reductions are torchtitan's, as with a named layout.

Measured (llama3 debug models, fp32, 3 steps): on torchtitan 0.2.2 documents at dp 2 x cp 2 x tp 2 logs the
losses of dp 2 x tp 2 at cp 1, and ``dynamic`` on the same ranks those of the static documents run (identical
digits; tests/titan/v02/test_titan_dynamic.py); on 0.3 ``dynamic`` at dp 2 x cp 2 x tp 2 those of the static
documents run (tests/titan/v03/test_titan03_dynamic.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.plan.documents import DocumentLayout, plan_batch
from ...core.plan.layout import check_seq_len, local_positions, shard_tensor

__all__ = ["DOCUMENTS", "batch_plan", "check_mask_ids", "check_titan_seq_len", "rope_positions", "shard_rows", "titan_unit"]

DOCUMENTS = "documents"  # the [cp_dtensor] layout that places the batch's documents


def titan_unit(layout: str, cp: int) -> int:
    """What ``seq_len`` must be a multiple of for ``layout`` on ``cp`` ranks ("documents": ``cp``)."""
    from ...core.plan.layout import layout_unit

    return cp if layout == DOCUMENTS else layout_unit(layout, cp)


def check_titan_seq_len(layout: str, cp: int, seq_len: int, *, fix: str) -> None:
    """The ValueError of a batch whose length ``layout`` cannot split over ``cp`` ranks (torch-free)."""
    if layout != DOCUMENTS:
        check_seq_len(layout, cp, seq_len, fix=fix)
    elif seq_len % cp:
        raise ValueError(f"the documents layout on {cp} CP ranks needs a sequence length divisible by {cp}; got "
                         f"{seq_len}. {fix}")


def batch_plan(layout: str, cp_size: int, ids: torch.Tensor | None, *, windows: Any = None,
               where: str = "[cp_dtensor] layout") -> str | DocumentLayout:
    """The step's plan (Note [One plan per torchtitan batch]): ``layout`` itself for a name, else the
    ``DocumentLayout`` of the full batch's document ids ``ids`` [B, N] with the model's ``windows``."""
    if layout != DOCUMENTS:
        return layout
    if ids is None:
        raise ValueError(f'{where} = "documents" needs the batch\'s documents, and this batch has no document masks. '
                         'Use a flavor whose masks mark documents (0.2.2: a flex flavor with attn_mask_type = '
                         '"block_causal"; 0.3: its flex / varlen flavors) or a named layout ("striped").')
    return plan_batch(DOCUMENTS, cp_size, document_ids=ids, windows=windows, where=where)


def check_mask_ids(plan: str | DocumentLayout, ids: torch.Tensor | None, what: str) -> None:
    """A mask's full ids must be the plan's documents (Note [One plan per torchtitan batch])."""
    if isinstance(plan, str) or ids is None:
        return
    if tuple(ids.shape) != tuple(plan.ids.shape) or not torch.equal(ids.detach().to("cpu", torch.int64), plan.ids):
        raise ValueError(f'[cp_dtensor] layout = "documents" places one set of documents per batch; the {what} mask '
                         "masks by other ids (e.g. llama4's chunks inside documents). Use a named layout "
                         '("striped") for this model.')


def shard_rows(x: torch.Tensor, plan: str | DocumentLayout, rank: int, cp_size: int) -> torch.Tensor:
    """[B, N] -> [B, S_local]: this rank's tokens of ``x`` in the plan."""
    return shard_tensor(x, seq_dim=1, layout=plan, rank=rank, cp_size=cp_size).contiguous()


def rope_positions(plan: str | DocumentLayout, rank: int, cp_size: int, seq_len: int) -> torch.Tensor:
    """The global positions this rank holds, as RoPE takes them: [1, S_local] when every row has the same
    (a named layout), else [B, S_local] (a document plan places each row's documents)."""
    pos = local_positions(layout=plan, rank=rank, cp_size=cp_size, seq_len=seq_len)
    if pos.dim() == 1:
        return pos.unsqueeze(0)
    return pos[:1] if bool((pos == pos[:1]).all()) else pos
