"""torchtitan 0.3: the ring as each layer's inner attention, its masks, and the batch each CP rank keeps.

Note [0.3 inner attention as the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.3's decoders (llama3, qwen3, deepseek_v3, gpt_oss) call ``attention.inner_attention(q, k, v,
attention_masks=..., scale=..., enable_gqa=...)`` with q, k, v as [B, L, N, H] (gpt_oss adds
``out_transform=`` for its sinks). The inner attention is a FlexAttention or a VarlenAttention module
(0.3 refuses "sdpa" for these families); both build their masks from one thing, the per-document
``positions`` [B, N] the dataloader yields (a position resets to 0 where a document starts): causal, and
no attention across documents; gpt_oss's sliding-window layers add ``0 <= q - k < W``.

Under the plugin every inner attention is ``RingInnerAttention`` and the masks are ``RingDocs`` (the
document ids ``cumsum(positions == 0)``, never decreasing, plus the window), so one rule serves flex and
varlen alike and no [N, N] BlockMask is built (on CPU that needs torch.compile). ``shard_cp_batch`` shards
inputs, labels, positions and the ids in the layout, as 0.2.2's ``shard_cp_batch`` does; positions are
the data's own (0.3 rotates by position within the document), so they are sharded, not recomputed.
The ring then runs at CP = 1 too (a group of this rank alone): CP = 1 and CP = P compute the same
masks, and FlexAttention has no CPU backward in torch 2.13-2.15.

gpt_oss's sinks: as in 0.2.2 (Note [gpt_oss sinks] in ../families.py) the ring puts the sinks in the
merged softmax and hands ``out_transform`` an lse of +inf, so the model's ``sigmoid(lse - sinks)``
rescale is exactly 1 with zero gradient.

Note [0.3 TP heads into the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``partial_dtensor`` with TP, torchtitan 0.3's plans (``set_gqa_inner_attention_local_map`` and the
families' own) hand the inner attention q, k, v as DTensors [B, L, N, H] placed Shard(2) -- heads -- on the
1-D TP mesh, L this CP rank's tokens; its FlexAttention / VarlenAttention would take them through a
``local_map``, which the ring, not a torchtitan ``Module``, does not get. Heads are independent in
attention, so ``RingInnerAttention`` does what that ``local_map`` does: it takes each TP rank's own heads
(``to_local``: Hq / TP query and Hkv / TP K/V heads; the CP group is another mesh dimension), runs the
ring over the CP group on them -- so each ring step moves only this rank's Hkv / TP K/V heads -- calls
gpt_oss's ``out_transform`` on them (its sinks, Shard(0) on the same mesh, taken locally too), and hands
the output back as the same DTensor placement; ``wo``'s row-wise plan then reduces over heads as after
torchtitan's kernels. The 0.2.2 glue does the same on [B, H, S, D] (Note [TP heads into the ring] in
../attention.py); TP must divide both head counts, and Ulysses the heads a TP rank holds (checked at start).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...core.plan.documents import full_document_ids
from ..shared.inner import RingInner
from ..shared.plan import batch_plan, check_mask_ids, check_titan_seq_len, shard_rows

__all__ = ["RingDocs", "RingInnerAttention", "ring_masks", "shard_cp_batch"]


@dataclasses.dataclass(frozen=True)
class RingDocs:
    """The mask rule one layer's attention gets: causal, within documents, optionally a window."""

    ids: torch.Tensor  # [B, N] document ids (global), or [B, S_local] after shard_cp_batch; non-decreasing along N
    window_size: tuple[int, int] | None = None  # gpt_oss sliding window W: (W - 1, 0)
    plan: Any = None  # the step's DocumentLayout after shard_cp_batch: Note [One plan per torchtitan batch]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, N] positions (0 where a document starts) -> [B, N] int64 document ids (0.3's own rule; the one
    derivation every door uses: ``full_document_ids``, Note [One plan per batch] in core/plan/documents.py)."""
    return full_document_ids(position_ids=positions, where="torchtitan 0.3")


def ring_masks(model_config, positions: torch.Tensor):
    """What the model's ``get_attention_masks(positions)`` would return, as ring rules: one ``RingDocs``,
    or gpt_oss's ``{"basic_mask", "sliding_window_mask"}`` dict (the model picks a layer's entry by key)."""
    ids = document_ids(positions)
    window = None
    for layer in getattr(model_config, "layers", []):
        w = getattr(getattr(layer, "attention", None), "sliding_window_size", None)
        if w is not None:
            window = w
            break
    if type(model_config).__module__.startswith("torchtitan.models.gpt_oss"):
        masks = {"basic_mask": RingDocs(ids)}
        if window is not None:
            masks["sliding_window_mask"] = RingDocs(ids, window_size=(window - 1, 0))
        return masks
    return RingDocs(ids)


def shard_cp_batch(inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, Any], *, layout: str, rank: int,
                   cp_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This CP rank's share of a batch (Note [0.3 inner attention as the ring]): inputs, labels and
    positions [B, N] -> [B, S_local]; every ``RingDocs`` id tensor alike. ``layout="documents"`` first plans
    the batch's documents from the masks' full ids (Note [One plan per torchtitan batch] in
    titan/shared/plan.py), shards everything with that plan and hands it to the ring in the masks. 0.2.2's glue has the same name
    (``v02.attention.shard_cp_batch``, in torchtitan's own signature); the public ``cp_dtensor.shard_batch``
    shards any batch structure over a mesh."""
    world = cp_size
    check_titan_seq_len(layout, world, inputs.shape[1], fix="Change --training.seq_len (or the validator's seq_len).")
    masks = extra.get("attention_masks")
    found = {"": masks} if isinstance(masks, RingDocs) else dict(masks or {})
    ids = next((m.ids for m in found.values()), None)
    if ids is None and extra.get("positions") is not None:
        ids = document_ids(extra["positions"])
    windows = [m.window_size for m in found.values()] or None  # gpt_oss: a global layer beside a window layer
    plan = batch_plan(layout, world, ids, windows=windows)  # once per batch: Note [One plan per torchtitan batch]
    for key, m in found.items():
        check_mask_ids(plan, m.ids, repr(key) if key else "model's")
    carried = None if isinstance(plan, str) else plan

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_rows(x, plan, rank, world)

    if isinstance(masks, RingDocs):
        extra["attention_masks"] = dataclasses.replace(masks, ids=shard(masks.ids), plan=carried)
    elif isinstance(masks, dict):
        extra["attention_masks"] = {k: dataclasses.replace(m, ids=shard(m.ids), plan=carried) for k, m in masks.items()}
    if extra.get("positions") is not None:
        extra["positions"] = shard(extra["positions"])
    return shard(inputs), shard(labels), extra


class RingInnerAttention(RingInner):
    """Stands in for 0.3's FlexAttention / VarlenAttention: ring attention over ``group`` with the
    ``RingDocs`` the model passes (the shared adapter: titan/shared/inner.py). ``sinks_of``: the attention
    module whose ``sinks`` join the softmax (gpt_oss), read at every call (FSDP swaps the parameter
    object); a reference, not a child module."""

    version = "torchtitan 0.3"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_masks=None,
                scale: float | None = None, enable_gqa: bool = False, out_transform=None, score_mod=None,
                **kwargs) -> torch.Tensor:
        # q: [B, S_local, Hq, Dqk]; k: [B, S_local, Hkv, Dqk]; v: [B, S_local, Hkv, Dv]
        ids, window, plan = None, None, None
        if attention_masks is not None:
            if not isinstance(attention_masks, RingDocs):
                raise TypeError(f"cp_dtensor ring attention got a {type(attention_masks).__name__} mask; it needs "
                                "the plugin's RingDocs (Note [0.3 inner attention as the ring]). Train through "
                                "cp_dtensor's trainer (python -m cp_dtensor.titan.train).")
            ids, window, plan = attention_masks.ids, attention_masks.window_size, attention_masks.plan
        if out_transform is not None and not self.has_sinks:
            raise NotImplementedError("cp_dtensor ring attention hands out_transform an lse only for gpt_oss-style "
                                      "sinks (Note [0.3 inner attention as the ring]); this model has none.")
        # See Note [0.3 TP heads into the ring]: the adapter runs the ring on this TP rank's heads
        return self.ring(q, k, v, heads_dim=2, ids=ids, window=window, is_causal=True, scale=scale,
                         score_mod=score_mod, out_transform=out_transform, plan=plan)  # [B, S_local, Hq (/ TP), Dv]


def __getattr__(name: str):
    if name == "shard_batch":  # its old name, beside the public cp_dtensor.shard_batch of another signature
        from ..._deprecated import old_keywords, warn_once

        warn_once("cp_dtensor.titan.v03.attention.shard_batch", "cp_dtensor.titan.v03.attention.shard_cp_batch")
        return old_keywords("cp_dtensor.titan.v03.attention.shard_batch", world="cp_size")(shard_cp_batch)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
