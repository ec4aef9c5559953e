"""The CUDA kernels' real host-side rules, emulated on CPU (tests/_cuda.py): flash's window conversion
(max_seqlen_k) and bottom-right alignment, empty rows (out 0, lse +inf), the memory-efficient kernel with a
mask only in fp32, and the ring's kernel choice under torch's SDPA backend switches. See Note [Kernel
contracts] in cp_dtensor/core/compute/kernels.py (issue 53).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _cuda import StrictCuda, as_cuda, flash_window, keep_mask
from _tiers import slow

import cp_dtensor
from cp_dtensor.tools.plan_documents import lognormal_lengths
from _dist import run_ranks
from _ref import abs_rel_err, masked_reference


def _ids(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def test_flash_window_rules_read_from_torch():
    """The stand-in's host rules on the shapes issue 53 measured: an open right side in a rectangle taller
    than max_seqlen_k + 1 loses its first rows' latest keys; max_seqlen_k >= the rectangle's height keeps
    the window as meant; a side >= max_seqlen_k is dropped."""
    # 10 rows x 3 keys, window (left 2, right open): meant: row r keeps keys >= r - 7 - 2, i.e. all for r <= 9
    assert flash_window(2, -1, False, 10, 3, forward=True) == (2, 3)
    lost = ~keep_mask(10, 3, (2, 3)) & keep_mask(10, 3, (2, -1))
    assert lost.any(1).tolist()[:3] == [True, True, True]  # rows 0..2 lose keys (row 0 keeps none)
    assert not keep_mask(10, 3, (2, 3))[0].any()
    assert flash_window(2, -1, False, 10, 10, forward=True) == (2, 10)
    assert torch.equal(keep_mask(10, 3, (2, 10)), keep_mask(10, 3, (2, -1)))
    assert flash_window(5, 0, False, 4, 4, forward=True) == (4, 0)  # left >= max_k: dropped, then max_k
    assert flash_window(-1, -1, True, 1, 9, forward=True) == (-1, -1)  # one query row: not causal (forward)
    assert flash_window(-1, -1, True, 1, 9, forward=False) == (9, 0)


def _packed_docs(seed: int, n: int, median: float) -> torch.Tensor:
    return _ids(lognormal_lengths(seed, n, median))


def _rules_cases(rank, world, seeds):
    """Every layout (and the documents placement) x {documents + window + sinks, documents + window}, bf16,
    several log-normal packings each, forward + backward through the flash stand-ins with torch's host
    rules, against float64. Returns per case (error, non-finite count) and the stand-in's counters."""
    s, hq, hkv, d, window = 32, 4, 2, 16, (12, 0)
    n = s * world
    results, counters = {}, {"tall": 0, "changed": 0, "empty_rows": 0, "windowed": 0}
    layouts = [*cp_dtensor.LAYOUTS, "documents"]
    for li, layout in enumerate(layouts):
        for with_sinks in (True, False):
            for seed in range(seeds):
                ids = _packed_docs(100 * li + 10 * seed + with_sinks, n, median=12.0)[None]  # [1, N]
                g = torch.Generator().manual_seed(seed)
                q = torch.randn(1, hq, n, d, generator=g, dtype=torch.float64)
                k = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
                v = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
                do = torch.randn(1, hq, n, d, generator=g, dtype=torch.float64)
                sinks = torch.randn(hq, generator=g, dtype=torch.float64) if with_sinks else None
                want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=window, sinks=sinks)
                lay = cp_dtensor.document_layout(ids, world, windows=[window]) if layout == "documents" else layout

                def shard(x, dim=2, lay=lay):
                    return cp_dtensor.shard_tensor(x, seq_dim=dim, layout=lay, rank=rank, cp_size=world)

                ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
                sl = None if sinks is None else sinks.float().requires_grad_()
                standin = StrictCuda()
                with as_cuda(standin):
                    out = cp_dtensor.ring_attention(ql, kl, vl, layout=lay, is_causal=True, window_size=window,
                                                    document_ids=shard(ids, 1), sinks=sl)
                    out.backward(shard(do).to(torch.bfloat16))
                got = [out, ql.grad, kl.grad, vl.grad]
                refs = [shard(w) for w in want[:4]]
                if sl is not None:
                    total = sl.grad.clone()
                    dist.all_reduce(total)
                    got.append(total)
                    refs.append(want[4])
                bad = sum(int((~torch.isfinite(x.float())).sum()) for x in got)
                err = max(abs_rel_err(torch.nan_to_num(a.float(), 1e6, 1e6, -1e6), b) for a, b in zip(got, refs))
                key = f"{layout}{'+sinks' if with_sinks else ''}"
                prev = results.get(key, (0.0, 0))
                results[key] = (max(prev[0], err), prev[1] + bad)
                for name in counters:
                    counters[name] += getattr(standin, name)
                assert standin.calls, "the CUDA branch ran no kernel"
    return results, counters


@pytest.mark.parametrize("world, seeds", [(2, 1), pytest.param(4, 3, marks=slow("P = 4, three packings"))])
def test_documents_and_windows_under_flash_host_rules_match_float64(world, seeds):
    """Issue 53 item 1: packed log-normal documents + a sliding window (+ sinks, gpt-oss), bf16, every
    layout and the documents placement: within bf16 tolerance of float64 on every rank, nothing
    non-finite (outputs and gradients, the sinks' included), with rectangles taller than their call's
    keys exercised."""
    per_rank = run_ranks(world, _rules_cases, seeds)
    tall = sum(c["tall"] for _, c in per_rank)
    assert tall > 0, per_rank  # the shape max_seqlen_k decides was exercised
    for rank, (results, _) in enumerate(per_rank):
        for key, (err, bad) in results.items():
            assert bad == 0 and err <= 3e-2, (world, rank, key, err, bad)


# ---------------------------------------------------------------------------------------------------
# torch's SDPA backend switches choose the ring's CUDA kernel: Note [SDPA backend switches] in kernels.py.


def _switch_cases(rank, world):
    import contextlib

    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cp_dtensor.core.plan.layout import shard_tensor

    F, E, C, M = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                  SDPBackend.MATH)
    s, hq, hkv, d = 16, 4, 2, 16
    n = s * world
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, h, n, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    ids = _packed_docs(1, n, median=5.0)[None]
    window = (5, 0)

    def shard(x, dim=2):
        return shard_tensor(x, seq_dim=dim, layout="headtail", rank=rank, cp_size=world)

    def run(switch, dtype, masked, *, standin=None, backward_outside=False):
        """Forward (+ backward) under ``switch``; returns the stand-in's op names and the worst error vs float64."""
        standin = standin or StrictCuda()
        kw = dict(document_ids=shard(ids, 1), window_size=window) if masked else {}
        want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids if masked else None,
                                window_size=window if masked else None)
        ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
        with as_cuda(standin):
            with switch():
                out = cp_dtensor.ring_attention(ql, kl, vl, layout="headtail", is_causal=True, **kw)
                if not backward_outside:
                    out.backward(shard(do).to(dtype))
            if backward_outside:  # the backward runs the kernels the forward chose
                out.backward(shard(do).to(dtype))
        err = max(abs_rel_err(a, shard(b)) for a, b in zip((out, ql.grad, kl.grad, vl.grad), want[:4]))
        return {name for name, _ in standin.dtypes}, standin.dtypes, err

    def only(*backends):
        return lambda: sdpa_kernel(list(backends))

    flash_names = {"flash", "flash_bwd"}
    varlen_names = {"flash_varlen", "flash_varlen_bwd"}
    eff_names = {"efficient", "efficient_bwd"}
    routes = [  # (switch, dtype, masked, the stand-in ops the ring must call)
        (contextlib.nullcontext, torch.bfloat16, False, flash_names),
        (only(F), torch.bfloat16, False, flash_names),
        (only(E), torch.bfloat16, False, eff_names),
        (only(F, C), torch.bfloat16, False, flash_names),
        (only(E, C, M), torch.bfloat16, False, eff_names),
        (only(F), torch.bfloat16, True, varlen_names),
        (only(E), torch.bfloat16, True, eff_names),
        (only(E), torch.float32, True, eff_names),
        (contextlib.nullcontext, torch.float32, False, eff_names),
    ]
    for switch, dtype, masked, want in routes:
        names, dtypes, err = run(switch, dtype, masked)
        assert names == want, (switch, dtype, masked, names)
        assert err <= (3e-2 if dtype == torch.bfloat16 else 2e-5), (switch, dtype, masked, err)
        if masked and want == eff_names:  # window tiles with a bias: the efficient kernel in fp32 only
            assert torch.float32 in {dt for _, dt in dtypes}, dtypes
    # torch.backends.cuda.enable_flash_sdp(False): the same switch as sdpa_kernel's
    was = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        names, _, _ = run(contextlib.nullcontext, torch.bfloat16, True)
    finally:
        torch.backends.cuda.enable_flash_sdp(was)
    assert names == eff_names, names
    # forward under sdpa_kernel(EFFICIENT), backward outside it: the forward's kernels
    names, _, err = run(only(E), torch.bfloat16, False, backward_outside=True)
    assert names == eff_names and err <= 3e-2, (names, err)
    # refusals: a ValueError on every rank, raised by the agreement before any K/V moves
    refused = [
        (only(C), torch.bfloat16, False, None, "allow cudnn"),
        (only(M), torch.bfloat16, True, None, "no cudnn or math path"),
        (only(F), torch.float32, False, None, "flash takes fp16/bf16"),
        (only(F), torch.bfloat16, True, StrictCuda(windows=False), "lacks"),
    ]
    for switch, dtype, masked, standin, match in refused:
        with CommDebugMode() as cm, pytest.raises(ValueError, match=match):
            run(switch, dtype, masked, standin=standin)
        moved = {str(op).split(".")[-1]: c for op, c in cm.get_comm_counts().items()}
        assert not moved.get("all_to_all_single"), moved  # only the agreement's gathers of host ints: no K/V moved


def test_sdpa_backend_switches_route_the_rings_cuda_kernels():
    """sdpa_kernel / enable_*_sdp choose the ring's CUDA kernel (stand-in calls counted): flash, efficient
    (its masked calls in fp32 only), the forward's choice kept by the backward; a switch the ring cannot
    follow (cudnn or math only, fp32 under flash only, windows on a flash build without them and efficient
    off) raises a ValueError on every rank before any collective."""
    run_ranks(2, _switch_cases)


def _compiled_switch_cases(rank, world):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cp_dtensor.core.plan.layout import shard_tensor

    s, n = 8, 8 * world
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, h, n, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    want = masked_reference(q, k, v, do, is_causal=True)

    def shard(x):
        return shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world)

    def f(q, k, v):
        return cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True)

    names = {}
    for label, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        torch._dynamo.reset()
        standin = StrictCuda()
        ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
        with as_cuda(standin), sdpa_kernel([backend]):  # the switches as the trace reads them
            out = torch.compile(f, backend="aot_eager", fullgraph=True)(ql, kl, vl)
            out.backward(shard(do).to(torch.bfloat16))
        err = max(abs_rel_err(a, shard(b)) for a, b in zip((out, ql.grad, kl.grad, vl.grad), want[:4]))
        assert err <= 3e-2, (label, err)
        names[label] = {name for name, _ in standin.dtypes}
        assert s == out.shape[2]
    assert names == {"efficient": {"efficient", "efficient_bwd"}, "flash": {"flash", "flash_bwd"}}, names
    torch._dynamo.reset()
    ql, kl, vl = (shard(x).to(torch.bfloat16) for x in (q, k, v))
    with as_cuda(StrictCuda()), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), pytest.raises(ValueError, match="cudnn"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(ql, kl, vl)


@slow("three compiles (aot_eager), ~45 s")
def test_sdpa_backend_switches_under_torch_compile():
    """Compiled (aot_eager, fullgraph): the switches at trace time choose the kernels of the forward and the
    backward (Dynamo does not guard on them: a compiled function keeps its trace's choice); a switch the ring
    cannot follow raises the eager ValueError on every rank."""
    run_ranks(2, _compiled_switch_cases)


# ---------------------------------------------------------------------------------------------------
# On a GPU: the real ops against the rules above (the stand-ins' source of truth) and the branch the ring
# keeps off (bf16 efficient with a mask). Skipped without CUDA.

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@_CUDA
def test_real_flash_varlen_follows_the_emulated_host_rules():
    """torch's flash varlen op on tall and wide rectangles, windows one- and two-sided, max_seqlen_k as given
    and raised: out and lse equal the stand-in's emulation (tests/_cuda.py), empty rows included."""
    from _cuda import attend

    g = torch.Generator().manual_seed(0)
    for lq, lk, window, max_k in ((10, 3, (2, -1), 3), (10, 3, (2, -1), 10), (6, 6, (2, 0), 6), (9, 4, (1, 5), 4),
                                  (9, 4, (1, 5), 9), (5, 12, (-1, 3), 12)):
        q, k, v = (torch.randn(n, 2, 16, generator=g).to("cuda", torch.bfloat16) for n in (lq, lk, lk))
        cu_q = torch.tensor([0, lq], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, lk], dtype=torch.int32, device="cuda")
        out, lse = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, lq, max_k, 0.0, False, False,
                                                           scale=0.25, window_size_left=window[0],
                                                           window_size_right=window[1])[:2]
        keep = keep_mask(lq, lk, flash_window(*window, False, lq, max_k, forward=True))
        bias = torch.zeros(lq, lk, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        o, lse_ref = attend(*(x.cpu().transpose(0, 1)[None] for x in (q, k, v)), 0.25, False, bias)
        assert torch.equal(torch.isposinf(lse.cpu()), torch.isposinf(lse_ref[0])), (lq, lk, window, max_k)
        fin = torch.isfinite(lse_ref[0])
        assert torch.allclose(lse.cpu()[fin], lse_ref[0][fin], atol=2e-2), (lq, lk, window, max_k)
        assert abs_rel_err(out.cpu().transpose(0, 1)[None].float(), o) <= 2e-2, (lq, lk, window, max_k)


@_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_efficient_with_a_mask_in_half_precision(dtype):
    """The memory-efficient kernel with an additive mask (a document + window band, a fully masked row) in
    bf16 / fp16, forward + backward, against float64: the branch the ring runs in fp32 only (issue 53: an
    illegal memory access and NaN on the H200). Passing here on a device is what would lift that rule."""
    b, h, sq, sk, d, scale = 1, 2, 40, 48, 64, 0.125
    g = torch.Generator().manual_seed(1)
    q, do = (torch.randn(b, h, sq, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, h, sk, d, generator=g, dtype=torch.float64) for _ in range(2))
    keep = keep_mask(sq, sk, (7, 0)) & (torch.arange(sk)[None, :] >= 5)
    keep[3] = False  # a row with no key: its output 0, no gradient
    mask = torch.zeros(sq, sk, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    rows = keep.any(1)
    # float64 reference over the rows that keep a key
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    ref = torch.softmax((qr[..., rows, :] @ kr.transpose(-1, -2)) * scale + mask[rows], -1) @ vr
    ref.backward(do[..., rows, :])
    want_out = torch.zeros(b, h, sq, d, dtype=torch.float64)
    want_out[..., rows, :] = ref.detach()
    # the kernel: attn_bias [B, H, Sq, Sk] with rows on 16-element boundaries, as kernels.py passes it
    padded = torch.zeros(sq, sk + (-sk) % 16, dtype=dtype, device="cuda")
    padded[:, :sk] = mask.to(dtype)
    bias = padded[:, :sk].expand(b, h, sq, sk)
    xs = [x.to("cuda", dtype) for x in (q, k, v)]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(*xs, bias, True, 0.0, False, scale=scale)[:2]
    empty = torch.empty(0, dtype=torch.int64, device="cuda")
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        do.to("cuda", dtype), *xs, bias, out, lse.contiguous(), empty, empty, 0.0, [True, True, True, False], False,
        scale=scale)
    for name, a, w in (("out", out[..., rows.cuda(), :], want_out[..., rows, :]), ("dq", dq, qr.grad),
                       ("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        assert torch.isfinite(a.float()).all(), f"non-finite {name}"
        assert abs_rel_err(a.cpu().float(), w) <= 3e-2, name
    assert torch.isfinite(out.float()).all(), "non-finite output in the row with no key"
