"""The pure parts of scripts/benchmarks/bench_ring.py and scripts/benchmarks/gpu_check.py (_gpu_sim.py, _gpu_ring.py), against independent references."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from cp_dtensor.core.plan.layout import LAYOUTS
from cp_dtensor.tools.plan import PlanInput, make_plan

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "benchmarks")
sys.path.insert(0, SCRIPTS)
import _gpu_ring as gpu_ring  # noqa: E402
import _gpu_sim as gpu_sim  # noqa: E402

import _bench_mem as bench_mem  # noqa: E402
import _bench_work as bench_work  # noqa: E402


@pytest.mark.parametrize("layout", LAYOUTS)
def test_work_table_is_the_exact_pair_count(layout):
    """The heat map's table (layout.step_pairs, as the planner counts) against a brute-force count over
    global positions."""
    for world in (1, 2, 3, 4, 8):
        for s_local in (2, 4, 6):
            table = bench_work.work_table(layout, world, s_local)
            assert table == bench_work.brute_force_table(layout, world, s_local), (layout, world, s_local)


def test_work_table_closed_forms():
    """The docs' P = 4, N = 64 pair totals (how_it_works.md, section 4) and the balance ratios."""
    totals = {lay: [sum(row) for row in bench_work.work_table(lay, 4, 16)] for lay in LAYOUTS}
    assert totals["contiguous"] == [136, 392, 648, 904]
    assert totals["striped"] == [496, 512, 528, 544]
    assert totals["headtail"] == [520] * 4
    assert bench_work.balance(bench_work.work_table("headtail", 8, 64)) == 1.0
    contiguous = bench_work.work_table("contiguous", 8, 64)
    assert bench_work.balance(contiguous) == pytest.approx(15 / 8, rel=0.01)  # (P - 1/2) / (P / 2)
    assert bench_work.critical_path(contiguous) == 64 * 65 // 2 + 7 * 64 * 64


def test_calibration_inverts_the_planner():
    """A time made from the planner's own FLOPs at a rate must calibrate back to that rate."""
    plan = make_plan(PlanInput(seq_len=1024, cp=1, head_dim=64, q_heads=4, kv_heads=2, dtype="fp32"))
    t = plan.fwd_bwd_flops_max_rank / 2.5e10
    assert bench_work.calibrate_tflops(t, s_local=1024, batch=1, q_heads=4, head_dim=64) == pytest.approx(0.025)
    # a ring with free communication at that rate takes the critical path's FLOPs over the rate
    pred = bench_work.plan_ring_seconds(layout="contiguous", world=2, s_local=1024, batch=1, q_heads=4,
                                        kv_heads=2, head_dim=64, dtype=torch.float32, tflops=0.025, link_gbps=1e9)
    pairs = 1024 * 1025 // 2 + 1024 * 1024  # step 0 causal, step 1 full on rank 1
    assert pred == pytest.approx(pairs * 4 * 4 * 64 * 3.5 / 2.5e10, rel=1e-6)


def test_search_max_finds_the_largest_fit():
    for limit in (100, 200, 1000, 1024, 4095, 5000, 70000):
        seen = []

        def fits(s):
            seen.append(s)
            return s <= limit

        best = bench_mem.search_max(fits, start=512, unit=64)
        assert best <= limit and best % 64 == 0
        assert limit - best < max(64, best / 64 + 64), (limit, best)
        assert len(seen) < 20
    assert bench_mem.search_max(lambda s: False, start=512, unit=64) == 0


def test_peak_memory_sees_an_allocation():
    # as the probes do: without a fixed mmap threshold, glibc may serve the 16 MiB from heap pages an earlier
    # test made resident and freed (the dynamic threshold rises past 16 MiB), and the peak reads 0
    bench_mem._libc_live_memory()
    base = bench_mem.reset_peak()
    x = torch.ones(16 * 2**20 // 4)  # 16 MiB, touched
    peak = bench_mem.peak_since(base)
    del x
    assert 15 * 2**20 < peak < 64 * 2**20


@pytest.mark.parametrize("layout", LAYOUTS)
def test_simulated_ring_matches_float64(layout):
    """gpu_check's one-process ring (block kernels + ring.py's merge, its P7 section) in fp32 against
    float64 attention by the textbook formula, and its per-group float64 reference against that formula."""
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 4, 48, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 48, 16, generator=g) for _ in range(2))
    ref = gpu_ring.reference(q, k, v, do, is_causal=True)[:4]  # scale D ** -0.5 = 0.25
    by_group = gpu_sim.reference_by_group(q, k, v, do, scale=0.25, dtype=torch.float64)
    for x, r in zip(by_group, ref):
        assert gpu_sim.abs_rel_err(x, r) < 1e-12
    for world in (1, 3, 4):
        got = gpu_sim.simulate(q, k, v, do, layout=layout, world=world, scale=0.25)
        for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
            assert gpu_sim.abs_rel_err(x, r) < 2e-5, (layout, world, name)


def test_tile_pairs_counts_whole_kv_tiles():
    """The tile model against a brute-force walk over the kernel's (query tile, kv tile) grid."""
    for rows in (100, 256, 767, 768, 1000, 2048):
        q_tile = 256 if rows >= 768 else 64 if rows >= 192 else 32
        brute = 0
        for m in range(0, rows, q_tile):
            qb = min(q_tile, rows - m)
            for n in range(0, rows, 512):  # a kv tile is computed iff its first key is visible to the tile's last row
                if n <= m + qb - 1:
                    brute += qb * min(512, rows - n)
        assert bench_work.tile_pairs(rows, rows, True) == brute, rows
    assert bench_work.tile_pairs(300, 200, False) == 60000


def test_mask_balance_counts_the_kept_pairs():
    """bench_masks.py's per-rank work (docs/performance.md's balance table) against a brute-force count over
    global positions: the pairs each rank's queries keep, causal within packed documents."""
    import bench_masks

    from cp_dtensor.core.plan.layout import global_order

    for seed, (world, n) in enumerate(((2, 48), (3, 36), (4, 64))):
        ids = bench_masks.doc_ids(n, 5, lognormal=True, seed=seed)
        for layout in LAYOUTS:
            order = global_order(layout, world, n)  # positions of the shards, rank by rank
            s = n // world
            want = []
            for r in range(world):
                pos = order[r * s : (r + 1) * s]
                same = ids[0, pos][:, None] == ids[0][None, :]
                want.append(int((same & (torch.arange(n)[None, :] <= pos[:, None])).sum()))
            assert bench_masks.kept(layout, world, n, ids, None) == want, (layout, world)


def test_bench_masks_cli(tmp_path):
    """bench_masks.py end to end at tiny sizes: every case timed, the balance plot written."""
    import json
    import subprocess

    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "bench_masks.py"), "--s-local", "64", "--iters", "1",
         "--balance-n", "4096", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "masks.json").read_text())
    import bench_masks

    assert set(res["timing"]) == {c[0] for c in bench_masks.CASES}
    assert all(r["efficiency"] > 0 for r in res["timing"].values())
    assert res["timing"]["docs 512 striped, no transfers"]["kv_bytes"] == 0  # the probe moves nothing
    assert res["timing"]["docs 512 striped"]["kv_bytes"] > 0
    assert (tmp_path / "mask_balance.png").stat().st_size > 0
