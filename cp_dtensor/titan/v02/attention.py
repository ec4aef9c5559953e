"""What context parallelism changes inside a torchtitan step: the attention call and the batch.

Note [CP batch and positions]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every CP rank of a data-parallel group reads the same full batch; before the forward each keeps its
``layout`` shard of the sequence dimension of inputs [B, N] and labels [B, N] (N = seq_len), so each
rank holds S_local = N / P tokens. RoPE must rotate a token by its *global* position, so the model
also receives ``positions`` [1, S_local] = ``local_positions(layout, rank, P, N)``; llama3, llama4,
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
from torch.distributed.tensor import DTensor, Shard

from ...core.attention import ring_attention
from ...core.layout import check_seq_len, local_positions, shard_tensor
from ..shared.heads import (
    tp_head_sharding,
    ulysses_mesh,  # noqa: F401  (the old path cp_dtensor.titan.attention's name)
    ulysses_shard_index,
)
from .flex import RingMask, shard_masks

__all__ = ["RingAttention", "shard_cp_batch"]


class RingAttention(nn.Module):
    """Drop-in for torchtitan's inner attention modules (``ScaledDotProductAttentionWrapper``,
    ``FlexAttentionWrapper``): ring attention over ``group``, with the mask the model passes.

    ``mask_key`` picks this layer's mask from a dict the model passes whole (llama4 iRoPE: "rope" or
    "nope"). ``sinks_of`` is the attention module whose ``sinks`` parameter (gpt_oss) joins the softmax;
    it is read at every call (FSDP swaps the parameter object) and is not a submodule.
    """

    def __init__(self, *, group: dist.ProcessGroup | DeviceMesh, layout: str, comm_dtype: torch.dtype | None = None,
                 mask_key: str | None = None, sinks_of: nn.Module | None = None, kv_exchange: str = "ring"):
        super().__init__()
        self.group, self.layout, self.comm_dtype = group, layout, comm_dtype  # comm_dtype None: K/V travel as they are
        self.kv_exchange = kv_exchange  # group: a process group, or a 2-D (U, R) mesh (Note [Ulysses in torchtitan])
        self.mask_key = mask_key
        object.__setattr__(self, "_sinks_of", sinks_of)  # a reference, not a child module

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        scale: float | None = None, enable_gqa: bool = False, is_causal: bool = True,
        block_mask: RingMask | dict[str, RingMask] | None = None, score_mod=None, return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # q, k: [B, Hq | Hkv, S_local, Dqk]; v: [B, Hkv, S_local, Dv] (GQA when Hq > Hkv, whatever enable_gqa says)
        if score_mod is not None:
            raise NotImplementedError("cp_dtensor ring attention takes no flex score_mod; torchtitan 0.2.2's models pass none.")
        mask = block_mask[self.mask_key] if isinstance(block_mask, dict) else block_mask
        ids, window = None, None
        if mask is not None:
            if not isinstance(mask, RingMask):
                raise TypeError(f"cp_dtensor ring attention got a {type(mask).__name__} mask; it needs the plugin's "
                                "RingMask (Note [Flex masks as ring masks]). Apply the plugin to the whole model.")
            ids, window, is_causal = mask.ids, mask.window_size, mask.is_causal
        sinks = None if self._sinks_of is None else self._sinks_of.sinks
        if isinstance(sinks, DTensor):  # gpt_oss under TP: sinks [Hq] placed Shard(0), q holds those local heads
            if sinks.placements != (Shard(0),):
                raise NotImplementedError(f"cp_dtensor ring attention takes TP sinks sharded over heads (Shard(0)); "
                                          f"got {sinks.placements}. Use torchtitan's gpt_oss TP plan unchanged.")
            sinks = sinks.to_local()  # [Hq / TP]
        tp_heads = tp_head_sharding(q, k, v)  # See Note [TP heads into the ring]
        if tp_heads is not None:
            q, k, v = q.to_local(), k.to_local(), v.to_local()  # [B, H / TP, S_local, D]: this TP rank's heads
        out = ring_attention(
            q, k, v, mesh=self.group, layout=self.layout, is_causal=is_causal, scale=scale,
            comm_dtype=self.comm_dtype, document_ids=ids, window_size=window, sinks=sinks,
            kv_exchange=self.kv_exchange,
        )  # out: [B, Hq, S_local, Dv]
        if tp_heads is not None:
            out = DTensor.from_local(out, *tp_heads, run_check=False)
        if not return_lse:
            return out
        if self._sinks_of is None:
            raise NotImplementedError("cp_dtensor ring attention returns an lse only for gpt_oss-style sinks "
                                      "(Note [gpt_oss sinks] in families.py); this model asked for one without sinks.")
        # gpt_oss rescales by sigmoid(lse - sinks) itself; the sinks are already in `out`, so hand it an
        # lse of +inf: sigmoid(+inf) = 1 exactly and its gradient 0. See Note [gpt_oss sinks] in families.py.
        return out, out.new_full(out.shape[:-1], float("inf"), dtype=torch.float32)

    def extra_repr(self) -> str:
        extra = "" if self.mask_key is None else f", mask_key={self.mask_key!r}"
        extra += "" if self._sinks_of is None else ", sinks"
        if isinstance(self.group, DeviceMesh):
            cp = f"cp={self.group.size()} (ulysses={self.group.size(0)} x ring={self.group.size(1)})"
        else:
            cp = f"cp={dist.get_world_size(self.group)}"
        extra += "" if self.kv_exchange == "ring" else f", kv_exchange={self.kv_exchange!r}"
        return f"layout={self.layout!r}, {cp}, comm_dtype={self.comm_dtype}{extra}"


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
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This CP rank's share of a batch; see Note [CP batch and positions].

    Same signature as torchtitan's ``prepare_context_parallel_input`` (whose place it takes), plus
    ``layout`` and ``ulysses`` (the U of Note [Ulysses in torchtitan]: the shard is then that of
    ``ulysses_shard_index``); ``load_balancer_type`` is ignored: the layout decides the balance.
    inputs, labels: [B, N] -> [B, S_local]; adds extra_kwargs["positions"]: [1, S_local]; the ids of
    extra_kwargs["attention_masks"] (RingMask or a dict of them): [B, N] -> [B, S_local].
    """
    rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
    rank = ulysses_shard_index(rank, world, ulysses)  # this rank's 1-D shard index; = rank when ulysses == 1
    seq_len = inputs.shape[1]
    # e.g. a validation seq_len that the start-up check did not see
    check_seq_len(layout, world, seq_len, fix="Change [training]/[validation] seq_len.")
    if extra_kwargs.get("attention_masks") is not None:
        extra_kwargs["attention_masks"] = shard_masks(extra_kwargs["attention_masks"], layout=layout, rank=rank, world=world)
    inputs = shard_tensor(inputs, seq_dim=1, layout=layout, rank=rank, cp_size=world)
    labels = shard_tensor(labels, seq_dim=1, layout=layout, rank=rank, cp_size=world)
    extra_kwargs["positions"] = local_positions(layout=layout, rank=rank, cp_size=world, seq_len=seq_len).to(device).unsqueeze(0)
    return inputs, labels, extra_kwargs
