"""One-GPU check of the blockwise ring math: bf16 correctness, and the blockwise overhead at N = 128k.

    python scripts/gpu_check.py                                    # CUDA: Hq 32, Hkv 8, D 128, bf16, P = 8
    .venv/bin/python scripts/gpu_check.py --device cpu --seq-len 2048   # CPU crash test: Hq 4, Hkv 2, D 64

P ranks are simulated in one process: rank r's step t calls cp_dtensor.ops.block_attn (and, backward,
block_attn_backward) on exactly the slices cp_dtensor.layout.step_block gives for the K/V block of rank
(r - t) mod P, and merges with ring.py's own LSE merge. No collectives: what is checked is the ring's
arithmetic and kernels, not the transport (tests/test_ring.py covers that on gloo).

1. correctness at --check-seq-len (default min(8192, --seq-len)), per layout: out, dq, dk, dv of the
   simulated ring vs one full-sequence causal call of the same kernel, both against a reference in
   float32 (CUDA) / float64 (CPU) computed head group by head group. PASS when the ring's error is within
   2x the single call's error plus 1e-3 (bf16 rounds the per-block outputs; the merge is fp32).
2. overhead at --seq-len: P^2 simulated steps (all ranks' blocks, fwd+bwd, merges included) vs one causal
   call over the whole sequence; both do the same causal pairs, so the ratio is the blockwise overhead.
Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cp_dtensor.layout import LAYOUTS, shard_tensor, step_block, unshard_tensor  # noqa: E402
from cp_dtensor.ops import block_attn, block_attn_backward  # noqa: E402
from cp_dtensor.ops import merge_ as _merge_  # noqa: E402  (the ring's own merge, so this checks its math)


def _steps(world: int, rank: int, s: int, layout: str):
    """Rank ``rank``'s causal ring steps in order: (source rank, q rows, kv rows, causal), skipped ones left out."""
    for t in range(world):
        src = (rank - t) % world
        blk = step_block(layout, rank=rank, src=src, world=world, s_local=s, is_causal=True)
        if blk is not None:
            yield src, (slice(None), slice(None), blk.q_rows), (slice(None), slice(None), blk.kv_rows), blk.causal


def ring_forward_sim(qs, ks, vs, *, layout: str, scale: float):
    """Every rank's ring forward, one after another. qs[r]: [B, Hq, S, D]; ks[r], vs[r]: [B, Hkv, S, D].
    Returns outs[r] in q's dtype and lses[r]: [B, Hq, S] fp32."""
    world, s = len(qs), qs[0].shape[2]
    outs, lses = [], []
    for r in range(world):
        out = lse = None
        for src, qr, kr, causal in _steps(world, r, s, layout):
            out_b, lse_b = block_attn(qs[r][qr], ks[src][kr], vs[src][kr], causal, scale)
            if out is None:  # step 0, the diagonal block, covers every row
                out, lse = out_b.float(), lse_b.clone()
            else:
                _merge_(out[qr], lse[qr], out_b, lse_b)
        outs.append(out.to(qs[r].dtype))
        lses.append(lse)
    return outs, lses


def ring_backward_sim(dos, qs, ks, vs, outs, lses, *, layout: str, scale: float):
    """Every rank's ring backward; dK/dV of a block accumulate where the ring would send them (fp32)."""
    world, s = len(qs), qs[0].shape[2]
    dqs = [torch.zeros_like(q, dtype=torch.float32) for q in qs]
    dks = [torch.zeros_like(k, dtype=torch.float32) for k in ks]
    dvs = [torch.zeros_like(v, dtype=torch.float32) for v in vs]
    for r in range(world):
        for src, qr, kr, causal in _steps(world, r, s, layout):
            dq_b, dk_b, dv_b = block_attn_backward(dos[r][qr], qs[r][qr], ks[src][kr], vs[src][kr], outs[r][qr],
                                                   lses[r][qr], causal, scale)
            dqs[r][qr] += dq_b
            dks[src][kr] += dk_b
            dvs[src][kr] += dv_b
    return dqs, dks, dvs


def simulate(q, k, v, do, *, layout: str, world: int, scale: float):
    """Full-sequence out, dq, dk, dv of a P-rank ring on q: [B, Hq, N, D], k, v: [B, Hkv, N, D]."""
    shard = lambda x: [shard_tensor(x, dim=2, layout=layout, rank=r, world=world) for r in range(world)]  # noqa: E731
    qs, ks, vs, dos = shard(q), shard(k), shard(v), shard(do)
    outs, lses = ring_forward_sim(qs, ks, vs, layout=layout, scale=scale)
    grads = ring_backward_sim(dos, qs, ks, vs, outs, lses, layout=layout, scale=scale)
    return [unshard_tensor(x, dim=2, layout=layout) for x in (outs, *grads)]


def single_call(q, k, v, do, *, scale: float):
    """One causal call of the same kernel over the whole sequence: out, dq, dk, dv."""
    out, lse = block_attn(q, k, v, True, scale)
    return [out, *block_attn_backward(do, q, k, v, out, lse, True, scale)]


def reference(q, k, v, do, *, scale: float, dtype: torch.dtype):
    """Causal attention in ``dtype`` with autograd, one KV head (and its query heads) at a time."""
    hkv, groups, n = k.shape[1], q.shape[1] // k.shape[1], q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    res = [torch.empty_like(x, dtype=dtype) for x in (q, q, k, v)]
    for h in range(hkv):
        hs = slice(h * groups, (h + 1) * groups)
        qh = q[:, hs].to(dtype).requires_grad_()
        kh, vh = (x[:, h:h + 1].to(dtype).requires_grad_() for x in (k, v))
        p = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        out = p @ vh
        out.backward(do[:, hs].to(dtype))
        res[0][:, hs], res[1][:, hs] = out.detach(), qh.grad
        res[2][:, h:h + 1], res[3][:, h:h + 1] = kh.grad, vh.grad
        del p, out
    return res


def rel_err(x, ref) -> float:
    return ((x.to(ref.dtype) - ref).abs().max() / ref.abs().max()).item()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters):
    fn()  # warm-up
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs(args, n, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda h: (args.batch, h, n, args.head_dim)  # noqa: E731
    xs = [torch.randn(shape(h), generator=g) for h in (args.q_heads, args.kv_heads, args.kv_heads, args.q_heads)]
    return [x.to(device=device, dtype=dtype) for x in xs]


def check_correctness(args, device, dtype, n):
    ref_dtype = torch.float32 if device.type == "cuda" else torch.float64
    q, k, v, do = make_inputs(args, n, device, dtype)
    scale = args.head_dim**-0.5
    ref = reference(q, k, v, do, scale=scale, dtype=ref_dtype)
    single = [rel_err(x, r) for x, r in zip(single_call(q, k, v, do, scale=scale), ref)]
    rows = []
    for layout in args.layouts:
        ring = simulate(q, k, v, do, layout=layout, world=args.world, scale=scale)
        errs = [rel_err(x, r) for x, r in zip(ring, ref)]
        ok = all(e <= 2 * s + 1e-3 for e, s in zip(errs, single))
        rows.append(dict(layout=layout, ring_err=errs, single_err=single, ok=ok))
        names = ("out", "dq", "dk", "dv")
        print(f"  {layout:<10} ring vs {ref_dtype}: " + " ".join(f"{m} {e:.1e}" for m, e in zip(names, errs))
              + f" | one call: " + " ".join(f"{m} {e:.1e}" for m, e in zip(names, single))
              + ("  PASS" if ok else "  FAIL"))
    return rows


def check_overhead(args, device, dtype, n):
    q, k, v, do = make_inputs(args, n, device, dtype, seed=1)
    scale = args.head_dim**-0.5
    t_single = _time(lambda: single_call(q, k, v, do, scale=scale), device, args.iters)
    rows = []
    for layout in args.layouts:
        shard = lambda x: [shard_tensor(x, dim=2, layout=layout, rank=r, world=args.world)  # noqa: E731
                           for r in range(args.world)]
        qs, ks, vs, dos = shard(q), shard(k), shard(v), shard(do)

        def ring():
            outs, lses = ring_forward_sim(qs, ks, vs, layout=layout, scale=scale)
            ring_backward_sim(dos, qs, ks, vs, outs, lses, layout=layout, scale=scale)

        t_ring = _time(ring, device, args.iters)
        rows.append(dict(layout=layout, ring_s=t_ring, single_s=t_single, overhead=t_ring / t_single - 1))
        print(f"  {layout:<10} {args.world}^2 blockwise steps {t_ring * 1e3:9.1f} ms vs one causal call "
              f"{t_single * 1e3:9.1f} ms: overhead {t_ring / t_single - 1:+.1%}")
        del qs, ks, vs, dos
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=131072, help="N of the overhead check")
    p.add_argument("--check-seq-len", type=int, default=None, help="N of the correctness check (default min(8192, N))")
    p.add_argument("--world", type=int, default=8, help="simulated ranks P")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, help="default 32 on CUDA, 4 on CPU")
    p.add_argument("--kv-heads", type=int, help="default 8 on CUDA, 2 on CPU")
    p.add_argument("--head-dim", type=int, help="default 128 on CUDA, 64 on CPU")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--iters", type=int, help="timed repeats (default 3 on CUDA, 1 on CPU)")
    p.add_argument("--out", default="bench_out/gpu_check.json")
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # CPU is a crash test at a tiny size (bf16 attention is slow there): small heads unless asked
    for name, cuda, cpu in (("q_heads", 32, 4), ("kv_heads", 8, 2), ("head_dim", 128, 64), ("iters", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, cuda if device.type == "cuda" else cpu)
    if args.seq_len % (2 * args.world):
        raise ValueError(f"--seq-len must be a multiple of 2 * --world ({2 * args.world}) for every layout; "
                         f"got {args.seq_len}.")
    n_check = args.check_seq_len or min(8192, args.seq_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}: P={args.world} simulated ranks, B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} {args.dtype}, causal fwd+bwd")
    t0 = time.perf_counter()
    print(f"correctness at N={n_check}:")
    correct = check_correctness(args, device, dtype, n_check)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"blockwise overhead at N={args.seq_len} (median of {args.iters}):")
    overhead = check_overhead(args, device, dtype, args.seq_len)
    res = dict(config=vars(args), device=name, correctness=correct, overhead=overhead,
               seconds=time.perf_counter() - t0)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    ok = all(r["ok"] for r in correct)
    print(f"{'PASS' if ok else 'FAIL'} in {res['seconds']:.0f} s; wrote {args.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
