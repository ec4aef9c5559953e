"""Strict CPU stand-ins of the CUDA attention ops that cp_dtensor/core/compute/kernels.py calls, for the tests of
the CUDA branches (tests/core/test_cuda_paths.py, tests/core/test_cuda_rules.py).

Each stand-in asserts the op's input contract (Note [Kernel contracts] in kernels.py) and computes by the
textbook formula in float64 -- under the rules the real op applies on the host before its kernel runs,
read from torch's sources (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_fwd /
mha_varlen_fwd / mha_bwd / mha_varlen_bwd and set_params_fprop), never kinder than the op:

* a window side >= max_seqlen_k (the longest key run of the call; Sk on dense calls) becomes -1;
* then a one-sided -1 becomes max_seqlen_k (both -1: no window at all);
* ``is_causal`` is the window (-1, 0); the forward drops it where max_seqlen_q == 1;
* windows and causal masks are aligned bottom-right per sequence: row r of Lq rows against Lk keys
  keeps keys r + Lk - Lq - left .. r + Lk - Lq + right;
* a row left with no key comes back with out = 0 and lse = +inf (flash's softmax: ``sum == 0 ? INFINITY``).

A stand-in that were kinder than the op (-1 as "unbounded" whatever max_seqlen_k) would hide exactly the
bugs it exists to catch (issue 53: rectangles taller than their keys lost their latest keys on the H200).
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import torch

import cp_dtensor.core.compute.kernels as kernels

INF = float("inf")


def stack(*ctxs):
    """One context manager entering ``ctxs`` in order."""
    st = contextlib.ExitStack()
    for c in ctxs:
        st.enter_context(c)
    return st


def dense(x):
    return x.stride(-1) == 1


def flash_window(left, right, is_causal: bool, max_q: int, max_k: int, *, forward: bool) -> tuple[int, int]:
    """The (left, right) window flash really applies (-1: unbounded), from the op's arguments, by torch's
    host rules (module docstring). ``forward``: the forward's extra rule (is_causal dropped at max_q 1)."""
    left = -1 if left is None else int(left)
    right = -1 if right is None else int(right)
    if forward and max_q == 1:
        is_causal = False
    if is_causal:
        right = 0
    if left >= max_k:
        left = -1
    if right >= max_k:
        right = -1
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    return left, right


def keep_mask(nq: int, nk: int, window: tuple[int, int]) -> torch.Tensor:
    """[nq, nk] bool: the pairs a bottom-right aligned window keeps."""
    left, right = window
    d = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - (nk - nq)
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        keep &= d >= -left
    if right >= 0:
        keep &= d <= right
    return keep


def _bias(keep: torch.Tensor | None) -> torch.Tensor | None:
    return None if keep is None else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -INF)


def math_scores(q, k, v, scale, is_causal, bias=None):
    """Scores in float64 with GQA by repetition (causal top-left, only ever on squares: asserted by callers)."""
    g = q.shape[1] // k.shape[1]
    ke, ve = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ ke.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if is_causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -INF)
    return s, ke, ve


def attend(q, k, v, scale, is_causal, bias=None):
    """out (float64) and lse (float32) the flash way: rows without a key get out 0 and lse +inf."""
    s, _, ve = math_scores(q, k, v, scale, is_causal, bias)
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - torch.where(empty, 0.0, lse).unsqueeze(-1))
    out = (p @ ve).masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse.masked_fill(empty, INF).float()


def grads(dout, q, k, v, out, lse, scale, is_causal, bias=None):
    """dq, dk, dv from the given out and lse (the kernel contract: P = exp(s - lse), D = rowsum(dO * O))."""
    s, ke, ve = math_scores(q, k, v, scale, is_causal, bias)
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
    """Stand-ins for the CUDA attention ops kernels.py calls; records what each call received.

    ``windows``: whether this "flash build" takes window sizes (else it refuses them at the call).
    Counters: ``windowed`` (calls that passed a window), ``tall`` (packed sequences of a windowed call
    with more rows than the call's longest key run + 1: the rectangles whose window max_seqlen_k
    decides), ``changed`` (packed sequences whose applied window differs from the arguments read
    naively, -1 as unbounded), ``empty_rows`` (rows the forward returned with lse +inf)."""

    def __init__(self, windows: bool = True):
        self.calls: list[tuple[str, int, int]] = []  # (op, q heads, k heads)
        self.dtypes: list[tuple[str, torch.dtype]] = []  # (op, q's dtype)
        self.windows = windows
        self.windowed = self.tall = self.changed = self.empty_rows = 0

    def _common(self, name, q, k, v, dropout_p, is_causal):
        assert dropout_p == 0.0
        assert q.dtype == k.dtype == v.dtype and all(dense(x) for x in (q, k, v)), f"{name}: last dim not dense"
        assert k.shape == v.shape, f"{name}: one head size for q, k, v"
        assert q.shape[-1] == k.shape[-1]
        if is_causal:  # ours: flash aligns a non-square causal mask bottom-right, efficient top-left
            assert q.shape[2] == k.shape[2], f"{name}: is_causal on a non-square block {q.shape} x {k.shape}"
        self.calls.append((name, q.shape[1], k.shape[1]))
        self.dtypes.append((name, q.dtype))

    def _flash_checks(self, q, k):
        assert q.dtype in (torch.float16, torch.bfloat16), f"flash: dtype {q.dtype}"
        assert q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
        assert q.shape[1] % k.shape[1] == 0

    def _dense_flash_keep(self, q, k, is_causal, forward):
        window = flash_window(-1, -1, is_causal, q.shape[2], k.shape[2], forward=forward)
        return None if window == (-1, -1) else keep_mask(q.shape[2], k.shape[2], window)

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        self._common("flash", q, k, v, dropout_p, is_causal)
        self._flash_checks(q, k)
        out, lse = attend(q, k, v, scale, False, _bias(self._dense_flash_keep(q, k, is_causal, True)))
        self.empty_rows += int(torch.isposinf(lse).sum())
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        rng = torch.zeros(2, dtype=torch.int64)
        return out, lse, None, None, q.shape[2], k.shape[2], rng, torch.empty(()), torch.empty(0)

    def _scaled_dot_product_flash_attention_backward(
        self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *, scale=None
    ):
        self._common("flash_bwd", q, k, v, dropout_p, is_causal)
        self._flash_checks(q, k)
        assert cum_q is None and cum_k is None, "flash backward: dense calls pass no cumulative lengths"
        assert (max_q, max_k) == (q.shape[2], k.shape[2])
        assert dense(dout) and dense(out) and out.shape == q.shape
        # read through a raw pointer as a dense [B, H, Sq] fp32 array
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3], lse.shape
        assert lse.is_contiguous(), "flash backward: lse must be contiguous [B, H, Sq]"
        return grads(dout, q, k, v, out, lse, scale, False, _bias(self._dense_flash_keep(q, k, is_causal, False)))

    def _eff_checks(self, q, k, bias):
        assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"efficient: dtype {q.dtype}"
        assert q.shape[1] == k.shape[1], f"efficient: no GQA (q heads {q.shape[1]}, k heads {k.shape[1]})"
        if bias is not None:
            assert bias.dtype == q.dtype and bias.shape == (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0, f"efficient: bias rows unaligned {bias.stride()}"
            # ours (issue 53: bf16 with a mask crashed or gave NaN on the H200; fp32 was right)
            assert q.dtype == torch.float32, f"efficient with a mask runs in fp32 only; got {q.dtype}"
            assert bool(torch.isfinite(bias).any(-1).all()), "efficient: a row with no key under the mask"

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
        self._common("efficient", q, k, v, dropout_p, is_causal)
        self._eff_checks(q, k, bias)
        assert compute_lse
        s, _, ve = math_scores(q, k, v, scale, is_causal, bias)
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
        assert dense(dout) and dense(out)
        dq, dk, dv = grads(dout, q, k, v, out, lse[..., : q.shape[2]], scale, is_causal, bias)
        return dq, dk, dv, None

    def _varlen(self, name, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, window):
        """The packed-sequence contract (Note [Kernel contracts]); returns per sequence (q rows, k rows,
        the keep mask flash applies or None)."""
        assert dropout_p == 0.0, f"{name}: no dropout"
        windowed = window != (None, None)
        if windowed:
            if not self.windows:  # as a build without local attention: a host-side error at the call
                raise RuntimeError(f"{name}: this flash build does not support local (sliding window) attention")
            self.windowed += 1
            assert all(isinstance(w, int) and w >= -1 for w in window) and not is_causal, f"{name}: window {window}"
        assert q.dim() == k.dim() == v.dim() == 3, f"{name}: packed [T, H, D], got {q.shape}"
        assert q.dtype == k.dtype == v.dtype and all(dense(x) for x in (q, k, v)), f"{name}: last dim not dense"
        assert k.shape == v.shape and q.shape[-1] == k.shape[-1], f"{name}: one head size"
        assert q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
        assert q.shape[1] % k.shape[1] == 0
        for cu, t in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous() and cu.device == q.device
            assert int(cu[0]) == 0 and int(cu[-1]) == t and bool((cu[1:] > cu[:-1]).all()), f"{name}: {cu}"
        assert cu_q.numel() == cu_k.numel(), f"{name}: one k range per q range"
        lq, lk = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        # max_seqlen_q sizes the grid over query rows: exactly the longest; max_seqlen_k bounds the key runs
        assert max_q == max(lq) and max_k >= max(lk), f"{name}: max lengths {max_q, max_k} vs {max(lq), max(lk)}"
        if is_causal:
            assert lq == lk, f"{name}: is_causal on non-square sequences (flash aligns them bottom-right)"
        self.calls.append((name, q.shape[1], k.shape[1]))
        self.dtypes.append((name, q.dtype))
        applied = flash_window(*window, is_causal, max_q, max_k, forward=name == "flash_varlen")
        naive = (-1 if window[0] is None else window[0], 0 if is_causal else -1 if window[1] is None else window[1])
        seqs = []
        for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            keep = None if applied == (-1, -1) else keep_mask(b - a, d - c, applied)
            if windowed and name == "flash_varlen":
                self.tall += (b - a) > max(lk) + 1
                want = keep_mask(b - a, d - c, naive)
                self.changed += not bool(torch.equal(want, torch.ones_like(want) if keep is None else keep))
            seqs.append((a, b, c, d, keep))
        return seqs

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
        for a, b, c, d, keep in seqs:
            o, l_ = attend(self._bhsd(q, a, b), self._bhsd(k, c, d), self._bhsd(v, c, d), scale, False, _bias(keep))
            out[a:b] = o[0].transpose(0, 1).to(q.dtype)
            lse[:, a:b] = l_[0]
        self.empty_rows += int(torch.isposinf(lse).sum())
        return out, lse, torch.zeros(2, dtype=torch.int64), torch.empty(()), torch.empty(0)

    def _flash_attention_backward(
        self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
        scale=None, window_size_left=None, window_size_right=None,
    ):
        assert scale is not None
        window = (window_size_left, window_size_right)
        seqs = self._varlen("flash_varlen_bwd", q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, window)
        assert dout.shape == out.shape == q.shape and dense(dout) and dense(out), "flash varlen bwd: dout/out"
        assert dout.dtype == out.dtype == q.dtype, f"flash varlen bwd: dout {dout.dtype}, out {out.dtype}, q {q.dtype}"
        # read through a raw pointer as a dense [Hq, Tq] fp32 array
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous(), lse.shape
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, d, keep in seqs:
            g = grads(self._bhsd(dout, a, b), self._bhsd(q, a, b), self._bhsd(k, c, d), self._bhsd(v, c, d),
                      self._bhsd(out, a, b), lse[:, a:b].unsqueeze(0), scale, False, _bias(keep))
            dq[a:b] = g[0][0].transpose(0, 1)
            dk[c:d] += g[1][0].transpose(0, 1)
            dv[c:d] += g[2][0].transpose(0, 1)
        return dq, dk, dv

    def __getattr__(self, name):  # any other aten op (the CPU kernel included) must not be reached
        raise AssertionError(f"the CUDA branch called aten.{name}")


def as_cuda(standin):
    """Run the CUDA branches on CPU tensors: kernels.backend says "cuda", aten ops are the stand-ins (and
    the flash-windows probe asks them afresh)."""
    return stack(mock.patch.multiple(kernels, aten=standin, backend=lambda x: "cuda"),
                 mock.patch.dict(kernels._FLASH_WINDOWS, clear=True))
