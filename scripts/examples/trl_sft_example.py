"""TRL's SFTTrainer with packing under context parallelism: the script changes one line.

    torchrun --nproc-per-node 2 scripts/examples/trl_sft_example.py              # CP=2 (gloo on CPU, NCCL on GPUs)
    torchrun --nproc-per-node 1 scripts/examples/trl_sft_example.py --cp 1       # the unchanged SFTTrainer: the same losses
    torchrun --nproc-per-node 4 scripts/examples/trl_sft_example.py --layout documents --dynamic  # one plan a step
    torchrun --nproc-per-node 2 scripts/examples/trl_sft_example.py --cp 1       # over all 4 ranks: dp=2's losses

A random-init Llama learns a synthetic text corpus with a word-level tokenizer built here (nothing is
downloaded). ``packing=True`` packs the tokenized examples into rows of ``--max-length`` tokens (best-fit
decreasing, padding-free: position ids restart at 0 per example); TRL refuses packing with accelerate's
context parallelism, cp_dtensor keeps the packed examples apart. Prints the logged losses and token accuracy.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

WORDS = "the a ring shard token rank layout striped head tail window sink packed document attention".split()


def corpus(seed: int, count: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(4, 40, (1,), generator=g))
        out.append({"text": " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))})
    return out


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks per data-parallel replica (1: the plain SFTTrainer)")
    p.add_argument("--layout", default="striped", choices=["striped", "headtail", "contiguous", "documents"])
    p.add_argument("--dynamic", action="store_true", help="with --layout documents: each step's global batch planned "
                   "over every dp x cp rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-length", type=int, default=128, help="the packed row length, in tokens")
    p.add_argument("--out", default="/tmp/cp_dtensor_trl_sft_example")
    args = p.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    tok = tokenizer()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         attn_implementation="sdpa", use_cache=False))
    config = SFTConfig(output_dir=args.out, packing=True, max_length=args.max_length, per_device_train_batch_size=1,
                       max_steps=args.steps, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                       use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True, seed=0)

    trainer_cls = SFTTrainer
    if args.cp > 1:  # the one line
        from cp_dtensor.hf import with_context_parallel

        trainer_cls = with_context_parallel(SFTTrainer, cp_size=args.cp, layout=args.layout,
                                            **(dict(dynamic=True) if args.dynamic else {}))

    trainer = trainer_cls(model=model, args=config, train_dataset=Dataset.from_list(corpus(1, 64)), processing_class=tok)
    trainer.train()
    if trainer.is_world_process_zero():
        for h in trainer.state.log_history:
            if "loss" in h:
                print(f"step {h['step']}: loss {h['loss']:.6f}  mean_token_accuracy {h['mean_token_accuracy']:.4f}")


if __name__ == "__main__":
    main()
