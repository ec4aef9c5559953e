"""A second turn of a conversation under CP on CPU ranks: T new tokens after C cached ones, continuing the
sequence-sharded cache (pass-Q or pass-KV by the bytes rule: Note [Continuing a sharded cache] in
cp_dtensor/hf/turns.py), CP=2 vs CP=1.

    .venv/bin/python scripts/benchmarks/bench_turns.py                        # C = 1k, 4k, 16k; T = 32, 2048
    .venv/bin/python scripts/benchmarks/bench_turns.py --cached 512 2048 --new 8 64

The Llama shape of bench_decode.py (2 layers, hidden 512, 8 query / 2 KV heads, head 64, fp32, random
weights). For each C: turn 1 prefills a C-token prompt (generate, one token), then turn 2 feeds that token
and T - 1 more (generate with the cache, one token: exactly the turn's forward). Measured per rank: the
turn's wall and CPU time, the bytes it sends (``CommBytes``), and, for comparison, re-prefilling the whole
conversation of C + T tokens without the cache. ``cp1`` is the plain model continuing transformers'
DynamicCache in one process; ``cp2`` is ``apply_context_parallel`` on 2 ranks (striped). The planner's
choice (``turn_plan``: pass-Q or pass-KV by bytes) is printed next to what ran (``cache.runs``). The same script runs on
CUDA ranks unchanged but for the gloo backend. Writes bench_out/turns.json.
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
from bench_decode import SHAPE, build_model  # noqa: E402

from _bench_dist import run_ranks  # noqa: E402


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, SHAPE["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


def _gen(model, ids, **kw):
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0, eos_token_id=None,
                              return_dict_in_generate=True, output_logits=True, **kw)


def _turn(model, cached: int, new: int, world: int) -> dict:
    from cp_dtensor.tools.debug import CommBytes

    first = _gen(model, _ids(cached, cached))  # the cache holds the C prompt tokens
    convo = torch.cat([first.sequences, _ids(new - 1, cached + 1)], 1)  # C + T columns
    meter = CommBytes()
    t0, c0 = time.perf_counter(), time.process_time()
    with meter:
        out = _gen(model, convo, cache=first.cache)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    again = _gen(model, convo)  # the whole conversation again, no cache
    redo = time.perf_counter() - t0
    return dict(turn_s=wall, turn_cpu_s=cpu, sent=meter.sent, redo_s=redo, token=int(out.sequences[0, -1]),
                ran=sorted({"decode": "pass-q"}.get(k, k) for k in out.cache.runs if k != "prefill") if world > 1 else [],
                logits=out.logits[0][0].tolist(), redo_equal=bool(torch.equal(again.sequences, out.sequences)))


def rank_main(rank: int, world: int, cached: list[int], new: list[int]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    model = build_model(init_device_mesh("cpu", (world,)) if world > 1 else None, max_len=max(cached) + max(new) + 8)
    _turn(model, 32, 4, world)  # warm-up
    out = {}
    for c in cached:
        for t in new:
            r = _turn(model, c, t, world)
            out[f"{c},{t}"] = r
            if rank == 0:
                print(f"  P={world} C={c} T={t}: turn {1e3 * r['turn_s']:.0f} ms, sent {r['sent']} B, re-prefill "
                      f"{1e3 * r['redo_s']:.0f} ms", flush=True)
    return out


def main() -> None:
    from cp_dtensor.core.plan.layout import layout_unit
    from cp_dtensor.hf.turns import turn_plan

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cached", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--new", type=int, nargs="+", default=[32, 2048])
    parser.add_argument("--out", default="bench_out/turns.json")
    args = parser.parse_args()
    runs = {}
    for world in (1, 2):
        print(f"CP={world} ...", flush=True)
        runs[world] = run_ranks(world, rank_main, args.cached, args.new)
    layers, hq, hkv, d = (SHAPE[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                             "head_dim"))
    print(f"\nload average {os.getloadavg()}")
    print("| C | T | turn ms cp1 / cp2 | cp2÷cp1 | re-prefill ms cp2 | bytes/rank/layer cp2 | pass-Q formula | "
          "pass-KV formula | planner picks | ran | token equal | max logit diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for c in args.cached:
        for t in args.new:
            key = f"{c},{t}"
            one, two = runs[1][0][key], [r[key] for r in runs[2]]
            plan = turn_plan(new=t, cached=c, cp=2, batch=1, q_heads=hq, kv_heads=hkv, head_dim=d, kv_bytes=4,
                             unit=layout_unit("striped", 2))
            turn2 = max(r["turn_s"] for r in two)
            diff = max(abs(a - b) for a, b in zip(one["logits"], two[0]["logits"]))
            row = dict(turn_cp1_s=one["turn_s"], turn_cp2_s=turn2, ratio=turn2 / one["turn_s"],
                       redo_cp2_s=max(r["redo_s"] for r in two), sent_per_layer=two[0]["sent"] / layers,
                       pass_q=plan.pass_q, pass_kv=plan.pass_kv, mode=plan.mode, ran=two[0]["ran"],
                       token_equal=all(r["token"] == one["token"] for r in two), max_logit_diff=diff)
            rows[key] = row
            print(f"| {c} | {t} | {1e3 * one['turn_s']:.0f} / {1e3 * turn2:.0f} | {row['ratio']:.2f} | "
                  f"{1e3 * row['redo_cp2_s']:.0f} | {row['sent_per_layer']:.0f} | {plan.pass_q} | {plan.pass_kv} | "
                  f"{plan.mode} | {'+'.join(row['ran'])} | {row['token_equal']} | {diff:.1e} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(shape=SHAPE, rows=rows, runs={str(k): v for k, v in runs.items()}), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
