"""Host time of one masked ring call's planning (Python only: no kernel runs, no rank talks).

What one rank does on the host for a call with documents, forward + backward, besides the kernels: build
the call's mask (``blocks.Mask``), and at every step ask whether the block is kept and for the op's
arguments, then the op's own rectangles (``ops._batch_rects``, what ``masked_block_attn`` and its
backward cut each step into). The ranks are simulated in one process (rank 0 of P; every rank plans
alike), from a gathered table of ``--docs`` documents over N = P * S_local tokens; every timed call
gets new document boundaries (another batch), so nothing of an earlier call's plan is reused.

    python scripts/benchmarks/bench_mask_plan.py --worlds 8 32 --docs 64 --s-local 512
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cp_dtensor.core.compute.blocks import Mask  # noqa: E402
from cp_dtensor.core.compute.ops import _batch_rects  # noqa: E402
from cp_dtensor.core.plan.layout import shard_tensor  # noqa: E402


def _ids(world: int, s_local: int, docs: int, layout: str, seed: int = 0) -> torch.Tensor:
    """Every rank's ids [P, 1, S_local]: ``docs`` documents of random lengths, in ``layout``."""
    n = world * s_local
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: docs - 1] + 1).values
    ids = torch.zeros(n, dtype=torch.int64)
    ids[cuts] = 1
    ids = ids.cumsum(0).view(1, n)
    return torch.stack([shard_tensor(ids, seq_dim=1, layout=layout, rank=r, cp_size=world) for r in range(world)])


def plan_call(world: int, s_local: int, ids: torch.Tensor, layout: str, rank: int = 0) -> int:
    """One call's planning on ``rank``: forward and backward. Returns the rectangles planned."""
    q = torch.empty(1, 1, s_local, 1)
    mask = Mask(layout, world, s_local, True, None, ids)
    n = 0
    for _ in ("forward", "backward"):
        for step in range(mask.steps):
            src = (rank - step) % world
            if step == 0 or mask.keeps(rank, src):
                q_ids, k_ids, q_runs, k_runs, lo, hi = mask.args(rank, src)
                n += sum(len(r) for _, r in _batch_rects(q_ids, k_ids, q_runs, k_runs, lo, hi, q))
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--s-local", type=int, default=512)
    ap.add_argument("--layout", default="striped")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for world in args.worlds:
        batches = [_ids(world, args.s_local, args.docs, args.layout, seed) for seed in range(args.iters + 1)]
        rects = plan_call(world, args.s_local, batches[0], args.layout)  # warm-up
        times = []
        for ids in batches[1:]:
            t0 = time.perf_counter()
            plan_call(world, args.s_local, ids, args.layout)
            times.append(time.perf_counter() - t0)
        print(f"P={world:3d} docs={args.docs} S_local={args.s_local} {args.layout}: "
              f"{1e3 * min(times):8.2f} ms per call (min of {args.iters}; median "
              f"{1e3 * sorted(times)[len(times) // 2]:.2f}), {rects} rectangles fwd+bwd")


if __name__ == "__main__":
    main()
