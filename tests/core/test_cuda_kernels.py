"""The GPU tier (CP_DTENSOR_GPU=1, a CUDA device): the ring's CUDA branches on the real kernels, small shapes,
against float64 by the textbook formula. tests/core/test_cuda_paths.py runs the same branches on CPU through
stand-ins of the ops; these check the ops themselves: dense flash (bf16, fp16), the memory-efficient kernel
(fp32), the variable-length flash calls of a masked step -- documents and windows, in rectangles taller than
their keys, where a row can keep no key (out 0, lse -inf, never +inf or NaN) -- and the whole ring on two
ranks sharing the device over gloo (scripts/benchmarks/gpu_check.py runs the larger matrix)."""

from __future__ import annotations

import pytest
import torch
from _tiers import gpu

from _dist import run_ranks
from _ref import abs_rel_err, masked_reference

TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 2e-3}


def _inputs(seed, b, hq, hkv, sq, sk, d, dv, device):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv), (b, hq, sq, dv))
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device) for s in shapes]


def _reference(q, k, v, do, keep):
    """float64 attention of q [B, Hq, Sq, D] on k, v [B, Hkv, Sk, D] under ``keep`` [Sq, Sk]: out, lse, dq, dk,
    dv; a row that keeps no key has out 0, lse -inf and no gradient."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~keep.to(q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
    out = p @ v.repeat_interleave(g, 1)
    out.backward(do.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def dense_case(device, dtype, *, causal, hq=4, hkv=2, s=256, d=64, dv=64, seed=0) -> dict:
    """cp_dtensor::block_attn (and its autograd backward) on one square block vs float64."""
    from cp_dtensor.core.compute.ops import block_attn

    q, k, v, do = _inputs(seed, 1, hq, hkv, s, s, d, dv, device)
    keep = torch.ones(s, s, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    want = _reference(q, k, v, do, keep)
    ql, kl, vl = (x.to(dtype).requires_grad_() for x in (q, k, v))
    out, lse = block_attn(ql, kl, vl, causal, d**-0.5)
    out.backward(do.to(dtype))
    got = (out, lse, ql.grad, kl.grad, vl.grad)
    return {m: abs_rel_err(a, b) for m, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want)}


def rectangle_case(device, dtype, *, layout, window, seed=0, s=128, hq=4, hkv=2, d=64) -> dict:
    """One masked ring step of rank 1 on rank 0's block (P = 2) with packed documents and a window -- the
    varlen flash calls, rectangles taller than their keys included -- vs float64: errors, and whether every
    row that keeps no key came back with out 0 and lse -inf."""
    from cp_dtensor.core.compute.ops import masked_block_attn, masked_block_attn_backward
    from cp_dtensor.core.plan.layout import local_positions
    from cp_dtensor.core.plan.masks import flat_runs, mask_bounds, runs

    n = 2 * s
    ids = torch.zeros(1, n, dtype=torch.int64)
    # s = 128: documents [60, 120) and [120, 200). contiguous: rank 1's queries 128..199 against rank 0's keys
    # 120..127 (72 rows, 8 keys); headtail: queries 64..119 against keys 60..63. With a window of 40, the
    # later rows of those rectangles keep no key at all (issue 53's +inf lse).
    for cut in (s - 68, s - 8, s + 72):
        ids[:, cut:] += 1
    pos_q, pos_k = (local_positions(layout=layout, rank=r, cp_size=2, seq_len=n) for r in (1, 0))
    lo, hi = mask_bounds(True, window)
    keep = (ids[0, pos_q][:, None] == ids[0, pos_k][None, :]) & (pos_k[None, :] - pos_q[:, None] <= hi)
    if lo is not None:
        keep &= pos_k[None, :] - pos_q[:, None] >= lo
    q, k, v, do = _inputs(seed, 1, hq, hkv, s, s, d, d, device)
    want = _reference(q, k, v, do, keep)
    ql, kl, vl = (x.to(dtype) for x in (q, k, v))
    rq, rk = (flat_runs(runs(layout, r, 2, s)) for r in (1, 0))
    args = (ids[:, pos_q], ids[:, pos_k], rq, rk, lo, hi, d**-0.5)
    out, lse = masked_block_attn(ql, kl, vl, *args)
    # as the ring calls it: dO and out in the input dtype, the block's own lse as the rows' final one
    dq, dkv = masked_block_attn_backward(do.to(dtype), ql, kl, vl, out.to(dtype), lse, *args)
    dk, dv = dkv[: kl.numel()].view(kl.shape), dkv[kl.numel():].view(vl.shape)
    empty = ~keep.any(1)
    errs = {m: abs_rel_err(torch.nan_to_num(a.float(), posinf=1e30, neginf=0.0), torch.nan_to_num(b, neginf=0.0))
            for m, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want)}
    empty_ok = bool((lse[..., empty] == float("-inf")).all() and (out[..., empty, :] == 0).all())
    finite = all(bool(torch.isfinite(x).all()) for x in (out, dq, dk, dv))
    return dict(errors=errs, empty_rows=int(empty.sum()), empty_ok=empty_ok, finite=finite)


@gpu("the real CUDA attention kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [True, False])
def test_dense_block_kernels_match_float64(dtype, causal):
    errs = dense_case(torch.device("cuda", 0), dtype, causal=causal)
    assert max(errs.values()) <= TOL[dtype] and min(errs.values()) > 0, errs


@gpu("the real CUDA varlen flash kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "headtail", "striped"])
@pytest.mark.parametrize("window", [None, (40, 0)], ids=["docs", "docs+window"])
def test_varlen_rectangles_match_float64(dtype, layout, window):
    res = rectangle_case(torch.device("cuda", 0), dtype, layout=layout, window=window)
    assert res["finite"] and res["empty_ok"], res
    assert max(res["errors"].values()) <= TOL[dtype], res


def _ring_on_cuda(rank, world):
    """Every layout x docs + window + sinks, bf16, ring_attention on cuda:0 (both ranks) vs float64."""
    import cp_dtensor

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    n, worst = 128, {}
    ids = torch.zeros(2, n, dtype=torch.int64)
    for cut in (17, 40, 41, 90):
        ids[:, cut:] += 1
    ids[1] *= 2
    q, k, v, do = (x.cpu() for x in _inputs(3, 2, 8, 2, n, n, 64, 32, "cpu"))
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=(30, 0), sinks=sinks)
    for layout in ("striped", "headtail", "contiguous"):
        def shard(x, dim=2, layout=layout):
            return cp_dtensor.shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)

        ql, kl, vl = (shard(x).to(device, torch.bfloat16).requires_grad_() for x in (q, k, v))
        sk = sinks.float().to(device).requires_grad_()
        out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True, document_ids=shard(ids, 1),
                                        window_size=(30, 0), sinks=sk)
        out.backward(shard(do).to(device, torch.bfloat16))
        total = sk.grad.detach().cpu().double()
        torch.distributed.all_reduce(total)
        got = [out, ql.grad, kl.grad, vl.grad]
        errs = [abs_rel_err(a.cpu(), shard(b)) if torch.isfinite(a).all() else float("inf") for a, b in zip(got, want[:4])]
        worst[layout] = max(errs + [abs_rel_err(total, want[4])])
    return worst


@gpu("the ring on CUDA tensors, 2 ranks sharing the device over gloo")
def test_ring_on_cuda_matches_float64():
    for rank, worst in enumerate(run_ranks(2, _ring_on_cuda, start_method="spawn")):
        assert all(w <= TOL[torch.bfloat16] for w in worst.values()), (rank, worst)
