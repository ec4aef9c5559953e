"""The transformers Trainer on packed documents under context parallelism: the script changes one line.

    torchrun --nproc-per-node 2 scripts/examples/trainer_example.py             # CP=2 (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 1 scripts/examples/trainer_example.py --cp 1      # the unchanged Trainer: the same losses
    torchrun --nproc-per-node 4 scripts/examples/trainer_example.py --cp 2      # 2 data-parallel replicas x CP=2
    torchrun --nproc-per-node 4 scripts/examples/trainer_example.py --layout documents --dynamic  # one plan a
    torchrun --nproc-per-node 2 scripts/examples/trainer_example.py --cp 1   # training step over all 4 ranks
                                                           # prints the train and eval losses of dp=2 without CP

A random-init Llama (GQA, a few layers) trains on synthetic documents packed into one row per batch by
transformers' ``DataCollatorWithFlattening`` (position ids restarting at 0 per document); the CP ranks keep
the documents apart, as flash-attention does. Prints the logged train and eval losses on rank 0.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


def documents(seed: int, count: int, vocab: int, longest: int) -> list[dict]:
    """Token documents of random lengths (the collator packs a batch of them into one row)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(longest // 4, longest + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks per data-parallel replica (1: the plain Trainer)")
    p.add_argument("--layout", default="headtail", choices=["striped", "headtail", "contiguous", "documents"])
    p.add_argument("--dynamic", action="store_true", help="with --layout documents: each training step's global batch "
                   "planned over every dp x cp rank (evaluation: each replica's rows over its own CP ranks)")
    p.add_argument("--no-eval", action="store_true", help="train only")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--docs-per-row", type=int, default=8)
    p.add_argument("--doc-len", type=int, default=64, help="the longest document, in tokens")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over every rank (CP ranks included) instead of DDP")
    p.add_argument("--out", default="/tmp/cp_dtensor_trainer_example")
    args = p.parse_args()
    evaluate = not args.no_eval
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", use_cache=False)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.docs_per_row, per_device_eval_batch_size=args.docs_per_row,
        max_steps=args.steps, learning_rate=1e-3, logging_steps=1,
        eval_strategy="steps" if evaluate else "no", eval_steps=args.steps,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0,
        **(dict(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap":
                                                          ["LlamaDecoderLayer"]}) if args.fsdp else {}),
    )

    trainer_cls = Trainer
    if args.cp > 1:  # the one line: a subclass of the trainer class, CP on every cp ranks of the launch
        from cp_dtensor.hf import with_context_parallel

        trainer_cls = with_context_parallel(Trainer, cp_size=args.cp, layout=args.layout,
                                            **(dict(dynamic=True) if args.dynamic else {}))

    trainer = trainer_cls(
        model=model, args=training, data_collator=DataCollatorWithFlattening(),
        train_dataset=documents(1, 64, config.vocab_size, args.doc_len),
        eval_dataset=documents(2, 2 * args.docs_per_row, config.vocab_size, args.doc_len) if evaluate else None,
    )
    trainer.train()
    if trainer.is_world_process_zero():
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"step {h['step']}: loss {h['loss']:.6f}")
            if "eval_loss" in h:
                print(f"step {h['step']}: eval_loss {h['eval_loss']:.6f}")


if __name__ == "__main__":
    main()
