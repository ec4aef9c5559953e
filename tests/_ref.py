"""Independent references: float64 single-device attention on tensors every rank builds alike."""

from __future__ import annotations

import torch


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


def masked_reference(q, k, v, do, *, is_causal: bool, scale=None, document_ids=None, window_size=None, sinks=None):
    """Full-sequence float64 attention under a dense boolean mask (documents [B, N], window (left, right),
    causal) with optional per-head sinks [Hq]; returns out, dq, dk, dv and dsinks (None without sinks)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    sk = None if sinks is None else sinks.detach().double().requires_grad_()
    groups = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ ke.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    n = q.shape[2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool)
    if is_causal:
        keep &= j <= i
    if window_size is not None:
        left, right = window_size
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    keep = keep.expand(q.shape[0], 1, n, n)
    if document_ids is not None:
        keep = keep & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    s = s.masked_fill(~keep, float("-inf"))
    if sk is not None:  # one more logit per row, with no value
        p = torch.softmax(torch.cat([s, sk[None, :, None, None].expand(*s.shape[:3], 1)], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    out = p @ ve
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad, (None if sk is None else sk.grad)


def abs_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1): relative to the largest magnitude, absolute where the reference
    is (near) zero -- e.g. the gradients of a query that attends only to itself."""
    return ((a.double() - b.double()).abs().max() / max(b.double().abs().max().item(), 1.0)).item()


# -- linear attention (the gated delta rule) ------------------------------------------------------------

def recurrence(q, k, v, g, beta, *, state=None, reset=None, l2norm=True):
    """The gated delta rule token by token: S = (I - beta k k^T) diag(exp g) S + beta k v^T, o = S^T q.
    q, k [B, N, Hk, dk]; v [B, N, Hv, dv]; g [B, N, Hv] or [B, N, Hv, dk]; beta [B, N, Hv]; ``reset`` [B, N]
    bool: the state restarts at that token (a document start). Returns o [B, N, Hv, dv], S [B, Hv, dk, dv]."""
    b, n, hk, dk = q.shape
    hv, dv = v.shape[2:]
    q, k = (x.repeat_interleave(hv // hk, 2) for x in (q, k))
    if l2norm:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * dk ** -0.5
    s = v.new_zeros(b, hv, dk, dv) if state is None else state.to(v.dtype)
    outs = []
    for t in range(n):
        if reset is not None:
            s = s * (~reset[:, t]).to(s.dtype)[:, None, None, None]
        gate = g[:, t].exp()
        s = s * (gate[..., None, None] if g.dim() == 3 else gate[..., None])
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        s = s + bt[..., None, None] * kt[..., :, None] * (vt - (s * kt[..., None]).sum(-2))[..., None, :]
        outs.append((s * q[:, t][..., None]).sum(-2))
    return torch.stack(outs, 1), s


def f64_kernel(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **_):
    """A float64 kernel with transformers' signature (the recurrence): the CP machinery alone, to 1e-9."""
    o, s = recurrence(q, k, v, g, beta, state=initial_state, l2norm=use_qk_l2norm_in_kernel)
    return o.to(q.dtype), s if output_final_state else None
