"""Long-context inference under CP on CPU ranks: ring prefill, then decoding from a sequence-sharded KV cache.

    .venv/bin/python scripts/benchmarks/bench_decode.py                         # prompts 8k and 32k, 16 decoded tokens
    .venv/bin/python scripts/benchmarks/bench_decode.py --lengths 2048 8192 --new-tokens 8

A Llama-shaped model (2 layers, hidden 512, 8 query / 2 KV heads, head 64, SwiGLU 1024, vocab 1024, fp32,
random weights, the same on every rank) generates greedily from one prompt three ways, one after the
other, each in freshly forked ranks with one thread each:

* ``cp1``: the plain model (attn_implementation="sdpa", transformers' DynamicCache) in one process;
* ``cp1-sharded``: ``apply_context_parallel`` on a 1-rank mesh (the same cache class and decode
  attention as CP=2, so the ratio against it isolates what the second rank buys);
* ``cp2``: ``apply_context_parallel`` on 2 ranks, layout striped.

Per prompt length: prefill time (generate's start to the first logits), decode time per token (median
over the steps), the KV cache bytes each rank allocates, and the rank's peak resident memory over the
whole generate (``_bench_mem``: VmHWM above the line; weights below it). The longest prompt that fits
a per-rank budget comes from a line through the two lengths' peaks (budget: cp1's peak at the longest
length). The bytes each rank sends per decoded token and layer are counted (``CommBytes``) on a short
prompt, against (P - 1) * B * Hq * T * (Dv + 1) * 4. Writes bench_out/decode.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.dirname(__file__))
from cp_dtensor.hf import cache_bytes  # noqa: E402  (each buffer once: K, V, the shared positions)
from _bench_dist import run_ranks  # noqa: E402
from _bench_mem import _libc_live_memory, peak_since, reset_peak  # noqa: E402

SHAPE = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64)


def build_model(cp_mesh=None, max_len: int = 40000, layout: str = "striped"):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from cp_dtensor.hf import apply_context_parallel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, max_position_embeddings=max_len, attn_implementation="sdpa"))
    model = model.float().eval()
    if cp_mesh is not None:
        apply_context_parallel(model, cp_mesh, layout=layout)
    return model


def prompt(n: int) -> torch.Tensor:
    return torch.randint(1, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))


def timed_generate(model, ids: torch.Tensor, new_tokens: int, count_bytes: bool = False) -> dict:
    """Greedy generate with a time stamp (and the bytes sent so far) at every step's logits."""
    from transformers import LogitsProcessor

    from cp_dtensor.tools.debug import CommBytes

    stamps, cpu, sent = [], [], []
    meter = CommBytes() if count_bytes else None

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
            sent.append(meter.sent if meter is not None else 0)
            return scores

    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad(), (meter if meter is not None else contextlib.nullcontext()):
        out = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None, logits_processor=[Stamp()], return_dict_in_generate=True)
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    cpu_steps = [b - a for a, b in zip(cpu, cpu[1:])]
    return dict(prefill_s=stamps[0] - t0, decode_s=statistics.median(steps) if steps else None,
                prefill_cpu_s=cpu[0] - c0, decode_cpu_s=statistics.median(cpu_steps) if cpu_steps else None,
                step_bytes=[b - a for a, b in zip(sent, sent[1:])], tokens=out.sequences[0, ids.shape[1]:].tolist(),
                cache_bytes=cache_bytes(out.cache), held=[layer.keys.shape[2] for layer in out.cache.layers])


def rank_main(rank: int, world: int, kind: str, lengths: list[int], new_tokens: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    _libc_live_memory()
    mesh = None if kind == "cp1" else init_device_mesh("cpu", (world,))
    model = build_model(mesh)
    timed_generate(model, prompt(16), 2)  # warm-up: gloo connections, lazy state
    small = timed_generate(model, prompt(256), 8)  # the short-cache floor: everything but attention over the cache
    small["step_bytes"] = timed_generate(model, prompt(64), 3, count_bytes=world > 1)["step_bytes"]  # the wire
    out = dict(floor_decode_s=small["decode_s"], floor_decode_cpu_s=small["decode_cpu_s"], step_bytes=small["step_bytes"],
               load_average=os.getloadavg())
    for n in lengths:
        gc.collect()
        _libc_live_memory()
        base = reset_peak()
        r = timed_generate(model, prompt(n), new_tokens + 1)
        r["peak_bytes"] = peak_since(base)
        out[str(n)] = r
        if rank == 0:
            print(f"  {kind} N={n}: prefill {r['prefill_s']:.2f} s, decode {1e3 * r['decode_s']:.1f} ms/token, "
                  f"cache {r['cache_bytes'] / 2**20:.1f} MiB, peak {r['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    return out


def longest(peaks: dict[int, int], budget: float) -> float:
    """The prompt length whose peak reaches ``budget``, on the line through the two longest measured lengths."""
    (n0, p0), (n1, p1) = sorted(peaks.items())[-2:]
    slope = (p1 - p0) / (n1 - n0)
    return n1 + (budget - p1) / slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default="bench_out/decode.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = {}
    for kind, world in (("cp1", 1), ("cp1-sharded", 1), ("cp2", 2)):
        print(f"{kind} ({world} rank{'s' if world > 1 else ''}) ...", flush=True)
        runs[kind] = run_ranks(world, rank_main, kind, args.lengths, args.new_tokens)
    one, two = runs["cp1"][0], runs["cp2"]
    hq, dv, layers = SHAPE["num_attention_heads"], SHAPE["head_dim"], SHAPE["num_hidden_layers"]
    formula = (2 - 1) * 1 * hq * 1 * (dv + 1) * 4
    per_layer = sorted({b / layers for b in two[0]["step_bytes"]})
    report = dict(shape=SHAPE, lengths=args.lengths, new_tokens=args.new_tokens, runs=runs,
                  bytes_per_token_per_layer=per_layer, formula=formula)
    print(f"\nbytes sent per decoded token per layer (rank 0): {per_layer} (formula {formula})")
    print(f"decode floor (N=256): cp1 {1e3 * one['floor_decode_s']:.1f} ms, "
          f"cp1-sharded {1e3 * runs['cp1-sharded'][0]['floor_decode_s']:.1f} ms, cp2 {1e3 * two[0]['floor_decode_s']:.1f} ms"
          f" (cpu: {1e3 * one['floor_decode_cpu_s']:.1f} / {1e3 * runs['cp1-sharded'][0]['floor_decode_cpu_s']:.1f} / "
          f"{1e3 * two[0]['floor_decode_cpu_s']:.1f} ms); load average {os.getloadavg()}")
    print("| N | prefill cp1 / cp2 (s) | ratio | decode ms/token cp1 / cp1-sharded / cp2 | cp2÷cp1 | cp2÷cp1-sharded | "
          "cache MiB/rank cp1 / cp2 | ratio | tokens equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for n in args.lengths:
        a, s, b = one[str(n)], runs["cp1-sharded"][0][str(n)], [r[str(n)] for r in two]
        cache2 = max(r["cache_bytes"] for r in b)
        row = dict(prefill_ratio=max(r["prefill_s"] for r in b) / a["prefill_s"],
                   decode_ratio=max(r["decode_s"] for r in b) / a["decode_s"],
                   decode_ratio_sharded=max(r["decode_s"] for r in b) / s["decode_s"],
                   cache_ratio=cache2 / a["cache_bytes"],
                   tokens_equal=all(r["tokens"] == a["tokens"] for r in b) and s["tokens"] == a["tokens"])
        row.update(prefill_cpu_ratio=max(r["prefill_cpu_s"] for r in b) / a["prefill_cpu_s"],
                   decode_cpu_ratio=max(r["decode_cpu_s"] for r in b) / a["decode_cpu_s"],
                   decode_cpu_ratio_sharded=max(r["decode_cpu_s"] for r in b) / s["decode_cpu_s"])
        rows[n] = row
        print(f"| {n} | {a['prefill_s']:.1f} / {max(r['prefill_s'] for r in b):.1f} | {row['prefill_ratio']:.2f} | "
              f"{1e3 * a['decode_s']:.1f} / {1e3 * s['decode_s']:.1f} / {1e3 * max(r['decode_s'] for r in b):.1f} | "
              f"{row['decode_ratio']:.2f} | {row['decode_ratio_sharded']:.2f} | {a['cache_bytes'] / 2**20:.1f} / "
              f"{cache2 / 2**20:.1f} | {row['cache_ratio']:.3f} | {row['tokens_equal']} |")
    print("\nCPU seconds of the busiest rank (time.process_time: what the work costs, without the waits a loaded "
          "machine adds):")
    print("| N | prefill cpu s cp1 / cp2 | ratio | decode cpu ms/token cp1 / cp1-sharded / cp2 | cp2÷cp1 | cp2÷cp1-sharded |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        a, s, b = one[str(n)], runs["cp1-sharded"][0][str(n)], [r[str(n)] for r in two]
        row = rows[n]
        print(f"| {n} | {a['prefill_cpu_s']:.1f} / {max(r['prefill_cpu_s'] for r in b):.1f} | "
              f"{row['prefill_cpu_ratio']:.2f} | {1e3 * a['decode_cpu_s']:.1f} / {1e3 * s['decode_cpu_s']:.1f} / "
              f"{1e3 * max(r['decode_cpu_s'] for r in b):.1f} | {row['decode_cpu_ratio']:.2f} | "
              f"{row['decode_cpu_ratio_sharded']:.2f} |")
    if len(args.lengths) >= 2:
        budget = one[str(max(args.lengths))]["peak_bytes"]
        n1 = longest({n: one[str(n)]["peak_bytes"] for n in args.lengths}, budget)
        n2 = longest({n: max(r[str(n)]["peak_bytes"] for r in two) for n in args.lengths}, budget)
        report["longest_prompt"] = dict(budget_bytes=budget, cp1=n1, cp2=n2, ratio=n2 / n1)
        print(f"\nlongest prompt within {budget / 2**20:.0f} MiB per rank (peak over generate, linear in N): "
              f"cp1 {n1:.0f}, cp2 {n2:.0f}, ratio {n2 / n1:.2f}")
        for n in args.lengths:
            print(f"  peak MiB at N={n}: cp1 {one[str(n)]['peak_bytes'] / 2**20:.0f}, cp2 per rank "
                  f"{[round(r[str(n)]['peak_bytes'] / 2**20) for r in two]}")
    report["rows"] = rows
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
