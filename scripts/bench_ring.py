"""Benchmark the ring on CPU ranks (one thread each): causal forward+backward, side by side.

    .venv/bin/python scripts/bench_ring.py --world 2 --s-local 4096

Reports, from one run (the machine is shared and noisy, so only ratios measured together count):
  * ring time per layout (median of --iters, after a warm-up), and the bytes each rank sent vs the formula;
  * P3 = contiguous time / striped time, next to its kernel ceiling
    (T_causal + T_full) / (T_causal + T_strict) of single S_local blocks timed in the same run (P=2);
  * P4 = ideal / ring time, ideal = one process running full-sequence SDPA fwd+bwd, divided by P.
Writes a JSON record with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cp_dtensor  # noqa: E402
from cp_dtensor.debug import CommBytes  # noqa: E402
from cp_dtensor.ops import block_attn, block_attn_backward  # noqa: E402


def _qkv(args, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(args.batch, args.q_heads, n, args.head_dim, generator=g).to(dtype)
    k = torch.randn(args.batch, args.kv_heads, n, args.head_dim, generator=g).to(dtype)
    v = torch.randn(args.batch, args.kv_heads, n, args.head_dim, generator=g).to(dtype)
    return q, k, v


def _median_time(fn, iters):
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _block_fwd_bwd(q, k, v, causal, scale):
    out, lse = block_attn(q, k, v, causal, scale)
    block_attn_backward(torch.ones_like(out), q, k, v, out, lse, causal, scale)


def _sdpa_fwd_bwd(q, k, v):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(torch.ones_like(out))


def _rank(rank, world, init, args, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    dtype = getattr(torch, args.dtype)
    s, n = args.s_local, args.s_local * world
    scale = args.head_dim**-0.5
    rec = {"rank": rank}
    q, k, v = _qkv(args, s, dtype, seed=rank)
    for layout in args.layouts:
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))

        def step():
            out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
            out.backward(torch.ones_like(out))

        dist.barrier()
        rec[f"ring_{layout}"] = _median_time(step, args.iters)
        with CommBytes() as sent:
            cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
        rec[f"bytes_{layout}"] = sent.by_op["all_to_all_single"]
    # Single blocks and the ideal run on rank 0 while the others wait at the barrier.
    dist.barrier()
    if rank == 0:
        rec["T_causal"] = _median_time(lambda: _block_fwd_bwd(q, k, v, True, scale), args.iters)
        rec["T_full"] = _median_time(lambda: _block_fwd_bwd(q, k, v, False, scale), args.iters)
        qs, ks, vs = q[:, :, 1:], k[:, :, :-1], v[:, :, :-1]
        rec["T_strict"] = _median_time(lambda: _block_fwd_bwd(qs, ks, vs, True, scale), args.iters)
        if not args.skip_ideal:
            qf, kf, vf = _qkv(args, n, dtype)
            rec["T_full_sequence"] = _median_time(lambda: _sdpa_fwd_bwd(qf, kf, vf), args.iters)
    dist.barrier()
    queue.put(rec)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--s-local", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--layouts", nargs="+", default=list(cp_dtensor.LAYOUTS))
    p.add_argument("--skip-ideal", action="store_true")
    p.add_argument("--out", help="write the JSON record here")
    args = p.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rdzv"
        procs = [ctx.Process(target=_rank, args=(r, args.world, init, args, queue)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        recs = sorted((queue.get() for _ in procs), key=lambda r: r["rank"])
        for proc in procs:
            proc.join()

    world, s = args.world, args.s_local
    itemsize = getattr(torch, args.dtype).itemsize
    formula = (world - 1) * 2 * args.batch * s * args.head_dim * args.kv_heads * itemsize
    r0 = recs[0]
    res = {"config": vars(args), "formula_bytes": formula}
    print(f"P={world}, S_local={s}, B={args.batch}, Hq={args.q_heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
          f"{args.dtype}, causal fwd+bwd, 1 thread per rank, median of {args.iters}")
    for layout in args.layouts:
        t = max(r[f"ring_{layout}"] for r in recs)  # a ring step lasts as long as its slowest rank
        res[f"ring_{layout}_s"] = t
        ratio = r0[f"bytes_{layout}"] / formula if formula else 1.0
        res[f"bytes_ratio_{layout}"] = ratio
        print(f"  ring {layout:<10} {t * 1e3:9.1f} ms   bytes sent / formula = {ratio:.3f}")
    tc, tf, ts = r0["T_causal"], r0["T_full"], r0["T_strict"]
    res.update(T_causal_s=tc, T_full_s=tf, T_strict_s=ts)
    print(f"  single blocks: causal {tc * 1e3:.1f} ms, full {tf * 1e3:.1f} ms, strictly causal {ts * 1e3:.1f} ms")
    if "striped" in args.layouts and "contiguous" in args.layouts:
        p3 = res["ring_contiguous_s"] / res["ring_striped_s"]
        ceiling = (tc + tf) / (tc + ts)
        res.update(P3=p3, P3_ceiling=ceiling, P3_of_ceiling=p3 / ceiling)
        print(f"  P3 contiguous/striped = {p3:.3f}; kernel ceiling (Tc+Tf)/(Tc+Ts) = {ceiling:.3f}; "
              f"P3/ceiling = {p3 / ceiling:.3f} (target >= 0.95)")
    if "T_full_sequence" in r0:
        ideal = r0["T_full_sequence"] / world
        res["ideal_s"] = ideal
        for layout in args.layouts:
            res[f"P4_{layout}"] = ideal / res[f"ring_{layout}_s"]
        print(f"  ideal (full-sequence SDPA / P) {ideal * 1e3:.1f} ms; P4 ideal/ring: "
              + ", ".join(f"{lay} {res[f'P4_{lay}']:.3f}" for lay in args.layouts) + " (target >= 0.9)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
