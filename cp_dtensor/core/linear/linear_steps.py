"""Decoding a linear-attention layer: one step on the full (replicated) state, on every rank alike, no
communication -- what generate() runs after :func:`~cp_dtensor.core.linear.linear_attention.sharded_delta_rule`'s
prefill (Note [Prefill for decoding] in linear_attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_conv1d_step", "delta_rule_step"]


def causal_conv1d_step(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None = None,
                       activation: str | None = None) -> Tensor:
    """The causal conv for T new tokens x [B, C, T] continuing from ``conv_state`` [B, C, W] (the last W >= K - 1
    inputs, as :func:`sharded_causal_conv1d` returns with ``output_final_state=True``); weight [C, K]. Updates
    ``conv_state`` in place (its last W inputs) and returns [B, C, T] in x's dtype. Local: every rank runs it
    on the same inputs and gets the same bits (Note [Prefill for decoding])."""
    c, kk = weight.shape
    if x.dim() != 3 or conv_state.dim() != 3 or conv_state.shape[:2] != x.shape[:2] or conv_state.shape[2] < kk - 1:
        raise ValueError(f"causal_conv1d_step: x must be [B, C, T] and conv_state [B, C, W >= K - 1 = {kk - 1}] with "
                         f"C = {c}; got x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}.")
    full = torch.cat([conv_state.to(x.dtype), x], -1)  # [B, C, W + T]
    conv_state.copy_(full[..., -conv_state.shape[2]:])
    out = F.conv1d(full[..., -(x.shape[2] + kk - 1):].to(weight.dtype), weight.unsqueeze(1), bias, groups=c)
    return (out if activation is None else F.silu(out)).to(x.dtype)


def delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
                    use_qk_l2norm: bool = False, scale: float | None = None) -> Tensor:
    """The gated delta rule for T new tokens, token by token, from ``state`` [B, Hv, dk, dv] (as
    :func:`sharded_delta_rule` returns with ``output_final_state=True``), updated in place. q, k [B, T, Hk, dk];
    v [B, T, Hv, dv]; g [B, T, Hv] (GDN) or [B, T, Hv, dk] (KDA); beta [B, T, Hv]. Computes in the state's dtype
    (fp32 or fp64); returns o [B, T, Hv, dv] in q's dtype. Local: every rank runs it on the same inputs and gets
    the same bits (Note [Prefill for decoding]). The math of Note [Linear attention under CP]."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if state.shape != (b, hv, dk, dv) or hv % hk or k.shape != q.shape or tuple(beta.shape) != (b, t, hv):
        raise ValueError(f"delta_rule_step: q, k [B, T, Hk, dk], v [B, T, Hv, dv], beta [B, T, Hv], state [B, Hv, dk, "
                         f"dv] with Hk dividing Hv; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, beta "
                         f"{tuple(beta.shape)}, state {tuple(state.shape)}.")
    dtype, out_dtype = state.dtype, q.dtype
    q, k = (x.to(dtype).repeat_interleave(hv // hk, 2) for x in (q, k))  # each key head serves Hv / Hk value heads
    if use_qk_l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (dk ** -0.5 if scale is None else scale)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    s = state
    outs = []
    for i in range(t):
        gate = g[:, i].exp()
        s = s * (gate[..., None, None] if g.dim() == 3 else gate[..., None])  # S <- diag(exp g) S
        kt = k[:, i]
        delta = (v[:, i] - (s * kt[..., None]).sum(-2)) * beta[:, i, :, None]  # beta (v - S^T k)
        s = s + kt[..., :, None] * delta[..., None, :]
        outs.append((s * q[:, i][..., None]).sum(-2))  # o = S^T q
    state.copy_(s)
    return torch.stack(outs, 1).to(out_dtype)
