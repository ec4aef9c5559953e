"""Attention output error of the float8 K/V ring payload against float64 attention, on real gloo ranks.

    .venv/bin/python scripts/benchmarks/fp8_error_table.py            # P in {2, 4, 8}, N/P in {1k, 8k}: ~1-3 min on 2 cores
    .venv/bin/python scripts/benchmarks/fp8_error_table.py --cp 2 --s-local 1024 --json

For each P the script forks P gloo ranks (tests/_dist.py's run_ranks). Every rank builds the same global
q, k, v ~ N(0, 1) [B=1, H, N, D] from one seed, keeps its striped shard, and runs causal ring attention
in the input dtype with comm_dtype None (the plain ring), float8_e4m3fn and float8_e5m2. The reference
is float64 causal attention computed by the textbook formula for a sample of each rank's query rows
(every rank's rows against all N keys would be P times the ring's own work). Errors, over the sampled
rows of all ranks: max|out - ref| / max|ref| and rms(out - ref) / rms(ref).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from cp_dtensor import ring_attention  # noqa: E402
from cp_dtensor.core.plan.layout import local_positions, shard_tensor  # noqa: E402
from _dist import run_ranks  # noqa: E402

PAYLOADS = {"none": None, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # q: [H, R, D] rows at global positions pos: [R]; k, v: [H, N, D] -> [H, R, D] float64, causal by position
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.arange(k.shape[1]) > pos[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def _rank(rank: int, world: int, s_local: int, heads: int, d: int, dtype_name: str, rows: int):
    n, dtype = world * s_local, DTYPES[dtype_name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, d, generator=g).to(dtype) for _ in range(3))  # rounded inputs are the truth
    sh = lambda x: shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world)  # noqa: E731
    ql, kl, vl = sh(q), sh(k), sh(v)
    pos = local_positions(layout="striped", rank=rank, cp_size=world, seq_len=n)  # [S_local] global position of each local row
    pick = torch.linspace(0, s_local - 1, min(rows, s_local)).round().long()
    ref = _reference_rows(ql[0][:, pick], k[0], v[0], pos[pick])  # [H, R, D]
    result = {}
    for name, comm_dtype in PAYLOADS.items():
        out = ring_attention(ql, kl, vl, layout="striped", is_causal=True, comm_dtype=comm_dtype)
        err = out[0][:, pick].double() - ref
        result[name] = (err.abs().max().item(), ref.abs().max().item(), err.square().sum().item(),
                        ref.square().sum().item())
    return result


def measure(world: int, s_local: int, *, heads: int, d: int, dtype: str, rows: int) -> dict[str, dict[str, float]]:
    per_rank = run_ranks(world, _rank, s_local, heads, d, dtype, rows, timeout=900)
    out = {}
    for name in PAYLOADS:
        amax_err = max(r[name][0] for r in per_rank)
        amax_ref = max(r[name][1] for r in per_rank)
        rms = math.sqrt(sum(r[name][2] for r in per_rank) / sum(r[name][3] for r in per_rank))
        out[name] = {"max_rel": amax_err / amax_ref, "rms_rel": rms}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8], help="ring sizes P")
    p.add_argument("--s-local", type=int, nargs="+", default=[1024, 8192], help="tokens per rank N/P")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype of q, k, v")
    p.add_argument("--rows", type=int, default=256, help="query rows per rank checked against float64")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    table = []
    for s_local in args.s_local:
        for world in args.cp:
            errs = measure(world, s_local, heads=args.heads, d=args.head_dim, dtype=args.dtype, rows=args.rows)
            table.append({"P": world, "N/P": s_local, **{k: v for k, v in errs.items()}})
            if not args.json:
                row = "  ".join(f"{errs[k]['max_rel']:.2e} / {errs[k]['rms_rel']:.2e}" for k in PAYLOADS)
                print(f"N/P={s_local:5d}  P={world}  {row}", flush=True)
    if args.json:
        print(json.dumps(table, indent=1))
    else:
        print(f"columns: comm_dtype {', '.join(PAYLOADS)}; each max|err|/max|ref| / rms(err)/rms(ref); "
              f"inputs {args.dtype}, causal striped, H={args.heads}, D={args.head_dim}, vs float64")


if __name__ == "__main__":
    main()
