"""Bytes per layer of DeepSeek Sparse Attention under CP (cp_dtensor/hf/sparse.py) against the ring's K/V bytes
and against the selected latent rows a rank does not hold, counted from the exchange plan (no model runs).

DeepSeek-V3.2's attention sizes (bf16): a latent row is kv_lora_rank 512 + rope 64 = 1152 bytes, an index
key 128 numbers = 256 bytes, the ring's expanded K/V 128 heads x (192 + 128) = 81920 bytes a token. Each
rank's queries select ``index_topk`` keys of their causal prefix at random -- every prefix key equally
likely, the worst case for how many distinct rows a rank needs (a trained indexer's picks cluster,
so fewer rows move, and the index keys' share grows). For each rank (simulated in one process, every rank's
plan being a function of the selection only): the bytes it receives in one forward --

* ``index keys``: the keys of the other ranks' tokens one of its queries can see (causal, in its document:
  ``--doc L`` packs documents of L tokens), which the all_to_all sends it (``all-gathered keys``: every
  key, what an all-gather would bring);
* ``requests``: the row numbers other ranks ask of it (8 bytes a row) and the counts (8 P);
* ``rows``: the selected latent rows it does not hold (what it must receive in any exact scheme);
* ``ring``: the ring's K/V through it ((P - 1) S_local x 81920).

Backward sends the received rows' gradients back (the rows' bytes again); the ring's backward passes K/V and
dK/dV (twice its forward): ``fwd+bwd`` counts the rows twice, the keys and requests once. The rank that
receives the most is reported.

    python scripts/benchmarks/bench_dsa.py --n 8192 16384 32768 --world 4 [--doc 0 3000] [--device cuda]

``--turn C T [C T ...]``: a generate() turn of T new tokens on a cache of C (Note [Sharded DSA turns] in
cp_dtensor/hf/sparse_turn.py), batch 1, ``--topk`` picks a query (DeepSeek-V3.2's 2048), uniform over its
prefix: what a rank receives a layer in pass-Q ((P - 1) T x 128 heads x (128 + 1) x 4 of [out | lse], and the
index scores or keys), in a sharded turn (the cached and new index keys it sees, the rows' numbers, the
selected latent rows it does not hold: measured on the simulated picks, the busiest rank), the rule's bound
on the sharded turn, and the selected rows alone.

    python scripts/benchmarks/bench_dsa.py --turn 32768 4096 131072 4096 131072 512 --world 4

``--memory T K H``: one DSA layer's attention over the picks (step 3, from the expanded table to the output;
Note [DSA attention in query chunks] in cp_dtensor/hf/sparse_attend.py) for T queries of batch 1, K picks a
query, H heads (Dqk 192, Dv 128 as DeepSeek-V3.2, bf16, a table of U = 2T rows, picks uniform in the table,
a tenth of them masked): the bytes autograd keeps for backward (unique storages, counted by a
saved-tensors hook), the resident peak of forward + backward (``_bench_mem``) and the time -- the plain
gather of every query's picks at once (what it replaced) against the chunked Function; then the formula at
DeepSeek-V3.2's sizes.

    python scripts/benchmarks/bench_dsa.py --memory 1024 256 16

``--indexer S N H``: the family's indexer (transformers' DeepseekV32Indexer, ``H`` index heads of 128, fp32) for
S queries at the end of N keys: the resident peak of the one call against query tiles of at most ``_INDEX_SCORES``
scores (Note [The DSA indexer in query tiles] in cp_dtensor/hf/sparse_rows.py), and that the picks are the
same.

    python scripts/benchmarks/bench_dsa.py --indexer 512 8192 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cp_dtensor.core.plan.layout import global_order  # noqa: E402
from cp_dtensor.hf.sparse import exchange_plan, seen_keys  # noqa: E402
from cp_dtensor.hf.sparse_attend import _GATHERED, attend_picks  # noqa: E402
from cp_dtensor.hf.sparse_turn import dsa_turn_plan  # noqa: E402

LATENT, INDEX_KEY, RING_KV, ROW_ID = (512 + 64) * 2, 128 * 2, 128 * (192 + 128) * 2, 8


def rows_needed(n: int, world: int, rank: int, topk: int, layout: str, chunk: int, device: str, seed: int,
                doc: int = 0) -> int:
    """How many selected latent rows rank ``rank`` does not hold, each query picking at random in its prefix (of
    its document: packed documents of ``doc`` tokens, 0 for one sequence a row)."""
    g = torch.Generator(device=device).manual_seed(seed + rank)
    order = global_order(layout, world, n).to(device)
    s = n // world
    mine = order[rank * s:(rank + 1) * s]
    need = []
    for lo in range(0, s, chunk):
        q = mine[lo:lo + chunk]
        start = (q // doc) * doc if doc else torch.zeros_like(q)  # the first key the query can see
        # a query's picks: its whole prefix when it has at most index_topk keys, else index_topk draws uniform over
        # the prefix (with replacement: within a few rows of topk's subsets, at O(N k) instead of O(N^2) work)
        drawn = start[:, None] + (torch.rand(q.numel(), topk, generator=g, device=device)
                                  * (q - start + 1)[:, None]).long()
        short = (q - start)[:, None] < topk
        picks = torch.where(short, start[:, None] + torch.arange(topk, device=device)[None, :], drawn)
        valid = picks <= q[:, None]
        picks = torch.where(valid, picks, q[:, None])  # the invalid ones in range (they are masked)
        rows, _ = exchange_plan(picks[None], valid[None], order, rank, world)
        need.append(rows)
    return int(torch.cat(need).unique().numel())


def keys_needed(n: int, world: int, rank: int, layout: str, doc: int = 0) -> int:
    """The index keys rank ``rank`` must receive in any exact scheme where it scores its own queries: those of the
    tokens held elsewhere that one of its queries can see (causal, in its document). A key no query of the rank
    sees is masked in every row (-inf, whatever its value), so a scheme could send only these."""
    order = global_order(layout, world, n)
    s = n // world
    mine = order[rank * s:(rank + 1) * s]
    docs = torch.arange(n) // doc if doc else torch.zeros(n, dtype=torch.long)
    last = torch.full((int(docs.max()) + 1,), -1, dtype=torch.long).scatter_reduce(0, docs[mine], mine, "amax")
    seen = torch.arange(n) <= last[docs]  # [N]: some query of this rank sees the key
    seen[mine] = False  # held here
    return int(seen.sum())


def turn_bytes(c: int, t: int, world: int, topk: int, layout: str, chunk: int, device: str, seed: int) -> dict:
    """Bytes the busiest rank receives a layer in a T-token turn on a C-token cache (batch 1, bf16): pass-Q, a
    sharded turn (simulated picks), its bound, the selected rows not held. The cache holds the prefill's layout."""
    from cp_dtensor.core.plan.layout import layout_unit

    u = layout_unit(layout, world)
    pad = -t % u
    cached = global_order(layout, world, c).view(world, -1)  # [P, C / P]: the prefill's shares
    new = global_order(layout, world, t + pad).view(world, -1).to(torch.long) - pad + c  # [P, T_local]
    spare = c + t + torch.arange(world * (t + pad) // world)  # the layout's pad slots: never a key
    new = torch.where(new < c, spare.view(world, -1)[:, :new.shape[1]], new)
    order = torch.cat([cached, new], 1).reshape(-1).to(device)  # [N'] rank-major, as sparse_turn's _layout
    real_new = torch.arange(t + pad) >= pad
    seen = seen_keys(global_order(layout, world, t + pad), world, 1, ("real", real_new[None]))  # [P, 1, pad + T]
    need, asked = [], torch.zeros(world, dtype=torch.long)  # rows each rank asks for; row numbers asked of each
    for rank in range(world):
        g = torch.Generator(device=device).manual_seed(seed + rank)
        q = new[rank][new[rank] < c + t].to(device)  # this rank's real new columns
        got = []
        for lo in range(0, q.numel(), chunk):
            qq = q[lo:lo + chunk]
            drawn = (torch.rand(qq.numel(), topk, generator=g, device=device) * (qq + 1)[:, None]).long()
            got.append(exchange_plan(drawn[None], torch.ones_like(drawn, dtype=torch.bool)[None], order, rank,
                                     world)[0])
        rows = torch.cat(got).unique()
        owners = torch.empty_like(order).scatter_(0, order, torch.arange(world, device=device).repeat_interleave(
            order.numel() // world))[rows]
        need.append(rows.numel())
        asked += torch.bincount(owners, minlength=world).cpu()
    out = {"rows": 0, "sharded": 0}
    for rank in range(world):
        mine = global_order(layout, world, t + pad).view(world, -1)[rank]
        keys = (world - 1) * cached.shape[1] + int(seen[rank, 0].sum()) - int((mine >= pad).sum())  # others' keys
        sharded = need[rank] * LATENT + int(asked[rank]) * ROW_ID + keys * INDEX_KEY + 8 * world
        if sharded > out["sharded"]:
            out.update(rows=need[rank] * LATENT, sharded=sharded, keys=keys * INDEX_KEY)
    plan = dsa_turn_plan(new=t, cached=c, cp=world, batch=1, heads=128, value_dim=128, latent_dim=576, index_dim=128,
                         index_topk=topk, esize=2, unit=u)
    out.update(pass_q=plan.pass_q, bound=plan.sharded, mode=plan.mode)
    return out


def _turns(args) -> None:
    print("| C | T | P | index_topk | pass-Q MB | sharded MB (bound) | selected rows MB | index keys MB | "
          "pass-Q / sharded | sharded / rows | rule picks | s |")
    print("|" + "---|" * 12)
    pairs = list(zip(args.turn[::2], args.turn[1::2]))
    for world in args.world:
        for c, t in pairs:
            t0 = time.perf_counter()
            b = turn_bytes(c, t, world, args.topk, args.layout, args.chunk, args.device, args.seed)
            mb = 1 / 2**20
            print(f"| {c} | {t} | {world} | {args.topk} | {b['pass_q'] * mb:.1f} | {b['sharded'] * mb:.1f} "
                  f"({b['bound'] * mb:.1f}) | {b['rows'] * mb:.1f} | {b['keys'] * mb:.1f} | "
                  f"{b['pass_q'] / b['sharded']:.1f} | {b['sharded'] / b['rows']:.3f} | {b['mode']} | "
                  f"{time.perf_counter() - t0:.1f} |", flush=True)


def _plain_picks(query, keys, values, slot, valid, scaling):
    """Step 3 as the plain gather of every query's picks at once (what the chunked Function replaced)."""
    keys, values = keys[:, slot], values[:, slot]  # [H, B, T, K, D]
    scores = torch.einsum("bhsd,hbskd->bhsk", query, keys) * scaling
    blind = ~valid.any(-1)[:, None, :, None]
    scores = scores.masked_fill(~valid[:, None], float("-inf")).masked_fill(blind, 0.0)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).masked_fill(blind, 0.0).to(query.dtype)
    return torch.einsum("bhsk,hbskd->bshd", probs, values)


def _saved_and_peak(fn, inputs, grad) -> tuple[int, int, float]:
    """(bytes autograd keeps for backward -- unique storages --, resident peak of forward + backward, seconds)."""
    from _bench_mem import peak_since, reset_peak

    kept = {}

    def pack(x):
        kept[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    q, k, v = (x.detach().requires_grad_() for x in inputs[:3])
    t0, base = time.perf_counter(), reset_peak()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(q, k, v, *inputs[3:])
    out.backward(grad)
    return sum(kept.values()), peak_since(base), time.perf_counter() - t0


def _memory(t: int, k: int, heads: int) -> None:
    from _bench_mem import _libc_live_memory

    _libc_live_memory()
    torch.manual_seed(0)
    dqk, dv, u, dt = 192, 128, 2 * t, torch.bfloat16
    query = torch.randn(1, heads, t, dqk, dtype=dt)
    keys, values = torch.randn(heads, u, dqk, dtype=dt), torch.randn(heads, u, dv, dtype=dt)
    slot = torch.randint(0, u, (1, t, k))
    valid = torch.rand(1, t, k) > 0.1
    grad = torch.randn(1, t, heads, dv, dtype=dt)
    inputs = (query, keys, values, slot, valid, dqk ** -0.5)
    plain = _saved_and_peak(_plain_picks, inputs, grad)
    chunked = _saved_and_peak(attend_picks, inputs, grad)
    mb = 1 / 2**20
    print(f"T = {t} queries, K = {k} picks, H = {heads}, Dqk {dqk}, Dv {dv}, bf16, U = {u} table rows; chunk bound "
          f"_GATHERED = 2**{_GATHERED.bit_length() - 1} key numbers")
    print("| step 3 | saved for backward MB | fwd+bwd resident peak MB | s |")
    print("|---|---|---|---|")
    for name, (kept, peak, sec) in (("plain gather (before)", plain), ("chunked Function (after)", chunked)):
        print(f"| {name} | {kept * mb:.1f} | {peak * mb:.1f} | {sec:.2f} |")
    print(f"saved: before / after = {plain[0] / chunked[0]:.1f}x; peak: {plain[1] / chunked[1]:.1f}x")
    # the formula (bytes, e = 2 bf16): before keeps the gathered keys and values, the probabilities (fp32, bf16), the
    # masks; after keeps the query, the table, slot and valid, the fp32 lse
    t, k, heads, u, e = 4096, 2048, 128, 4096 + 12288, 2  # DeepSeek-V3.2, a rank's 4096 queries, 12k received rows
    before = heads * t * k * (dqk + dv) * e + heads * t * k * (4 + e) + t * k + heads * t * dqk * e
    after = heads * t * dqk * e + heads * u * (dqk + dv) * e + t * k * 9 + heads * t * 4
    print(f"DeepSeek-V3.2 (H {heads}, K {k}, T {t} queries of a rank, U {u} table rows, bf16): before about "
          f"{before / 2**30:.0f} GiB, after {after / 2**30:.2f} GiB ({before / after:.0f}x)")


def _indexer(s: int, n: int, heads: int) -> None:
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Config, DeepseekV32Indexer

    from cp_dtensor.hf import sparse_rows
    from _bench_mem import _libc_live_memory, peak_since, reset_peak

    _libc_live_memory()
    torch.manual_seed(0)
    cfg = DeepseekV32Config(hidden_size=256, q_lora_rank=128, index_n_heads=heads, index_head_dim=128,
                            qk_rope_head_dim=64, index_topk=n // 16)
    indexer = DeepseekV32Indexer(cfg, 0)
    hidden, q_resid = torch.randn(1, s, 256), torch.randn(1, s, 128)
    angle = torch.arange(n - s, n)[None, :, None] * 1e-3 * torch.arange(1, 65)
    keys = torch.randn(1, n, 128)
    mask = torch.arange(n)[None, None, :] <= torch.arange(n - s, n)[None, :, None]  # causal: the last S queries

    class Keys:  # the exchanged keys of every column
        def update_indexer(self, k, layer_idx):
            return keys

    args = (hidden, q_resid, (angle.cos(), angle.sin()), mask, torch.arange(n - s, n)[None])
    runs = {}
    for name, fn in (("one call (before)", lambda: indexer(*args, cache=Keys())),
                     ("query tiles (after)", lambda: sparse_rows.index_tiles(indexer, *args, Keys()))):
        t0, base = time.perf_counter(), reset_peak()
        picks = fn()
        runs[name] = (picks, peak_since(base), time.perf_counter() - t0)
    (a, pa, ta), (b, pb, tb) = runs.values()
    tile = max(1, sparse_rows._INDEX_SCORES // (heads * n))
    print(f"S = {s} queries, N = {n} keys, {heads} index heads, index_topk {n // 16}; _INDEX_SCORES = "
          f"2**{sparse_rows._INDEX_SCORES.bit_length() - 1} scores: tiles of {tile} queries")
    print("| indexer | resident peak MB | s |\n|---|---|---|")
    for name, (_, peak, sec) in runs.items():
        print(f"| {name} | {peak / 2**20:.1f} | {sec:.2f} |")
    print(f"peak: before / after = {pa / pb:.1f}x; picks identical: {torch.equal(a, b)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--world", type=int, nargs="+", default=[4])
    parser.add_argument("--layout", default="headtail")
    parser.add_argument("--chunk", type=int, default=2048, help="queries scored at a time")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--doc", type=int, nargs="+", default=[0], help="packed documents of this many tokens (0: one "
                        "sequence a row)")
    parser.add_argument("--turn", type=int, nargs="+", default=None, help="C T pairs: a T-token turn on a C-token "
                        "cache (Note [Sharded DSA turns])")
    parser.add_argument("--topk", type=int, default=2048, help="index_topk of --turn (DeepSeek-V3.2's)")
    parser.add_argument("--memory", type=int, nargs=3, default=None, metavar=("T", "K", "H"),
                        help="saved-activation bytes of step 3, the plain gather against the chunked Function")
    parser.add_argument("--indexer", type=int, nargs=3, default=None, metavar=("S", "N", "H"),
                        help="resident peak of the family's indexer, one call against query tiles")
    args = parser.parse_args()
    if args.indexer:
        return _indexer(*args.indexer)
    if args.memory:
        return _memory(*args.memory)
    if args.turn:
        return _turns(args)
    print("| N | P | doc | index_topk | rows not held (max rank) | rows MB | index keys MB | requests MB | ours MB | "
          "ours / rows | fwd+bwd ours / rows | all-gathered keys: ours / rows | ours / ring | ring MB | s |")
    print("|" + "---|" * 15)
    for world in args.world:
        for n in args.n:
            for doc in args.doc:
                t0 = time.perf_counter()
                s, topk = n // world, n // 16
                need = [rows_needed(n, world, r, topk, args.layout, args.chunk, args.device, args.seed, doc)
                        for r in range(world)]
                worst = max(range(world), key=lambda r: need[r])
                # what the worst rank receives: the rows, the others' requests of it (a rank answers every other's:
                # in total the others need sum(need) - need[worst] rows, spread over the ranks: their mean), the
                # index keys its queries can see; backward: the rows' gradients go back (the rows' bytes again), no
                # index key moves
                rows = need[worst] * LATENT
                requests = (sum(need) - need[worst]) / (world - 1) * ROW_ID + 8 * world
                index = keys_needed(n, world, worst, args.layout, doc) * INDEX_KEY
                gathered = (world - 1) * s * INDEX_KEY  # an all-gather of every key
                ours = rows + requests + index
                ring = (world - 1) * s * RING_KV
                mb = 1 / 2**20
                per = lambda x, y: f"{x / y:.3f}" if y else "inf"  # noqa: E731
                print(f"| {n} | {world} | {doc or n} | {topk} | {need[worst]} of {(world - 1) * s} | {rows * mb:.2f} | "
                      f"{index * mb:.2f} | {requests * mb:.3f} | {ours * mb:.2f} | {per(ours, rows)} | "
                      f"{per(ours + rows, 2 * rows)} | {per(rows + requests + gathered, rows)} | {ours / ring:.4f} | "
                      f"{ring * mb:.1f} | {time.perf_counter() - t0:.1f} |", flush=True)

if __name__ == "__main__":
    main()
