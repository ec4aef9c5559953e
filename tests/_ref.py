"""Independent references: float64 single-device attention on tensors every rank builds alike."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def make_qkv(seed: int, b: int, hq: int, hkv: int, n: int, d: int, *, scale: float = 1.0):
    """Global q, k, v and an output gradient, identical on every rank (float64)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    do = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64)
    return q, k, v, do


def reference(q, k, v, do, *, is_causal: bool, scale: float | None = None):
    """Full-sequence float64 attention by the textbook formula, and its gradients."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ ke.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(s, -1) @ ve
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
