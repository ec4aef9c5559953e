"""Loss curves of the llama3 debug model at CP = 2 with the float8 K/V ring payload vs full precision.

    .venv/bin/python scripts/benchmarks/fp8_loss_curve.py            # ~6-10 min on 2 CPU cores
    .venv/bin/python scripts/benchmarks/fp8_loss_curve.py --steps 20 --out /tmp/curve.png

Makes one fp32 seed checkpoint (1 rank), then trains titan_configs/llama3_debug.toml from it twice on
2 CPU ranks (torchrun, cp_dtensor.titan.train): once as written (K/V travel in fp32) and once with
``--cp_dtensor.comm_dtype float8_e4m3fn``. Same seed checkpoint, same data order, so the curves differ
only by the payload. Plots both losses and their difference to docs/img/fp8_payload_loss.png and prints
a summary; the logs and the per-step losses (JSON) go to --work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from _titan_run import REPO, run_torchrun, step_losses  # noqa: E402  the tests' torchrun launcher and loss parser

RUNS = {"fp32 payload": [], "float8_e4m3fn payload": ["--cp_dtensor.comm_dtype", "float8_e4m3fn"]}


def _torchrun(nproc: int, dump: Path, *overrides: str) -> str:
    """One job (rank 0's log only), its output also written next to ``dump``."""
    code, out = run_torchrun(nproc, dump, *overrides, timeout=None, launcher_args=["--local-ranks-filter", "0"])
    (dump.parent / f"{dump.name}.log").write_text(out)
    if code != 0:
        raise SystemExit(f"exit {code}: {nproc} ranks, {' '.join(overrides)}\n...\n{out[-4000:]}")
    return out


def _plot(curves: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (ref_name, ref), (fp8_name, fp8) = curves.items()
    steps = range(1, len(ref) + 1)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    top.plot(steps, ref, label=ref_name, lw=2)
    top.plot(steps, fp8, label=fp8_name, lw=1.2, ls="--")
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=10)
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot(steps, [a - b for a, b in zip(fp8, ref)], color="C3", marker=".", lw=1)
    bottom.axhline(0, color="k", lw=0.5)
    bottom.set_ylabel("float8 - fp32 loss")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "img" / "fp8_payload_loss.png")
    p.add_argument("--work", type=Path, default=REPO / "outputs" / "fp8_loss_curve")
    p.add_argument("--replot", action="store_true", help="plot --work/losses.json again without training")
    args = p.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.replot:
        _report(json.loads((work / "losses.json").read_text()), args.out)
        return

    seed = work / "seed" / "checkpoint" / "step-0"
    if not (seed / ".metadata").is_file():
        print("seed checkpoint (1 rank) ...", flush=True)
        _torchrun(1, work / "seed", "--parallelism.context_parallel_degree", "1", "--checkpoint.enable",
                  "--checkpoint.create_seed_checkpoint")
    from_seed = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed), "--checkpoint.load_only",
                 "--training.steps", str(args.steps), "--parallelism.context_parallel_degree", "2"]
    curves = {}
    for name, extra in RUNS.items():
        print(f"CP=2, {name}, {args.steps} steps ...", flush=True)
        out = _torchrun(2, work / name.split()[0], *from_seed, *extra)
        curves[name] = step_losses(out, last=args.steps)
    (work / "losses.json").write_text(json.dumps(curves, indent=1))
    _report(curves, args.out)


def _report(curves: dict[str, list[float]], out: Path) -> None:
    ref, fp8 = curves.values()
    diff = [abs(a - b) for a, b in zip(fp8, ref)]
    rel = [d / r for d, r in zip(diff, ref)]
    title = f"llama3 debugmodel, CP=2 striped, seq 256, fp32 model\nK/V ring payload fp32 vs float8_e4m3fn, one seed checkpoint, {len(ref)} steps"
    _plot(curves, out, title)
    print(f"final loss: fp32 payload {ref[-1]:.5f}, float8_e4m3fn payload {fp8[-1]:.5f}")
    worst = diff.index(max(diff))
    print(f"|loss difference|: max {diff[worst]:.2e} at step {worst + 1} (rel {rel[worst]:.2e}; max rel {max(rel):.2e}), "
          f"mean {sum(diff) / len(diff):.2e}; last 10 steps mean {sum(diff[-10:]) / len(diff[-10:]):.2e}")
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
