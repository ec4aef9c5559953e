"""Linear attention (gated delta rule) under CP on CPU ranks: bytes per layer and time, CP=2 against CP=1.

    .venv/bin/python scripts/benchmarks/bench_linear_attention.py                  # N = 8k, B 1, Hk 2, Hv 4, dk = dv = 64
    .venv/bin/python scripts/benchmarks/bench_linear_attention.py --seq-len 4096 --repeats 1

* Bytes: what one rank sends per layer for the state summaries (``linear_state_bytes``: fp32, independent
  of N), forward and backward, counted with ``CommBytes`` at the timed shape and checked against the
  formula (the agreement's fingerprint, ``check_bytes``, apart); then a table at Qwen3-Next's linear-attention
  shape (Hk 16, Hv 32, dk = dv = 128, bf16 activations) next to a head-parallel all-to-all scheme at the same
  shapes: all-to-alls of q, k, v, g, beta in and o out forward, their gradients backward, each sending
  (P - 1) / P of B * S_local * (2 Hk dk + 2 Hv dv + 2 Hv) values (g scalar per head, GDN).
* Time: ``sharded_delta_rule`` with transformers' ``torch_chunk_gated_delta_rule`` (its default chunk 64,
  l2norm on), forward + backward, on N tokens: CP=1 (one rank, the plain kernel) and CP=2 (contiguous and
  headtail; the step's time is the slower rank's), one intra-op thread per rank, best of ``--repeats`` after
  one warm-up; ratios from this one run. Writes bench_out/linear_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # this checkout's cp_dtensor
sys.path.insert(0, os.path.dirname(__file__))
from cp_dtensor.core.linear.linear_attention import check_bytes, linear_state_bytes, sharded_delta_rule  # noqa: E402
from cp_dtensor.tools.debug import CommBytes  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402

QWEN3_NEXT = dict(hk=16, hv=32, dk=128, dv=128)


def a2a_bytes(*, world: int, batch: int, s_local: int, hk: int, hv: int, dk: int, dv: int, itemsize: int,
              gate_width: int = 1) -> int:
    """A head-parallel scheme's all-to-alls per rank per forward (the backward sends as many): q, k, v, g, beta
    in, o out, each sending (P - 1) / P of its buffer."""
    per_token = 2 * hk * dk + hv * dv + hv * gate_width + hv + hv * dv
    return (world - 1) * batch * s_local * per_token * itemsize // world


def _make(seed: int, b: int, n: int, hk: int, hv: int, d: int):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    return (r(b, n, hk, d), r(b, n, hk, d), r(b, n, hv, d), -torch.nn.functional.softplus(r(b, n, hv)),
            torch.sigmoid(r(b, n, hv)), r(b, n, hv, d))


def _rank(rank: int, world: int, args, layout: str):
    import torch.distributed as dist
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from cp_dtensor.core.plan.layout import shard_tensor

    torch.set_num_threads(1)
    *xs, do = _make(0, args.batch, args.seq_len, args.hk, args.hv, args.d)
    shard = lambda x: shard_tensor(x, seq_dim=1, layout=layout, rank=rank, cp_size=world) if world > 1 else x
    xs, do = [shard(x).contiguous() for x in xs], shard(do).contiguous()
    times, sent = [], None
    for it in range(args.repeats + 1):
        local = [x.clone().requires_grad_() for x in xs]
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with CommBytes() as fwd:
            o = sharded_delta_rule(torch_chunk_gated_delta_rule, *local, mesh=None, layout=layout,
                                   use_qk_l2norm_in_kernel=True)
        with CommBytes() as bwd:
            o.backward(do)
        t = time.perf_counter() - t0
        if it:
            times.append(t)
        sent = (fwd.sent, bwd.sent)
    return min(times), sent


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hk", type=int, default=2)
    p.add_argument("--hv", type=int, default=4)
    p.add_argument("--d", type=int, default=64, help="dk = dv")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench_out/linear_attention.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    report: dict = {"shape": vars(args), "time_s": {}, "bytes_measured": {}}
    t1, _ = run_ranks(1, _rank, args, "contiguous")[0]
    report["time_s"]["cp1"] = t1
    print(f"N={args.seq_len} B={args.batch} Hk={args.hk} Hv={args.hv} dk=dv={args.d}, fwd+bwd, 1 thread per rank")
    print(f"  CP=1                 {t1:7.2f} s")
    for layout in ("contiguous", "headtail"):
        per_rank = run_ranks(2, _rank, args, layout)
        t2 = max(t for t, _ in per_rank)
        fwd, bwd = per_rank[0][1]
        want = linear_state_bytes(batch=args.batch, heads=args.hv, dk=args.d, dv=args.d, world=2, layout=layout)
        fwd -= check_bytes(world=2)
        assert fwd == want and bwd == want, (layout, fwd, bwd, want)
        report["time_s"][f"cp2_{layout}"] = t2
        report["bytes_measured"][layout] = {"fwd": fwd, "bwd": bwd, "formula": want}
        print(f"  CP=2 {layout:<15} {t2:7.2f} s   CP2/CP1 {t2 / t1:.2f}   per-rank times "
              + ", ".join(f"{t:.2f}" for t, _ in per_rank) + f"   bytes fwd {fwd} bwd {bwd} (= formula {want})")

    print("\nbytes per rank per layer, forward (backward the same), Qwen3-Next linear attention "
          f"(Hk {QWEN3_NEXT['hk']}, Hv {QWEN3_NEXT['hv']}, dk = dv = 128), B = 1, bf16 activations:")
    print(f"  {'P':>2} {'N':>7} {'layout':<11} {'summaries (fp32)':>17} {'head a2a (bf16)':>16} {'ratio':>7}")
    table = []
    for world in (2, 4, 8):
        for n in (8192, 32768, 131072):
            for layout in ("contiguous", "headtail"):
                s = linear_state_bytes(batch=1, heads=QWEN3_NEXT["hv"], dk=128, dv=128, world=world, layout=layout)
                a = a2a_bytes(world=world, batch=1, s_local=n // world, itemsize=2, **QWEN3_NEXT)
                table.append(dict(world=world, seq_len=n, layout=layout, summaries=s, a2a=a))
                print(f"  {world:>2} {n:>7} {layout:<11} {s / 2**20:>13.1f} MiB {a / 2**20:>12.1f} MiB {s / a:>7.3f}")
    report["bytes_table"] = table
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
