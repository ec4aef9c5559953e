"""The fast document planner against the planner it replaced (tests/core/_doc_plan_ref.py, kept verbatim):
the same positions on every rank, on random rows of log-normal, adversarial (one long document and many
short ones) and few-document lengths, with and without windows, at several tolerances; and the vectorised
exchange plan against the per-peer loop it replaced. Independent references: the old code, not the new."""

from __future__ import annotations

import random

import pytest
import torch
from _doc_plan_ref import plan_row as reference_plan_row
from _tiers import slow

import cp_dtensor
from cp_dtensor.core.exchange.doc_exchange import _needs, _starts, exchange_plan
from cp_dtensor.core.plan import doc_plan
from cp_dtensor.core.plan.masks import mask_bounds
from cp_dtensor.tools.plan_documents import lognormal_lengths


def _adversarial(rng: random.Random, n: int) -> list[int]:
    """One long document somewhere among many short ones (n tokens in all)."""
    big = rng.randint(n // 4, n)
    out, total = [big], big
    while total < n:
        x = min(n - total, rng.randint(1, max(1, n // 40)))
        out.append(x)
        total += x
    rng.shuffle(out)
    return out


def _rows(count: int, seed: int = 0):
    rng = random.Random(seed)
    for case in range(count):
        world = rng.choice([1, 2, 3, 4, 8, 16, 32])
        n = world * rng.choice([8, 64, 128] if count < 100 else [8, 64, 256, 512])
        kind = rng.choice(["lognormal", "lognormal", "adversarial", "few"])
        if kind == "lognormal":
            lengths = lognormal_lengths(case, n, rng.choice([4, 30, 200, 1000]), sigma=rng.choice([0.5, 1.2, 2.0]))
        elif kind == "adversarial":
            lengths = _adversarial(rng, n)
        else:
            cuts = sorted(rng.sample(range(1, n), min(rng.randint(1, 6), n - 1))) if n > 1 else []
            lengths = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        windows = rng.choice([None, None, [None, 16], [8], [(4, 0), None]])
        yield lengths, world, windows, rng.choice([0.02, 0.02, 0.05, 0.0])


@pytest.mark.parametrize("cases", [pytest.param(24, id="default"), pytest.param(60, id="many", marks=slow())])
def test_fast_planner_equals_the_reference_planner(monkeypatch, cases):
    dealt = []  # the fast path must have run, or the comparison proves little
    peel = doc_plan._peel_run
    monkeypatch.setattr(doc_plan, "_peel_run", lambda *a, **k: dealt.append(peel(*a, **k)) or dealt[-1])
    for lengths, world, windows, tol in _rows(cases):
        want = reference_plan_row(lengths, world, windows=windows, tol=tol)
        assert doc_plan.plan_row(lengths, world, windows=windows, tol=tol) == want, (lengths, world, windows, tol)
    assert sum(dealt) > 500, "the runs of head tokens were not exercised"


def test_document_layout_order_is_the_planned_positions():
    rng = random.Random(1)
    for _ in range(6):
        world, b = rng.choice([2, 4, 8]), rng.choice([1, 3])
        rows = [lognormal_lengths(rng.randrange(99), world * 64, rng.choice([8, 40, 200])) for _ in range(b)]
        ids = torch.stack([torch.repeat_interleave(torch.arange(len(x)) * 3 + 5, torch.tensor(x)) for x in rows])
        lay = cp_dtensor.document_layout(ids, world)
        want = [[p for pos in reference_plan_row(x, world) for p in pos] for x in rows]
        assert lay.order.tolist() == want


def _reference_exchange_plan(lay, rank: int, is_causal: bool, window) -> dict:
    """The per-peer loop exchange_plan was (one peer at a time, each peer's queries against my keys)."""
    lo, hi = mask_bounds(is_causal, window)
    world, s, b = lay.cp_size, lay.s_local, lay.batch
    start = _starts(lay)
    owner = torch.empty_like(lay.order)
    owner.scatter_(1, lay.order, (torch.arange(lay.seq_len) // s).expand_as(lay.order))
    mine = lay.order[:, rank * s : (rank + 1) * s]
    flat = torch.arange(b * s).view(b, s)
    send, send_splits, recv_splits, recv_pos = [], [], [], []
    need = _needs(lay, rank, torch.arange(lay.seq_len).expand(b, -1), start, lo, hi)
    for peer in range(world):
        if peer == rank:
            send_splits.append(0)
            recv_splits.append(0)
            continue
        out_rows = _needs(lay, peer, mine, start, lo, hi)
        send_splits.append(int(out_rows.sum()))
        send.append(flat[out_rows])
        in_rows = need & (owner == peer)
        recv_splits.append(int(in_rows.sum()))
        recv_pos.append(torch.nonzero(in_rows, as_tuple=True))
    bb = torch.cat([x[0] for x in recv_pos]) if recv_pos else torch.zeros(0, dtype=torch.int64)
    jj = torch.cat([x[1] for x in recv_pos]) if recv_pos else torch.zeros(0, dtype=torch.int64)
    rows = [torch.nonzero(bb == r, as_tuple=True)[0] for r in range(b)]
    return {"send": torch.cat(send) if send else torch.zeros(0, dtype=torch.int64), "send_splits": send_splits,
            "recv_splits": recv_splits, "rows": rows, "pos": [jj[r] for r in rows],
            "total": int(bool((owner != owner.gather(1, start)).any())), "bounds": (lo, hi)}


@pytest.mark.parametrize("placement", ["documents", "striped"])
def test_exchange_plan_equals_the_per_peer_loop(placement):
    rng = random.Random(2)
    for _ in range(8):
        world, s, b = rng.choice([1, 2, 4, 8]), rng.choice([4, 16, 64]), rng.choice([1, 2])
        ids = torch.stack([torch.repeat_interleave(torch.arange(len(x)), torch.tensor(x)) for x in (
            lognormal_lengths(rng.randrange(99), world * s, rng.choice([2, 8, 40])) for _ in range(b))])
        lay = cp_dtensor.document_layout(ids, world, placement=placement if s % 2 == 0 else "documents")
        for rank in range(world):
            # masks without a left reach (each rank's last query) and with one (the search per key)
            for causal, window in [(True, None), (False, None), (True, (3, 0)), (False, (2, 5)), (True, (-1, 0))]:
                lay._cache.clear()
                got = exchange_plan(lay, rank, causal, window)
                want = _reference_exchange_plan(lay, rank, causal, window)
                for key, x in want.items():
                    y = got[key]
                    if isinstance(x, torch.Tensor):
                        assert torch.equal(x, y), key
                    elif isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
                        assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)), key
                    else:
                        assert x == y, key
