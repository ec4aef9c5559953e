"""Ring vs all-gather vs 2x2 (heads all-to-all x ring) at P = 4: time and bytes per rank per layer.

    .venv/bin/python scripts/benchmarks/bench_2d.py [--s-local 2048] [--iters 3] [--layout striped]

Four forked gloo ranks, one thread each, causal attention fwd+bwd on each rank's N/P = --s-local
tokens (B = 1, Hq = 8, Hkv = 2, D = 64, float32). Per mode: the median wall time of --iters timed calls
(after one warm-up), the bytes this rank sent (debug.CommBytes, K/V exchange only: the agreement
check's all-gather subtracted) and the ratio to cp_dtensor.wire's formula. Modes run interleaved per
iteration so that a busy machine slows them alike. Prints one JSON line. CPU timings are informational:
gloo on one host has no link to hide, so the fewer-message modes mostly save the per-message overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import cp_dtensor  # noqa: E402
from cp_dtensor.core.plan.wire import allgather_bytes, check_bytes, ring_bytes, ulysses_bytes  # noqa: E402
from cp_dtensor.tools.debug import CommBytes  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402

B, HQ, HKV, D = 1, 8, 2, 64


def _modes(world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2))
    dims = dict(b=B, hkv=HKV, dqk=D, dv=D, itemsize=4)
    return {
        "ring": (None, "ring", lambda s: ring_bytes(p=world, s_local=s, **dims), check_bytes(world)),
        "allgather": (None, "allgather", lambda s: allgather_bytes(p=world, s_local=s, **dims), check_bytes(world)),
        "2x2": (mesh, "ring", lambda s: ulysses_bytes(u=2, r=world // 2, s_local=s, hq=HQ, **dims),
                check_bytes(world, 2)),
    }


def _bench(rank, world, s_local, iters, layout):
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, HQ, s_local, D, generator=g, requires_grad=True)
    k = torch.randn(B, HKV, s_local, D, generator=g, requires_grad=True)
    v = torch.randn(B, HKV, s_local, D, generator=g, requires_grad=True)
    modes = _modes(world)

    def call(group, exchange):
        out = cp_dtensor.ring_attention(q, k, v, mesh=group, layout=layout, is_causal=True, kv_exchange=exchange)
        out.backward(torch.ones_like(out))

    result = {}
    for name, (group, exchange, formula, check) in modes.items():
        with CommBytes() as cb:
            call(group, exchange)  # warm-up, counted
        want = formula(s_local)["total"]
        result[name] = {"bytes": cb.sent - check, "formula": want, "ratio": (cb.sent - check) / want, "times": []}
    for _ in range(iters):
        for name, (group, exchange, _, _) in modes.items():
            dist.barrier()
            t0 = time.perf_counter()
            call(group, exchange)
            dist.barrier()
            result[name]["times"].append(time.perf_counter() - t0)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--s-local", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--layout", default="striped", choices=cp_dtensor.LAYOUTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = 4
    per_rank = run_ranks(world, _bench, args.s_local, args.iters, args.layout)
    r0 = per_rank[0]
    out = {"P": world, "s_local": args.s_local, "layout": args.layout, "B": B, "Hq": HQ, "Hkv": HKV, "D": D,
           "dtype": "float32", "causal": True}
    for name in r0:
        out[name] = {
            "time_s": round(statistics.median(r0[name]["times"]), 4),
            "bytes_per_rank": [r[name]["bytes"] for r in per_rank],
            "formula": r0[name]["formula"],
            "ratio": [round(r[name]["ratio"], 6) for r in per_rank],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
