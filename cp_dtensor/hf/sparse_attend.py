"""DeepSeek Sparse Attention's step 3 under CP: each query over its gathered picks, in query chunks whose
backward recomputes the gather (Note [DSA attention in query chunks]).

Note [DSA attention in query chunks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Step 3 of Note [DeepSeek Sparse Attention under CP] (hf/sparse.py) attends each query to its
``index_topk`` = K picks: rows ``slot`` [B, T, K] of the expanded table ``keys`` / ``values`` [H, U, D]
(the held and received latent rows, ``kv_b_proj`` applied once). Gathered for every query at once that is
[H, B, T, K, D] numbers, and autograd would keep the gathered keys, values and probabilities until
backward: at DeepSeek-V3.2's sizes (H = 128, Dqk = 192, Dv = 128, K = 2048) 2 * 128 * 2048 * (192 + 128)
= 168 M bytes a query in bf16, 688 GB for a rank's 4096 queries -- where the table itself is
H * (Dqk + Dv) numbers a row (80 KB in bf16) and the picks index it.

So the attention is one autograd Function over query chunks of at most ``_GATHERED`` gathered key numbers
(H * B * T_chunk * K * Dqk):

* forward, per chunk: gather the chunk's keys and values by ``slot``; scores ``q . k * scaling`` in the
  query's dtype; the invalid picks (outside the causal prefix, the padding, another document) -inf; the
  softmax in fp32, as the plain path and transformers' eager kernel compute it; a query with no valid pick
  (a left pad: a "blind" row) gets a zero output, as SDPA gives a fully masked row. It keeps the chunk's
  output and its rows' log-sum-exp ``lse`` [B, H, T_chunk] (fp32; 0 for a blind row), nothing gathered;
* backward, per chunk: gather again, recompute the scores, the probabilities ``p = exp(s - lse)`` (the
  invalid picks and the blind rows 0: their ``s`` is -inf), then the softmax's gradient
  ``ds = p * (dp - sum_k p * dp)`` with ``dp = dO . v`` (fp32), and
  ``dQ = ds . k * scaling``; the table's gradients ``dK[h, slot] += ds * q * scaling`` and
  ``dV[h, slot] += p * dO`` are scattered by ``index_add_`` into fp32 [H, U, D] buffers (a row picked by
  many queries sums all their contributions), cast to the table's dtype at the end.

What is saved for backward is the query, the table, ``slot``, ``valid`` and ``lse``:
O(B * H * T * Dqk + H * U * (Dqk + Dv) + B * T * K + B * H * T), none of it O(T * K * H * D); at any
moment one chunk's gather (and in backward its gradients, about four of them) is alive. The forward
computes what the plain gather computed (the same ops on each chunk), so the logits are unchanged; the
backward's probabilities come from ``lse`` instead of a second softmax, equal within fp32 rounding.
Training and turns (``compact``: only the table rows some pick reads are expanded) use the same Function.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attend_picks", "chunk_queries"]

_GATHERED = 2**26  # the most gathered key numbers a query chunk holds ([H, B, T_chunk, K, Dqk]): a bound on memory


def chunk_queries(heads: int, batch: int, picks: int, dim: int) -> int:
    """Queries a chunk attends: at most ``_GATHERED`` gathered key numbers, one query at least."""
    return max(1, _GATHERED // max(1, heads * batch * picks * dim))


def attend_picks(query: Tensor, keys: Tensor, values: Tensor, slot: Tensor, valid: Tensor, scaling: float) -> Tensor:
    """query [B, H, T, Dqk] over its picks: ``slot`` [B, T, K] rows of the expanded ``keys`` [H, U, Dqk] /
    ``values`` [H, U, Dv] where ``valid`` [B, T, K]; in query chunks (Note [DSA attention in query chunks]).
    Returns [B, T, H, Dv]."""
    return _AttendPicks.apply(query, keys, values, slot, valid, scaling)


def _scores(q: Tensor, keys: Tensor, slot: Tensor, valid: Tensor, scaling: float) -> Tensor:
    """[B, H, t, K] fp32: q [B, H, t, D] . its gathered keys, scaled in q's dtype, the invalid picks -inf."""
    scores = torch.einsum("bhsd,hbskd->bhsk", q, keys[:, slot]) * scaling
    return scores.float().masked_fill(~valid[:, None], float("-inf"))


class _AttendPicks(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, values: Tensor, slot: Tensor, valid: Tensor, scaling: float):
        bsz, heads, t = query.shape[:3]
        step = chunk_queries(heads, bsz, slot.shape[-1], keys.shape[-1])
        outs, lses = [], []
        for lo in range(0, t, step):
            sl, vd = slot[:, lo:lo + step], valid[:, lo:lo + step]
            scores = _scores(query[:, :, lo:lo + step], keys, sl, vd, scaling)
            blind = ~vd.any(-1)[:, None, :, None]  # [B, 1, t, 1]: a query that sees no key (left padding) gets 0
            probs = torch.softmax(scores.masked_fill(blind, 0.0), dim=-1).masked_fill(blind, 0.0).to(query.dtype)
            outs.append(torch.einsum("bhsk,hbskd->bshd", probs, values[:, sl]))
            lses.append(torch.logsumexp(scores, dim=-1).masked_fill(blind[..., 0], 0.0))  # [B, H, t]
        ctx.save_for_backward(query, keys, values, slot, valid, torch.cat(lses, -1))
        ctx.scaling, ctx.step = scaling, step
        return torch.cat(outs, 1)  # [B, T, H, Dv]

    @staticmethod
    def backward(ctx, grad: Tensor):  # grad: [B, T, H, Dv]
        query, keys, values, slot, valid, lse = ctx.saved_tensors
        scaling, step, t = ctx.scaling, ctx.step, query.shape[2]
        want_q, want_k, want_v = ctx.needs_input_grad[:3]
        dq = torch.empty_like(query) if want_q else None
        dk = keys.new_zeros(keys.shape, dtype=torch.float32) if want_k else None  # [H, U, Dqk]
        dv = values.new_zeros(values.shape, dtype=torch.float32) if want_v else None  # [H, U, Dv]
        heads = keys.shape[0]
        for lo in range(0, t, step):
            q, sl, vd, do = query[:, :, lo:lo + step], slot[:, lo:lo + step], valid[:, lo:lo + step], \
                grad[:, lo:lo + step]
            probs = torch.exp(_scores(q, keys, sl, vd, scaling) - lse[:, :, lo:lo + step, None])  # [B, H, t, K] fp32
            p = probs.to(query.dtype)
            at = sl.reshape(-1)  # [B * t * K]: the table rows, in the gathered order
            if want_v:  # dV[h, slot] += p * dO
                dv.index_add_(1, at, torch.einsum("bhsk,bshd->hbskd", p, do).reshape(heads, at.numel(), -1).float())
            dp = torch.einsum("bshd,hbskd->bhsk", do, values[:, sl]).float()
            ds = (probs * (dp - (probs * dp).sum(-1, keepdim=True))).to(query.dtype) * scaling  # the softmax's grad
            if want_q:
                dq[:, :, lo:lo + step] = torch.einsum("bhsk,hbskd->bhsd", ds, keys[:, sl])
            if want_k:  # dK[h, slot] += ds * q
                dk.index_add_(1, at, torch.einsum("bhsk,bhsd->hbskd", ds, q).reshape(heads, at.numel(), -1).float())
        return (dq, None if dk is None else dk.to(keys.dtype), None if dv is None else dv.to(values.dtype), None,
                None, None)
