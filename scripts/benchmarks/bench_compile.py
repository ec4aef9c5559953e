"""Benchmark the compiled ring against the eager ring on CPU ranks: causal forward+backward, side by side.

    .venv/bin/python scripts/benchmarks/bench_compile.py --world 2 --s-local 1024 4096

For each S_local, every rank times the eager step and the ``torch.compile(fullgraph=True)`` step
(default Inductor) in alternation -- eager, compiled, compiled, eager, ... -- so that the noise of a
shared machine hits both alike. A step lasts as long as its slowest rank, so each iteration counts
the maximum over ranks; the report gives the median of those, the ratio compiled / eager (target
<= 1.0) and the cold compile time: the first compiled call (forward + backward) minus one warm
step, with a fresh, empty Inductor cache. ``--overlap-config`` compiles under the Inductor setting
of tests/core/test_compile.py (OVERLAP_CONFIG) instead of the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
import cp_dtensor  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402  the one rank launcher (tests/_dist.py)

OVERLAP_CONFIG = dict(reorder_for_peak_memory=False)  # the same as tests/core/test_compile.py


def _step(fn, q, k, v, dout):
    out = fn(q, k, v)
    out.backward(dout)


def _timed(fn, *args):
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _rank(rank, world, args):
    torch._inductor.config.compile_threads = 1
    if args.overlap_config:
        for key, val in OVERLAP_CONFIG.items():
            setattr(torch._inductor.config, key, val)
    rec = {}
    for s in args.s_local:
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(args.batch, args.q_heads, s, args.head_dim, generator=g).requires_grad_()
        k = torch.randn(args.batch, args.kv_heads, s, args.head_dim, generator=g).requires_grad_()
        v = torch.randn(args.batch, args.kv_heads, s, args.head_dim, generator=g).requires_grad_()
        dout = torch.randn(args.batch, args.q_heads, s, args.head_dim, generator=g)

        def eager(q, k, v):
            return cp_dtensor.ring_attention(q, k, v, layout=args.layout, is_causal=True)

        compiled = torch.compile(eager, fullgraph=True, dynamic=False)
        cold = _timed(_step, compiled, q, k, v, dout)  # compiles forward, then backward
        _timed(_step, eager, q, k, v, dout)  # warm-up
        times = {"eager": [], "compiled": []}
        for i in range(args.iters):
            order = ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")
            for name in order:
                times[name].append(_timed(_step, eager if name == "eager" else compiled, q, k, v, dout))
        rec[s] = dict(cold=cold, **times)
    dist.barrier()
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--s-local", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="striped", choices=cp_dtensor.LAYOUTS)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--overlap-config", action="store_true", help="compile under OVERLAP_CONFIG")
    p.add_argument("--out", help="write the JSON record here")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        # A fresh Inductor cache: the first compiled call is a cold compile (spawned ranks: fresh interpreters).
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        recs = dict(enumerate(run_ranks(args.world, _rank, args, timeout_s=3600.0, start_method="spawn")))

    print(f"P={args.world}, B={args.batch}, Hq={args.q_heads}, Hkv={args.kv_heads}, D={args.head_dim}, fp32, "
          f"{args.layout}, causal fwd+bwd, 1 thread per rank, {'OVERLAP_CONFIG' if args.overlap_config else 'default Inductor'}, "
          f"median of {args.iters} interleaved")
    res = {"config": vars(args)}
    for s in args.s_local:
        # per iteration, the slowest rank
        per_iter = {name: [max(recs[r][s][name][i] for r in recs) for i in range(args.iters)]
                    for name in ("eager", "compiled")}
        eager, compiled = statistics.median(per_iter["eager"]), statistics.median(per_iter["compiled"])
        cold = max(recs[r][s]["cold"] for r in recs) - compiled
        ratios = sorted(c / e for c, e in zip(per_iter["compiled"], per_iter["eager"]))
        res[str(s)] = dict(eager_s=eager, compiled_s=compiled, ratio=compiled / eager, ratios=ratios, cold_compile_s=cold)
        print(f"  S_local={s:5d}: eager {eager * 1e3:8.1f} ms  compiled {compiled * 1e3:8.1f} ms  "
              f"compiled/eager {compiled / eager:.3f} (per-pair {ratios[0]:.3f}..{ratios[-1]:.3f}, target <= 1.0)  "
              f"cold compile {cold:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
