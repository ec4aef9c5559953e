"""``[cp_dtensor] dynamic = true`` in torchtitan 0.2.2: one plan of the global batch over every dp_shard x cp
rank each step (Note [One plan over the grid] in core/dynamic.py).

Note [Dynamic CP in torchtitan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan gives every rank its dp rank's rows [B, N] (the same on the cp ranks of one dp rank) and the
block_causal mask's document ids, then calls ``prepare_context_parallel_input`` -- here
``shard_dynamic_batch``. The grid is torchtitan's "loss" mesh (``batch`` x ``cp`` flattened, flat rank
``d * cp + c``): the ranks agree on the batch shapes and gather every dp rank's document lengths, plan the
global batch over all of them (``shard_on_grid``), and move inputs, labels and positions (the original
token index in its row: RoPE unchanged) by one all-to-all each. Each rank then holds [1, B * N / cp]
tokens; its mask carries the plan and its ids; the ring attention modules run over the same "loss" mesh
(``parallelize_with_ring`` hands it to ``apply_ring_attention``).

Nothing else changes, and nothing needs to: the trainer counts the global batch's valid tokens before
this hook (over the dp ranks), each rank's loss is its tokens' sum over that count, the logged loss is the
sum over the "loss" mesh, FSDP (over dp_shard x cp) sums the gradients with divide factor 1, and the token
counts are taken from the rows as loaded. So the losses and gradients equal the static documents run's.
float8 linears (torchao) see [1, B * N / cp] tokens instead of [B, N / cp]: a per-token or per-weight scale
is the same, a scale over a rank's tokens (tensorwise activations, rowwise's weight-gradient operands) is
taken over other tokens, so those recipes differ by float8 rounding noise (as CP does from CP = 1).
deepseek_v3's MoE layers are token-wise and its auxiliary-loss-free expert bias is updated from the tokens
per expert summed over the same "loss" mesh: the same tokens, the same update.
One log line a step (rank 0) reports the plan: work max/mean over ranks (kept causal pairs + 64 a token
for the linear layers), the dp ranks' own rows' max/mean (what the static grid is at least), the K/V rows
the busiest rank receives a layer, and the tokens a rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..shared.dynamic import LINEAR_PAIRS, shard_on_loss_mesh
from .flex import RingMask

__all__ = ["LINEAR_PAIRS", "shard_dynamic_batch"]


def shard_dynamic_batch(inputs: torch.Tensor, labels: torch.Tensor, extra_kwargs: dict[str, Any], grid: DeviceMesh,
                        cp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This rank's share of the global batch (Note [Dynamic CP in torchtitan]): inputs, labels [B, N] ->
    [1, B * N / cp]; extra_kwargs["positions"]: [1, B * N / cp]; the mask: the plan and this rank's ids."""
    mask = extra_kwargs.get("attention_masks")
    if not isinstance(mask, RingMask) or mask.ids is None:
        raise ValueError('[cp_dtensor] dynamic = true needs the batch\'s documents in one block_causal mask (a llama3 or '
                         'deepseek_v3 flex flavor with attn_mask_type = "block_causal", e.g. "debugmodel_flex_attn").')
    b, n = inputs.shape
    positions = torch.arange(n, device=inputs.device).expand(b, n)  # the token's index in its row, as RoPE reads it
    (x, y, pos), plan, ids = shard_on_loss_mesh((inputs, labels, positions), grid, cp, mask.ids, [mask.window_size])
    extra_kwargs["attention_masks"] = mask.with_ids(ids, plan)
    extra_kwargs["positions"] = pos.to(device)
    return x.to(device), y.to(device), extra_kwargs
