"""The document layout: the planner's balance and bytes against formulas and a brute-force mask; the
exchange's forward + backward against float64 dense attention on the full sequence; bytes on the wire
against the rows the masks need; bad input raising on every rank before K/V moves."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.distributed as dist

import cp_dtensor
from cp_dtensor.core.plan.documents import needed_rows, plan_row, rank_work, row_balance
from cp_dtensor.tools.debug import CommBytes
from cp_dtensor.tools.plan_documents import lognormal_lengths  # the planner's and the benchmark's batches
from _dist import run_ranks
from _ref import abs_rel_err, masked_reference


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


# -- the planner (torch-free) ---------------------------------------------------------------------------

def test_plan_holds_every_position_once_with_equal_counts():
    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(1, 8)
        n = world * rng.randint(1, 40)
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(10, n - 1)))) if n > 1 else []
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        pos = plan_row(lengths, world, windows=rng.choice([None, [None, 3]]))
        assert all(len(p) == n // world and p == sorted(p) for p in pos)
        assert sorted(x for p in pos for x in p) == list(range(n))


def test_rank_work_is_the_dense_mask_count():
    lengths = [5, 1, 9, 3]
    pos = plan_row(lengths, 3, windows=[None, 2])
    ids = _ids(lengths)
    n = len(ids)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    same = ids[:, None] == ids[None, :]
    full = same & (j <= i)
    win = full & (j >= i - 2)
    want = [int(full[p].sum() + win[p].sum()) for p in pos]
    assert rank_work(pos, lengths, windows=[None, 2]) == want


@pytest.mark.parametrize("world", [4, 8])
def test_balance_on_packed_lognormal_documents(world):
    """max/mean kept causal pairs over ranks, N/P = 8192, median ~1k, sigma 1.2, 12 seeds: <= 1.05; with a
    4096 window layer beside a global one (counted as windows=): <= 1.08 (issue #42's bars). The greedy alone
    reached 1.083 on seed 6 at P = 4 (14 documents); the swaps bring every seed under 1.04."""
    worst, worst_w = 0.0, 0.0
    for seed in range(12):
        lengths = lognormal_lengths(seed, world * 8192, 1000.0)
        worst = max(worst, row_balance(plan_row(lengths, world), lengths))
        wins = [None, 4096]
        worst_w = max(worst_w, row_balance(plan_row(lengths, world, windows=wins), lengths, windows=wins))
    assert worst <= 1.05 and worst_w <= 1.08, (worst, worst_w)
    assert max(worst, worst_w) <= 1.04, (worst, worst_w)  # the margin the swaps give: 1.033 at worst today


def test_needed_rows_is_the_dense_mask_count():
    rng = random.Random(3)
    for _ in range(60):
        world = rng.randint(2, 4)
        n = world * rng.randint(2, 12)
        cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(5, n - 1))))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        causal = rng.random() < 0.7
        window = rng.choice([None, (2, 0), (3, 1), (-1, 2)])
        pos = rng.choice([plan_row(lengths, world), [list(range(r, n, world)) for r in range(world)]])
        ids = _ids(lengths)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        keep = ids[:, None] == ids[None, :]
        keep &= (j <= i) if causal else True
        if window is not None:
            keep &= (j >= i - window[0]) if window[0] >= 0 else True
            keep &= (j <= i + window[1]) if window[1] >= 0 else True
        want = []
        for p in pos:
            cols = keep[p].any(0)
            cols[p] = False
            want.append(int(cols.sum()))
        assert needed_rows(pos, lengths, is_causal=causal, window=window) == want


def test_rows_needed_against_the_striped_ring():
    """P = 4, S_local = 2048: the rows the document layout's masks need <= 0.35 x the striped ring's
    (P - 1) * S_local per rank, on short log-normal documents (sigma 1.2, none longer than S_local); one
    document covering the row: <= striped."""
    world, s = 4, 2048
    ring = world * (world - 1) * s
    for median in (256, 1000):
        ratios = [sum(needed_rows(plan_row(ls, world), ls)) / ring
                  for ls in (lognormal_lengths(seed, world * s, median=median, cap=s) for seed in range(4))]
        assert max(ratios) <= 0.35, (median, ratios)
    one = [world * s]
    assert max(needed_rows(plan_row(one, world), one)) <= (world - 1) * s


# -- the exchange ----------------------------------------------------------------------------------------

def _cases(world: int) -> list[dict]:
    s = 6
    n = s * world
    short = [2, 1, 3, 2, 4, 1, 3, 2, 3, 1, 2, 3, 1, 2, 1, 3][: n]
    while sum(short) < n:
        short.append(1)
    while sum(short) > n:
        short[-1] -= sum(short) - n
        short = [x for x in short if x > 0]
    long = [n // 2 + 3, n - (n // 2 + 3)]
    base = dict(b=1, hq=2, hkv=2, d=8, dv=8, causal=True, window=None, sinks=False)
    return [
        dict(base, lengths=[short]),
        dict(base, lengths=[long, short], b=2, hq=4, hkv=2),  # a document > N/P; GQA; B = 2
        dict(base, lengths=[[n]], dv=4),  # one document covering the row; MLA-like Dv != Dqk
        dict(base, lengths=[[1] * n, short], b=2),  # 1-token documents
        dict(base, lengths=[long, [n]], b=2, window=(3, 0)),  # a window
        dict(base, lengths=[short, long], b=2, sinks=True, hq=4, hkv=1),  # sinks, MQA
        dict(base, lengths=[long], causal=False),  # not causal: whole documents
        dict(base, lengths=[short], causal=False, window=(2, 1)),  # a two-sided window
    ]


def _errors(lay, rank, world, c, full, want, *, mesh=None, document_ids=None) -> list[float]:
    """fp32 forward + backward of this rank's shards under ``lay`` against the float64 reference ``want``
    (out, dq, dk, dv, and the sinks' gradient summed over the ranks)."""
    q, k, v, do, sinks = full

    def shard(x):
        return cp_dtensor.shard_tensor(x, seq_dim=2, layout=lay, rank=rank, cp_size=world)

    ql, kl, vl = (shard(x).float().requires_grad_() for x in (q, k, v))
    sl = None if sinks is None else sinks.float().requires_grad_()
    out = cp_dtensor.ring_attention(ql, kl, vl, mesh=mesh, layout=lay, is_causal=c["causal"], window_size=c["window"],
                                    sinks=sl, document_ids=document_ids)
    out.backward(shard(do).float())
    errs = [abs_rel_err(a, shard(r)) for a, r in zip((out, ql.grad, kl.grad, vl.grad), want[:4])]
    if sl is not None:
        total = sl.grad.clone()
        dist.all_reduce(total)
        errs.append(abs_rel_err(total, want[4]))
    return errs


def _exact(rank, world):
    worst = 0.0
    for i, c in enumerate(_cases(world)):
        ids = torch.stack([_ids(ls) for ls in c["lengths"]])  # [B, N]
        b, n = ids.shape
        g = torch.Generator().manual_seed(i)
        q = torch.randn(b, c["hq"], n, c["d"], generator=g, dtype=torch.float64)
        k = torch.randn(b, c["hkv"], n, c["d"], generator=g, dtype=torch.float64)
        v = torch.randn(b, c["hkv"], n, c["dv"], generator=g, dtype=torch.float64)
        do = torch.randn(b, c["hq"], n, c["dv"], generator=g, dtype=torch.float64)
        sinks = torch.randn(c["hq"], generator=g, dtype=torch.float64) if c["sinks"] else None
        want = masked_reference(q, k, v, do, is_causal=c["causal"], document_ids=ids, window_size=c["window"],
                                sinks=sinks)
        lay = cp_dtensor.document_layout(ids, world, windows=[c["window"]])

        def shard(x, dim=2):
            return cp_dtensor.shard_tensor(x, seq_dim=dim, layout=lay, rank=rank, cp_size=world)

        errs = _errors(lay, rank, world, c, (q, k, v, do, sinks), want, document_ids=shard(ids, 1) if i % 2 else None)
        assert max(errs) <= 2e-5, (world, rank, i, errs)
        worst = max(worst, *errs)
        # the layout's shards put back together are the batch
        every = [cp_dtensor.shard_tensor(q, seq_dim=2, layout=lay, rank=r, cp_size=world) for r in range(world)]
        assert torch.equal(cp_dtensor.unshard_tensor(every, seq_dim=2, layout=lay), q)
        if i == 1:  # shard_batch / unshard_batch take the layout too
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))
            tokens, labels = cp_dtensor.shard_batch((ids * 7, ids + 1), mesh, layout=lay)
            assert torch.equal(tokens, shard(ids * 7, 1)) and torch.equal(labels, shard(ids + 1, 1))
            assert torch.equal(cp_dtensor.unshard_batch(tokens, mesh, layout=lay), ids * 7)
        pos = cp_dtensor.local_positions(layout=lay, rank=rank, cp_size=world, seq_len=n)
        assert pos.shape == (b, n // world) and torch.equal(shard(torch.arange(n).expand(b, n), 1), pos)
    return worst


@pytest.mark.parametrize("world", [2, 3, 4])
def test_document_layout_matches_float64_reference(world):
    """fp32 forward + backward <= 2e-5 of float64 dense attention: short documents, one > N/P, one covering
    the row, 1-token documents, windows, sinks, GQA / MQA, Dv != Dqk, B = 1 and 2, causal and not."""
    run_ranks(world, _exact)


def _two_d(rank, world):
    """A (2, 2) mesh: heads all-to-all, then the exchange over the ring dim; and a named placement's ring."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2))
    worst = 0.0
    for i, c in enumerate(_cases(world)[:6]):
        ids = torch.stack([_ids(ls) for ls in c["lengths"]])
        b, n = ids.shape
        g = torch.Generator().manual_seed(50 + i)
        hq = max(c["hq"], 2)
        q = torch.randn(b, hq, n, c["d"], generator=g, dtype=torch.float64)
        k = torch.randn(b, c["hkv"], n, c["d"], generator=g, dtype=torch.float64)
        v = torch.randn(b, c["hkv"], n, c["dv"], generator=g, dtype=torch.float64)
        do = torch.randn(b, hq, n, c["dv"], generator=g, dtype=torch.float64)
        sinks = torch.randn(hq, generator=g, dtype=torch.float64) if c["sinks"] else None
        want = masked_reference(q, k, v, do, is_causal=c["causal"], document_ids=ids, window_size=c["window"], sinks=sinks)
        for placement in ("documents", "headtail"):
            lay = cp_dtensor.document_layout(ids, world, windows=[c["window"]], placement=placement)

            errs = _errors(lay, rank, world, c, (q, k, v, do, sinks), want, mesh=mesh)
            assert max(errs) <= 2e-5, (rank, i, placement, errs)
            worst = max(worst, *errs)
    return worst


def test_document_layout_on_a_2d_mesh_matches_float64_reference():
    """(U, R) = (2, 2): the document exchange over the ring dim after the heads all-to-all, and a named
    placement carried by the plan, forward + backward <= 2e-5 of float64 dense attention."""
    run_ranks(4, _two_d)


def _wire(rank, world):
    s, hkv, d = 2048 // 16, 1, 8  # S_local 128: a small batch with the same document statistics scaled
    lengths = lognormal_lengths(5, world * s, median=16)
    ids = _ids(lengths)[None]
    lay = cp_dtensor.document_layout(ids, world)
    q, k, v = (torch.randn(1, hkv, s, d, requires_grad=True) for _ in range(3))
    with CommBytes() as fwd:
        out = cp_dtensor.ring_attention(q, k, v, layout=lay, is_causal=True)
    with CommBytes() as bwd:
        out.sum().backward()
    pos = [cp_dtensor.local_positions(layout=lay, rank=r, cp_size=world, seq_len=world * s)[0].tolist() for r in range(world)]
    need = needed_rows(pos, lengths)
    # the striped ring on the same batch
    with CommBytes() as ring:
        cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True)
    row = 2 * hkv * d * 4
    # every peer's rows need what this rank holds: what I send == sum over peers of their needs from me
    return fwd.by_op["all_to_all_single"], bwd.by_op["all_to_all_single"], ring.by_op["all_to_all_single"], need, row


@pytest.mark.parametrize("world", [2, 4])
def test_document_bytes_on_the_wire(world):
    per_rank = run_ranks(world, _wire)
    need, row = per_rank[0][3], per_rank[0][4]
    sent = sum(r[0] for r in per_rank)
    assert sent == sum(need) * row  # each needed row once, nothing else
    assert sum(r[1] for r in per_rank) == sent  # dK/dV go back the same way
    assert sent <= 0.35 * sum(r[2] for r in per_rank)


def _payload(rank, world):
    """float8 / bf16 payloads: bytes per needed row by payload_bytes' formula, dK/dV back in the input dtype,
    and float8's error within the ring's bar (test_payload.FP8_TOL) against float64."""
    from test_payload import FP8, FP8_TOL

    from cp_dtensor.core.plan.layout import payload_bytes

    s, hkv, hq, d = 32, 2, 4, 16
    lengths = lognormal_lengths(7, world * s, median=12)
    ids = _ids(lengths)[None]
    lay = cp_dtensor.document_layout(ids, world)
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, h, world * s, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids)
    pos = [cp_dtensor.local_positions(layout=lay, rank=r, cp_size=world, seq_len=world * s)[0].tolist()
           for r in range(world)]
    need = sum(needed_rows(pos, lengths))
    out = {}
    for comm in (FP8, torch.bfloat16):
        ql, kl, vl = (cp_dtensor.shard_tensor(x, seq_dim=2, layout=lay, rank=rank, cp_size=world).float().requires_grad_()
                      for x in (q, k, v))
        with CommBytes() as fwd:
            o = cp_dtensor.ring_attention(ql, kl, vl, layout=lay, is_causal=True, comm_dtype=comm)
        with CommBytes() as bwd:
            o.backward(cp_dtensor.shard_tensor(do, seq_dim=2, layout=lay, rank=rank, cp_size=world).float())
        shard = [cp_dtensor.shard_tensor(r, seq_dim=2, layout=lay, rank=rank, cp_size=world) for r in want[:4]]
        errs = [((a.double() - r).abs().max() / r.abs().max()).item() for a, r in zip((o, ql.grad, kl.grad, vl.grad), shard)]
        out[str(comm)] = (fwd.by_op["all_to_all_single"], bwd.by_op["all_to_all_single"], max(errs))
    rows = dict(rows=need * hkv, head_dim=d)
    return out, payload_bytes(**rows, itemsize=1, fp8=True), payload_bytes(**rows, itemsize=2), \
        payload_bytes(**rows, itemsize=4), FP8_TOL


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="the float8 payload needs torchao ([float8])")
def test_document_payload_in_float8_and_bf16():
    per_rank = run_ranks(2, _payload)
    fp8_bytes, bf16_bytes, fp32_bytes, tol = per_rank[0][1:]
    for name, want_fwd, err_bar in (("torch.float8_e4m3fn", fp8_bytes, tol), ("torch.bfloat16", bf16_bytes, 1e-2)):
        fwd = sum(r[0][name][0] for r in per_rank)
        bwd = sum(r[0][name][1] for r in per_rank)
        assert fwd == want_fwd, (name, fwd, want_fwd)  # each needed row once, in the payload's format
        assert bwd == fp32_bytes, (name, bwd, fp32_bytes)  # dK/dV home in the input dtype
        assert max(r[0][name][2] for r in per_rank) <= err_bar, (name, [r[0][name][2] for r in per_rank])


def _bad(rank, world):
    n = 4 * world
    ids = torch.arange(n).unsqueeze(0) // 3
    lay = cp_dtensor.document_layout(ids, world)
    other = cp_dtensor.document_layout(ids // 2, world)
    q, k, v = (torch.randn(1, 2, n // world, 8) for _ in range(3))
    mine = cp_dtensor.shard_tensor(ids, seq_dim=1, layout=lay, rank=rank, cp_size=world)
    cases = {
        "ids differ across ranks": dict(layout=lay if rank else other),
        "ids of another batch": dict(layout=lay, document_ids=mine + 1 if rank == 0 else mine),
        "a layout for another length": dict(layout=cp_dtensor.document_layout(torch.zeros(1, 2 * n, dtype=torch.int64),
                                                                              world)),
        "window differs": dict(layout=lay, window_size=(rank, 0)),
    }
    messages = {}
    for name, kwargs in cases.items():
        with CommBytes() as cb:
            try:
                cp_dtensor.ring_attention(q, k, v, is_causal=True, **kwargs)
            except ValueError as e:
                messages[name] = str(e)
            else:
                raise AssertionError(f"{name}: no error on rank {rank}")
        assert cb.by_op["all_to_all_single"] == 0, (name, cb.by_op)
    for bad, text in ((torch.tensor([[0, 1, 0, 2]] * 1), "must not decrease"), (torch.zeros(1, n + 1), "integer"),
                      (torch.zeros(1, n + 1, dtype=torch.int64), "divisible")):
        with pytest.raises(ValueError, match=text):
            cp_dtensor.document_layout(bad, world)
    return messages


def test_bad_document_input_raises_on_every_rank_before_kv_moves():
    per_rank = run_ranks(2, _bad)
    assert per_rank[0].keys() == per_rank[1].keys()
    assert "layout key" in per_rank[0]["ids differ across ranks"]
    assert "not the ids this document layout was built from" in per_rank[1]["ids of another batch"]
    assert "built for 2 ranks and a batch [1, 16]" in per_rank[0]["a layout for another length"]
