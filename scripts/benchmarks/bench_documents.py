"""Document layout vs striped on packed log-normal documents: K/V rows the masks need, balance of kept
causal pairs, and the planner's host cost. Torch-free (the planner is pure integer math).

    python scripts/bench_documents.py                 # small defaults, a few seconds
    python scripts/bench_documents.py --doc-lengths lengths.txt --world 4   # one row from a file (one int a line)
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from cp_dtensor.core.documents import needed_rows, plan_row, row_balance  # noqa: E402


def lognormal(seed: int, n: int, median: float, sigma: float = 1.2, cap: int | None = None) -> list[int]:
    rng, out, total = random.Random(seed), [], 0
    while total < n:
        length = min(n - total, cap or n, max(1, int(rng.lognormvariate(math.log(median), sigma))))
        out.append(length)
        total += length
    return out


def report(lengths: list[int], world: int) -> str:
    s = sum(lengths) // world
    ring = world * (world - 1) * s
    docs = plan_row(lengths, world)
    striped = [list(range(r, world * s, world)) for r in range(world)]
    return (f"docs {len(lengths):4d}  rows needed / striped ring: documents {sum(needed_rows(docs, lengths)) / ring:.3f}"
            f"  striped {sum(needed_rows(striped, lengths)) / ring:.3f}  balance: documents "
            f"{row_balance(docs, lengths):.3f}  striped {row_balance(striped, lengths):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-lengths", type=pathlib.Path, help="a file of document lengths, one a line (one row)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    if args.doc_lengths:
        lengths = [int(x) for x in args.doc_lengths.read_text().split()]
        print(report(lengths, args.world))
        return
    print("rows: P = 4, S_local = 2048, no document longer than S_local; balance: P = 4 and 8, N/P = 8192")
    for median in (64, 256, 1000):
        for seed in range(args.seeds):
            print(f"median {median:5d} seed {seed}  " + report(lognormal(seed, 4 * 2048, median, cap=2048), 4))
    for world in (4, 8):
        for wins in (None, [None, 4096]):
            worst = max(row_balance(plan_row(ls, world, windows=wins), ls, windows=wins)
                        for ls in (lognormal(seed, world * 8192, 1000) for seed in range(args.seeds)))
            print(f"balance P = {world} windows {wins}: worst of {args.seeds} seeds {worst:.3f}")
    for world in (8, 32):
        n = world * 8192
        lengths = [n // 64] * 64
        t = time.perf_counter()
        plan_row(lengths, world)
        print(f"plan host cost P = {world}, 64 documents, N = {n}: {1e3 * (time.perf_counter() - t):.1f} ms")


if __name__ == "__main__":
    main()
