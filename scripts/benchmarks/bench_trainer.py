"""The transformers Trainer under CP on CPU ranks: tokens/s and peak memory per rank, CP=2 against CP=1.

    .venv/bin/python scripts/benchmarks/bench_trainer.py                         # N = 8k and 32k tokens per sample
    .venv/bin/python scripts/benchmarks/bench_trainer.py --seq-len 8192 --steps 3

The model: a small Llama (transformers' LlamaForCausalLM, random init, fp32): 2 layers, hidden 128, 2 query
heads / 1 KV head of D 64, SwiGLU 256, vocab 256 -- attention-bound at these lengths, as long-context
training is. One sample of N tokens per step (per_device_train_batch_size 1), AdamW, the Trainer's own loop.

* CP=1: the unchanged ``transformers.Trainer`` in one process. CP=2: ``with_context_parallel(Trainer,
  cp_size=2, layout="headtail")`` on 2 gloo ranks (DDP over both). Each configuration runs in freshly forked
  processes, one intra-op thread each, CP=1 then CP=2 for each N, in one run (the ratios are taken minutes
  apart at most). The first step is a warm-up (the optimizer state appears there); the time is the min over
  the ``--steps`` after it, measured by a TrainerCallback from step begin to step end (the slower rank's).
* tokens/s: N / step time (one replica; CP=2 spends 2 processes on it). Also each rank's CPU time per step:
  on a shared machine the wall time includes waiting for a core, the CPU time mostly does not.
* Peak memory per rank: the resident high-water mark of the last timed step above the resident memory at its
  start (``scripts/benchmarks/_bench_mem.py``: glibc set to return freed blocks, so the peak is live memory: activations,
  the backward's transients, gradients, gloo's and DDP's buffers; weights and optimizer state are below the line).
Writes bench_out/trainer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_dist import run_ranks  # noqa: E402
from _bench_mem import _libc_live_memory, peak_since, reset_peak  # noqa: E402


def _rank(rank: int, world: int, n: int, steps: int) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    _libc_live_memory()
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from cp_dtensor.hf import with_context_parallel

    transformers.logging.set_verbosity_error()

    class Clock(TrainerCallback):
        def __init__(self):
            self.wall, self.cpu, self.peak = [], [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.base = reset_peak()
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.wall.append(time.perf_counter() - self.t)
            self.cpu.append(time.process_time() - self.c)
            self.peak.append(peak_since(self.base))

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                         max_position_embeddings=n, attn_implementation="sdpa", use_cache=False))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(0, 256, (n,), generator=g).tolist()), "labels": ids}
            for _ in range(steps + 1)]
    clock = Clock()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=1, max_steps=steps + 1,
                             learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, dataloader_drop_last=True)
    cls = Trainer if world == 1 else with_context_parallel(Trainer, cp_size=world, layout="headtail")
    trainer = cls(model=model, args=args, train_dataset=data, data_collator=transformers.default_data_collator,
                  callbacks=[clock])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"wall": clock.wall[1:], "cpu": clock.cpu[1:], "peak": clock.peak[-1], "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up")
    p.add_argument("--out", default="bench_out/trainer.json")
    args = p.parse_args()
    torch.set_num_threads(1)  # before forking the ranks
    load = [os.getloadavg()[0]]
    rows = []
    for n in args.seq_len:
        res = {}
        for world in (1, 2):
            ranks = run_ranks(world, _rank, n, args.steps)
            wall = min(max(r["wall"][i] for r in ranks) for i in range(args.steps))
            res[world] = {"step_s": wall, "tokens_per_s": n / wall, "cpu_s": max(min(r["cpu"]) for r in ranks),
                          "peak_gib": [r["peak"] / 2**30 for r in ranks], "losses": ranks[0]["losses"]}
            print(f"N={n} CP={world}: step {wall:.2f} s, {n / wall:.0f} tokens/s, peak/rank "
                  f"{', '.join(f'{x:.3f}' for x in res[world]['peak_gib'])} GiB, losses {ranks[0]['losses']}",
                  flush=True)
            load.append(os.getloadavg()[0])
        rows.append({"seq_len": n, **{f"cp{w}": v for w, v in res.items()}})
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "load_1min": load, "command": " ".join(sys.argv)}, f, indent=1)
    print("\n| N | CP=1 tokens/s | CP=2 tokens/s | ratio | CP=1 peak/rank | CP=2 peak/rank | ratio | CPU s/step 1 -> 2 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["cp1"], r["cp2"]
        pa, pb = max(a["peak_gib"]), max(b["peak_gib"])
        print(f"| {r['seq_len']} | {a['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} | "
              f"{b['tokens_per_s'] / a['tokens_per_s']:.2f} | {pa:.3f} GiB | {pb:.3f} GiB | {pb / pa:.2f} | "
              f"{a['cpu_s']:.1f} -> {b['cpu_s']:.1f} |")
    print(f"1-minute load average during the run: {', '.join(f'{x:.1f}' for x in load)} (2 cores)")


if __name__ == "__main__":
    main()
