"""How much the bf16 dK/dV accumulators lose on their way round the ring: dk, dv error vs P.

    .venv/bin/python scripts/benchmarks/dkv_precision.py [--world 2 3 4 5 6 7 8] [--seq-len 1680]

The ring sends each block's dK/dV accumulator in the input dtype, adding one rank's share a hop
(Note [Ring backward] in ring.py), so a bf16 accumulator is rounded up to P-1 times. For each P this
runs causal striped ring attention in bf16 on P CPU ranks (one fixed global problem, N divisible by
every P) and prints max |dk - dk_ref| / max |dk_ref| against float64 attention, next to the same
error of one single-rank bf16 call (P=1): the difference is what the travelling accumulator costs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import cp_dtensor  # noqa: E402
from cp_dtensor.core.plan.layout import shard_tensor, unshard_tensor  # noqa: E402
from _dist import run_ranks  # noqa: E402
from _ref import make_qkv, reference, rel_err  # noqa: E402


def _grads(rank, world, n, seed):
    q, k, v, do = make_qkv(seed, 1, 4, 2, n, 64)
    sh = lambda x: shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world).bfloat16()  # noqa: E731
    ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
    out = cp_dtensor.ring_attention(ql, kl, vl, layout="striped", is_causal=True)
    out.backward(sh(do))
    return [x.float().numpy() for x in (ql.grad, kl.grad, vl.grad)]  # numpy: no tensor fds across the fork


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    ap.add_argument("--seq-len", type=int, default=1680)  # 1680 = 2 * lcm(1..8): every P divides it
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"N={args.seq_len}, B=1, Hq=4, Hkv=2, D=64, striped causal, bf16; max rel error vs float64 "
          f"(worst of {args.seeds} seeds)")
    print(f"{'P':>3} {'dq':>9} {'dk':>9} {'dv':>9}")
    for world in [1, *args.world]:
        worst = [0.0, 0.0, 0.0]
        for seed in range(args.seeds):
            q, k, v, do = make_qkv(seed, 1, 4, 2, args.seq_len, 64)
            ref = reference(q, k, v, do, is_causal=True)[1:]
            shards = run_ranks(world, _grads, args.seq_len, seed)
            for i in range(3):
                got = unshard_tensor([torch.from_numpy(s[i]) for s in shards], seq_dim=2, layout="striped")
                worst[i] = max(worst[i], rel_err(got, ref[i]))
        print(f"{world:>3} " + " ".join(f"{e:9.2e}" for e in worst), flush=True)


if __name__ == "__main__":
    main()
