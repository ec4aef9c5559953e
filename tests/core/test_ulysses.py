"""2-D CP (heads all-to-all x ring) and the all-gather K/V exchange against float64 dense-mask attention on the
full sequence; bytes on the wire against cp_dtensor.wire's formulas; bad input raising on every rank."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from _tiers import slow
from test_masks import masked_case
from torch.distributed.device_mesh import init_device_mesh

import cp_dtensor
from cp_dtensor.core.exchange.ulysses import kv_replicas, union_order
from cp_dtensor.core.plan.layout import local_positions, shard_tensor
from cp_dtensor.core.plan.masks import Run, runs
from cp_dtensor.core.plan.wire import allgather_bytes, check_bytes, ring_bytes, ulysses_bytes
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import abs_rel_err

TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
MESHES = [(2, 2), (1, 4), (4, 1)]


def _expand(rs: tuple[Run, ...]) -> list[int]:
    return [r.base + r.stride * i for r in rs for i in range(r.count)]


def test_union_runs_are_the_union_of_the_group_shards():
    """For every layout and (U, R): ring rank r's runs (masks.runs(..., ulysses=U)) list exactly the
    positions of the 1-D shards of ranks u * R + r taken in union_order, increasing."""
    for layout in cp_dtensor.LAYOUTS:
        for u_, r_ in [(2, 2), (1, 4), (4, 1), (2, 3), (3, 2), (4, 2)]:
            p, s = u_ * r_, 6
            for r in range(r_):
                parts = torch.cat([local_positions(layout=layout, rank=u * r_ + r, cp_size=p, seq_len=p * s) for u in range(u_)])
                want = parts[torch.tensor(union_order(layout, u_, s))].tolist()
                got = _expand(runs(layout, r, r_, u_ * s, ulysses=u_))
                assert got == want, (layout, u_, r_, r, got, want)
                assert want == sorted(want)


def test_kv_replicas_is_the_least_uniform_split():
    assert [kv_replicas(hkv, 4) for hkv in (1, 2, 4, 8, 6)] == [4, 2, 1, 1, 2]
    assert kv_replicas(3, 1) == 1


def _case(rng: random.Random, i: int, u_: int):
    hq, hkv = rng.choice([(4, 2), (4, 1), (8, 2), (4, 4), (12, 6)] if u_ == 4 else [(4, 2), (2, 1), (6, 3), (4, 4)])
    if u_ == 4 and hq % 4:
        hq, hkv = 4, 2
    s = rng.choice([4, 6])
    return dict(
        layout=cp_dtensor.LAYOUTS[i % 3], causal=rng.random() < 0.7, hq=hq, hkv=hkv,
        dqk=8, dv=rng.choice([8, 12]), s=s, b=rng.choice([1, 2]), docs=rng.random() < 0.4,
        sinks=rng.random() < 0.4, window=rng.choice([None, None, (3, 0), (s + 1, 2), (-1, 2)]),
        kv_exchange=rng.choice(["ring", "allgather"]), seed=i,
    )


def _run(rank, world, c, group, dtype=torch.float32):
    q, k, v, do, ids, sinks, want = masked_case(c, world)

    def shard(x, dim=2):
        return shard_tensor(x, seq_dim=dim, layout=c["layout"], rank=rank, cp_size=world)

    ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
    sl = None if sinks is None else sinks.to(dtype).requires_grad_()
    out = cp_dtensor.ring_attention(
        ql, kl, vl, mesh=group, layout=c["layout"], is_causal=c["causal"], kv_exchange=c["kv_exchange"],
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


def _bytes_case(rank, world, group, u_, kv_exchange, layout, hq, hkv, causal=True):
    b, s, dqk, dv = 2, 4, 8, 12
    g = torch.Generator().manual_seed(5)
    q = torch.randn(b, hq, s, dqk, generator=g, requires_grad=True)
    k = torch.randn(b, hkv, s, dqk, generator=g, requires_grad=True)
    v = torch.randn(b, hkv, s, dv, generator=g, requires_grad=True)
    with CommBytes() as fwd:
        out = cp_dtensor.ring_attention(q, k, v, mesh=group, layout=layout, is_causal=causal, kv_exchange=kv_exchange)
    with CommBytes() as bwd:
        out.backward(torch.ones_like(out))
    dims = dict(b=b, s_local=s, hkv=hkv, dqk=dqk, dv=dv, itemsize=4)
    if u_ is None:  # 1-D
        want = (allgather_bytes if kv_exchange == "allgather" else ring_bytes)(p=world, **dims)
        check = check_bytes(world)
    else:
        want = ulysses_bytes(u=u_, r=world // u_, hq=hq, kv_exchange=kv_exchange, **dims)
        check = check_bytes(world, u_)
    got_fwd, got_bwd = fwd.sent - check, bwd.sent
    assert (got_fwd, got_bwd) == (want["fwd"], want["bwd"]), (u_, kv_exchange, layout, hq, hkv, fwd.by_op, bwd.by_op, want)
    return got_fwd + got_bwd, want["total"]


def _errors(rank, world, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        return str(e)
    return ""


def _all(rank, world):
    worst = 0.0
    rng = random.Random(19)
    meshes = {shape: init_device_mesh("cpu", shape) for shape in MESHES}
    i = 0
    for shape, mesh in meshes.items():
        for _ in range(9):
            c = _case(rng, i, shape[0])
            err = _run(rank, world, c, mesh)
            assert err <= TOL[torch.float32], f"mesh {shape} rank {rank} {c}: error {err:.2e}"
            worst = max(worst, err)
            i += 1
    # float64: the exact path, 2x2, every layout, causal with documents, window and sinks
    for j, layout in enumerate(cp_dtensor.LAYOUTS):
        c = dict(layout=layout, causal=True, hq=4, hkv=1, dqk=8, dv=12, s=6, b=1, docs=True, sinks=True,
                 window=(7, 0), kv_exchange=["ring", "allgather"][j % 2], seed=100 + j)
        err = _run(rank, world, c, meshes[(2, 2)], torch.float64)
        assert err <= TOL[torch.float64], (c, err)
    # the all-gather exchange on the 1-D group, every layout, masks
    for j in range(6):
        c = _case(rng, 200 + j, 1) | dict(kv_exchange="allgather", layout=cp_dtensor.LAYOUTS[j % 3])
        err = _run(rank, world, c, None)
        assert err <= TOL[torch.float32], (c, err)
    # bytes on the wire vs cp_dtensor.wire
    ratios = {}
    for name, group, u_ in [("ring", None, None), ("allgather", None, None), ("2x2", meshes[(2, 2)], 2),
                            ("2x2-allgather", meshes[(2, 2)], 2), ("4x1", meshes[(4, 1)], 4)]:
        for layout, (hq, hkv) in [("striped", (4, 2)), ("headtail", (4, 1)), ("contiguous", (8, 2))]:
            got, want = _bytes_case(rank, world, group, u_, "allgather" if "allgather" in name else "ring", layout, hq, hkv)
            ratios[f"{name}/{layout}/{hq}x{hkv}"] = got / want
    # bad input raises on every rank, before any K/V or head moves
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 1, 4, 8)
    msgs = [_errors(rank, world, cp_dtensor.ring_attention, q, k, k, mesh=meshes[(4, 1)])]  # Hq 2 % U 4
    qq = torch.randn(1, 4 if rank else 8, 4, 8)  # one rank disagrees on Hq
    msgs.append(_errors(rank, world, cp_dtensor.ring_attention, qq, k, k, mesh=meshes[(2, 2)]))
    msgs.append(_errors(rank, world, cp_dtensor.ring_attention, q, k, k, mesh=meshes[(2, 2)], kv_exchange="p2p"))
    mesh3 = init_device_mesh("cpu", (2, 2, 1))
    msgs.append(_errors(rank, world, cp_dtensor.ring_attention, q, k, k, mesh=mesh3))
    qb = torch.randn(1, 4, 4 + (rank == 3), 8)  # one rank's S differs: every rank must raise
    kb = torch.randn(1, 2, 4 + (rank == 3), 8)
    msgs.append(_errors(rank, world, cp_dtensor.ring_attention, qb, kb, kb, mesh=meshes[(2, 2)]))
    # still usable after the errors: one more exact call
    c = _case(random.Random(7), 300, 2)
    assert _run(rank, world, c, meshes[(2, 2)]) <= TOL[torch.float32]
    return worst, ratios, msgs


@pytest.fixture(scope="module")
def results():
    return run_ranks(4, _all)


def test_2d_and_allgather_match_float64_reference(results):
    assert all(r[0] <= TOL[torch.float32] for r in results)


def test_bytes_on_the_wire_match_the_formulas(results):
    for _, ratios, _ in results:
        assert ratios and all(x == 1.0 for x in ratios.values()), ratios


def test_bad_input_raises_on_every_rank(results):
    msgs = [r[2] for r in results]
    for rank_msgs in msgs:
        hq, disagree, exchange, mesh3, seq = rank_msgs
        assert "Hq (2) must be divisible by U (4)" in hq, hq
        assert "q_heads" in disagree, disagree
        assert "kv_exchange must be one of" in exchange, exchange
        assert "2-D (ulysses, ring) mesh" in mesh3, mesh3
        assert "seq_len_local" in seq, seq


def _compiled(rank, world):
    torch._inductor.config.compile_threads = 1
    mesh = init_device_mesh("cpu", (2, 2))
    worst = 0.0
    for layout, exchange, backend in [("striped", "ring", "inductor"), ("headtail", "allgather", "aot_eager")]:
        hq, hkv = (4, 1) if exchange == "ring" else (8, 4)  # all-gather: 2 K/V heads a rank, 2 gathered chunks
        c = dict(layout=layout, causal=True, hq=hq, hkv=hkv, dqk=8, dv=8, s=4, b=1, docs=False, sinks=False,
                 window=None, kv_exchange=exchange, seed=11)
        torch._dynamo.reset()
        f = torch.compile(cp_dtensor.ring_attention, backend=backend, fullgraph=True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cp_dtensor, "ring_attention", f)
            worst = max(worst, _run(rank, world, c, mesh))
    return worst


@slow("4 ranks compiling on 2 CPU cores: ~2 min")
def test_2d_compiles_fullgraph():
    """The 2-D path (heads all-to-all, ring or all-gather, all-to-all back) under torch.compile(fullgraph=True):
    forward and gradients vs float64."""
    assert all(err <= TOL[torch.float32] for err in run_ranks(4, _compiled, timeout=900))
