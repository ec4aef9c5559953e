"""What cp_dtensor costs plain-tensor SDPA: math-backend forward + backward per call, A/B in one process.

A: before ``import cp_dtensor`` and, after it, with the SDPA dispatch uninstalled; B: with
``cp_dtensor.install_sdpa_dispatch()`` (whose kernel on the math op's Autograd keys every plain math
SDPA call passes through). Rounds alternate A and B; the ratio is B / A of the medians.

    python scripts/benchmarks/bench_import_cost.py --shapes 1x4x64x32 2x8x256x64 --rounds 10 --calls 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _per_call(q, k, v, do, calls: int) -> float:
    """Seconds per math-SDPA forward + backward on plain tensors."""
    with sdpa_kernel([SDPBackend.MATH]):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(do)
        return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x4x64x32", "2x8x256x64"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    inputs = {}
    for shape in args.shapes:
        b, h, s, d = map(int, shape.split("x"))
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
        inputs[shape] = (q, k, v, torch.randn(b, h, s, d))
    for x in inputs.values():  # warm-up: the first calls build autograd's and the allocator's state
        _per_call(*x, args.calls)
    before = {shape: _per_call(*x, args.calls) for shape, x in inputs.items()}  # not imported yet

    import cp_dtensor

    times: dict[str, dict[str, list[float]]] = {s: {"A": [], "B": []} for s in inputs}
    for _ in range(args.rounds):
        for arm in ("A", "B"):
            (cp_dtensor.install_sdpa_dispatch if arm == "B" else cp_dtensor.uninstall_sdpa_dispatch)()
            for shape, x in inputs.items():
                times[shape][arm].append(_per_call(*x, args.calls))
    cp_dtensor.uninstall_sdpa_dispatch()
    for shape in inputs:
        a, b = (statistics.median(times[shape][arm]) for arm in ("A", "B"))
        ratios = sorted(y / x for x, y in zip(times[shape]["A"], times[shape]["B"]))
        print(f"{shape}: before import {1e6 * before[shape]:8.1f} us; A (imported, not installed) "
              f"{1e6 * a:8.1f} us; B (installed) {1e6 * b:8.1f} us per call; B / A = {b / a:.3f} "
              f"(per round: {ratios[0]:.3f}..{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
