"""One rank's queries over the whole sequence's MLA latent rows, expanded chunk by chunk (hf/latent.py's kernel).

Note [Latent attention in chunks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Multi-head latent attention keeps one row a token -- the normed latent (``kv_lora_rank``) and the rotated
rope key (``qk_rope_head_dim``) -- that the layer's own ``expand_kv`` (``kv_b_proj``) turns into every
head's key and value. With the latent rows of the sequence in global order, a rank attends its queries
to them a key chunk at a time: ``expand_kv`` on the chunk's rows (C tokens, :func:`key_chunk`), then for
each tile of T queries (:func:`query_tile`) the scores ``q . k * scaling`` with the tile's mask (causal by
global position, and the padding or document rule of the batch), folded into an online softmax (running
max ``m``, sum ``l``, ``acc``; out = acc / l, lse = m + log l) -- the numerics of SDPA's math kernel up to
fp32 rounding. Chunks that start after the rank's last query are never expanded, and a tile is skipped
for a chunk none of its queries reaches. A query that sees no key (a left pad) gets a zero output, as
SDPA's fully masked row.

Backward recomputes each chunk's expansion (FlashAttention's recomputation, per key chunk): with
``p = exp(s - lse)`` and ``D = rowsum(dO * out)``, ``dv = p^T dO``, ``ds = p * (dO v^T - D) * scaling``,
``dq += ds k``, ``dk = ds^T q``, then ``autograd.grad`` of the chunk's ``expand_kv`` hands back the
gradient of the chunk's latent rows and of the layer's parameters (``kv_b_proj``'s weight), summed over
the chunks and returned through this Function. So no rank ever holds more than one chunk's expanded K/V
and one tile's scores: the attention's peak is the [B, N, R + r] latent rows (saved for backward; their
gradient too in backward), one chunk's [B, H, C, Dqk + Dv] keys and values (at most ``_EXPANDED`` numbers;
fp32 gradients of them in backward) and a few [B, H, T, C] fp32 score tiles (at most ``_SCORES`` numbers
each). The attention runs as matmuls and a softmax in tiles (SDPA's math kernel, tiled), not a fused kernel.

With ``FUSED`` (the default) each (query tile, key chunk) instead goes through the core's fused kernel
(core/compute/kernels.py's ``kernel_fwd`` / ``kernel_bwd``, which serve the ring with masks and Dv != Dqk: the
CPU flash kernel; on CUDA the efficient kernel in fp32 with a mask), one batch row at a time with its tile's
mask as an additive [T, C] mask, and the rows' out and lse merged chunk by chunk (``lse' = logaddexp(lse,
lse_c)``, out weighted by ``exp(lse - lse')``); backward calls ``kernel_bwd`` with the final out and lse, which
gives each chunk's share of dq, dk, dv exactly. A query with no key in the chunk takes no part; a tile then
bounds the [T, C] mask only (the kernel tiles its scores itself). CPU, CP = 2, tiny DeepSeek-V3 at N = 2048:
1.56 s fused vs 4.94 s tiled matmuls (ring 1.25 s; scripts/benchmarks/bench_mla.py --time).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.compute.kernels import kernel_bwd, kernel_fwd

_EXPANDED = 2**25  # the most numbers a key chunk's expanded [B, H, C, Dqk + Dv] holds (64 MiB in bf16)
_SCORES = 2**26  # the most numbers a query tile's scores [B, H, T, C] hold (256 MiB in fp32) on an accelerator
_SCORES_CPU = 2**20  # on CPU: tiles that stay in cache run ~2x faster there (scripts/benchmarks/bench_mla.py --time)
FUSED = True  # each (query tile, key chunk) through the core's fused kernel (kernel_fwd / kernel_bwd); False: matmuls


def key_chunk(bsz: int, width: int, n: int) -> int:
    """C: the key tokens expanded at a time (``width``: H x (Dqk + Dv) numbers a token), at most ``_EXPANDED``."""
    return max(1, min(n, _EXPANDED // max(1, bsz * width)))


def query_tile(bsz: int, heads: int, s: int, c: int, device: str = "cuda") -> int:
    """T: the queries scored against a key chunk at a time, at most ``_SCORES`` score numbers (``_SCORES_CPU``)."""
    return max(1, min(s, (_SCORES_CPU if device == "cpu" else _SCORES) // max(1, bsz * heads * c)))


class Masks:
    """Which global key positions each of this rank's queries sees (causal in global order, and ``rows``:
    ("real", [B, N] not padding) or ("documents", [B, N] document ids) or None), tile by chunk."""

    def __init__(self, mine: Tensor, rows):
        self.mine, self.rows = mine, rows  # mine: [B, S] this rank's queries' global positions
        self.doc = None if rows is None or rows[0] == "real" else rows[1].gather(1, mine)  # [B, S]
        self.end = int(mine.max()) + 1  # keys at or after this position no query of the rank sees

    def tiles(self, t: int) -> list[tuple[slice, int]]:
        """The query tiles of ``t`` queries: (slice, the last global position a query of it sees + 1)."""
        s = self.mine.shape[1]
        return [(slice(a, min(s, a + t)), int(self.mine[:, a:a + t].max()) + 1) for a in range(0, s, t)]

    def chunk(self, rows: slice, lo: int, hi: int) -> Tensor:  # [B, T, C] bool
        keys = torch.arange(lo, hi, device=self.mine.device)
        mine = self.mine[:, rows]
        allowed = keys[None, None, :] <= mine[:, :, None]
        if self.rows is not None and self.rows[0] == "real":
            allowed = allowed & self.rows[1][:, None, lo:hi]
        elif self.rows is not None:
            allowed = allowed & (self.rows[1][:, None, lo:hi] == self.doc[:, rows, None])
        return allowed


def _expand(module: nn.Module, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's own expansion of latent rows [B, C, R + r]: keys [B, H, C, Dqk], values [B, H, C, Dv]."""
    kv_nope, k_rot = torch.split(rows, [module.kv_lora_rank, rows.shape[-1] - module.kv_lora_rank], dim=-1)
    return type(module).expand_kv(module, kv_nope[:, None], k_rot[:, None])


def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype out, lse and the gradients accumulate in: fp32, float64 for a float64 model (the CPU kernel
    keeps float64 and hands back a float64 lse)."""
    return torch.promote_types(dtype, torch.float32)


def _scores(query: Tensor, keys: Tensor, scaling: float, allowed: Tensor) -> Tensor:
    s = torch.matmul(query, keys.transpose(-1, -2)).to(_acc(query.dtype)) * scaling  # [B, H, T, C]
    return s.masked_fill(~allowed[:, None], float("-inf"))


def _plan(module: nn.Module, query: Tensor, masks: Masks, n: int) -> tuple[int, list[tuple[slice, int]]]:
    bsz, heads, s, _ = query.shape
    rope = module.qk_rope_head_dim
    c = key_chunk(bsz, module.kv_b_proj.out_features + heads * rope, n)  # k_nope + v from kv_b_proj, k_rot per head
    if FUSED:  # the kernel tiles its scores itself: a tile bounds the [T, C] additive mask of one batch row
        return c, masks.tiles(query_tile(1, 1, s, c))
    return c, masks.tiles(query_tile(bsz, heads, s, c, query.device.type))


class LatentAttention(torch.autograd.Function):
    """query [B, H, S, Dqk] over ``latents`` [B, N, R + r] (global order) -> out [B, H, S, Dv]; see Note
    [Latent attention in chunks]. ``params``: the layer's parameters (gradients of those ``expand_kv`` uses)."""

    @staticmethod
    def forward(ctx, module: nn.Module, masks: Masks, scaling: float, query: Tensor, latents: Tensor, *params):
        bsz, heads, s, _ = query.shape
        step, tiles = _plan(module, query, masks, latents.shape[1])
        m = query.new_full((bsz, heads, s), float("-inf"), dtype=_acc(query.dtype))
        l = torch.zeros_like(m)  # noqa: E741
        acc = None  # [B, H, S, Dv] in _acc's dtype
        for lo in range(0, masks.end, step):
            hi = min(lo + step, masks.end)
            keys, values = _expand(module, latents[:, lo:hi])
            if acc is None:
                acc = query.new_zeros(bsz, heads, s, values.shape[-1], dtype=m.dtype)
            for rows, end in tiles:
                if end <= lo:  # no query of the tile sees a key of the chunk
                    continue
                if FUSED:  # out in acc (normalised), lse in m: merged chunk by chunk
                    _fused_fwd(query, keys, values, scaling, masks.chunk(rows, lo, hi), rows, acc, m)
                    continue
                sc = _scores(query[:, :, rows], keys, scaling, masks.chunk(rows, lo, hi))
                new = torch.maximum(m[:, :, rows], sc.amax(-1))
                base = new.masked_fill(new == float("-inf"), 0.0)  # a row with no key yet: exp(-inf) = 0 below
                p = torch.exp(sc - base[..., None])
                fix = torch.exp(m[:, :, rows] - base)
                # stable merge: acc * exp(m - m') + p v, l * exp(m - m') + sum p
                acc[:, :, rows] = acc[:, :, rows] * fix[..., None] + torch.matmul(p.to(values.dtype), values).to(acc.dtype)
                l[:, :, rows] = l[:, :, rows] * fix + p.sum(-1)
                m[:, :, rows] = new
        if FUSED:
            out, lse = acc.to(query.dtype), m
        else:
            seen = l > 0
            out = (acc / torch.where(seen, l, 1.0)[..., None]).masked_fill(~seen[..., None], 0.0).to(query.dtype)
            lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
        ctx.save_for_backward(query, latents, out, lse)
        ctx.module, ctx.masks, ctx.scaling, ctx.params = module, masks, scaling, params
        dev = query.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), dev)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, latents, out, lse = ctx.saved_tensors
        module, masks, scaling = ctx.module, ctx.masks, ctx.scaling
        step, tiles = _plan(module, query, masks, latents.shape[1])
        do = grad_out.to(lse.dtype)
        delta = (do * out.to(lse.dtype)).sum(-1)  # [B, H, S]: D = rowsum(dO * out)
        base = torch.where(torch.isfinite(lse), lse, 0.0)[..., None]
        dq = torch.zeros_like(query, dtype=lse.dtype)
        dlat = torch.zeros_like(latents)
        sums: list[Tensor | None] = [None] * len(ctx.params)
        enabled, dtype, dev = ctx.autocast
        for lo in range(0, masks.end, step):
            hi = min(lo + step, masks.end)
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                rows_ = latents[:, lo:hi].detach().requires_grad_()
                keys, values = _expand(module, rows_)
            k, v = keys.detach(), values.detach()
            dk, dv = torch.zeros_like(k, dtype=lse.dtype), torch.zeros_like(v, dtype=lse.dtype)
            for rows, end in tiles:
                if end <= lo:
                    continue
                if FUSED:
                    _fused_bwd(grad_out, query, k, v, out, base[..., 0], scaling, masks.chunk(rows, lo, hi), rows,
                               dq, dk, dv)
                    continue
                q = query[:, :, rows]
                p = torch.exp(_scores(q, k, scaling, masks.chunk(rows, lo, hi)) - base[:, :, rows])  # [B, H, T, C]
                dv += torch.matmul(p.transpose(-1, -2), do[:, :, rows])
                ds = p * (torch.matmul(do[:, :, rows], v.to(do.dtype).transpose(-1, -2)) - delta[:, :, rows, None]) * scaling
                dq[:, :, rows] += torch.matmul(ds, k.to(do.dtype))
                dk += torch.matmul(ds.transpose(-1, -2), q.to(do.dtype))
            got = torch.autograd.grad((keys, values), (rows_, *ctx.params), (dk.to(keys.dtype), dv.to(values.dtype)),
                                      allow_unused=True)
            dlat[:, lo:hi] += got[0]
            sums = [g if a is None else a if g is None else a + g for a, g in zip(sums, got[1:])]
        return (None, None, None, dq.to(query.dtype), dlat, *sums)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, C] bool -> the kernels' additive mask (0 where allowed, -inf elsewhere) in ``dtype``."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _fused_fwd(query, keys, values, scaling, allowed, rows, acc, lse) -> None:
    """One (query tile, key chunk) through the core's fused kernel, a batch row at a time (each row its own
    mask), merged into ``acc`` (the normalised out so far) and ``lse`` (-inf: no key yet) in place, both in :func:`_acc`'s dtype."""
    for b in range(query.shape[0]):
        a = allowed[b]  # [T, C]
        hit = a.any(-1)  # [T]: the tile's queries with a key in the chunk
        if not bool(hit.any()):
            continue
        o, ls = kernel_fwd(query[b:b + 1, :, rows], keys[b:b + 1], values[b:b + 1], False, scaling,
                           _additive(a, query.dtype))
        ls = ls.to(lse.dtype).masked_fill(~hit, float("-inf"))  # a query with no key here: no part of its softmax
        o = o.to(acc.dtype).masked_fill(~hit[:, None], 0.0)
        old = lse[b:b + 1, :, rows]
        new = torch.logaddexp(old, ls)
        base = new.masked_fill(new == float("-inf"), 0.0)
        acc[b:b + 1, :, rows] = (acc[b:b + 1, :, rows] * torch.exp(old - base)[..., None]
                                 + o * torch.exp(ls - base)[..., None])
        lse[b:b + 1, :, rows] = new


def _fused_bwd(grad_out, query, k, v, out, lse, scaling, allowed, rows, dq, dk, dv) -> None:
    """The backward of :func:`_fused_fwd` for one (query tile, key chunk), from the final out and ``lse`` (a
    row with no key: 0, every score masked): dq, dk, dv (:func:`_acc`'s dtype) accumulated in place."""
    if query.device.type != "cpu":  # the CUDA kernels read an fp32 lse (a float64 model runs them in fp32)
        lse = lse.float()
    for b in range(query.shape[0]):
        a = allowed[b]
        if not bool(a.any()):
            continue
        got = kernel_bwd(grad_out[b:b + 1, :, rows], query[b:b + 1, :, rows], k[b:b + 1], v[b:b + 1],
                         out[b:b + 1, :, rows], lse[b:b + 1, :, rows].contiguous(), False, scaling,
                         _additive(a, query.dtype))
        dq[b:b + 1, :, rows] += got[0].to(dq.dtype)
        dk[b:b + 1] += got[1].to(dk.dtype)
        dv[b:b + 1] += got[2].to(dv.dtype)


def _parameters(module: nn.Module) -> list[Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def latent_attention(module: nn.Module, masks: Masks, scaling: float, query: Tensor, latents: Tensor) -> Tensor:
    """:class:`LatentAttention` with the layer's trainable parameters as inputs (their gradients come back
    through it). Returns out [B, H, S, Dv]."""
    return LatentAttention.apply(module, masks, scaling, query, latents, *_parameters(module))
