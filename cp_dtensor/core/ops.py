"""The compile boundary: one attention block with its log-sum-exp, as ``torch.library`` custom ops.

``cp_dtensor::block_attn`` and ``cp_dtensor::block_attn_backward`` wrap the fused SDPA kernel of the
device (kernels.py, Note [Kernel contracts]) behind one schema with fake implementations, so the ring loop around them traces
under ``torch.compile(fullgraph=True)`` and Inductor sees the functional collectives between them.

Shapes: q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D] with Hq % Hkv == 0; out: [B, Hq, Sq, D] in q's dtype,
contiguous; lse: [B, Hq, Sq] float32. The gradients dq, dk, dv come back in the layout the CPU kernel
writes them, sequence-major ([B, S, H, D] memory seen as [B, H, S, D]; see :func:`_seq_major`), so the
ring never copies them just to change strides: copying a block's three gradients costs as much memory
as one more K/V block at the peak of the backward. ``is_causal`` is only used for square blocks
(Sq == Sk), where top-left and bottom-right alignment agree -- see Note [Causal ring steps] in layout.py.
"""

from __future__ import annotations

import weakref
from itertools import accumulate

import torch
from torch import Tensor

__all__ = [
    "after", "block_attn", "block_attn_backward", "block_attn_backward_into_", "masked_block_attn",
    "masked_block_attn_backward", "masked_block_attn_merge_", "merge_", "tie", "tie_",
]

from . import kernels
from .kernels import kernel_bwd, kernel_bwd_varlen, kernel_fwd, kernel_fwd_varlen


def _seq_major(x: Tensor) -> Tensor:
    """``x`` [B, H, S, D] laid out as [B, S, H, D] in memory (a copy only if it is not already)."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


def _empty_seq_major(like: Tensor) -> Tensor:
    b, h, s, d = like.shape
    return like.new_empty(b, s, h, d).transpose(1, 2)


@torch.library.custom_op("cp_dtensor::block_attn", mutates_args=())
def block_attn(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = kernel_fwd(q, k, v, is_causal, scale)
    # The kernels return [B, S, H, ...]-major strides; the op promises contiguous results.
    return out.contiguous(), lse.contiguous()


@block_attn.register_fake
def _(q, k, v, is_causal, scale):
    # new_empty, not empty_like: the results are contiguous whatever q's strides (empty_like keeps them)
    out = q.new_empty((*q.shape[:3], v.shape[3]))
    return out, q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("cp_dtensor::block_attn_backward", mutates_args=())
def block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *final* out and lse of the rows (not the block's own): the
    kernel's D = rowsum(dout * out) and P = exp(s - lse) are then those of the full attention, so the
    block's dq, dk, dv are exactly its share of the full gradients."""
    grads = kernel_bwd(dout, q, k, v, out, lse, is_causal, scale)
    return tuple(_seq_major(g) for g in grads)  # on CPU already sequence-major: no copy


@block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, is_causal, scale):
    return _empty_seq_major(q), _empty_seq_major(k), _empty_seq_major(v)  # sequence-major, as the kernel's


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # lse is an output for the ring's merge, not a differentiable result.
    dq, dk, dv = block_attn_backward(dout.contiguous(), q, k, v, out, lse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


block_attn.register_autograd(_backward, setup_context=_setup_context)


def head_chunks(q: Tensor, k: Tensor) -> list[tuple[slice, slice]]:
    """(q heads, kv heads) per backward kernel call; see Note [Backward in head chunks] in blocks.py."""
    b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    if kernels.backend(q) != "cpu":
        return [(slice(None), slice(None))]
    groups = hq // hkv
    n = min(hkv, -(-torch.get_num_threads() // (b * groups)))  # kv heads per call: >= one (b, head) per thread
    while hkv % n:
        n += 1
    return [(slice(i * groups, (i + n) * groups), slice(i, i + n)) for i in range(0, hkv, n)]


@torch.library.custom_op("cp_dtensor::block_attn_backward_into_", mutates_args=("dq", "dkv"))
def block_attn_backward_into_(
    dq: Tensor, dkv: Tensor, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    q0: int, q1: int, k0: int, k1: int, is_causal: bool, scale: float, add: bool,
) -> None:
    """One ring step's backward, written into the ring's buffers: rows [q0, q1) of q against rows
    [k0, k1) of k and v. Adds the block's dq into ``dq`` rows (sets them when ``add`` is False) and
    writes its dk, dv into ``dkv`` (flat [dk | dv] shaped like k and v); other rows are untouched.
    The kernel runs per group of KV heads (:func:`head_chunks`), so the only fresh gradients are
    one group's -- in eager and compiled graphs alike (Note [Backward in head chunks] in blocks.py)."""
    dk_out, dv_out = dkv[: k.numel()].view(k.shape), dkv[k.numel() :].view(v.shape)
    for hq, hkv in head_chunks(q, k):
        qi, ki = (slice(None), hq, slice(q0, q1)), (slice(None), hkv, slice(k0, k1))
        dq_c, dk_c, dv_c = kernel_bwd(dout[qi], q[qi], k[ki], v[ki], out[qi], lse[qi], is_causal, scale)
        if add:
            dq[qi] += dq_c
        else:
            dq[qi] = dq_c
        dk_out[ki] = dk_c
        dv_out[ki] = dv_c
        del dq_c, dk_c, dv_c


@block_attn_backward_into_.register_fake
def _(dq, dkv, dout, q, k, v, out, lse, q0, q1, k0, k1, is_causal, scale, add):
    return None


def merge_(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Fold a partial result over other keys into (out, lse), in place; see Note [Online softmax merge]
    in blocks.py. out: [B, H, S, Dv] fp32 (a view), lse: [B, H, S] fp32 (a view); lse may be -inf (no key
    yet), lse_b may not."""
    # stable merge: out + sigmoid(lse_b - lse) * (out_b - out); no exp() can overflow
    w = torch.sigmoid(lse_b - lse).unsqueeze(-1)
    out.lerp_(out_b.to(out.dtype), w)
    lse.copy_(torch.logaddexp(lse, lse_b))


# ---------------------------------------------------------------------------------------------------
# Masked blocks: documents and windows. See Note [Masked ring steps] in masks.py.


_SEGMENTS: dict[tuple, tuple] = {}  # (id(ids), row) -> (weakref to ids, version, segments): Note [One plan per call]


def _row_segments(ids: Tensor, row: int) -> tuple[tuple[int, int, int], ...]:
    """:func:`_segments` of ``ids[row]`` ([B, S] ids), once per tensor and row: the forward and the
    backward of a call pass the same ids (blocks.Mask.args), every step the same query ids. An inference
    tensor (torch.inference_mode) has no version counter to tell an in-place change: read every time."""
    if ids.is_inference():
        return _segments(ids[row])
    hit = _SEGMENTS.get((id(ids), row))
    if hit is not None and hit[0]() is ids and hit[1] == ids._version:
        return hit[2]
    segs = _segments(ids[row])
    if len(_SEGMENTS) > 4096:  # dead entries of earlier calls
        for key in [k for k, v in _SEGMENTS.items() if v[0]() is None]:
            del _SEGMENTS[key]
    _SEGMENTS[id(ids), row] = (weakref.ref(ids), ids._version, segs)
    return segs


def _segments(ids: Tensor) -> tuple[tuple[int, int, int], ...]:
    """(start, end, id) of the runs of equal ids in a 1-D tensor. Reads the ids on the host."""
    n = ids.shape[0]
    starts = torch.cat([ids.new_zeros(1, dtype=torch.int64), torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1])
    values, starts = ids[starts].tolist(), starts.tolist()
    return tuple((s, e, d) for s, e, d in zip(starts, starts[1:] + [n], values))


def _batch_rects(q_ids, k_ids, q_runs: list[int], k_runs: list[int], lo, hi, q: Tensor):
    """[(batch slice, rectangles)]: one entry for the whole batch when every row has the same ids."""
    from .masks import block_rects, unflat_runs

    qr, kr = unflat_runs(q_runs), unflat_runs(k_runs)
    strip = kernels.causal_strip(q.device)
    tile = -1 if lo is not None and kernels.flash_windows(q) else 0  # one rectangle per window band
    if q_ids is None:
        return [(slice(None), block_rects(qr, kr, lo, hi, tile=tile, strip=strip))]
    same = q_ids.shape[0] == 1 or bool((q_ids == q_ids[:1]).all() and (k_ids == k_ids[:1]).all())
    rows = [slice(None)] if same else [slice(b, b + 1) for b in range(q_ids.shape[0])]
    return [
        (b, block_rects(qr, kr, lo, hi, _row_segments(q_ids, b.start or 0), _row_segments(k_ids, b.start or 0),
                        tile=tile, strip=strip))
        for b in rows
    ]


class _Fresh:
    """Which row ranges a block op has written yet. A rectangle whose rows no earlier one touched is
    copied into the (uninitialised) accumulator; otherwise its untouched rows are initialised first
    (0 / -inf) and it is merged or added. Most rows of a document are touched once."""

    def __init__(self):
        self.done: list[tuple[int, int]] = []

    def __call__(self, a: int, b: int) -> tuple[bool, list[slice]]:
        """(whether [a, b) is untouched, the parts of [a, b) untouched so far)."""
        new = [s for s in _gaps(self.done, a, b)]
        self.done.append((a, b))
        return (len(new) == 1 and (new[0].start, new[0].stop) == (a, b)), new

    def gaps(self, n: int) -> list[slice]:
        """The ranges of [0, n) no rectangle touched."""
        return _gaps(self.done, 0, n)


def _gaps(done: list[tuple[int, int]], lo: int, hi: int) -> list[slice]:
    out, at = [], lo
    for a, b in sorted(done):
        a, b = max(a, lo), min(b, hi)
        if a >= b:
            continue
        if a > at:
            out.append(slice(at, a))
        at = max(at, b)
    return out + ([slice(at, hi)] if at < hi else [])


class _Masks:
    """The additive mask of each "mask" rectangle, built once per band and size within one call."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device, self.cache = dtype, device, {}

    def __call__(self, rect) -> Tensor | None:
        if rect.kind != "mask":
            return None
        nq, nk = rect.q1 - rect.q0, rect.k1 - rect.k0
        key = (nq, nk, *rect.band)
        if key not in self.cache:
            lo, hi = rect.band
            d = torch.arange(nk, device=self.device)[None, :] - torch.arange(nq, device=self.device)[:, None]
            keep = torch.ones(nq, nk, dtype=torch.bool, device=self.device)
            if lo is not None:
                keep &= d >= lo
            if hi is not None:
                keep &= d <= hi
            self.cache[key] = torch.zeros(nq, nk, dtype=self.dtype, device=self.device).masked_fill_(~keep, float("-inf"))
        return self.cache[key]


# Note [Varlen rectangles]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# A masked step with many short documents has a few rectangles per document, and a window of W tokens
# is cut into tiles of W / 4 rows: a call per rectangle is a kernel launch per rectangle, each too
# small to fill a GPU (a 128-token window over a 16k block: 512 tiles a step). Where CUDA's flash
# kernel takes the dtype and head size, the step's rectangles instead run as variable-length calls,
# every (batch row, rectangle) one packed sequence: one call for all full rectangles, one for all
# causal squares (square, so the kernel's bottom-right causal alignment is the ring's), and, where the
# flash build takes window sizes (kernels.flash_windows), each window band as one rectangle instead of
# tiles, one call per distinct (left, right) the bands need (the band read with flash's bottom-right
# alignment; usually one or two per step). Launches per step then no longer grow with the number of
# documents or the block length. The packed q, k, v (and out, dout, lse in the backward) are gathered
# copies, one block's worth. Without window support, window tiles keep their own calls (memory-efficient
# kernel with a bias). The CPU kernel has no variable-length form: one call per rectangle there (see
# Note [Causal staircase] in masks.py for how its squares are cut).


def _offsets(lengths: list[int], device: torch.device) -> Tensor:
    """[0, l0, l0 + l1, ...] as int32 on ``device``: built on the host (the rectangles are host values)
    and sent without making the host wait (pinned memory, non-blocking; the caching host allocator
    keeps the buffer until the copy is done)."""
    x = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32)
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x


def _span(r, keys: bool) -> slice:
    """A rectangle's key (or query) rows."""
    return slice(r.k0, r.k1) if keys else slice(r.q0, r.q1)


class _Pack:
    """Rectangles x batch rows as the packed sequences of one variable-length call."""

    def __init__(self, rects: list, batch: range, device: torch.device):
        self.rects, self.batch = rects, batch
        seqs = [(r.q1 - r.q0, r.k1 - r.k0) for r in rects for _ in batch]
        self.max_q, self.max_k = max(n for n, _ in seqs), max(n for _, n in seqs)
        self.cu_q = _offsets([n for n, _ in seqs], device)
        self.cu_k = _offsets([n for _, n in seqs], device)

    def rows(self, x: Tensor, keys: bool = False) -> Tensor:
        """[B, H, S, D] -> the rectangles' query (or key) rows packed, [T, H, D]."""
        return torch.cat([x[bi, :, _span(r, keys)].transpose(0, 1) for r in self.rects for bi in self.batch])

    def lse_rows(self, lse: Tensor) -> Tensor:
        """[B, H, S] -> [H, Tq]."""
        return torch.cat([lse[bi, :, _span(r, False)] for r in self.rects for bi in self.batch], 1)

    def split(self, packed: Tensor, keys: bool = False) -> list[Tensor]:
        """[T, H, D] -> per rectangle [B', H, n, D] (views)."""
        out, at, nb = [], 0, len(self.batch)
        for r in self.rects:
            n = (r.k1 - r.k0) if keys else (r.q1 - r.q0)
            out.append(packed[at : at + nb * n].unflatten(0, (nb, n)).permute(0, 2, 1, 3))
            at += nb * n
        return out

    def split_lse(self, lse: Tensor) -> list[Tensor]:
        """[H, Tq] -> per rectangle [B', H, n] (views)."""
        out, at, nb = [], 0, len(self.batch)
        for r in self.rects:
            n = r.q1 - r.q0
            out.append(lse[:, at : at + nb * n].unflatten(1, (nb, n)).transpose(0, 1))
            at += nb * n
        return out


def _flash_window(r) -> tuple[int, int]:
    """The band of a "mask" rectangle as flash's (left, right) window (Note [Kernel contracts]): row i
    keeps keys i + off - left .. i + off + right with off = Sk - Sq; -1 unbounded. Non-negative by
    construction (masks.band_rects trims rows without keys)."""
    lo, hi = r.band
    off = (r.k1 - r.k0) - (r.q1 - r.q0)
    left, right = (-1 if lo is None else off - lo), (-1 if hi is None else hi - off)
    assert left >= -1 and right >= -1 and (lo is None or left >= 0) and (hi is None or right >= 0), (r, left, right)
    return left, right


def _packed(q: Tensor, rects: list) -> tuple[list, dict[tuple, list]]:
    """(rectangles called one by one, {(kind, window): rectangles packed into one call}): Note [Varlen
    rectangles]."""
    if not kernels.varlen(q):
        return rects, {}
    windows = kernels.flash_windows(q)
    groups: dict[tuple, list] = {}
    alone = []
    for r in rects:
        if r.kind in ("full", "causal"):
            groups.setdefault((r.kind, None), []).append(r)
        elif windows:
            groups.setdefault(("mask", _flash_window(r)), []).append(r)
        else:
            alone.append(r)
    return alone, groups


def _forward_pieces(q: Tensor, k: Tensor, v: Tensor, b: slice, rects: list, scale: float, masks):
    """(rectangle, out_r, lse_r) of every rectangle of batch rows ``b``, in no particular order."""
    alone, groups = _packed(q, rects)
    for r in alone:
        qs, ks = (b, slice(None), slice(r.q0, r.q1)), (b, slice(None), slice(r.k0, r.k1))
        yield r, *kernel_fwd(q[qs], k[ks], v[ks], r.kind == "causal", scale, masks(r))
    for (kind, window), rs in groups.items():
        pack = _Pack(rs, range(q.shape[0])[b], q.device)
        out, lse = kernel_fwd_varlen(
            pack.rows(q), pack.rows(k, keys=True), pack.rows(v, keys=True), pack.cu_q, pack.cu_k, pack.max_q, pack.max_k,
            kind == "causal", scale, window,
        )
        yield from zip(rs, pack.split(out), pack.split_lse(lse))


def _backward_pieces(dout, q, k, v, out, lse, b: slice, rects: list, scale: float, masks):
    """(rectangle, (dq_r, dk_r, dv_r)) of every rectangle of batch rows ``b``, given the rows' final out
    and lse, in no particular order."""
    alone, groups = _packed(q, rects)
    for r in alone:
        qs, ks = (b, slice(None), slice(r.q0, r.q1)), (b, slice(None), slice(r.k0, r.k1))
        yield r, kernel_bwd(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs].contiguous(), r.kind == "causal", scale,
                            masks(r))
    for (kind, window), rs in groups.items():
        pack = _Pack(rs, range(q.shape[0])[b], q.device)
        dq, dk, dv = kernel_bwd_varlen(
            pack.rows(dout), pack.rows(q), pack.rows(k, keys=True), pack.rows(v, keys=True), pack.rows(out), pack.lse_rows(lse),
            pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, kind == "causal", scale, window,
        )
        yield from zip(rs, zip(pack.split(dq), pack.split(dk, keys=True), pack.split(dv, keys=True)))


@torch.library.custom_op("cp_dtensor::masked_block_attn", mutates_args=())
def masked_block_attn(
    q: Tensor, k: Tensor, v: Tensor, q_ids: Tensor | None, k_ids: Tensor | None,
    q_runs: list[int], k_runs: list[int], lo: int | None, hi: int | None, scale: float,
) -> tuple[Tensor, Tensor]:
    """One ring step under a mask: q [B, Hq, Sq, Dqk] against k [B, Hkv, Sk, Dqk], v [B, Hkv, Sk, Dv],
    keeping the pairs of the same document (ids [B, S] or None) with lo <= pos_k - pos_q <= hi, the
    positions given by the runs (masks.flat_runs). Returns out [B, Hq, Sq, Dv] and lse [B, Hq, Sq] in
    fp32 (fp64 for fp64 inputs); rows with no kept key get out 0 and lse -inf. One kernel call per
    rectangle of masks.block_rects, none where nothing is kept."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_empty((*q.shape[:3], v.shape[3]), dtype=acc)
    lse = q.new_empty(q.shape[:3], dtype=acc)
    masks = _Masks(q.dtype, q.device)
    for b, rects in _batch_rects(q_ids, k_ids, q_runs, k_runs, lo, hi, q):
        fresh = _Fresh()
        for r, out_r, lse_r in _forward_pieces(q, k, v, b, rects, scale, masks):
            qs = (b, slice(None), slice(r.q0, r.q1))
            whole, new = fresh(r.q0, r.q1)
            if whole:
                out[qs], lse[qs] = out_r, lse_r
                continue
            for rows in new:
                out[b, :, rows], lse[b, :, rows] = 0, float("-inf")
            merge_(out[qs], lse[qs], out_r, lse_r)
        for rows in fresh.gaps(q.shape[2]):
            out[b, :, rows] = 0
            lse[b, :, rows] = float("-inf")
    return out, lse


@masked_block_attn.register_fake
def _(q, k, v, q_ids, k_ids, q_runs, k_runs, lo, hi, scale):
    acc = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty((*q.shape[:3], v.shape[3]), dtype=acc), q.new_empty(q.shape[:3], dtype=acc)


@torch.library.custom_op("cp_dtensor::masked_block_attn_merge_", mutates_args=("out", "lse"))
def masked_block_attn_merge_(
    out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, q_ids: Tensor | None, k_ids: Tensor | None,
    q_runs: list[int], k_runs: list[int], lo: int | None, hi: int | None, scale: float,
) -> None:
    """:func:`masked_block_attn`, merged straight into the ring's accumulators ``out`` [B, Hq, Sq, Dv]
    and ``lse`` [B, Hq, Sq] (fp32): only the rows a rectangle keeps are touched, and no block-sized
    result is allocated. See Note [Online softmax merge] in blocks.py."""
    masks = _Masks(q.dtype, q.device)
    for b, rects in _batch_rects(q_ids, k_ids, q_runs, k_runs, lo, hi, q):
        for r, out_r, lse_r in _forward_pieces(q, k, v, b, rects, scale, masks):
            qs = (b, slice(None), slice(r.q0, r.q1))
            merge_(out[qs], lse[qs], out_r, lse_r)


@masked_block_attn_merge_.register_fake
def _(out, lse, q, k, v, q_ids, k_ids, q_runs, k_runs, lo, hi, scale):
    return None


@torch.library.custom_op("cp_dtensor::masked_block_attn_backward", mutates_args=())
def masked_block_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_ids: Tensor | None,
    k_ids: Tensor | None, q_runs: list[int], k_runs: list[int], lo: int | None, hi: int | None, scale: float,
) -> tuple[Tensor, Tensor]:
    """The block's dq and [dk | dv] (one flat buffer, the ring's accumulator layout; fp32, fp64 for fp64
    inputs) given the rows' *final* out and lse, as :func:`block_attn_backward`; zeros where the mask
    keeps nothing."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = q.new_empty(q.shape, dtype=acc)
    dkv = k.new_empty(k.numel() + v.numel(), dtype=acc)
    dk, dv = dkv[: k.numel()].view(k.shape), dkv[k.numel() :].view(v.shape)
    masks = _Masks(q.dtype, q.device)
    for b, rects in _batch_rects(q_ids, k_ids, q_runs, k_runs, lo, hi, q):
        fresh_q, fresh_k = _Fresh(), _Fresh()
        for r, g in _backward_pieces(dout, q, k, v, out, lse, b, rects, scale, masks):
            qs, ks = (b, slice(None), slice(r.q0, r.q1)), (b, slice(None), slice(r.k0, r.k1))
            whole, new = fresh_q(r.q0, r.q1)
            if whole:
                dq[qs] = g[0]
            else:
                for rows in new:
                    dq[b, :, rows] = 0
                dq[qs] += g[0]
            whole, new = fresh_k(r.k0, r.k1)
            if whole:
                dk[ks], dv[ks] = g[1], g[2]
            else:
                for rows in new:
                    dk[b, :, rows], dv[b, :, rows] = 0, 0
                dk[ks] += g[1]
                dv[ks] += g[2]
        for rows in fresh_q.gaps(q.shape[2]):
            dq[b, :, rows] = 0
        for rows in fresh_k.gaps(k.shape[2]):
            dk[b, :, rows] = 0
            dv[b, :, rows] = 0
    return dq, dkv


@masked_block_attn_backward.register_fake
def _(dout, q, k, v, out, lse, q_ids, k_ids, q_runs, k_runs, lo, hi, scale):
    acc = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape, dtype=acc), k.new_empty(k.numel() + v.numel(), dtype=acc)


def _masked_setup_context(ctx, inputs, output):
    q, k, v, q_ids, k_ids, *static = inputs
    ctx.save_for_backward(q, k, v, *output, q_ids, k_ids)
    ctx.static = static


def _masked_backward(ctx, dout, dlse):
    q, k, v, out, lse, q_ids, k_ids = ctx.saved_tensors
    dq, dkv = masked_block_attn_backward(dout.contiguous(), q, k, v, out.to(q.dtype), lse, q_ids, k_ids, *ctx.static)
    dk, dv = dkv[: k.numel()].view(k.shape), dkv[k.numel() :].view(v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


masked_block_attn.register_autograd(_masked_backward, setup_context=_masked_setup_context)


@torch.library.custom_op("cp_dtensor::after", mutates_args=())
def after(x: Tensor, dep: Tensor) -> Tensor:
    """A copy of ``x`` that the compiler must compute after ``dep`` exists. See Note [Compiled backward
    re-sends K/V] in ring.py: it keeps the backward's K/V rotations in the backward graph."""
    return x.clone()


@after.register_fake
def _(x, dep):
    return torch.empty_like(x)


@torch.library.custom_op("cp_dtensor::tie_", mutates_args=("buf",))
def tie_(buf: Tensor, dep: Tensor) -> None:
    """Nothing, done to ``buf`` once ``dep`` exists: in a compiled graph every later reader of ``buf`` (the
    first K/V collective) then comes after ``dep`` (the agreement). See Note [Compiled agreement] in
    checks.py. Inductor re-inplaces it: no copy, no kernel."""


@tie_.register_fake
def _(buf, dep):
    return None


def tie(buf: Tensor, ready: Tensor | None) -> Tensor:
    """``buf``, tied after ``ready`` when given (compiled calls; eager passes None)."""
    if ready is not None:
        with torch.no_grad():  # the tie has no gradient: keep it out of autograd (2-D: q, k, v's heads)
            tie_(buf, ready)
    return buf
