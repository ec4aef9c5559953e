"""The document exchange's attention: a rank's queries against its own K/V and against the rows it
received, by the ring's masked block kernels (``cp_dtensor::masked_block_attn`` and its backward, ops.py).

Note [Document blocks]
~~~~~~~~~~~~~~~~~~~~~~
A rank of a ``DocumentLayout`` holds sorted global positions: a few intervals per row (whole documents,
head-tail pieces). The rows it receives (doc_exchange.py) are sorted per row too, so both sides are short
lists of runs of stride 1 (masks.Run) -- what the ring's masked steps take. Per batch row, one masked
block call against the local K/V and one against the received rows give two partial results (out, lse)
under the documents, causality and the window, kernel by kept rectangle (no [S, K] scores anywhere);
they merge by their log-sum-exp (Note [Online softmax merge] in blocks.py) and the sinks join last. The
backward is the ring's: given the rows' final out and lse, each block's kernel backward yields exactly
its share of dq, dk, dv; the received rows' dK/dV go back into the received buffer's layout, and the
all-to-all's backward returns them to their holders. Local rows always include the query itself, so the
local call starts every row (lse finite) and the merge never meets two -inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .blocks import add_sinks, sinks_grad
from .masks import Run, flat_runs
from .ops import masked_block_attn, masked_block_attn_backward, merge_

__all__ = ["DocBlocks", "doc_blocks", "doc_attention"]


def _runs(pos: list[int]) -> list[int]:
    """Sorted global positions -> flat runs of stride 1 (local index, count, first position, 1)."""
    out: list[Run] = []
    for i, p in enumerate(pos):
        if out and out[-1].base + out[-1].count == p:
            last = out[-1]
            out[-1] = Run(last.start, last.count + 1, last.base, 1)
        else:
            out.append(Run(i, 1, p, 1))
    return flat_runs(tuple(out))


class DocBlocks:
    """Per batch row: the local runs and ids, and the received rows in position order (their indices into
    the received buffer, runs and ids). Built once per (layout, rank, mask) with the exchange plan."""

    def __init__(self, lay, rank: int, plan: dict):
        qpos = lay.local_positions(rank, lay.world, lay.seq_len)  # [B, S], sorted per row
        qids = lay.local_ids(rank)
        self.q_runs, self.q_ids, self.k_index, self.k_runs, self.k_ids = [], [], [], [], []
        for b in range(lay.batch):
            self.q_runs.append(_runs(qpos[b].tolist()))
            self.q_ids.append(qids[b : b + 1].contiguous())
            pos, rows = plan["pos"][b], plan["rows"][b]
            order = torch.argsort(pos)
            pos, rows = pos[order], rows[order]
            self.k_index.append(rows)
            self.k_runs.append(_runs(pos.tolist()))
            self.k_ids.append(lay.ids[b, pos][None].contiguous())


def doc_blocks(lay, rank: int, plan: dict) -> DocBlocks:
    """The cached :class:`DocBlocks` of an exchange plan (the plan is cached on the layout)."""
    if "blocks" not in plan:
        plan["blocks"] = DocBlocks(lay, rank, plan)
    return plan["blocks"]


def _received(recv: Tensor, index: Tensor, hkv: int, dqk: int) -> tuple[Tensor, Tensor]:
    """Rows ``index`` of the received buffer [R, Hkv * (Dqk + Dv)] as k [1, Hkv, K, Dqk], v [1, Hkv, K, Dv]."""
    got = recv.index_select(0, index.to(recv.device))
    k = got[:, : hkv * dqk].view(len(index), hkv, dqk).transpose(0, 1)[None].contiguous()
    v = got[:, hkv * dqk :].view(len(index), hkv, -1).transpose(0, 1)[None].contiguous()
    return k, v


class _DocAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, recv, sinks, blocks: DocBlocks, bounds, scale):
        lo, hi = bounds
        acc = torch.promote_types(q.dtype, torch.float32)
        b_, hq, s, _ = q.shape
        hkv, dqk = k.shape[1], k.shape[3]
        out = q.new_empty((b_, hq, s, v.shape[3]), dtype=acc)
        lse = q.new_empty((b_, hq, s), dtype=acc)
        for b in range(b_):  # the local keys first: the received rows may still be in flight
            ids = blocks.q_ids[b].to(q.device)
            out[b : b + 1], lse[b : b + 1] = masked_block_attn(q[b : b + 1], k[b : b + 1], v[b : b + 1], ids, ids,
                                                               blocks.q_runs[b], blocks.q_runs[b], lo, hi, scale)
        for b in range(b_):
            if recv is None or len(blocks.k_index[b]) == 0:
                continue
            kr, vr = _received(recv, blocks.k_index[b], hkv, dqk)
            o2, l2 = masked_block_attn(q[b : b + 1], kr, vr, blocks.q_ids[b].to(q.device), blocks.k_ids[b].to(q.device),
                                       blocks.q_runs[b], blocks.k_runs[b], lo, hi, scale)
            merge_(out[b : b + 1], lse[b : b + 1], o2, l2)
        out, lse = add_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, recv if recv is not None else q.new_empty(0), out, lse, sinks)
        ctx.blocks, ctx.bounds, ctx.scale, ctx.has_recv = blocks, bounds, scale, recv is not None
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, recv, out, lse, sinks = ctx.saved_tensors
        blocks, (lo, hi), scale = ctx.blocks, ctx.bounds, ctx.scale
        hkv, dqk = k.shape[1], k.shape[3]
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        drecv = torch.zeros_like(recv) if ctx.has_recv else None
        out_q = out.to(q.dtype)
        for b in range(q.shape[0]):
            rows = slice(b, b + 1)
            ids = blocks.q_ids[b].to(q.device)
            g_q, g_kv = masked_block_attn_backward(dout[rows], q[rows], k[rows], v[rows], out_q[rows], lse[rows], ids, ids,
                                                   blocks.q_runs[b], blocks.q_runs[b], lo, hi, scale)
            n = k[rows].numel()
            dk[rows], dv[rows] = g_kv[:n].view(k[rows].shape), g_kv[n:].view(v[rows].shape)
            index = blocks.k_index[b]
            if drecv is not None and len(index):
                kr, vr = _received(recv, index, hkv, dqk)
                g_q2, g_kv2 = masked_block_attn_backward(dout[rows], q[rows], kr, vr, out_q[rows], lse[rows], ids,
                                                         blocks.k_ids[b].to(q.device), blocks.q_runs[b],
                                                         blocks.k_runs[b], lo, hi, scale)
                g_q = g_q + g_q2
                m = kr.numel()
                dkr = g_kv2[:m].view(kr.shape)[0].transpose(0, 1).reshape(len(index), -1)  # [K, Hkv * Dqk]
                dvr = g_kv2[m:].view(vr.shape)[0].transpose(0, 1).reshape(len(index), -1)
                drecv.index_copy_(0, index.to(drecv.device), torch.cat([dkr, dvr], 1).to(drecv.dtype))
            dq[rows] = g_q
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[4] else None
        return dq, dk, dv, drecv, dsinks, None, None, None


def doc_attention(q: Tensor, k: Tensor, v: Tensor, recv: Tensor | None, sinks: Tensor | None, blocks: DocBlocks,
                  bounds: tuple, scale: float) -> Tensor:
    """This rank's output [B, Hq, S, Dv] (q's dtype): its queries against its K/V and the received rows
    (``recv``: [R, Hkv * (Dqk + Dv)] or None), sinks last. Differentiable in q, k, v, recv and sinks. See
    Note [Document blocks]."""
    return _DocAttention.apply(q, k, v, recv, sinks, blocks, bounds, scale)
