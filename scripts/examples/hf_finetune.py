"""Fine-tune a small Hugging Face Llama with context parallelism on CPU ranks, packed sequences, vs CP=1.

    .venv/bin/python scripts/examples/hf_finetune.py                      # CP=2, striped, 3 AdamW steps
    .venv/bin/python scripts/examples/hf_finetune.py --cp 4 --layout headtail

A random-init LlamaForCausalLM (GQA) trains on batches of packed documents (one row per batch, position
ids restarting at 0 per document, labels -100 at each document's first token: what transformers'
``DataCollatorWithFlattening`` produces). The same steps run twice from the same weights: once as the
plain model on the full sequence (CP=1, attn_implementation="sdpa"), once with
``cp_dtensor.hf.apply_context_parallel`` on ``--cp`` forked gloo ranks, each holding its layout's
shard of tokens, positions and labels. Prints both losses per step and how far the weights drifted apart.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))  # the forked-gloo launcher
from _bench_dist import run_ranks  # noqa: E402  (the scripts' forked-gloo launcher)


def packed_batch(seed: int, n: int, vocab: int):
    """One packed row of documents: tokens, positions restarting at 0, labels (-100 at document starts)."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < n:
        lengths.append(min(int(torch.randint(1, n // 2, (1,), generator=g)), n - sum(lengths)))
    tokens = torch.randint(0, vocab, (1, n), generator=g)
    positions = torch.cat([torch.arange(x) for x in lengths])[None]
    labels = tokens.masked_fill(positions == 0, -100)
    return tokens, positions, labels, len(lengths)


def train(rank: int, world: int, args) -> list[tuple[float, float]] | float:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    import cp_dtensor
    from cp_dtensor.hf import apply_context_parallel, shift_labels

    transformers.logging.set_verbosity_error()
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg)
    batches = [packed_batch(100 + step, args.seq_len, cfg.vocab_size) for step in range(args.steps)]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))

    def steps(model, shard=None):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for tokens, positions, labels, _ in batches:
            lab = shift_labels(labels)  # shift on the full row: a token's label may live on another rank
            count = (lab != -100).sum()  # normalise by the global label count
            tok, pos, lab = shard(tokens, positions, lab) if shard else (tokens, positions, lab)
            # use_cache=False: training; transformers (and CP) then keep the packed documents apart
            loss = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                         use_cache=False).loss
            opt.zero_grad()
            loss.backward()
            if shard:
                cp_dtensor.reduce_gradients(model, mesh)  # each rank's gradient covers its own tokens
                loss = loss.detach().clone()
                dist.all_reduce(loss)
            opt.step()
            losses.append(loss.item())
        return losses

    ref = copy.deepcopy(base)
    ref_losses = steps(ref)  # CP=1: every rank runs the full sequence alike
    model = apply_context_parallel(copy.deepcopy(base), mesh, layout=args.layout)
    cp_losses = steps(model, lambda *t: cp_dtensor.shard_batch(t, mesh, layout=args.layout))
    drift = max(((p - r).abs().max() / r.abs().max()).item() for p, r in zip(model.parameters(), ref.parameters()))
    if rank == 0:
        for step, ((*_, docs), a, b) in enumerate(zip(batches, ref_losses, cp_losses)):
            print(f"step {step}: {docs:2d} packed documents  loss CP=1 {a:.6f}  CP={world} ({args.layout}) {b:.6f}"
                  f"  rel diff {abs(a - b) / abs(a):.1e}")
        print(f"weights after {args.steps} steps: max relative difference {drift:.1e}")
    return max(abs(a - b) / abs(a) for a, b in zip(ref_losses, cp_losses))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--layout", default="striped", choices=["striped", "headtail", "contiguous"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)  # before forking the ranks
    worst = max(run_ranks(args.cp, train, args, timeout_s=600))
    print("OK: CP loss equals CP=1" if worst <= 1e-5 else f"MISMATCH: {worst:.1e}")
    sys.exit(0 if worst <= 1e-5 else 1)


if __name__ == "__main__":
    main()
