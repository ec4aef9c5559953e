"""Masked blocks as varlen pieces: the document segments of each row (``RowSegments``), the rectangles a
block's mask keeps, and their packing into the varlen kernels' calls (kernels.py) -- what the masked block
ops of ops.py run. See Note [Masked ring steps] in masks.py.
"""

from __future__ import annotations

import functools
import weakref
from itertools import accumulate

import torch
from torch import Tensor

from . import kernels
from .kernels import kernel_bwd, kernel_bwd_varlen, kernel_fwd, kernel_fwd_varlen

__all__ = ["RowSegments"]

class RowSegments:
    """The document segments (:func:`_segments`) of each row of an ids tensor [B, S], read on the host once
    per tensor, version and row: a call's forward and backward pass the same ids objects (``blocks.Mask.args``)
    and every step the same query ids. Each tensor's entry lives exactly as long as the tensor (a weak
    reference drops it; the call's ``Mask`` holds the ids), so nothing outlives the call and no id is
    reused. Owned by the masked block ops: a custom op's arguments are tensors and numbers, so a cache
    cannot travel into it with the call. See Note [One plan per call] in masks.py."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, int, dict[int, tuple]]] = {}  # id -> (ref, version, rows)

    def __call__(self, ids: Tensor, row: int) -> tuple[tuple[int, int, int], ...]:
        if ids.is_inference():  # no version counter to tell an in-place change (torch.inference_mode): read every time
            return _segments(ids[row])
        key = id(ids)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not ids or entry[1] != ids._version:
            entry = self._entries[key] = (weakref.ref(ids, functools.partial(self._drop, key)), ids._version, {})
        rows = entry[2]
        if row not in rows:
            rows[row] = _segments(ids[row])
        return rows[row]

    def _drop(self, key: int, dead: weakref.ref) -> None:
        """The weak reference's callback: the tensor of ``key`` is gone (unless the entry is a newer one's)."""
        if key in self._entries and self._entries[key][0] is dead:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


_row_segments = RowSegments()  # the masked block ops' own: see RowSegments


def _segments(ids: Tensor) -> tuple[tuple[int, int, int], ...]:
    """(start, end, id) of the runs of equal ids in a 1-D tensor. Reads the ids on the host."""
    n = ids.shape[0]
    starts = torch.cat([ids.new_zeros(1, dtype=torch.int64), torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1])
    values, starts = ids[starts].tolist(), starts.tolist()
    return tuple((s, e, d) for s, e, d in zip(starts, starts[1:] + [n], values))


def _batch_rects(q_ids, k_ids, q_runs: list[int], k_runs: list[int], lo, hi, q: Tensor, backends: int = -1):
    """[(batch slice, rectangles)]: one entry for the whole batch when every row has the same ids."""
    from ..plan.masks import block_rects, unflat_runs

    qr, kr = unflat_runs(q_runs), unflat_runs(k_runs)
    strip = kernels.causal_strip(q.device)
    tile = -1 if lo is not None and kernels.flash_windows(q, backends) else 0  # one rectangle per window band
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
# alignment, and a max_seqlen_k that keeps it as given: Note [Kernel contracts] in kernels.py; usually
# one or two per step). Launches per step then no longer grow with the number of
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


def _packed(q: Tensor, rects: list, backends: int) -> tuple[list, dict[tuple, list]]:
    """(rectangles called one by one, {(kind, window): rectangles packed into one call}): Note [Varlen
    rectangles]."""
    if not kernels.varlen(q, backends):
        return rects, {}
    windows = kernels.flash_windows(q, backends)
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


def _forward_pieces(q: Tensor, k: Tensor, v: Tensor, b: slice, rects: list, scale: float, masks, backends: int = -1):
    """(rectangle, out_r, lse_r) of every rectangle of batch rows ``b``, in no particular order."""
    alone, groups = _packed(q, rects, backends)
    for r in alone:
        qs, ks = (b, slice(None), slice(r.q0, r.q1)), (b, slice(None), slice(r.k0, r.k1))
        yield r, *kernel_fwd(q[qs], k[ks], v[ks], r.kind == "causal", scale, masks(r), backends)
    for (kind, window), rs in groups.items():
        pack = _Pack(rs, range(q.shape[0])[b], q.device)
        out, lse = kernel_fwd_varlen(
            pack.rows(q), pack.rows(k, keys=True), pack.rows(v, keys=True), pack.cu_q, pack.cu_k, pack.max_q, pack.max_k,
            kind == "causal", scale, window,
        )
        yield from zip(rs, pack.split(out), pack.split_lse(lse))


def _backward_pieces(dout, q, k, v, out, lse, b: slice, rects: list, scale: float, masks, backends: int = -1):
    """(rectangle, (dq_r, dk_r, dv_r)) of every rectangle of batch rows ``b``, given the rows' final out
    and lse, in no particular order."""
    alone, groups = _packed(q, rects, backends)
    for r in alone:
        qs, ks = (b, slice(None), slice(r.q0, r.q1)), (b, slice(None), slice(r.k0, r.k1))
        yield r, kernel_bwd(dout[qs], q[qs], k[ks], v[ks], out[qs], lse[qs].contiguous(), r.kind == "causal", scale,
                            masks(r), backends)
    for (kind, window), rs in groups.items():
        pack = _Pack(rs, range(q.shape[0])[b], q.device)
        dq, dk, dv = kernel_bwd_varlen(
            pack.rows(dout), pack.rows(q), pack.rows(k, keys=True), pack.rows(v, keys=True), pack.rows(out), pack.lse_rows(lse),
            pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, kind == "causal", scale, window,
        )
        yield from zip(rs, zip(pack.split(dq), pack.split(dk, keys=True), pack.split(dv, keys=True)))


