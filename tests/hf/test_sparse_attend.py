"""DeepSeek Sparse Attention's attention over the gathered picks in query chunks (cp_dtensor/hf/sparse_attend.py,
Note [DSA attention in query chunks]) against a float64 reference of the same math -- a plain gather and a masked
softmax, differentiated by autograd -- forward and every gradient, with the chunk bound forced tiny (many chunks),
invalid picks, blind rows (no valid pick) and table rows picked by many queries; and the saved-activation bound."""

from __future__ import annotations

import pytest
import torch

from cp_dtensor.hf import sparse_attend
from _ref import rel_err

H, B, T, K, DQK, DV, U = 3, 2, 11, 5, 6, 4, 9  # U < T * K: many queries share table rows


def _case(dtype=torch.float32):
    g = torch.Generator().manual_seed(5)
    query = torch.randn(B, H, T, DQK, generator=g, dtype=torch.float64)
    keys = torch.randn(H, U, DQK, generator=g, dtype=torch.float64)
    values = torch.randn(H, U, DV, generator=g, dtype=torch.float64)
    grad = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    slot = torch.randint(1, U - 1, (B, T, K), generator=g)  # row U - 1 unread, row 0 read by masked picks only
    valid = torch.rand(B, T, K, generator=g) < 0.6
    valid[0, 0] = False  # blind rows: a left pad (no valid pick) gets a zero output and no gradient
    valid[1, 4] = False
    valid[1, 5] = False
    valid[1, 6, 1:] = False  # one valid pick
    slot[~valid] = 0  # the masked picks point at row 0, as in hf/sparse.py
    return [x.to(dtype) for x in (query, keys, values, grad)] + [slot, valid]


def _reference(query, keys, values, grad, slot, valid, scaling):
    """float64: gather every query's picks, mask, softmax; autograd's gradients."""
    q, k, v = (x.detach().double().requires_grad_() for x in (query, keys, values))
    scores = torch.einsum("bhsd,hbskd->bhsk", q, k[:, slot]) * scaling
    blind = ~valid.any(-1)[:, None, :, None]
    scores = scores.masked_fill(~valid[:, None], float("-inf")).masked_fill(blind, 0.0)
    probs = torch.softmax(scores, -1).masked_fill(blind, 0.0)
    out = torch.einsum("bhsk,hbskd->bshd", probs, v[:, slot])
    out.backward(grad.double())
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("gathered", [1, H * B * K * DQK * 3, 2**26])  # a chunk of 1 query, of 3 (a ragged last), all
def test_attend_picks_matches_float64(monkeypatch, gathered):
    monkeypatch.setattr(sparse_attend, "_GATHERED", gathered)
    query, keys, values, grad, slot, valid = _case()
    scaling = DQK ** -0.5
    want = _reference(query, keys, values, grad, slot, valid, scaling)
    q, k, v = (x.clone().requires_grad_() for x in (query, keys, values))
    out = sparse_attend.attend_picks(q, k, v, slot, valid, scaling)
    out.backward(grad)
    got = (out.detach(), q.grad, k.grad, v.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32 and rel_err(a, b) <= 1e-6, (name, rel_err(a, b))
    blind = ~valid.any(-1)  # [B, T]
    assert (out.detach()[blind] == 0).all()
    assert (q.grad.permute(0, 2, 1, 3)[blind] == 0).all()
    unread = torch.ones(U, dtype=torch.bool)
    unread[slot[valid]] = False  # a table row no valid pick reads gets no gradient
    assert unread.any() and (k.grad[:, unread] == 0).all() and (v.grad[:, unread] == 0).all()


def test_attend_picks_bf16_rounding(monkeypatch):
    """bf16 query and table (the softmax in fp32): within bf16's rounding of the float64 reference."""
    monkeypatch.setattr(sparse_attend, "_GATHERED", H * B * K * DQK * 2)
    query, keys, values, grad, slot, valid = _case(torch.bfloat16)
    want = _reference(query, keys, values, grad, slot, valid, DQK ** -0.5)
    q, k, v = (x.clone().requires_grad_() for x in (query, keys, values))
    out = sparse_attend.attend_picks(q, k, v, slot, valid, DQK ** -0.5)
    out.backward(grad)
    for a, b in zip((out.detach(), q.grad, k.grad, v.grad), want):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) <= 3e-2


def test_attend_picks_saves_no_gathered_tensor(monkeypatch):
    """What autograd keeps for backward: the query, the table, slot, valid and the lse -- no [H, B, T, K, D]
    gather (the plain path kept the gathered keys, values and probabilities)."""
    monkeypatch.setattr(sparse_attend, "_GATHERED", 1)
    query, keys, values, grad, slot, valid = _case()
    q, k, v = (x.clone().requires_grad_() for x in (query, keys, values))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        sparse_attend.attend_picks(q, k, v, slot, valid, 1.0)
    assert sum(saved) == q.numel() + k.numel() + v.numel() + 2 * slot.numel() + B * H * T, saved
