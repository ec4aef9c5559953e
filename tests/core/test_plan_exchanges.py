"""The planner's K/V exchange comparison (Note [Plan exchanges] in tools/plan_exchanges.py): bytes are the wire
formulas the multi-rank tests count on the wire, times follow the overlap model by hand, and the
recommendation follows the times and the memory budget."""

from __future__ import annotations

import json
import math

import pytest

from cp_dtensor.core.plan import wire
from cp_dtensor.tools import plan as P
from cp_dtensor.tools.cli import main

# the 128k example's model (hidden 8192, 64 heads, 8 KV heads, bf16) on 4 nodes x 8 GPUs
BIG = dict(seq_len=128 * 1024, cp=32, head_dim=128, q_heads=64, kv_heads=8, dtype="bf16", tflops=400.0)
LINKS = dict(island=8, intra_gbps=450.0, inter_gbps=50.0)


@pytest.mark.parametrize("hq,hkv", [(64, 8), (8, 2), (12, 6), (4, 1)])
@pytest.mark.parametrize("comm", [None, "fp8"])
def test_exchange_bytes_are_the_wire_formulas(hq, hkv, comm):
    inp = P.PlanInput(seq_len=8192, cp=8, head_dim=64, q_heads=hq, kv_heads=hkv, dtype="bf16", comm_dtype=comm,
                      tflops=100.0)
    kw = dict(b=1, dqk=64, dv=64, itemsize=2, fp8=comm == "fp8")
    by_name = {x.name: x for x in P.compare_exchanges(inp, island=8, intra_gbps=400.0, inter_gbps=50.0)}
    want = {"ring": wire.ring_bytes(p=8, s_local=1024, hkv=hkv, **kw),
            "allgather": wire.allgather_bytes(p=8, s_local=1024, hkv=hkv, **kw)}
    for u in (2, 4, 8):
        if hq % u:
            continue
        r = 8 // u
        for x in ("ring", "allgather"):
            if x == "allgather" and r == 1:
                continue
            name = f"{u}x{r} {x}" if r > 1 else f"{u}x1 (Ulysses)"
            if comm == "fp8":  # the all-to-alls always move the input dtype; only the ring's K/V is fp8
                continue
            want[name] = wire.ulysses_bytes(u=u, r=r, s_local=1024, hq=hq, hkv=hkv, kv_exchange=x, **kw)
    assert set(want) <= set(by_name)
    for name, w in want.items():
        got = by_name[name]
        assert (got.fwd_bytes, got.bwd_bytes) == (w["fwd"], w["bwd"]), name


def test_ulysses_candidates_follow_the_rules():
    names = [x.name for x in P.compare_exchanges(P.PlanInput(**BIG), **LINKS)]
    # U divides P = 32, U <= island 8, Hq = 64 divisible by U
    assert names == ["ring", "allgather", "2x16 ring", "2x16 allgather", "4x8 ring", "4x8 allgather",
                     "8x4 ring", "8x4 allgather"]
    odd = P.PlanInput(**{**BIG, "q_heads": 24, "kv_heads": 8})  # 24 % 16 != 0 would not matter: 16 > island
    assert [x.ulysses for x in P.compare_exchanges(odd, **LINKS)] == [1, 1, 2, 2, 4, 4, 8, 8]
    twelve = P.PlanInput(**{**BIG, "q_heads": 12, "kv_heads": 4})  # 8 does not divide 12: not a candidate
    assert [x.ulysses for x in P.compare_exchanges(twelve, **LINKS)] == [1, 1, 2, 2, 4, 4]
    with pytest.raises(ValueError, match="must divide"):
        P.compare_exchanges(P.PlanInput(**{**BIG, "q_heads": 24}), ulysses=[16], **LINKS)
    with pytest.raises(ValueError, match="tflops"):
        P.compare_exchanges(P.PlanInput(**{**BIG, "tflops": None}), **LINKS)


def test_allgather_times_by_hand():
    # P = 2 inside one island, Hkv even: 2 chunks; everything small enough to compute by hand
    inp = P.PlanInput(seq_len=4096, cp=2, head_dim=64, q_heads=4, kv_heads=2, dtype="bf16", tflops=1.0)
    ag = {x.name: x for x in P.compare_exchanges(inp, island=8, intra_gbps=1.0, inter_gbps=1.0)}["allgather"]
    s = 2048
    kv = 2 * s * 2 * 64 * 2  # K and V of this rank, bytes
    pairs = max(P._rank_pairs(inp))
    c_f = pairs * 4 * 4 * 64 / 1e12 / 2  # one chunk's forward
    c_b = 2.5 * c_f
    g = rs = kv / 2 / 1e9  # one chunk's gather, reduce-scatter ((P - 1) = 1 block)
    assert ag.fwd_s == pytest.approx(g + max(c_f, g) + c_f)
    assert ag.bwd_s == pytest.approx(g + max(c_b, g + rs) + c_b + rs)
    assert ag.exposed_s == pytest.approx(ag.fwd_s + ag.bwd_s - 2 * (c_f + c_b))


def test_ulysses_all_to_alls_are_exposed():
    inp = P.PlanInput(**BIG)
    ex = {x.name: x for x in P.compare_exchanges(inp, **LINKS)}
    u, r = 4, 8
    inner = P.PlanInput(**{**BIG, "cp": r, "q_heads": 64 // u, "kv_heads": math.lcm(8, u) // u})
    ring_inner = {x.name: x for x in P.compare_exchanges(inner, island=8, intra_gbps=50.0, inter_gbps=50.0,
                                                         ulysses=[])}["ring"]
    a2a = wire.ulysses_bytes(u=u, r=r, b=1, s_local=4096, hq=64, hkv=8, dqk=128, dv=128, itemsize=2)["fwd"] \
        - wire.ring_bytes(p=r, b=1, s_local=4 * 4096, hkv=2, dqk=128, dv=128, itemsize=2)["fwd"]
    got = ex["4x8 ring"]
    assert got.fwd_s == pytest.approx(ring_inner.fwd_s + a2a / 450e9)
    assert got.bwd_s == pytest.approx(ring_inner.bwd_s + a2a / 450e9)


def test_recommendation_follows_the_links_and_the_budget():
    fast = P.compare_exchanges(P.PlanInput(**BIG), **LINKS)
    assert P.recommend(fast).name == "ring"  # compute/comm 2: the ring hides; nothing to gain
    slow = P.compare_exchanges(P.PlanInput(**BIG), island=8, intra_gbps=450.0, inter_gbps=12.5)
    ring = next(x for x in slow if x.name == "ring")
    assert ring.compute_over_comm < 1 and ring.exposed_s > 0.01  # the 1-D ring is exposed at 12.5 GB/s
    best = P.recommend(slow)
    assert best.ulysses > 1 and best.total_s < ring.total_s
    # a budget that only the ring meets (allgather and U x R hold more)
    mem = sorted(x.memory_total for x in slow)
    only = P.recommend(slow, mem_budget_gib=mem[0] / 2**30)
    assert only.memory_total == mem[0]
    assert P.recommend(slow, mem_budget_gib=mem[0] / 2**30 / 2) is None


def test_cli_compares_exchanges(capsys):
    args = ["plan", "--seq-len", "128k", "--cp", "32", "--hidden", "8192", "--heads", "64", "--kv-heads", "8",
            "--tflops", "400", "--island", "8", "--intra-gbps", "450", "--inter-gbps", "12.5"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "K/V exchanges on 32 ranks" in text and "<- recommended" in text
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["recommended"] == P.recommend(P.compare_exchanges(
        P.PlanInput(**BIG), island=8, intra_gbps=450.0, inter_gbps=12.5)).name
    assert len(d["exchanges"]) == 8
    with pytest.raises(SystemExit):
        main(args[:-2])  # --inter-gbps missing
    assert "needs all of --island" in capsys.readouterr().err
