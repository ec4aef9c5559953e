"""Dynamic CP against the static grid, side by side in one run: the global batch of a dp x cp grid placed
either row by row (each data-parallel rank's packed row on its own cp ranks, ``document_layout`` of that
row: the static grid) or as one row over all dp x cp ranks (``document_layout`` of the whole batch: dynamic).

For each grid of the issue's table (dp 4 / 8 x cp 2 with rows of 16384 tokens per dp rank, x cp 4 with rows
of 32768; ``--row`` sets one size for all) and length set (log-normal documents, and an adversarial batch:
one long document filling one dp row, short ones elsewhere):

  * per-rank work max/mean: attention's kept causal pairs + ``--linear`` pair-equivalents per token (the
    linear layers), the planner's figures (``rank_work``);
  * tokens per rank (equal in both: memory);
  * K/V rows each rank receives per layer (``needed_rows``: the document exchange sends exactly those) and
    the busiest rank's bytes per layer for a model of ``--kv-heads`` x ``--head-dim`` in bf16;
  * the plan's host cost (``document_layout`` of the global batch);
  * the plan's host cost of a global batch of 262144 tokens at P = 32, 64, 128 (``document_layout`` + one
    rank's ``exchange_plan``, process CPU time; the torch-free planner ``plan_intervals`` alone beside it);
  * at dp 2 x cp 2 on a skewed batch: each rank's attention (per run of its queries, against the keys its
    mask keeps) + a linear layer over its tokens, timed in this process one rank after another with
    ``time.thread_time`` (honest when ranks share cores), max/mean per placement.

    python scripts/benchmarks/bench_dynamic.py             # about a minute on 2 shared cores
    python scripts/benchmarks/bench_dynamic.py --seeds 3 --row 16384

Writes bench_out/dynamic.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch

import cp_dtensor
from cp_dtensor.core.plan.documents import needed_rows, rank_work
from cp_dtensor.tools.plan_documents import lognormal_lengths

GRIDS = ((4, 2, 16384), (8, 2, 16384), (4, 4, 32768), (8, 4, 32768))  # dp, cp, tokens per dp rank's row


def adversarial(seed: int, dp: int, row: int) -> list[list[int]]:
    """One dp row is one long document; the others hold short log-normal ones."""
    rows = [[row]] + [lognormal_lengths(seed * 31 + i, row, 200, cap=row) for i in range(1, dp)]
    random.Random(seed).shuffle(rows)
    return rows


def positions(lengths: list[int], world: int) -> list[list[int]]:
    """Each rank's global positions of one row (``document_layout``'s order, rank-major)."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    order = cp_dtensor.document_layout(ids, world).order[0]
    s = order.numel() // world
    return [order[r * s : (r + 1) * s].tolist() for r in range(world)]


def figures(rows: list[list[int]], cp: int, linear: int) -> dict:
    """The static grid's and dynamic's per-rank work, tokens and received rows of one global batch."""
    dp = len(rows)
    static_work, static_rows, static_tokens = [], [], []
    for lengths in rows:
        pos = positions(lengths, cp)
        static_work += [w + linear * len(p) for w, p in zip(rank_work(pos, lengths), pos)]
        static_rows += needed_rows(pos, lengths)
        static_tokens += [len(p) for p in pos]
    flat = [x for lengths in rows for x in lengths]
    t0 = time.process_time()
    pos = positions(flat, dp * cp)
    plan_ms = 1e3 * (time.process_time() - t0)
    dyn_work = [w + linear * len(p) for w, p in zip(rank_work(pos, flat), pos)]
    return {"static": dict(work=static_work, rows=static_rows, tokens=static_tokens),
            "dynamic": dict(work=dyn_work, rows=needed_rows(pos, flat), tokens=[len(p) for p in pos]),
            "plan_ms": plan_ms}


def balance(work: list[int]) -> float:
    return max(work) * len(work) / sum(work)


def runs_of(pos: list[int], starts: list[int]) -> list[tuple[int, int, int]]:
    """(document start, first offset, end offset) of each run of consecutive positions in one document."""
    import bisect

    out: list[list[int]] = []
    for p in pos:
        d = starts[bisect.bisect_right(starts, p) - 1]
        if out and out[-1][0] == d and out[-1][2] == p - d:
            out[-1][2] += 1
        else:
            out.append([d, p - d, p - d + 1])
    return [tuple(x) for x in out]


def compute_times(rows: list[list[int]], cp: int, heads: int, head_dim: int, hidden: int) -> dict:
    """Each rank's thread CPU time: its queries' causal attention within their documents (run by run, the
    keys up to the run's end, bottom-right causal mask) + one linear layer over its tokens."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(hidden, 4 * hidden, generator=g) / hidden**0.5

    n = sum(sum(lengths) for lengths in rows)
    q, k, v = (torch.randn(1, heads, n, head_dim, generator=g) for _ in range(3))  # [1, H, N, D], made once
    x = torch.randn(n, hidden, generator=g)

    def rank_time(pos: list[int], starts: list[int], base: int) -> float:
        t0 = time.thread_time()
        for d, a, b in runs_of(pos, starts):
            d += base
            mask = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]  # bottom-right causal
            torch.nn.functional.scaled_dot_product_attention(q[:, :, d + a : d + b], k[:, :, d : d + b],
                                                             v[:, :, d : d + b], attn_mask=mask)
        x[: len(pos)] @ weight
        return time.thread_time() - t0

    def starts_of(lengths: list[int]) -> list[int]:
        out = [0]
        for x in lengths[:-1]:
            out.append(out[-1] + x)
        return out

    dp = len(rows)
    static, base = [], 0
    for lengths in rows:  # row i's documents sit at base in the global tensors, as in the flat batch
        static += [rank_time(p, starts_of(lengths), base) for p in positions(lengths, cp)]
        base += sum(lengths)
    flat = [y for lengths in rows for y in lengths]
    dynamic = [rank_time(p, starts_of(flat), 0) for p in positions(flat, dp * cp)]
    return {"static": static, "dynamic": dynamic}


def host_cost(worlds=(32, 64, 128), n: int = 262144, median: float = 500.0, reps: int = 5) -> list[dict]:
    """The plan's host cost of one global batch of N tokens over P ranks: ``document_layout`` + one rank's
    ``exchange_plan`` (causal), process CPU time, one thread, median of ``reps`` after a warm-up."""
    import statistics

    from cp_dtensor.core.exchange.doc_exchange import exchange_plan
    from cp_dtensor.core.plan.doc_plan import plan_intervals

    torch.set_num_threads(1)
    lengths = lognormal_lengths(0, n, median, cap=131072)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    out = []
    for world in worlds:
        def one():
            t0 = time.process_time()
            lay = cp_dtensor.document_layout(ids, world)
            t1 = time.process_time()
            exchange_plan(lay, world // 2, True, None)
            t2 = time.process_time()
            plan_intervals(lengths, world)  # the planner alone (document_layout runs it)
            return t1 - t0, t2 - t1, time.process_time() - t2

        one()
        xs = [one() for _ in range(reps)]
        rec = dict(world=world, n=n, docs=len(lengths), layout_ms=1e3 * statistics.median(x[0] for x in xs),
                   exchange_plan_ms=1e3 * statistics.median(x[1] for x in xs),
                   total_ms=1e3 * statistics.median(x[0] + x[1] for x in xs),
                   planner_ms=1e3 * statistics.median(x[2] for x in xs))
        out.append(rec)
        print(f"plan host cost P = {world:3d}, N = {n}, {len(lengths)} log-normal documents: document_layout "
              f"{rec['layout_ms']:.1f} ms (its planner alone {rec['planner_ms']:.1f} ms) + exchange_plan (one rank) "
              f"{rec['exchange_plan_ms']:.1f} ms = {rec['total_ms']:.1f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", type=int, default=None,
                    help="tokens of one data-parallel rank's packed row (default: 16384 at cp 2, 32768 at cp 4)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--median", type=float, default=500.0, help="log-normal median document length (sigma 1.2)")
    ap.add_argument("--linear", type=int, default=64, help="linear layers' pair-equivalents per token")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--time-row", type=int, default=4096, help="row length of the timed dp 2 x cp 2 batch")
    ap.add_argument("--host-worlds", type=int, nargs="*", default=[32, 64, 128],
                    help="P of the plan's host cost (N = 262144); none to skip")
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "dynamic.json"))
    args = ap.parse_args()
    row_bytes = 2 * args.kv_heads * args.head_dim * 2  # K and V, bf16
    out = {"args": vars(args), "grids": [], "time": None}
    print(f"work = kept causal pairs + {args.linear} per token; bytes per layer: K/V rows received x {row_bytes} B")
    print(f"{'grid':>8} {'row':>6} {'set':>11} {'seed':>4} | {'static max/mean':>15} {'dynamic':>8} | tokens/rank | "
          f"{'rows recv max: static':>21} {'dynamic':>8} | {'MB/layer max: static':>20} {'dynamic':>8} | plan ms")
    for dp, cp, row in GRIDS:
        row = args.row or row
        for kind in ("lognormal", "adversarial"):
            for seed in range(args.seeds):
                rows = ([lognormal_lengths(seed * 97 + i, row, args.median, cap=row) for i in range(dp)]
                        if kind == "lognormal" else adversarial(seed, dp, row))
                f = figures(rows, cp, args.linear)
                st, dy = f["static"], f["dynamic"]
                assert len(set(st["tokens"] + dy["tokens"])) == 1, "tokens per rank differ"
                rec = dict(dp=dp, cp=cp, row=row, kind=kind, seed=seed, static_balance=balance(st["work"]),
                           dynamic_balance=balance(dy["work"]), tokens_per_rank=dy["tokens"][0],
                           static_rows_max=max(st["rows"]), dynamic_rows_max=max(dy["rows"]),
                           static_rows_mean=sum(st["rows"]) / len(st["rows"]),
                           dynamic_rows_mean=sum(dy["rows"]) / len(dy["rows"]), plan_ms=f["plan_ms"])
                out["grids"].append(rec)
                print(f"{dp:>3} x {cp:<2} {row:>6} {kind:>11} {seed:>4} | {rec['static_balance']:>15.3f} "
                      f"{rec['dynamic_balance']:>8.3f} | {rec['tokens_per_rank']:>11} | {rec['static_rows_max']:>21} "
                      f"{rec['dynamic_rows_max']:>8} | {rec['static_rows_max'] * row_bytes / 2**20:>20.2f} "
                      f"{rec['dynamic_rows_max'] * row_bytes / 2**20:>8.2f} | {rec['plan_ms']:.0f}", flush=True)
    # the skewed batch at 4 ranks, timed: one dp row is a single document
    rows = [[args.time_row], lognormal_lengths(5, args.time_row, 100, cap=args.time_row)]
    times = compute_times(rows, 2, heads=2, head_dim=32, hidden=256)
    out["time"] = {name: dict(seconds=ts, balance=balance(ts)) for name, ts in times.items()}
    print(f"\nskewed batch, dp 2 x cp 2, rows of {args.time_row}: per-rank compute (thread CPU time, attention by "
          "kept runs + a linear layer), max/mean")
    for name, ts in times.items():
        print(f"  {name:>8}: {' '.join(f'{t:.3f}' for t in ts)} s   max/mean {balance(ts):.3f}")
    print(f"  dynamic / static max: {max(times['dynamic']) / max(times['static']):.3f}\n")
    out["host"] = host_cost(tuple(args.host_worlds)) if args.host_worlds else []
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
