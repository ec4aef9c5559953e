"""ring_attention against float64 single-device attention, and its bytes against the formula."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import cp_dtensor
from cp_dtensor.core.plan.layout import shard_tensor
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import make_qkv, reference, rel_err

GQA = [(4, 4), (4, 2), (4, 1), (8, 2)]  # (Hq, Hkv): MHA, GQA 2, MQA, GQA 4


def _cases(world: int):
    for layout, causal, (hq, hkv) in itertools.product(cp_dtensor.LAYOUTS, (True, False), GQA):
        s_local = 6 if layout == "headtail" else 5  # odd where the layout allows it
        yield dict(layout=layout, causal=causal, hq=hq, hkv=hkv, s_local=s_local, scale=None)
    # a custom scale and a longer block
    for layout in cp_dtensor.LAYOUTS:
        yield dict(layout=layout, causal=True, hq=4, hkv=2, s_local=16, scale=0.3)


def _run_case(rank, world, case, dtype, seed):
    layout, causal = case["layout"], case["causal"]
    q, k, v, do = make_qkv(seed, 2, case["hq"], case["hkv"], case["s_local"] * world, 16)
    ref = reference(q, k, v, do, is_causal=causal, scale=case["scale"])

    def shard(x):
        return shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world).to(dtype)

    ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
    out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=causal, scale=case["scale"])
    out.backward(shard(do))
    assert out.dtype == dtype and out.shape == ql.shape
    got = (out, ql.grad, kl.grad, vl.grad)
    return max(rel_err(g, shard(r).double()) for g, r in zip(got, ref))


def _accuracy(rank, world):
    worst = {}
    for i, case in enumerate(_cases(world)):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            if dtype != torch.float32 and case["hq"] == 8:
                continue
            err = _run_case(rank, world, case, dtype, seed=i)
            tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}[dtype]
            assert err <= tol, f"P={world} rank {rank} {case} {dtype}: relative error {err:.2e} > {tol}"
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
    return worst


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_forward_and_gradients_match_float64_reference(world):
    """Every layout, causal and not, MHA/GQA/MQA, odd S_local, custom scale; fp32, bf16 and fp64."""
    run_ranks(world, _accuracy)


def _bytes(rank, world):
    results = []
    for layout, (hq, hkv), dtype in itertools.product(cp_dtensor.LAYOUTS, [(4, 2), (2, 2)], [torch.float32, torch.bfloat16]):
        b, s_local, d = 2, 8, 16
        q, k, v, do = make_qkv(0, b, hq, hkv, s_local * world, d)
        ql, kl, vl = (shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world).to(dtype).requires_grad_() for x in (q, k, v))
        with CommBytes() as fwd, CommDebugMode() as fwd_counts:
            out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True)
        with CommBytes() as bwd:
            out.backward(torch.ones_like(out))
        # The formula: (P - 1) steps of 2 * S_local * D * Hkv * itemsize (per batch element).
        formula = (world - 1) * 2 * b * s_local * d * hkv * dtype.itemsize
        assert fwd.by_op["all_to_all_single"] == formula, (layout, hq, hkv, dtype, fwd.by_op, formula)
        # Backward: K/V again plus the dK/dV accumulators, each P - 1 hops.
        assert bwd.by_op["all_to_all_single"] == 2 * formula, (layout, hq, hkv, dtype, bwd.by_op, formula)
        assert set(bwd.by_op) <= {"all_to_all_single"}
        # The agreement check of Note [Agreeing before the ring]: one tiny all_gather per call.
        counts = {str(op): n for op, n in fwd_counts.get_comm_counts().items()}
        assert sum(counts.values()) == (world - 1) + (1 if world > 1 else 0), counts
        results.append(fwd.by_op["all_gather_into_tensor"])
    _old_exchange_keywords(rank, world)
    return results


def _old_exchange_keywords(rank, world):
    """ring_forward / ring_backward with the keywords they took before the RingSpec: a FutureWarning, and
    the float64 reference's output and gradients."""
    import warnings

    from cp_dtensor.core.exchange.ring import ring_backward, ring_forward

    layout = "headtail"
    q, k, v, do = make_qkv(5, 1, 4, 2, 4 * world, 8)
    out_ref, *grads_ref = reference(q, k, v, do, is_causal=True, scale=0.5)
    ql, kl, vl, dol = (shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world).float() for x in (q, k, v, do))
    options = dict(group=dist.group.WORLD, layout=layout, is_causal=True, scale=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = ring_forward(ql, kl, vl, **options)
        grads = ring_backward(dol, ql, kl, vl, out, lse, **options)
    assert [w.category for w in caught] == [FutureWarning, FutureWarning], [str(w.message) for w in caught]
    for got, want in zip((out, *grads), (out_ref, *grads_ref)):
        assert rel_err(got, shard_tensor(want, seq_dim=2, layout=layout, rank=rank, cp_size=world)) < 2e-5


@pytest.mark.parametrize("world", [1, 2, 4])
def test_bytes_on_the_wire_match_the_formula(world):
    control = run_ranks(world, _bytes)
    assert all(c == 8 * 20 * (world - 1) for per_rank in control for c in per_rank)  # 20 int64 fields


def test_single_rank_is_plain_sdpa():
    """P=1 without a process group of more ranks: equal to SDPA on the same tensors."""

    def fn(rank, world):
        q, k, v, _ = make_qkv(3, 1, 4, 2, 33, 8)
        q, k, v = q.float(), k.float(), v.float()
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        got = cp_dtensor.ring_attention(q, k, v, is_causal=True, mesh=dist.group.WORLD)
        assert rel_err(got, want) < 1e-6

    run_ranks(1, fn)


@pytest.mark.parametrize("b,hq,hkv,threads", [(1, 4, 2, 1), (1, 4, 4, 2), (2, 8, 4, 4), (1, 32, 8, 16), (1, 6, 3, 2)])
def test_backward_head_chunks_cover_every_head_once(b, hq, hkv, threads):
    # Note [Backward in head chunks]: each call keeps >= one (batch, head) pair per thread, whole KV groups
    from cp_dtensor.core.compute.ops import head_chunks as _head_chunks

    q, k = torch.empty(b, hq, 2, 8), torch.empty(b, hkv, 2, 8)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        chunks = _head_chunks(q, k)
    finally:
        torch.set_num_threads(old)
    groups = hq // hkv
    q_heads = [h for qs, _ in chunks for h in range(hq)[qs]]
    kv_heads = [h for _, ks in chunks for h in range(hkv)[ks]]
    assert q_heads == list(range(hq)) and kv_heads == list(range(hkv))
    for qs, ks in chunks:
        n_kv = len(range(hkv)[ks])
        assert range(hq)[qs] == range(ks.start * groups, (ks.start + n_kv) * groups)
        assert b * n_kv * groups >= min(threads, b * hq)
    # one call per block where the kernel wants every head at once
    assert _head_chunks(q.to("meta"), k.to("meta")) == [(slice(None), slice(None))]
