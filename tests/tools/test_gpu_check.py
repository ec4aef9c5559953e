"""scripts/benchmarks/gpu_check.py on CPU: --cpu-smoke runs the sections' code (ranks launched as on a GPU, gloo,
the ring and the document exchange vs float64 on every rank, every SDPA backend choice on DTensors, the
simulation, tiling, the planner side of the memory check; the slow tier adds the compiled ring and the
transformers models); the CUDA-only parts report "skipped". The verdict logic -- NaN is a failure, every
rank counts, a stall is stopped with every rank's stacks -- is checked on made-up results and ranks."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from _tiers import slow

from cp_dtensor.core.plan.layout import LAYOUTS
from cp_dtensor.tools.plan import PlanInput, memory_bytes

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
BENCH = os.path.join(ROOT, "scripts", "benchmarks")
SCRIPT = os.path.join(BENCH, "gpu_check.py")


def _module(name="gpu_check"):
    """The script's module ``name`` (one instance: the rank helpers keep per-process state)."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    return importlib.import_module(name)


def _smoke(tmp_path, *extra):
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(tmp_path), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "gpu_check.json").read_text()), (tmp_path / "gpu_check.md").read_text()


def test_cpu_smoke_runs_every_section(tmp_path):
    res, md = _smoke(tmp_path, "--skip", "compile", "models", "--layouts", "striped")  # the rest: slow tier
    _check_smoke(res, md, ["striped"])


def _check_smoke(res, md, layouts):
    assert res["ok"] and res["config"]["ranks"] == 2 and res["ring_group"]["status"] == "ok"
    # (a) every layout x case and the document exchange on the cases with documents, each rank against
    # float64 within its dtype's tolerance, none exact by accident, nothing non-finite
    ring = _module("_gpu_ring")
    want = {(lay, c[0]) for lay in layouts for c in ring.RING_CASES} | {("documents", c[0]) for c in ring.DOC_CASES}
    assert {(r["layout"], r["case"]) for r in res["ring"]} == want and len(res["ring"]) == len(want)
    for r in res["ring"]:
        assert r["ok"] and len(r["per_rank_worst"]) == 2 and all(0 < w <= r["tol"] for w in r["per_rank_worst"]), r
        assert set(r["errors"]) >= {"out", "dq", "dk", "dv"} and r["per_rank_nonfinite"] == [0, 0]
        assert ("dsinks" in r["errors"]) == ("sinks" in r["case"])
    # every SDPA backend choice: the ring (K/V all-to-alls only) or, where CPU has no such kernel, "unavailable"
    status = {r["backend"]: r["status"] for r in res["sdpa"]}
    assert status == {"flash": "ring", "default bf16 GQA": "ring", "efficient": "unavailable", "efficient bf16": "unavailable",
                      "cudnn": "unavailable", "math": "ring", "default fp32 GQA": "ring", "default fp64": "ring"}, status
    for r in res["sdpa"]:
        assert r["ok"], r
        if r["status"] == "ring":
            assert r["comm"]["forward"] == {"all_to_all_single": 1} and set(r["comm"]["backward"]) == {"all_to_all_single"}
    # (b) and the measured side of (d) need CUDA; the planner side is the planner's, for the CPU's kernels
    assert res["sync"]["status"] == "skipped" and res["sync"]["syncs"] == []
    mem = res["memory"]
    assert mem["status"] == "skipped" and mem["per_rank"] == [None, None]
    assert mem["planned"] == memory_bytes(PlanInput(seq_len=mem["seq_len"], cp=2, head_dim=mem["head_dim"], q_heads=mem["q_heads"],
                                                    kv_heads=mem["kv_heads"], dtype="bf16", device="cpu"))
    # (c) the simulation is checked, then timed per layout; (f) tiling against float64
    assert [r["layout"] for r in res["simulation"]] == layouts and all(r["ok"] for r in res["simulation"])
    assert [r["layout"] for r in res["overhead"]] == layouts and all(r["ratio"] > 0 for r in res["overhead"])
    assert set(res["tiling"]["rows"]) == {"untiled", "tiled"} and res["tiling"]["ok"]
    for part in ("## (a)", "## (b)", "## (c)", "## (d)", "## (f)", "PASS", " / "):
        assert part in md


@slow("the whole --cpu-smoke: every layout, the compiled ring and the transformers models (~2 minutes on 2 cores)")
def test_cpu_smoke_whole(tmp_path):
    t0 = time.perf_counter()
    res, md = _smoke(tmp_path)
    _check_smoke(res, md, list(LAYOUTS))
    assert res["models_group"]["status"] == "ok", md
    (c,) = res["compile"]
    assert c["ok"] and c["per_rank_worst"][0] > 0 and "out vs eager" in c["errors"]
    cases = [r["case"] for r in res["models"]]
    assert len(cases) == 5 and cases[-1].startswith("gpt-oss striped N=1024")
    for r in res["models"]:
        assert r["ok"] and r["status"] == "ok" and 0 < r["worst"] <= 2 * r["err_cp1_bf16"] + 2e-2, r
    assert "## (e)" in md and time.perf_counter() - t0 < 600


def test_compare_counts_non_finite_and_worst_reads_nan_as_inf():
    ranks = _module("_gpu_ranks")
    want = torch.ones(4, 3, dtype=torch.float64)
    assert ranks.compare(want + 1e-3, want) == dict(err=pytest.approx(1e-3), nonfinite=0)
    got = want.clone()
    got[0, 0], got[2] = float("nan"), float("inf")
    r = ranks.compare(got, want)
    assert math.isinf(r["err"]) and r["nonfinite"] == 4 and r["ref_nonfinite"] == 0
    # max() over a NaN depends on the order; worst() does not
    assert ranks.worst([1e-3, float("nan")]) == math.inf == ranks.worst([float("nan"), 1e-3])
    assert ranks.worst([1e-3, 2e-3]) == 2e-3 and ranks.worst([]) == math.inf


def _row(case, w, ok=True, nonfinite=0):
    return dict(section="ring", layout="striped", case=case, worst=w, ok=ok, nonfinite_total=nonfinite, tol=3e-2)


def test_merge_keeps_every_rank_and_fails_on_any():
    ranks = _module("_gpu_ranks")
    merged = ranks.merge_rows([[_row("a", 1e-3), _row("b", 1e-3)], [_row("a", 2e-3), _row("b", math.inf, False, 7)]],
                              ("layout", "case"))
    a, b = merged
    assert a["ok"] and a["per_rank_worst"] == [1e-3, 2e-3] and a["worst"] == 2e-3
    assert not b["ok"] and b["per_rank_nonfinite"] == [0, 7] and math.isinf(b["worst"])
    # a case one rank never finished fails
    (c,) = ranks.merge_rows([[_row("c", 1e-3)], []], "case")
    assert not c["ok"] and c["per_rank_worst"] == [1e-3, None]
    gc = _module()
    md = gc._per_rank(b)
    assert "inf" in md and "non-finite per rank: [0, 7]" in md


def _hang(cfg, rank, world, device):
    """Rank 0 finishes one case, then waits in a collective that rank 1 never joins (rank 1 sleeps)."""
    ranks = sys.modules["_gpu_ranks"]
    ranks.record("ring", _row("before the stall", 1e-3))
    ranks.progress("start the stalled case")
    if rank == 0:
        torch.distributed.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def test_stall_is_stopped_with_every_ranks_stacks():
    ranks = _module("_gpu_ranks")
    cfg = dict(device="cpu", threads=1, stall_s=2, collective_timeout=120)
    torch.set_num_threads(1)
    g = ranks.run_group("hang", _hang, cfg, 2, timeout=6, start_method="fork")
    assert g["status"] == "stalled" and g["stalled"] == [0, 1] and g["seconds"] < 30
    assert [len(rows) for rows in ranks.rows_of(g, "ring")] == [1, 1]  # what finished before the stall is kept
    assert "all_reduce" in g["stacks"][0] and "time.sleep" not in g["stacks"][0] and "_hang" in g["stacks"][1]
    assert all(text.count("most recent call first") >= 2 for text in g["stacks"].values())  # repeated dumps
    md = "\n".join(ranks.stall_summary(g))
    assert "rank 0: stalled in `the stalled case`" in md and "rank 1: stalled" in md


def _boom(cfg, rank, world, device):
    """Rank 1 raises; rank 0 waits for it in a collective."""
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    torch.distributed.all_reduce(torch.ones(1))


def test_crash_stops_the_group_with_the_tracebacks():
    ranks = _module("_gpu_ranks")
    torch.set_num_threads(1)
    g = ranks.run_group("boom", _boom, dict(device="cpu", threads=1, stall_s=30, collective_timeout=120), 2,
                        timeout=60, start_method="fork")
    # rank 0's collective fails too once gloo sees its peer gone (or it is stopped at once): never a wait
    assert g["status"] == "crashed" and 1 in g["crashed"] and sorted(g["stacks"]) == [0, 1] and g["seconds"] < 30
    (crash,) = [x for x in g["ranks"][1] if x["section"] == "_crash"]
    assert "boom on rank 1" in crash["error"] and "_boom" in crash["trace"]


def test_watch_syncs_counts_syncs_not_torchs_notices():
    ring = _module("_gpu_ring")
    with ring.watch_syncs(False) as (syncs, notices):
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert len(syncs) == 1 and "called a synchronizing" in syncs[0]
    assert len(notices) == 1 and "prototype feature" in notices[0]


@pytest.mark.parametrize("argv, match", [([], "no CUDA device"), (["--cpu-smoke", "--seq-len", "100"], "multiple of")])
def test_refuses_bad_invocations(argv, match):
    gc = _module()
    if argv == [] and gc.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match=match):
        gc.main(argv)
