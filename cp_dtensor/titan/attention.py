"""What context parallelism changes inside a torchtitan llama3 step: the attention call and the batch.

Note [CP batch and positions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every CP rank of a data-parallel group reads the same full batch; before the forward each keeps its
``layout`` shard of the sequence dimension of inputs [B, N] and labels [B, N] (N = seq_len), so each
rank holds S_local = N / P tokens. RoPE must rotate a token by its *global* position, so the model
also receives ``positions`` [1, S_local] = ``local_positions(layout, rank, P, N)``; torchtitan's
llama3 indexes its RoPE table with them (``positions`` is already a forward argument there).

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

from ..layout import layout_unit, local_positions, shard_tensor
from ..ring import ring_attention

__all__ = ["RingAttention", "shard_cp_batch"]


class RingAttention(nn.Module):
    """Drop-in for torchtitan's ``ScaledDotProductAttentionWrapper``: ring attention over ``group``."""

    def __init__(self, *, group: dist.ProcessGroup, layout: str, comm_dtype: torch.dtype | None = None):
        super().__init__()
        self.group, self.layout, self.comm_dtype = group, layout, comm_dtype  # comm_dtype None: K/V travel as they are

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        scale: float | None = None, enable_gqa: bool = False, is_causal: bool = True,
    ) -> torch.Tensor:
        # q: [B, Hq, S_local, D]; k, v: [B, Hkv, S_local, D] (GQA when Hq > Hkv, whatever enable_gqa says)
        return ring_attention(
            q, k, v, group=self.group, layout=self.layout, is_causal=is_causal, scale=scale, comm_dtype=self.comm_dtype
        )

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}, cp={dist.get_world_size(self.group)}, comm_dtype={self.comm_dtype}"


def shard_cp_batch(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    extra_kwargs: dict[str, Any],
    cp_mesh,
    device: torch.device,
    load_balancer_type: str | None = None,
    *,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This CP rank's share of a batch; see Note [CP batch and positions].

    Same signature as torchtitan's ``prepare_context_parallel_input`` (whose place it takes), plus
    ``layout``; ``load_balancer_type`` is ignored: the layout decides the balance.
    inputs, labels: [B, N] -> [B, S_local]; adds extra_kwargs["positions"]: [1, S_local].
    """
    if extra_kwargs.get("attention_masks") is not None:
        raise NotImplementedError("cp_dtensor context parallelism supports SDPA attention only (no attention masks).")
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    seq_len = inputs.shape[1]
    if seq_len % layout_unit(layout, world) != 0:  # e.g. a validation seq_len that the start-up check did not see
        raise ValueError(
            f"{layout} layout on {world} CP ranks needs batches whose sequence length is a multiple of "
            f"{layout_unit(layout, world)}; got {seq_len}. Change [training]/[validation] seq_len."
        )
    inputs = shard_tensor(inputs, dim=1, layout=layout, rank=rank, world=world)
    labels = shard_tensor(labels, dim=1, layout=layout, rank=rank, world=world)
    extra_kwargs["positions"] = local_positions(layout, rank, world, seq_len).to(device).unsqueeze(0)
    return inputs, labels, extra_kwargs
