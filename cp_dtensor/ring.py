"""The ring loop, forward and backward, parameterised by layout: one loop for every layout.

Note [Online softmax merge]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Softmax over a row needs the whole row, but a ring rank only ever sees one K/V block of it at a time.
Each block's kernel returns its normalised output o_b and its log-sum-exp lse_b = log sum_j exp(s_j).
Two partial results of disjoint key sets combine exactly:

    lse = logaddexp(lse_a, lse_b)
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)
        = o_a - sigmoid(lse_b - lse_a) * (o_a - o_b)            # stable merge: no exp() can overflow

We accumulate o and lse in fp32 whatever the input dtype, and start from the local (diagonal) block,
which every row attends to, so no row ever merges two -inf log-sum-exps.

Note [Ring backward]
~~~~~~~~~~~~~~~~~~~~
With the final o and lse of the forward, the kernel's backward on one block yields exactly that
block's share of dq, dk, dv (P = exp(s - lse) and D = rowsum(do * o) are those of the full rows).
dq stays local. K/V rotate again as in the forward; the dK/dV of the block a rank holds at step t >= 1
travel in an accumulator that rides one step behind: rank r adds its share of block (r - t) and sends
the sum to r + 1, which holds that block at step t + 1. After the last step the accumulator arrives
at the block's owner, which adds its own (step 0) share. So K/V and dK/dV each travel P - 1 times.

Note [Backward in head chunks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The backward's peak memory is reached inside a step t >= 1: the K/V block held and the next one
arriving, the accumulator being sent and the next one arriving, plus the kernel's fresh dq, dk, dv
for the block. dq alone is as big as q, Hq heads -- for Llama-like GQA (Hq = 8 Hkv) four times the
whole K/V block. On CPU the backward kernel parallelises over (batch, head) pairs only, so calling it
per group of KV heads (with their Hq / Hkv query heads) loses no parallelism as long as every call
still has one pair per thread; each call's dq then goes straight into the accumulator, and the
transient shrinks to one group's. dk and dv go straight into the accumulator's layout, so there is no
separate copy for the send. CUDA (whose kernels want every head at once) and compiled graphs
(Inductor plans memory itself) call the kernel once per block.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import check_ring_args
from .comm import RingComm, unpack
from .payload import decode_kv, encode_kv
from .layout import step_block
from .ops import block_attn, block_attn_backward

__all__ = ["ring_attention", "ring_forward", "ring_backward"]


def _merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    # See Note [Online softmax merge]. out: [B, H, S, D] fp32 (a view), lse: [B, H, S] fp32 (a view)
    w = torch.sigmoid(lse_b - lse).unsqueeze(-1)
    out.lerp_(out_b.to(out.dtype), w)  # out + w * (out_b - out)
    lse.copy_(torch.logaddexp(lse, lse_b))


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float,
    comm_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Unchecked ring forward on local shards. q: [B, Hq, S, D]; k, v: [B, Hkv, S, D].
    Returns out: [B, Hq, S, D] in q's dtype and lse: [B, Hq, S] fp32 (fp64 for fp64 inputs)."""
    comm = RingComm(group)
    world, rank, s_local = comm.world, comm.rank, q.shape[2]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    out = lse = None
    kv = encode_kv(k, v, comm_dtype) if world > 1 else None
    for step in range(world):
        if step + 1 < world:
            kv_next = comm.rotate(kv)  # posted before this step's compute: overlap
        kb, vb = (k, v) if step == 0 else decode_kv(kv, k, v, comm_dtype)
        blk = step_block(layout, rank=rank, src=comm.src_at(step), world=world, s_local=s_local, is_causal=is_causal)
        if blk is not None:
            q_rows, kv_rows = (slice(None), slice(None), blk.q_rows), (slice(None), slice(None), blk.kv_rows)
            out_b, lse_b = block_attn(q[q_rows], kb[kv_rows], vb[kv_rows], blk.causal, scale)
            if out is None:  # step 0: the diagonal block covers every row
                out, lse = out_b.to(acc_dtype), lse_b.to(acc_dtype)
            else:
                _merge_(out[q_rows], lse[q_rows], out_b, lse_b)
            del out_b, lse_b
        del kb, vb  # views of the block just used: free it before the next one arrives
        if step + 1 < world:
            kv = comm.wait(kv_next)
    return out.to(q.dtype), lse


def _head_chunks(q: Tensor, k: Tensor) -> list[tuple[slice, slice]]:
    """(q heads, kv heads) per backward kernel call; see Note [Backward in head chunks]."""
    b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return [(slice(None), slice(None))]
    groups = hq // hkv
    n = min(hkv, -(-torch.get_num_threads() // (b * groups)))  # kv heads per call: >= one (b, head) per thread
    while hkv % n:
        n += 1
    return [(slice(i * groups, (i + n) * groups), slice(i, i + n)) for i in range(0, hkv, n)]


def _block_backward_(
    dq: Tensor | None, dkv: Tensor, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    blk, scale: float, acc_dtype: torch.dtype,
) -> Tensor:
    """One ring step's backward: adds the block's dq into ``dq`` (allocated when None) and writes its
    dk, dv into ``dkv`` (flat, [dk | dv] shaped like k and v; rows outside ``blk.kv_rows`` untouched).
    Returns dq."""
    q_rows, kv_rows = blk.q_rows, blk.kv_rows
    dk_out, dv_out = unpack(dkv, k, v)
    chunks = _head_chunks(q, k)
    first = dq is None  # step 0, whose diagonal block covers every row
    if first and len(chunks) > 1:
        dq = q.new_empty(q.shape, dtype=acc_dtype)
    for hq, hkv in chunks:
        qi, ki = (slice(None), hq, q_rows), (slice(None), hkv, kv_rows)
        dq_c, dk_c, dv_c = block_attn_backward(dout[qi], q[qi], k[ki], v[ki], out[qi], lse[qi], blk.causal, scale)
        if dq is None:  # the whole block in one call: the kernel's dq is the accumulator
            dq = dq_c.to(acc_dtype)
        elif first:
            dq[qi] = dq_c
        else:
            dq[qi] += dq_c
        dk_out[ki] = dk_c
        dv_out[ki] = dv_c
        del dq_c, dk_c, dv_c
    return dq


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float, comm_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Unchecked ring backward on local shards; see Note [Ring backward]. Returns dq, dk, dv."""
    comm = RingComm(group)
    world, rank, s_local = comm.world, comm.rank, q.shape[2]
    dout = dout.contiguous()
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    dq = None  # started by step 0, whose diagonal block covers every row
    own = None  # [dk | dv] of this rank's block: step 0's share, then the accumulator coming home
    kv = encode_kv(k, v, comm_dtype) if world > 1 else None
    dkv = None  # the accumulator received from the previous rank, for the block held next
    for step in range(world):
        if step + 1 < world:
            kv_next = comm.rotate(kv)
        kb, vb = (k, v) if step == 0 else decode_kv(kv, k, v, comm_dtype)
        blk = step_block(layout, rank=rank, src=comm.src_at(step), world=world, s_local=s_local, is_causal=is_causal)
        if step == 0:
            own = k.new_empty(2 * k.numel(), dtype=acc_dtype)
            dq = _block_backward_(dq, own, dout, q, k, v, out, lse, blk, scale, acc_dtype)
        else:
            mine = None  # this rank's share of the block it holds, in the accumulator's layout and dtype
            if blk is not None:
                partial = blk.kv_rows != slice(None)
                mine = (k.new_zeros if partial else k.new_empty)(2 * k.numel())
                dq = _block_backward_(dq, mine, dout, q, kb, vb, out, lse, blk, scale, acc_dtype)
            if dkv is None:  # the first accumulator of this block starts here
                acc = mine if mine is not None else k.new_zeros(2 * k.numel())
            else:
                acc = comm.wait(dkv)
                if mine is not None:
                    acc += mine
            del mine
            dkv = comm.rotate(acc)
            del acc
        # Free this step's block before the next one arrives.
        del kb, vb
        if step + 1 < world:
            kv = comm.wait(kv_next)
    kv = None  # the last block held: free it before the accumulator comes home
    if dkv is not None:  # our own block's accumulator, home after P - 1 hops
        own += comm.wait(dkv)
    dk, dv = unpack(own, k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, layout, is_causal, scale, comm_dtype):
        opts = dict(group=group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype)
        out, lse = ring_forward(q, k, v, **opts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = opts
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, **ctx.opts)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "striped",
    is_causal: bool = False,
    scale: float | None = None,
    comm_dtype: torch.dtype | None = None,
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: world).

    q: [B, Hq, S_local, D]; k, v: [B, Hkv, S_local, D] with Hq % Hkv == 0 -- this rank's shards in
    ``layout`` ("striped", "headtail" or "contiguous"; see Note [Sequence layouts] in layout.py).
    Returns this rank's output shard [B, Hq, S_local, D] in q's dtype, equal to full-sequence
    ``F.scaled_dot_product_attention`` with ``is_causal`` masking by global position. Differentiable
    in q, k and v. Only K/V heads travel: (P - 1) * 2 * S_local * D * Hkv * itemsize bytes per
    forward per rank. ``comm_dtype`` (off by default) sends K/V in another dtype; a float8 dtype
    sends float8 with power-of-two row scales, about half the bytes of bf16 -- see
    Note [float8 ring payload] in payload.py.
    """
    group = group if group is not None else dist.group.WORLD
    scale = check_ring_args(
        q, k, v, group=group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype
    )
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _RingAttention.apply(q, k, v, group, layout, is_causal, scale, comm_dtype)
