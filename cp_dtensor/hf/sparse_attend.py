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
* backward, per chunk: gather again, recompute the scores, the probabilities ``p = exp(s - lse)`` (fp32; the
  invalid picks and the blind rows 0: their ``s`` is -inf), then the softmax's gradient
  ``ds = p * (dp - sum_k p * dp) * scaling`` with ``dp = dO . v`` (fp32), ``dQ = ds . k``; the table's
  gradients ``dK[slot, h] += ds * q`` and ``dV[slot, h] += p * dO`` are formed in fp32 and scattered by
  ``index_add_`` (over rows: [U, H, D] buffers) -- a row picked by many queries sums all their
  contributions -- and cast to the table's dtype at the end (autograd's gather would have summed them in
  the table's dtype: in bf16 this is the more exact of the two).

What is saved for backward is the query, the table, ``slot``, ``valid`` and ``lse``:
O(B * H * T * Dqk + H * U * (Dqk + Dv) + B * T * K + B * H * T), none of it O(T * K * H * D); at any
moment one chunk's gather (and in backward its gradients, about four of them) is alive. The forward
computes what the plain gather computed (the same ops on each chunk), so the logits are unchanged; the
backward's probabilities come from ``lse`` instead of a second softmax, equal within fp32 rounding. The cost
is a second gather and q . k a chunk in backward (CPU, bf16, ``bench_dsa.py --memory``: about 1.5x the plain
step's time; the step is a small part of a layer).
Training and turns (``compact``: only the table rows some pick reads are expanded) use the same Function.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attend_picks", "chunk_queries"]

_GATHERED = 2**27  # the most gathered key numbers a query chunk holds ([H, B, T_chunk, K, Dqk]): a bound on memory


def chunk_queries(heads: int, batch: int, picks: int, dim: int) -> int:
    """Queries a chunk attends: at most ``_GATHERED`` gathered key numbers, one query at least."""
    return max(1, _GATHERED // max(1, heads * batch * picks * dim))


def attend_picks(query: Tensor, keys: Tensor, values: Tensor, slot: Tensor, valid: Tensor, scaling: float) -> Tensor:
    """query [B, H, T, Dqk] over its picks: ``slot`` [B, T, K] rows of the expanded ``keys`` [H, U, Dqk] /
    ``values`` [H, U, Dv] where ``valid`` [B, T, K]; in query chunks (Note [DSA attention in query chunks]).
    Returns [B, T, H, Dv]."""
    return _AttendPicks.apply(query, keys, values, slot, valid, scaling)


def _scores(q: Tensor, keys: Tensor, valid: Tensor, scaling: float) -> Tensor:
    """[B, H, t, K] fp32: q [B, H, t, D] . its gathered ``keys`` [H, B, t, K, D], scaled in q's dtype, the invalid
    picks -inf."""
    scores = torch.einsum("bhsd,hbskd->bhsk", q, keys) * scaling
    return scores.float().masked_fill(~valid[:, None], float("-inf"))


class _AttendPicks(torch.autograd.Function):

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, values: Tensor, slot: Tensor, valid: Tensor, scaling: float):
        bsz, heads, t = query.shape[:3]
        step = chunk_queries(heads, bsz, slot.shape[-1], keys.shape[-1])
        outs, lses = [], []
        for lo in range(0, t, step):
            sl, vd = slot[:, lo:lo + step], valid[:, lo:lo + step]
            scores = _scores(query[:, :, lo:lo + step], keys[:, sl], vd, scaling)
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
        heads, u = keys.shape[:2]
        dk = keys.new_zeros((u, heads, keys.shape[-1]), dtype=torch.float32) if want_k else None  # [U, H, Dqk]
        dv = values.new_zeros((u, heads, values.shape[-1]), dtype=torch.float32) if want_v else None  # [U, H, Dv]
        for lo in range(0, t, step):
            q, sl, vd, do = query[:, :, lo:lo + step], slot[:, lo:lo + step], valid[:, lo:lo + step], \
                grad[:, lo:lo + step]
            kg = keys[:, sl]  # [H, B, t, K, Dqk]: the chunk's gather, again
            probs = torch.exp(_scores(q, kg, vd, scaling) - lse[:, :, lo:lo + step, None])  # [B, H, t, K] fp32; 0
            # where masked or blind
            at = sl.reshape(-1)  # [B * t * K]: the table rows, in the gathered order
            if want_v:  # dV[slot, h] += p * dO, the products in fp32
                dv.index_add_(0, at, torch.einsum("bhsk,bshd->bskhd", probs, do.float()).reshape(at.numel(), heads, -1))
            dp = torch.einsum("bshd,hbskd->bhsk", do, values[:, sl]).float()
            ds = probs * (dp - (probs * dp).sum(-1, keepdim=True)) * scaling  # the softmax's gradient, fp32
            if want_q:
                dq[:, :, lo:lo + step] = torch.einsum("bhsk,hbskd->bhsd", ds.to(query.dtype), kg)
            if want_k:  # dK[slot, h] += ds * q
                dk.index_add_(0, at, torch.einsum("bhsk,bhsd->bskhd", ds, q.float()).reshape(at.numel(), heads, -1))
        return (dq, None if dk is None else dk.transpose(0, 1).to(keys.dtype),
                None if dv is None else dv.transpose(0, 1).to(values.dtype), None, None, None)
