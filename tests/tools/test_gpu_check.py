"""scripts/benchmarks/gpu_check.py on CPU: --cpu-smoke runs every section's code (ranks spawned as on a GPU, gloo,
the ring vs float64, every SDPA backend choice on DTensors, the simulation, the planner side of the
memory check); the CUDA-only parts report "skipped". The report logic is checked on made-up results."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest

from cp_dtensor.core.layout import LAYOUTS
from cp_dtensor.tools.plan import PlanInput, memory_bytes

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
SCRIPT = os.path.join(ROOT, "scripts", "benchmarks", "gpu_check.py")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cpu_smoke_runs_every_section(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["ok"] and res["config"]["ranks"] == 2
    # (a) every layout x case, each against float64 within its dtype's tolerance, none exact by accident
    assert {(r["layout"], r["case"]) for r in res["ring"]} == {(lay, r["case"]) for lay in LAYOUTS for r in res["ring"]}
    assert len(res["ring"]) == 8 * len(LAYOUTS)
    for r in res["ring"]:
        assert r["ok"] and 0 < r["worst"] <= r["tol"], r
        assert set(r["errors"]) >= {"out", "dq", "dk", "dv"}
    # every SDPA backend choice: the ring (K/V all-to-alls only) or, where CPU has no such kernel, "unavailable"
    status = {r["backend"]: r["status"] for r in res["sdpa"]}
    assert status == {"flash": "ring", "default bf16 GQA": "ring", "efficient": "unavailable", "cudnn": "unavailable",
                      "math": "ring", "default fp32 GQA": "ring", "default fp64": "ring"}, status
    for r in res["sdpa"]:
        assert r["ok"], r
        if r["status"] == "ring":
            assert r["comm"]["forward"] == {"all_to_all_single": 1} and set(r["comm"]["backward"]) == {"all_to_all_single"}
    # (b) and the measured side of (d) need CUDA
    assert res["sync"]["status"] == "skipped" and res["sync"]["syncs"] == []
    mem = res["memory"]
    assert mem["status"] == "skipped" and mem["per_rank"] == [None, None]
    want = memory_bytes(PlanInput(seq_len=mem["seq_len"], cp=2, head_dim=mem["head_dim"], q_heads=mem["q_heads"],
                                  kv_heads=mem["kv_heads"], dtype="bf16"))
    assert mem["planned"] == want
    # (c) the simulation is checked, then timed per layout
    assert [r["layout"] for r in res["simulation"]] == list(LAYOUTS) and all(r["ok"] for r in res["simulation"])
    assert [r["layout"] for r in res["overhead"]] == list(LAYOUTS)
    assert all(r["ratio"] > 0 and r["ring_s"] > 0 for r in res["overhead"])
    md = (tmp_path / "gpu_check.md").read_text()
    for part in ("## (a)", "## (b)", "## (c)", "## (d)", "PASS"):
        assert part in md


def _rank(ok=True, worst=1e-3, ring=None, sync=None, memory=None):
    row = dict(layout="striped", case="c", dtype="torch.bfloat16", tol=3e-2, errors={"out": worst}, worst=worst, ok=ok)
    sdpa = dict(backend="flash", dtype="torch.bfloat16", status="ring", worst=worst, tol=3e-2,
                comm=dict(forward={"all_to_all_single": 1}, backward={"all_to_all_single": 2}), ok=ok)
    mem = memory or dict(seq_len=64, cp=2, q_heads=4, kv_heads=2, head_dim=16, planned={"total": 1000},
                         status="measured", measured=900, ratio=0.9, ok=True)
    return dict(ring=ring if ring is not None else [row], sdpa=[sdpa],
                sync=sync or dict(status="checked", syncs=[], ok=True), memory=mem)


def _report(gc, per_rank):
    merged = gc.merge_ranks(per_rank)
    config = dict(ranks=2, device="cuda:0", ring_seq_len=64, head_dim=16, sim_world=8, seq_len=256, q_heads=4,
                  kv_heads=2, head_dim_sim=16, check_seq_len=128)
    sim = [dict(layout="striped", ring_err=[1e-3], single_err=[1e-3], ok=True)]
    over = [dict(layout="striped", ring_s=1.1, single_s=1.0, ratio=1.1, vs_striped=1.0, meets_target=True)]
    res = dict(device="test", command="x", config=config, ok=True, seconds=1.0, simulation=sim, overhead=over, **merged)
    return merged, gc.markdown(res)


def test_report_merges_ranks_and_shows_failures():
    gc = _module()
    merged, md = _report(gc, [_rank(), _rank(worst=2e-3)])
    assert all(r["ok"] for r in merged["ring"] + merged["sdpa"]) and merged["ring"][0]["worst"] == 2e-3
    assert merged["memory"]["measured"] == 900 and "0.90" in md
    # one rank's failed case fails the merged row; a section that raised is one failed row
    merged, _ = _report(gc, [_rank(), _rank(ok=False, worst=0.5)])
    assert not merged["ring"][0]["ok"] and merged["ring"][0]["worst"] == 0.5 and not merged["sdpa"][0]["ok"]
    err = dict(status="error", detail="RuntimeError: boom", trace="tb", ok=False)
    merged, md = _report(gc, [_rank(), _rank(ring=err, sync=dict(err), memory=dict(err))])
    assert merged["ring"][0]["status"] == "error" and not merged["ring"][0]["ok"] and not merged["sync"]["ok"]
    assert "boom" in md and "ERROR" in md
    # syncs found on any rank fail (b)
    merged, md = _report(gc, [_rank(), _rank(sync=dict(status="checked", syncs=["ring.py:1: sync"], ok=False))])
    assert not merged["sync"]["ok"] and "ring.py:1: sync" in md and "1 found" in md


def test_watch_syncs_collects_sync_warnings():
    gc = _module()
    with gc.watch_syncs(False) as seen:
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
    assert len(seen) == 1 and "synchronizing" in seen[0]


@pytest.mark.parametrize("argv, match", [([], "no CUDA device"), (["--cpu-smoke", "--seq-len", "100"], "multiple of")])
def test_refuses_bad_invocations(argv, match):
    gc = _module()
    if argv == [] and gc.torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match=match):
        gc.main(argv)
