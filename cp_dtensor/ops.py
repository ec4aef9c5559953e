"""The compile boundary: one attention block with its log-sum-exp, as ``torch.library`` custom ops.

``cp_dtensor::block_attn`` and ``cp_dtensor::block_attn_backward`` wrap the fused SDPA kernel of the
device (CPU: ``_scaled_dot_product_flash_attention_for_cpu``; CUDA: flash for fp16/bf16, memory-
efficient otherwise) behind one schema with fake implementations, so the ring loop around them traces
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

__all__ = ["block_attn", "block_attn_backward"]

aten = torch.ops.aten


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    # [B, Hkv, S, D] -> [B, Hkv * groups, S, D]; only for kernels without native GQA, on the local copy
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(g: Tensor, groups: int) -> Tensor:
    # [B, Hkv * groups, S, D] -> [B, Hkv, S, D]
    return g if groups == 1 else g.unflatten(1, (-1, groups)).sum(2)


def _seq_major(x: Tensor) -> Tensor:
    """``x`` [B, H, S, D] laid out as [B, S, H, D] in memory (a copy only if it is not already)."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_seq_major(like: Tensor) -> Tensor:
    b, h, s, d = like.shape
    return like.new_empty(b, s, h, d).transpose(1, 2)


def _cuda_use_flash(q: Tensor) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0


@torch.library.custom_op("cp_dtensor::block_attn", mutates_args=())
def block_attn(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if q.device.type == "cpu":
        # GQA is native here: Hq % Hkv == 0 is enough.
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        # The kernel returns [B, S, H, ...]-major strides; the op promises contiguous results.
        return out.contiguous(), lse.contiguous()
    groups = q.shape[1] // k.shape[1]
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    if _cuda_use_flash(q):
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return res[0].contiguous(), res[1].contiguous()
    out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)[:2]
    return out.contiguous(), lse[..., : q.shape[2]].contiguous()  # the kernel pads lse to a multiple of 32


@block_attn.register_fake
def _(q, k, v, is_causal, scale):
    # new_empty, not empty_like: the results are contiguous whatever q's strides (empty_like keeps them)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("cp_dtensor::block_attn_backward", mutates_args=())
def block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *final* out and lse of the rows (not the block's own): the
    kernel's D = rowsum(dout * out) and P = exp(s - lse) are then those of the full attention, so the
    block's dq, dk, dv are exactly its share of the full gradients."""
    if q.device.type == "cpu":
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, scale=scale
        )
        return tuple(_seq_major(g) for g in grads)  # already sequence-major: no copy
    groups = q.shape[1] // k.shape[1]
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    sq, sk = q.shape[2], k.shape[2]
    # Without dropout the kernels never read the philox state: pass empty tensors.
    empty = q.new_empty(0, dtype=torch.int64)
    if _cuda_use_flash(q):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, None, None, sq, sk, 0.0, is_causal, empty, empty, scale=scale
        )
    else:
        lse = torch.nn.functional.pad(lse, (0, (-sq) % 32))  # back to the kernel's padded length
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, lse, empty, empty, 0.0, [True, True, True, False], is_causal, scale=scale
        )
    return _seq_major(dq), _seq_major(_reduce_kv_grad(dk, groups)), _seq_major(_reduce_kv_grad(dv, groups))


@block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale):
    return _empty_seq_major(q), _empty_seq_major(k), _empty_seq_major(v)  # sequence-major, as the kernel's


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # lse is an output for the ring's merge, not a differentiable result.
    dq, dk, dv = block_attn_backward(dout.contiguous(), q, k, v, out, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


block_attn.register_autograd(_backward, setup_context=_setup_context)
