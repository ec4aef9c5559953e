"""Bad inputs raise on every rank before any ring traffic; a dead rank fails the others; numerics hold."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import resource
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import cp_dtensor
from cp_dtensor.core.plan.layout import shard_tensor
from cp_dtensor.tools.debug import CommBytes
import _dist
from _dist import RankFailure, run_ranks
from _ref import make_qkv, reference, rel_err


def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# (name, builder(rank) -> (q, k, v, kwargs), words the message must contain)
BAD = [
    ("seq len differs across ranks",
     lambda r: (_t(1, 2, 4 + r, 8), _t(1, 2, 4 + r, 8), _t(1, 2, 4 + r, 8), {}), ["seq_len_local", "rank 0", "rank 1"]),
    ("q/k length mismatch", lambda r: (_t(1, 2, 4, 8), _t(1, 2, 6, 8), _t(1, 2, 6, 8), {}), ["S_local"]),
    ("head dim mismatch", lambda r: (_t(1, 2, 4, 8), _t(1, 2, 4, 16), _t(1, 2, 4, 16), {}), ["D"]),
    ("Hq not a multiple of Hkv", lambda r: (_t(1, 3, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8), {}), ["multiple"]),
    ("k and v heads differ", lambda r: (_t(1, 4, 4, 8), _t(1, 2, 4, 8), _t(1, 4, 4, 8), {}), ["must agree on all but the head size"]),
    ("dtype mismatch", lambda r: (_t(1, 2, 4, 8), _t(1, 2, 4, 8, dtype=torch.bfloat16), _t(1, 2, 4, 8), {}), ["dtype"]),
    ("integer dtype", lambda r: (torch.ones(1, 2, 4, 8, dtype=torch.int64),) * 3 + ({},), ["int64"]),
    ("not 4-D", lambda r: (_t(2, 4, 8), _t(2, 4, 8), _t(2, 4, 8), {}), ["4-D"]),
    ("unknown layout", lambda r: (_t(1, 2, 4, 8),) * 3 + ({"layout": "zigzag"},), ["zigzag"]),
    ("headtail odd local length", lambda r: (_t(1, 2, 5, 8),) * 3 + ({"layout": "headtail"},), ["even"]),
    ("layout differs across ranks",
     lambda r: (_t(1, 2, 4, 8),) * 3 + ({"layout": ["striped", "contiguous"][r % 2]},), ["layout"]),
    ("is_causal differs across ranks", lambda r: (_t(1, 2, 4, 8),) * 3 + ({"is_causal": r == 0},), ["is_causal"]),
    ("scale differs across ranks", lambda r: (_t(1, 2, 4, 8),) * 3 + ({"scale": 0.1 * (r + 1)},), ["scale"]),
    ("bad only on rank 1",
     lambda r: (_t(1, 2, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4 if r != 1 else 5, 8), {}), ["rank(s) 1"]),
    ("negative scale", lambda r: (_t(1, 2, 4, 8),) * 3 + ({"scale": -1.0},), ["scale"]),
]


def _bad_inputs(rank, world):
    seen = []
    for name, build, words in BAD:
        q, k, v, kwargs = build(rank)
        with CommBytes() as sent:
            try:
                cp_dtensor.ring_attention(q, k, v, **kwargs)
            except ValueError as e:
                msg = str(e)
            else:
                raise AssertionError(f"{name}: no error on rank {rank}")
        missing = [w for w in words if w not in msg]
        assert not missing, f"{name}: message lacks {missing}: {msg}"
        # Nothing but the agreement check went out: no K/V left any rank.
        assert sent.by_op["all_to_all_single"] == 0, (name, sent.by_op)
        seen.append(name)
    # The group still works after all those errors: a valid call succeeds.
    cp_dtensor.ring_attention(_t(1, 2, 4, 8), _t(1, 2, 4, 8), _t(1, 2, 4, 8), is_causal=True)
    return seen


def test_bad_inputs_raise_on_every_rank_before_the_ring():
    per_rank = run_ranks(2, _bad_inputs, timeout=120)
    assert all(seen == [b[0] for b in BAD] for seen in per_rank)


def _victim(rank, world, init, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=20))
    q = _t(1, 2, 64, 16)
    t0 = time.monotonic()
    try:
        for step in range(1000):
            if rank == 1 and step == 3:
                os._exit(17)  # dies mid-run, without a word to anyone
            cp_dtensor.ring_attention(q, q, q, is_causal=True)
        results.put((rank, "finished", 0.0))
    except Exception as e:  # noqa: BLE001 -- the test inspects it
        results.put((rank, f"{type(e).__name__}: {e}", time.monotonic() - t0))
    results.close()
    results.join_thread()
    os._exit(0)


def test_a_dead_rank_fails_the_others_within_the_timeout():
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_victim, args=(r, 3, f"file://{tmp}/rdzv", results)) for r in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=90)
        alive = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not alive, "a surviving rank hung"
        reports = {}
        for _ in range(2):  # the two survivors
            rank, msg, elapsed = results.get(timeout=10)
            reports[rank] = (msg, elapsed)
    assert procs[1].exitcode == 17
    for rank in (0, 2):
        msg, elapsed = reports[rank]
        assert "cp_dtensor ring" in msg and elapsed < 60, (rank, msg, elapsed)


def _numerics(rank, world):
    errs = {}
    one = dist.new_subgroups(group_size=1)[0]  # a CP=1 group of this rank alone
    # Large logits: |q.k| * scale up to ~1e4.
    for layout in cp_dtensor.LAYOUTS:
        q, k, v, do = make_qkv(7, 1, 4, 2, 8 * world, 16, scale=50.0)
        ref = reference(q, k, v, do, is_causal=True)
        sh = lambda x: shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world)  # noqa: E731
        ql, kl, vl = (sh(x).float().requires_grad_() for x in (q, k, v))
        out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
        out.backward(sh(do).float())
        assert all(torch.isfinite(t).all() for t in (out, ql.grad, kl.grad, vl.grad))
        logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)).abs().max().item() / 4
        assert logits > 5e3, logits
        errs[f"large_logits_{layout}"] = rel_err(out, sh(ref[0]))
        # Reruns are bitwise identical, gradients included.
        q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (ql, kl, vl))
        out2 = cp_dtensor.ring_attention(q2, k2, v2, layout=layout, is_causal=True)
        out2.backward(sh(do).float())
        assert torch.equal(out, out2) and torch.equal(ql.grad, q2.grad) and torch.equal(kl.grad, k2.grad)
        # CP=1 vs CP=P in fp32, both through ring_attention.
        q, k, v, _ = make_qkv(8, 2, 4, 2, 12 * world, 16)
        full = cp_dtensor.ring_attention(q.float(), k.float(), v.float(), mesh=one, is_causal=True)
        part = cp_dtensor.ring_attention(sh(q).float(), sh(k).float(), sh(v).float(), layout=layout, is_causal=True)
        errs[f"cp1_vs_cp{world}_{layout}"] = rel_err(part, sh(full))
    return errs


def test_numerics_large_logits_bitwise_reruns_and_cp1_parity():
    for errs in run_ranks(4, _numerics):
        for name, err in errs.items():
            tol = 1e-3 if name.startswith("large_logits") else 1e-5
            assert err <= tol, (name, err)


def _edge_cases(rank, world):
    done = []
    # One token per rank (two for headtail, one per chunk).
    for layout in cp_dtensor.LAYOUTS:
        s_local = 2 if layout == "headtail" else 1
        q, k, v, do = make_qkv(1, 1, 2, 1, s_local * world, 8)
        ref = reference(q, k, v, do, is_causal=True)
        sh = lambda x: shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world)  # noqa: E731
        ql, kl, vl = (sh(x).float().requires_grad_() for x in (q, k, v))
        out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
        out.backward(sh(do).float())
        for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref):
            # relative to the full tensor: one rank's shard of dq may be all zeros (token 0)
            assert (got.double() - sh(want)).abs().max() <= 2e-5 * want.abs().max(), layout
        done.append(f"one token {layout}")
    # Non-contiguous inputs ([B, S, H, D] storage seen as [B, H, S, D]) and grads on q only.
    q, k, v, do = make_qkv(2, 2, 4, 2, 8 * world, 16)
    ref = reference(q, k, v, do, is_causal=True)
    sh = lambda x: shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world)  # noqa: E731
    ql = sh(q).float().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    kl, vl = (sh(x).float().transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    assert not ql.is_contiguous() and not kl.is_contiguous()
    out = cp_dtensor.ring_attention(ql, kl, vl, is_causal=True)
    out.backward(sh(do).float())
    assert rel_err(out, sh(ref[0])) < 2e-5 and rel_err(ql.grad, sh(ref[1])) < 2e-5
    assert kl.grad is None and vl.grad is None
    done.append("non-contiguous, grad on q only")
    # Gradients on k and v only.
    kl2, vl2 = (sh(x).float().requires_grad_() for x in (k, v))
    out = cp_dtensor.ring_attention(sh(q).float(), kl2, vl2, is_causal=True)
    out.backward(sh(do).float())
    assert rel_err(kl2.grad, sh(ref[2])) < 2e-5 and rel_err(vl2.grad, sh(ref[3])) < 2e-5
    done.append("grad on k, v only")
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_valid_edge_cases(world):
    run_ranks(world, _edge_cases)


def _property(rank, world):
    failures = []

    @settings(derandomize=True, max_examples=12, database=None, deadline=None)
    @given(
        layout=st.sampled_from(cp_dtensor.LAYOUTS),
        causal=st.booleans(),
        kv_heads=st.sampled_from([1, 2]),
        group=st.sampled_from([1, 2, 3]),
        chunks=st.integers(1, 4),
        head_dim=st.sampled_from([8, 16, 24]),
        batch=st.integers(1, 2),
        scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
        seed=st.integers(0, 2**16),
    )
    def check(layout, causal, kv_heads, group, chunks, head_dim, batch, scale, seed):
        # Every rank draws the same example (derandomized), so collectives stay in step. No assert
        # inside: a failing rank must not shrink alone while the others wait.
        s_local = 2 * chunks if layout == "headtail" else chunks
        q, k, v, do = make_qkv(seed, batch, kv_heads * group, kv_heads, s_local * world, head_dim)
        ref = reference(q, k, v, do, is_causal=causal, scale=scale)
        sh = lambda x: shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world)  # noqa: E731
        ql, kl, vl = (sh(x).float().requires_grad_() for x in (q, k, v))
        out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=causal, scale=scale)
        out.backward(sh(do).float())
        # relative to the whole tensor's norm: a shard of the reference can be exactly 0 (a causal rank whose
        # only query sees only its own key has dQ = 0), where fp32 leaves ~1e-6
        err = max(float((g.double() - sh(r)).norm() / r.norm()) for g, r in zip((out, ql.grad, kl.grad, vl.grad), ref))
        if not err <= 2e-5:
            failures.append((err, layout, causal, kv_heads, group, s_local, head_dim, batch, scale, seed))

    check()
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_property_random_shapes_layouts_gqa_scales(world):
    for failures in run_ranks(world, _property):
        assert not failures, failures


def _outside_group(rank, world):
    group = dist.new_group([0, 1])  # every rank creates it; rank 2 is not a member
    q = torch.randn(1, 2, 4, 8)
    if rank == 2:
        with pytest.raises(ValueError, match="not a member of its CP group"):
            cp_dtensor.ring_attention(q, q, q, mesh=group, is_causal=True)
    else:
        cp_dtensor.ring_attention(q, q, q, mesh=group, is_causal=True)


def test_rank_outside_the_group_gets_a_clear_error():
    run_ranks(3, _outside_group)


def _host_only_agreement(rank, world):
    from unittest import mock

    from cp_dtensor.core.checks import check_ring_args
    from cp_dtensor.core.exchange import comm

    group = dist.group.WORLD
    # meta tensors hold no data: the check can only pass if it reads none (no device sync on CUDA)
    q, k = torch.empty(1, 4, 8, 16, device="meta"), torch.empty(1, 2, 8, 16, device="meta")
    scale, _ = check_ring_args(q, k, k, group=group, layout="striped", is_causal=True, scale=None, window_size=(3, 0))
    assert scale == 0.25
    bad = torch.empty(1, 4, 8 + rank, 16, device="meta")
    with pytest.raises(ValueError, match="seq_len_local"):
        check_ring_args(bad, bad[:, :2], bad[:, :2], group=group, layout="striped", is_causal=True, scale=None)
    # an NCCL group agrees over a gloo twin of the same ranks, made once
    with mock.patch.object(dist, "get_backend", lambda g=None: "nccl"):
        twin = comm.host_group(group)
        assert twin is not group and twin is comm.host_group(group)
        assert dist.get_process_group_ranks(twin) == list(range(world))
        check_ring_args(q, k, k, group=group, layout="striped", is_causal=True, scale=None)


def test_agreement_reads_no_tensor_data_and_uses_a_host_group():
    run_ranks(2, _host_only_agreement)


def _rank0_cause(how):
    """Rank 0's failure, in a function of its own (the name the report must show)."""
    time.sleep(0.3)  # rank 1 is waiting in the collective by now
    if how == "kill":
        os.kill(os.getpid(), 9)  # dies without a traceback or a stack, as the OOM killer kills
    if how == "segv":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the checkout
        ctypes.string_at(0)  # a crash: faulthandler writes the stack
    raise ValueError("the cause")


def _rank0_stuck():
    while True:  # still computing when its peer fails: the launcher asks it for its stack
        time.sleep(0.01)


def _cause_then_echo(rank, world, how):
    if rank == 0:
        _rank0_stuck() if how == "stuck" else _rank0_cause(how)
    if how == "stuck":
        raise ValueError("rank 1 fails alone")
    out = [None] * world
    dist.all_gather_object(out, rank)  # rank 1: its sockets close under it, an echo of rank 0's failure


@pytest.mark.parametrize("how", ["raise", "kill", "segv", "stuck"])
def test_the_launcher_reports_the_cause_first(how, monkeypatch):
    """tests/_dist.py names every failing rank, the cause before the peers' echoes of it, with the signal and
    Python stack of a rank that died and the stack of a rank still running."""
    monkeypatch.setattr(_dist, "GRACE", 1.0)  # the stuck rank: ask for its stack after 1 s
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _cause_then_echo, how)
    report = str(info.value)
    first = {"raise": "rank 0 of 2 failed", "kill": "rank 0 of 2 died of SIGKILL (killed from outside",
             "segv": "rank 0 of 2 died of SIGSEGV", "stuck": "rank 1 of 2 failed"}[how]
    assert report.startswith(first), report[:300]
    if how == "raise":
        assert "ValueError: the cause" in report
    if how == "segv":  # faulthandler's stack, from the rank's file
        assert "Segmentation fault" in report and "in _rank0_cause" in report, report
    if how == "stuck":
        assert "ValueError: rank 1 fails alone" in report
        assert "rank 0 of 2 was still running; its stderr and stack:" in report and "in _rank0_stuck" in report, report
    else:
        assert "rank 1 of 2 failed" in report  # the echo is kept, after the cause


def _mismatch(rank, world):
    if rank == 0:  # a collective rank 1 does not join: its 8-byte message arrives where 4 are expected
        x = torch.zeros(4, dtype=torch.uint8)
        dist.all_gather([torch.empty_like(x) for _ in range(world)], x)
        dist.barrier()
    else:
        dist.all_gather_object([None] * world, "the call's fingerprint")


def test_the_launcher_names_a_collective_mismatch():
    """Two ranks in different collectives: gloo aborts the rank that receives the larger message (SIGABRT, no
    Python traceback) and its peer reads "Connection reset by peer". The report names the abort, with gloo's
    reason from the rank's stderr, at once rather than after the launcher's timeout."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(2, _mismatch, timeout=120.0)
    report = str(info.value)
    assert report.startswith("rank 0 of 2 died of SIGABRT"), report[:300]
    assert "Received data size doesn't match expected size" in report, report  # gloo's reason, from stderr
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in report  # how to have torch name both collectives
    assert time.monotonic() - start < 60  # not the 120 s timeout
