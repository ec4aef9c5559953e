"""The fused attention kernel of each device, called on one rectangle with the inputs it requires.

Note [Kernel contracts]
~~~~~~~~~~~~~~~~~~~~~~~
What each kernel accepts, read from its schema and PyTorch's kernel sources (for flash: flash_api.cpp's
mha_fwd / mha_varlen_fwd / mha_bwd / mha_varlen_bwd), and what the calls below guarantee. tests/_cuda.py's
strict stand-ins assert exactly these contracts, apply the ops' host-side rules and compute by the textbook
formula (tests/core/test_cuda_paths.py, tests/core/test_cuda_rules.py run the CUDA branches on CPU):

* CPU ``_scaled_dot_product_flash_attention_for_cpu``: any strides; native GQA (Hq % Hkv == 0); an
  additive ``attn_mask`` in q's dtype; top-left causal alignment; lse [B, H, Sq] fp32 (sequence-major
  strides), read back by the backward through strides.
* CUDA flash (fp16/bf16, D <= 256, D % 8 == 0), no mask: native GQA -- K/V are passed with their Hkv
  heads, never expanded; last dim contiguous; ``is_causal`` only on square rectangles (flash aligns a
  non-square causal mask bottom-right, the CPU kernel top-left; the ring's causal rectangles are all
  square; a one-row forward drops ``is_causal``, the same on a 1 x 1 square). No window. The backward
  reads the lse through a raw pointer as a dense [B, Hq, Sq] fp32 array: it gets a contiguous copy of
  exactly that (a slice of the ring's lse is not). Dense calls pass no cumulative sequence lengths (None,
  as the forward returns them) and, without dropout, no philox state.
* CUDA memory-efficient (fp32, or any call flash cannot take or the switches route here): no GQA, so it
  runs once per KV head on that head's group of Hq / Hkv query heads with the one K/V head copied g times
  (a group's copy, not the whole block's: 1 / Hkv of an expanded block); ``is_causal`` top-left, on
  squares only; lse padded to a multiple of 32, which the backward wants back padded and contiguous. With
  a mask (an additive ``attn_bias`` [B, H, Sq, Sk] whose rows start on 16-element boundaries, every row
  keeping a key) it runs in **fp32 only**: fp16/bf16 inputs are cast up, out cast back, lse fp32 -- on
  the H200 bf16 with a mask crashed (illegal memory access) or returned NaN while fp32 through the same
  kernel was exact (issue 53); only window tiles on a flash build without windows, or the
  efficient-only switch, take this branch, a window band's worth of rows at a time.
  tests/core/test_cuda_rules.py has the GPU check that would lift the rule.
* CUDA flash, variable length (``_flash_attention_forward`` / ``_backward`` with cumulative
  sequence lengths): many sequences packed along one token dim, q [Tq, Hq, D], k and v [Tk, Hkv, D]
  (last dim contiguous), ``cu_seqlens`` int32 on the device, [0, ..., T]; native GQA; ``is_causal``
  only where every packed sequence is square (the ring's are); lse [Hq, Tq] fp32, which the backward
  wants contiguous in that layout; no dropout, so no rng state; ``max_seqlen_q`` the longest query run
  (it sizes the grid). A window ``(left, right)`` keeps, for row r of a sequence of Lq rows and Lk keys,
  the keys r + Lk - Lq - left .. r + Lk - Lq + right (bottom-right alignment) -- but only after the host
  code rewrote it: a side >= ``max_seqlen_k`` becomes -1, then a one-sided -1 becomes ``max_seqlen_k``.
  With ``max_seqlen_k`` the longest *key* run, a rectangle with more than max_seqlen_k + 1 rows (a
  document that cuts the key segment short while the query segment stays long: documents + window)
  silently lost its first rows' latest keys, and rows left with none came back empty (issue 53). So a
  windowed call passes ``max_seqlen_k`` >= every sequence's rows and keys (``max(max_q, max_k)``, a bound
  the kernel takes: it reads each sequence's own length from ``cu_seqlens``); the window is then applied
  exactly as given, -1 unbounded. Whether the build takes windows is probed once per device
  (:func:`flash_windows`). See Note [Varlen rectangles] in varlen.py.
* Empty rows: flash returns a row with no key as out 0 and lse **+inf** (its softmax's convention); the
  ring's is lse -inf (a merge weight of 0; ``add_sinks`` keeps out 0). Every lse a CUDA kernel returns is
  read through :func:`_empty_rows` (+inf -> -inf) before any merge or sink, and every lse handed to a CUDA
  backward through :func:`_kernel_lse` (-inf -> +inf: P = exp(s - lse) = 0, no gradient), so an empty
  row can never turn into weight 1 or NaN, whichever kernel produced it. The calls above leave no row
  empty (masks.band_rects trims rows without keys), so this is the second line of defence.
* cudnn and math: never called; the switches can only forbid them (Note [SDPA backend switches]).
* float64 has no fused CUDA kernel: ``checks.py`` refuses it on CUDA before the ring.
* Decoding from a sharded cache (decode.py) calls no fused kernel: its masked matmuls run in fp32 with
  its own empty-row rule (lse -inf, out 0), so none of the above applies there.

Note [SDPA backend switches]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's SDPA switches -- ``torch.nn.attention.sdpa_kernel([...])``, ``torch.backends.cuda.enable_flash_sdp``,
``enable_mem_efficient_sdp``, ``enable_cudnn_sdp``, ``enable_math_sdp`` -- choose the ring's CUDA kernels
as they choose SDPA's, so a user can route around a kernel problem. The ring has two: flash (dense and
variable length) and memory-efficient. ``sdpa_backends()`` reads the switches once per call, when the
call's mask plan is made (``blocks.Mask``); the plan carries the bits into every block op (a trailing
``backends`` argument of the ``cp_dtensor::`` ops; -1, their default, reads the switches at the op), and
the autograd context keeps them, so the backward runs the kernels the forward chose even outside the
``sdpa_kernel`` block. Flash runs what it can take (fp16/bf16, head size <= 256 and % 8) when allowed;
everything else runs memory-efficient. Before any K/V moves, :func:`kernel_error` (from ``local_error``
in checks.py and the document exchange's checks) refuses a call the allowed kernels cannot serve -- only
cudnn and/or math allowed, fp32 or an odd head size with only flash allowed, or windows with only flash
allowed on a flash build without windows -- with a ValueError on every rank: the decision depends only on
shapes, dtype, the switches and the device's flash build, and the agreement raises it everywhere. Never
a silent fallback. Compiled (``torch.compile``), Dynamo reads the switches while tracing
(``torch.compiler.assume_constant_result``) and does not guard on them: a compiled function keeps the
kernels of its trace; change the switches before the first compiled call, or ``torch._dynamo.reset()``.
The DTensor SDPA rule (dtensor/sdpa.py) builds the backward's plan when the backward runs, so there the
backward reads the switches again. The switches have no say on the CPU (one kernel).

Note [Value head size]
~~~~~~~~~~~~~~~~~~~~~~
The kernels take one head size for q, k and v; MLA (DeepSeek-V3) has Dv != Dqk. The narrower side is
zero-padded per call: zero columns of v (and of out and dout in the backward) add nothing to
rowsum(dout * out) and change neither dq nor dk; zero columns of q and k change no score (the scale is
passed explicitly). Results are sliced back to their own head sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "EFFICIENT", "FLASH", "backend", "causal_strip", "flash_windows", "kernel_bwd", "kernel_bwd_varlen", "kernel_error",
    "kernel_fwd", "kernel_fwd_varlen", "sdpa_backends", "varlen",
]

aten = torch.ops.aten


def backend(x: Tensor) -> str:
    """Which kernel family runs ``x``'s attention: "cpu" or "cuda"."""
    return "cpu" if x.device.type == "cpu" else "cuda"


CAUSAL_STRIP = {"cpu": 256, "cuda": 0}  # See Note [Causal staircase] in masks.py


def causal_strip(device: torch.device) -> int:
    """Rows per strip of a masked step's causal squares on ``device`` (masks.block_rects' ``strip``;
    0: one kernel call per square)."""
    return CAUSAL_STRIP["cpu" if device.type == "cpu" else "cuda"]


FLASH, EFFICIENT = 1, 2  # the CUDA kernels the ring can run, as bits of a set (See Note [SDPA backend switches])
_CUDNN, _MATH = 4, 8  # switches the ring has no kernel for
_HALF = (torch.float16, torch.bfloat16)


@torch.compiler.assume_constant_result  # Dynamo calls it while tracing: a constant of the graph
def _switches() -> int:
    cuda = torch.backends.cuda
    return ((FLASH if cuda.flash_sdp_enabled() else 0) | (EFFICIENT if cuda.mem_efficient_sdp_enabled() else 0)
            | (_CUDNN if cuda.cudnn_sdp_enabled() else 0) | (_MATH if cuda.math_sdp_enabled() else 0))


def sdpa_backends() -> int:
    """The CUDA kernels the ring may use (``FLASH | EFFICIENT`` bits), read from torch's SDPA backend switches
    (``torch.nn.attention.sdpa_kernel``, ``torch.backends.cuda.enable_*_sdp``). Compiled, the switches as
    the trace reads them. See Note [SDPA backend switches]."""
    return _switches() & (FLASH | EFFICIENT)


def _allowed(backends: int) -> int:
    return sdpa_backends() if backends < 0 else backends


def _flash_fits(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in _HALF and head_dim <= 256 and head_dim % 8 == 0


def _use_flash(q: Tensor, mask: Tensor | None, backends: int = -1) -> bool:
    return bool(_allowed(backends) & FLASH) and mask is None and _flash_fits(q.dtype, q.shape[-1])


def _names() -> str:
    on = [n for n, bit in (("flash", FLASH), ("efficient", EFFICIENT), ("cudnn", _CUDNN), ("math", _MATH))
          if _switches() & bit]
    return ", ".join(on) or "none"


def kernel_error(q: Tensor, v: Tensor, *, windowed: bool, backends: int = -1) -> str | None:
    """Why the CUDA kernels torch's SDPA switches allow cannot serve a ring call of ``q``'s dtype and head
    sizes (``windowed``: it has window bands, or masked rectangles of any band); None when they can, and on
    the CPU. Depends only on shapes, dtypes, the switches and the device's flash build, so every rank of a
    call says the same, before any collective. See Note [SDPA backend switches]."""
    if backend(q) == "cpu":
        return None
    backends = _allowed(backends)
    d = max(q.shape[-1], v.shape[-1])
    flash = bool(backends & FLASH) and _flash_fits(q.dtype, d)
    efficient = bool(backends & EFFICIENT)
    fix = ("Allow one the ring runs, e.g. torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, "
           "SDPBackend.EFFICIENT_ATTENTION]) or torch.backends.cuda.enable_mem_efficient_sdp(True)")
    if not flash and not efficient:
        why = ("flash is off" if not backends & FLASH else
               f"flash takes fp16/bf16 with a head size <= 256 divisible by 8 (got {q.dtype}, head size {d})")
        return (f"ring_attention on CUDA runs torch's flash or memory-efficient attention kernel; torch's SDPA "
                f"backend switches allow {_names()} and {why}, so no kernel the ring has can run this call "
                f"(it has no cudnn or math path). {fix}.")
    if not windowed or not flash or efficient:
        return None
    # whether the flash build takes windows: probed once per device in eager; while tracing, the probe's answer
    # if one was made, else assumed (torch's CUDA builds do; the kernels raise at the call otherwise)
    takes = _FLASH_WINDOWS.get(q.device, True) if torch.compiler.is_compiling() else flash_windows(q, backends)
    if not takes:
        return ("ring_attention on CUDA: this call's window bands need flash with window sizes, which this torch "
                "build's flash lacks, or the memory-efficient kernel, which torch's SDPA switches disable (allowed: "
                f"{_names()}). {fix}, or drop window_size.")
    return None


def _need_efficient(backends: int) -> None:
    if not _allowed(backends) & EFFICIENT:  # the call's checks refuse this before the ring (kernel_error)
        raise RuntimeError("cp_dtensor: this attention block needs the memory-efficient kernel, which torch's SDPA "
                           "switches disable; see Note [SDPA backend switches] in cp_dtensor/core/compute/kernels.py.")


def _empty_rows(lse: Tensor) -> Tensor:
    """A CUDA kernel's lse with its empty rows (+inf: no key) as ours (-inf), in place: Note [Kernel contracts]."""
    return lse.masked_fill_(torch.isposinf(lse), float("-inf"))


def _kernel_lse(lse: Tensor) -> Tensor:
    """Our lse (-inf: a row with no key) as the CUDA backward kernels read it (+inf: P = exp(s - lse) = 0),
    contiguous (a fresh tensor)."""
    return torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()


def _pad_last(x: Tensor, d: int) -> Tensor:
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


def _pad_fwd(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v with one head size, the narrower side zero-padded: Note [Value head size]."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        return q, k, _pad_last(v, dqk)
    return (_pad_last(q, dv), _pad_last(k, dv), v) if dv > dqk else (q, k, v)


def _pad_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> tuple[Tensor, ...]:
    """dout, q, k, v, out with one head size (v, out and dout padded like v): Note [Value head size]."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv < dqk:
        return _pad_last(dout, dqk), q, k, _pad_last(v, dqk), _pad_last(out, dqk)
    return (dout, _pad_last(q, dv), _pad_last(k, dv), v, out) if dv > dqk else (dout, q, k, v, out)


def _group(x: Tensor, h: int, g: int) -> Tensor:
    """KV head ``h`` of x [B, Hkv, S, D] copied for its g query heads: [B, g, S, D]."""
    one = x[:, h : h + 1]
    return one if g == 1 else one.expand(-1, g, -1, -1).contiguous()


def _bias(mask: Tensor, b: int, h: int) -> Tensor:
    """An additive [Sq, Sk] mask as the memory-efficient kernel's attn_bias [B, H, Sq, Sk] in fp32, its rows
    starting on 16-element boundaries (stored padded, expanded over batch and heads)."""
    sq, sk = mask.shape
    padded = mask.new_zeros(sq, sk + (-sk) % 16, dtype=torch.float32)
    padded[:, :sk] = mask
    return padded[:, :sk].expand(b, h, sq, sk)


def _fp32(*xs: Tensor) -> tuple[Tensor, ...]:
    return tuple(x.float() for x in xs)


def kernel_fwd(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, mask: Tensor | None = None, backends: int = -1,
):
    """One fused-kernel call on one rectangle: out [B, Hq, Sq, Dv] (kernel strides), lse [B, Hq, Sq] fp32
    (-inf: a row with no key). q, k: [B, Hq | Hkv, S, Dqk]; v: [B, Hkv, Sk, Dv]; ``mask``: additive [Sq, Sk]
    in q's dtype or None; ``backends``: the CUDA kernels allowed (:func:`sdpa_backends`; -1: read now).
    See Note [Kernel contracts] and Note [Value head size]."""
    dv, dtype = v.shape[-1], q.dtype
    q, k, v = _pad_fwd(q, k, v)
    if backend(q) == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)[:2]
        return out[..., :dv], lse
    if _use_flash(q, mask, backends):
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
        return out[..., :dv], _empty_rows(lse)
    _need_efficient(backends)
    if mask is not None:  # with a mask in fp32 only: Note [Kernel contracts]
        q, k, v = _fp32(q, k, v)
    hkv, g, sq = k.shape[1], q.shape[1] // k.shape[1], q.shape[2]
    outs, lses = [], []
    for h in range(hkv):
        bias = None if mask is None else _bias(mask, q.shape[0], g)
        out, lse = aten._scaled_dot_product_efficient_attention(
            q[:, h * g : (h + 1) * g], _group(k, h, g), _group(v, h, g), bias, True, 0.0, is_causal, scale=scale
        )[:2]
        outs.append(out[..., :dv].to(dtype))
        lses.append(lse[..., :sq])  # the kernel pads lse to a multiple of 32
    out, lse = (outs[0], lses[0]) if hkv == 1 else (torch.cat(outs, 1), torch.cat(lses, 1))
    return out, _empty_rows(lse)


def kernel_bwd(dout, q, k, v, out, lse, is_causal: bool, scale: float, mask: Tensor | None = None, backends: int = -1):
    """The backward of :func:`kernel_fwd` given the rows' *final* out and lse: dq, dk, dv (kernel strides)."""
    dqk, dv_size, dtype = q.shape[-1], v.shape[-1], q.dtype
    dout, q, k, v, out = _pad_bwd(dout, q, k, v, out)
    if backend(q) == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_size]
    sq, sk = q.shape[2], k.shape[2]
    # Without dropout the kernels never read the philox state: pass empty tensors.
    empty = q.new_empty(0, dtype=torch.int64)
    if _use_flash(q, mask, backends):
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, _kernel_lse(lse), None, None, sq, sk, 0.0, is_causal, empty, empty, scale=scale
        )
        return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_size]
    _need_efficient(backends)
    if mask is not None:  # with a mask in fp32 only: Note [Kernel contracts]
        dout, q, k, v, out = _fp32(dout, q, k, v, out)
    hkv, g = k.shape[1], q.shape[1] // k.shape[1]
    lse = F.pad(_kernel_lse(lse), (0, (-sq) % 32))  # back to the kernel's padded length (a contiguous copy)
    grads = []
    for h in range(hkv):
        qs = slice(h * g, (h + 1) * g)
        bias = None if mask is None else _bias(mask, q.shape[0], g)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout[:, qs], q[:, qs], _group(k, h, g), _group(v, h, g), bias, out[:, qs], lse[:, qs].contiguous(),
            empty, empty, 0.0, [True, True, True, False], is_causal, scale=scale,
        )
        grads.append((dq, dk.sum(1, keepdim=True), dv.sum(1, keepdim=True)))
    dq, dk, dv = (torch.cat(x, 1) for x in zip(*grads)) if hkv > 1 else grads[0]
    return dq[..., :dqk].to(dtype), dk[..., :dqk].to(dtype), dv[..., :dv_size].to(dtype)


def varlen(q: Tensor, backends: int = -1) -> bool:
    """Whether unmasked rectangles of ``q``'s dtype and head size run as one variable-length call per
    kind (CUDA flash) rather than one call each. See Note [Varlen rectangles] in varlen.py."""
    return backend(q) == "cuda" and _use_flash(q, None, backends)


_FLASH_WINDOWS: dict[torch.device, bool] = {}  # per device: whether flash takes window sizes


def flash_windows(q: Tensor, backends: int = -1) -> bool:
    """Whether window bands of ``q``'s calls run as flash windows (one rectangle per band, packed)
    rather than as tiles with a bias: CUDA flash dtypes on a build that takes window sizes, probed
    once per device with a two-token call (tensors made on the device: no copy, no wait)."""
    if not varlen(q, backends):
        return False
    if q.device not in _FLASH_WINDOWS:
        x = torch.zeros(2, 1, 8, dtype=torch.bfloat16, device=q.device)
        cu = torch.arange(0, 3, 2, dtype=torch.int32, device=q.device)  # [0, 2]
        try:
            aten._flash_attention_forward(x, x, x, cu, cu, 2, 2, 0.0, False, False, scale=1.0, window_size_left=1,
                                          window_size_right=0)
            _FLASH_WINDOWS[q.device] = True
        except RuntimeError:  # a build without local attention refuses at the call, on the host
            _FLASH_WINDOWS[q.device] = False
    return _FLASH_WINDOWS[q.device]


def _windows(window: tuple[int, int] | None, max_q: int, max_k: int) -> tuple[dict, int]:
    """The window keywords and the max_seqlen_k of a varlen call: with a window, max_seqlen_k >= every
    sequence's rows and keys, so that flash applies the window as given (Note [Kernel contracts])."""
    if window is None:
        return {}, max_k
    return dict(window_size_left=window[0], window_size_right=window[1]), max(max_k, max_q)


def kernel_fwd_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, is_causal: bool, scale: float,
    window: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """One call over packed sequences: q [Tq, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dv]; sequence i is
    q rows [cu_q[i], cu_q[i + 1]) against k rows [cu_k[i], cu_k[i + 1]), within ``window`` (left,
    right; -1 unbounded; bottom-right aligned) if given. ``max_q``, ``max_k``: the longest query and key
    runs. Returns out [Tq, Hq, Dv] and lse [Hq, Tq] fp32 (-inf: a row with no key). See Note [Kernel
    contracts]."""
    dv = v.shape[-1]
    q, k, v = _pad_fwd(q, k, v)
    kw, max_k = _windows(window, max_q, max_k)
    out, lse = aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False, scale=scale, **kw)[:2]
    return out[..., :dv], _empty_rows(lse)


def kernel_bwd_varlen(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
    max_k: int, is_causal: bool, scale: float, window: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`kernel_fwd_varlen` given the rows' *final* out and lse ([Hq, Tq]): dq, dk, dv."""
    dqk, dv_size = q.shape[-1], v.shape[-1]
    dout, q, k, v, out = _pad_bwd(dout, q, k, v, out)
    empty = q.new_empty(0, dtype=torch.int64)  # no dropout: the kernel never reads the rng state
    kw, max_k = _windows(window, max_q, max_k)
    dq, dk, dv = aten._flash_attention_backward(
        dout, q, k, v, out, _kernel_lse(lse), cu_q, cu_k, max_q, max_k, 0.0, is_causal, empty, empty, scale=scale, **kw,
    )
    return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_size]
