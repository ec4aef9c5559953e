"""The compile boundary: one attention block with its log-sum-exp, as ``torch.library`` custom ops.

``cp_dtensor::block_attn`` and ``cp_dtensor::block_attn_backward`` wrap the fused SDPA kernel of the
device (kernels.py, Note [Kernel contracts]) behind one schema with fake implementations, so the ring loop around them traces
under ``torch.compile(fullgraph=True)`` and Inductor sees the functional collectives between them.

Shapes: q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D] with Hq % Hkv == 0; out: [B, Hq, Sq, D] in q's dtype,
contiguous; lse: [B, Hq, Sq] float32. The gradients dq, dk, dv come back in the layout the CPU kernel
writes them, sequence-major ([B, S, H, D] memory seen as [B, H, S, D]; see :func:`_seq_major`), so the
ring never copies them just to change strides: copying a block's three gradients costs as much memory
as one more K/V block at the peak of the backward. ``is_causal`` is only used for square blocks
(Sq == Sk), where top-left and bottom-right alignment agree -- see Note [Causal ring steps] in layout.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "RowSegments", "after", "block_attn", "block_attn_backward", "block_attn_backward_into_", "masked_block_attn",
    "masked_block_attn_backward", "masked_block_attn_merge_", "merge_", "tie", "tie_",
]

from . import kernels
from .kernels import kernel_bwd, kernel_fwd
from .ordering import after, tie, tie_  # noqa: F401 -- their old home: ops.after, ops.tie
from .varlen import RowSegments, _backward_pieces, _batch_rects, _forward_pieces, _Fresh, _Masks  # noqa: F401


def _seq_major(x: Tensor) -> Tensor:
    """``x`` [B, H, S, D] laid out as [B, S, H, D] in memory (a copy only if it is not already)."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_seq_major(like: Tensor) -> Tensor:
    b, h, s, d = like.shape
    return like.new_empty(b, s, h, d).transpose(1, 2)


@torch.library.custom_op("cp_dtensor::block_attn", mutates_args=())
def block_attn(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, backends: int = -1,
) -> tuple[Tensor, Tensor]:
    """``backends``: the CUDA kernels allowed (kernels.sdpa_backends(), -1: read at the call); CPU: one kernel."""
    out, lse = kernel_fwd(q, k, v, is_causal, scale, None, backends)
    # The kernels return [B, S, H, ...]-major strides; the op promises contiguous results.
    return out.contiguous(), lse.contiguous()


@block_attn.register_fake
def _(q, k, v, is_causal, scale, backends=-1):
    # new_empty, not empty_like: the results are contiguous whatever q's strides (empty_like keeps them)
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    return out, q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("cp_dtensor::block_attn_backward", mutates_args=())
def block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool, scale: float,
    backends: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *final* out and lse of the rows (not the block's own): the
    kernel's D = rowsum(dout * out) and P = exp(s - lse) are then those of the full attention, so the
    block's dq, dk, dv are exactly its share of the full gradients."""
    grads = kernel_bwd(dout, q, k, v, out, lse, is_causal, scale, None, backends)
    return tuple(_seq_major(g) for g in grads)  # on CPU already sequence-major: no copy


@block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale, backends=-1):
    return _empty_seq_major(q), _empty_seq_major(k), _empty_seq_major(v)  # sequence-major, as the kernel's


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, *backends = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.is_causal, ctx.scale, ctx.backends = is_causal, scale, backends[0] if backends else -1


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # lse is an output for the ring's merge, not a differentiable result.
    dq, dk, dv = block_attn_backward(dout.contiguous(), q, k, v, out, lse, ctx.is_causal, ctx.scale, ctx.backends)
    return dq, dk, dv, None, None, None


block_attn.register_autograd(_backward, setup_context=_setup_context)


def head_chunks(q: Tensor, k: Tensor) -> list[tuple[slice, slice]]:
    """(q heads, kv heads) per backward kernel call; see Note [Backward in head chunks] in blocks.py."""
    b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    if kernels.backend(q) != "cpu":
        return [(slice(None), slice(None))]
    groups = hq // hkv
    n = min(hkv, -(-torch.get_num_threads() // (b * groups)))  # kv heads per call: >= one (b, head) per thread
    while hkv % n:
        n += 1
    return [(slice(i * groups, (i + n) * groups), slice(i, i + n)) for i in range(0, hkv, n)]


@torch.library.custom_op("cp_dtensor::block_attn_backward_into_", mutates_args=("dq", "dkv"))
def block_attn_backward_into_(
    dq: Tensor, dkv: Tensor, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    q0: int, q1: int, k0: int, k1: int, is_causal: bool, scale: float, add: bool, backends: int = -1,
) -> None:
    """One ring step's backward, written into the ring's buffers: rows [q0, q1) of q against rows
    [k0, k1) of k and v. Adds the block's dq into ``dq`` rows (sets them when ``add`` is False) and
    writes its dk, dv into ``dkv`` (flat [dk | dv] shaped like k and v); other rows are untouched.
    The kernel runs per group of KV heads (:func:`head_chunks`), so the only fresh gradients are
    one group's -- in eager and compiled graphs alike (Note [Backward in head chunks] in blocks.py)."""
    dk_out, dv_out = dkv[: k.numel()].view(k.shape), dkv[k.numel() :].view(v.shape)
    for hq, hkv in head_chunks(q, k):
        qi, ki = (slice(None), hq, slice(q0, q1)), (slice(None), hkv, slice(k0, k1))
        dq_c, dk_c, dv_c = kernel_bwd(dout[qi], q[qi], k[ki], v[ki], out[qi], lse[qi], is_causal, scale, None, backends)
        if add:
            dq[qi] += dq_c
        else:
            dq[qi] = dq_c
        dk_out[ki] = dk_c
        dv_out[ki] = dv_c
        del dq_c, dk_c, dv_c


@block_attn_backward_into_.register_fake
def _(dq, dkv, dout, q, k, v, out, lse, q0, q1, k0, k1, is_causal, scale, add, backends=-1):
    return None


def merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold a partial result over other keys into (out, lse), in place; see Note [Online softmax merge]
    in blocks.py. out: [B, H, S, Dv] fp32 (a view), lse: [B, H, S] fp32 (a view); lse may be -inf (no key
    yet), lse_b may not."""
    # stable merge: out + sigmoid(lse_b - lse) * (out_b - out); no exp() can overflow
    w = torch.sigmoid(lse_b - lse).unsqueeze(-1)
    out.lerp_(out_b.to(out.dtype), w)
    lse.copy_(torch.logaddexp(lse, lse_b))




@torch.library.custom_op("cp_dtensor::masked_block_attn", mutates_args=())
def masked_block_attn(
    q: Tensor, k: Tensor, v: Tensor, q_ids: Tensor | None, k_ids: Tensor | None,
    q_runs: list[int], k_runs: list[int], lo: int | None, hi: int | None, scale: float, backends: int = -1,
) -> tuple[Tensor, Tensor]:
    """One ring step under a mask: q [B, Hq, Sq, Dqk] against k [B, Hkv, Sk, Dqk], v [B, Hkv, Sk, Dv],
    keeping the pairs of the same document (ids [B, S] or None) with lo <= pos_k - pos_q <= hi, the
    positions given by the runs (masks.flat_runs). Returns out [B, Hq, Sq, Dv] and lse [B, Hq, Sq] in
    fp32 (fp64 for fp64 inputs); rows with no kept key get out 0 and lse -inf. One kernel call per
    rectangle of masks.block_rects, none where nothing is kept."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty((*q.shape[:3], v.shape[3]), dtype=acc)
    lse = q.new_empty(q.shape[:3], dtype=acc)
    masks = _Masks(q.dtype, q.device)
    for b, rects in _batch_rects(q_ids, k_ids, q_runs, k_runs, lo, hi, q, backends):
        fresh = _Fresh()
        for r, out_r, lse_r in _forward_pieces(q, k, v, b, rects, scale, masks, backends):
            qs = (b, slice(None), slice(r.q0, r.q1))
            whole, new = fresh(r.q0, r.q1)
            if whole:
                out[qs], lse[qs] = out_r, lse_r
                continue
            for rows in new:
                out[b, :, rows], lse[b, :, rows] = 0, float("-inf")
            merge_(out[qs], lse[qs], out_r, lse_r)
        for rows in fresh.gaps(q.shape[2]):
            out[b, :, rows] = 0
            lse[b, :, rows] = float("-inf")
    return out, lse


@masked_block_attn.register_fake
def _(q, k, v, q_ids, k_ids, q_runs, k_runs, lo, hi, scale, backends=-1):
    acc = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty((*q.shape[:3], v.shape[3]), dtype=acc), q.new_empty(q.shape[:3], dtype=acc)


@torch.library.custom_op("cp_dtensor::masked_block_attn_merge_", mutates_args=("out", "lse"))
def masked_block_attn_merge_(
    out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, q_ids: Tensor | None, k_ids: Tensor | None,
    q_runs: list[int], k_runs: list[int], lo: int | None, hi: int | None, scale: float, backends: int = -1,
) -> None:
    """:func:`masked_block_attn`, merged straight into the ring's accumulators ``out`` [B, Hq, Sq, Dv]
    and ``lse`` [B, Hq, Sq] (fp32): only the rows a rectangle keeps are touched, and no block-sized
    result is allocated. See Note [Online softmax merge] in blocks.py."""
    masks = _Masks(q.dtype, q.device)
    for b, rects in _batch_rects(q_ids, k_ids, q_runs, k_runs, lo, hi, q, backends):
        for r, out_r, lse_r in _forward_pieces(q, k, v, b, rects, scale, masks, backends):
            qs = (b, slice(None), slice(r.q0, r.q1))
            merge_(out[qs], lse[qs], out_r, lse_r)


@masked_block_attn_merge_.register_fake
def _(out, lse, q, k, v, q_ids, k_ids, q_runs, k_runs, lo, hi, scale, backends=-1):
    return None


@torch.library.custom_op("cp_dtensor::masked_block_attn_backward", mutates_args=())
def masked_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_ids: Tensor | None,
    k_ids: Tensor | None, q_runs: list[int], k_runs: list[int], lo: int | None, hi: int | None, scale: float,
    backends: int = -1,
) -> tuple[Tensor, Tensor]:
    """The block's dq and [dk | dv] (one flat buffer, the ring's accumulator layout; fp32, fp64 for fp64
    inputs) given the rows' *final* out and lse, as :func:`block_attn_backward`; zeros where the mask
    keeps nothing."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = q.new_empty(q.shape, dtype=acc)
    dkv = k.new_empty(k.numel() + v.numel(), dtype=acc)
    dk, dv = dkv[: k.numel()].view(k.shape), dkv[k.numel() :].view(v.shape)
    masks = _Masks(q.dtype, q.device)
    for b, rects in _batch_rects(q_ids, k_ids, q_runs, k_runs, lo, hi, q, backends):
        fresh_q, fresh_k = _Fresh(), _Fresh()
        for r, g in _backward_pieces(dout, q, k, v, out, lse, b, rects, scale, masks, backends):
            qs, ks = (b, slice(None), slice(r.q0, r.q1)), (b, slice(None), slice(r.k0, r.k1))
            whole, new = fresh_q(r.q0, r.q1)
            if whole:
                dq[qs] = g[0]
            else:
                for rows in new:
                    dq[b, :, rows] = 0
                dq[qs] += g[0]
            whole, new = fresh_k(r.k0, r.k1)
            if whole:
                dk[ks], dv[ks] = g[1], g[2]
            else:
                for rows in new:
                    dk[b, :, rows], dv[b, :, rows] = 0, 0
                dk[ks] += g[1]
                dv[ks] += g[2]
        for rows in fresh_q.gaps(q.shape[2]):
            dq[b, :, rows] = 0
        for rows in fresh_k.gaps(k.shape[2]):
            dk[b, :, rows] = 0
            dv[b, :, rows] = 0
    return dq, dkv


@masked_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, q_ids, k_ids, q_runs, k_runs, lo, hi, scale, backends=-1):
    acc = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape, dtype=acc), k.new_empty(k.numel() + v.numel(), dtype=acc)


def _masked_setup_context(ctx, inputs, output):
    q, k, v, q_ids, k_ids, *static = inputs
    ctx.save_for_backward(q, k, v, *output, q_ids, k_ids)
    ctx.static = static


def _masked_backward(ctx, dout, dlse):
    q, k, v, out, lse, q_ids, k_ids = ctx.saved_tensors
    dq, dkv = masked_block_attn_backward(dout.contiguous(), q, k, v, out.to(q.dtype), lse, q_ids, k_ids, *ctx.static)
    dk, dv = dkv[: k.numel()].view(k.shape), dkv[k.numel() :].view(v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * (len(ctx.static) + 2))


masked_block_attn.register_autograd(_masked_backward, setup_context=_masked_setup_context)


