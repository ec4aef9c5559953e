"""generate() of a hybrid linear-attention model under CP on CPU ranks: a state-passing prefill, then decoding
from a sharded attention cache and replicated linear states; CP=2 against CP=1.

    .venv/bin/python scripts/benchmarks/bench_hybrid_generate.py                      # prompts 8k and 32k, 16 new tokens
    .venv/bin/python scripts/benchmarks/bench_hybrid_generate.py --lengths 2048 --new-tokens 4

The model: transformers' Qwen3-Next, 8 layers in its 3 : 1 pattern (3 Gated DeltaNet, 1 full attention,
twice), hidden 512, dense SwiGLU 1024 (no experts), vocab 1024; linear layers Hk 4, Hv 8, dk = dv = 64,
conv 4; full layers (gated attention) Hq 8 / Hkv 2, D 64. fp32, B 1, random init (seed 0; decay rates
drawn from [0.05, 1] so the greedy tokens of a random model are not a tie-break lottery), one intra-op
thread per rank. It generates greedily from one prompt three ways, each in freshly forked ranks:

* ``cp1``: the plain model (SDPA, transformers' DynamicCache) in one process;
* ``cp1-sharded``: ``cp_dtensor.hf.apply_context_parallel`` on a 1-rank mesh (the same cache classes and decode path
  as CP=2: the ratio against it isolates what the second rank buys);
* ``cp2``: ``apply_context_parallel`` on 2 ranks, layout headtail.

Per prompt length: prefill time (generate's start to the first logits), decode time per token (median over
the steps) and its CPU time, the cache bytes each rank holds (attention shares + linear states), the rank's
peak resident memory over the whole generate above its start (``_bench_mem``), whether the tokens equal
CP=1's. On a short prompt: the bytes each rank sends per decoded token (``CommBytes``) against the formula
(P - 1) * B * Hq * T * (Dv + 1) * 4 per full-attention layer and 0 per linear layer; and the choice for the
linear layers' decode step (Note [Prefill for decoding] in cp_dtensor/core/linear/linear_attention.py): the measured
time of one linear layer's replicated step against one gloo broadcast of its output [B, 1, E] and of its
state [B, Hv, dk, dv] (what computing it on one rank would add). Writes bench_out/hybrid_generate.json.
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_dist import run_ranks  # noqa: E402
from _bench_mem import _libc_live_memory, peak_since, reset_peak  # noqa: E402

CONFIG = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=0,
              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2, max_position_embeddings=131072,
              attn_implementation="sdpa")


def build_model(mesh=None, layout: str = "headtail"):
    import transformers
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from cp_dtensor.hf import apply_context_parallel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG)).float().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                a = layer.linear_attn.A_log
                a.copy_(torch.empty(a.shape).uniform_(0.05, 1.0, generator=g).log())
    if mesh is not None:
        apply_context_parallel(model, mesh, layout=layout)
    return model


def prompt(n: int) -> torch.Tensor:
    return torch.randint(1, CONFIG["vocab_size"], (1, n), generator=torch.Generator().manual_seed(n))


def state_bytes(cache) -> int:
    """Bytes of every tensor the cache holds on this rank (attention shares, positions, linear states), once each."""
    seen, total = set(), 0
    for layer in cache.layers:
        xs = [getattr(layer, "keys", None), getattr(layer, "values", None), getattr(layer, "positions", None)]
        xs += list(getattr(layer, "conv_states", {}).values()) + list(getattr(layer, "recurrent_states", {}).values())
        for x in xs:
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in seen:
                seen.add(x.untyped_storage().data_ptr())
                total += x.untyped_storage().nbytes()
    return total


def timed_generate(model, ids: torch.Tensor, new_tokens: int, count_bytes: bool = False) -> dict:
    """Greedy generate with a time stamp (and the bytes sent so far) at every step's logits -- a hook on the LM
    head, not a logits processor, which would switch on generate()'s per-step stopping agreement (Note [Agreed
    stopping and sampling]) -- and the linear layers' decode-step times."""
    from cp_dtensor.tools.debug import CommBytes

    stamps, cpu, sent, linear = [], [], [], []
    meter = CommBytes() if count_bytes else None

    def stamp(m, a, o):
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())
        sent.append(meter.sent if meter is not None else 0)

    def pre(m, a, k):
        m._t0 = time.perf_counter()

    def post(m, a, k, o):
        if k.get("hidden_states", a[0] if a else None).shape[1] == 1:  # a decode step
            linear.append(time.perf_counter() - m._t0)

    handles = [model.lm_head.register_forward_hook(stamp)]
    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            handles += [layer.linear_attn.register_forward_pre_hook(pre, with_kwargs=True),
                        layer.linear_attn.register_forward_hook(post, with_kwargs=True)]
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        with torch.no_grad(), (meter if meter is not None else contextlib.nullcontext()):
            out = model.generate(input_ids=ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 eos_token_id=None, return_dict_in_generate=True)
    finally:
        for h in handles:
            h.remove()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    cpu_steps = [b - a for a, b in zip(cpu, cpu[1:])]
    return dict(prefill_s=stamps[0] - t0, decode_s=statistics.median(steps) if steps else None,
                prefill_cpu_s=cpu[0] - c0, decode_cpu_s=statistics.median(cpu_steps) if cpu_steps else None,
                step_bytes=[b - a for a, b in zip(sent, sent[1:])], tokens=out.sequences[0, ids.shape[1]:].tolist(),
                cache_bytes=state_bytes(out.cache), linear_step_s=statistics.median(linear) if linear else None)


def broadcast_s(shape: tuple, reps: int = 50) -> float:
    """Median time of one gloo broadcast of an fp32 tensor of ``shape`` from rank 0."""
    import torch.distributed as dist

    x = torch.zeros(shape)
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(x, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_main(rank: int, world: int, kind: str, lengths: list[int], new_tokens: int, layout: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    _libc_live_memory()
    mesh = None if kind == "cp1" else init_device_mesh("cpu", (world,))
    model = build_model(mesh, layout)
    timed_generate(model, prompt(16), 2)  # warm-up: gloo connections, lazy state
    small = timed_generate(model, prompt(256), 8)
    out = dict(floor_decode_s=small["decode_s"], linear_step_s=small["linear_step_s"],
               step_bytes=timed_generate(model, prompt(64), 3, count_bytes=world > 1)["step_bytes"],
               load_average=os.getloadavg())
    if world > 1:  # what one rank + a broadcast would add per linear layer and step
        b, e = 1, CONFIG["hidden_size"]
        out["broadcast_output_s"] = broadcast_s((b, 1, e))
        out["broadcast_state_s"] = broadcast_s((b, CONFIG["linear_num_value_heads"], CONFIG["linear_key_head_dim"],
                                                CONFIG["linear_value_head_dim"]))
    for n in lengths:
        gc.collect()
        _libc_live_memory()
        base = reset_peak()
        r = timed_generate(model, prompt(n), new_tokens + 1)
        r["peak_bytes"] = peak_since(base)
        r["load_average"] = os.getloadavg()
        out[str(n)] = r
        if rank == 0:
            print(f"  {kind} N={n}: prefill {r['prefill_s']:.2f} s, decode {1e3 * r['decode_s']:.1f} ms/token, "
                  f"cache {r['cache_bytes'] / 2**20:.1f} MiB, peak {r['peak_bytes'] / 2**20:.0f} MiB, "
                  f"load {r['load_average'][0]:.1f}", flush=True)
    return out


def formula_bytes(world: int) -> int:
    """Bytes one rank sends per decoded token per full-attention layer: (P - 1) * B * Hq * T * (Dv + 1) * 4."""
    return (world - 1) * 1 * CONFIG["num_attention_heads"] * 1 * (CONFIG["head_dim"] + 1) * 4


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--layout", default="headtail")
    parser.add_argument("--out", default="bench_out/hybrid_generate.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start_load = os.getloadavg()
    runs = {}
    for kind, world in (("cp1", 1), ("cp1-sharded", 1), ("cp2", 2)):
        print(f"{kind} ({world} rank{'s' if world > 1 else ''}) ...", flush=True)
        runs[kind] = run_ranks(world, rank_main, kind, args.lengths, args.new_tokens, args.layout)
    one, sharded, two = runs["cp1"][0], runs["cp1-sharded"][0], runs["cp2"]
    types = CONFIG["layer_types"]
    full, lin = types.count("full_attention"), types.count("linear_attention")
    per_token = sorted(set(two[0]["step_bytes"]))
    formula = formula_bytes(2)
    report = dict(config=CONFIG, args=vars(args), runs=runs, bytes_per_token=per_token,
                  bytes_per_token_per_full_layer=[b / full for b in per_token], formula_per_full_layer=formula,
                  load_average_start=start_load, load_average_end=os.getloadavg(), rows={})
    print(f"\nbytes sent per decoded token (rank 0): {per_token} = {[b / full for b in per_token]} per full-attention "
          f"layer x {full} (formula {formula}); linear layers ({lin}): 0")
    lin_s, bo, bs = two[0]["linear_step_s"], two[0]["broadcast_output_s"], two[0]["broadcast_state_s"]
    print(f"linear layer decode step, replicated: {1e3 * lin_s:.3f} ms; one gloo broadcast of its output "
          f"{1e3 * bo:.3f} ms, of its state {1e3 * bs:.3f} ms (what one rank + broadcast would add per layer)")
    print("| N | prefill s cp1 / cp2 | ratio | decode ms/token cp1 / cp1-sharded / cp2 | cp2÷cp1 | cp2÷cp1-sharded | "
          "decode cpu cp2÷cp1 | peak MiB/rank cp1 / cp2 | ratio | cache MiB/rank cp1 / cp2 | tokens equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        a, s, b = one[str(n)], sharded[str(n)], [r[str(n)] for r in two]
        slow = lambda key: max(r[key] for r in b)  # noqa: E731  the slower rank
        row = dict(prefill_ratio=slow("prefill_s") / a["prefill_s"], decode_ratio=slow("decode_s") / a["decode_s"],
                   decode_ratio_sharded=slow("decode_s") / s["decode_s"],
                   prefill_cpu_ratio=slow("prefill_cpu_s") / a["prefill_cpu_s"],
                   decode_cpu_ratio=slow("decode_cpu_s") / a["decode_cpu_s"],
                   decode_cpu_ratio_sharded=slow("decode_cpu_s") / s["decode_cpu_s"],
                   peak_ratio=slow("peak_bytes") / a["peak_bytes"], cache_ratio=slow("cache_bytes") / a["cache_bytes"],
                   tokens_equal=all(r["tokens"] == a["tokens"] for r in b) and s["tokens"] == a["tokens"])
        report["rows"][n] = row
        print(f"| {n} | {a['prefill_s']:.1f} / {slow('prefill_s'):.1f} | {row['prefill_ratio']:.2f} | "
              f"{1e3 * a['decode_s']:.1f} / {1e3 * s['decode_s']:.1f} / {1e3 * slow('decode_s'):.1f} | "
              f"{row['decode_ratio']:.2f} | {row['decode_ratio_sharded']:.2f} | {row['decode_cpu_ratio']:.2f} | "
              f"{a['peak_bytes'] / 2**20:.0f} / {slow('peak_bytes') / 2**20:.0f} | {row['peak_ratio']:.2f} | "
              f"{a['cache_bytes'] / 2**20:.1f} / {slow('cache_bytes') / 2**20:.1f} | {row['tokens_equal']} |")
    print("\nCPU seconds of the busiest rank (time.process_time: the work, without the waits a loaded machine adds):")
    print("| N | prefill cpu s cp1 / cp2 | ratio | decode cpu ms/token cp1 / cp1-sharded / cp2 | cp2÷cp1 | cp2÷cp1-sharded |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        a, s, b, row = one[str(n)], sharded[str(n)], [r[str(n)] for r in two], report["rows"][n]
        print(f"| {n} | {a['prefill_cpu_s']:.1f} / {max(r['prefill_cpu_s'] for r in b):.1f} | "
              f"{row['prefill_cpu_ratio']:.2f} | {1e3 * a['decode_cpu_s']:.1f} / {1e3 * s['decode_cpu_s']:.1f} / "
              f"{1e3 * max(r['decode_cpu_s'] for r in b):.1f} | {row['decode_cpu_ratio']:.2f} | "
              f"{row['decode_cpu_ratio_sharded']:.2f} |")
    print(f"load average: start {start_load[0]:.1f}, end {report['load_average_end'][0]:.1f} ({os.cpu_count()} CPUs)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
