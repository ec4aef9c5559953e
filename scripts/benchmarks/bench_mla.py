"""Multi-head latent attention under CP (cp_dtensor/hf/latent.py): latent rows on the wire against the ring's expanded
K/V -- bytes a layer and memory counted from the plan at DeepSeek-V3 sizes, and a CPU timing of a tiny model.

DeepSeek-V3's attention in bf16: a latent row is kv_lora_rank 512 + rope 64 = 1152 bytes; the expanded K/V the
ring moves is 128 heads x (192 + 128) = 81920 bytes a token. For each rank (every rank's plan is a function of the
layout and the masks only; the busiest one reported):

* ``latent``: the rows it receives in forward -- those of other ranks' tokens one of its queries can see (causal,
  in its document: ``--doc L`` packs documents of L tokens), hf/sparse.py's ``seen_keys`` as the door runs it --
  and as many gradient rows sent back in backward;
* ``ring``: (P - 1) S_local tokens of K/V through it forward, twice that backward (K/V and dK/dV).

Memory a layer, batch 1: what the attention saves for backward (latent: the [N, 576] rows in global order; ring:
its [S_local] expanded K/V) and the attention call's working set (latent: one key chunk's K/V and scores
[H, T, C] fp32 tiles (C = latent_attend.key_chunk, T = query_tile); ring: the block in flight and the one being received).

    python scripts/benchmarks/bench_mla.py --n 8192 32768 131072 --world 4 8 [--doc 0 4096]
    python scripts/benchmarks/bench_mla.py --time   # CP=2 ring vs latent, a tiny DeepSeek-V3 on CPU (~20 s)

``--turn C T [C T ...]``: a generate() turn of T new tokens on a cache of C (batch 1, bf16), bytes a rank sends a
layer by hf/turns.py's rule: pass-Q ([out | lse] of the replicated queries), pass-KV of the cached latent rows
(Note [MLA turns] in cp_dtensor/hf/latent.py) and pass-KV of the expanded K/V (what it would send), and the mode
the rule picks.

    python scripts/benchmarks/bench_mla.py --turn 32768 512 131072 4096 131072 512 --world 4 8
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cp_dtensor.core.plan.layout import global_order  # noqa: E402
from cp_dtensor.hf.latent_attend import key_chunk, query_tile  # noqa: E402
from cp_dtensor.hf.sparse import seen_keys  # noqa: E402

HEADS, QK, V_DIM, LATENT_DIM = 128, 192, 128, 512 + 64
LATENT, RING_KV = LATENT_DIM * 2, HEADS * (QK + V_DIM) * 2  # bytes a token, bf16


def rows_received(n: int, world: int, layout: str, doc: int = 0) -> list[int]:
    """Latent rows each rank receives in forward (batch 1): the other ranks' rows its queries can see."""
    order = global_order(layout, world, n)[None]  # [1, N]
    rows = None if not doc else ("documents", (torch.arange(n) // doc)[None])
    seen = seen_keys(order, world, 1, rows)[:, 0]  # [P, N]
    s = n // world
    out = []
    for rank in range(world):
        mine = seen[rank].clone()
        mine[order[0, rank * s:(rank + 1) * s]] = False  # held here
        out.append(int(mine.sum()))
    return out


def memory(n: int, world: int) -> dict:
    """Bytes a layer (batch 1, bf16 tensors, fp32 scores): saved for backward and the attention's working set
    (latent: one key chunk's K/V and two fp32 score tiles -- scores and probabilities)."""
    s = n // world
    c = key_chunk(1, HEADS * (QK + V_DIM), n)
    t = query_tile(1, HEADS, s, c)
    return dict(latent_saved=n * LATENT, ring_saved=s * RING_KV,
                latent_work=c * RING_KV + 2 * HEADS * t * c * 4, ring_work=2 * s * RING_KV, chunk=f"{c} x {t}")


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.0f}x" if b else "no rows"


def _bytes(args) -> None:
    print("| N | P | layout | doc | latent MB fwd / fwd+bwd | ring MB fwd / fwd+bwd | ring / latent fwd / fwd+bwd | "
          "saved MB latent / ring | working MB latent (C x T) / ring |")
    print("|" + "---|" * 9)
    for n in args.n:
        for world in args.world:
            for doc in args.doc:
                rows = max(rows_received(n, world, args.layout, doc))
                lat, ring = rows * LATENT, (world - 1) * (n // world) * RING_KV
                m = memory(n, world)
                mb = 2**20
                print(f"| {n} | {world} | {args.layout} | {doc or '-'} | {lat / mb:.1f} / {2 * lat / mb:.1f} | "
                      f"{ring / mb:.0f} / {3 * ring / mb:.0f} | {_ratio(ring, lat)} / {_ratio(3 * ring, 2 * lat)} | "
                      f"{m['latent_saved'] / mb:.0f} / {m['ring_saved'] / mb:.0f} | "
                      f"{m['latent_work'] / mb:.0f} ({m['chunk']}) / {m['ring_work'] / mb:.0f} |")


def _turns(args) -> None:
    from cp_dtensor.hf.turns import turn_plan

    print("| C | T | P | pass-Q MB | pass-KV latent MB | pass-KV expanded MB | picked |")
    print("|---|---|---|---|---|---|---|")
    pairs = list(zip(args.turn[::2], args.turn[1::2]))
    for world in args.world:
        for c, t in pairs:
            common = dict(new=t, cached=c, cp=world, batch=1, q_heads=HEADS, kv_bytes=2, unit=2 * world)
            lat = turn_plan(**common, kv_heads=1, head_dim=V_DIM, kv_width=LATENT_DIM)
            full = turn_plan(**common, kv_heads=HEADS, head_dim=QK, value_dim=V_DIM)
            mb = 2**20
            print(f"| {c} | {t} | {world} | {lat.pass_q / mb:.1f} | {lat.pass_kv / mb:.1f} | {full.pass_kv / mb:.0f} | "
                  f"{lat.mode} |")


def _timing_ranks(rank: int, world: int, n: int, repeat: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "hf"))
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import cp_dtensor
    from cp_dtensor.hf import attention as hf
    from cp_dtensor.hf import latent_attend

    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world,))
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=2, use_cache=False)
    torch.manual_seed(0)
    plain = transformers.DeepseekV3ForCausalLM(cfg).float().train()
    plain.set_attn_implementation("sdpa")
    tokens = torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(n)[None]
    out = {}
    for path in ("ring", "latent", "latent matmul"):  # the default ring; the opt-in latent path: the fused kernel
        # per (query tile, key chunk), or the tiled matmul + softmax (Note [Latent attention in chunks])
        latent_attend.FUSED = path != "latent matmul"
        exchange = "ring" if path == "ring" else "latent"
        cp = hf.apply_context_parallel(copy.deepcopy(plain), mesh, layout="headtail", kv_exchange=exchange)
        assert (cp._cp_dtensor_hf.mla == "latent") == (exchange == "latent"), cp._cp_dtensor_hf.mla
        tok, pos = cp_dtensor.shard_batch((tokens, positions), mesh, layout="headtail")
        times = []
        for _ in range(repeat + 1):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            cp(input_ids=tok, position_ids=pos).logits.float().square().mean().backward()
            times.append(time.perf_counter() - t0)
        out[path] = statistics.median(times[1:])
    return out


def _timing(args) -> None:
    from _bench_dist import run_ranks

    torch.set_num_threads(1)
    for n in args.time_n:
        got = run_ranks(2, _timing_ranks, n, args.repeat)
        ring, lat, mat = (max(r[k] for r in got) for k in ("ring", "latent", "latent matmul"))
        print(f"CPU, CP=2 headtail, tiny DeepSeek-V3 (16 heads x (48 + 32), latent 64 + 16, 2 layers), N={n}, "
              f"forward+backward median of {args.repeat}: ring {ring * 1e3:.0f} ms, latent (fused kernel) "
              f"{lat * 1e3:.0f} ms, latent (matmul + softmax) {mat * 1e3:.0f} ms (ring / latent {ring / lat:.2f}, "
              f"ring / latent matmul {ring / mat:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[8192, 32768, 131072])
    p.add_argument("--world", type=int, nargs="+", default=[4, 8])
    p.add_argument("--doc", type=int, nargs="+", default=[0], help="packed documents of this many tokens (0: one)")
    p.add_argument("--layout", default="headtail")
    p.add_argument("--time", action="store_true", help="the CPU timing of CP=2 ring vs latent instead")
    p.add_argument("--time-n", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--turn", type=int, nargs="+", help="C T pairs: generate() turns' bytes instead")
    args = p.parse_args()
    _timing(args) if args.time else _turns(args) if args.turn else _bytes(args)


if __name__ == "__main__":
    main()
