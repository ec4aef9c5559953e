"""One GPU, one command: the ring on CUDA tensors, every rank's verdict, the models, syncs, overhead and memory.

    python scripts/benchmarks/gpu_check.py                                       # one CUDA GPU, <= 5 minutes
    .venv/bin/python scripts/benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc  # CPU, tiny: the same code paths

Writes DIR/gpu_check.json and DIR/gpu_check.md (default bench_out/gpu_check) and prints the report. Exit
status 1 on any correctness failure (a wrong or non-finite result on any rank, a crash, a stall or a case
past its time limit); overhead and memory are reported, not enforced.

(a) _gpu_ring.py, P processes (--ranks, default 4) sharing cuda:0 in one gloo group (gloo's all-to-all takes
    CUDA tensors, staged through pinned host buffers; NCCL refuses two ranks on one device): every layout
    x bf16 / fp16 / fp32 x causal / full / documents + window + sinks / documents + window / documents /
    window, forward and backward against float64 by the textbook formula; the document exchange
    (cp_dtensor.document_layout) on the cases with documents; F.scaled_dot_product_attention on
    sequence-sharded DTensors under every SDPA backend (torch.nn.attention.sdpa_kernel: flash, efficient,
    cudnn, math, and SDPA's own choice) -- the ring with its K/V all-to-alls only, or a ValueError; a
    compiled ring (fullgraph, Inductor on CUDA) against eager and float64.
(b) host syncs: torch.cuda.set_sync_debug_mode("warn") around ring calls on every rank; only torch's "called
    a synchronizing CUDA operation" warnings count (its notices about the mode itself are listed apart).
(c) _gpu_sim.py, P7: P = 8 ranks simulated in one process at N = 128k, the blockwise steps + merges fwd+bwd /
    one causal call (target <= 1.15), after a check of the simulation against a reference.
(d) peak memory per rank (torch.cuda.max_memory_allocated) of one striped ring fwd+bwd at --mem-seq-len next
    to the planner's (cp_dtensor.plan.memory_bytes, Note [Plan memory]).
(e) _gpu_models.py: tiny transformers Llama and gpt-oss built locally at CP = 2 vs CP = 1, bf16, one packed
    row of documents, each case with a time limit; the last is gpt-oss at 1024 tokens (limit 90 s).
(f) sequence tiling's LM head + loss, tiled vs not: error vs float64, peak memory, time.

Every rank's results are kept (errors and non-finite counts per rank; NaN is a failure, never a small
error). A stalled group is stopped after its deadline with every rank's Python stacks in the report: see
the stall watchdog in _gpu_ranks.py. --cpu-smoke runs every section on CPU at tiny sizes with 2 ranks;
what needs CUDA (syncs, measured memory) is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _gpu_models as models  # noqa: E402
import _gpu_ring as ring  # noqa: E402
import _gpu_sim as sim  # noqa: E402
from _gpu_ranks import merge_rows, rows_of, run_group, stall_summary  # noqa: E402

from cp_dtensor.core.plan.layout import LAYOUTS  # noqa: E402

# name: (GPU default, --cpu-smoke default)
DEFAULTS = dict(ranks=(4, 2), ring_seq_len=(2048, 64), seq_len=(131072, 256), check_seq_len=(8192, 128),
                mem_seq_len=(32768, 64), q_heads=(32, 4), kv_heads=(8, 2), head_dim=(128, 16), iters=(3, 1),
                model_seq_len=(512, 64), stall_seq_len=(1024, 1024), model_limit_s=(60, 120), stall_limit_s=(90, 180),
                ring_timeout=(240, 240), models_timeout=(200, 420), stall_s=(30, 60), tiling_tokens=(8192, 256),
                tiling_vocab=(32768, 512), tiling_hidden=(1024, 64), tiling_tile=(1024, 64))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/gpu_check", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny sizes: the code paths, not the numbers")
    p.add_argument("--sim-world", type=int, default=8, help="simulated ranks P in (c)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--skip", nargs="*", default=[], choices=["ring", "compile", "sim", "models", "tiling"],
                   help="sections to leave out (a debugging aid; a skipped section is reported as such)")
    for name, (gpu, cpu) in DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"default {gpu}; smoke {cpu}")
    args = p.parse_args(argv)
    for name, (gpu, cpu) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu if args.cpu_smoke else gpu)
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here. Run it on a GPU machine, or pass --cpu-smoke for the CPU path.")
    for name in ("seq_len", "check_seq_len"):
        if getattr(args, name) % (2 * args.sim_world):
            raise SystemExit(f"gpu_check: --{name.replace('_', '-')} must be a multiple of 2 * --sim-world "
                             f"({2 * args.sim_world}) for every layout; got {getattr(args, name)}.")
    for name in ("ring_seq_len", "mem_seq_len"):
        if getattr(args, name) % (2 * args.ranks):
            raise SystemExit(f"gpu_check: --{name.replace('_', '-')} must be a multiple of 2 * --ranks "
                             f"({2 * args.ranks}); got {getattr(args, name)}.")
    return args


def run_ring_group(args, device) -> dict:
    cfg = dict(device=str(device), threads=1 if args.cpu_smoke else 4, stall_s=args.stall_s, collective_timeout=120,
               ring_seq_len=args.ring_seq_len, head_dim=64 if not args.cpu_smoke else 16, layouts=args.layouts,
               mem_seq_len=args.mem_seq_len, q_heads=args.q_heads, kv_heads=args.kv_heads, mem_head_dim=args.head_dim, skip=args.skip)
    g = run_group("ring", ring.ring_sections, cfg, args.ranks, timeout=args.ring_timeout,
                  start_method="fork" if args.cpu_smoke else "spawn")
    mem = [r[0] if r else None for r in rows_of(g, "memory")]
    sync = [r[0] if r else None for r in rows_of(g, "sync")]
    out = dict(group=g, ring=merge_rows(rows_of(g, "ring"), ("layout", "case")),
               sdpa=merge_rows(rows_of(g, "sdpa"), "backend"), compile=merge_rows(rows_of(g, "compile"), "case"))
    out["sync"] = dict(status=sync[0]["status"] if sync[0] else "missing",
                       syncs=[f"rank {r}: {x}" for r, s in enumerate(sync) if s for x in s.get("syncs", [])],
                       notices=sorted({x for s in sync if s for x in s.get("notices", [])}),
                       ok=all(s is not None and s["ok"] for s in sync))
    measured = [m.get("measured") if m else None for m in mem]
    out["memory"] = dict(mem[0] or dict(status="missing"), per_rank=measured, ok=all(m is not None and m["ok"] for m in mem))
    if mem[0] and all(x is not None for x in measured):
        out["memory"].update(measured=max(measured), ratio=mem[0]["planned"]["total"] / max(measured))
    return out


def verdict(res: dict) -> bool:
    rows = res["ring"] + res["sdpa"] + res["compile"] + res["models"] + res["simulation"]
    groups = [g for g in (res.get("ring_group"), res.get("models_group")) if g is not None]
    return (all(r["ok"] for r in rows) and res["sync"]["ok"] and res["memory"]["ok"] and res["tiling"]["ok"]
            and all(g["status"] == "ok" for g in groups))


def _err(x) -> str:
    return "-" if x is None else "inf" if math.isinf(x) else f"{x:.2e}"


def _per_rank(row) -> str:
    errs = " / ".join(_err(x) for x in row.get("per_rank_worst", []))
    bad = [n for n in row.get("per_rank_nonfinite", []) if n]
    return errs + (f" (non-finite per rank: {row['per_rank_nonfinite']})" if bad else "")


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f} MiB"


def markdown(res: dict) -> str:
    c = res["config"]
    lines = [f"# gpu_check on {res['device']}", "", f"{'PASS' if res['ok'] else 'FAIL'} in {res['seconds']:.0f} s. "
             f"Command: `{res['command']}`", ""]
    for key in ("ring_group", "models_group"):
        g = res.get(key)
        if g and g["status"] != "ok":
            lines += [f"**{g['name']} group {g['status'].upper()}** after {g['seconds']:.0f} s (limit "
                      f"{g['timeout']} s): unfinished ranks {g['stalled']}, crashed {g['crashed']}", "",
                      *stall_summary(g)]
    lines += [f"## (a) the ring on {c['ranks']} ranks sharing {c['device']}, N = {c['ring_seq_len']}", "",
              "| layout | case | worst error per rank vs float64 | tol | ok |", "|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['case']}{' ERROR ' + r['error'] if 'error' in r else ''} | {_per_rank(r)} | "
              f"{r.get('tol', 0):.0e} | {r['ok']} |" for r in res["ring"]]
    lines += ["", "F.scaled_dot_product_attention on sequence-sharded DTensors, per SDPA backend:", "",
              "| backend | dtype | status | worst error per rank | collectives fwd / bwd | ok |", "|---|---|---|---|---|---|"]
    for r in res["sdpa"]:
        comm = f"{r['comm']['forward']} / {r['comm']['backward']}" if r.get("comm") else r.get("detail", "")
        lines.append(f"| {r['backend']} | {r['dtype']} | {r['status']} | {_per_rank(r)} | {comm} | {r['ok']} |")
    lines += ["", "Compiled ring (fullgraph):", ""]
    lines += [f"- {r['case']} {r['dtype']} {r['backend']}: worst per rank {_per_rank(r)}, first call "
              f"{r.get('compiled_first_call_s', math.nan):.1f} s (eager {r.get('eager_first_call_s', math.nan):.2f} s)"
              f"{' ERROR ' + r['error'] if 'error' in r else ''}: {'PASS' if r['ok'] else 'FAIL'}" for r in res["compile"]]
    s = res["sync"]
    lines += ["", f"## (b) host syncs in ring calls: {s['status']}, {len(s['syncs'])} found"
              + (f" ({len(s['notices'])} notice(s) of torch's about the mode, not counted)" if s["notices"] else "")]
    lines += [f"- {x}" for x in s["syncs"][:20]]
    if res["overhead"]:
        lines += ["", f"## (c) P7: {c['sim_world']} ranks simulated, N = {c['seq_len']}, Hq {c['q_heads']} Hkv "
                  f"{c['kv_heads']} D {c['head_dim']} bf16, fwd+bwd", "",
                  f"simulation vs reference at N = {c['check_seq_len']}: " + ", ".join(
                      f"{r['layout']} {'PASS' if r['ok'] else 'FAIL'} (max err {_err(r['worst'])}, one call "
                      f"{_err(max(r['single_err']))})" for r in res["simulation"]), "",
                  "| layout | blockwise steps + merges | one causal call | ratio (target <= 1.15) | vs striped |",
                  "|---|---|---|---|---|"]
        for r in res["overhead"]:
            vs = "-" if r["vs_striped"] is None else f"{r['vs_striped']:.3f}"
            lines.append(f"| {r['layout']} | {r['ring_s'] * 1e3:.1f} ms | {r['single_s'] * 1e3:.1f} ms | "
                         f"{r['ratio']:.3f}{'' if r['meets_target'] else ' (over)'} | {vs} |")
    m = res["memory"]
    lines += ["", f"## (d) peak memory per rank, N = {m.get('seq_len')}, P = {m.get('cp')}, Hq {m.get('q_heads')} "
              f"Hkv {m.get('kv_heads')} D {m.get('head_dim')} bf16 striped causal fwd+bwd: {m['status']}", ""]
    if "planned" in m:
        lines.append(f"planner total {_mib(m['planned']['total'])}; measured per rank "
                     + ", ".join(_mib(x) for x in m["per_rank"])
                     + (f"; planner / measured (largest rank) {m['ratio']:.2f}" if "ratio" in m else f" ({m.get('detail', '')})"))
    lines += ["", "## (e) transformers models at CP = 2 vs CP = 1, bf16, one packed row of documents", "",
              "| case | CP=2 error vs fp32 CP=1, per rank | CP=1 bf16's own | worst tensor | time / limit | ok |",
              "|---|---|---|---|---|---|"]
    for r in res["models"]:
        detail = f" ERROR {r['error']}" if "error" in r else ""
        lines.append(f"| {r['case']}{detail} | {_per_rank(r)} | {_err(r.get('err_cp1_bf16'))} | {r.get('worst_tensor', '-')} "
                     f"| {r.get('seconds', math.nan):.1f} s / {r.get('limit_s', '-')} s | {r['ok']} |")
    t = res["tiling"]
    if t.get("rows"):
        lines += ["", f"## (f) sequence tiling, LM head + loss: {t['tokens']} tokens, hidden {t['hidden']}, vocab "
                  f"{t['vocab']}, tile {t['tile']}, bf16", "", "| | error vs float64 | peak | time | ok |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {_err(r['worst'])} | {_mib(r['peak_bytes'])} | {r['seconds'] * 1e3:.1f} ms | {r['ok']} |"
                  for k, r in t["rows"].items()]
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    name = "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name(device)
    t0 = time.perf_counter()
    if args.cpu_smoke:  # forked ranks: no OpenMP pool may cross the fork
        torch.set_num_threads(1)
    res = dict(ring=[], sdpa=[], compile=[], models=[], simulation=[], overhead=[], tiling=dict(ok=True, status="skipped"),
               sync=dict(status="skipped", syncs=[], notices=[], ok=True), memory=dict(status="skipped", ok=True))
    if "ring" not in args.skip:
        print(f"{name}: (a) ring, (b) syncs, (d) memory on {args.ranks} ranks sharing {device} ...", flush=True)
        got = run_ring_group(args, device)
        res.update(ring_group=got.pop("group"), **got)
        print(f"    {res['ring_group']['seconds']:.0f} s", flush=True)
    if "models" not in args.skip:
        print(f"(e) transformers models on 2 ranks (the last: gpt-oss, N={args.stall_seq_len}) ...", flush=True)
        cfg = dict(device=str(device), threads=1 if args.cpu_smoke else 4, stall_s=args.stall_s, collective_timeout=120,
                   model_seq_len=args.model_seq_len, stall_seq_len=args.stall_seq_len, model_limit_s=args.model_limit_s,
                   stall_limit_s=args.stall_limit_s)
        g = run_group("models", models.model_sections, cfg, 2, timeout=args.models_timeout,
                      start_method="fork" if args.cpu_smoke else "spawn")
        res.update(models_group=g, models=merge_rows(rows_of(g, "models"), "case"))
        print(f"    {g['seconds']:.0f} s", flush=True)
    if "sim" not in args.skip:
        print(f"(c) P7: {args.sim_world} simulated ranks at N={args.check_seq_len}, then N={args.seq_len} ...", flush=True)
        res["simulation"] = sim.check_simulation(args, device, args.check_seq_len)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        res["overhead"] = sim.check_overhead(args, device, args.seq_len)
    if "tiling" not in args.skip:
        print("(f) sequence tiling ...", flush=True)
        res["tiling"] = models.tiling_check(device, tokens=args.tiling_tokens, hidden=args.tiling_hidden,
                                            vocab=args.tiling_vocab, tile=args.tiling_tile, iters=args.iters)
    res.update(device=name, seconds=time.perf_counter() - t0,
               command=" ".join(["python", "scripts/benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
               config=dict(vars(args), device=str(device), head_dim_ring=64 if not args.cpu_smoke else 16))
    res["ok"] = verdict(res)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    report = markdown(res)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(report)
    print(report)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
