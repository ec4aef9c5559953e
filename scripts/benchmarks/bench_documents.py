"""The document layout against striped on packed log-normal documents, side by side in one run:

  * K/V rows on the wire and balance of kept causal pairs per placement (the planner's figures,
    cp_dtensor/tools/plan_documents.py: what ``cp-dtensor plan --doc-lengths`` prints);
  * forward + backward wall and CPU time of ``ring_attention``, documents vs striped on the same batch, P = 2
    and 4 gloo ranks (forked, one thread each; the slowest rank's median), with the bytes each rank sent;
  * the plan's host cost at P = 8 and 32 with 64 documents: plan_row (torch-free), document_layout and one
    rank's exchange_plan (core/exchange/doc_exchange.py);
  * a plot of bytes and balance against the mean document length (--plot).

    python scripts/benchmarks/bench_documents.py                   # all of it, a few minutes on 2 cores
    python scripts/benchmarks/bench_documents.py --skip-time       # the torch-free figures and host cost only
    python scripts/benchmarks/bench_documents.py --doc-lengths lengths.txt --world 4   # one batch from a file
                                                                   # (or a distribution: lognormal:median=1000)
Writes bench_out/documents.json; docs/documents.md has the figures and the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cp_dtensor.core.plan.documents import plan_row, row_balance  # noqa: E402
from cp_dtensor.tools.plan import PlanInput, compare_placements, doc_rows, lognormal_lengths, parse_doc_lengths  # noqa: E402


def placements(lengths: list[int], world: int, windows=None) -> dict:
    """The planner's figures of one row (head dim etc. do not matter for rows and balance)."""
    inp = PlanInput(seq_len=sum(lengths), cp=world, head_dim=64, q_heads=1, kv_heads=1)
    return {x.placement: x for x in compare_placements(inp, [lengths], windows=windows)}


def report(lengths: list[int], world: int) -> str:
    got = placements(lengths, world)
    return (f"docs {len(lengths):4d}  on the wire / striped ring: documents {got['documents'].vs_ring:.3f}  "
            f"(rows the masks need under striped {got['striped'].needed_rows_mean / got['striped'].ring_rows:.3f})"
            "  balance: " + "  ".join(f"{n} {x.balance:.3f}" for n, x in got.items()))


def rows_and_balance(seeds: int) -> dict:
    out = {"rows": [], "balance": []}
    print("rows: P = 4, S_local = 2048, no document longer than S_local; balance: P = 4 and 8, N/P = 8192")
    for median in (64, 256, 1000):
        for seed in range(seeds):
            lengths = lognormal_lengths(seed, 4 * 2048, median, cap=2048)
            got = placements(lengths, 4)
            out["rows"].append(dict(median=median, seed=seed, docs=len(lengths),
                                    **{n: dict(vs_ring=x.vs_ring, balance=x.balance) for n, x in got.items()}))
            print(f"median {median:5d} seed {seed}  " + report(lengths, 4))
    for world in (4, 8):
        for wins in (None, [None, 4096]):
            worst = max(row_balance(plan_row(ls, world, windows=wins), ls, windows=wins)
                        for ls in (lognormal_lengths(seed, world * 8192, 1000) for seed in range(seeds)))
            out["balance"].append(dict(world=world, windows=wins, worst=worst))
            print(f"balance P = {world} windows {wins}: worst of {seeds} seeds {worst:.3f}")
    return out


def host_cost(worlds=(8, 32), docs: int = 64, s_local: int = 8192) -> list[dict]:
    """The plan's host cost per batch: plan_row alone, document_layout (ids -> the plan, torch), and one
    rank's exchange_plan (what each rank derives once per batch and mask; every layer reuses it)."""
    import torch

    import cp_dtensor
    from cp_dtensor.core.exchange.doc_exchange import exchange_plan

    out = []
    for world in worlds:
        n = world * s_local
        lengths = [n // docs] * docs
        ids = torch.repeat_interleave(torch.arange(docs), torch.tensor(lengths))[None]
        t0 = time.perf_counter()
        plan_row(lengths, world)
        t1 = time.perf_counter()
        lay = cp_dtensor.document_layout(ids, world)
        t2 = time.perf_counter()
        exchange_plan(lay, 0, True, None)
        t3 = time.perf_counter()
        rec = dict(world=world, docs=docs, n=n, plan_row_ms=1e3 * (t1 - t0), document_layout_ms=1e3 * (t2 - t1),
                   exchange_plan_ms=1e3 * (t3 - t2))
        out.append(rec)
        print(f"plan host cost P = {world:2d}, {docs} documents, N = {n}: plan_row {rec['plan_row_ms']:.1f} ms, "
              f"document_layout {rec['document_layout_ms']:.1f} ms, exchange_plan (one rank) "
              f"{rec['exchange_plan_ms']:.1f} ms")
    return out


def _time_rank(rank, world, s_local, heads, head_dim, median, iters, seed):
    """Every rank: the same batch; documents vs striped (the ring with the batch's ids), fwd+bwd timed."""
    import torch

    import cp_dtensor
    from cp_dtensor.core.plan.documents import plan_batch
    from cp_dtensor.tools.debug import CommBytes

    n = world * s_local
    lengths = lognormal_lengths(seed, n, median, cap=s_local)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, heads, n, head_dim, generator=g) for _ in range(4))
    res = {}
    for name in ("documents", "striped"):
        lay = plan_batch(name, world, document_ids=ids)  # striped: the ring masks by the plan's ids

        def shard(x):
            return cp_dtensor.shard_tensor(x, seq_dim=2, layout=lay, rank=rank, cp_size=world)

        ql, kl, vl, dl = (shard(x) for x in (q, k, v, do))
        walls, cpus = [], []
        with CommBytes() as cb:  # the warm-up, counting the bytes this rank sends (fwd + bwd)
            cp_dtensor.ring_attention(*(x.detach().requires_grad_() for x in (ql, kl, vl)), layout=lay,
                                      is_causal=True).backward(dl)
        for _ in range(iters):
            a, b, c = (x.detach().requires_grad_() for x in (ql, kl, vl))
            torch.distributed.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            cp_dtensor.ring_attention(a, b, c, layout=lay, is_causal=True).backward(dl)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        res[name] = dict(wall=walls, cpu=cpus, sent=cb.sent)
    return res


def timing(worlds, s_locals, heads, head_dim, median, iters, seed) -> list[dict]:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _bench_dist import run_ranks

    torch.set_num_threads(1)
    out = []
    print(f"fwd+bwd, causal, fp32, B 1, H {heads}, D {head_dim}, log-normal documents median {median} (capped at "
          f"S_local), seed {seed}; median of {iters} after a warm-up, the slowest rank; CPU = process time")
    for world in worlds:
        for s in s_locals:
            per_rank = run_ranks(world, _time_rank, s, heads, head_dim, median, iters, seed)
            rec = dict(world=world, s_local=s)
            for name in ("documents", "striped"):
                wall = statistics.median(max(r[name]["wall"][i] for r in per_rank) for i in range(iters))
                cpu = statistics.median(max(r[name]["cpu"][i] for r in per_rank) for i in range(iters))
                rec[name] = dict(wall_s=wall, cpu_s=cpu, sent_max=max(r[name]["sent"] for r in per_rank))
            d, st = rec["documents"], rec["striped"]
            rec["ratio"] = dict(wall=d["wall_s"] / st["wall_s"], cpu=d["cpu_s"] / st["cpu_s"],
                                bytes=d["sent_max"] / st["sent_max"])
            out.append(rec)
            print(f"P = {world} S_local {s:5d}: documents wall {d['wall_s']:.3f} s cpu {d['cpu_s']:.3f} s, "
                  f"striped wall {st['wall_s']:.3f} s cpu {st['cpu_s']:.3f} s -> documents / striped wall "
                  f"{rec['ratio']['wall']:.2f} cpu {rec['ratio']['cpu']:.2f}, bytes sent (fwd+bwd, busiest rank) "
                  f"{rec['ratio']['bytes']:.3f}")
    return out


def sweep(seeds: int, world: int = 4, bytes_s: int = 2048, balance_s: int = 8192) -> list[dict]:
    """Bytes (S_local = ``bytes_s``) and balance (N/P = ``balance_s``) against the mean document length, P = 4,
    documents capped at S_local; the mean over seeds of the bytes, the worst seed's balance."""
    out = []
    for median in (16, 32, 64, 128, 256, 512, 1000, 2000):
        small = [lognormal_lengths(seed, world * bytes_s, median, cap=bytes_s) for seed in range(seeds)]
        big = [lognormal_lengths(seed, world * balance_s, median, cap=balance_s) for seed in range(seeds)]
        by, ba = [placements(ls, world) for ls in small], [placements(ls, world) for ls in big]
        out.append(dict(median=median, mean_len=statistics.mean(world * bytes_s / len(ls) for ls in small),
                        mean_len_balance=statistics.mean(world * balance_s / len(ls) for ls in big),
                        **{n: dict(vs_ring=statistics.mean(r[n].vs_ring for r in by),
                                   needed=statistics.mean(r[n].needed_rows_mean / r[n].ring_rows for r in by),
                                   balance=max(r[n].balance for r in ba)) for n in by[0]}))
        print(f"sweep median {median:5d}: mean length {out[-1]['mean_len']:7.1f}  on the wire / striped ring: "
              f"documents {out[-1]['documents']['vs_ring']:.3f}  balance (N/P {balance_s}, worst seed): "
              + "  ".join(f"{n} {out[-1][n]['balance']:.3f}" for n in by[0]))
    return out


def plot(points: list[dict], path: str, world: int = 4, s_local: int = 2048, balance_s: int = 8192) -> None:
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "bench_documents"  # the same figures write the same file
    import matplotlib.pyplot as plt

    xs, xb = [p["mean_len"] for p in points], [p["mean_len_balance"] for p in points]
    colors = {"striped": "tab:blue", "headtail": "tab:green", "contiguous": "tab:red", "documents": "tab:purple"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [p["striped"]["vs_ring"] for p in points], "o-", color=colors["striped"], label="striped ring (every layout's ring)")
    a.plot(xs, [p["documents"]["vs_ring"] for p in points], "o-", color=colors["documents"], label="documents (all-to-all-v)")
    a.plot(xs, [p["striped"]["needed"] for p in points], ":", color=colors["striped"], label="rows the masks need, striped")
    a.set(xscale="log", xlabel="mean document length (tokens)", ylabel="K/V rows on the wire / striped ring's",
          ylim=(0, 1.1), title=f"forward K/V bytes, P = {world}, S_local = {s_local}")
    for name, c in colors.items():
        b.plot(xb, [p[name]["balance"] for p in points], "o-", color=c, label=name)
    b.set(xscale="log", xlabel="mean document length (tokens)", ylabel="max / mean kept causal pairs",
          title=f"balance over ranks, P = {world}, N/P = {balance_s} (worst seed)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-lengths", help="one batch: a file of lengths or a distribution (cp-dtensor plan's syntax)")
    ap.add_argument("--world", type=int, default=4, help="with --doc-lengths: the CP degree")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--skip-time", action="store_true", help="no fwd+bwd timing (torch-free figures, host cost)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--s-locals", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--median", type=float, default=128, help="timed batch: the documents' median length")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--plot", default="docs/img/documents.svg", help="'' for none")
    ap.add_argument("--out", default="bench_out/documents.json")
    args = ap.parse_args()
    if args.doc_lengths:
        src = parse_doc_lengths(args.doc_lengths)
        lengths = src if isinstance(src, list) else doc_rows(src, args.world * 8192, 1)[0]
        print(report(lengths, args.world))  # a file: its lengths are one row (their sum divisible by --world)
        return
    res = dict(config=vars(args), **rows_and_balance(args.seeds), host=host_cost())
    if not args.skip_time:
        res["timing"] = timing(args.worlds, args.s_locals, args.heads, args.head_dim, args.median, args.iters, 0)
    res["sweep"] = sweep(args.seeds)
    if args.plot:
        plot(res["sweep"], args.plot)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
