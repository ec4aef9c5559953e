"""The one adapter between torchtitan's inner attention calls and ``ring_attention``, for both glues:
0.2.2's ``RingAttention`` (q, k, v [B, H, S_local, D]) and 0.3's ``RingInnerAttention`` ([B, S_local, H, D])
hold their options here and call :meth:`RingInner.ring` with the mask their model passed.

What both need, once: no flex ``score_mod``; gpt_oss's ``sinks`` read from the attention module at every
call (FSDP swaps the parameter object) and, under TP, taken as this rank's heads (Shard(0)); TP-sharded
q, k, v DTensors run the ring on their local heads and come back as the same placement (Note [TP heads
into the ring] in v02/attention.py, Note [0.3 TP heads into the ring] in v03/attention.py); the log-sum-exp
gpt_oss asks for is +inf, the sinks being in the output already (Note [gpt_oss sinks] in v02/families.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ...core.attention import ring_attention
from .heads import tp_head_sharding

__all__ = ["RingInner", "infinite_lse"]


def infinite_lse(out: torch.Tensor) -> torch.Tensor:
    """The lse handed to gpt_oss's rescale: +inf, so ``sigmoid(lse - sinks)`` is exactly 1 with zero
    gradient (the sinks are already in ``out``). ``out``: [..., Dv] -> [...] fp32."""
    return out.new_full(out.shape[:-1], float("inf"), dtype=torch.float32)


class RingInner(nn.Module):
    """Ring attention over ``group`` (a process group, or a 2-D (U, R) mesh: Note [Ulysses in torchtitan])
    in ``layout``, with ``comm_dtype`` / ``kv_exchange`` as ``ring_attention`` takes them. ``sinks_of``: the
    attention module whose ``sinks`` join the softmax (gpt_oss); a reference, not a child module."""

    version = "torchtitan"  #: named in the refusals

    def __init__(self, *, group: dist.ProcessGroup | DeviceMesh, layout: str, comm_dtype: torch.dtype | None = None,
                 kv_exchange: str = "ring", sinks_of: nn.Module | None = None):
        super().__init__()
        self.group, self.layout, self.comm_dtype, self.kv_exchange = group, layout, comm_dtype, kv_exchange
        object.__setattr__(self, "_sinks_of", sinks_of)

    @property
    def has_sinks(self) -> bool:
        return self._sinks_of is not None

    def ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, heads_dim: int, ids, window, is_causal: bool,
             scale: float | None, score_mod=None, out_transform=None, plan=None) -> torch.Tensor:
        """The ring on q, k, v whose heads are dim ``heads_dim`` (1: [B, H, S, D]; 2: [B, S, H, D]); the
        output in the same layout (and, under TP, the same DTensor placement) as q. ``out_transform``
        (0.3's gpt_oss) runs on the local heads, with :func:`infinite_lse`. ``plan``: the step's plan the
        mask carries (a ``DocumentLayout``; None: ``self.layout``): Note [One plan per torchtitan batch]."""
        if score_mod is not None:
            raise NotImplementedError(f"cp_dtensor ring attention takes no flex score_mod; {self.version}'s models "
                                      "pass none.")
        layout = self.layout if plan is None else plan
        if layout == "documents":  # See Note [One plan per torchtitan batch]: the masks bring the step's plan
            raise ValueError("cp_dtensor ring attention: layout documents needs the batch's plan, and this call's mask "
                             "carries none. The plugin's batch sharding (shard_cp_batch) makes it; shard the batch "
                             "through it, with the model's own masks.")
        sinks = None if self._sinks_of is None else self._sinks_of.sinks
        if isinstance(sinks, DTensor):  # gpt_oss under TP: sinks [Hq] placed Shard(0), q holds those local heads
            if sinks.placements != (Shard(0),):
                raise NotImplementedError(f"cp_dtensor ring attention takes TP sinks sharded over heads (Shard(0)); "
                                          f"got {sinks.placements}. Use torchtitan's gpt_oss TP plan unchanged.")
            sinks = sinks.to_local()  # [Hq / TP]
        tp_heads = tp_head_sharding(q, k, v, heads_dim=heads_dim)
        if tp_heads is not None:
            q, k, v = q.to_local(), k.to_local(), v.to_local()  # this TP rank's heads only
        if heads_dim == 2:  # [B, S_local, H, D] -> [B, H, S_local, D]
            q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        out = ring_attention(
            q, k, v, mesh=self.group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=self.comm_dtype,
            document_ids=ids, window_size=window, sinks=sinks, kv_exchange=self.kv_exchange,
        )  # [B, Hq (/ TP), S_local, Dv]
        if heads_dim == 2:
            out = out.transpose(1, 2)
        if out_transform is not None:  # on local heads, as torchtitan's local_map calls it
            out = out_transform(out, infinite_lse(out))
        if tp_heads is not None:
            out = DTensor.from_local(out, *tp_heads, run_check=False)
        return out

    def extra_repr(self) -> str:
        if isinstance(self.group, DeviceMesh) and self.group.ndim == 2:
            cp = f"cp={self.group.size()} (ulysses={self.group.size(0)} x ring={self.group.size(1)})"
        else:
            cp = f"cp={self.group.size() if isinstance(self.group, DeviceMesh) else dist.get_world_size(self.group)}"
        extra = "" if self.kv_exchange == "ring" else f", kv_exchange={self.kv_exchange!r}"
        extra += "" if self._sinks_of is None else ", sinks"
        return f"layout={self.layout!r}, {cp}, comm_dtype={self.comm_dtype}{extra}"
