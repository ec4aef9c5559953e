"""Masks in the ring (documents, windows, sinks, Dv != Dqk) against float64 dense-mask attention on the
full sequence; the rectangles against a brute-force mask; bytes against the formula; bad input."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.distributed as dist
from _tiers import slow

import cp_dtensor
from cp_dtensor.core.plan.layout import local_positions, shard_tensor
from cp_dtensor.core.plan.masks import block_rects, mask_bounds, runs, segments, steps_needed
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import abs_rel_err, masked_reference

TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _random_ids(rng: random.Random, b: int, n: int) -> torch.Tensor:
    """Non-decreasing ids with documents from 1 token to the whole sequence (and gaps in the ids)."""
    ids = torch.zeros(b, n, dtype=torch.int64)
    for row in range(b):
        for cut in sorted(rng.sample(range(1, n), rng.randint(0, min(6, n - 1)))):
            ids[row, cut:] += rng.randint(1, 3)
    return ids


def test_rectangles_cover_exactly_the_mask():
    """Every (layout, P, rank, src, window, documents): the rectangles' kept pairs are exactly the dense
    mask's, once each; every rectangle row keeps a key; "full" and "causal" rectangles need no mask."""
    rng = random.Random(0)
    for _ in range(600):
        world, layout = rng.randint(1, 4), rng.choice(cp_dtensor.LAYOUTS)
        s = rng.choice([2, 4, 6, 10])
        n = s * world
        lo, hi = mask_bounds(rng.random() < 0.5, (rng.choice([-1, 0, 1, 3, 7, 20]), rng.choice([-1, 0, 2, 9])))
        ids = _random_ids(rng, 1, n)[0] if rng.random() < 0.6 else None
        tile, strip = rng.choice([0, 1, 3]), rng.choice([0, 0, 1, 2, 3])  # strips: Note [Causal staircase]
        for rank in range(world):
            for src in range(world):
                qp, kp = (local_positions(layout=layout, rank=r, cp_size=world, seq_len=n) for r in (rank, src))
                d = kp[None, :] - qp[:, None]
                want = torch.ones(s, s, dtype=torch.bool)
                want &= d >= lo if lo is not None else True
                want &= d <= hi if hi is not None else True
                segs = (None, None)
                if ids is not None:
                    want &= ids[qp][:, None] == ids[kp][None, :]
                    segs = (segments(ids[qp].tolist()), segments(ids[kp].tolist()))
                rects = block_rects(runs(layout, rank, world, s), runs(layout, src, world, s), lo, hi, *segs, tile=tile, strip=strip)
                got = torch.zeros(s, s, dtype=torch.int64)
                for r in rects:
                    a, b = r.band
                    diff = torch.arange(r.k1 - r.k0)[None, :] - torch.arange(r.q1 - r.q0)[:, None]
                    keep = torch.ones_like(diff, dtype=torch.bool)
                    keep &= diff >= a if a is not None else True
                    keep &= diff <= b if b is not None else True
                    assert keep.any(1).all(), r
                    assert r.kept() == int(keep.sum())
                    if r.kind == "full":
                        assert keep.all(), r
                    if r.kind == "causal":
                        assert torch.equal(keep, torch.ones_like(keep).tril()), r
                    got[r.q0 : r.q1, r.k0 : r.k1] += keep
                assert torch.equal(got, want.long()), (layout, world, rank, src, lo, hi, ids, rects)


def test_window_shortens_the_ring():
    # contiguous: a causal window of left <= S_local needs the previous block only (one rotation)
    assert [steps_needed("contiguous", 8, 16, *mask_bounds(True, (w, 0))) for w in (0, 16, 17, 33, -1)] == [1, 2, 3, 4, 8]
    # striped: a window of left < P reaches left ranks back; any wider one needs every step
    assert [steps_needed("striped", 4, 16, *mask_bounds(True, (w, 0))) for w in (0, 1, 2, 3, 200)] == [1, 2, 3, 4, 4]


def test_band_costs_about_twice_its_pairs():
    """A (256, 0) window over a 4096-token contiguous block: computed rectangle area / kept pairs."""
    lo, hi = mask_bounds(True, (256, 0))
    rects = block_rects(runs("contiguous", 0, 1, 4096), runs("contiguous", 0, 1, 4096), lo, hi)
    area = sum((r.q1 - r.q0) * (r.k1 - r.k0) for r in rects)
    kept = sum(r.kept() for r in rects)
    assert kept == 257 * 4096 - 256 * 257 // 2
    assert area / kept < 1.6, area / kept


def test_causal_staircase_on_cpu_only():
    """Note [Causal staircase]: on CPU a causal square of 2-4 strips (of 256 rows) becomes a strip
    staircase -- one full rectangle and one 256-row causal square per strip -- and others stay whole;
    CUDA never cuts."""
    from cp_dtensor.core.compute.kernels import causal_strip

    strip = causal_strip(torch.device("cpu"))
    assert strip == 256 and causal_strip(torch.device("cuda")) == 0
    one = runs("contiguous", 0, 1, 4096)
    for n, pieces in ((256, 1), (512, 3), (640, 5), (1024, 7), (1025, 1), (2048, 1)):
        segs = [(0, n, 0), (n, 4096, 1)]
        rects = [r for r in block_rects(one, one, None, 0, segs, segs, strip=strip) if r.q1 <= n]
        assert len(rects) == pieces, (n, rects)
        assert sum(r.kept() for r in rects) == n * (n + 1) // 2
        causal = [r for r in rects if r.kind == "causal"]
        assert all(r.q1 - r.q0 <= strip for r in causal) or pieces == 1, (n, causal)


def _case(rng: random.Random, world: int, i: int):
    layout = rng.choice(cp_dtensor.LAYOUTS)
    hq, hkv = rng.choice([(4, 2), (2, 2), (4, 1)])
    dqk, dv = rng.choice([(8, 8), (12, 8), (8, 16)])  # MLA: Dv != Dqk either way
    s = rng.choice([4, 6, 8])
    b = rng.choice([1, 2])
    return dict(
        layout=layout, causal=rng.random() < 0.6, hq=hq, hkv=hkv, dqk=dqk, dv=dv, s=s, b=b,
        docs=rng.random() < 0.7, sinks=rng.random() < 0.5, seed=i,
        # windows below, at and above S_local; one- and two-sided
        window=rng.choice([None, (2, 0), (5, -1), (-1, 3), (1, 1), (s + 1, 0), (3 * s, 2), (0, 0)]),
    )


def masked_case(c: dict, world: int):
    """Full-sequence float64 q, k, v, dO, document ids, sinks of case ``c`` on ``world`` ranks, and the
    float64 reference (out and gradients) they must give."""
    n = c["s"] * world
    g = torch.Generator().manual_seed(c["seed"])
    q = torch.randn(c["b"], c["hq"], n, c["dqk"], generator=g, dtype=torch.float64)
    k = torch.randn(c["b"], c["hkv"], n, c["dqk"], generator=g, dtype=torch.float64)
    v = torch.randn(c["b"], c["hkv"], n, c["dv"], generator=g, dtype=torch.float64)
    do = torch.randn(c["b"], c["hq"], n, c["dv"], generator=g, dtype=torch.float64)
    ids = _random_ids(random.Random(c["seed"]), c["b"], n) if c["docs"] else None
    if c.get("halves"):  # two documents of n / 2 tokens
        ids = (torch.arange(n) // (n // 2)).expand(c["b"], n)
    sinks = torch.randn(c["hq"], generator=g, dtype=torch.float64) if c["sinks"] else None
    want = masked_reference(q, k, v, do, is_causal=c["causal"], document_ids=ids, window_size=c["window"], sinks=sinks)
    return q, k, v, do, ids, sinks, want


def _run(rank, world, c, dtype, comm_dtype=None):
    q, k, v, do, ids, sinks, want = masked_case(c, world)

    def shard(x, dim=2):
        return shard_tensor(x, seq_dim=dim, layout=c["layout"], rank=rank, cp_size=world)

    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    sl = None if sinks is None else sinks.to(dtype if dtype == torch.float64 else torch.float32).requires_grad_()
    out = cp_dtensor.ring_attention(
        ql, kl, vl, layout=c["layout"], is_causal=c["causal"], comm_dtype=comm_dtype,
        document_ids=None if ids is None else shard(ids, 1), window_size=c["window"], sinks=sl,
    )
    out.backward(shard(do).to(dtype))
    assert out.dtype == dtype and out.shape == (c["b"], c["hq"], c["s"], c["dv"])
    errs = [abs_rel_err(a, shard(b)) for a, b in zip((out, ql.grad, kl.grad, vl.grad), want[:4])]
    if sinks is not None:  # each rank's sinks.grad is its own queries' share: the caller sums it
        total = sl.grad.clone()
        dist.all_reduce(total)
        errs.append(abs_rel_err(total, want[4]))
    return max(errs)


def _accuracy(rank, world):
    rng = random.Random(1000 + world)
    worst = 0.0
    for i in range(36):
        c = _case(rng, world, i)
        dtypes = [torch.float32] + ([torch.float64] if i % 3 == 0 else []) + ([torch.bfloat16] if i % 5 == 0 else [])
        for dtype in dtypes:
            err = _run(rank, world, c, dtype)
            assert err <= TOL[dtype], f"P={world} rank {rank} {c} {dtype}: error {err:.2e} > {TOL[dtype]}"
            worst = max(worst, err) if dtype == torch.float32 else worst
    # the float8 ring payload under documents + window + sinks: float8's own error, nothing worse
    if importlib.util.find_spec("torchao") is not None:  # the [float8] extra; tests/test_extras.py without it
        c = dict(layout="striped", causal=True, hq=4, hkv=2, dqk=16, dv=16, s=8, b=1, docs=True, sinks=True, seed=7,
                 window=(5, 0))
        assert _run(rank, world, c, torch.float32, comm_dtype=torch.float8_e4m3fn) < 0.1
    # documents long enough for the CPU staircase (Note [Causal staircase]): causal squares of 320-640
    # rows, cut into 256-row strips
    for layout in cp_dtensor.LAYOUTS:
        c = dict(layout=layout, causal=True, hq=2, hkv=1, dqk=16, dv=8, s=640, b=1, docs=True, halves=True,
                 sinks=True, seed=11, window=None)
        assert _run(rank, world, c, torch.float64) <= TOL[torch.float64], (layout, world)
        assert _run(rank, world, c, torch.float32) <= TOL[torch.float32], (layout, world)
    return worst


@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=slow("P = 4: ~15 s"))])
def test_masked_ring_matches_float64_reference(world):
    """Random documents (1 token to the whole sequence, shorter than P), windows (below / above S_local,
    two-sided), sinks, GQA/MQA and Dv != Dqk, every layout, causal and not; fp32, fp64, bf16, fp8 payload."""
    run_ranks(world, _accuracy)


def _bytes(rank, world):
    b, hq, hkv, s, d = 1, 4, 2, 16, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    block = 2 * b * s * d * hkv * 4  # one K/V block, fp32
    seen = {}
    # documents, striped: K/V at the formula; the ids add one all-gather of one byte per token
    glob = torch.arange(s * world).div(5, rounding_mode="floor").unsqueeze(0)  # documents of 5 tokens
    ids = shard_tensor(glob, seq_dim=1, layout="striped", rank=rank, cp_size=world)
    with CommBytes() as fwd:
        out = cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True, document_ids=ids)
    with CommBytes() as bwd:
        out.sum().backward()
    seen["docs"] = (fwd.by_op["all_to_all_single"], bwd.by_op["all_to_all_single"], fwd.by_op["all_gather_into_tensor"])
    # a causal window of S_local / 2 at the contiguous layout: one neighbour block, not P - 1
    with CommBytes() as fwd:
        out = cp_dtensor.ring_attention(q, k, v, layout="contiguous", is_causal=True, window_size=(s // 2, 0))
    with CommBytes() as bwd:
        out.sum().backward()
    seen["window"] = (fwd.by_op["all_to_all_single"], bwd.by_op["all_to_all_single"])
    return seen, block


@pytest.mark.parametrize("world", [2, 4])
def test_masked_bytes_on_the_wire(world):
    for seen, block in run_ranks(world, _bytes):
        kv_fwd, kv_bwd, ids = seen["docs"]
        assert kv_fwd == (world - 1) * block and kv_bwd == 2 * (world - 1) * block
        fingerprint = 8 * 20 * (world - 1)  # Note [Agreeing before the ring]: 20 int64 fields
        assert ids - fingerprint == 16 * (world - 1)  # one byte per token, gathered once
        assert (ids - fingerprint) / kv_fwd <= 0.02
        assert seen["window"] == (block, 2 * block)


def _bad_inputs(rank, world):
    s = 4
    q, k, v = (torch.randn(1, 2, s, 8) for _ in range(3))
    good_ids = shard_tensor(torch.arange(s * world).unsqueeze(0) // 3, seq_dim=1, layout="striped", rank=rank, cp_size=world)
    cases = {
        "ids dtype": dict(document_ids=good_ids.float()),
        "ids shape on one rank": dict(document_ids=good_ids if rank else good_ids[:, :-1]),
        "ids decrease across ranks": dict(document_ids=good_ids if rank != world - 1 else good_ids - 5),
        "window below -1": dict(window_size=(-2, 0)),
        "window not a pair": dict(window_size=(3,)),
        "ranks disagree on the window": dict(window_size=(rank, 0)),
        "sinks length": dict(sinks=torch.zeros(3)),
        "sinks differ across ranks": dict(sinks=torch.full((2,), float(rank))),
        "documents on one rank only": dict(document_ids=good_ids if rank == 0 else None),
    }
    messages = {}
    for name, kwargs in cases.items():
        with CommBytes() as cb:
            try:
                cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True, **kwargs)
            except ValueError as e:
                messages[name] = str(e)
            else:
                raise AssertionError(f"{name}: no error on rank {rank}")
        assert cb.by_op["all_to_all_single"] == 0, (name, cb.by_op)  # no K/V moved
    return messages


def test_bad_masks_raise_on_every_rank_before_kv_moves():
    per_rank = run_ranks(2, _bad_inputs)
    assert per_rank[0].keys() == per_rank[1].keys()
    assert "must not decrease" in per_rank[0]["ids decrease across ranks"]
    assert "window_left" in per_rank[1]["ranks disagree on the window"]
    assert "sinks" in per_rank[0]["sinks differ across ranks"]


def _compiled(rank, world):
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("inductor")

    @torch.compile(backend=backend, fullgraph=True)
    def attn(q, k, v, ids, sinks):
        return cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True, document_ids=ids,
                                         window_size=(5, 0), sinks=sinks)

    worst = 0.0
    for seed in range(3):  # new document boundaries (and values), same shapes: compiled once
        c = dict(layout="striped", causal=True, hq=4, hkv=2, dqk=16, dv=8, s=8, b=1, docs=True, sinks=True,
                 seed=seed, window=(5, 0))
        n = c["s"] * world
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, 4, n, 16, generator=g, dtype=torch.float64)
        k = torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64)
        v = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64)
        do = torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64)
        sinks = torch.randn(4, generator=g, dtype=torch.float64)
        ids = _random_ids(random.Random(seed), 1, n)
        want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=(5, 0), sinks=sinks)

        def shard(x, dim=2):
            return shard_tensor(x, seq_dim=dim, layout="striped", rank=rank, cp_size=world)

        ql, kl, vl = (shard(x).float().requires_grad_() for x in (q, k, v))
        sl = sinks.float().requires_grad_()
        out = attn(ql, kl, vl, shard(ids, 1), sl)
        out.backward(shard(do).float())
        total = sl.grad.clone()
        dist.all_reduce(total)
        errs = [abs_rel_err(a, shard(b)) for a, b in zip((out, ql.grad, kl.grad, vl.grad), want[:4])]
        worst = max(worst, *errs, abs_rel_err(total, want[4]))
    assert worst <= TOL[torch.float32], worst
    assert backend.frame_count == 1, backend.frame_count
    return worst


def test_compiled_masks_take_new_document_boundaries_without_recompiling():
    """torch.compile(fullgraph=True), Inductor: documents + window + sinks + Dv != Dqk, fwd+bwd at P=2."""
    run_ranks(2, _compiled)


def test_row_segments_are_read_once_per_ids_and_die_with_them():
    """ops.RowSegments (Note [One plan per call]): the runs of equal ids per row, written out by hand; read
    again after the ids change in place; the entry gone with the tensor."""
    from cp_dtensor.core.compute.ops import RowSegments

    cache = RowSegments()
    ids = torch.tensor([[0, 0, 1, 1, 1, 4], [2, 2, 2, 2, 2, 2]])
    assert cache(ids, 0) == ((0, 2, 0), (2, 5, 1), (5, 6, 4))
    assert cache(ids, 1) == ((0, 6, 2),)
    assert cache(ids, 0) is cache(ids, 0) and len(cache) == 1  # read once
    ids[0, 0] = -1  # in place: a new version, read again
    assert cache(ids, 0) == ((0, 1, -1), (1, 2, 0), (2, 5, 1), (5, 6, 4))
    other = ids.clone()
    cache(other, 1)
    assert len(cache) == 2
    del ids, other  # freed at once (reference counts): their entries with them
    assert len(cache) == 0
