"""Benchmark the ring on CPU ranks (one thread each): causal forward+backward, every layout, side by side.

    .venv/bin/python scripts/benchmarks/bench_ring.py --s-local 512 1024 2048 4096 8192 --docs-img

One run measures, and writes to --out-dir (JSON + PNG plots; --docs-img copies the plots to docs/img/):
  * ring fwd+bwd time per layout and N/P on --world ranks (median over --iters of the slowest rank, after
    a warm-up), bytes each rank sent against the formula, and every rank's attention-kernel time per
    ring step (thread CPU time of each cp_dtensor.ops call, so oversubscribed ranks still count right);
  * P2 = max/mean rank work (from exact kept pairs, from standalone block times, and in the ring);
  * P3 = contiguous / striped time, next to its kernel ceiling (T_causal + T_full) / (T_causal + T_strict)
    of single S_local blocks timed in the same run (P = 2);
  * P4 = ideal / ring time, ideal = one process running full-sequence SDPA fwd+bwd on one thread, / P;
    also measured pairwise in one time window (--paired-s-local), next to the machine's parallel
    efficiency: one causal block alone vs the same block on every rank at once, timed in the same
    iterations -- the share of P cores' speed that P busy processes actually get here, which bounds P4;
  * the per-(rank, step) work heat map for --heat-worlds (blocks run standalone in this process);
  * P5 = longest N whose ring fwd+bwd fits --mem-cap-mib per rank, for --mem-worlds (see _bench_mem.py);
  * the planner's ring time (tools/plan.py, TFLOP/s calibrated on one causal block) against every measurement.
The machine may be shared: only numbers measured together in one run are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))
from tqdm import tqdm  # noqa: E402

import cp_dtensor  # noqa: E402
from cp_dtensor.core.compute.ops import block_attn, block_attn_backward  # noqa: E402
from cp_dtensor.core.exchange.comm import RingComm  # noqa: E402
from cp_dtensor.core.plan.layout import step_block  # noqa: E402
from cp_dtensor.tools.debug import CommBytes  # noqa: E402
from cp_dtensor.tools.plan import PlanInput, memory_bytes  # noqa: E402
import _bench_mem as mem  # noqa: E402
import _bench_report as report  # noqa: E402
import _bench_work as work  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402

KERNELS = ("cp_dtensor::block_attn", "cp_dtensor::block_attn_backward")


class KernelClock(TorchDispatchMode):
    """Every cp_dtensor block kernel call in call order: (name, thread CPU seconds, wall seconds)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name not in KERNELS:
            return func(*args, **(kwargs or {}))
        t0, w0 = time.thread_time(), time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.calls.append((name, time.thread_time() - t0, time.perf_counter() - w0))
        return out


def per_step(calls, layout: str, rank: int, world: int, s_local: int, *, wall=False) -> list[float]:
    """Kernel seconds per ring step (fwd + bwd; thread CPU time, or wall time with ``wall``) from one
    fwd+bwd's calls; steps without a block get 0."""
    steps = [t for t in range(world) if step_block(layout, rank=rank, src=(rank - t) % world, world=world,
                                                  s_local=s_local, is_causal=True) is not None]
    row = [0.0] * world
    for name in KERNELS:
        times = [w if wall else c for n, c, w in calls if n == name]
        per = len(times) // len(steps)  # the backward may run per group of heads (ring._head_chunks)
        if per * len(steps) != len(times):
            raise RuntimeError(f"{name}: {len(times)} calls for {len(steps)} causal ring steps on rank {rank}")
        for i, t in enumerate(steps):
            row[t] += sum(times[i * per:(i + 1) * per])
    return row


def _qkv(shape, s, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, d = shape["batch"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    return (torch.randn(b, h, s, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _profile(fwd_bwd) -> dict:
    """One fwd+bwd under torch.profiler: wall seconds per op name (self time), and the printed table."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fwd_bwd()
    wall = time.perf_counter() - t0
    avgs = prof.key_averages()
    ops = {e.key: e.self_cpu_time_total / 1e6 for e in avgs}
    return dict(wall_s=wall, self_s=ops, table=avgs.table(sort_by="self_cpu_time_total", row_limit=14))


def _ring_rank(rank, world, sizes, layouts, shape, dtype, iters, profile_layout=None):
    """Every rank: for each (S_local, layout) a warm-up, ``iters`` timed fwd+bwd, one counted for bytes."""
    rec = {}
    bar = tqdm(total=len(sizes) * len(layouts) * (iters + 2), desc=f"ring P={world}", disable=rank != 0)
    for s in sizes:
        q, k, v = _qkv(shape, s, dtype, seed=rank)
        for layout in layouts:
            ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))

            def fwd_bwd():
                out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
                out.backward(torch.ones_like(out))

            walls, cpus, kernels, kernel_walls = [], [], [], []
            for i in range(iters + 1):
                dist.barrier()
                clock = KernelClock()
                t0, c0 = time.perf_counter(), time.process_time()
                with clock:
                    fwd_bwd()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if i:  # the first one is the warm-up
                    walls.append(wall)
                    cpus.append(cpu)
                    kernels.append(per_step(clock.calls, layout, rank, world, s))
                    kernel_walls.append(sum(per_step(clock.calls, layout, rank, world, s, wall=True)))
                bar.update(1)
            with CommBytes() as fwd_sent:
                out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
            with CommBytes() as all_sent:
                out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
                out.backward(torch.ones_like(out))
            bar.update(1)
            if profile_layout == layout and s == max(sizes):
                rec["profile"] = _profile(fwd_bwd)
            rec[(s, layout)] = dict(
                wall=walls, cpu=cpus,
                kernel_steps=[statistics.median(col) for col in zip(*kernels)],
                kernel_wall=statistics.median(kernel_walls),
                bytes_fwd=fwd_sent.by_op["all_to_all_single"], bytes_fwd_bwd=all_sent.by_op["all_to_all_single"],
            )
    # The link, as the ring sees it: one rotation of the largest K/V block (median of 5).
    comm, s = RingComm(dist.group.WORLD), max(sizes)
    buf = torch.zeros(2 * shape["batch"] * shape["kv_heads"] * s * shape["head_dim"], dtype=dtype)
    times = []
    for _ in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        comm.wait(comm.rotate(buf))
        times.append(time.perf_counter() - t0)
    rec["link_gbps"] = buf.numel() * buf.element_size() / statistics.median(times[1:]) / 1e9
    bar.close()
    return rec


def _median_time(fn, iters):
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _block_fwd_bwd(q, k, v, causal, scale):
    out, lse = block_attn(q, k, v, causal, scale)
    block_attn_backward(torch.ones_like(out), q, k, v, out, lse, causal, scale)


def _sdpa_fwd_bwd(q, k, v):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(torch.ones_like(out))


def _ideal_rank(rank, world, n, shape, dtype, iters):
    """The ideal under the ring's conditions: every rank runs the full-sequence SDPA at the same time."""
    q, k, v = _qkv(shape, n, dtype, seed=0)
    dist.barrier()
    return _median_time(lambda: _sdpa_fwd_bwd(q, k, v), iters)


def _paired_rank(rank, world, sizes, layouts, shape, dtype, iters):
    """P3 and P4 in one time window: every iteration times the ring (all ranks, every layout), then the
    ideal (rank 0 alone, the others parked in a barrier), then the machine's own parallelism: one causal
    S_local block on every rank at once, then alone on rank 0, then P3's full and strictly causal blocks."""
    rec = {}
    scale = shape["head_dim"] ** -0.5
    bar = tqdm(total=len(sizes) * (iters + 1), desc=f"paired ring/ideal P={world}", disable=rank != 0)
    for s in sizes:
        q, k, v = _qkv(shape, s, dtype, seed=rank)
        ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
        full = tuple(_qkv(shape, s * world, dtype, seed=0)) if rank == 0 else None
        qs, ks, vs = q[:, :, 1:], k[:, :, :-1], v[:, :, :-1]  # the striped shift's strictly causal block
        r = dict(ring={lay: [] for lay in layouts}, ideal=[], together=[], alone=[], full=[], strict=[])
        for _ in range(iters + 1):  # the first is the warm-up
            for layout in layouts:
                dist.barrier()
                t0 = time.perf_counter()
                out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
                out.backward(torch.ones_like(out))
                r["ring"][layout].append(time.perf_counter() - t0)
            for key, fn, everyone in (
                ("ideal", lambda: _sdpa_fwd_bwd(*full), False),
                ("together", lambda: _block_fwd_bwd(q, k, v, True, scale), True),
                ("alone", lambda: _block_fwd_bwd(q, k, v, True, scale), False),  # T_causal
                ("full", lambda: _block_fwd_bwd(q, k, v, False, scale), False),
                ("strict", lambda: _block_fwd_bwd(qs, ks, vs, True, scale), False),
            ):
                dist.barrier()
                if everyone or rank == 0:
                    t0 = time.perf_counter()
                    fn()
                    r[key].append(time.perf_counter() - t0)
                dist.barrier()
            bar.update(1)
        rec[s] = r
    bar.close()
    return rec


def paired_sweep(args, shape, dtype, world, sizes, iters):
    """Per N/P: the median over iterations of ideal / ring measured back to back, and the machine's
    parallel efficiency (one block alone / the same block on every rank at once, slowest rank)."""
    recs = run_ranks(world, _paired_rank, sizes, args.layouts, shape, dtype, iters)
    rows = []
    for s in sizes:
        rr = [rec[s] for rec in recs]

        def slowest(times_per_rank):  # per iteration, the slowest rank; the warm-up dropped
            return [max(ts) for ts in zip(*times_per_rank)][1:]

        row = dict(world=world, s_local=s, n=s * world, iters=iters)
        ideal = rr[0]["ideal"][1:]
        rings = {lay: slowest(r["ring"][lay] for r in rr) for lay in args.layouts}
        for lay, ring in rings.items():
            row[f"ring_{lay}_s"] = statistics.median(ring)
            row[f"P4_{lay}"] = statistics.median(i / world / t for i, t in zip(ideal, ring))
            # best of N, as timeit reports: on a shared machine noise only ever adds time
            row[f"P4_best_{lay}"] = min(ideal) / world / min(ring)
        row["ideal_s"] = statistics.median(ideal) / world
        together = slowest(r["together"] for r in rr)
        tc, tf, ts = (rr[0][key][1:] for key in ("alone", "full", "strict"))
        row["parallel_efficiency"] = statistics.median(a / t for a, t in zip(tc, together))
        if "striped" in args.layouts and "contiguous" in args.layouts and world == 2:
            striped, contiguous = rings["striped"], rings["contiguous"]
            p3 = [c / s_ for c, s_ in zip(contiguous, striped)]
            ceiling = [(c + f) / (c + t) for c, f, t in zip(tc, tf, ts)]
            row.update(P3=statistics.median(p3), P3_ceiling=statistics.median(ceiling),
                       P3_of_ceiling=statistics.median(a / b for a, b in zip(p3, ceiling)))
            p3_best = min(contiguous) / min(striped)
            ceiling_best = (min(tc) + min(tf)) / (min(tc) + min(ts))
            row.update(P3_best=p3_best, P3_ceiling_best=ceiling_best, P3_of_ceiling_best=p3_best / ceiling_best)
        rows.append(row)
    return rows


def ring_sweep(args, shape, dtype, world, sizes, iters, *, singles=True, ideal=True, profile=False):
    """Ring runs on ``world`` ranks, then single blocks and the ideal run in this process, per S_local."""
    recs = run_ranks(world, _ring_rank, sizes, args.layouts, shape, dtype, iters, profile and args.profile)
    if profile and args.profile:
        for r, rec in enumerate(recs):
            path = os.path.join(args.out_dir, f"profile_{args.profile}_P{world}_rank{r}.txt")
            with open(path, "w") as f:
                f.write(f"{args.profile} N/P={max(sizes)} fwd+bwd, wall {rec['profile']['wall_s']:.3f} s\n")
                f.write(rec["profile"]["table"])
            print(f"profile of rank {r}: {path}")
    rows = []
    itemsize = dtype.itemsize
    for s in tqdm(sizes, desc=f"single blocks P={world}"):
        row = {"world": world, "s_local": s, "n": s * world}
        formula = (world - 1) * 2 * shape["batch"] * s * shape["head_dim"] * shape["kv_heads"] * itemsize
        row["formula_bytes_fwd"] = formula
        for layout in args.layouts:
            rr = [r[(s, layout)] for r in recs]
            # a ring iteration lasts as long as its slowest rank
            row[f"ring_{layout}_s"] = statistics.median(max(w) for w in zip(*(r["wall"] for r in rr)))
            row[f"cpu_{layout}_s"] = [statistics.median(r["cpu"]) for r in rr]
            table = [r["kernel_steps"] for r in rr]
            row[f"kernel_{layout}_s"] = table
            row[f"P2_ring_{layout}"] = work.balance(table)
            # where the time goes: the busiest rank's wall time inside the attention kernels vs the ring time
            row[f"kernel_wall_{layout}_s"] = [r["kernel_wall"] for r in rr]
            row[f"kernel_share_{layout}"] = max(r["kernel_wall"] for r in rr) / row[f"ring_{layout}_s"]
            row[f"bytes_ratio_fwd_{layout}"] = max(r["bytes_fwd"] for r in rr) / formula if formula else 1.0
            row[f"bytes_ratio_fwd_bwd_{layout}"] = (
                max(r["bytes_fwd_bwd"] for r in rr) / (3 * formula) if formula else 1.0)
        if not singles:
            rows.append(row)
            continue
        q, k, v = _qkv(shape, s, dtype, seed=0)
        scale = shape["head_dim"] ** -0.5
        row["T_causal_s"] = _median_time(lambda: _block_fwd_bwd(q, k, v, True, scale), iters)
        row["T_full_s"] = _median_time(lambda: _block_fwd_bwd(q, k, v, False, scale), iters)
        qs, ks, vs = q[:, :, 1:], k[:, :, :-1], v[:, :, :-1]
        row["T_strict_s"] = _median_time(lambda: _block_fwd_bwd(qs, ks, vs, True, scale), iters)
        if "striped" in args.layouts and "contiguous" in args.layouts:
            tc, tf, ts = row["T_causal_s"], row["T_full_s"], row["T_strict_s"]
            row["P3"] = row["ring_contiguous_s"] / row["ring_striped_s"]
            row["P3_ceiling"] = (tc + tf) / (tc + ts) if world == 2 else None
            row["P3_of_ceiling"] = row["P3"] / row["P3_ceiling"] if world == 2 else None
            # striped's rank 1 does two causal blocks: its real P = 2 critical path is max(Tc + Ts, 2 Tc)
            row["P3_ceiling_critical"] = (tc + tf) / max(tc + ts, 2 * tc) if world == 2 else None
        # the kernels' own critical path: every (rank, step) block of the ring run standalone (best of 2)
        for layout in args.layouts:
            row[f"kernel_critical_{layout}_s"] = work.critical_path(work.measured_table(layout, world, q, k, v))
        if ideal:
            qf, kf, vf = _qkv(shape, s * world, dtype, seed=0)
            row["ideal_s"] = _median_time(lambda: _sdpa_fwd_bwd(qf, kf, vf), iters) / world
            if args.ideal_concurrent:
                # P processes at once share the cores' caches, memory bandwidth and clock like the ring's ranks
                row["ideal_concurrent_s"] = max(run_ranks(world, _ideal_rank, s * world, shape, dtype, iters)) / world
            for layout in args.layouts:
                row[f"P4_{layout}"] = row["ideal_s"] / row[f"ring_{layout}_s"]
                if args.ideal_concurrent:
                    row[f"P4_concurrent_{layout}"] = row["ideal_concurrent_s"] / row[f"ring_{layout}_s"]
                # P4 = kernel ceiling (ideal / the blocks' critical path) x ring efficiency (that path / ring)
                row[f"P4_ceiling_{layout}"] = row["ideal_s"] / row[f"kernel_critical_{layout}_s"]
        rows.append(row)
    return rows, statistics.median(r["link_gbps"] for r in recs)


def heat_maps(args, shape, dtype):
    """Exact pairs and standalone measured seconds per (rank, step), for each heat-map world and layout."""
    out = []
    bar = tqdm(total=sum(w * w for w in args.heat_worlds) * len(args.layouts), desc="heat-map blocks")
    q, k, v = _qkv(shape, args.heat_s_local, dtype, seed=0)
    cache = {}  # the same block shapes recur across layouts and worlds
    for world in args.heat_worlds:
        for layout in args.layouts:
            pairs = work.work_table(layout, world, args.heat_s_local)
            secs = work.measured_table(layout, world, q, k, v, repeats=args.iters, progress=bar, cache=cache)
            out.append(dict(world=world, layout=layout, s_local=args.heat_s_local, pairs=pairs, seconds=secs,
                            P2_pairs=work.balance(pairs), P2_measured=work.balance(secs),
                            critical_pairs=work.critical_path(pairs), critical_s=work.critical_path(secs)))
    bar.close()
    return out


def memory_search(args, shape, dtype, *, layers=0):
    """P5: for each P the largest S_local whose measured ring peak fits the cap (fresh ranks per probe);
    the attention op alone, or with ``layers`` a stack of Llama-style layers around it."""
    cap = (args.layers_cap_mib if layers else args.mem_cap_mib) * 2**20
    probes, best = [], {}
    bar = tqdm(desc=f"memory probes Hq={shape['q_heads']} Hkv={shape['kv_heads']}" + (f" {layers} layers" if layers else ""))
    for world in args.mem_worlds:
        def fits(s, world=world):
            if layers:
                peaks = run_ranks(world, mem.layers_peak, s, shape, dtype, "striped", layers)
            else:
                peaks = run_ranks(world, mem.ring_peak, s, shape, dtype, "striped")
            probes.append(dict(world=world, s_local=s, n=s * world, peak_bytes=max(peaks), peaks=peaks))
            bar.update(1)
            return max(peaks) <= cap

        best[world] = world * mem.search_max(fits, start=args.mem_start, unit=64)
    bar.close()
    p5 = {w: best[w] / best[1] if best.get(1) else None for w in best}
    for pr in probes:
        pr["plan_bytes"] = memory_bytes(PlanInput(seq_len=pr["n"], cp=pr["world"], dtype=work.PLAN_DTYPES[dtype],
                                                  **shape))["total"]
    return dict(shape=shape, layers=layers, cap_bytes=cap, n_max=best, P5=p5, probes=probes,
                malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")})


def planner_check(rows, shape, dtype, link_gbps, calib_s):
    """Calibrate TFLOP/s on the causal block at ``calib_s``, predict every ring time, report the error."""
    calib = next(r for r in rows if r["s_local"] == calib_s)
    tflops = work.calibrate_tflops(calib["T_causal_s"], s_local=calib_s, batch=shape["batch"],
                                   q_heads=shape["q_heads"], head_dim=shape["head_dim"])
    per_pair = calib["T_causal_s"] / work.tile_pairs(calib_s, calib_s, True)  # for the tile-aware model
    checks = []
    for r in rows:
        for layout in ("striped", "headtail", "contiguous"):
            if f"ring_{layout}_s" not in r:
                continue
            pred = work.plan_ring_seconds(layout=layout, world=r["world"], s_local=r["s_local"], dtype=dtype,
                                          tflops=tflops, link_gbps=link_gbps, **shape)
            meas = r[f"ring_{layout}_s"]
            tile = work.tile_ring_seconds(layout, r["world"], r["s_local"], seconds_per_pair=per_pair)
            checks.append(dict(world=r["world"], s_local=r["s_local"], layout=layout, predicted_s=pred,
                               measured_s=meas, error=pred / meas - 1, tile_predicted_s=tile,
                               tile_error=tile / meas - 1))
    return dict(tflops=tflops, calib_s_local=calib_s, link_gbps=link_gbps, checks=checks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks of the timing sweep (keep <= cores)")
    p.add_argument("--s-local", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192], help="N/P values")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--layouts", nargs="+", default=list(cp_dtensor.LAYOUTS))
    p.add_argument("--skip-ideal", action="store_true")
    p.add_argument("--ideal-concurrent", action="store_true",
                   help="also time the ideal with P copies running at once (same machine contention as the ring)")
    p.add_argument("--paired-s-local", type=int, nargs="*", default=[4096],
                   help="N/P of the same-window P4 runs (ring and ideal back to back each iteration); empty to skip")
    p.add_argument("--paired-iters", type=int, default=5)
    p.add_argument("--calib-s-local", type=int, default=None, help="planner calibration block (default: middle N/P)")
    p.add_argument("--balance-worlds", type=int, nargs="*", default=[4], help="extra in-ring balance runs")
    p.add_argument("--balance-s-local", type=int, default=2048)
    p.add_argument("--heat-worlds", type=int, nargs="*", default=[4, 8])
    p.add_argument("--heat-s-local", type=int, default=2048)
    p.add_argument("--mem-worlds", type=int, nargs="*", default=[1, 2, 4], help="P5 search; empty to skip")
    p.add_argument("--mem-heads", nargs="+", default=["4:2", "32:4"], help="Hq:Hkv shapes of the P5 search")
    p.add_argument("--mem-cap-mib", type=float, default=64.0)
    p.add_argument("--layers", type=int, default=4, help="P5 also for this many Llama-style layers around the "
                   "ring (Hq=--q-heads, Hkv=--kv-heads); 0 to skip")
    p.add_argument("--layers-cap-mib", type=float, default=256.0)
    p.add_argument("--mem-start", type=int, default=256, help="first S_local of the P5 doubling")
    p.add_argument("--profile", choices=cp_dtensor.LAYOUTS, help="torch.profiler on every rank: one extra fwd+bwd "
                   "of this layout at the largest N/P, tables to OUT_DIR/profile_*.txt")
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--out", help="JSON path (default OUT_DIR/bench_ring.json)")
    p.add_argument("--docs-img", action="store_true", help="copy the plots to docs/img/")
    args = p.parse_args()
    torch.set_num_threads(1)  # the ideal run and the standalone blocks: one thread, like a rank
    dtype = getattr(torch, args.dtype)
    shape = dict(batch=args.batch, q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
    os.makedirs(args.out_dir, exist_ok=True)
    res = dict(config=vars(args), shape=shape, torch=torch.__version__, cpus=os.cpu_count(),
               started=datetime.now(timezone.utc).isoformat(timespec="seconds"), load_avg_start=os.getloadavg(),
               command=" ".join([".venv/bin/python scripts/benchmarks/bench_ring.py", *sys.argv[1:]]))
    t0 = time.perf_counter()
    res["memory"] = []  # first: the forked probes then inherit a small parent heap
    for heads in args.mem_heads if args.mem_worlds else []:
        hq, hkv = (int(x) for x in heads.split(":"))
        res["memory"].append(memory_search(args, {**shape, "q_heads": hq, "kv_heads": hkv}, dtype))
    if args.mem_worlds and args.layers:
        res["memory"].append(memory_search(args, shape, dtype, layers=args.layers))
    res["timing"], link = ring_sweep(args, shape, dtype, args.world, args.s_local, args.iters,
                                     ideal=not args.skip_ideal, profile=True)
    res["paired"] = (paired_sweep(args, shape, dtype, args.world, args.paired_s_local, args.paired_iters)
                     if args.paired_s_local and not args.skip_ideal else [])
    calib = args.calib_s_local or sorted(args.s_local)[len(args.s_local) // 2]
    res["planner"] = planner_check(res["timing"], shape, dtype, link, calib)
    res["balance"] = []
    for w in args.balance_worlds:
        rows, _ = ring_sweep(args, shape, dtype, w, [args.balance_s_local], 1, singles=False, ideal=False)
        res["balance"] += rows
    res["heat"] = heat_maps(args, shape, dtype) if args.heat_worlds else []
    res["load_avg_end"], res["seconds"] = os.getloadavg(), time.perf_counter() - t0
    print(report.text(res))
    out = args.out or os.path.join(args.out_dir, "bench_ring.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    import _bench_plot as plot

    paths = plot.all_plots(res, args.out_dir)
    md = os.path.join(args.out_dir, "performance.md")
    with open(md, "w") as f:
        f.write(report.markdown(res))
    paths_note = f"{md}, "
    if args.docs_img:
        os.makedirs("docs/img", exist_ok=True)
        for path in paths:
            shutil.copy(path, os.path.join("docs/img", os.path.basename(path)))
    print(f"wrote {out}, {paths_note}{', '.join(paths)}" + (" (copied to docs/img/)" if args.docs_img else "")
          + f" in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
