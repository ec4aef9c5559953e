"""What context parallelism changes inside a torchtitan step: the attention call and the batch.

Note [CP batch and positions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every CP rank of a data-parallel group reads the same full batch; before the forward each keeps its
``layout`` shard of the sequence dimension of inputs [B, N] and labels [B, N] (N = seq_len), so each
rank holds S_local = N / P tokens. RoPE must rotate a token by its *global* position, so the model
also receives ``positions`` [1, S_local] = ``local_positions(layout, rank, P, N)`` ([B, S_local] under the documents
layout, whose rows place their documents apart: Note [One plan per torchtitan batch]); llama3, llama4,
qwen3 and deepseek_v3 index their RoPE tables with them (``positions`` is a forward argument there;
gpt_oss, which has none, is handled in families.py). A flex flavor's masks (``RingMask``, Note [Flex
masks as ring masks] in flex.py) carry global document ids [B, N]; they are sharded in the same layout.

The loss needs no change: each rank's loss is the sum of cross entropy over its S_local tokens
divided by the number of valid tokens of the whole global batch (counted by the trainer before
sharding, over the data-parallel ranks only). torchtitan sums that over the dp x cp "loss" mesh for
the log, and FSDP (which with CP spans dp_shard x cp) sums gradients with divide factor 1, so both
the logged loss and the gradients are the full-sequence mean, as at CP = 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..shared.heads import (
    ulysses_mesh,  # noqa: F401  (the old path cp_dtensor.titan.attention's name)
    ulysses_shard_index,
)
from ..shared.inner import RingInner, infinite_lse
from ..shared.plan import check_titan_seq_len, rope_positions, shard_rows
from .dynamic import shard_dynamic_batch
from .flex import RingMask, mask_plan, shard_masks
from .pipeline import masks_for_schedule, rows_for_schedule

__all__ = ["RingAttention", "shard_cp_batch"]


class RingAttention(RingInner):
    """Drop-in for torchtitan's inner attention modules (``ScaledDotProductAttentionWrapper``,
    ``FlexAttentionWrapper``): ring attention over ``group``, with the mask the model passes (the shared
    adapter: titan/shared/inner.py).

    ``mask_key`` picks this layer's mask from a dict the model passes whole (llama4 iRoPE: "rope" or
    "nope"). ``sinks_of`` is the attention module whose ``sinks`` parameter (gpt_oss) joins the softmax;
    it is read at every call (FSDP swaps the parameter object) and is not a submodule.
    """

    version = "torchtitan 0.2.2"

    def __init__(self, *, group: dist.ProcessGroup | DeviceMesh, layout: str, comm_dtype: torch.dtype | None = None,
                 mask_key: str | None = None, sinks_of: nn.Module | None = None, kv_exchange: str = "ring"):
        super().__init__(group=group, layout=layout, comm_dtype=comm_dtype, kv_exchange=kv_exchange, sinks_of=sinks_of)
        self.mask_key = mask_key

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        scale: float | None = None, enable_gqa: bool = False, is_causal: bool = True,
        block_mask: RingMask | dict[str, RingMask] | None = None, score_mod=None, return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # q, k: [B, Hq | Hkv, S_local, Dqk]; v: [B, Hkv, S_local, Dv] (GQA when Hq > Hkv, whatever enable_gqa says)
        mask = block_mask[self.mask_key] if isinstance(block_mask, dict) else block_mask
        ids, window, plan = None, None, None
        if mask is not None:
            if not isinstance(mask, RingMask):
                raise TypeError(f"cp_dtensor ring attention got a {type(mask).__name__} mask; it needs the plugin's "
                                "RingMask (Note [Flex masks as ring masks]). Apply the plugin to the whole model.")
            ids, window, is_causal, plan = mask.ids, mask.window_size, mask.is_causal, mask.plan
        if return_lse and not self.has_sinks:
            raise NotImplementedError("cp_dtensor ring attention returns an lse only for gpt_oss-style sinks "
                                      "(Note [gpt_oss sinks] in families.py); this model asked for one without sinks.")
        out = self.ring(q, k, v, heads_dim=1, ids=ids, window=window, is_causal=is_causal, scale=scale,
                        score_mod=score_mod, plan=plan)  # [B, Hq, S_local, Dv]; See Note [TP heads into the ring]
        # gpt_oss rescales by sigmoid(lse - sinks) itself: See Note [gpt_oss sinks] in families.py
        return (out, infinite_lse(out)) if return_lse else out

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.mask_key is None else f", mask_key={self.mask_key!r}")


def shard_cp_batch(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    extra_kwargs: dict[str, Any],
    cp_mesh,
    device: torch.device,
    load_balancer_type: str | None = None,
    *,
    layout: str,
    ulysses: int = 1,
    pipeline: bool = False,
    grid: DeviceMesh | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This CP rank's share of a batch; see Note [CP batch and positions].

    Same signature as torchtitan's ``prepare_context_parallel_input`` (whose place it takes), plus
    ``layout`` and ``ulysses`` (the U of Note [Ulysses in torchtitan]: the shard is then that of
    ``ulysses_shard_index``); ``load_balancer_type`` is ignored: the layout decides the balance.
    inputs, labels: [B, N] -> [B, S_local]; adds extra_kwargs["positions"]: [1, S_local] ([B, S_local] under
    ``layout="documents"``); the ids of extra_kwargs["attention_masks"] (RingMask or a dict of them): [B, N] ->
    [B, S_local]. ``layout="documents"`` plans the batch's documents from those masks first (Note [One plan
    per torchtitan batch] in titan/shared/plan.py) and shards everything with that plan. ``pipeline``: the
    positions and masks in the form a pipeline schedule splits into microbatches (Note [CP under pipeline
    parallelism] in pipeline.py). ``grid``: ``[cp_dtensor] dynamic = true``'s flattened dp x cp mesh, over which
    the global batch is planned instead (Note [Dynamic CP in torchtitan] in dynamic.py).
    """
    if grid is not None:
        return shard_dynamic_batch(inputs, labels, extra_kwargs, grid, cp_mesh.size(), device)
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rank = ulysses_shard_index(rank, world, ulysses)  # this rank's 1-D shard index; = rank when ulysses == 1
    seq_len = inputs.shape[1]
    # e.g. a validation seq_len that the start-up check did not see
    check_titan_seq_len(layout, world, seq_len, fix="Change [training]/[validation] seq_len.")
    masks = extra_kwargs.get("attention_masks")
    plan = mask_plan(masks, layout=layout, world=world)  # once per batch: Note [One plan per torchtitan batch]
    if masks is not None:
        extra_kwargs["attention_masks"] = shard_masks(masks, layout=plan, rank=rank, world=world)
    inputs, labels = shard_rows(inputs, plan, rank, world), shard_rows(labels, plan, rank, world)
    extra_kwargs["positions"] = rope_positions(plan, rank, world, seq_len).to(device)
    if pipeline:  # See Note [CP under pipeline parallelism]
        extra_kwargs["positions"] = rows_for_schedule(extra_kwargs["positions"], inputs.shape[0])
        if masks is not None:
            extra_kwargs["attention_masks"] = masks_for_schedule(extra_kwargs["attention_masks"], plan)
    return inputs, labels, extra_kwargs
