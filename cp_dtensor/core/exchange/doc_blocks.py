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
its share of dq, dk, dv; the received rows' dK/dV return to their holders by the reverse all-to-all, in
the input dtype, and add into their dK/dV (a row sent to several ranks gets every share). With
``comm_dtype`` the rows travel cast or in float8 (payload.encode_rows, Note [float8 ring payload]), and
the backward uses the very values the forward received. Local rows always include the query itself, so the
local call starts every row (lse finite) and the merge never meets two -inf.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from ..._compat import function_output
from ..compute.blocks import add_sinks, sinks_grad
from ..compute.ops import masked_block_attn, masked_block_attn_backward, merge_
from ..plan.masks import Run, flat_runs
from .payload import decode_rows, encode_rows

__all__ = ["DocBlocks", "backward", "doc_attention", "doc_blocks", "forward", "received_rows", "send_rows"]


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
        qpos = lay.local_positions(rank, lay.cp_size, lay.seq_len)  # [B, S], sorted per row
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


def _received(rk: Tensor, rv: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Received rows ``index`` (rk [R, Hkv, Dqk], rv [R, Hkv, Dv]) as k [1, Hkv, K, Dqk], v [1, Hkv, K, Dv]."""
    index = index.to(rk.device)
    return (x.index_select(0, index).transpose(0, 1)[None].contiguous() for x in (rk, rv))


def _token_rows(x: Tensor) -> Tensor:
    """[B, H, S, D] -> [B * S, H, D]: one row per token, the exchange's unit."""
    b, h, s, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b * s, h, d)


def send_rows(k: Tensor, v: Tensor, ex: dict):
    """Start the exchange: this rank's needed K/V rows (in ``comm_dtype``) to their peers. Returns the
    received buffer in flight (None: nothing travels anywhere)."""
    if not ex["total"]:
        return None
    send = ex["send"].to(k.device)
    buf = encode_rows(_token_rows(k).index_select(0, send), _token_rows(v).index_select(0, send), ex["comm_dtype"])
    return funcol.all_to_all_single(buf, ex["recv_splits"], ex["send_splits"], ex["group"])


def received_rows(wire, k: Tensor, v: Tensor, ex: dict) -> tuple[Tensor, Tensor]:
    """The received rows, decoded: rk [R, Hkv, Dqk], rv [R, Hkv, Dv] in k's dtype (empty when none travel)."""
    if wire is None:
        return k.new_empty(0), v.new_empty(0)
    return decode_rows(funcol.wait_tensor(wire), k.shape[1], k.shape[3], v.shape[3], k.dtype, ex["comm_dtype"])


def forward(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, blocks: DocBlocks, ex: dict):
    """The exchange and the attention (no autograd): out [B, Hq, S, Dv] and lse [B, Hq, S] in fp32 (fp64 for
    fp64 inputs), sinks joined, and the received rows (rk, rv) the backward needs."""
    lo, hi = ex["bounds"]
    scale = ex["scale"]
    acc = torch.promote_types(q.dtype, torch.float32)
    b_, hq, s, _ = q.shape
    wire = send_rows(k, v, ex)  # in flight
    out = q.new_empty((b_, hq, s, v.shape[3]), dtype=acc)
    lse = q.new_empty((b_, hq, s), dtype=acc)
    for b in range(b_):  # the local keys while the rows travel
        ids = blocks.q_ids[b].to(q.device)
        out[b : b + 1], lse[b : b + 1] = masked_block_attn(q[b : b + 1], k[b : b + 1], v[b : b + 1], ids, ids,
                                                           blocks.q_runs[b], blocks.q_runs[b], lo, hi, scale)
    rk, rv = received_rows(wire, k, v, ex)
    for b in range(b_):
        if len(blocks.k_index[b]) == 0:
            continue
        kr, vr = _received(rk, rv, blocks.k_index[b])
        o2, l2 = masked_block_attn(q[b : b + 1], kr, vr, blocks.q_ids[b].to(q.device), blocks.k_ids[b].to(q.device),
                                   blocks.q_runs[b], blocks.k_runs[b], lo, hi, scale)
        merge_(out[b : b + 1], lse[b : b + 1], o2, l2)
    out, lse = add_sinks(out, lse, sinks)
    return out, lse, rk, rv


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, rk: Tensor, rv: Tensor, out: Tensor, lse: Tensor,
             sinks: Tensor | None, blocks: DocBlocks, ex: dict, *, sinks_grad_needed: bool = True):
    """dq, dk, dv (the dtypes of q, k, v) and dsinks (or None) from the rows' final out and lse: the local and
    the received blocks' kernel backward, then the received rows' dK/dV home by the reverse all-to-all (every
    rank joins, receiving or not)."""
    (lo, hi), scale = ex["bounds"], ex["scale"]
    dout = dout.contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    drk, drv = torch.zeros_like(rk), torch.zeros_like(rv)  # the received rows' dK / dV, input dtype
    out_q = out.to(q.dtype)
    for b in range(q.shape[0]):
        rows = slice(b, b + 1)
        ids = blocks.q_ids[b].to(q.device)
        g_q, g_kv = masked_block_attn_backward(dout[rows], q[rows], k[rows], v[rows], out_q[rows], lse[rows], ids, ids,
                                               blocks.q_runs[b], blocks.q_runs[b], lo, hi, scale)
        n = k[rows].numel()
        dk[rows], dv[rows] = g_kv[:n].view(k[rows].shape), g_kv[n:].view(v[rows].shape)
        index = blocks.k_index[b]
        if len(index):
            kr, vr = _received(rk, rv, index)
            g_q2, g_kv2 = masked_block_attn_backward(dout[rows], q[rows], kr, vr, out_q[rows], lse[rows], ids,
                                                     blocks.k_ids[b].to(q.device), blocks.q_runs[b],
                                                     blocks.k_runs[b], lo, hi, scale)
            g_q = g_q + g_q2
            m = kr.numel()
            index = index.to(rk.device)
            drk.index_copy_(0, index, g_kv2[:m].view(kr.shape)[0].transpose(0, 1).to(drk.dtype))
            drv.index_copy_(0, index, g_kv2[m:].view(vr.shape)[0].transpose(0, 1).to(drv.dtype))
        dq[rows] = g_q
    if ex["total"]:  # the rows' dK/dV go home, the forward's routes reversed
        back = funcol.all_to_all_single(torch.cat([drk.flatten(1), drv.flatten(1)], 1), ex["send_splits"],
                                        ex["recv_splits"], ex["group"])
        back = funcol.wait_tensor(back)  # [rows sent, Hkv * (Dqk + Dv)]
        send = ex["send"].to(q.device)
        hkv, dqk = k.shape[1], k.shape[3]
        tk, tv = _token_rows(dk), _token_rows(dv)  # copies in the layout [B * S, Hkv, D]
        tk.index_add_(0, send, back[:, : hkv * dqk].view(-1, hkv, dqk).to(tk.dtype))
        tv.index_add_(0, send, back[:, hkv * dqk :].view(-1, hkv, dv.shape[3]).to(tv.dtype))
        b_, _, s, _ = k.shape
        dk = tk.view(b_, s, hkv, dqk).permute(0, 2, 1, 3)
        dv = tv.view(b_, s, hkv, -1).permute(0, 2, 1, 3)
    dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and sinks_grad_needed else None
    return dq, dk, dv, dsinks


class _DocAttention(torch.autograd.Function):
    """The exchange and the attention in one autograd node (Note [Document blocks]): the forward sends
    K/V rows (in ``comm_dtype``), computes the local blocks while they travel, then the received ones;
    the backward returns the received rows' dK/dV (in the input dtype) by the reverse all-to-all."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, blocks: DocBlocks, ex: dict):
        out, lse, rk, rv = forward(q, k, v, sinks, blocks, ex)
        ctx.save_for_backward(q, k, v, rk, rv, out, lse, sinks)
        ctx.blocks, ctx.ex = blocks, ex
        return function_output(out.to(q.dtype))  # a copy on torch 2.11 compiling: Note [torch 2.11 to 2.15]

    @staticmethod
    def backward(ctx, dout):
        q, k, v, rk, rv, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = backward(dout, q, k, v, rk, rv, out, lse, sinks, ctx.blocks, ctx.ex,
                                      sinks_grad_needed=ctx.needs_input_grad[3])
        return dq, dk, dv, dsinks, None, None


def doc_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, blocks: DocBlocks, ex: dict) -> Tensor:
    """This rank's output [B, Hq, S, Dv] (q's dtype) under a document layout: the exchange of ``ex`` (the
    plan's send indices and splits, ``total``, ``bounds``, ``scale``, ``group``, ``comm_dtype``), its
    queries against its K/V and the received rows, sinks last. Differentiable in q, k, v and sinks. See
    Note [Document blocks]."""
    return _DocAttention.apply(q, k, v, sinks, blocks, ex)
