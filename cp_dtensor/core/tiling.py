"""Sequence tiling: the LM head + cross-entropy and the MLP run tile by tile along the sequence.

Note [Sequence tiling]
~~~~~~~~~~~~~~~~~~~~~~
Under CP a rank's K/V blocks are O(N / P); what grows next per token is everything else a rank holds.
The largest term is the LM head: one forward + backward with labels keeps the [S_local, V] logits
(fp32 for the loss), their softmax and their gradient -- 3 x 4 x V bytes a token, 384 KiB at V = 32768,
against 4 x H bytes for a hidden row. The second is the MLP's intermediate ([S_local, I] a few times,
I ~ 3.5 H) saved for backward.

Both are token-wise, so they can run on T tokens at a time (ALST, arXiv 2506.13996; Liger's fused
linear cross-entropy):

* ``linear_cross_entropy``: one autograd function. Forward: per tile, logits = h_t W^T (+ b) in the
  compute dtype, upcast to fp32, ``loss += sum(lse - logit[label])`` over the tile's labelled tokens;
  only ``h``, ``W`` and the labels are saved. Backward recomputes each tile's logits and turns them in
  place into ``softmax - onehot`` (the gradient of the cross-entropy), scaled by the reduction; then
  ``dh_t = g W`` and ``dW += g^T h_t`` (accumulated in fp32). So at most one [T, V] fp32 tile exists,
  in forward and in backward. The reduction is transformers' ``ForCausalLMLoss``: a sum divided by
  ``num_items_in_batch`` when given (under CP: the global count, so the ranks' losses add up to the
  CP=1 loss), else the mean over labelled tokens; ``ignore_index`` tokens add nothing.
* ``tiled_forward``: a token-wise module (SwiGLU MLP, an MoE block) called on T tokens at a time, each
  tile under non-reentrant activation checkpointing: forward keeps only the tiles' outputs, backward
  recomputes one tile at a time (the autograd engine runs the later tile's nodes first, each tile's
  chain whole), so one tile's intermediates live at a time. With the layer itself checkpointed
  (gradient checkpointing), this is what bounds the layer's backward peak.

Cost: the head's logits are computed twice (forward, backward): 4 matmuls instead of 3; the MLP's
forward runs twice (as under activation checkpointing). The tile size trades the transient [T, V]
buffer (T x V x 4 bytes: 128 MiB at T = 1024, V = 32768) against the number of kernel launches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_TILE", "check_tile_size", "linear_cross_entropy", "tiled_forward"]

DEFAULT_TILE = 1024  #: tokens per tile for ``sequence_tiling=True``


def check_tile_size(sequence_tiling) -> int | None:
    """The tile size (tokens) for ``sequence_tiling=`` (False / None: off, True: DEFAULT_TILE, an int > 0)."""
    if sequence_tiling is None or sequence_tiling is False:
        return None
    if sequence_tiling is True:
        return DEFAULT_TILE
    if isinstance(sequence_tiling, int) and not isinstance(sequence_tiling, bool) and sequence_tiling > 0:
        return sequence_tiling
    raise ValueError(f"sequence_tiling must be True, False or a positive int (tokens per tile); got "
                     f"{sequence_tiling!r}. Pass True for {DEFAULT_TILE} tokens a tile, or e.g. 2048.")


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The head's matmul dtype: autocast's when on (as nn.Linear under autocast), else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """See Note [Sequence tiling]. hidden: [N, H]; weight: [V, H]; bias: [V] | None; labels: [N] (shifted);
    scale: 0-d (1 / num_items or 1 / count). Returns the 0-d loss (fp32; float64 for float64 inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, scale, tile: int, ignore_index: int, dtype: torch.dtype):
        w = weight.to(dtype)  # [V, H] in the compute dtype, once
        b = None if bias is None else bias.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)  # the loss's dtype: fp32 (float64 stays)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], tile):
                lab = labels[s:s + tile]  # [T]
                logits = F.linear(hidden[s:s + tile].to(dtype), w, b).to(acc)  # [T, V], the one live tile
                valid = lab != ignore_index
                target = logits.gather(1, torch.where(valid, lab, 0)[:, None])[:, 0]  # [T]
                total = total + torch.where(valid, torch.logsumexp(logits, 1) - target, 0.0).sum()
                del logits
        ctx.save_for_backward(hidden, weight, bias, labels, scale)
        ctx.tile, ctx.ignore_index, ctx.dtype = tile, ignore_index, dtype
        return total * scale

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, labels, scale = ctx.saved_tensors
        tile, ignore_index, dtype = ctx.tile, ctx.ignore_index, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        dh = torch.empty_like(hidden) if need_h else None  # [N, H]
        acc = torch.promote_types(dtype, torch.float32)
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # [V, H]
        db = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None  # [V]
        coef = (grad_out * scale).to(acc)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], tile):
                h, lab = hidden[s:s + tile].to(dtype), labels[s:s + tile]  # [T, H], [T]
                g = F.linear(h, w, b).to(acc)  # [T, V]: recomputed, then turned into the gradient in place
                valid = lab != ignore_index
                g.sub_(torch.logsumexp(g, 1, keepdim=True)).exp_()  # softmax
                rows = torch.arange(g.shape[0], device=g.device)
                g[rows, torch.where(valid, lab, 0)] -= 1.0  # softmax - onehot
                g.mul_((valid.to(acc) * coef)[:, None])
                gd = g.to(dtype)
                if need_h:
                    dh[s:s + tile] = (gd @ w).to(hidden.dtype)
                if need_w:
                    dw.add_((gd.t() @ h).to(acc))
                if need_b:
                    db.add_(g.sum(0))
                del g, gd
        return (dh, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype),
                None, None, None, None, None)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                         tile_size: int = DEFAULT_TILE, num_items_in_batch: Tensor | int | None = None,
                         ignore_index: int = -100) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, ``tile_size`` tokens at a time,
    never holding the [N, V] logits (see Note [Sequence tiling]).

    hidden: [..., H]; weight: [V, H]; labels: [...] already shifted (the label of each token's *next*
    token: under CP this rank's shard of ``cp_dtensor.hf.shift_labels(labels)``). The reduction is
    transformers' ``ForCausalLMLoss``: ``sum / num_items_in_batch`` when given (under CP pass the global
    count of labels != ignore_index), else the mean over labelled tokens. Returns a 0-d fp32 tensor.
    """
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"linear_cross_entropy's tile_size must be a positive int (tokens per tile); got "
                         f"{tile_size!r}. Pass e.g. tile_size={DEFAULT_TILE}.")
    tile = tile_size
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy takes hidden [..., H], weight [V, H] and labels [...] (hidden's "
                         f"leading shape); got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels "
                         f"{tuple(labels.shape)}.")
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1).to(device=h.device, dtype=torch.long)
    if num_items_in_batch is None:
        count = (lab != ignore_index).sum()  # mean: nan when nothing is labelled, as F.cross_entropy
    else:
        count = torch.as_tensor(num_items_in_batch, device=h.device)
    dtype = _compute_dtype(h, weight)
    scale = 1.0 / count.to(torch.promote_types(dtype, torch.float32))
    return _LinearCrossEntropy.apply(h, weight, bias, lab, scale, tile, ignore_index, dtype)


def _merge(outs: list, batch: int, tile: int, seq_dim: int, what: str):
    """Concatenate the tiles' outputs (the first tile holds ``tile`` tokens): tensors whose dim ``seq_dim``
    is the tile along it, [B * T, ...] ones (an MoE router's scores) as [B, T, ...]; tuples element-wise."""
    first = outs[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([o[i] for o in outs], batch, tile, seq_dim, what) for i in range(len(first)))
    if first is None:
        return None
    if isinstance(first, Tensor) and first.dim() > seq_dim and first.shape[seq_dim] == tile and (
            seq_dim == 0 or first.shape[0] == batch):
        return torch.cat(outs, seq_dim)
    if isinstance(first, Tensor) and seq_dim == 1 and first.dim() >= 1 and first.shape[0] == batch * tile:
        return torch.cat([o.reshape(batch, -1, *o.shape[1:]) for o in outs], 1).flatten(0, 1)  # flattened tokens
    shape = tuple(first.shape) if isinstance(first, Tensor) else type(first).__name__
    raise ValueError(f"sequence_tiling: {what} returned {shape} for a tile of {tile} tokens, not a tensor per token "
                     "(a tiled module maps [B, T, ...] to [B, T, ...] or [B * T, ...]). Turn sequence_tiling off "
                     "for this model.")


def tiled_forward(forward: Callable, x: Tensor, *args, tile_size: int, seq_dim: int = 1, what: str = "the module",
                  **kwargs):
    """``forward(x, *args, **kwargs)`` for a token-wise ``forward``, ``tile_size`` tokens of ``x`` (along
    ``seq_dim``) at a time, each tile recomputed in backward (see Note [Sequence tiling])."""
    n = x.shape[seq_dim]
    if n <= tile_size:
        return forward(x, *args, **kwargs)
    grad = torch.is_grad_enabled()
    outs = []
    for s in range(0, n, tile_size):
        part = x.narrow(seq_dim, s, min(tile_size, n - s))
        if grad:  # only the tile's output is kept; its intermediates come back one tile at a time in backward
            outs.append(checkpoint(forward, part, *args, use_reentrant=False, **kwargs))
        else:
            outs.append(forward(part, *args, **kwargs))
    return _merge(outs, x.shape[0], tile_size, seq_dim, what)
