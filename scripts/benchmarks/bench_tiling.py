"""Sequence tiling (issue #43): a rank's peak memory per token, tiled vs untiled, the longest S_local under a
fixed per-rank budget, and the time cost -- one transformers Llama (vocab 32768, hidden 128, 2 layers) under
``cp_dtensor.hf.apply_context_parallel`` at CP=2 on CPU (gloo), one forward + backward with labels.

Peak: VmHWM after ``echo 5 > /proc/self/clear_refs`` minus the resident set then (scripts/benchmarks/_bench_mem.py: every
block >= 64 KiB its own mapping, so the peak is live memory); the weights and their gradient buffers are below
the line (a warm-up step at 64 tokens allocates them). Per-token growth = (peak(S_hi) - peak(S_lo)) /
(S_hi - S_lo). The longest S_local under ``--budget-mib``: the line through the two probes predicts it (the growth
is not quite linear: the ring's buffers), then a search of real probes (doubling / bisection to S/16, multiples
of 256) from there, capped at ``--cap`` tokens (attention's time grows as S^2 on CPU): a tiled run that fits at
the cap is reported as ">= cap".

    python scripts/benchmarks/bench_tiling.py                    # S_local 1024 vs 3072, tile 1024, budget 1024 MiB
    python scripts/benchmarks/bench_tiling.py --quick            # S_local 256 vs 768 (the smoke test)

``--head``: the LM head alone, ``cp_dtensor.linear_cross_entropy`` against the plain head + ``F.cross_entropy``
(logits in the compute dtype), forward + backward, the modes interleaved in each of ``--reps`` rounds (median
seconds; ratios side by side), labels with ~10 % ignored tokens, several tile sizes; peak memory above the inputs
(CPU: VmHWM as above; CUDA: max_memory_allocated). ``--device cuda`` runs it on a GPU.

    python scripts/benchmarks/bench_tiling.py --head                                    # CPU, S 4096, H 256, V 32000
    python scripts/benchmarks/bench_tiling.py --head --device cuda --dtype bf16 --head-shape 32768,4096,128256 \
        --tiles 1024,2048,4096                                                          # the H200 shape of issue 49
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this checkout's cp_dtensor
from _bench_dist import run_ranks  # noqa: E402
from _bench_mem import _libc_live_memory, peak_since, reset_peak, search_max  # noqa: E402

MiB = 2 ** 20


def _model(vocab: int, hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1 << 20,
                      attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg).float().train()


def _probe(rank: int, world: int, s_local: int, tile, shape: dict) -> dict:
    """Peak bytes above the line and seconds of one fwd+bwd with labels on this rank's S_local tokens."""
    from torch.distributed.device_mesh import init_device_mesh

    import cp_dtensor
    from cp_dtensor import hf

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = hf.apply_context_parallel(_model(**shape), mesh, sequence_tiling=tile or False)
    vocab = shape["vocab"]

    def step(s: int) -> float:
        n = s * world
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (1, n), generator=g)
        labels = hf.shift_labels(tokens)
        tok, pos, lab = cp_dtensor.shard_batch((tokens, torch.arange(n)[None], labels), mesh)
        t0 = time.perf_counter()
        out = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=n - 1)
        out.loss.backward()
        return time.perf_counter() - t0

    _libc_live_memory()
    step(64)  # warm-up: gloo, lazy state, the gradient buffers (below the line)
    base = reset_peak()
    seconds = step(s_local)
    return {"peak": peak_since(base), "seconds": seconds}


def probe(world: int, s_local: int, tile, shape: dict) -> dict:
    out = run_ranks(world, _probe, s_local, tile, shape)
    return {"peak": max(r["peak"] for r in out), "seconds": max(r["seconds"] for r in out)}


def _head_step(mode, h, w, lab, tile):
    """One forward + backward of the head + loss; returns the loss (float)."""
    import torch.nn.functional as F

    from cp_dtensor import linear_cross_entropy

    h.grad = w.grad = None
    if mode == "plain":
        loss = F.cross_entropy(F.linear(h, w), lab)
    else:
        loss = linear_cross_entropy(h, w, lab, tile_size=tile)
    loss.backward()
    return loss.item()


def head_bench(a) -> dict:
    """The LM head alone: tiled / plain time and peak memory at several tile sizes, one interleaved run."""
    import statistics

    dev = torch.device(a.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    s, hid, vocab = (int(x) for x in a.head_shape.split(","))
    tiles = [int(t) for t in a.tiles.split(",")]
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(s, hid, generator=g) * 0.5).to(dev, dtype).requires_grad_()
    w = (torch.randn(vocab, hid, generator=g) * hid ** -0.5).to(dev, dtype).requires_grad_()
    lab = torch.randint(0, vocab, (s,), generator=g)
    lab[torch.rand(s, generator=g) < 0.1] = -100  # ignored tokens
    lab = lab.to(dev)
    modes = [("plain", None)] + [(f"tile {t}", t) for t in tiles]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for mode, t in modes:  # warm-up
        _head_step(mode, h, w, lab, t)
    times = {m: [] for m, _ in modes}
    losses = {}
    for _ in range(a.reps):
        for mode, t in modes:
            sync()
            t0 = time.perf_counter()
            losses[mode] = _head_step(mode, h, w, lab, t)
            sync()
            times[mode].append(time.perf_counter() - t0)
    peaks = {}
    for mode, t in modes:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _head_step(mode, h, w, lab, t)
            peaks[mode] = torch.cuda.max_memory_allocated() - base
        else:
            _libc_live_memory()
            base = reset_peak()
            _head_step(mode, h, w, lab, t)
            peaks[mode] = peak_since(base)
    plain, plain_min = statistics.median(times["plain"]), min(times["plain"])
    res = {"device": str(dev), "dtype": a.dtype, "shape": [s, hid, vocab], "threads": torch.get_num_threads(),
           "reps": a.reps, "modes": {}}
    print(f"head fwd+bwd, {dev} {a.dtype}, S {s}, H {hid}, V {vocab}, {torch.get_num_threads()} threads, "
          f"{a.reps} interleaved rounds (median; and the fastest round of each)")
    for mode, _ in modes:
        sec = statistics.median(times[mode])
        r = {"seconds": sec, "time_ratio": sec / plain, "min_time_ratio": min(times[mode]) / plain_min,
             "peak_mib": peaks[mode] / MiB,
             "peak_ratio": peaks[mode] / peaks["plain"], "loss_rel_diff": abs(losses[mode] / losses["plain"] - 1)}
        res["modes"][mode] = r
        print(f"  {mode:>10}: {sec * 1e3:8.1f} ms  x{r['time_ratio']:.3f} (fastest rounds x{r['min_time_ratio']:.3f})"
              f"   peak {r['peak_mib']:8.1f} MiB  "
              f"x{r['peak_ratio']:.3f}   loss rel diff {r['loss_rel_diff']:.1e}", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--lo", type=int, default=1024)
    p.add_argument("--hi", type=int, default=3072)
    p.add_argument("--tile", type=int, default=1024)
    p.add_argument("--budget-mib", type=float, default=1024.0)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="S_local 256 vs 768, tile 256, budget 256 MiB, cap 2048")
    p.add_argument("--cap", type=int, default=16384, help="the longest S_local probed")
    p.add_argument("--no-search", action="store_true", help="only the line's prediction, no probes at the budget")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--head", action="store_true", help="the LM head + loss alone (see the module docstring)")
    p.add_argument("--head-shape", default="4096,256,32000", help="--head: S,H,V")
    p.add_argument("--tiles", default="256,512,1024,2048", help="--head: tile sizes")
    p.add_argument("--reps", type=int, default=5, help="--head: interleaved rounds")
    p.add_argument("--device", default="cpu", help="--head: cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="--head: the head's dtype")
    a = p.parse_args()
    if a.head:
        torch.set_num_threads(1)
        res = head_bench(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    if a.quick:
        a.lo, a.hi, a.tile, a.budget_mib, a.cap = 256, 768, 256, 256.0, 2048
    torch.set_num_threads(1)
    shape = dict(vocab=a.vocab, hidden=a.hidden, layers=a.layers)
    res = {"cp": a.cp, "shape": shape, "lo": a.lo, "hi": a.hi, "tile": a.tile, "budget_mib": a.budget_mib}
    for mode, tile in (("untiled", None), ("tiled", a.tile)):
        lo, hi = probe(a.cp, a.lo, tile, shape), probe(a.cp, a.hi, tile, shape)
        slope = (hi["peak"] - lo["peak"]) / (a.hi - a.lo)  # bytes a token
        intercept = lo["peak"] - slope * a.lo
        longest = int((a.budget_mib * MiB - intercept) / slope) // 256 * 256
        r = {"peak_lo_mib": lo["peak"] / MiB, "peak_hi_mib": hi["peak"] / MiB, "kib_per_token": slope / 1024,
             "seconds_hi": hi["seconds"], "predicted_longest": longest}
        if not a.no_search:
            seen = {}

            def fits(s: int) -> bool:
                seen[s] = probe(a.cp, s, tile, shape)
                return seen[s]["peak"] <= a.budget_mib * MiB

            if longest >= a.cap and fits(a.cap):
                found, capped = a.cap, True
            else:
                found, capped = search_max(fits, start=max(256, min(longest, a.cap)), unit=256, rel_grain=1 / 16), False
            r.update(longest=found, capped=capped, probes={s: round(v["peak"] / MiB, 1) for s, v in sorted(seen.items())},
                     seconds_longest=seen[found]["seconds"] if found in seen else None)
        res[mode] = r
        print(mode, json.dumps(r), flush=True)
    u, t = res["untiled"], res["tiled"]
    res["growth_ratio"] = t["kib_per_token"] / u["kib_per_token"]
    key = "predicted_longest" if a.no_search else "longest"
    res["longest_ratio"] = t[key] / max(u[key], 1)
    res["time_ratio_at_hi"] = t["seconds_hi"] / u["seconds_hi"]
    print(f"per-token growth: untiled {u['kib_per_token']:.1f} KiB, tiled {t['kib_per_token']:.1f} KiB, "
          f"ratio {res['growth_ratio']:.3f} (bar <= 0.15)")
    at_least = ">= " if t.get("capped") else ""
    print(f"longest S_local under {a.budget_mib:.0f} MiB ({key}): untiled {u[key]}, tiled {at_least}{t[key]}, "
          f"ratio {at_least}{res['longest_ratio']:.1f}x (aim >= 4x)")
    print(f"time at S_local {a.hi}: tiled / untiled = {res['time_ratio_at_hi']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
