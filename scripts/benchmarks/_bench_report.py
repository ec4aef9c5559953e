"""bench_ring.py's printed report and the Markdown tables for docs/performance.md, both from one JSON record."""

from __future__ import annotations


def _load(res: dict) -> str:
    return (f"load average {res['load_avg_start'][0]:.2f} at the start, {res['load_avg_end'][0]:.2f} at the end "
            f"({res['cpus']} CPUs)")


def _command(res: dict) -> str:
    return res.get("command", "scripts/benchmarks/bench_ring.py")


def text(res: dict) -> str:
    cfg, sh = res["config"], res["shape"]
    lays = cfg["layouts"]
    out = [f"\nP={cfg['world']} ranks x 1 thread, B={sh['batch']}, Hq={sh['q_heads']}, Hkv={sh['kv_heads']}, "
           f"D={sh['head_dim']}, {cfg['dtype']}, causal fwd+bwd, median of {cfg['iters']}; {_load(res)}",
           "  N/P      N  " + "".join(f"{lay:>11}" for lay in lays) + "      ideal    P3  ceil P3/ceil "
           + "".join(f" P4 {lay[:5]:<5}" for lay in lays) + "  P2 ring str/con  bytes fwd,fwd+bwd / formula"]
    for r in res["timing"]:
        line = f"{r['s_local']:5d} {r['n']:6d}  " + "".join(f"{r[f'ring_{lay}_s'] * 1e3:9.1f}ms" for lay in lays)
        line += f" {r['ideal_s'] * 1e3:8.1f}ms" if "ideal_s" in r else "         - "
        if r.get("P3_ceiling"):
            line += f" {r['P3']:5.3f} {r['P3_ceiling']:5.3f} {r['P3_of_ceiling']:6.3f} "
        line += "".join(f" {r[f'P4_{lay}']:8.3f}" for lay in lays if f"P4_{lay}" in r)
        line += f"   {r.get('P2_ring_striped', float('nan')):.3f}/{r.get('P2_ring_contiguous', float('nan')):.3f}"
        line += "   " + " ".join(f"{r[f'bytes_ratio_fwd_{lay}']:.3f},{r[f'bytes_ratio_fwd_bwd_{lay}']:.3f}"
                                 for lay in lays)
        out.append(line)
    out.append("  P4 = kernel ceiling (ideal / critical path of the ring's blocks run standalone) x ring efficiency "
               "(that path / ring time): " + "; ".join(
                   f"N/P={r['s_local']} " + " ".join(
                       f"{lay[:3]} {r[f'P4_ceiling_{lay}']:.2f}x{r[f'kernel_critical_{lay}_s'] / r[f'ring_{lay}_s']:.2f}"
                       for lay in lays) for r in res["timing"] if "ideal_s" in r))
    if any("ideal_concurrent_s" in r for r in res["timing"]):
        out.append("  P4 with the ideal run by P processes at once (same contention as the ring): " + "; ".join(
            f"N/P={r['s_local']} ideal {r['ideal_concurrent_s'] * 1e3:.1f} ms " + " ".join(
                f"{lay[:3]} {r[f'P4_concurrent_{lay}']:.3f}" for lay in lays)
            for r in res["timing"] if "ideal_concurrent_s" in r))
    for r in res.get("paired", []):
        out.append(f"  P4 same window (ring and ideal back to back, median of {r['iters']} pairs) N/P={r['s_local']}: "
                   + ", ".join(f"{lay} {r[f'P4_{lay}']:.3f}" for lay in lays)
                   + f"; machine parallel efficiency of {r['world']} busy ranks {r['parallel_efficiency']:.3f}"
                   + (f"; P3 {r['P3']:.3f} vs ceiling {r['P3_ceiling']:.3f} -> {r['P3_of_ceiling']:.3f} of it"
                      if "P3" in r else ""))
        out.append(f"    best of {r['iters']}: P4 " + ", ".join(f"{lay} {r[f'P4_best_{lay}']:.3f}" for lay in lays)
                   + (f"; P3 {r['P3_best']:.3f} vs ceiling {r['P3_ceiling_best']:.3f} -> {r['P3_of_ceiling_best']:.3f}"
                      if "P3_best" in r else ""))
    out.append("  kernel share of the ring time (busiest rank's wall time in block kernels / ring time): "
               + "; ".join(f"N/P={r['s_local']} " + " ".join(f"{lay[:3]} {r[f'kernel_share_{lay}']:.2f}"
                                                            for lay in lays) for r in res["timing"]))
    for r in res.get("balance", []):
        out.append(f"  in-ring balance P={r['world']} N/P={r['s_local']}: P2 (kernel thread time, max/mean rank) "
                   + ", ".join(f"{lay} {r[f'P2_ring_{lay}']:.3f}" for lay in lays))
    for h in res.get("heat", []):
        out.append(f"  heat P={h['world']} {h['layout']:<10} N/P={h['s_local']}: P2 exact pairs {h['P2_pairs']:.3f}, "
                   f"measured blocks {h['P2_measured']:.3f}; critical path {h['critical_s'] * 1e3:.1f} ms "
                   f"({h['critical_pairs'] / h['s_local'] ** 2:.2f} S^2 pairs)")
    for m in res.get("memory", []):
        what = f"{m['layers']} Llama-style layers" if m.get("layers") else "the attention op"
        out.append(f"  P5 {what}, Hq={m['shape']['q_heads']} Hkv={m['shape']['kv_heads']}, cap {m['cap_bytes'] / 2**20:.0f} MiB "
                   "per rank (striped ring fwd+bwd peak RSS): "
                   + ", ".join(f"P={w} N_max={n} ({m['P5'][w]:.2f}x = {m['P5'][w] / w:.2f} P)"
                               for w, n in m["n_max"].items()))
    if "planner" in res:
        pl = res["planner"]
        out.append(f"  planner: {pl['tflops'] * 1e3:.1f} GFLOP/s from the causal block at N/P={pl['calib_s_local']}, "
                   f"link {pl['link_gbps']:.2f} GB/s; predicted/measured - 1:")
        for c in pl["checks"]:
            out.append(f"    P={c['world']} N/P={c['s_local']:5d} {c['layout']:<10} predicted "
                       f"{c['predicted_s'] * 1e3:9.1f} ms measured {c['measured_s'] * 1e3:9.1f} ms  "
                       f"error {c['error']:+.1%}; tile-aware model {c['tile_predicted_s'] * 1e3:9.1f} ms "
                       f"error {c['tile_error']:+.1%}")
    return "\n".join(out)


def markdown(res: dict) -> str:
    """docs/performance.md's tables: every number from this one run."""
    cfg, sh = res["config"], res["shape"]
    lays = cfg["layouts"]
    err = {(c["s_local"], c["layout"]): (c["error"], c["tile_error"]) for c in res.get("planner", {}).get("checks", [])}
    out = [f"`{_command(res)}` ({res['started']}, torch {res['torch']}, {_load(res)}): P = {cfg['world']} CPU "
           f"ranks x 1 thread, gloo, B={sh['batch']} Hq={sh['q_heads']} Hkv={sh['kv_heads']} D={sh['head_dim']} "
           f"{cfg['dtype']}, causal forward+backward, median of {cfg['iters']}.", ""]
    out.append("| N/P | N | " + " | ".join(f"{lay} ms" for lay in lays)
               + " | ideal ms | P3 (ceiling) | P4 (kernel ceiling) [vs concurrent ideal] " + " / ".join(lays) + " | P2 striped / contiguous | "
               "bytes / formula | tools/plan.py error (tile-aware) " + " / ".join(lays) + " |")
    out.append("|" + "---|" * (8 + len(lays)))
    for r in res["timing"]:
        cells = [str(r["s_local"]), str(r["n"])] + [f"{r[f'ring_{lay}_s'] * 1e3:.0f}" for lay in lays]
        cells.append(f"{r['ideal_s'] * 1e3:.0f}" if "ideal_s" in r else "-")
        cells.append(f"{r['P3']:.2f} ({r['P3_ceiling']:.2f})" if r.get("P3_ceiling") else "-")
        cells.append(" / ".join(f"{r[f'P4_{lay}']:.2f} ({r[f'P4_ceiling_{lay}']:.2f})"
                                + (f" [{r[f'P4_concurrent_{lay}']:.2f}]" if "ideal_concurrent_s" in r else "")
                                for lay in lays) if "ideal_s" in r else "-")
        cells.append(f"{r.get('P2_ring_striped', float('nan')):.2f} / {r.get('P2_ring_contiguous', float('nan')):.2f}")
        ratios = {round(r[f"bytes_ratio_{k}_{lay}"], 3) for lay in lays for k in ("fwd", "fwd_bwd")}
        cells.append(" ".join(f"{x:.2f}" for x in sorted(ratios)))
        cells.append(" / ".join(f"{err[(r['s_local'], lay)][0]:+.0%} ({err[(r['s_local'], lay)][1]:+.0%})"
                                for lay in lays if (r["s_local"], lay) in err))
        out.append("| " + " | ".join(cells) + " |")
    if res.get("paired"):
        out += ["", f"P3 and P4 in one time window (each of {res['paired'][0]['iters']} iterations: the ring of every "
                "layout on every rank, then the ideal alone, then one causal block on every rank at once and alone, "
                "then the full and strictly causal blocks alone; medians of per-iteration ratios, and in brackets "
                "the ratios of the best times, as timeit reports):", "",
                "| N/P | P3 (ceiling) → of ceiling [best] | " + " | ".join(f"P4 {lay} [best]" for lay in lays)
                + " | machine parallel efficiency |", "|" + "---|" * (3 + len(lays))]
        for r in res["paired"]:
            p3 = (f"{r['P3']:.2f} ({r['P3_ceiling']:.2f}) → {r['P3_of_ceiling']:.2f} [{r['P3_of_ceiling_best']:.2f}]"
                  if "P3" in r else "-")
            out.append(f"| {r['s_local']} | {p3} | "
                       + " | ".join(f"{r[f'P4_{lay}']:.2f} [{r[f'P4_best_{lay}']:.2f}]" for lay in lays)
                       + f" | {r['parallel_efficiency']:.2f} |")
    if res.get("heat"):
        out += ["", "| layout | P | N/P | P2 exact pairs | P2 measured blocks | critical path (S^2 pairs) |",
                "|---|---|---|---|---|---|"]
        for h in res["heat"]:
            out.append(f"| {h['layout']} | {h['world']} | {h['s_local']} | {h['P2_pairs']:.3f} | "
                       f"{h['P2_measured']:.3f} | {h['critical_s'] * 1e3:.0f} ms ({h['critical_pairs'] / h['s_local'] ** 2:.2f}) |")
    for m in res.get("memory", []):
        what = f"{m['layers']} Llama-style layers (RMSNorm, projections, ring, SwiGLU)" if m.get("layers") else "attention op"
        out += ["", f"P5, {what}, cap {m['cap_bytes'] / 2**20:.0f} MiB per rank, Hq={m['shape']['q_heads']} "
                f"Hkv={m['shape']['kv_heads']}: " + ", ".join(
                    f"P={w}: N_max {n} ({m['P5'][w]:.2f}x)" for w, n in m["n_max"].items())]
    return "\n".join(out) + "\n"
