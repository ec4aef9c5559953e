"""cp_dtensor.plan and ``cp-dtensor plan`` against hand formulas and brute-force mask counts."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
from fractions import Fraction

import pytest

from cp_dtensor.tools import plan as P
from cp_dtensor.tools.cli import main

MiB, GiB = 1 << 20, 1 << 30

# The 128k example (docs/planner.md): N = 128k, P = 8, hidden 8192 over 64 q-heads (D = 128), 8 KV heads, bf16.
EX1 = dict(seq_len=131072, cp=8, head_dim=128, q_heads=64, kv_heads=8, dtype="bf16")
EX1_ARGS = ["plan", "--seq-len", "128k", "--cp", "8", "--hidden", "8192", "--heads", "64", "--kv-heads", "8",
            "--dtype", "bf16"]


def test_exercise_1_bytes_per_step():
    step = P.kv_step_bytes(P.PlanInput(**EX1))
    assert step == 2 * (131072 // 8) * 128 * 8 * 2 == 67_108_864 == 64 * MiB


def test_exercise_1_cli_json(capsys):
    assert main([*EX1_ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["input"]["head_dim"] == 8192 // 64
    assert out["kv_step_bytes"] == 67_108_864
    assert out["fwd_bytes"] == 7 * 67_108_864
    # backward: K/V again + dK/dV accumulators, both bf16 (the ring sends them in the input dtype), 7 hops each
    assert out["bwd_bytes"] == 7 * (67_108_864 + 2 * 16384 * 128 * 8 * 2)


def test_exercise_1_cli_text(capsys):
    main(EX1_ARGS)
    text = capsys.readouterr().out
    assert "67,108,864 B (64.00 MiB)" in text
    assert "S_local=16,384" in text


def test_one_million_tokens():
    # N = 1M = 2**20 tokens, P = 32, D = 128, 8 KV heads, bf16
    inp = P.PlanInput(seq_len=P.parse_tokens("1M"), cp=32, head_dim=128, q_heads=64, kv_heads=8)
    assert inp.s_local == 32768
    assert P.kv_step_bytes(inp) == 2 * 32768 * 128 * 8 * 2 == 128 * MiB
    assert P.make_plan(inp).fwd_bytes == 31 * 128 * MiB
    # what travels past one rank in a full ring, P * step = 2 N D Hkv bytes, does not depend on P
    for cp in (8, 32, 64, 256):
        step = P.kv_step_bytes(P.PlanInput(**{**inp.__dict__, "cp": cp}))
        assert cp * step == 2 * 2**20 * 128 * 8 * 2 == 4 * GiB


def test_fp8_ratio_counts_scales():
    for d in (64, 128, 256):
        base = dict(seq_len=4096, cp=4, head_dim=d, q_heads=32, kv_heads=8, batch=3)
        bf16 = P.kv_step_bytes(P.PlanInput(**base, dtype="bf16"))
        fp8 = P.kv_step_bytes(P.PlanInput(**base, dtype="bf16", comm_dtype="fp8"))
        # 1 byte per element + one int8 exponent per (batch, head, row) vs 2 bytes per element
        assert fp8 == 2 * 3 * 8 * (4096 // 4) * (d + 1)
        assert Fraction(fp8, bf16) == Fraction(d + 1, 2 * d)
        if d == 128:
            assert Fraction(fp8, bf16) == Fraction(129, 256)  # 50.4% of the bf16 bytes


def test_plan_bytes_are_what_the_ring_sends():
    # the planner's K/V step against the very buffer payload.encode_kv puts on the wire
    import torch

    from cp_dtensor.core.exchange.payload import encode_kv

    b, hkv, s, d = 2, 3, 8, 16
    k, v = torch.randn(b, hkv, s, d, dtype=torch.bfloat16), torch.randn(b, hkv, s, d, dtype=torch.bfloat16)
    base = dict(seq_len=s * 4, cp=4, head_dim=d, q_heads=hkv, kv_heads=hkv, batch=b, dtype="bf16")
    fp8 = [("fp8", torch.float8_e4m3fn)] if importlib.util.find_spec("torchao") else []  # the [float8] extra
    for name, comm in [("bf16", None), ("fp32", torch.float32), *fp8]:
        buf = encode_kv(k, v, comm)
        assert P.kv_step_bytes(P.PlanInput(**base, comm_dtype=name)) == buf.numel() * buf.element_size(), name
    assert P.dkv_step_bytes(P.PlanInput(**base)) == 2 * k.numel() * k.element_size()


def test_backward_bytes_twice_forward_in_fp32():
    r = P.make_plan(P.PlanInput(seq_len=1024, cp=8, head_dim=64, q_heads=8, kv_heads=2, dtype="fp32"))
    assert r.bwd_bytes == 2 * r.fwd_bytes
    assert r.fwd_bwd_bytes == 3 * r.fwd_bytes
    r = P.make_plan(P.PlanInput(seq_len=1024, cp=8, head_dim=64, q_heads=8, kv_heads=2, dtype="bf16"))
    assert r.bwd_bytes == 2 * r.fwd_bytes
    # an fp8 payload shrinks the K/V half of the backward, not the bf16 dK/dV accumulators
    r = P.make_plan(P.PlanInput(seq_len=1024, cp=8, head_dim=64, q_heads=8, kv_heads=2, dtype="bf16", comm_dtype="fp8"))
    assert r.bwd_bytes == r.fwd_bytes + 7 * 2 * 128 * 2 * 64 * 2


def _brute_pairs(layout: str, rank: int, src: int, world: int, seq_len: int, causal: bool) -> int:
    from cp_dtensor.core.plan.layout import local_positions

    q = local_positions(layout=layout, rank=rank, cp_size=world, seq_len=seq_len)
    k = local_positions(layout=layout, rank=src, cp_size=world, seq_len=seq_len)
    if not causal:
        return len(q) * len(k)
    return int((k[None, :] <= q[:, None]).sum())


@pytest.mark.parametrize("layout", ["striped", "headtail", "contiguous"])
def test_step_pairs_match_global_causal_mask(layout):
    for world in (1, 2, 3, 4, 5):
        for s_local in (2, 4, 6):
            n = world * s_local
            total = 0
            for rank in range(world):
                for src in range(world):
                    want = _brute_pairs(layout, rank, src, world, n, True)
                    assert P.step_pairs(layout, rank=rank, src=src, s_local=s_local) == want, (world, rank, src)
                    assert P.step_pairs(layout, rank=rank, src=src, s_local=s_local, causal=False) == s_local**2
                    total += want
            assert total == n * (n + 1) // 2  # every kept pair is computed exactly once


def test_step_work_balance_by_layout():
    s, p = 1024, 4
    base = dict(seq_len=s * p, cp=p, head_dim=64, q_heads=4, kv_heads=4)
    steps = {lay: P.make_plan(P.PlanInput(**base, layout=lay)).steps for lay in ("striped", "headtail", "contiguous")}
    for lay in steps:
        assert steps[lay][0].max_pairs == steps[lay][0].min_pairs == s * (s + 1) // 2
    for t in range(1, p):
        # contiguous: some rank does a full block, another nothing
        assert (steps["contiguous"][t].max_pairs, steps["contiguous"][t].min_pairs) == (s * s, 0)
        assert (steps["striped"][t].max_pairs, steps["striped"][t].min_pairs) == (s * (s + 1) // 2, s * (s - 1) // 2)
        assert steps["headtail"][t].max_pairs == steps["headtail"][t].min_pairs == s * s // 2
    # contiguous: the last rank carries the whole lower triangle of its rows
    r = P.make_plan(P.PlanInput(**base, layout="contiguous"))
    assert r.rank_fwd_pairs_max == s * (s + 1) // 2 + (p - 1) * s * s
    assert r.rank_fwd_pairs_mean == (s * p) * (s * p + 1) / 2 / p


def test_flops_hand_formula():
    b, hq, d, s, p = 2, 16, 128, 2048, 4
    r = P.make_plan(P.PlanInput(seq_len=s * p, cp=p, head_dim=d, q_heads=hq, kv_heads=4, batch=b, causal=False))
    assert r.fwd_flops_max_rank == p * 4 * b * hq * s * s * d  # QK^T and PV, 2 FLOPs per multiply-add
    assert r.fwd_bwd_flops_max_rank == 3.5 * r.fwd_flops_max_rank


def test_memory_exercise_1_by_hand():
    m = P.memory_bytes(P.PlanInput(**EX1, layers=4, reserved_gib=1))
    s = 16384
    q, kv, lse = s * 64 * 128 * 2, 2 * s * 8 * 128 * 2, 64 * s * 4  # bytes of q (= out = dO), k + v, lse
    assert m["saved_per_layer"] == 2 * q + kv + lse == 580 * MiB
    # dO, fp32 dq, fp32 own [dk | dv]; P >= 4: the block in use, [dK/dV | K/V] leaving and arriving, this
    # step's share (6 K/V-sized bf16 buffers); flash's backward: fresh dq dk dv, contiguous dO and out,
    # fp32 dq accumulator, dK/dV expanded to 64 heads, fp32 rowsum
    kernel = (q + kv) + 2 * q + 2 * q + 2 * q + lse
    bwd = q + 2 * q + 2 * kv + 6 * kv + kernel
    assert m["backward_messages"] == 6 * kv and m["backward_working_set"] == bwd == 3136 * MiB + lse
    # the block in use and the one arriving, fp32 out and lse, the block's out and lse, its fp32 copy
    assert m["forward_working_set"] == 2 * kv + 2 * q + lse + q + lse + 2 * q == 1408 * MiB + 2 * lse
    assert m["total"] == 4 * 580 * MiB + bwd + GiB


def test_memory_messages_by_ring_size():
    """The backward's messages at their worst step (Note [Plan memory]): none alone, then by P."""
    base = dict(seq_len=4800, head_dim=64, q_heads=4, kv_heads=2, dtype="fp32")
    kv = 2 * 2 * 64 * 4  # bytes of one token's k + v
    for p, want in ((1, 0), (2, 3), (3, 4), (4, 6), (8, 6)):
        m = P.memory_bytes(P.PlanInput(**base, cp=p))
        assert m["backward_messages"] == want * kv * (4800 // p), p
        assert m["forward_messages"] == (2 * kv * (4800 // p) if p > 1 else 0)


def test_memory_against_measured_peaks():
    """The calibration table of docs/planner.md: one striped causal fwd+bwd per rank, measured (the H200's
    torch.cuda.max_memory_allocated, gpu_check.py (d); CPU resident peaks, bench_planner_memory.py) --
    the planner within 15% of each."""
    rows = [  # N, P, Hq, Hkv, D, dtype, device, measured MiB (the largest rank)
        (32768, 4, 32, 8, 128, "bf16", "cuda", 1091),
        (8192, 4, 8, 2, 128, "bf16", "cpu", 46.2),
        (8192, 2, 8, 8, 64, "fp32", "cpu", 112.5),
    ]
    for n, p, hq, hkv, d, dtype, device, measured in rows:
        plan = P.memory_bytes(P.PlanInput(seq_len=n, cp=p, q_heads=hq, kv_heads=hkv, head_dim=d, dtype=dtype,
                                          device=device))["total"] / MiB
        assert abs(plan / measured - 1) <= 0.15, (n, p, device, plan, measured)
    with pytest.raises(ValueError, match="device"):
        P.PlanInput(seq_len=8, cp=1, head_dim=8, q_heads=1, kv_heads=1, device="tpu")


def _hand_total(n, p, d=128, hq=32, hkv=8, layers=32, e=2):
    s = n // p
    saved = (2 * s * hq * d + 2 * s * hkv * d) * e + hq * s * 4
    q, kv, lse = s * hq * d, 2 * s * hkv * d, hq * s * 4  # elements, elements, bytes
    fwd = (2 * kv * e if p > 1 else 0) + q * 4 + lse + q * e + lse + q * 4
    msgs = {1: 0, 2: 3, 3: 4}.get(p, 6) * kv * e
    kernel = (q + kv) * e + 2 * q * e + q * 4 + 2 * q * e + lse  # CUDA flash, GQA
    bwd = q * e + q * 4 + kv * 4 + msgs + kernel
    return layers * saved + max(fwd, bwd)


def test_smallest_cp_search():
    n = P.parse_tokens("128k")
    base = dict(seq_len=n, cp=1, head_dim=128, q_heads=32, kv_heads=8, layers=32)
    # by hand at P = 1: 64 GiB of q and out, 16 GiB of k and v, 0.5 GiB of lse saved over 32 layers, and
    # an 11.5 GiB backward working set (4 GiB of dO and fp32 dq, 1 GiB of fp32 dK/dV, 6.5 GiB in flash)
    assert _hand_total(n, 1) == (80.5 + 11.5) * GiB + 32 * 128 * 1024 * 4
    for budget, want in ((12.0, 8), (6.0, 16), (92.1, 1)):
        assert want == next(p for p in range(1, 4097) if n % p == 0 and _hand_total(n, p) <= budget * GiB)
        assert P.smallest_cp(P.PlanInput(**base), mem_budget_gib=budget) == want
    assert P.smallest_cp(P.PlanInput(**base), mem_budget_gib=12.0, max_cp=4) is None
    # headtail needs N divisible by 2P: with N = 24 and a budget first met at P = 8, striped takes 8
    # but headtail must skip it (24 % 16 != 0) and takes 12 (memory does not depend on the layout)
    tiny = dict(seq_len=24, cp=1, head_dim=8, q_heads=2, kv_heads=2)
    budget8 = P.memory_bytes(P.PlanInput(**{**tiny, "cp": 8}))["total"] / GiB
    assert P.memory_bytes(P.PlanInput(**{**tiny, "cp": 6}))["total"] / GiB > budget8
    assert P.smallest_cp(P.PlanInput(**tiny, layout="striped"), mem_budget_gib=budget8) == 8
    assert P.smallest_cp(P.PlanInput(**tiny, layout="headtail"), mem_budget_gib=budget8) == 12


def test_overlap_hand_times():
    r = P.make_plan(P.PlanInput(**EX1, link_gbps=50, tflops=400))
    s = 16384
    comm = 67_108_864 / 50e9
    # the lightest step, judged by its slowest rank: S(S+1)/2 pairs (diagonal, or striped s < r)
    lightest = s * (s + 1) // 2 * 4 * 64 * 128 / 400e12
    assert r.timing["kv_step_s"] == pytest.approx(comm)
    assert r.timing["compute_over_comm"] == pytest.approx(lightest / comm)
    assert r.timing["fwd_hidden"] and r.timing["fwd_exposed_comm_s"] == pytest.approx(0)
    # a 100x slower link exposes the ring: 7 hops of comm instead of 7 steps of compute
    slow = P.make_plan(P.PlanInput(**EX1, link_gbps=0.5, tflops=400))
    assert not slow.timing["fwd_hidden"]
    assert slow.timing["fwd_s"] == pytest.approx(7 * comm * 100 + s * (s + 1) // 2 * 4 * 64 * 128 / 400e12)


def test_parse_tokens():
    assert P.parse_tokens("128k") == 131072
    assert P.parse_tokens("1M") == 1048576 == P.parse_tokens("1m")
    assert P.parse_tokens("4096") == 4096
    for bad in ("1.5k", "128kb", "", "-4"):
        with pytest.raises(ValueError, match="token count"):
            P.parse_tokens(bad)


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--seq-len", "1001", "--cp", "8", "--head-dim", "128"], "divisible by 8"),
        (["--seq-len", "1024", "--cp", "8", "--hidden", "1000"], "divisible by --q-heads"),
        (["--seq-len", "1024", "--cp", "8", "--hidden", "8192", "--head-dim", "64"], "disagrees"),
        (["--seq-len", "1024", "--cp", "8", "--head-dim", "64", "--kv-heads", "5"], "multiple of kv_heads"),
        (["--seq-len", "1024", "--head-dim", "64"], "--mem-budget-gib"),
    ],
)
def test_cli_errors(extra, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--heads", "64", *extra])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_picks_cp_from_budget(capsys):
    main(["plan", "--seq-len", "128k", "--head-dim", "128", "--heads", "32", "--kv-heads", "8", "--layers", "32",
          "--mem-budget-gib", "6", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["input"]["cp"] == out["smallest_cp"]["cp"] == 16


def test_plan_does_not_import_torch():
    # cp_dtensor/__init__.py is bypassed (a bare package stub) so this checks tools/cli.py and tools/plan.py only
    code = (
        "import sys, types, importlib.util;"
        "spec = importlib.util.find_spec('cp_dtensor');"
        "pkg = types.ModuleType('cp_dtensor'); pkg.__path__ = list(spec.submodule_search_locations);"
        "sys.modules['cp_dtensor'] = pkg;"
        "import cp_dtensor.tools.cli; print('torch' in sys.modules)"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
    assert out.strip() == "False"


def test_window_and_documents_in_the_plan():
    """A window shortens the ring (contiguous: one neighbour block); documents cut pairs, not bytes.
    References: the ring's own byte formula per send and brute-force pair counts."""
    from cp_dtensor.tools.plan import PlanInput, make_plan

    base = dict(seq_len=1024, cp=4, head_dim=16, q_heads=4, kv_heads=2, dtype="fp32")
    block = 2 * 256 * 16 * 2 * 4
    win = make_plan(PlanInput(layout="contiguous", window=100, **base))
    assert (len(win.steps), win.fwd_bytes, win.bwd_bytes) == (2, block, 2 * block)
    # rank 3 keeps, per query i, min(i, 100) + 1 keys: brute force over its 256 queries
    assert win.rank_fwd_pairs_max == sum(min(i, 100) + 1 for i in range(768, 1024))
    assert make_plan(PlanInput(layout="striped", window=100, **base)).fwd_bytes == 3 * block
    docs = make_plan(PlanInput(layout="striped", mean_doc_len=128, **base))
    full = make_plan(PlanInput(layout="striped", **base))
    assert docs.fwd_bytes == full.fwd_bytes
    # documents of 128 tokens: 8 * 128 * 129 / 2 pairs instead of 1024 * 1025 / 2, balanced by striping
    assert abs(docs.rank_fwd_pairs_mean * 4 - 8 * 128 * 129 / 2) <= 4
