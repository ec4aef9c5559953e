"""The plots of bench_ring.py, from its JSON record: time vs N, the per-(rank, step) work heat map, memory vs N;
and bench_masks.py's balance of packed documents over ranks."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"striped": "tab:blue", "headtail": "tab:green", "contiguous": "tab:red"}


def time_vs_n(res: dict, path: str) -> str:
    rows, shape = res["timing"], res["shape"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = [r["n"] for r in rows]
    preds = {(c["s_local"], c["layout"]): c["predicted_s"] for c in res.get("planner", {}).get("checks", [])}
    for layout, color in COLORS.items():
        if f"ring_{layout}_s" not in rows[0]:
            continue
        ax.plot(ns, [r[f"ring_{layout}_s"] for r in rows], "o-", color=color, label=f"ring {layout}")
        if preds:
            ax.plot(ns, [preds[(r["s_local"], layout)] for r in rows], ":", color=color, alpha=0.7)
    if "ideal_s" in rows[0]:
        ax.plot(ns, [r["ideal_s"] for r in rows], "k--", label="ideal: full-sequence SDPA / P")
    ax.plot([], [], "k:", label="planner prediction")
    ax.set(xscale="log", yscale="log", xlabel="global sequence length N (tokens)", ylabel="fwd+bwd seconds",
           title=f"Causal ring fwd+bwd, P={rows[0]['world']} CPU ranks x 1 thread\n"
                 f"Hq={shape['q_heads']} Hkv={shape['kv_heads']} D={shape['head_dim']} "
                 f"{res['config']['dtype']}, N/P {rows[0]['s_local']}..{rows[-1]['s_local']}")
    ax.set_xticks(ns, [f"{n // 1024}k" if n >= 1024 else str(n) for n in ns])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def work_heatmap(res: dict, path: str) -> str:
    """Rows: heat-map worlds; columns: layouts. Colour: measured block seconds; text: exact pairs / S^2."""
    heat = res["heat"]
    worlds = sorted({h["world"] for h in heat})
    layouts = [lay for lay in ("contiguous", "striped", "headtail") if any(h["layout"] == lay for h in heat)]
    fig, axes = plt.subplots(len(worlds), len(layouts), figsize=(3.6 * len(layouts), 3.3 * len(worlds)),
                             squeeze=False)
    for i, world in enumerate(worlds):
        vmax = max(max(map(max, h["seconds"])) for h in heat if h["world"] == world) * 1e3
        for j, layout in enumerate(layouts):
            h = next(h for h in heat if h["world"] == world and h["layout"] == layout)
            ax = axes[i][j]
            ms = [[x * 1e3 for x in row] for row in h["seconds"]]
            im = ax.imshow(ms, cmap="viridis", vmin=0, vmax=vmax)
            s2 = h["s_local"] ** 2
            if world <= 8:
                for r, row in enumerate(h["pairs"]):
                    for t, pairs in enumerate(row):
                        ax.text(t, r, f"{pairs / s2:.2g}", ha="center", va="center", fontsize=7 if world <= 4 else 5.5,
                                color="white" if ms[r][t] < 0.6 * vmax else "black")
            ax.set_title(f"{layout}, P={world}: P2 {h['P2_measured']:.2f} (exact {h['P2_pairs']:.2f})\n"
                         f"critical path {h['critical_s'] * 1e3:.0f} ms", fontsize=9)
            ax.set_xlabel("ring step t")
            ax.set_ylabel("rank")
            ax.set_xticks(range(world))
            ax.set_yticks(range(world))
        fig.colorbar(im, ax=axes[i].tolist(), label="fwd+bwd kernel ms", shrink=0.85)
    fig.suptitle(f"Causal work per (rank, step), N/P={heat[0]['s_local']}: colour measured block time, "
                 "text kept pairs / S^2", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def memory_vs_n(res: dict, path: str) -> str:
    """One panel per searched head shape: measured peak per rank vs N for each P, the cap, tools/plan.py's estimate."""
    mems = res["memory"]
    fig, axes = plt.subplots(1, len(mems), figsize=(5.6 * len(mems), 4.2), squeeze=False)
    for ax, m in zip(axes[0], mems):
        for world in sorted({p["world"] for p in m["probes"]}):
            probes = sorted((p for p in m["probes"] if p["world"] == world), key=lambda p: p["n"])
            ns = [p["n"] for p in probes]
            line, = ax.plot(ns, [p["peak_bytes"] / 2**20 for p in probes], "o-",
                            label=f"P={world}: N_max {m['n_max'][world]} (P5 {m['P5'][world]:.2f})")
            if not m.get("layers"):  # tools/plan.py models the attention layer only
                ax.plot(ns, [p["plan_bytes"] / 2**20 for p in probes], ":", color=line.get_color(), alpha=0.8)
            ax.axvline(m["n_max"][world], color=line.get_color(), alpha=0.25)
        ax.axhline(m["cap_bytes"] / 2**20, color="k", ls="--", label=f"cap {m['cap_bytes'] / 2**20:.0f} MiB")
        if not m.get("layers"):
            ax.plot([], [], "k:", label="tools/plan.py memory estimate")
        sh = m["shape"]
        ax.set(xscale="log", xlabel="global sequence length N (tokens)", ylabel="peak MiB per rank",
               title=f"Hq={sh['q_heads']} Hkv={sh['kv_heads']} D={sh['head_dim']} {res['config']['dtype']}"
               + (f", {m['layers']} Llama-style layers" if m.get("layers") else ", attention op"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Striped ring fwd+bwd: peak resident memory per rank (VmHWM above the pre-call RSS, fresh ranks)"
                 "; dotted: tools/plan.py",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def all_plots(res: dict, out_dir: str) -> list[str]:
    paths = [time_vs_n(res, os.path.join(out_dir, "ring_time_vs_n.png"))]
    if res.get("heat"):
        paths.append(work_heatmap(res, os.path.join(out_dir, "ring_work_heatmap.png")))
    if res.get("memory"):
        paths.append(memory_vs_n(res, os.path.join(out_dir, "ring_memory_vs_n.png")))
    return paths


def mask_balance(rows: list[dict], n: int, path: str) -> str:
    """bench_masks.py's balance rows: kept-pair work max/mean over ranks per layout and P (bars: mean
    of the seeds; ticks: the worst seed)."""
    worlds = sorted({r["world"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    width = 0.8 / len(COLORS)
    for i, (layout, color) in enumerate(COLORS.items()):
        mine = {r["world"]: r for r in rows if r["layout"] == layout}
        xs = [j + (i - (len(COLORS) - 1) / 2) * width for j in range(len(worlds))]
        ax.bar(xs, [mine[w]["max_over_mean"] for w in worlds], width, color=color, label=layout)
        ax.plot(xs, [mine[w]["worst"] for w in worlds], "_", color="k", markersize=12)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(worlds)), [f"P = {w}" for w in worlds])
    ax.set(ylabel="busiest rank's kept pairs / mean",
           title=f"Causal packed documents, log-normal lengths ~2048, N = {n}\n"
                 "per-rank work: bars mean of 3 seeds, ticks the worst seed")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
