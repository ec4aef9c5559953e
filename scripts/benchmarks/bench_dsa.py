"""Bytes per layer of DeepSeek Sparse Attention under CP (cp_dtensor/hf/sparse.py) against the ring's K/V bytes
and against the selected latent rows a rank does not hold, counted from the exchange plan (no model runs).

DeepSeek-V3.2's attention sizes (bf16): a latent row is kv_lora_rank 512 + rope 64 = 1152 bytes, an index
key 128 numbers = 256 bytes, the ring's expanded K/V 128 heads x (192 + 128) = 81920 bytes a token. Each
rank's queries select ``index_topk`` keys of their causal prefix at random -- every prefix key equally
likely, the worst case for how many distinct rows a rank needs (a trained indexer's picks cluster,
so fewer rows move, and the index keys' share grows). For each rank (simulated in one process, every rank's
plan being a function of the selection only): the bytes it receives in one forward --

* ``index keys``: the all-gather of every other rank's index keys ((P - 1) S_local x 256);
* ``requests``: the row numbers other ranks ask of it (8 bytes a row) and the counts (8 P);
* ``rows``: the selected latent rows it does not hold (what it must receive in any exact scheme);
* ``ring``: the ring's K/V through it ((P - 1) S_local x 81920); ``latent ring``: every other rank's latent rows.

Backward sends the received rows' gradients back (the rows' bytes again); the ring's backward passes K/V and
dK/dV (twice its forward). The rank that receives the most is reported.

    python scripts/benchmarks/bench_dsa.py --n 8192 16384 32768 --world 4 [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cp_dtensor.core.plan.layout import global_order  # noqa: E402
from cp_dtensor.hf.sparse import exchange_plan  # noqa: E402

LATENT, INDEX_KEY, RING_KV, ROW_ID = (512 + 64) * 2, 128 * 2, 128 * (192 + 128) * 2, 8


def rows_needed(n: int, world: int, rank: int, topk: int, layout: str, chunk: int, device: str, seed: int) -> int:
    """How many selected latent rows rank ``rank`` does not hold, each query picking at random in its prefix."""
    g = torch.Generator(device=device).manual_seed(seed + rank)
    order = global_order(layout, world, n).to(device)
    s = n // world
    mine = order[rank * s:(rank + 1) * s]
    need = []
    for lo in range(0, s, chunk):
        q = mine[lo:lo + chunk]
        # a query's picks: its whole prefix when it has at most index_topk keys, else index_topk draws uniform over
        # the prefix (with replacement: within a few rows of topk's subsets, at O(N k) instead of O(N^2) work)
        drawn = (torch.rand(q.numel(), topk, generator=g, device=device) * (q[:, None] + 1)).long()
        short = q[:, None] < topk
        picks = torch.where(short, torch.arange(topk, device=device)[None, :], drawn)
        valid = picks <= q[:, None]
        rows, _ = exchange_plan(picks[None], valid[None], order, rank, world)
        need.append(rows)
    return int(torch.cat(need).unique().numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--world", type=int, nargs="+", default=[4])
    parser.add_argument("--layout", default="headtail")
    parser.add_argument("--chunk", type=int, default=2048, help="queries scored at a time")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| N | P | index_topk | rows not held (max rank) | rows MB | index keys MB | requests MB | ours MB | "
          "ours / rows | ours / ring | ring MB | latent ring MB | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for world in args.world:
        for n in args.n:
            t0 = time.perf_counter()
            s, topk = n // world, n // 16
            need = [rows_needed(n, world, r, topk, args.layout, args.chunk, args.device, args.seed) for r in range(world)]
            worst = max(range(world), key=lambda r: need[r])
            # what the worst rank receives: the rows, the others' requests of it (a rank answers every other's:
            # in total the others need sum(need) - need[worst] rows, spread over the ranks: their mean), index keys
            rows = need[worst] * LATENT
            requests = (sum(need) - need[worst]) / (world - 1) * ROW_ID + 8 * world
            index = (world - 1) * s * INDEX_KEY
            ours = rows + requests + index
            ring, latent_ring = (world - 1) * s * RING_KV, (world - 1) * s * LATENT
            mb = 1 / 2**20
            print(f"| {n} | {world} | {topk} | {need[worst]} of {(world - 1) * s} | {rows * mb:.2f} | {index * mb:.2f} | "
                  f"{requests * mb:.3f} | {ours * mb:.2f} | {ours / rows:.3f} | {ours / ring:.4f} | {ring * mb:.1f} | "
                  f"{latent_ring * mb:.2f} | {time.perf_counter() - t0:.1f} |", flush=True)


if __name__ == "__main__":
    main()
