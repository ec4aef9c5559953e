"""The CUDA branches of kernels.py / ops.py / ring.py, run on CPU through strict stand-ins of the CUDA
attention ops: each stand-in asserts the op's input contract (Note [Kernel contracts] in kernels.py)
and computes by the textbook formula in float64. The ring's results are compared with float64
single-device attention, as everywhere else.
"""

from __future__ import annotations

import math
import random
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import cp_dtensor
import cp_dtensor.core.kernels as kernels
from cp_dtensor.core.layout import shard_tensor
from _dist import run_ranks
from _ref import abs_rel_err, masked_reference

_REAL = torch.ops.aten


def _dense(x):
    return x.stride(-1) == 1


def _math(q, k, v, scale, is_causal, bias=None):
    """Scores and probabilities in float64 with GQA by repetition; causal only on squares (asserted)."""
    g = q.shape[1] // k.shape[1]
    ke, ve = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ ke.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if is_causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return s, ke, ve


def _grads(dout, q, k, v, out, lse, scale, is_causal, bias=None):
    """dq, dk, dv from the given out and lse (the kernel contract: P = exp(s - lse), D = rowsum(dO * O))."""
    s, ke, ve = _math(q, k, v, scale, is_causal, bias)
    p = torch.exp(s - lse.double().unsqueeze(-1))
    do = dout.double()
    dv = p.transpose(-1, -2) @ do
    dp = do @ ve.transpose(-1, -2)
    ds = p * (dp - (do * out.double()).sum(-1, keepdim=True))
    dq = ds @ ke * scale
    dk = ds.transpose(-1, -2) @ q.double() * scale
    g = q.shape[1] // k.shape[1]
    dk, dv = dk.unflatten(1, (-1, g)).sum(2), dv.unflatten(1, (-1, g)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class StrictCuda:
    """Stand-ins for the CUDA attention ops kernels.py calls; records what each call received."""

    def __init__(self, windows: bool = True):
        self.calls: list[tuple[str, int, int]] = []  # (op, q heads, k heads)
        self.windows = windows  # whether this "flash build" takes window sizes (else it refuses them)
        self.windowed = 0  # calls that passed a window

    def _common(self, name, q, k, v, dropout_p, is_causal):
        assert dropout_p == 0.0
        assert q.dtype == k.dtype == v.dtype and all(_dense(x) for x in (q, k, v)), f"{name}: last dim not dense"
        assert k.shape == v.shape, f"{name}: one head size for q, k, v"
        assert q.shape[-1] == k.shape[-1]
        if is_causal:
            assert q.shape[2] == k.shape[2], f"{name}: is_causal on a non-square block {q.shape} x {k.shape}"
        self.calls.append((name, q.shape[1], k.shape[1]))

    def _flash_checks(self, q, k):
        assert q.dtype in (torch.float16, torch.bfloat16), f"flash: dtype {q.dtype}"
        assert q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
        assert q.shape[1] % k.shape[1] == 0

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        self._common("flash", q, k, v, dropout_p, is_causal)
        self._flash_checks(q, k)
        s, _, ve = _math(q, k, v, scale, is_causal)
        lse = torch.logsumexp(s, -1)
        out = (torch.softmax(s, -1) @ ve).to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        rng = torch.zeros(2, dtype=torch.int64)
        return out, lse.float(), None, None, q.shape[2], k.shape[2], rng, torch.empty(()), torch.empty(0)

    def _scaled_dot_product_flash_attention_backward(
        self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None
    ):
        self._common("flash_bwd", q, k, v, dropout_p, is_causal)
        self._flash_checks(q, k)
        assert cum_q is None and cum_k is None, "flash backward: dense calls pass no cumulative lengths"
        assert (max_q, max_k) == (q.shape[2], k.shape[2])
        assert _dense(dout) and _dense(out) and out.shape == q.shape
        # read through a raw pointer as a dense [B, H, Sq] fp32 array
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3], lse.shape
        assert lse.is_contiguous(), "flash backward: lse must be contiguous [B, H, Sq]"
        return _grads(dout, q, k, v, out, lse, scale, is_causal)

    def _eff_checks(self, q, k, bias):
        assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"efficient: dtype {q.dtype}"
        assert q.shape[1] == k.shape[1], f"efficient: no GQA (q heads {q.shape[1]}, k heads {k.shape[1]})"
        if bias is not None:
            assert bias.dtype == q.dtype and bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, f"efficient: bias rows unaligned {bias.stride()}"

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
        self._common("efficient", q, k, v, dropout_p, is_causal)
        self._eff_checks(q, k, bias)
        assert compute_lse
        s, _, ve = _math(q, k, v, scale, is_causal, bias)
        lse = torch.logsumexp(s, -1).float()
        pad = math.ceil(q.shape[2] / 32) * 32
        lse = torch.cat([lse, lse.new_full((*lse.shape[:2], pad - q.shape[2]), float("nan"))], -1)  # padding: NaN
        out = (torch.softmax(s, -1) @ ve).to(q.dtype)
        return out, lse, torch.empty(()), torch.empty(())

    def _scaled_dot_product_efficient_attention_backward(
        self, dout, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask, is_causal=False, *, scale=None
    ):
        self._common("efficient_bwd", q, k, v, dropout_p, is_causal)
        self._eff_checks(q, k, bias)
        assert lse.shape == (*q.shape[:2], math.ceil(q.shape[2] / 32) * 32) and lse.is_contiguous()
        assert _dense(dout) and _dense(out)
        dq, dk, dv = _grads(dout, q, k, v, out, lse[..., : q.shape[2]], scale, is_causal, bias)
        return dq, dk, dv, None

    def _varlen(self, name, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, window):
        """The packed-sequence contract (Note [Kernel contracts]); returns the sequences' row ranges."""
        assert dropout_p == 0.0, f"{name}: no dropout"
        if window != (None, None):
            if not self.windows:  # as a build without local attention: a host-side error at the call
                raise RuntimeError(f"{name}: this flash build does not support local (sliding window) attention")
            self.windowed += 1
            assert all(isinstance(w, int) and w >= -1 for w in window) and not is_causal, f"{name}: window {window}"
        assert q.dim() == k.dim() == v.dim() == 3, f"{name}: packed [T, H, D], got {q.shape}"
        assert q.dtype == k.dtype == v.dtype and all(_dense(x) for x in (q, k, v)), f"{name}: last dim not dense"
        assert k.shape == v.shape and q.shape[-1] == k.shape[-1], f"{name}: one head size"
        assert q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
        assert q.shape[1] % k.shape[1] == 0
        for cu, t in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous() and cu.device == q.device
            assert int(cu[0]) == 0 and int(cu[-1]) == t and bool((cu[1:] > cu[:-1]).all()), f"{name}: {cu}"
        assert cu_q.numel() == cu_k.numel(), f"{name}: one k range per q range"
        lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        assert (max_q, max_k) == (max(lq), max(lk)), f"{name}: max lengths {max_q, max_k} vs {max(lq), max(lk)}"
        if is_causal:
            assert lq == lk, f"{name}: is_causal on non-square sequences (flash aligns them bottom-right)"
        self.calls.append((name, q.shape[1], k.shape[1]))
        return list(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()))

    @staticmethod
    def _window_bias(nq, nk, window):
        """flash-attn's sliding window, bottom-right aligned: row i keeps keys i + nk - nq - left ..
        i + nk - nq + right (-1: unbounded). Asserts every row keeps one (the kernel's result is
        undefined otherwise)."""
        if window == (None, None):
            return None
        left, right = window
        d = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - (nk - nq)
        keep = torch.ones(nq, nk, dtype=torch.bool)
        keep &= d >= -left if left >= 0 else True
        keep &= d <= right if right >= 0 else True
        assert keep.any(1).all(), f"flash window {window} on {nq} x {nk} leaves a row without keys"
        return torch.zeros(nq, nk, dtype=torch.float64).masked_fill(~keep, float("-inf"))

    @staticmethod
    def _bhsd(x, a, b):  # packed rows [a, b) of [T, H, D] as [1, H, n, D]
        return x[a:b].transpose(0, 1).unsqueeze(0)

    def _flash_attention_forward(
        self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None,
        window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None, block_table=None,
        num_splits=None,
    ):
        assert scale is not None and not return_debug_mask and seqused_k is None and alibi_slopes is None
        window = (window_size_left, window_size_right)
        seqs = self._varlen("flash_varlen", q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, window)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for a, b, c, d in seqs:
            bias = self._window_bias(b - a, d - c, window)
            s, _, ve = _math(self._bhsd(q, a, b), self._bhsd(k, c, d), self._bhsd(v, c, d), scale, is_causal, bias)
            out[a:b] = (torch.softmax(s, -1) @ ve)[0].transpose(0, 1).to(q.dtype)
            lse[:, a:b] = torch.logsumexp(s, -1)[0].float()
        return out, lse, torch.zeros(2, dtype=torch.int64), torch.empty(()), torch.empty(0)

    def _flash_attention_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
        scale=None, window_size_left=None, window_size_right=None,
    ):
        assert scale is not None
        window = (window_size_left, window_size_right)
        seqs = self._varlen("flash_varlen_bwd", q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, window)
        assert dout.shape == out.shape == q.shape and _dense(dout) and _dense(out), "flash varlen bwd: dout/out"
        assert dout.dtype == out.dtype == q.dtype, f"flash varlen bwd: dout {dout.dtype}, out {out.dtype}, q {q.dtype}"
        # read through a raw pointer as a dense [Hq, Tq] fp32 array
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous(), lse.shape
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, d in seqs:
            bias = self._window_bias(b - a, d - c, window)
            g = _grads(self._bhsd(dout, a, b), self._bhsd(q, a, b), self._bhsd(k, c, d), self._bhsd(v, c, d),
                       self._bhsd(out, a, b), lse[:, a:b].unsqueeze(0), scale, is_causal, bias)
            dq[a:b] = g[0][0].transpose(0, 1)
            dk[c:d] += g[1][0].transpose(0, 1)
            dv[c:d] += g[2][0].transpose(0, 1)
        return dq, dk, dv

    def __getattr__(self, name):  # any other aten op (the CPU kernel included) must not be reached
        raise AssertionError(f"the CUDA branch called aten.{name}")


def _as_cuda(standin):
    """Run the CUDA branches on CPU tensors: kernels.backend says "cuda", aten ops are the stand-ins (and
    the flash-windows probe asks them afresh)."""
    return _stack(mock.patch.multiple(kernels, aten=standin, backend=lambda x: "cuda"),
                  mock.patch.dict(kernels._FLASH_WINDOWS, clear=True))


def _ring_cases(rank, world):
    rng = random.Random(5)
    standin = StrictCuda()
    worst = {}
    with _as_cuda(standin):
        assert kernels.flash_windows(torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16))  # probed once, before the cases
        for i, (layout, (hq, hkv), dtype, masked) in enumerate(
            (lay, h, dt, m) for lay in cp_dtensor.LAYOUTS for h in ((4, 2), (4, 4), (8, 1))
            for dt in (torch.bfloat16, torch.float32) for m in (False, True)
        ):
            s, d = 8, 16
            n = s * world
            g = torch.Generator().manual_seed(i)
            dv = 8 if masked else d  # MLA-style Dv != Dqk on the masked cases
            q = torch.randn(1, hq, n, d, generator=g, dtype=torch.float64)
            k = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
            v = torch.randn(1, hkv, n, dv, generator=g, dtype=torch.float64)
            do = torch.randn(1, hq, n, dv, generator=g, dtype=torch.float64)
            opts = {}
            if masked:
                ids = torch.zeros(1, n, dtype=torch.int64)
                for cut in sorted(rng.sample(range(1, n), 3)):
                    ids[0, cut:] += 1
                opts = dict(document_ids=ids, window_size=(5, 0), sinks=torch.randn(hq, generator=g, dtype=torch.float64))
            causal = masked or i % 2 == 0
            want = masked_reference(q, k, v, do, is_causal=causal, **opts)

            def shard(x, dim=2):
                return shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)

            ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
            kw = {}
            if masked:
                kw = dict(document_ids=shard(opts["document_ids"], 1), window_size=(5, 0),
                          sinks=opts["sinks"].float().requires_grad_())
            standin.calls.clear()
            out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=causal, **kw)
            out.backward(shard(do).to(dtype))
            err = max(abs_rel_err(a, shard(b)) for a, b in zip((out, ql.grad, kl.grad, vl.grad), want[:4]))
            if masked:
                total = kw["sinks"].grad.clone()
                dist.all_reduce(total)
                err = max(err, abs_rel_err(total, want[4]))
            tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
            assert err <= tol, (layout, hq, hkv, dtype, masked, err)
            # native GQA on flash (K/V with their own heads); efficient: one KV head's group at a time
            for name, qh, kh in standin.calls:
                if name.startswith("flash"):
                    assert (qh, kh) == (hq, hkv), (name, qh, kh)
                else:
                    assert qh == kh == hq // hkv, (name, qh, kh)
            kinds = {name.split("_")[0] for name, _, _ in standin.calls}
            if dtype == torch.float32:
                assert kinds == {"efficient"}, kinds  # no fp32 flash kernel
            elif not masked:
                assert kinds == {"flash"}, kinds
            else:  # flash for full and causal rectangles, efficient (with a bias) for window tiles
                assert kinds <= {"flash", "efficient"}, kinds
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
    return worst


def _varlen_cases(rank, world):
    """Documents and windows on CUDA flash dtypes: every step's rectangles in a few variable-length calls
    (full, causal, one per window the bands need), whatever the number of documents; on a flash build
    without windows, window tiles fall back to the memory-efficient kernel (Note [Varlen rectangles])."""
    worst = 0.0
    windows = [None, (5, 0), (2, 3), (-1, 2), (7, -1), (30, 0)]
    seen = {"windowed flash": 0, "efficient tiles": 0}
    for i, (layout, b, same, (dqk, dv), flash_windows) in enumerate(
        (lay, b, same, hd, fw) for lay in cp_dtensor.LAYOUTS for b, same in ((1, True), (2, True), (2, False))
        for hd in ((16, 16), (16, 8)) for fw in (True, False)
    ):
        standin = StrictCuda(windows=flash_windows)
        window = windows[(i // 2) % len(windows)]
        s, hq, hkv = 12, 4, 2
        n = s * world
        g = torch.Generator().manual_seed(100 + i)
        q = torch.randn(b, hq, n, dqk, generator=g, dtype=torch.float64)
        k = torch.randn(b, hkv, n, dqk, generator=g, dtype=torch.float64)
        v = torch.randn(b, hkv, n, dv, generator=g, dtype=torch.float64)
        do = torch.randn(b, hq, n, dv, generator=g, dtype=torch.float64)
        ids = torch.zeros(b, n, dtype=torch.int64)
        rng = random.Random(i)
        for row in range(b):  # 1-token documents up to ones longer than a block
            for cut in sorted(rng.sample(range(1, n), 6 if (i // 4) % 2 else 2)):
                ids[row, cut:] += 1
            if same:
                ids[row] = ids[0]
        want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=window)

        def shard(x, dim=2):
            return shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)

        ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
        with _as_cuda(standin):
            assert kernels.flash_windows(ql) == flash_windows  # the probe: one tiny windowed call
            standin.calls.clear()
            out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True, document_ids=shard(ids, 1),
                                            window_size=window)
            out.backward(shard(do).to(torch.bfloat16))
        err = max(abs_rel_err(a, shard(w)) for a, w in zip((out, ql.grad, kl.grad, vl.grad), want[:4]))
        assert err <= 3e-2, (layout, b, same, dqk, dv, window, flash_windows, err)
        worst = max(worst, err)
        names = [name for name, _, _ in standin.calls]
        assert all((qh, kh) == (hq, hkv) for name, qh, kh in standin.calls if name.startswith("flash")), standin.calls
        if flash_windows or window is None or window[0] < 0:
            assert set(names) <= {"flash_varlen", "flash_varlen_bwd"}, (window, flash_windows, names)
        else:  # window tiles, with a bias, on the memory-efficient kernel
            assert set(names) <= {"flash_varlen", "flash_varlen_bwd", "efficient", "efficient_bwd"}, (window, names)
        seen["windowed flash"] += standin.windowed
        seen["efficient tiles"] += names.count("efficient")
        rows = 1 if same else b  # batch rows with their own documents get their own calls
        varlen = [n_ for n_ in names if n_.startswith("flash_varlen")]
        assert len(varlen) <= 2 * 6 * world * rows, (window, len(varlen))  # <= 6 calls a step, fwd and bwd
    assert all(seen.values()), seen  # both window paths ran
    return worst


@pytest.mark.parametrize("world", [1, 2, 3])
def test_documents_and_windows_run_as_varlen_calls_on_cuda_flash(world):
    """Many documents per block with windows (one- and two-sided, below and above S_local), bf16, every
    layout, one or two batch rows (shared or own ids), Dv != Dqk, flash builds with and without window
    support: exact vs float64 through the varlen stand-ins."""
    run_ranks(world, _varlen_cases)


@pytest.mark.parametrize("world", [2, 3])
def test_cuda_branches_through_strict_standins_match_float64(world):
    """Every layout x GQA/MHA/MQA x bf16 (flash) / fp32 (efficient) x unmasked / masked (documents,
    window, sinks, Dv != Dqk), forward and backward, through the CUDA calls with their contracts checked."""
    run_ranks(world, _ring_cases)


def test_standin_rejects_a_strided_lse():
    """The contract the ring once broke: a slice of the ring's lse handed to the flash backward."""
    standin = StrictCuda()
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    out, lse = standin._scaled_dot_product_flash_attention(q, q, q, 0.0, True, scale=0.25)[:2]
    with pytest.raises(AssertionError, match="lse must be contiguous"):
        standin._scaled_dot_product_flash_attention_backward(
            out[:, :, 1:], q[:, :, 1:], q[:, :, 1:], q[:, :, 1:], out[:, :, 1:], lse[:, :, 1:], None, None, 7, 7,
            0.0, True, None, None, scale=0.25,
        )
    # and kernels.kernel_bwd hands it a contiguous copy
    with _as_cuda(standin):
        kernels.kernel_bwd(out[:, :, 1:], q[:, :, 1:], q[:, :, 1:], q[:, :, 1:], out[:, :, 1:], lse[:, :, 1:], True, 0.25)


# ---------------------------------------------------------------------------------------------------
# The SDPA math path on sequence-sharded DTensors: the ring or a ValueError, never a silent all-gather.
# See Note [SDPA math path] in dtensor/sdpa.py. On CPU the math kernel is chosen by sdpa_kernel(MATH) and by
# dropout; on CUDA also by fp32 with GQA, fp64 and head sizes no fused kernel takes.


def _comm_counts(cm) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}


def _math_cases(rank, world):
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cp_dtensor.dtensor.placements import full_tensor
    from cp_dtensor.dtensor.sharding import shard_sequence
    from _ref import make_qkv, reference, rel_err

    mesh = init_device_mesh("cpu", (world,))
    ring = {"all_to_all_single": world - 1}
    modes = {
        "math": lambda: sdpa_kernel(SDPBackend.MATH),
        "math+no_grad": lambda: _stack(sdpa_kernel(SDPBackend.MATH), torch.no_grad()),
        "inference": torch.inference_mode,
        "inference+math": lambda: _stack(sdpa_kernel(SDPBackend.MATH), torch.inference_mode()),
    }
    case = 0
    for layout in cp_dtensor.LAYOUTS:
        for mode, ctx in modes.items():
            for is_causal, scale, (hq, hkv) in ((True, None, (4, 2)), (False, 0.3, (2, 2))):
                case += 1
                q, k, v, do = make_qkv(case, 2, hq, hkv, 4 * world, 8)
                want = reference(q, k, v, do, is_causal=is_causal, scale=scale)
                grad = mode == "math"
                xs = [shard_sequence(x, mesh, seq_dim=2, layout=layout).requires_grad_(grad) for x in (q, k, v)]
                with CommDebugMode() as cm, ctx():
                    out = F.scaled_dot_product_attention(*xs, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
                assert _comm_counts(cm) == ring, (layout, mode, _comm_counts(cm))
                assert isinstance(out, DTensor) and out.placements == xs[0].placements
                got = [out]
                if grad:
                    with CommDebugMode() as cm:
                        out.backward(shard_sequence(do, mesh, seq_dim=2, layout=layout))
                    assert set(_comm_counts(cm)) == {"all_to_all_single"}, _comm_counts(cm)  # K/V + dK/dV hops
                    got += [x.grad for x in xs]
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    err = rel_err(full_tensor(a), b)
                    assert err <= 1e-12, (layout, mode, is_causal, name, err)  # float64 ring vs float64
    # calls the ring cannot run: a ValueError on every rank, before any collective
    q, k, v, _ = make_qkv(0, 1, 4, 2, 4 * world, 8)
    xs = [shard_sequence(x, mesh, seq_dim=2, layout="striped").requires_grad_() for x in (q, k, v)]
    bad = [
        ("dropout_p must be 0", contextlib.nullcontext, dict(dropout_p=0.1, enable_gqa=True)),  # math on CPU
        ("enable_gqa is False", lambda: sdpa_kernel(SDPBackend.MATH), dict(is_causal=True)),
        ("attn_mask is not supported", lambda: sdpa_kernel(SDPBackend.MATH),
         dict(attn_mask=distribute_tensor(torch.ones(4 * world, 4 * world, dtype=torch.bool), mesh, [Replicate()]),
              enable_gqa=True)),
        ("dropout_p must be 0", torch.inference_mode, dict(dropout_p=0.1, enable_gqa=True)),
    ]
    for match, ctx, kw in bad:
        with CommDebugMode() as cm, ctx(), pytest.raises(ValueError, match=match):
            F.scaled_dot_product_attention(*xs, **kw)
        assert _comm_counts(cm) == {}, (match, _comm_counts(cm))
    # not sequence-sharded: torch's composite path as before (replicated in, replicated out, no collective;
    # non-causal, as torch's causal math mask is a plain tensor that DTensor refuses to mix)
    rep = [distribute_tensor(x, mesh, [Replicate()], src_data_rank=None) for x in (q, k, v)]
    with CommDebugMode() as cm, sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*rep, enable_gqa=True)
    assert _comm_counts(cm) == {} and out.placements == (Replicate(),)
    assert rel_err(out.to_local(), reference(q, k, v, torch.zeros_like(q), is_causal=False)[0]) <= 1e-12


def _stack(*ctxs):
    import contextlib

    stack = contextlib.ExitStack()
    for c in ctxs:
        stack.enter_context(c)
    return stack


def test_sdpa_math_path_on_sequence_sharded_dtensors_runs_the_ring_or_raises():
    """sdpa_kernel(MATH), inference mode, no_grad, dropout, a mask, GQA without enable_gqa: every
    layout, out and grads vs float64, collectives counted (only the ring's all-to-alls, never a gather)."""
    run_ranks(2, _math_cases)


def test_math_kernel_on_plain_tensors_is_unchanged():
    """Our Autograd kernel of the math op decomposes plain tensors exactly as torch's composite does."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cp_dtensor.dtensor.sdpa as dispatch
    from _ref import make_qkv, reference, rel_err

    q, k, v, do = make_qkv(3, 2, 4, 2, 12, 8)
    want = reference(q, k, v, do, is_causal=True)
    for installed in (True, False):
        (dispatch.install_sdpa_dispatch if installed else dispatch.uninstall_sdpa_dispatch)()
        assert ("dtensor/sdpa.py" in torch._C._dispatch_dump("aten::_scaled_dot_product_attention_math")) == installed
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True)
        out.backward(do)
        for a, b in zip((out, *(x.grad for x in xs)), want):
            assert rel_err(a, b) <= 1e-12
    dispatch.install_sdpa_dispatch()


# ---------------------------------------------------------------------------------------------------
# What a ring call on CUDA reads on the host: only host-made integers (the agreement fingerprint, the
# document ids), never a float tensor. See Note [Agreeing before the ring] in checks.py.


_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _host_reads(rank, world):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Record(TorchDispatchMode):
        """Taints q, k, v, dout (device tensors on a GPU) and everything computed from them; records every
        host read (item/bool/int: _local_scalar_dense) and every collective, with whether it was tainted."""

        def __init__(self, *device_tensors):
            super().__init__()
            self.keep = list(device_tensors)  # alive, so their ids stay theirs
            self.tainted = {id(t) for t in device_tensors}
            self.reads, self.collectives = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            dirty = any(id(t) in self.tainted for t in ins)
            name = func.__name__.split(".")[0]
            if func is torch.ops.aten._local_scalar_dense.default:
                self.reads.append((args[0].dtype, dirty))
            elif func.namespace == "_c10d_functional" and name not in _NOT_COLLECTIVES:
                self.collectives.append((name, args[0].dtype, dirty))
            out = func(*args, **kwargs)
            if dirty:
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                self.keep += outs
                self.tainted |= {id(t) for t in outs}
            return out

    standin = StrictCuda()
    found = {}
    with mock.patch.multiple(kernels, aten=standin, backend=lambda x: "cuda"):
        for layout in cp_dtensor.LAYOUTS:
            for masked in (False, True):
                n, hq = 8 * world, 4
                g = torch.Generator().manual_seed(1)
                q, k, v, do = (torch.randn(1, h, n, 16, generator=g) for h in (hq, 2, 2, hq))
                shard = lambda x, dim=2: shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)  # noqa: E731
                ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
                kw = {}
                if masked:
                    ids = torch.arange(n).div(5, rounding_mode="floor").unsqueeze(0)
                    # (no sinks: these are CPU tensors, and checks.py compares sinks' values only on the CPU)
                    kw = dict(document_ids=shard(ids, 1), window_size=(5, 0))
                dout = shard(do).to(torch.bfloat16)
                mode = Record(ql, kl, vl, dout)
                with mode:
                    out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True, **kw)
                    out.backward(dout)
                assert not any(dirty for _, dirty in mode.reads), (layout, masked, mode.reads)
                gathers = [(name, dirty) for name, _, dirty in mode.collectives if name != "all_to_all_single"]
                assert not any(dirty for _, dirty in gathers), mode.collectives  # host-made: fingerprint, ids
                assert any(dirty for name, _, dirty in mode.collectives if name == "all_to_all_single")  # K/V
                found[(layout, masked)] = (len(mode.reads), len(gathers))
    mode = Record(ql)  # the recorder itself sees a read of q's values
    with mode:
        bool((ql.float() * 2).sum() > 0)
    assert mode.reads == [(torch.bool, True)], mode.reads
    return found


def test_ring_call_reads_nothing_computed_from_qkv_on_the_host():
    """Per ring call (fwd+bwd, CUDA branches via the stand-ins), nothing computed from q, k, v or dout is
    read on the host (item/bool/int) or gathered: the agreement fingerprint and the document ids are made
    on the host; only the K/V all-to-alls carry device data."""
    found = run_ranks(2, _host_reads)[0]
    # one agreement all-gather per call, plus one of the document ids when there are documents
    assert all(gathers == (2 if masked else 1) for (_, masked), (_, gathers) in found.items()), found


def test_gqa_kv_bytes_per_kernel_call():
    """GQA (Hq 8, Hkv 2): the K/V bytes each CUDA kernel call receives, against the Hq-head expansion the
    ring once made. Flash gets K/V as they are (1/g of it, g = Hq/Hkv); the memory-efficient kernel gets
    one KV head copied for its group (1/Hkv of it), fwd and bwd."""
    sizes = []

    class Bytes(StrictCuda):
        def _common(self, name, q, k, v, dropout_p, is_causal):
            sizes.append((name, k.nbytes + v.nbytes))
            super()._common(name, q, k, v, dropout_p, is_causal)

    b, hq, hkv, s, d = 1, 8, 2, 32, 16
    for dtype, kinds, share in ((torch.bfloat16, {"flash", "flash_bwd"}, hkv / hq), (torch.float32, {"efficient", "efficient_bwd"}, 1 / hkv)):
        g = torch.Generator().manual_seed(0)
        q, do = (torch.randn(b, hq, s, d, generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(b, hkv, s, d, generator=g).to(dtype) for _ in range(2))
        expanded = 2 * b * hq * s * d * dtype.itemsize  # K and V repeated to Hq heads
        sizes.clear()
        with mock.patch.multiple(kernels, aten=Bytes(), backend=lambda x: "cuda"):
            out, lse = kernels.kernel_fwd(q, k, v, True, 0.25)
            kernels.kernel_bwd(do, q, k, v, out.contiguous(), lse, True, 0.25)
        assert {n for n, _ in sizes} == kinds
        assert max(n for _, n in sizes) == expanded * share, (dtype, sizes, expanded)


def test_float64_on_cuda_is_refused_at_validation():
    """No fused CUDA kernel takes float64: validation says so (and what to do) before any kernel runs."""
    from cp_dtensor.core.checks import local_error

    class OnCuda(torch.Tensor):  # a CPU tensor that reports a CUDA device, as validation sees it
        @property
        def device(self):
            return torch.device("cuda", 0)

    q = torch.Tensor._make_subclass(OnCuda, torch.zeros(1, 4, 8, 16, dtype=torch.float64))
    k = torch.Tensor._make_subclass(OnCuda, torch.zeros(1, 2, 8, 16, dtype=torch.float64))
    err = local_error(q, k, k, "striped", True, None)
    assert err is not None and "float64" in err and "cast q, k, v to float32" in err
    assert local_error(q.float(), k.float(), k.float(), "striped", True, None) is None


def test_standins_take_the_real_schemas():
    """Each stand-in takes exactly the positional arguments of the real CUDA op's schema (torch 2.13), and
    every keyword kernels.py passes is one of the schema's: a torch bump that moves an argument fails
    here, not silently on the first GPU."""
    import inspect

    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward",
    ):
        schema = getattr(_REAL, name).default._schema
        positional = [a.name for a in schema.arguments if not a.kwarg_only]
        keywords = {a.name for a in schema.arguments if a.kwarg_only}
        params = list(inspect.signature(getattr(StrictCuda, name)).parameters.values())[1:]  # past self
        mine_pos = [p for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        mine_kw = {p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY}
        assert len(mine_pos) == len(positional), (name, [p.name for p in mine_pos], positional)
        assert mine_kw <= keywords, (name, mine_kw - keywords)
