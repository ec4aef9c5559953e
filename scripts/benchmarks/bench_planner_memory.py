"""The planner's memory (Note [Plan memory]) against the measured peak of one ring forward + backward per rank.

    .venv/bin/python scripts/benchmarks/bench_planner_memory.py                  # the CPU shapes, ~1 minute
    .venv/bin/python scripts/benchmarks/bench_planner_memory.py --shape 8192,4,8,2,128,bf16

Each shape runs in freshly forked gloo ranks (one thread each): the peak resident set of one causal striped
``ring_attention`` forward + backward, q/k/v/dO and the gradients included (``_bench_mem.ring_peak``: the
kernel's high-water mark reset, glibc set to return freed blocks), next to ``memory_bytes`` for the same
shapes with ``device="cpu"``. The CUDA figure (``torch.cuda.max_memory_allocated`` of the same call) comes
from ``scripts/benchmarks/gpu_check.py``'s section (d); docs/planner.md keeps both tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from cp_dtensor.tools.plan import PlanInput, memory_bytes  # noqa: E402
import _bench_mem as mem  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402

# N, P, Hq, Hkv, D, dtype: GQA in bf16 (the fp32 accumulators and upcasts at their largest) and MHA in fp32
SHAPES = ["8192,4,8,2,128,bf16", "8192,2,8,8,64,fp32"]
_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def measure(spec: str) -> dict:
    n, p, hq, hkv, d, dtype = spec.split(",")
    n, p, hq, hkv, d = (int(x) for x in (n, p, hq, hkv, d))
    shape = dict(batch=1, q_heads=hq, kv_heads=hkv, head_dim=d)
    peaks = run_ranks(p, mem.ring_peak, n // p, shape, _DT[dtype], "striped")
    plan = memory_bytes(PlanInput(seq_len=n, cp=p, head_dim=d, q_heads=hq, kv_heads=hkv, dtype=dtype, device="cpu"))
    return dict(seq_len=n, cp=p, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype, peaks=peaks, planned=plan,
                ratio=plan["total"] / max(peaks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=SHAPES, help="N,P,Hq,Hkv,D,dtype (striped, causal, batch 1)")
    ap.add_argument("--out", default="bench_out/planner_memory.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # forked ranks: no OpenMP pool may cross the fork
    rows = [measure(s) for s in args.shape]
    mib = 2**20
    print("| N | P | Hq / Hkv | D | dtype | measured peak (max rank) | planner | planner / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']} | {r['cp']} | {r['q_heads']} / {r['kv_heads']} | {r['head_dim']} | {r['dtype']} | "
              f"{max(r['peaks']) / mib:.1f} MiB | {r['planned']['total'] / mib:.1f} MiB | {r['ratio']:.2f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
