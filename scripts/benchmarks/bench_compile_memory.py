"""Peak memory per rank of the compiled ring against the eager ring: causal forward+backward, side by side.

    .venv/bin/python scripts/benchmarks/bench_compile_memory.py [--s-local 4096] [--worlds 2 4] [--baseline]

Each rank runs the eager step and the ``torch.compile(fullgraph=True)`` step once to warm up (compiling
happens there), then measures each step's resident high-water mark above what it held before the step
(fresh process memory accounting from scripts/benchmarks/_bench_mem.py). The report is the largest
rank's peak for each, and compiled / eager (target <= 1.1). ``--p5-cap-mib C`` instead searches, for eager and compiled alike, the longest sequence whose step
fits C MiB per rank (P5 under compile; target compiled >= 0.9 x eager): the compiled function is
built once with ``dynamic=True``, every probe length first runs unmeasured (so a recompile never
lands inside a measurement), and the ranks agree on each probe through an all-reduce of their peaks.
``--baseline`` replays the old compiled
backward, in which the joint graph merged the backward's K/V rotations into the forward's and kept
every received block (see Note [Compiled backward re-sends K/V] in ring.py), for comparison.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import cp_dtensor  # noqa: E402
import cp_dtensor.core.exchange.ring as ring  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402
from _bench_mem import _libc_live_memory, peak_since, reset_peak, search_max  # noqa: E402


def _rank(rank, world, s_local, shape, baseline):
    b, hq, hkv, d = shape
    torch._inductor.config.compile_threads = 1
    if baseline:
        ring.after = lambda x, dep: x  # the old graph: identical rotations, merged by the joint graph

    def attn(q, k, v):
        return cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True)

    compiled = torch.compile(attn, fullgraph=True)

    def step(fn):
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(b, h, s_local, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))

    _libc_live_memory()
    res = {}
    for name, fn in (("eager", attn), ("compiled", compiled)):
        step(fn)  # warm up (and compile)
        base = reset_peak()
        step(fn)
        res[name] = peak_since(base)
    return res


def _rank_p5(rank, world, cap_bytes, shape, start, unit):
    import torch.distributed as dist

    b, hq, hkv, d = shape
    torch._inductor.config.compile_threads = 1

    def attn(q, k, v):
        return cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True)

    compiled = torch.compile(attn, fullgraph=True, dynamic=True)

    def step(fn, s_local):
        g = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(b, h, s_local, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))

    _libc_live_memory()
    probes = {"eager": {}, "compiled": {}}

    def fits(name, fn, s_local):
        step(fn, s_local)  # unmeasured: compiles (or recompiles) here, never inside the measurement
        base = reset_peak()
        step(fn, s_local)
        peak = torch.tensor([peak_since(base)], dtype=torch.int64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # every rank takes the same branch of the search
        probes[name][s_local] = int(peak)
        return int(peak) <= cap_bytes

    res = {}
    for name, fn in (("eager", attn), ("compiled", compiled)):
        res[name] = search_max(lambda s: fits(name, fn, s), start=start, unit=unit, rel_grain=1 / 256)
    res["probes"] = probes
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--s-local", type=int, default=4096)
    p.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--p5-cap-mib", type=float, default=None, help="P5 search under this per-rank cap instead")
    args = p.parse_args()
    torch.set_num_threads(1)
    shape = (1, 8, 2, 64)  # B, Hq, Hkv, D; fp32
    if args.p5_cap_mib is not None:
        cap = int(args.p5_cap_mib * 2**20)
        print(f"| P | eager N_max | compiled N_max | compiled / eager | (cap {args.p5_cap_mib:g} MiB per rank)")
        print("|---|---|---|---|")
        for world in args.worlds:
            r = run_ranks(world, _rank_p5, cap, shape, 1024, 64)[0]
            e, c = world * r["eager"], world * r["compiled"]
            print(f"| {world} | {e} | {c} | {c / e:.3f} |", flush=True)
            print("  probes (S_local: MiB):", {k: {s: round(v / 2**20, 1) for s, v in sorted(d.items())}
                                               for k, d in r["probes"].items()}, flush=True)
        return
    block = 2 * shape[0] * args.s_local * shape[2] * shape[3] * 4
    print(f"| P | eager MiB | compiled MiB | compiled / eager | (compiled - eager) / K/V block |{' (baseline)' if args.baseline else ''}")
    print("|---|---|---|---|---|")
    for world in args.worlds:
        per_rank = run_ranks(world, _rank, args.s_local, shape, args.baseline)
        eager = max(r["eager"] for r in per_rank)
        comp = max(r["compiled"] for r in per_rank)
        print(f"| {world} | {eager / 2**20:.1f} | {comp / 2**20:.1f} | {comp / eager:.2f} | {(comp - eager) / block:.2f} |")


if __name__ == "__main__":
    main()
