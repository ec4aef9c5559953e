"""Pad tokens a loss scores where CP cannot give CP=1's answer: found on the global batch, refused on every rank.

Note [Scored pads]
~~~~~~~~~~~~~~~~~~
A pad query's attention output is zero under CP (Note [Pad queries] in hf/attention.py). That is CP=1's answer
only where CP=1 gives zero, and it matters only where the loss reads the pad's logits (its shifted label is not
-100). Two cases are not zero at CP=1: a right pad (it sees the row's tokens) and, when the model's attention
ran transformers' ``"eager"`` function without sinks, a left pad: every key of a pad that sees none is masked
by adding the dtype's minimum, so all its scores are equal, the softmax is uniform over every key of the row,
later tokens included, and its gradient reaches them (DeepSeek Sparse Attention's eager path too: its top-k
mask writes the same minimum). A left-padded Gemma 2 batch (eager: Gemma 2 offers no SDPA) with a padding
collator's labels had its loss 8.5e-4 and its gradients 19 % off CP=1's, silently; a right pad labelled
(labels = input_ids, pads not masked) put Llama's gradients 87 % off.

Neither can be reproduced from a rank's shard, so a forward whose ``shift_labels`` score such a pad raises on
every rank. The ring's path carries the pads' flags in the documents' gather it makes anyway (3: a pad with a
label, hf/attention.py's ``derive_documents``), so the verdict is global and costs nothing. Under
``layout="documents"`` (no gather) a scored pad of an eager model without sinks is refused through the plan's
agreement; a scored right pad there is not detected. DeepSeek Sparse Attention answers a right pad as CP=1 does
(its rows hold the whole selection), so only its eager left pads are refused, after one all-reduce of a flag in
the first layer of an eager model's padded forward. The MLA latent path (``kv_exchange="latent"``, hf/latent.py) holds
whole rows too: only its eager left pads are refused, from the ring path's flags (the same gather). Labels of -100 on padding (every padding collator) and
right padding for the eager families (or SDPA / flash-attention, which give a left pad zero) avoid both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["latent_pad_error", "planned_pad_error", "scored_pad_error", "scored_pads", "sparse_pad_error", "uniform_pads"]

_SCORED = ("shift_labels scores {which} pad token{where} (attention_mask 0, label != -100), {why} Under context "
           "parallelism a pad token's attention output is zero (Note [Scored pads] in cp_dtensor/hf/pads.py), so the "
           "loss and gradients would differ from CP=1's. {fix}")
_RIGHT = ("a right", "which at CP=1 attends to its row's tokens.",
          "Give padding the label -100 (as DataCollatorForLanguageModeling does) before cp_dtensor.hf.shift_labels.")
_LEFT = ("a left", "and the model's attention ran 'eager' before context parallelism: transformers' eager attention "
         "gives a pad that sees no key a uniform average over every key of its row, later tokens included.",
         "Pad on the right (tokenizer.padding_side = 'right'), give the row's first token the label -100, or load the "
         "model with attn_implementation='sdpa' (or 'flash_attention_2'), which gives such a pad zero, where the family "
         "offers it.")


def _message(kind: tuple[str, str, str], where: str = "") -> str:
    return _SCORED.format(which=kind[0], where=where, why=kind[1], fix=kind[2])


def uniform_pads(model: nn.Module, before: dict) -> bool:
    """Whether CP=1's attention gives a query that sees no key a uniform average: transformers' eager function
    (``before``: the implementations before CP), and an attention layer without sinks (a sink takes the whole
    weight: zero, as under CP)."""
    layers = [m for m in model.modules() if all(hasattr(m, a) for a in ("layer_idx", "is_causal", "scaling"))]
    return before.get("") == "eager" and any(getattr(m, "sinks", None) is None for m in layers)


def scored_pads(flag: Tensor):
    """(the first left pad, the first right pad) the loss scores, each a global (row, column) or None; None when
    no pad is scored. ``flag``: the global [B, N] flags (1 real, 3 a pad with a label)."""
    scored = flag == 3
    if not bool(scored.any()):
        return None
    after = (flag == 1).long().cumsum(1) > 0  # a real token at or before the column

    def first(m: Tensor):
        return tuple(int(i) for i in m.nonzero()[0]) if bool(m.any()) else None

    return first(scored & ~after), first(scored & after)


def scored_pad_error(state) -> str | None:
    """The ring path's refusal, from :func:`scored_pads`' global facts: the same on every rank."""
    left, right = state.scored_pads or (None, None)
    kind, where = (_RIGHT, right) if right is not None else (_LEFT, left) if state.uniform_pads else (None, None)
    return None if where is None else _message(kind, f" at row {where[0]}, column {where[1]}")


def latent_pad_error(state) -> str | None:
    """The latent path's refusal (hf/latent.py): its right pads see the row's tokens, as at CP=1, so only a scored
    left pad of an eager model without sinks is refused; from :func:`scored_pads`' global facts."""
    left = (state.scored_pads or (None, None))[0]
    return None if left is None or not state.uniform_pads else _message(_LEFT, f" at row {left[0]}, column {left[1]}")


def planned_pad_error(state, attention_mask) -> str | None:
    """This rank's refusal under a plan (raised on every rank by the plan's agreement): a scored pad of an eager
    model without sinks (its right pads and left pads alike differ from CP=1's)."""
    labels = state.labels
    if not (state.uniform_pads and isinstance(labels, Tensor) and isinstance(attention_mask, Tensor)
            and attention_mask.dim() == 2 and labels.shape == attention_mask.shape):
        return None
    scored = (attention_mask == 0) & (labels.to(attention_mask.device) != -100)
    return _message(_LEFT) if bool(scored.any()) else None


def sparse_pad_error(state, real: Tensor, mine: Tensor, group) -> str | None:
    """DeepSeek Sparse Attention's refusal of a scored left pad of an eager model, the same on every rank (one
    all-reduce; call it on every rank when ``state.uniform_pads`` and the batch is padded). ``real``: [B, N] not
    padding, by global column; ``mine``: [B, S] this rank's global columns."""
    first = torch.where(real.any(1), real.long().argmax(1), real.shape[1])  # [B]: each row's first real column
    labels, flag = state.labels, torch.zeros(1, dtype=torch.long)
    if isinstance(labels, Tensor) and labels.shape == mine.shape:
        flag[0] = int(bool(((mine < first[:, None].to(mine.device)) & (labels.to(mine.device) != -100)).any()))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return _message(_LEFT) if int(flag[0]) else None
