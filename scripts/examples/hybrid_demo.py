"""The hybrid recipe of docs/hybrids.md, runnable: Qwen3-Next and Kimi Linear (tiny, random init) under CP vs CP=1.

    .venv/bin/torchrun --standalone --nproc_per_node 2 scripts/examples/hybrid_demo.py
    .venv/bin/torchrun --standalone --nproc_per_node 3 scripts/examples/hybrid_demo.py --model kimi_linear --seq-len 96

Every rank builds the same model (3 linear-attention layers + 1 full-attention layer) and batch, runs it
whole (CP=1, the reference), then applies ``apply_context_parallel(model, mesh, layout="headtail")``
and runs the recipe's three lines on its shard: ``shard_batch`` of tokens, positions and the shifted
labels, then ``model(input_ids, position_ids, labels, shift_labels, num_items_in_batch).loss`` and its
backward. Prints the loss (summed over ranks) against CP=1, max |logits - CP=1| and the largest gradient
error (max |g - g_ref| / max |g_ref| over the parameters, gradients summed over the ranks). fp32, gloo.
Measured at P = 2, N = 256: logits within 2.4e-7 of CP=1 for both; gradients within 4.4e-6 for Kimi Linear
and 2.1e-4 for Qwen3-Next, whose worst is dt_bias / A_log: with transformers' default decay init (up to ~20
per token) the fp32 kernel keeps ~3 digits of those at CP=1 itself, and CP is no further from float64
(docs/hybrids.md; scripts/benchmarks/hybrid_precision.py).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # this checkout's cp_dtensor
import cp_dtensor  # noqa: E402
from cp_dtensor.hf import apply_context_parallel, shift_labels  # noqa: E402

V = 128
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def make(name: str):
    """A tiny random-init model of ``name``, the same on every rank (seeded)."""
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  layer_types=LAYERS, max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    if name == "qwen3_next":  # Gated DeltaNet (scalar decay per head), GVA: 2 key heads, 4 value heads
        cfg = transformers.Qwen3NextConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=0,
                                           linear_conv_kernel_dim=4, linear_key_head_dim=16,
                                           linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
        return transformers.Qwen3NextForCausalLM(cfg).float()
    # Kimi Delta Attention (per-channel decay); MLA full layers (Dqk 24 != Dv 16)
    cfg = transformers.KimiLinearConfig(**common, num_key_value_heads=4, linear_head_dim=16, linear_num_heads=2,
                                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                        mlp_layer_types=["dense"] * 4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.KimiLinearForCausalLM(cfg).float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["qwen3_next", "kimi_linear", "both"], default="both")
    p.add_argument("--seq-len", type=int, default=256, help="a multiple of 2 * P (headtail)")
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (args.batch, args.seq_len), generator=g)  # the same on every rank
    positions = torch.arange(args.seq_len).expand_as(tokens)
    labels = tokens
    for name in (["qwen3_next", "kimi_linear"] if args.model == "both" else [args.model]):
        base = make(name)

        ref = copy.deepcopy(base)  # CP=1: the whole batch (transformers shifts the labels itself)
        out = ref(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False)
        out.loss.backward()

        # the recipe of docs/hybrids.md
        model = apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
        shifted = shift_labels(labels)
        n = (shifted != -100).sum()
        tok, pos, lab = cp_dtensor.shard_batch((tokens, positions, shifted), mesh, layout="headtail")
        cp = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=n)
        cp.loss.backward()
        cp_dtensor.reduce_gradients(model, mesh)  # each rank's gradients cover its own tokens

        loss = cp.loss.detach().clone()
        dist.all_reduce(loss)
        logits = cp_dtensor.unshard_batch(cp.logits.detach(), mesh, layout="headtail")
        logit_err = (logits - out.logits.detach()).abs().max().item()
        grad_err, worst = max((((a.grad - b.grad).abs().max() / b.grad.abs().max()).item(), k)
                              for (k, a), b in zip(model.named_parameters(), ref.parameters()))
        if rank == 0:
            print(f"{name}: CP={world} headtail, B={args.batch} N={args.seq_len}, fp32: loss {loss.item():.6f} "
                  f"(CP=1 {out.loss.item():.6f}), max |logits - CP=1| {logit_err:.2e} "
                  f"(max |logits| {out.logits.abs().max().item():.2f}), max gradient error {grad_err:.2e} ({worst})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
