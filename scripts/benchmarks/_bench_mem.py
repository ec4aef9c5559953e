"""Peak memory per rank, and P5: the longest sequence whose attention fits a fixed per-rank memory cap.

What is measured (Linux): the resident set of the rank process. Before a measured call we reset the
kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) and read VmRSS; after it we read VmHWM.
``peak = VmHWM - VmRSS_before`` is everything the call made resident at its worst moment: q/k/v shards
with requires_grad, dO, the ring's K/V and dK/dV buffers, out/lse, the gradients, kernel workspace and
gloo's send/receive copies -- torch, gloo connections and the interpreter are below the line (a tiny
warm-up ring call runs first). Each probe runs in freshly forked ranks that first return the heap they
inherit (``malloc_trim``) and fix glibc's mmap threshold at 64 KiB (``mallopt``), so every tensor buffer
is its own mapping, returned when freed: the peak is the live memory, not the history of glibc's heap
(with glibc's default dynamic threshold, freed blocks stay resident and the fwd+bwd peak of a P = 4
rank is about 1.4x higher; see the report).

Two workloads: the attention op alone (``ring_peak``: q/k/v in, gradients out), and a stack of
Llama-style layers around it (``layers_peak``: RMSNorm, q/k/v/o projections, the ring, a SwiGLU MLP,
residuals), which is what a training rank holds. Weights and their gradient buffers are allocated
before the line, so both measure what grows with the sequence.

Search (P5): for each P, the per-rank shard length S (a multiple of ``unit``) doubles from ``start``
while the probe fits the cap (or halves until it does), then bisects between the last fit and the first miss down to ``grain``
(S/64, so about 1.6 %); N_max(P) = P * S_max and P5(P) = N_max(P) / N_max(1).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

import cp_dtensor


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status: peak memory needs Linux")


def _libc_live_memory() -> None:
    """Make RSS follow live memory in this process: return free heap pages, mmap every block >= 64 KiB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD; a fixed value also turns off the dynamic threshold
    libc.malloc_trim(0)


def reset_peak() -> int:
    """Reset the resident high-water mark; returns the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def peak_since(base: int) -> int:
    """Bytes of the resident high-water mark above ``base`` (from :func:`reset_peak`)."""
    return _status_kib("VmHWM") * 1024 - base


def search_max(fits: Callable[[int], bool], *, start: int, unit: int, rel_grain: float = 1 / 64) -> int:
    """Largest multiple of ``unit`` for which ``fits`` holds (assumed monotone): doubling (or halving when
    ``start`` is too big), then bisection to within max(unit, rel_grain * value). 0 when ``unit`` misses."""
    if fits(start):
        lo, hi = start, 2 * start
        while fits(hi):
            lo, hi = hi, 2 * hi
    else:
        lo, hi = start // 2 // unit * unit, start
        while lo >= unit and not fits(lo):
            lo, hi = lo // 2 // unit * unit, lo
        if lo < unit:
            return 0
    while hi - lo > max(unit, int(rel_grain * lo)):
        mid = (lo + hi) // 2 // unit * unit
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def ring_peak(rank: int, world: int, s_local: int, shape: dict, dtype: torch.dtype, layout: str) -> int:
    """Peak resident bytes of one causal ring fwd+bwd on this rank, inputs and gradients included."""
    b, hq, hkv, d = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]

    def fwd_bwd(s):
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(b, hq, s, d, generator=g, dtype=dtype).requires_grad_()
        k = torch.randn(b, hkv, s, d, generator=g, dtype=dtype).requires_grad_()
        v = torch.randn(b, hkv, s, d, generator=g, dtype=dtype).requires_grad_()
        out = cp_dtensor.ring_attention(q, k, v, layout=layout, is_causal=True)
        out.backward(torch.ones_like(out))

    _libc_live_memory()
    fwd_bwd(2)  # warm-up at S_local = 2: gloo connections, lazy state
    base = reset_peak()
    fwd_bwd(s_local)
    return peak_since(base)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def layers_peak(rank: int, world: int, s_local: int, shape: dict, dtype: torch.dtype, layout: str,
                layers: int = 4, ffn_mult: int = 3) -> int:
    """Peak resident bytes of one fwd+bwd of ``layers`` Llama-style blocks (dim = Hq * D, SwiGLU hidden
    ``ffn_mult`` * dim) on this rank's S_local tokens, attention through the ring; weights and their
    gradients are below the line."""
    b, hq, hkv, d = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    dim, hidden = hq * d, ffn_mult * hq * d
    g = torch.Generator().manual_seed(0)  # the same weights on every rank

    def w(i, o):
        return (torch.randn(i, o, generator=g, dtype=dtype) * i ** -0.5).requires_grad_()

    blocks = [dict(wq=w(dim, dim), wk=w(dim, hkv * d), wv=w(dim, hkv * d), wo=w(dim, dim),
                   w1=w(dim, hidden), w3=w(dim, hidden), w2=w(hidden, dim)) for _ in range(layers)]
    for blk in blocks:
        for p in blk.values():
            p.grad = torch.zeros_like(p)

    def fwd_bwd(s):
        x = torch.randn(b, s, dim, generator=torch.Generator().manual_seed(rank), dtype=dtype).requires_grad_()
        h = x
        for blk in blocks:
            a = _rms_norm(h)
            q = (a @ blk["wq"]).view(b, s, hq, d).transpose(1, 2)
            k = (a @ blk["wk"]).view(b, s, hkv, d).transpose(1, 2)
            v = (a @ blk["wv"]).view(b, s, hkv, d).transpose(1, 2)
            o = cp_dtensor.ring_attention(q, k, v, layout=layout, is_causal=True)
            h = h + o.transpose(1, 2).reshape(b, s, dim) @ blk["wo"]
            m = _rms_norm(h)
            h = h + (torch.nn.functional.silu(m @ blk["w1"]) * (m @ blk["w3"])) @ blk["w2"]
        h.sum().backward()

    _libc_live_memory()
    fwd_bwd(2)
    base = reset_peak()
    fwd_bwd(s_local)
    return peak_since(base)
