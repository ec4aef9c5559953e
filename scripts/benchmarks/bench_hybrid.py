"""A hybrid linear-attention model under CP on CPU ranks: time and memory per rank, CP=2 against CP=1.

    .venv/bin/python scripts/benchmarks/bench_hybrid.py                          # N = 8k and 32k
    .venv/bin/python scripts/benchmarks/bench_hybrid.py --seq-len 8192 16384 --repeats 2

The model: transformers' Qwen3-Next, small enough for a CPU: 4 layers (3 Gated DeltaNet, then 1 full
attention, Qwen3-Next's 3:1 pattern), hidden 256, dense MLP 256 (no experts), vocab 256; linear layers Hk 2,
Hv 4, dk = dv = 64, conv 4; attention Hq 4 / Hkv 2, D 64. fp32, B 1, random init (seed 0), one intra-op
thread per rank. The step: the recipe of docs/hybrids.md, ``model(input_ids, position_ids, labels, shift_labels,
num_items_in_batch).loss`` forward + backward (transformers' torch kernels: ``torch_chunk_gated_delta_rule``,
chunk 64; SDPA for the full layer).

* CP=1: the plain model (no CP) in one process. CP=2: ``apply_context_parallel(model, mesh,
  layout="headtail")`` on 2 gloo ranks (the step's time is the slower rank's, per repeat).
* Time: min over ``--repeats`` after one warm-up step, each configuration in freshly forked processes,
  CP=1 then CP=2 for each N (one run: the ratio is taken minutes apart at most). Also the process CPU
  time of the slower rank (``time.process_time``): on a shared machine two ranks compete with other
  load for the cores, which the wall time shows and the CPU time mostly does not.
* Memory, two ways, per rank: (1) peak resident memory of the last timed step above the resident memory before it
  (``scripts/benchmarks/_bench_mem.py``: the kernel's high-water mark reset, glibc set to return freed blocks, so
  the peak is live memory: saved activations, the backward's transients, gradients, gloo's copies);
  (2) the bytes autograd saves for the backward (``saved_tensors_hooks``, unique storages, parameters
  excluded): the activations a training step holds at the end of its forward.
Writes bench_out/hybrid.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_mem as bench_mem  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402

CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=0,
              layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=131072,
              attn_implementation="sdpa")


def build():
    import transformers
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG)).float()


def saved_bytes(step, params) -> int:
    """Bytes of the unique storages autograd saves during ``step()`` (parameters excluded); runs its backward."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def _rank(rank: int, world: int, n: int, batch: int, repeats: int, layout: str) -> dict:
    import torch.distributed as dist

    from cp_dtensor.doors import shard_batch
    from cp_dtensor.hf import attention as hf

    torch.set_num_threads(1)
    bench_mem._libc_live_memory()
    model = build()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG["vocab_size"], (batch, n), generator=g)
    positions = torch.arange(n).expand(batch, n)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        hf.apply_context_parallel(model, mesh, layout=layout)
        shifted = hf.shift_labels(tokens)
        count = (shifted != -100).sum()
        tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout=layout)

        def step():
            return model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count).loss
    else:
        def step():
            return model(input_ids=tokens, position_ids=positions, labels=tokens, use_cache=False).loss

    params = list(model.parameters())
    saved = saved_bytes(step, params)  # also the warm-up
    times, cpu = [], []
    for i in range(repeats):
        model.zero_grad(set_to_none=True)
        gc.collect()
        if i == repeats - 1:  # the last repeat also gives the peak (the reset walks the page tables: before t0)
            base = bench_mem.reset_peak()
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step().backward()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = bench_mem.peak_since(base)
    return dict(times=times, cpu=cpu, peak=peak, saved=saved)


def measure(n: int, world: int, args) -> dict:
    ranks = run_ranks(world, _rank, n, args.batch, args.repeats, args.layout)
    per_repeat = [max(r["times"][i] for r in ranks) for i in range(args.repeats)]  # the slower rank's
    cpu = [max(r["cpu"][i] for r in ranks) for i in range(args.repeats)]
    return dict(time=min(per_repeat), per_repeat=per_repeat, cpu=min(cpu), peak=max(r["peak"] for r in ranks),
                saved=max(r["saved"] for r in ranks), per_rank=ranks)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layout", default="headtail")
    p.add_argument("--out", default="bench_out/hybrid.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    report: dict = {"config": CONFIG, "args": vars(args), "rows": []}
    p_ = args.world
    print(f"Qwen3-Next (3 GDN : 1 full, hidden 256, dk = dv = 64), B={args.batch}, fp32, fwd+bwd, 1 thread per rank, "
          f"CP={p_} {args.layout} vs CP=1 (plain model); min of {args.repeats} after a warm-up")
    print(f"  {'N':>6} {'CP=1 s':>8} {f'CP={p_} s':>8} {'time':>6} {'cpu':>5} {'CP=1 peak':>10} {f'CP={p_} peak':>10} {'peak':>6} "
          f"{'CP=1 saved':>11} {f'CP={p_} saved':>11} {'saved':>6}")
    for n in args.seq_len:
        t0 = time.perf_counter()
        one = measure(n, 1, args)
        cp = measure(n, p_, args)
        row = dict(seq_len=n, cp1=one, cp=cp, time_ratio=cp["time"] / one["time"], cpu_ratio=cp["cpu"] / one["cpu"],
                   peak_ratio=cp["peak"] / one["peak"],
                   saved_ratio=cp["saved"] / one["saved"], wall_s=time.perf_counter() - t0)
        report["rows"].append(row)
        mib = 2 ** 20
        print(f"  {n:>6} {one['time']:8.2f} {cp['time']:8.2f} {row['time_ratio']:6.2f} {row['cpu_ratio']:5.2f} "
              f"{one['peak'] / mib:6.0f} MiB "
              f"{cp['peak'] / mib:6.0f} MiB {row['peak_ratio']:6.2f} {one['saved'] / mib:7.0f} MiB "
              f"{cp['saved'] / mib:7.0f} MiB {row['saved_ratio']:6.2f}", flush=True)
        _write(report, args.out)  # after every row: a run stopped at a longer N keeps the shorter ones
    print(f"  time: CP={p_} / CP=1 of the step's wall time (slower rank); cpu: the same for the process CPU time "
          "(less sensitive to other load on the machine); peak: resident high-water mark of a step above its start, "
          "per rank (CP: the larger rank); saved: bytes autograd keeps for the backward, per rank")
    print(f"wrote {args.out}")
    return report


def _write(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
