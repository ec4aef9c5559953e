"""Console entry point ``cp-dtensor``: one argparse subcommand per tool.

Keep module import free of torch so that ``cp-dtensor plan`` starts fast; subcommands that need
torch import it inside their handler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from . import plan as _plan
from . import plan_documents as _plan_documents
from . import plan_model as _plan_model

__all__ = ["main", "build_parser"]


def _tokens(text: str) -> int:
    try:
        return _plan.parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="cost model: ring bytes, attention FLOPs, memory and overlap per rank per layer",
        description=(
            "Cost one ring-attention configuration, per rank and per attention layer. "
            "Token counts take binary suffixes: 128k = 131072, 1M = 1048576."
        ),
    )
    p.add_argument("--seq-len", type=_tokens, required=True, help="global sequence length N (e.g. 131072, 128k, 1M)")
    p.add_argument("--cp", type=int, help="CP degree P; if omitted with --mem-budget-gib, the smallest that fits")
    p.add_argument("--head-dim", type=int, help="head dimension D")
    p.add_argument("--hidden", type=int, help="model width; D = hidden / q-heads")
    p.add_argument("--q-heads", "--heads", dest="q_heads", type=int, required=True, help="query heads Hq")
    p.add_argument("--kv-heads", type=int, help="key/value heads Hkv (default: q-heads)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism beside CP: each rank's attention runs "
                   "Hq / tp and Hkv / tp heads (default 1)")
    p.add_argument("--dtype", choices=_plan.COMPUTE_DTYPES, default="bf16",
                   help="compute/activation dtype, also that of the dK/dV accumulators (default bf16)")
    p.add_argument("--comm-dtype", choices=list(_plan.DTYPE_BYTES),
                   help="K/V ring payload dtype (default: --dtype); fp8 adds a 1-byte exponent per row")
    p.add_argument("--layout", choices=["striped", "headtail", "contiguous"], default="striped")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank B (default 1)")
    p.add_argument("--layers", type=int, default=1, help="attention layers, for memory (default 1)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask (default on)")
    p.add_argument("--window", type=int, help="causal sliding window: each query sees the W tokens before it "
                   "(flash-attn's (W, 0)); steps no rank needs are not sent")
    p.add_argument("--mean-doc-len", type=_tokens, help="packed documents of this mean length (block-causal): "
                   "fewer kept pairs, the same K/V bytes")
    p.add_argument("--doc-lengths", metavar="FILE|DIST",
                   help="packed documents: a file of lengths (one a line, or whitespace separated; packed in order "
                   "into --batch rows of --seq-len) or a distribution, lognormal:median=1000,sigma=1.2[,seed=0,cap=C] "
                   "or fixed:length=L; adds bytes, balance and steps of striped, headtail, contiguous and documents")
    p.add_argument("--windows", nargs="+", metavar="W", type=_window,
                   help="with --doc-lengths: every attention layer's left window ('none' for a global layer), "
                   "e.g. --windows none 4096; the balance and the document placement count them all "
                   "(default: the one layer of --window)")
    p.add_argument("--link-gbps", type=float, help="ring link bandwidth per rank, GB/s (1e9 B/s)")
    p.add_argument("--tflops", type=float, help="sustained attention throughput, TFLOP/s")
    p.add_argument("--mem-budget-gib", type=float, help="per-rank memory budget (GiB): report the smallest CP that fits")
    p.add_argument("--reserved-gib", type=float, default=0.0, help="per-rank memory not modelled (weights, optimizer, ...)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the kernels run: their transient memory differs (default cuda)")
    p.add_argument("--max-cp", type=int, default=4096, help="largest CP the budget search tries (default 4096)")
    p.add_argument("--island", type=int, help="compare K/V exchanges (ring, allgather, U x R): ranks per fast "
                   "island (a node's NVLink); needs --intra-gbps, --inter-gbps, --tflops")
    p.add_argument("--intra-gbps", type=float, help="per-rank link inside an island, GB/s (with --island)")
    p.add_argument("--inter-gbps", type=float, help="per-rank link between islands, GB/s (with --island)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_cmd_plan)


def _window(text: str) -> int | None:
    if text.lower() in ("none", "global", "-1"):
        return None
    try:
        w = int(text)
    except ValueError:
        w = -1
    if w < 0:
        raise argparse.ArgumentTypeError(f"a layer's window is 'none' (global) or a token count >= 0; got {text!r}")
    return w


def _head_dim(args: argparse.Namespace) -> int:
    if args.hidden is None:
        if args.head_dim is None:
            raise ValueError("give the head size: --head-dim D, or --hidden W with --q-heads/--heads H.")
        return args.head_dim
    if args.hidden % args.q_heads != 0:
        raise ValueError(f"--hidden ({args.hidden}) must be divisible by --q-heads ({args.q_heads}).")
    d = args.hidden // args.q_heads
    if args.head_dim is not None and args.head_dim != d:
        raise ValueError(f"--head-dim {args.head_dim} disagrees with --hidden/--q-heads = {d}; give one of them.")
    return d


def _tp_heads(args: argparse.Namespace) -> tuple[int, int]:
    hq, hkv, tp = args.q_heads, args.q_heads if args.kv_heads is None else args.kv_heads, args.tp
    if tp < 1 or hq % tp or hkv % tp:
        raise ValueError(f"--tp ({tp}) must divide --q-heads ({hq}) and --kv-heads ({hkv}): each TP rank runs whole "
                         f"heads. Use a divisor of {hkv}.")
    return hq // tp, hkv // tp


def _cmd_plan(args: argparse.Namespace) -> int:
    hq, hkv = _tp_heads(args)  # a TP rank's heads
    fields = dict(
        seq_len=args.seq_len, head_dim=_head_dim(args), q_heads=hq, kv_heads=hkv, dtype=args.dtype, comm_dtype=args.comm_dtype,
        layout=args.layout, batch=args.batch, layers=args.layers,
        causal=args.causal, window=args.window, mean_doc_len=args.mean_doc_len, link_gbps=args.link_gbps, tflops=args.tflops, reserved_gib=args.reserved_gib,
        device=args.device,
    )
    cp = args.cp
    if cp is None:
        if args.mem_budget_gib is None:
            raise ValueError("give --cp P, or --mem-budget-gib to pick the smallest CP that fits.")
        # the search ignores inp.cp; cp=1 only has to pass validation
        cp = _plan.smallest_cp(_plan.PlanInput(cp=1, **fields), mem_budget_gib=args.mem_budget_gib, max_cp=args.max_cp)
        if cp is None:
            raise ValueError(f"no CP up to {args.max_cp} fits {args.mem_budget_gib} GiB per rank.")
    inp = _plan.PlanInput(cp=cp, **fields)
    result = _plan.make_plan(inp, mem_budget_gib=args.mem_budget_gib, max_cp=args.max_cp)
    docs = None
    if args.windows is not None and args.doc_lengths is None:
        raise ValueError("--windows lists the layers for --doc-lengths; give --doc-lengths too (or use --window).")
    if args.doc_lengths is not None:
        if args.mean_doc_len is not None:
            raise ValueError("give the documents once: --doc-lengths or --mean-doc-len, not both.")
        rows = _plan_documents.doc_rows(_plan_documents.parse_doc_lengths(args.doc_lengths), inp.seq_len, inp.batch)
        docs = _plan_documents.compare_placements(inp, rows, windows=args.windows)
    exchanges = best = None
    if args.island is not None or args.intra_gbps is not None or args.inter_gbps is not None:
        if None in (args.island, args.intra_gbps, args.inter_gbps):
            raise ValueError("comparing K/V exchanges needs all of --island, --intra-gbps and --inter-gbps.")
        exchanges = _plan.compare_exchanges(inp, island=args.island, intra_gbps=args.intra_gbps,
                                            inter_gbps=args.inter_gbps)
        best = _plan.recommend(exchanges, mem_budget_gib=args.mem_budget_gib)
    if args.json:
        d = result.to_dict()
        if exchanges is not None:
            d["exchanges"] = [dataclasses.asdict(x) | {"total_s": x.total_s} for x in exchanges]
            d["recommended"] = None if best is None else best.name
        if docs is not None:
            d["documents"] = [dataclasses.asdict(x) | {"vs_ring": x.vs_ring} for x in docs]
        print(json.dumps(d))
    else:
        print(format_plan(result))
        if docs is not None:
            print()
            print(format_documents(inp, docs, args))
        if exchanges is not None:
            print()
            print(format_exchanges(inp, exchanges, best, args))
    return 0


def format_exchanges(inp: _plan.PlanInput, exchanges: list, best, args: argparse.Namespace) -> str:
    """The K/V exchange comparison: one row per way to move K/V (Note [Plan exchanges] in tools/plan_exchanges.py)."""
    out = [
        f"K/V exchanges on {inp.cp} ranks, islands of {args.island} at {args.intra_gbps:g} GB/s, "
        f"{args.inter_gbps:g} GB/s between, {inp.tflops:g} TFLOP/s (per rank per layer, fwd+bwd)",
        "  exchange         bytes sent      memory      compute/comm  est. time    exposed comm",
    ]
    for x in exchanges:
        ratio = "-" if x.compute_over_comm is None else f"{x.compute_over_comm:.2f}"
        mark = "  <- recommended" if best is not None and x is best else ""
        out.append(
            f"  {x.name:<16} {(x.fwd_bytes + x.bwd_bytes) / (1 << 20):>9,.1f} MiB  {x.memory_total / (1 << 30):>7.2f} GiB"
            f"  {ratio:>12}  {_secs(x.total_s):>11}  {_secs(x.exposed_s):>11}{mark}"
        )
    if best is None:
        out.append(f"  none fits {args.mem_budget_gib:g} GiB per rank")
    elif best.ulysses > 1:
        out.append(
            f"  run it: ring_attention(..., group=mesh, kv_exchange={best.kv_exchange!r}) with a ({best.ulysses}, "
            f"{best.ring}) mesh whose Ulysses dim stays inside an island (see Note [Plan exchanges])"
        )
    return "\n".join(out)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{int(n):,} B ({n / size:,.2f} {unit})"
    return f"{int(n):,} B"


def _flops(n: float) -> str:
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:,.3f} {unit}"
    return f"{n:,.0f} FLOP"


def _secs(s: float) -> str:
    return f"{s * 1e3:,.3f} ms"


def format_documents(inp: _plan.PlanInput, docs: list, args: argparse.Namespace) -> str:
    """The packed documents' table: one row per placement (Note [Plan documents] in tools/plan_documents.py)."""
    wins = args.windows if args.windows is not None else [inp.window]
    out = [f"packed documents ({args.doc_lengths}), {inp.batch} row{'s' if inp.batch > 1 else ''} of {inp.seq_len:,}; "
           f"per rank per layer, forward; balance over layers {['global' if w is None else w for w in wins]}",
           f"  {'placement':<11}{'exchange':<14}{'steps':>5}  {'K/V rows on the wire':>21}  {'vs ring':>7}  "
           f"{'rows the masks need':>19}  {'fwd bytes':>22}  balance"]
    for x in docs:
        out.append(f"  {x.placement:<11}{x.exchange:<14}{x.steps:>5}  {x.wire_rows_max:>21,}  {x.vs_ring:>7.3f}  "
                   f"{x.needed_rows_max:>19,}  {_bytes(x.fwd_bytes_max):>22}  {x.balance:.3f}")
    out.append("  (rows: token positions whose K and V arrive, the busiest rank; vs ring: summed over ranks / the "
               "striped ring's; balance: max/mean kept causal pairs over ranks; the ring sends every block whatever "
               "the documents, the document exchange only the rows the masks need; both in --comm-dtype)")
    return "\n".join(out)


def _row(label: str, text: str) -> str:
    return f"  {label:<21}{text}"


def format_plan(r: _plan.Plan) -> str:
    """The human-readable report of ``cp-dtensor plan``."""
    i = r.input
    p, fpp, mem = i.cp, r.flops_per_pair, r.memory
    steps = len(r.steps)  # P, or fewer under a window
    scales = " + 1-byte exponent per row" if i.comm_dtype == "fp8" else ""
    out = [
        f"N={i.seq_len:,} tokens, CP={p} -> S_local={i.s_local:,}, layout {i.layout}, "
        f"{'causal' if i.causal else 'full'} mask"
        + (f", window {i.window}" if i.window is not None else "")
        + (f", documents of ~{i.mean_doc_len:,} tokens" if i.mean_doc_len is not None else "")
        + f", batch {i.batch}",
        f"heads Hq={i.q_heads} Hkv={i.kv_heads}, D={i.head_dim}, dtype {i.dtype}, "
        f"K/V comm {i.comm_dtype} ({_plan.DTYPE_BYTES[i.comm_dtype]} B{scales}), "
        f"dK/dV comm {i.dtype} ({_plan.DTYPE_BYTES[i.dtype]} B)",
        "",
        "communication per rank per layer (only K/V travel, never Q)",
        _row("K/V per ring step", f"{_bytes(r.kv_step_bytes)} = 2*B*S_local*D*Hkv*bytes"
             + (" + 2*B*S_local*Hkv*1 (exponents)" if scales else "")),
        _row(f"forward, {steps - 1} sends", f"{_bytes(r.fwd_bytes)} = "
             + ("(P-1)" if steps == p else f"{steps - 1} (the window needs {steps} of {p} ring steps)") + " * K/V step"),
        _row("dK/dV hop", f"{_bytes(r.dkv_step_bytes)} = 2*B*S_local*D*Hkv*bytes(dtype)"),
        _row("backward", f"{_bytes(r.bwd_bytes)} = {'(P-1)' if steps == p else steps - 1} * (K/V step + dK/dV hop)"),
        _row("forward+backward", _bytes(r.fwd_bwd_bytes)),
        "",
        f"attention FLOPs per rank per layer ({fpp:,} = 4*B*Hq*D per kept (q,k) pair; "
        f"backward = {_plan.BWD_FLOP_FACTOR}x forward)",
        _row("step 0 (own block)", f"{_flops(r.steps[0].max_pairs * fpp)} on every rank"),
    ]
    if steps > 1:
        hi, lo = max(w.max_pairs for w in r.steps[1:]), min(w.min_pairs for w in r.steps[1:])
        out.append(_row(f"steps 1..{steps - 1}", f"slowest rank {_flops(hi * fpp)}, lightest rank {_flops(lo * fpp)}"))
    imbalance = r.rank_fwd_pairs_max / r.rank_fwd_pairs_mean
    work = max(mem["forward_working_set"], mem["backward_working_set"])
    out += [
        _row("forward, all steps", f"slowest rank {_flops(r.fwd_flops_max_rank)} (max/mean over ranks {imbalance:.3f})"),
        _row("forward+backward", f"slowest rank {_flops(r.fwd_bwd_flops_max_rank)}"),
        "",
        f"memory per rank (ring attention only, {i.layers} layer{'s' if i.layers > 1 else ''})",
        _row("saved for backward", f"{_bytes(mem['saved_per_layer'])} per layer (q, k, v, out, fp32 lse)"),
        _row("ring working set", f"{_bytes(work)} (one layer; forward {_bytes(mem['forward_working_set'])}, "
             f"backward {_bytes(mem['backward_working_set'])})"),
    ]
    if mem["reserved"]:
        out.append(_row("reserved", _bytes(mem["reserved"])))
    out += [_row("total", _bytes(mem["total"])), ""]
    t = r.timing
    if t is None:
        out.append("overlap: pass --link-gbps and --tflops to compare ring transfer with step compute")
    elif steps == 1:
        out.append("overlap: no ring communication (CP=1, or a window within the local block)")
    else:
        out += [
            f"overlap at {i.link_gbps:g} GB/s and {i.tflops:g} TFLOP/s (a step lasts as long as its slowest rank)",
            _row("forward", f"K/V step {_secs(t['kv_step_s'])} vs shortest step (slowest rank) "
                 f"{_secs(t['min_step_compute_s'])} -> {'hidden' if t['fwd_hidden'] else 'EXPOSED'} "
                 f"(compute/comm {t['compute_over_comm']:.2f}); ~{_secs(t['fwd_s'])}, "
                 f"exposed {_secs(t['fwd_exposed_comm_s'])}"),
            _row("backward", f"K/V + dK/dV {_secs(t['kv_step_s'] + t['dkv_step_s'])} per step -> "
                 f"{'hidden' if t['bwd_hidden'] else 'EXPOSED'}; ~{_secs(t['bwd_s'])}, exposed "
                 f"{_secs(t['bwd_exposed_comm_s'])} (the last dK/dV hop always is)"),
        ]
    s = r.smallest_cp
    if s is not None:
        found = f"none up to CP={s['max_cp_searched']}" if s["cp"] is None else (
            f"{s['cp']} (total {_bytes(s['total_bytes'])})")
        out.append(f"smallest CP within {s['mem_budget_gib']:g} GiB per rank: {found}")
    return "\n".join(out)


def _add_longest(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "longest",
        help="the longest sequence per rank a model trains within a memory budget, tiled vs untiled",
        description=("The whole-model memory of one training step per rank (attention, layers, MLP, LM head + "
                     "loss; Note [Plan model memory] in tools/plan_model.py), with and without sequence tiling, "
                     "and the longest S_local (and N = P * S_local) within --mem-budget-gib."),
    )
    p.add_argument("--model", choices=sorted(_plan_model.MODELS), required=True, help="the model's shape")
    p.add_argument("--cp", type=int, required=True, help="CP degree P")
    p.add_argument("--mem-budget-gib", type=float, required=True, help="per-rank memory (GiB)")
    p.add_argument("--reserved-gib", type=float, default=0.0,
                   help="per-rank memory not modelled: weights, gradients, optimizer state, slack")
    p.add_argument("--dtype", choices=_plan.COMPUTE_DTYPES, default="bf16")
    p.add_argument("--tile", type=int, default=1024, help="sequence tiling's tokens per tile (default 1024)")
    p.add_argument("--checkpointing", choices=["none", "full"], default="full",
                   help="activation checkpointing of every layer (default full)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (each holds ceil(L / pp) layers; default 1)")
    p.add_argument("--schedule", choices=["1F1B", "GPipe"], default="1F1B",
                   help="the pipeline schedule: how many microbatches a stage holds in flight (default 1F1B)")
    p.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches of one row (default --pp)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism (with sequence parallelism) beside CP: "
                   "heads, SwiGLU width and vocabulary split tp ways (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_cmd_longest)


def _cmd_longest(args: argparse.Namespace) -> int:
    if args.cp < 1:
        raise ValueError(f"--cp must be a positive integer; got {args.cp}.")
    if not 0 <= args.reserved_gib < args.mem_budget_gib:
        raise ValueError(f"--reserved-gib ({args.reserved_gib:g}) must be >= 0 and below --mem-budget-gib "
                         f"({args.mem_budget_gib:g}): the activations get what the reserved bytes leave. Pass a "
                         f"larger budget or a smaller reservation.")
    shape = _plan_model.MODELS[args.model]
    kw = dict(cp=args.cp, dtype=args.dtype, checkpointing=args.checkpointing, reserved_gib=args.reserved_gib,
              pp=args.pp, schedule=args.schedule, microbatches=args.microbatches, tp=args.tp)
    out = {"params_per_rank": _plan_model.params_per_rank(shape, tp=args.tp, pp=args.pp)}
    for name, tile in (("untiled", None), ("tiled", args.tile)):
        s = _plan_model.longest_s_local(shape, args.mem_budget_gib, tile=tile, **kw)
        out[name] = {"s_local": s, "seq_len": s * args.cp,
                     "memory": _plan_model.model_memory(shape, max(s, 1), tile=tile, **kw)}
    out["ratio"] = out["tiled"]["s_local"] / max(out["untiled"]["s_local"], 1)
    if args.json:
        print(json.dumps(out))
        return 0
    pipeline = "" if args.pp == 1 else (f" x PP={args.pp} ({args.schedule}, "
                                        f"{args.microbatches or args.pp} microbatches; the worst stage)")
    tensor = "" if args.tp == 1 else f" x TP={args.tp}"
    print(f"{args.model} at CP={args.cp}{tensor}{pipeline}, {args.mem_budget_gib:g} GiB a rank ({args.reserved_gib:g} "
          f"reserved: weights, gradients, optimizer; {out['params_per_rank'] / 1e9:.2f} B parameters a rank), "
          f"{args.dtype}, checkpointing {args.checkpointing}")
    for name in ("untiled", "tiled"):
        r, m = out[name], out[name]["memory"]
        terms = ", ".join(f"{k} {_bytes(v)}" for k, v in m.items() if k != "total")
        label = name if name == "untiled" else f"tiled (T={args.tile})"
        print(_row(label, f"S_local {r['s_local']} (N = {r['seq_len']}): {terms}"))
    print(_row("tiled / untiled", f"{out['ratio']:.1f}x"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cp-dtensor", description="Context parallelism (ring attention) tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan(sub)
    _add_longest(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        parser.exit(2, f"cp-dtensor {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
