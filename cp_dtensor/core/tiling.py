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

* ``linear_cross_entropy``: one autograd function whose forward computes the loss *and* the gradients.
  The loss is a scalar at the end of the step, so the gradient of each tile's logits is known in the
  forward pass up to the one number ``grad_output``: d loss / d z_t = c_t (softmax(z_t) - onehot), with
  c_t = scale on labelled tokens, 0 on ``ignore_index`` ones. Per tile, in one reused fp32 [T, V] buffer:
  ``z = h_t W^T (+ b)`` (matmul 1); ``log_softmax`` in place, the tile's loss ``-z[label]`` summed; ``exp_``
  (softmax) and ``-1`` at the labels (softmax - onehot, in place); then ``dh_t = c_t (g W)`` (matmul 2)
  and ``dW += g^T (c_t h_t)`` (matmul 3, accumulated in fp32; ``db += g^T c_t``). The row scale c goes on
  the [T, H] sides, never as another pass over [T, V]. Backward only multiplies the stored dh, dW, db by
  ``grad_output``: 3 matmuls a tile, nothing recomputed, no host sync (the count and scale stay tensors).
  The fused path holds dh [N, H] (and dW, db) from forward to backward -- what the backward would
  allocate anyway; no [N, V] tensor exists. Without grad (``torch.no_grad``, nothing requires grad) only
  the loss is computed.
* the recompute path: a backward under ``create_graph=True`` (a double backward through the loss) cannot
  use the stored gradients (they are constants), so it recomputes each tile's logits with differentiable
  ops (out of place; 4 matmuls a tile; a second derivative keeps its tiles' intermediates). That is the
  only use; it is why the forward also saves ``h`` and ``W`` (references, no copy).
* vocabulary-parallel heads (tensor parallelism: ``weight`` a DTensor placed ``Shard(0)`` on a 1-D TP
  mesh; each rank holds V / TP rows, the hidden states replicated): each rank's tile of logits covers its
  vocabulary shard. Per tile the row max is all-reduced (MAX), then the sums of exp and the label's logit
  (owned by one rank, 0 elsewhere) in one all-reduce (SUM), giving the global log-sum-exp; the local
  softmax minus onehot then gives this shard's dW exactly and a partial dh, summed over the group once
  at the end (or left ``Partial`` when ``hidden`` is a DTensor, for its redistribute to reduce). The
  loss is the same on every rank. Tiles are the same on every rank, so every rank issues the same
  collectives (after one all-reduce that checks, on every rank alike, that the ranks hold the same number
  of tokens and no label lies outside [0, V): Note [Which DTensor head is vocabulary-parallel]). The
  recompute path is single-device only.

  The reduction is transformers' ``ForCausalLMLoss``: a sum divided by ``num_items_in_batch`` when given
  (under CP: the global count, so the ranks' losses add up to the CP=1 loss), else the mean over labelled
  tokens; ``ignore_index`` tokens add nothing.
* ``tiled_forward``: a token-wise module (SwiGLU MLP, an MoE block) called on T tokens at a time, each
  tile under non-reentrant activation checkpointing: forward keeps only the tiles' outputs, backward
  recomputes one tile at a time (the autograd engine runs the later tile's nodes first, each tile's
  chain whole), so one tile's intermediates live at a time. With the layer itself checkpointed
  (gradient checkpointing), this is what bounds the layer's backward peak.

Cost: the head runs its 3 matmuls once (as the plain head); the MLP's forward runs twice (as under
activation checkpointing). The tile size trades the transient [T, V] buffer (T x V x 4 bytes: 128 MiB at
T = 1024, V = 32768) against the number of kernel launches; under torch.compile the in-place ``out=``
kernels become their out-of-place forms (the compiler plans the buffers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .vocab_parallel import check_tp_batch, vocab_parallel_head

__all__ = ["DEFAULT_TILE", "check_tile_size", "linear_cross_entropy", "merge_tiles", "tiled_forward"]

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
    """The head's matmul dtype: autocast's when on (as nn.Linear under autocast, which leaves float64 alone),
    else the weight's."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _all_reduce(x: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _fused(hidden, weight, bias, labels, scale, *, tile: int, ignore_index: int, dtype: torch.dtype,
           need: tuple[bool, bool, bool], group, offset: int, reduce_dh: bool):
    """The loss and (when ``need``) dh, dW, db of Note [Sequence tiling], one [T, V] buffer reused.
    hidden: [N, H]; weight: [V, H] (this rank's vocabulary rows offset..offset+V under ``group``); labels: [N]."""
    n, vocab = hidden.shape[0], weight.shape[0]
    acc = torch.promote_types(dtype, torch.float32)  # the loss's dtype: fp32 (float64 stays)
    eager = not torch.compiler.is_compiling()  # in-place ``out=`` kernels in eager; the compiler plans its own
    w = weight.to(dtype)  # [V, H] in the compute dtype, once
    b = None if bias is None else bias.to(dtype)
    need_h, need_w, need_b = need
    grads = need_h or need_w or need_b
    dh = hidden.new_empty(hidden.shape) if need_h else None  # [N, H]
    dw = weight.new_zeros(weight.shape, dtype=acc) if need_w else None  # [V, H], fp32 accumulation
    db = bias.new_zeros(bias.shape, dtype=acc) if need_b else None  # [V]
    buf = hidden.new_empty(min(tile, n), vocab, dtype=acc)  # [T, V]: the one live tile
    minus_one = buf.new_full((buf.shape[0], 1), -1.0)
    total = buf.new_zeros(())
    for s in range(0, n, tile):
        t = min(tile, n - s)
        x, lab = hidden[s:s + t].to(dtype), labels[s:s + t]  # [T, H], [T]
        valid = lab != ignore_index
        if group is None:  # an out-of-range label raises in gather, as in F.cross_entropy
            mine, safe = valid, torch.where(valid, lab, 0)[:, None]  # [T], [T, 1]
        else:  # the label's logit is on this rank when it falls in its shard
            mine = valid & (lab >= offset) & (lab < offset + vocab)
            safe = torch.where(mine, lab - offset, 0)[:, None]
        z = buf[:t]
        if eager and dtype == acc:
            torch.mm(x, w.t(), out=z) if b is None else torch.addmm(b, x, w.t(), out=z)  # matmul 1
        elif eager:
            z.copy_(F.linear(x, w, b))
        else:
            z = F.linear(x, w, b).to(acc)
        if group is None:
            z = torch.log_softmax(z, 1, out=z) if eager else torch.log_softmax(z, 1)  # [T, V]: log p
            nll = -z.gather(1, safe)[:, 0]
        else:  # Note [Sequence tiling]: the log-sum-exp and the label's logit over the vocabulary shards
            m = _all_reduce(z.amax(1), group, dist.ReduceOp.MAX)  # [T]
            z = z.sub_(m[:, None]) if eager else z - m[:, None]
            sums = torch.stack([torch.exp(z).sum(1), torch.where(mine, z.gather(1, safe)[:, 0], 0.0)])
            sums = _all_reduce(sums, group)  # [2, T]: sum of exp, shifted label logit
            lse = sums[0].log()
            z = z.sub_(lse[:, None]) if eager else z - lse[:, None]  # log p on this shard
            nll = lse - sums[1]
        total = total + torch.where(valid, nll, 0.0).sum()
        if not grads:
            continue
        c = torch.where(valid, scale, 0.0)  # [T]: d loss / d nll_i (0 for ignored tokens, even when scale is inf)
        if eager:  # g = softmax - onehot, in place; the row scale c goes on the [T, H] sides
            z.exp_().scatter_add_(1, safe, minus_one[:t].where(mine[:, None], 0.0))
        else:
            z = torch.exp(z).scatter_add(1, safe, minus_one[:t].where(mine[:, None], 0.0))
        g = z if dtype == acc else z.to(dtype)  # [T, V]
        if need_h:  # matmul 2
            dh[s:s + t] = ((g @ w).to(acc) * c[:, None]).to(dh.dtype)  # the scale in fp32, not rounded to bf16
        if need_w:  # matmul 3
            xc = (x * c[:, None]).to(dtype)
            if eager and dtype == acc:
                dw.addmm_(g.t(), xc)
            else:
                dw = dw + (g.t() @ xc).to(acc)
        if need_b:
            db = db.addmv_(z.t(), c) if eager else db + z.t() @ c
        del z, g
    if need_h and reduce_dh:
        dh = _all_reduce(dh, group)
    return total * scale, dh, dw, db


def _recomputed_grads(grad_out, hidden, weight, bias, labels, scale, *, tile: int, ignore_index: int,
                      dtype: torch.dtype, need: tuple[bool, bool, bool]):
    """dh, dW, db of the loss by recomputing each tile's logits with differentiable, out-of-place ops: the
    backward under ``create_graph=True`` (Note [Sequence tiling], the recompute path)."""
    acc = torch.promote_types(dtype, torch.float32)
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    dhs, dw, db = [], 0, 0
    for s in range(0, hidden.shape[0], tile):
        x, lab = hidden[s:s + tile].to(dtype), labels[s:s + tile]
        z = F.linear(x, w, b).to(acc)  # [T, V]
        valid = lab != ignore_index
        onehot = F.one_hot(torch.where(valid, lab, 0), z.shape[1]).to(acc)
        g = (torch.softmax(z, 1) - onehot) * torch.where(valid, scale * grad_out, 0.0)[:, None]
        gd = g.to(dtype)
        dhs.append(gd @ w)
        dw = dw + (gd.t() @ x).to(acc)
        db = db + g.sum(0)
    dh = torch.cat(dhs).to(hidden.dtype) if need[0] else None
    return (dh, dw.to(weight.dtype) if need[1] else None, db.to(bias.dtype) if need[2] else None)


class _LinearCrossEntropy(torch.autograd.Function):
    """See Note [Sequence tiling]. hidden: [N, H]; weight: [V, H]; bias: [V] | None; labels: [N] (shifted);
    scale: 0-d (1 / num_items or 1 / count). Returns the 0-d loss (fp32; float64 for float64 inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, scale, tile: int, ignore_index: int, dtype: torch.dtype,
                need: tuple[bool, bool, bool], group, offset: int, reduce_dh: bool):
        with torch.autocast(hidden.device.type, enabled=False):
            loss, dh, dw, db = _fused(hidden, weight, bias, labels, scale, tile=tile, ignore_index=ignore_index,
                                      dtype=dtype, need=need, group=group, offset=offset, reduce_dh=reduce_dh)
        ctx.save_for_backward(dh, dw, db, hidden, weight, bias, labels, scale)
        ctx.tile, ctx.ignore_index, ctx.dtype, ctx.need, ctx.group = tile, ignore_index, dtype, need, group
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw, db, hidden, weight, bias, labels, scale = ctx.saved_tensors
        rest = (None,) * 9
        if torch.is_grad_enabled():  # create_graph: the stored gradients are constants -- recompute
            if ctx.group is not None:
                raise NotImplementedError("linear_cross_entropy: a double backward (create_graph=True) through a "
                                          "vocabulary-parallel head is not supported. Use a replicated head.")
            with torch.autocast(hidden.device.type, enabled=False):
                return (*_recomputed_grads(grad_out, hidden, weight, bias, labels, scale, tile=ctx.tile,
                                           ignore_index=ctx.ignore_index, dtype=ctx.dtype, need=ctx.need), *rest)
        return (None if dh is None else dh * grad_out.to(dh.dtype),
                None if dw is None else (dw * grad_out).to(weight.dtype),
                None if db is None else (db * grad_out).to(bias.dtype), *rest)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                         tile_size: int = DEFAULT_TILE, num_items_in_batch: Tensor | int | None = None,
                         ignore_index: int = -100, tp_mesh=None) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, ``tile_size`` tokens at a time,
    never holding the [N, V] logits, gradients computed in the forward (see Note [Sequence tiling]).

    hidden: [..., H]; weight: [V, H]; labels: [...] already shifted (the label of each token's *next*
    token: under CP this rank's shard of ``cp_dtensor.hf.shift_labels(labels)``). The reduction is
    transformers' ``ForCausalLMLoss``: ``sum / num_items_in_batch`` when given (under CP pass the global
    count of labels != ignore_index), else the mean over labelled tokens. Returns a 0-d fp32 tensor.
    A vocabulary-parallel head (``weight``, ``bias`` DTensors placed ``Shard(0)`` on a 1-D TP mesh, named by
    ``tp_mesh=`` or by ``hidden`` as a DTensor replicated there) combines the tiles' log-sum-exp over the mesh;
    every rank gets the whole loss. An FSDP-sharded weight is refused: pass it unsharded (Note [Which DTensor
    head is vocabulary-parallel]).
    """
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 1:
        raise ValueError(f"linear_cross_entropy's tile_size must be a positive int (tokens per tile); got "
                         f"{tile_size!r}. Pass e.g. tile_size={DEFAULT_TILE}.")
    tile = tile_size
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy takes hidden [..., H], weight [V, H] and labels [...] (hidden's "
                         f"leading shape); got hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels "
                         f"{tuple(labels.shape)}.")
    if bias is not None and tuple(bias.shape) != tuple(weight.shape[:1]):
        raise ValueError(f"linear_cross_entropy's bias must be [V] = [{weight.shape[0]}]; got {tuple(bias.shape)}.")
    if not hidden.is_floating_point() or not weight.is_floating_point() or labels.is_floating_point():
        raise TypeError(f"linear_cross_entropy takes floating hidden states and weight and integer labels; got "
                        f"hidden {hidden.dtype}, weight {weight.dtype}, labels {labels.dtype}.")
    vocab = weight.shape[0]
    if num_items_in_batch is not None:
        count = torch.as_tensor(num_items_in_batch, device=hidden.device)
        if count.numel() != 1 or count.is_complex():
            raise ValueError(f"linear_cross_entropy's num_items_in_batch must be a number or a one-element tensor "
                             f"(the count of labelled tokens); got a tensor of shape {tuple(count.shape)}. Pass its "
                             "sum.")
        count = count.reshape(())
    weight, bias, hidden, group, offset, reduce_dh = vocab_parallel_head(weight, bias, hidden, tp_mesh)
    h = hidden.reshape(-1, hidden.shape[-1])
    lab = labels.reshape(-1).to(device=h.device, dtype=torch.long)
    if group is not None:
        check_tp_batch(lab, vocab, ignore_index, group)
    if num_items_in_batch is None:
        count = (lab != ignore_index).sum()  # mean: nan when nothing is labelled, as F.cross_entropy
    dtype = _compute_dtype(h, weight)
    scale = 1.0 / count.to(torch.promote_types(dtype, torch.float32))
    grad = torch.is_grad_enabled()
    need = (grad and h.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)
    return _LinearCrossEntropy.apply(h, weight, bias, lab, scale, tile, ignore_index, dtype, need, group, offset,
                                     reduce_dh)


def merge_tiles(outs: list, batch: int, tile: int, seq_dim: int, what: str):
    """Concatenate the tiles' outputs (the first tile holds ``tile`` tokens): tensors whose dim ``seq_dim``
    is the tile along it, [B * T, ...] ones (an MoE router's scores) as [B, T, ...]; tuples element-wise."""
    first = outs[0]
    if isinstance(first, (tuple, list)):
        return type(first)(merge_tiles([o[i] for o in outs], batch, tile, seq_dim, what) for i in range(len(first)))
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


def _contiguous_first(forward: Callable, x: Tensor, *args, **kwargs):
    return forward(x.contiguous(), *args, **kwargs)


def tiled_forward(forward: Callable, x: Tensor, *args, tile_size: int, seq_dim: int = 1, what: str = "the module",
                  recompute_context: Callable | None = None, **kwargs):
    """``forward(x, *args, **kwargs)`` for a token-wise ``forward``, ``tile_size`` tokens of ``x`` (along
    ``seq_dim``) at a time, each tile recomputed in backward (see Note [Sequence tiling]).
    ``recompute_context()``: a context manager entered around each tile's recomputation (eager), e.g. to keep
    a router's token counts from counting a tile twice."""
    n = x.shape[seq_dim]
    if n <= tile_size:
        return forward(x, *args, **kwargs)
    grad = torch.is_grad_enabled()
    if any(x.shape[d] > 1 for d in range(seq_dim)):  # a tile of B > 1 rows is strided: made contiguous inside the
        forward = functools.partial(_contiguous_first, forward)  # call (blocks that .view() it), recomputed, not kept
    outs = []
    for s in range(0, n, tile_size):
        part = x.narrow(seq_dim, s, min(tile_size, n - s))
        if grad:  # only the tile's output is kept; its intermediates come back one tile at a time in backward
            ctx = {} if recompute_context is None else {"context_fn": lambda: (nullcontext(), recompute_context())}
            outs.append(checkpoint(forward, part, *args, use_reentrant=False, **ctx, **kwargs))
        else:
            outs.append(forward(part, *args, **kwargs))
    return merge_tiles(outs, x.shape[0], tile_size, seq_dim, what)
