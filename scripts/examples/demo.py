"""A small CP demo under torchrun: ring attention on CPU ranks vs single-device attention.

    .venv/bin/torchrun --standalone --nproc_per_node=4 scripts/examples/demo.py --seq-len 4096

Every rank builds the same global q, k, v from one seed, takes its shard in each layout, runs
``cp_dtensor.ring_attention`` forward and backward, and compares with float64 attention on the full
sequence. Prints the relative errors and the bytes each rank sent next to the formula.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import cp_dtensor
from cp_dtensor.core.plan.layout import shard_tensor
from cp_dtensor.tools.debug import CommBytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    n, d = args.seq_len, args.head_dim
    q = torch.randn(1, args.q_heads, n, d, generator=g, dtype=torch.float64)
    k = torch.randn(1, args.kv_heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, args.kv_heads, n, d, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if rank == 0:
        print(f"CP={world} ranks, N={n}, Hq={args.q_heads}, Hkv={args.kv_heads}, D={d}, causal, fp32")
    for layout in cp_dtensor.LAYOUTS:
        ql, kl, vl = (shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world).float() for x in (q, k, v))
        with CommBytes() as sent:
            out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
        want = shard_tensor(ref, seq_dim=2, layout=layout, rank=rank, cp_size=world)
        err = torch.tensor([((out.double() - want).abs().max() / want.abs().max()).item()])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        formula = (world - 1) * 2 * (n // world) * d * args.kv_heads * 4
        if rank == 0:
            print(
                f"  {layout:<10} max relative error vs float64 {err.item():.2e}   "
                f"K/V bytes sent per rank {sent.by_op['all_to_all_single']:,} (formula {formula:,})"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
