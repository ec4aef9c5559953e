"""Generate from a long prompt under context parallelism on CPU ranks, next to the same model at CP=1.

    .venv/bin/python scripts/examples/decode_demo.py                              # 4096-token prompt, 64 tokens, CP=2
    .venv/bin/python scripts/examples/decode_demo.py --prompt-len 8191 --cp 3 --layout striped

A random-init Llama (GQA) generates greedily twice from the same prompt: once as the plain model
(attn_implementation="sdpa", one process), once after ``cp_dtensor.hf.apply_context_parallel`` on
``--cp`` forked gloo ranks, each calling ``model.generate`` with the full prompt: the prompt's prefill
runs the ring in the layout and leaves each rank its share of the KV cache; every decoded token's K/V
stay on one rank (column mod P), and each step attends by ``cp_dtensor.sharded_cache_attention``.
Prints the tokens of both runs, each rank's cache size and bytes, and the times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # the forked-gloo launcher
from bench_decode import build_model  # noqa: E402

from cp_dtensor.hf import cache_bytes  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402  (the scripts' forked-gloo launcher)


def generate(rank: int, world: int, args, cp: bool) -> dict:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,)) if cp else None
    model = build_model(mesh, max_len=args.prompt_len + args.new_tokens + 8, layout=args.layout)
    ids = torch.randint(1, 1024, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    first = []

    from transformers import LogitsProcessor

    class FirstLogits(LogitsProcessor):  # generate() calls it after each forward: the first is the prefill's
        def __call__(self, input_ids, scores):
            first.append(time.perf_counter()) if not first else None
            return scores

    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None, logits_processor=[FirstLogits()], return_dict_in_generate=True)
    t1 = time.perf_counter()
    layer = out.cache.layers[0]
    return dict(tokens=out.sequences[0, args.prompt_len:].tolist(), prefill_s=first[0] - t0,
                decode_ms=1e3 * (t1 - first[0]) / max(1, args.new_tokens - 1), held=int(layer.keys.shape[2]),
                cache_bytes=cache_bytes(out.cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--layout", default="striped")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ref = run_ranks(1, generate, args, False)[0]
    ranks = run_ranks(args.cp, generate, args, True)
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} generated, Llama 2 layers, hidden 512, 8q/2kv heads")
    print(f"CP=1 tokens: {ref['tokens']}")
    for r, got in enumerate(ranks):
        print(f"CP={args.cp} rank {r} tokens: {'same as CP=1' if got['tokens'] == ref['tokens'] else got['tokens']}")
    print(f"CP=1: prefill {ref['prefill_s']:.2f} s, decode {ref['decode_ms']:.1f} ms/token, cache {ref['held']} "
          f"tokens / layer, {ref['cache_bytes'] / 2**20:.2f} MiB")
    for r, got in enumerate(ranks):
        print(f"CP={args.cp} rank {r}: prefill {got['prefill_s']:.2f} s, decode {got['decode_ms']:.1f} ms/token, "
              f"cache {got['held']} tokens / layer, {got['cache_bytes'] / 2**20:.2f} MiB")
    if any(got["tokens"] != ref["tokens"] for got in ranks):
        raise SystemExit("the tokens differ from CP=1")


if __name__ == "__main__":
    main()
