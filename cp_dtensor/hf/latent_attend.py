"""One rank's queries over the whole sequence's MLA latent rows, expanded chunk by chunk (hf/latent.py's kernel).

Note [Latent attention in chunks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Multi-head latent attention keeps one row a token -- the normed latent (``kv_lora_rank``) and the rotated
rope key (``qk_rope_head_dim``) -- that the layer's own ``expand_kv`` (``kv_b_proj``) turns into every
head's key and value. With the latent rows of the sequence in global order, a rank attends its queries
to them a key chunk at a time: ``expand_kv`` on the chunk's rows, the scores ``q . k * scaling`` with the
chunk's mask (causal by global position, and the padding or document rule of the batch), and the
chunk folded into an online softmax (running max ``m``, sum ``l``, ``acc``; out = acc / l, lse = m +
log l) -- the numerics of SDPA's math kernel up to fp32 rounding. Chunks that start after the rank's
last query are never expanded. A query that sees no key (a left pad) gets a zero output, as SDPA's
fully masked row.

Backward recomputes each chunk's expansion (FlashAttention's recomputation, per key chunk): with
``p = exp(s - lse)`` and ``D = rowsum(dO * out)``, ``dv = p^T dO``, ``ds = p * (dO v^T - D) * scaling``,
``dq += ds k``, ``dk = ds^T q``, then ``autograd.grad`` of the chunk's ``expand_kv`` hands back the
gradient of the chunk's latent rows and of the layer's parameters (``kv_b_proj``'s weight), summed over
the chunks and returned through this Function. So no rank ever holds more than one chunk's expanded K/V
and scores: peak = [B, N, R + r] latents (+ their gradient in backward) + one chunk's [B, H, C, Dqk + Dv]
keys and values and [B, H, S_local, C] scores (C = :func:`key_chunk`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

_SCORES = 2**26  # the most score numbers a key chunk's [B, H, S_local, C] holds (256 MiB in fp32)


def key_chunk(bsz: int, heads: int, s: int, n: int) -> int:
    """C: the key tokens expanded at a time, so that one chunk's scores hold at most ``_SCORES`` numbers."""
    return max(1, min(n, _SCORES // max(1, bsz * heads * s)))


class Masks:
    """Which global key positions each of this rank's queries sees (causal in global order, and ``rows``:
    ("real", [B, N] not padding) or ("documents", [B, N] document ids) or None), chunk by chunk."""

    def __init__(self, mine: Tensor, rows):
        self.mine, self.rows = mine, rows  # mine: [B, S] this rank's queries' global positions
        self.doc = None if rows is None or rows[0] == "real" else rows[1].gather(1, mine)  # [B, S]
        self.end = int(mine.max()) + 1  # keys at or after this position no query of the rank sees

    def chunk(self, lo: int, hi: int) -> Tensor:  # [B, S, C] bool
        keys = torch.arange(lo, hi, device=self.mine.device)
        allowed = keys[None, None, :] <= self.mine[:, :, None]
        if self.rows is not None and self.rows[0] == "real":
            allowed = allowed & self.rows[1][:, None, lo:hi]
        elif self.rows is not None:
            allowed = allowed & (self.rows[1][:, None, lo:hi] == self.doc[:, :, None])
        return allowed


def _expand(module: nn.Module, rows: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's own expansion of latent rows [B, C, R + r]: keys [B, H, C, Dqk], values [B, H, C, Dv]."""
    kv_nope, k_rot = torch.split(rows, [module.kv_lora_rank, rows.shape[-1] - module.kv_lora_rank], dim=-1)
    return type(module).expand_kv(module, kv_nope[:, None], k_rot[:, None])


def _scores(query: Tensor, keys: Tensor, scaling: float, allowed: Tensor) -> Tensor:
    s = torch.matmul(query, keys.transpose(-1, -2)).float() * scaling  # [B, H, S, C]
    return s.masked_fill(~allowed[:, None], float("-inf"))


class LatentAttention(torch.autograd.Function):
    """query [B, H, S, Dqk] over ``latents`` [B, N, R + r] (global order) -> out [B, H, S, Dv]; see Note
    [Latent attention in chunks]. ``params``: the layer's parameters (gradients of those ``expand_kv`` uses)."""

    @staticmethod
    def forward(ctx, module: nn.Module, masks: Masks, scaling: float, query: Tensor, latents: Tensor, *params):
        bsz, heads, s, _ = query.shape
        step = key_chunk(bsz, heads, s, latents.shape[1])
        m = query.new_full((bsz, heads, s), float("-inf"), dtype=torch.float32)
        l = torch.zeros_like(m)  # noqa: E741
        acc = None
        for lo in range(0, masks.end, step):
            hi = min(lo + step, masks.end)
            keys, values = _expand(module, latents[:, lo:hi])
            sc = _scores(query, keys, scaling, masks.chunk(lo, hi))
            new = torch.maximum(m, sc.amax(-1))
            base = new.masked_fill(new == float("-inf"), 0.0)  # a row with no key yet: exp(-inf) = 0 below
            p = torch.exp(sc - base[..., None])
            fix = torch.exp(m - base)
            pv = torch.matmul(p.to(values.dtype), values).float()
            acc = pv if acc is None else acc * fix[..., None] + pv
            l = l * fix + p.sum(-1)  # noqa: E741
            m = new
        seen = l > 0
        out = (acc / torch.where(seen, l, 1.0)[..., None]).masked_fill(~seen[..., None], 0.0)
        lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))
        out = out.to(query.dtype)
        ctx.save_for_backward(query, latents, out, lse)
        ctx.module, ctx.masks, ctx.scaling, ctx.step, ctx.params = module, masks, scaling, step, params
        dev = query.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), dev)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        query, latents, out, lse = ctx.saved_tensors
        module, masks, scaling, step = ctx.module, ctx.masks, ctx.scaling, ctx.step
        do = grad_out.float()
        delta = (do * out.float()).sum(-1)  # [B, H, S]: D = rowsum(dO * out)
        base = torch.where(torch.isfinite(lse), lse, 0.0)[..., None]
        dq = torch.zeros_like(query, dtype=torch.float32)
        dlat = torch.zeros_like(latents)
        wanted = ctx.params
        sums: list[Tensor | None] = [None] * len(wanted)
        enabled, dtype, dev = ctx.autocast
        for lo in range(0, masks.end, step):
            hi = min(lo + step, masks.end)
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                rows = latents[:, lo:hi].detach().requires_grad_()
                keys, values = _expand(module, rows)
            k, v = keys.detach(), values.detach()
            p = torch.exp(_scores(query, k, scaling, masks.chunk(lo, hi)) - base)  # [B, H, S, C]
            dv = torch.matmul(p.transpose(-1, -2), do)
            ds = p * (torch.matmul(do, v.float().transpose(-1, -2)) - delta[..., None]) * scaling
            dq += torch.matmul(ds, k.float())
            dk = torch.matmul(ds.transpose(-1, -2), query.float())
            got = torch.autograd.grad((keys, values), (rows, *wanted), (dk.to(keys.dtype), dv.to(values.dtype)),
                                      allow_unused=True)
            dlat[:, lo:hi] += got[0]
            sums = [g if a is None else a if g is None else a + g for a, g in zip(sums, got[1:])]
        return (None, None, None, dq.to(query.dtype), dlat, *sums)


def _parameters(module: nn.Module) -> list[Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def latent_attention(module: nn.Module, masks: Masks, scaling: float, query: Tensor, latents: Tensor) -> Tensor:
    """:class:`LatentAttention` with the layer's trainable parameters as inputs (their gradients come back
    through it). Returns out [B, H, S, Dv]."""
    return LatentAttention.apply(module, masks, scaling, query, latents, *_parameters(module))
