"""``[cp_dtensor] sequence_tiling`` under torchtitan 0.2.2 (issue #43): a step's peak memory per token, tiled vs
untiled, and the loss of both -- torchtitan's llama3 (dim 256, 2 layers, vocab 32768, fp32) at CP = 1 on CPU,
one forward + backward of torchtitan's loss (the sum over tokens).

Peak: VmHWM after ``echo 5 > /proc/self/clear_refs`` minus the resident set then (_bench_mem.py; the weights
and their gradient buffers are allocated before the line). Per-token growth = (peak(S_hi) - peak(S_lo)) /
(S_hi - S_lo). Each (mode, S) runs in a fresh process.

    python scripts/benchmarks/bench_titan_tiling.py                 # S 1024 vs 4096, tile 1024
    python scripts/benchmarks/bench_titan_tiling.py --lo 512 --hi 2048 --tile 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # this checkout's cp_dtensor

MiB = 2 ** 20


def one(mode: str, s: int, tile: int, vocab: int) -> dict:
    import copy

    import torch
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer, llama3_args

    import cp_dtensor.titan  # noqa: F401  before torchtitan: Note [torchtitan on CPU]
    from cp_dtensor.titan.shared.tiling import apply_sequence_tiling, tiled_loss
    from _bench_mem import _libc_live_memory, peak_since, reset_peak

    torch.set_num_threads(1)
    _libc_live_memory()
    args = copy.deepcopy(llama3_args["debugmodel"])
    args.n_layers, args.vocab_size, args.max_seq_len = 2, vocab, max(s, 2048)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    loss_fn = cross_entropy_loss
    if mode == "tiled":
        apply_sequence_tiling(model, tile)
        loss_fn = tiled_loss(cross_entropy_loss, tile)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, vocab, (1, s), generator=g), torch.randint(0, vocab, (1, s), generator=g)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    base = reset_peak()
    loss = loss_fn(model(x), y)
    loss.backward()
    return {"mode": mode, "s": s, "loss": loss.item(), "peak_mib": peak_since(base) / MiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lo", type=int, default=1024)
    ap.add_argument("--hi", type=int, default=4096)
    ap.add_argument("--tile", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--one", nargs=2, metavar=("MODE", "S"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), a.tile, a.vocab)))
        return
    rows = {}
    for mode in ("untiled", "tiled"):
        for s in (a.lo, a.hi):
            out = subprocess.run([sys.executable, __file__, "--one", mode, str(s), "--tile", str(a.tile), "--vocab",
                                  str(a.vocab)], capture_output=True, text=True, check=True).stdout
            rows[mode, s] = json.loads(out.strip().splitlines()[-1])
    growth = {m: (rows[m, a.hi]["peak_mib"] - rows[m, a.lo]["peak_mib"]) * 1024 / (a.hi - a.lo) for m in ("untiled", "tiled")}
    for (m, s), r in rows.items():
        print(f"{m:8s} S={s:6d}  peak {r['peak_mib']:8.1f} MiB  loss {r['loss']:.6f}")
    print(f"per-token growth: untiled {growth['untiled']:.1f} KiB, tiled {growth['tiled']:.1f} KiB, "
          f"ratio {growth['tiled'] / growth['untiled']:.3f}")
    for s in (a.lo, a.hi):
        u, t = rows["untiled", s]["loss"], rows["tiled", s]["loss"]
        print(f"S={s}: loss rel. difference {abs(t - u) / abs(u):.1e}")


if __name__ == "__main__":
    main()
