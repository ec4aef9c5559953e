"""A transformers model under CP with layout="documents" (one plan per batch) beside layout="striped".

    .venv/bin/python scripts/benchmarks/bench_hf_documents.py                     # P = 2, N = 2048
    .venv/bin/python scripts/benchmarks/bench_hf_documents.py --worlds 2 4 --seq-len 4096 --repeats 5

A tiny random-init Llama (2 layers, hidden 64, 4 query / 2 KV heads, fp32, the same on every rank) on one row
of packed documents of 16..127 tokens (position ids restarting at 0), on P forked CPU ranks (gloo, one
thread each). Per layout, the best of ``--repeats`` steps (after one warm-up) of what a training step does
at the door: the plan of the full batch (``cp_dtensor.hf.plan_batch``; documents only), ``shard_batch``, the
forward and the backward. Then the plan's host cost alone. Writes bench_out/hf_documents.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.dirname(__file__))
from _bench_dist import run_ranks  # noqa: E402


def rank_main(rank: int, world: int, n: int, repeats: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import cp_dtensor
    from cp_dtensor import hf

    mesh = init_device_mesh("cpu", (world,))
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(16, 128, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - n
    pos = torch.cat([torch.arange(x) for x in lengths if x > 0])[None]
    tok = torch.randint(0, 256, (1, n), generator=g)
    out = {"documents_in_row": len(lengths)}
    for layout in ("striped", "documents"):
        model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            plan = hf.plan_batch(model, position_ids=pos) if layout == "documents" else layout
            t, p = cp_dtensor.shard_batch((tok, pos), mesh, layout=plan)
            extra = {"cp_layout": plan} if layout == "documents" else {}
            model(input_ids=t, position_ids=p, use_cache=False, **extra).logits.square().mean().backward()
            times.append(time.perf_counter() - t0)
        out[f"{layout}_step_s"] = min(times[1:])
    t0 = time.perf_counter()
    hf.plan_batch(model, position_ids=pos)
    out["plan_ms"] = 1e3 * (time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    for world in args.worlds:
        r = run_ranks(world, rank_main, args.seq_len, args.repeats)[0]  # rank 0's
        results[world] = r
        print(f"P={world} N={args.seq_len} ({r['documents_in_row']} documents): forward+backward step "
              f"striped {r['striped_step_s']:.3f} s, documents {r['documents_step_s']:.3f} s "
              f"(plan {r['plan_ms']:.1f} ms of it)")
    os.makedirs("bench_out", exist_ok=True)
    with open("bench_out/hf_documents.json", "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
