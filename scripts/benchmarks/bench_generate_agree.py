"""What generate() under CP pays per token for agreeing across ranks (Note [Agreed stopping and sampling]).

    .venv/bin/python scripts/benchmarks/bench_generate_agree.py                   # P = 2, 3; prompt 256; 32 new tokens
    .venv/bin/python scripts/benchmarks/bench_generate_agree.py --worlds 2 --new-tokens 64 --repeats 5

A Llama-shaped model (the shape of scripts/benchmarks/bench_decode.py: 2 layers, hidden 512, 8 query / 2 KV heads, fp32,
random weights, the same on every rank) generates from one prompt on P forked CPU ranks (gloo, one thread
each), side by side in the same ranks, alternating, ``--repeats`` times each:

* ``greedy``: nothing to agree per token (every decision follows from the agreed options and logits);
* ``greedy+max_time``: ``max_time=1e6`` (never reached) -- a clock, so every step's stopping decisions and
  tokens go through one all-gather of [2, B] int64 a rank (AgreedStopping): the difference to ``greedy`` is
  what that agreement costs per token;
* ``sampled``: ``do_sample=True, top_k=50`` with per-rank seeds (``seed + rank``): the generators agreed once
  per call (rank 0's state in the call's first gather), nothing per token; the difference to ``greedy`` is
  the sampling itself.

Per variant: the median and the minimum time per decoded token over the steps (time stamps at each step's logits, by a logits
processor) and the median wall time of the whole call. Then the agreement's collective alone: the median and minimum of 1000
all-gathers of [2, B] int64 over the CP group, as AgreedStopping posts it. Writes bench_out/generate_agree.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import build_model  # noqa: E402

from _bench_dist import run_ranks  # noqa: E402


def _generate(model, ids, new_tokens: int, **options) -> tuple[float, list[float]]:
    from transformers import LogitsProcessor

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None,
                       logits_processor=[Stamp()], **options)
    wall = time.perf_counter() - start
    return wall, [b - a for a, b in zip(stamps, stamps[1:])]


def rank_main(rank: int, world: int, prompt: int, new_tokens: int, repeats: int, batch: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(mesh, max_len=prompt + new_tokens + 8)
    ids = torch.randint(1, 1024, (batch, prompt), generator=torch.Generator().manual_seed(0))
    variants = {"greedy": dict(do_sample=False), "greedy+max_time": dict(do_sample=False, max_time=1e6),
                "sampled": dict(do_sample=True, top_k=50)}
    _generate(model, ids, 4)  # warm-up: gloo connections, lazy state
    walls, steps = {k: [] for k in variants}, {k: [] for k in variants}
    for _ in range(repeats):
        for name, options in variants.items():
            torch.manual_seed(1 + rank)
            wall, per_step = _generate(model, ids, new_tokens, **options)
            walls[name].append(wall)
            steps[name] += per_step
    out = {name: {"token_ms": 1e3 * statistics.median(steps[name]), "token_min_ms": 1e3 * min(steps[name]),
                  "call_ms": 1e3 * statistics.median(walls[name])} for name in variants}
    from cp_dtensor.core.exchange.comm import all_gather, host_group, wait

    group = host_group(mesh.get_group())
    flags, times = torch.zeros(2 * batch, dtype=torch.long), []
    for _ in range(1000):
        start = time.perf_counter()
        wait(all_gather(flags, group), group)
        times.append(time.perf_counter() - start)
    out["all_gather_us"], out["all_gather_min_us"] = 1e6 * statistics.median(times), 1e6 * min(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for world in args.worlds:
        out = run_ranks(world, rank_main, args.prompt, args.new_tokens, args.repeats, args.batch)[0]  # rank 0's
        results[world] = out
        base = out["greedy"]["token_ms"]
        print(f"P={world} prompt {args.prompt} B={args.batch}, {args.new_tokens} new tokens, median of "
              f"{args.repeats} calls' steps:")
        for name, r in out.items():
            if not isinstance(r, dict):
                continue
            print(f"  {name:16s} {r['token_ms']:7.3f} ms/token median ({r['token_ms'] - base:+.3f} vs greedy), "
                  f"{r['token_min_ms']:7.3f} min ({r['token_min_ms'] - out['greedy']['token_min_ms']:+.3f})   "
                  f"call {r['call_ms']:8.1f} ms")
        print(f"  stop agreement (max_time, the caller's criteria or processors): one all-gather of "
              f"{16 * args.batch} bytes a rank per token, alone {out['all_gather_us']:.0f} us median, "
              f"{out['all_gather_min_us']:.0f} us min (of 1000)")
    os.makedirs("bench_out", exist_ok=True)
    with open("bench_out/generate_agree.json", "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
