"""torchtitan's flex-attention masks, as the ring expresses them: document ids, chunks, windows.

Note [Flex masks as ring masks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A torchtitan flex flavor builds its masks once per batch, from the full [B, N] tokens, in the
model's ``get_attention_masks`` (the trainer calls it before CP shards the batch), and hands them
down the model to every ``inner_attention`` call as ``block_mask=``. Every mask torchtitan 0.2.2
builds is an ``and`` of four rules, all of which the ring takes directly:

* causal (``get_causal_mask_mod``): ``is_causal=True``;
* documents (``get_document_mask_mod``, for ``attn_mask_type = "block_causal"``): ids that count
  the eos tokens before each position -- taken from torchtitan's own function (its closure holds
  the ids), so the documents are exactly the ones torchtitan's block mask would keep;
* llama4's chunks (``get_fixed_block_mask_mod(C)`` on its RoPE layers): a chunk inside a document
  is a document of its own, so the ids become ``doc * ceil(N / C) + position // C``, which still
  never decrease;
* gpt_oss's sliding window (``get_sliding_window_mask_mod(W)``: ``0 <= q - k < W``):
  ``window_size=(W - 1, 0)`` with ``is_causal``.

The plugin replaces the model's ``get_attention_masks`` with ``ring_masks``, which returns the same
structure the model expects -- one mask, or llama4's ``{"rope", "nope"}`` / gpt_oss's
``{"basic_mask", "sliding_window_mask"}`` dict -- made of ``RingMask`` objects. A ``RingMask`` *is* a
``BlockMask`` (a one-block stand-in, so the models' ``isinstance`` checks pass) that carries the
rule: global ids [B, N] until ``shard_cp_batch`` replaces them with the rank's layout shard
[B, S_local], exactly as it shards the tokens. Nothing is built per layer and no ``BlockMask`` of
N x N blocks is ever created (on CPU that would need torch.compile's ``create_block_mask``).

gpt_oss's ``block_causal`` basic mask is torchtitan's document mask *without* the causal rule (its
``get_attention_masks`` leaves ``get_causal_mask_mod`` out); the ring reproduces that faithfully.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from ..shared.plan import batch_plan, check_mask_ids, shard_rows

__all__ = ["RingMask", "document_ids", "chunk_ids", "ring_masks", "mask_plan", "shard_masks"]


class RingMask(BlockMask):
    """A mask rule for the ring, passed where torchtitan passes a ``BlockMask``. Build with ``make``."""

    ids: Tensor | None  # [B, N] global, or [B, S_local] after shard_masks; None: no documents
    is_causal: bool
    window_size: tuple[int, int] | None
    plan: Any  # None, or the step's DocumentLayout after shard_masks: Note [One plan per torchtitan batch]

    @classmethod
    def make(cls, ids: Tensor | None, *, is_causal: bool = True, window_size: tuple[int, int] | None = None,
             plan: Any = None) -> RingMask:
        one = torch.zeros(1, 1, 1, dtype=torch.int32)  # a single-block BlockMask, never used by any kernel
        mask = cls.from_kv_blocks(one, one.unsqueeze(-1), BLOCK_SIZE=1, seq_lengths=(1, 1), compute_q_blocks=False)
        mask.ids, mask.is_causal, mask.window_size, mask.plan = ids, is_causal, window_size, plan
        return mask

    def with_ids(self, ids: Tensor | None, plan: Any = None) -> RingMask:
        return RingMask.make(ids, is_causal=self.is_causal, window_size=self.window_size, plan=plan)

    def __repr__(self) -> str:
        ids = None if self.ids is None else f"ids{list(self.ids.shape)}"
        plan = "" if self.plan is None else f", plan={self.plan!r}"
        return f"RingMask({ids}, is_causal={self.is_causal}, window_size={self.window_size}{plan})"

    __str__ = __repr__


def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """Document ids [B, N] (int64) of torchtitan's block_causal mask: taken from the closure of
    torchtitan's ``get_document_mask_mod`` (eos ends a document; see Note [Flex masks as ring masks])."""
    from torchtitan.models.attention import get_document_mask_mod  # 0.2.2's module; 0.3 (v03/) imports this file too

    mask_mod = get_document_mask_mod(tokens, eos_id)
    return inspect.getclosurevars(mask_mod).nonlocals["sequence_indices"].long()


def chunk_ids(ids: Tensor, chunk: int) -> Tensor:
    """llama4's chunked attention inside documents as document ids [B, N]: new ids every ``chunk`` tokens."""
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device).expand(b, n)
    return ids * (-(-n // chunk)) + pos // chunk  # non-decreasing: doc dominates, pos // chunk < ceil(N / C)


def ring_masks(model, input_batch: Tensor, tokenizer, extra_inputs=None):
    """Stands in for a flex flavor's ``get_attention_masks``: the same structure, of ``RingMask``s."""
    args = model.model_args
    mask_type = getattr(args, "attn_mask_type", "causal")
    if mask_type not in ("causal", "block_causal"):
        raise ValueError(f'cp_dtensor supports attn_mask_type "causal" and "block_causal"; got "{mask_type}". '
                         'Pick a flavor with one of them.')
    docs = None
    if mask_type == "block_causal":
        if tokenizer is None or tokenizer.eos_id is None:
            raise ValueError("block_causal attention needs a tokenizer with an eos token: set [model] hf_assets_path "
                             "to a tokenizer whose config names eos_token.")
        docs = document_ids(input_batch, tokenizer.eos_id)
    if getattr(args, "every_n_layers_nope", None) is not None:  # llama4 iRoPE
        full = docs if docs is not None else torch.zeros_like(input_batch, dtype=torch.long)
        return {"rope": RingMask.make(chunk_ids(full, args.fixed_attn_block_size)), "nope": RingMask.make(docs)}
    if getattr(args, "sliding_window_size", None) is not None:  # gpt_oss
        return {"basic_mask": RingMask.make(docs, is_causal=mask_type == "causal"),
                "sliding_window_mask": RingMask.make(docs, window_size=(args.sliding_window_size - 1, 0))}
    return RingMask.make(docs)


def _as_dict(masks) -> dict[str, RingMask]:
    if isinstance(masks, RingMask):
        return {"": masks}
    if isinstance(masks, dict) and all(isinstance(m, RingMask) for m in masks.values()):
        return masks
    raise NotImplementedError(
        f"cp_dtensor cannot shard attention masks of type {type(masks).__name__}: only the ring's own masks "
        "(RingMask). The plugin replaces the model's get_attention_masks when it applies the ring; was it applied?")


def mask_plan(masks, *, layout: str, world: int):
    """The step's plan from the full batch's masks (Note [One plan per torchtitan batch]): ``layout`` for a
    name; for "documents" the ``DocumentLayout`` of the masks' documents, balanced over their windows."""
    if layout != "documents":
        return layout
    found = {} if masks is None else _as_dict(masks)
    docs = found.get("nope", found.get("basic_mask", next(iter(found.values()), None)))  # llama4 / gpt_oss / one
    windows = [m.window_size for m in found.values()] or None  # gpt_oss: a global layer beside a window layer
    plan = batch_plan(layout, world, None if docs is None else docs.ids, windows=windows)
    for key, m in found.items():
        check_mask_ids(plan, m.ids, repr(key) if key else "model's")
    return plan


def shard_masks(masks, *, layout, rank: int, world: int):
    """``masks`` (a RingMask or a dict of them) with every [B, N] id tensor replaced by its shard in ``layout``
    (a name, or the step's plan, which each mask then carries to the ring)."""
    plan = None if isinstance(layout, str) else layout

    def one(m: RingMask) -> RingMask:
        if m.ids is None:
            return m.with_ids(None, plan)
        return m.with_ids(shard_rows(m.ids, layout, rank, world), plan)

    if isinstance(masks, RingMask):
        return one(masks)
    return {k: one(m) for k, m in _as_dict(masks).items()}
