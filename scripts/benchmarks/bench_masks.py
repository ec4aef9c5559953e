"""Masked ring benchmarks: documents and windows against the unmasked ring, in one time window.

    .venv/bin/python scripts/benchmarks/bench_masks.py [--s-local 4096] [--iters 3] [--balance-n 65536]

(a) packed documents of 512 and 2048 tokens vs none (striped): ring time ratio next to the kept-pair
    ratio; (b) a (256, 0) sliding window vs full causal, contiguous and striped: time and bytes;
    (c) per-rank kept-pair work max/mean with log-normal document lengths around 2k tokens, P = 2, 4, 8;
    (d) a probe: the documents rings again with every K/V transfer replaced by a local copy.
Masked ring efficiency = (one process running the same masked attention on the full sequence with the
same kernels, / P) / ring time, as P4 is for the unmasked ring. Each iteration times every case back to
back (ring on both ranks, then the single-process run on rank 0 alone) and the ratios are medians of
per-iteration ratios, as in bench_ring.py's --paired-s-local. Writes bench_out/masks.json and the balance plot
(mask_balance.png; --docs-img copies it to docs/img/) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import cp_dtensor  # noqa: E402
from cp_dtensor.core.exchange.comm import RingComm  # noqa: E402
from cp_dtensor.core.plan.layout import shard_tensor  # noqa: E402
from cp_dtensor.core.plan.masks import block_rects, kept_pairs, mask_bounds, runs, segments  # noqa: E402
from cp_dtensor.tools.debug import CommBytes  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402

CASES = [  # name, layout, documents (mean length, None: none), window
    ("causal striped", "striped", None, None),
    ("docs 2048 striped", "striped", 2048, None),
    ("docs 512 striped", "striped", 512, None),
    ("causal contiguous", "contiguous", None, None),
    ("window 256 contiguous", "contiguous", None, (256, 0)),
    ("window 256 striped", "striped", None, (256, 0)),
    # probes: the same rings with every K/V transfer replaced by a local copy (timing only; results are
    # not the attention): what the ring costs on this machine without moving a byte
    ("docs 2048 striped, no transfers", "striped", 2048, None),
    ("docs 512 striped, no transfers", "striped", 512, None),
]
PROBE = ", no transfers"


@contextlib.contextmanager
def _no_transfers(on: bool):
    """Replace the ring's rotations by local copies (a timing probe; see CASES)."""
    if not on:
        yield
        return
    rotate, wait = RingComm.rotate, RingComm.wait
    RingComm.rotate = lambda self, buf, shift=1: buf.clone()
    RingComm.wait = lambda self, buf: buf
    try:
        yield
    finally:
        RingComm.rotate, RingComm.wait = rotate, wait


def doc_ids(n: int, length: int | None, *, lognormal: bool = False, seed: int = 0) -> torch.Tensor | None:
    """[1, n] non-decreasing ids: documents of ``length`` tokens (log-normal around it if asked)."""
    if length is None:
        return None
    rng = random.Random(seed)
    ids, pos, d = torch.empty(1, n, dtype=torch.int64), 0, 0
    while pos < n:
        size = max(1, int(rng.lognormvariate(math.log(length), 0.75))) if lognormal else length
        ids[0, pos : pos + size] = d
        pos, d = pos + size, d + 1
    return ids


def kept(layout: str, world: int, n: int, ids: torch.Tensor | None, window, *, area: bool = False) -> list[int]:
    """Per-rank kept pairs (or computed rectangle area) of a causal ring over every step."""
    lo, hi = mask_bounds(True, window)
    s = n // world
    shards = [None if ids is None else shard_tensor(ids, seq_dim=1, layout=layout, rank=r, cp_size=world)[0].tolist()
              for r in range(world)]
    work = []
    for r in range(world):
        total = 0
        for src in range(world):
            segs = (None, None) if ids is None else (segments(shards[r]), segments(shards[src]))
            rects = block_rects(runs(layout, r, world, s), runs(layout, src, world, s), lo, hi, *segs)
            total += sum((x.q1 - x.q0) * (x.k1 - x.k0) for x in rects) if area else kept_pairs(rects)
        work.append(total)
    return work


def balance(n: int, seeds: int = 3) -> list[dict]:
    rows = []
    for world in (2, 4, 8):
        for layout in cp_dtensor.LAYOUTS:
            ratios = []
            for seed in range(seeds):
                w = kept(layout, world, n, doc_ids(n, 2048, lognormal=True, seed=seed), None)
                ratios.append(max(w) / statistics.mean(w))
            rows.append(dict(world=world, layout=layout, max_over_mean=statistics.mean(ratios), worst=max(ratios)))
    return rows


def _rank(rank, world, s_local, iters, shape):
    b, hq, hkv, d = shape
    n = s_local * world
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv)]
    solo = dist.new_group([0])  # the single-process run, on rank 0 alone
    times: dict[str, list[tuple[float, float]]] = {c[0]: [] for c in CASES}
    sent: dict[str, tuple[int, int]] = {}

    def fwd_bwd(q, k, v, layout, ids, window, group):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = cp_dtensor.ring_attention(q, k, v, mesh=group, layout=layout, is_causal=True, document_ids=ids,
                                        window_size=window)
        out.backward(torch.ones_like(out))

    for it in range(iters + 1):  # the first iteration warms up
        for name, layout, length, window in CASES:
            ids = doc_ids(n, length)
            local = [shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world) for x in full]
            lids = None if ids is None else shard_tensor(ids, seq_dim=1, layout=layout, rank=rank, cp_size=world)
            dist.barrier()
            t0 = time.perf_counter()
            with CommBytes() as cb, _no_transfers(name.endswith(PROBE)):
                fwd_bwd(*local, layout, lids, window, None)
            ring = time.perf_counter() - t0
            sent[name] = (cb.by_op["all_to_all_single"], cb.by_op["all_gather_into_tensor"])
            dist.barrier()
            ideal = float("nan")
            if rank == 0:
                t0 = time.perf_counter()
                fwd_bwd(*full, "contiguous", ids, window, solo)
                ideal = (time.perf_counter() - t0) / world
            dist.barrier()
            if it:
                times[name].append((ring, ideal))
    return times, sent


def timing(s_local: int, iters: int, shape, world: int = 2) -> dict:
    per_rank = run_ranks(world, _rank, s_local, iters, shape)
    n = s_local * world
    res = {}
    base = {}
    for name, layout, length, window in CASES:
        ring = [max(r[0][name][i][0] for r in per_rank) for i in range(iters)]  # the slowest rank
        ideal = [per_rank[0][0][name][i][1] for i in range(iters)]
        pairs = sum(kept(layout, world, n, doc_ids(n, length), window))
        rec = dict(ring_ms=1e3 * statistics.median(ring), ideal_ms=1e3 * statistics.median(ideal),
                   efficiency=statistics.median(i / r for i, r in zip(ideal, ring)),
                   efficiency_best=min(ideal) / min(ring), kept_pairs=pairs,
                   kv_bytes=per_rank[0][1][name][0], id_bytes=per_rank[0][1][name][1], ring=ring)
        if window is None and length is None:
            base[layout] = rec
        res[name] = rec
    block = 2 * shape[0] * s_local * shape[3] * shape[2] * 4
    for name, layout, _length, window in CASES:
        rec, ref = res[name], base[layout if window is None else layout]
        it_ratio = statistics.median(a / b for a, b in zip(rec["ring"], ref["ring"]))
        rec.update(time_vs_causal=it_ratio, pairs_vs_causal=rec["kept_pairs"] / ref["kept_pairs"],
                   blocks_sent=rec["kv_bytes"] / block)
        if window is not None:  # target: <= 2.5x its kept-pair share of the causal ring's time
            rec["time_over_pair_share"] = it_ratio / rec["pairs_vs_causal"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--s-local", type=int, default=4096)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--balance-n", type=int, default=65536)
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--docs-img", action="store_true", help="copy the balance plot to docs/img/")
    args = p.parse_args()
    torch.set_num_threads(1)
    shape = (1, 4, 2, 64)  # B, Hq, Hkv, D; fp32, causal forward + backward
    res = {"balance": balance(args.balance_n)}
    print("| P | layout | kept-pair work max/mean (mean of 3 seeds) | worst seed |\n|---|---|---|---|")
    for r in res["balance"]:
        print(f"| {r['world']} | {r['layout']} | {r['max_over_mean']:.3f} | {r['worst']:.3f} |")
    if not args.skip_timing:
        res["timing"] = timing(args.s_local, args.iters, shape)
        print("\n| case (P=2, N/P=%d) | ring ms | time / causal | kept pairs / causal | efficiency [best] | "
              "K/V blocks sent | id bytes |\n|---|---|---|---|---|---|---|" % args.s_local)
        for name, r in res["timing"].items():
            extra = f" (÷ pair share {r['time_over_pair_share']:.2f})" if "time_over_pair_share" in r else ""
            print(f"| {name} | {r['ring_ms']:.0f} | {r['time_vs_causal']:.3f}{extra} | {r['pairs_vs_causal']:.3f} | "
                  f"{r['efficiency']:.2f} [{r['efficiency_best']:.2f}] | {r['blocks_sent']:.2f} | {r['id_bytes']} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "masks.json"), "w") as f:
        json.dump(res, f, indent=1)
    import _bench_plot as plot

    path = plot.mask_balance(res["balance"], args.balance_n, os.path.join(args.out, "mask_balance.png"))
    if args.docs_img:
        os.makedirs("docs/img", exist_ok=True)
        shutil.copy(path, os.path.join("docs/img", os.path.basename(path)))


if __name__ == "__main__":
    main()
