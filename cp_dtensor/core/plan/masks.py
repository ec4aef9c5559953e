"""Masks in the ring: documents, windows and causality -> the rectangles each ring step keeps. Pure math.

Note [Masked ring steps]
~~~~~~~~~~~~~~~~~~~~~~~~
A mask keeps the pair (query at global position i, key at global position j) iff

    doc(i) == doc(j)  and  lo <= j - i <= hi

with ``lo = -left`` (None: unbounded) and ``hi = right``, lowered to 0 by ``is_causal`` (None:
unbounded). Document ids are non-decreasing along the global sequence, so a document is one
contiguous range of positions.

Every layout stores a rank's tokens as one or two *runs*: local indices whose global positions are
``base + stride * (local - start)`` (contiguous: one run, stride 1; striped: one run, stride P;
head-tail: two runs, stride 1). Within one pair of runs (query run, key run) with the same stride the
window becomes a band of local index differences, ``a <= jl - il <= b``, with a = ceil((lo - D) /
stride) and b = floor((hi - D) / stride), D the offset between the runs' positions; and since ids
are non-decreasing along each run, a document is one contiguous range of local indices in each run.
So a ring step keeps, per document present on both sides, one band inside one rectangle, and
``band_rects`` covers exactly that band with the rectangles the fused kernels compute without a
mask, or with a small one:

* no lower bound: the columns every row keeps (one full rectangle) and a top-left causal square (plus
  a full rectangle where the key range ends first) -- one kernel call for a document inside a block;
* a lower bound (sliding windows): query tiles of ``tile`` rows, each against the key range its rows
  need, with the band as an explicit mask over that tile-sized rectangle -- (W + T) / W times the kept
  pairs for a window of width W and tiles of T = W / 4 rows (measured on CPU: the fastest of W / 8 ..
  2 W), never a whole block masked afterwards.

Rows whose band is empty are trimmed from every rectangle, so every row a kernel sees keeps at least
one key (the CPU kernel returns lse = 0, not -inf, for a fully masked row). Without documents the
rectangles depend only on (layout, rank, src, window), so which ring steps have any kept pair is known
statically (``steps_needed``): a window shortens the ring, a step no rank needs is neither computed
nor sent. Documents are data, so their rectangles are computed inside the block op (ops.py), where
``torch.compile`` does not see them: new boundaries never recompile.

Note [Causal staircase]
~~~~~~~~~~~~~~~~~~~~~~~
The CPU flash kernel tiles queries by 256 rows (64 below 768 rows) and keys by 512, and under
``is_causal`` skips only key tiles wholly above a query tile: a causal square of 512-1024 rows
computes half to all of its masked-off upper triangle. Cut into strips of 256 rows -- per strip one full
rectangle of the keys all its rows keep and one 256-row causal square -- it computes about the kept
pairs plus the small squares' diagonals. Measured forward+backward on one thread (Hq 4, Hkv 2, D 64,
fp32), one square: 512 rows 7.8 -> 6.1 ms, 1024 rows 23.3 -> 19.7 ms, 2048 rows 74.8 -> 70.2 ms;
through the ops over 4096 tokens of packed documents: documents of 512 68.9 -> 58.1 ms, of 1024
97.9 -> 90.7 ms, of 2048 154.1 -> 154.2 ms (the strips' merges and dK/dV additions eat the gain), and
a 4096-row square was slower cut (278 vs 269 ms). So the staircase applies to squares of 2 to 4
strips, on CPU only (``kernels.causal_strip``): CUDA's kernels skip masked tiles at a finer grain.

Note [One plan per call]
~~~~~~~~~~~~~~~~~~~~~~~~
A call's plan -- per step whether the block is kept, both shards' runs, the rectangles -- is a pure
function of integers (layout, P, S_local, the window, U) and, with documents, of the step's segments.
Every function here that derives a piece of it is memoised (``functools.lru_cache``), so each piece is
derived once and every reader shares it: ``blocks.Mask`` (the steps a window needs, kept or skipped,
the runs it passes to the op), and the ops' rectangles (``ops._batch_rects``), which the backward asks
for again with the same arguments as the forward. The ops cut the rectangles themselves because they
are the compile boundary: a compiled graph passes the ids as tensors and takes new document boundaries
without recompiling; they read each ids row's segments on the host once per ids tensor
(``ops.RowSegments``, whose entries live exactly as long as the call's ids tensors). Measured
(``scripts/benchmarks/bench_mask_plan.py``, in docs/performance.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .layout import check_layout, pairs_upto

__all__ = ["Rect", "Run", "band_rects", "segments", "block_rects", "mask_bounds", "runs", "steps_needed", "kept_pairs"]


@dataclass(frozen=True)
class Run:
    """Local indices [start, start + count) at global positions base + stride * (local - start)."""

    start: int
    count: int
    base: int
    stride: int


@functools.lru_cache(maxsize=4096)  # See Note [One plan per call]
def runs(layout: str, rank: int, world: int, s_local: int, ulysses: int = 1) -> tuple[Run, ...]:
    """The runs of ``rank``'s shard. See Note [Sequence layouts] in layout.py. With ``ulysses`` = U > 1,
    ``rank`` is a ring rank of ``world`` = R and holds ``s_local`` = U * S tokens: the union of the
    shards of the 1-D ranks u * R + rank (u < U) over P = U * R ranks, in the order of Note [Ulysses
    unions] in ulysses.py (striped: exactly the striped shard over R, so no branch)."""
    if ulysses > 1 and layout in ("contiguous", "headtail"):
        return _union_runs(layout, rank, world, s_local // ulysses, ulysses)
    if check_layout(layout) == "contiguous":
        return (Run(0, s_local, rank * s_local, 1),)
    if layout == "striped":
        return (Run(0, s_local, rank, world),)
    c = s_local // 2
    return (Run(0, c, rank * c, 1), Run(c, c, (2 * world - 1 - rank) * c, 1))


def _union_runs(layout: str, r: int, world: int, s: int, ulysses: int) -> tuple[Run, ...]:
    p = ulysses * world
    if layout == "contiguous":  # U chunks of S: 1-D ranks r, R + r, 2R + r, ...
        return tuple(Run(u * s, s, (u * world + r) * s, 1) for u in range(ulysses))
    c = s // 2  # headtail: the U head chunks ascending, then the U tail chunks ascending (u descending)
    heads = [Run(u * c, c, (u * world + r) * c, 1) for u in range(ulysses)]
    tails = [Run((ulysses + i) * c, c, (2 * p - 1 - u * world - r) * c, 1) for i, u in enumerate(reversed(range(ulysses)))]
    return tuple(heads + tails)


def flat_runs(rs: tuple[Run, ...]) -> list[int]:
    """Runs as a flat int list (a custom op argument); ``unflat_runs`` undoes it."""
    return [x for r in rs for x in (r.start, r.count, r.base, r.stride)]


def unflat_runs(xs: list[int]) -> tuple[Run, ...]:
    return tuple(Run(*xs[i : i + 4]) for i in range(0, len(xs), 4))


def mask_bounds(is_causal: bool, window: tuple[int, int] | None) -> tuple[int | None, int | None]:
    """(lo, hi) on key position - query position; None is unbounded."""
    left, right = window if window is not None else (-1, -1)
    lo = -left if left >= 0 else None
    hi = right if right >= 0 else None
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


@dataclass(frozen=True)
class Rect:
    """``q[q0:q1]`` against ``k[k0:k1]`` (local indices), keeping the pairs with lo <= k - q <= hi."""

    q0: int
    q1: int
    k0: int
    k1: int
    lo: int | None
    hi: int | None

    @property
    def band(self) -> tuple[int | None, int | None]:
        """The kept band in the rectangle's own coordinates: lo' <= col - row <= hi'."""
        d = self.k0 - self.q0
        return (None if self.lo is None else self.lo - d), (None if self.hi is None else self.hi - d)

    @property
    def kind(self) -> str:
        """"full": every pair kept; "causal": a square with a top-left causal mask; "mask": other."""
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        lo, hi = self.band
        lo_free = lo is None or lo <= -(nq - 1)
        if lo_free and (hi is None or hi >= nk - 1):
            return "full"
        if lo_free and hi == 0 and nq == nk:
            return "causal"
        return "mask"

    def kept(self) -> int:
        """Kept pairs in the rectangle (closed form)."""
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        lo, hi = self.band
        upto = pairs_upto  # pairs with col - row <= h (layout.py)
        return (nq * nk if hi is None else upto(hi, nq, nk)) - (0 if lo is None else upto(lo - 1, nq, nk))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def band_rects(
    i0: int, i1: int, j0: int, j1: int, a: int | None, b: int | None, *, tile: int = 0, strip: int = 0
) -> list[Rect]:
    """Rectangles covering exactly {(i, j): i0 <= i < i1, j0 <= j < j1, a <= j - i <= b}, each row of
    each rectangle keeping at least one key. See Note [Masked ring steps]. ``tile``: rows per window
    tile (0: a quarter of the window; negative: one rectangle for the whole band, for kernels that
    take the window themselves)."""
    # rows whose band meets [j0, j1)
    if b is not None:
        i0 = max(i0, j0 - b)
    if a is not None:
        i1 = min(i1, j1 - a)
    if i0 >= i1 or j0 >= j1 or (a is not None and b is not None and a > b):
        return []
    # bounds that never bind inside the region are dropped
    if a is not None and j0 - (i1 - 1) >= a:
        a = None
    if b is not None and (j1 - 1) - i0 <= b:
        b = None
    if a is None:
        return _causal_rects(i0, i1, j0, j1, b, strip)
    tile = tile or (max(32, (b - a + 1) // 4) if b is not None else 256)
    if tile < 0:
        tile = i1 - i0
    out = []
    for t0 in range(i0, i1, tile):
        t1 = min(i1, t0 + tile)
        k0 = max(j0, t0 + a)
        k1 = j1 if b is None else min(j1, t1 - 1 + b + 1)
        out.append(Rect(t0, t1, k0, k1, a, b))
    return out


def _causal_rects(i0: int, i1: int, j0: int, j1: int, b: int | None, strip: int = 0) -> list[Rect]:
    """j - i <= b over rows [i0, i1) and keys [j0, j1) (rows already trimmed so that i0 + b >= j0):
    the keys every row keeps (one full rectangle), then a top-left causal square from (i0, i0 + b),
    then full rows below the square where the key range ends first. With ``strip`` > 0 a square
    of more rows (up to 4 strips) is cut into strips of ``strip`` rows, each a full rectangle of the
    keys its rows all keep plus a small causal square: Note [Causal staircase]."""
    if b is None:
        return [Rect(i0, i1, j0, j1, None, None)]
    out = []
    c0 = i0 + b  # row i0 keeps keys [j0, c0]; row i0 + r keeps up to c0 + r
    n = min(j1 - c0, i1 - i0)
    if strip and strip < n <= 4 * strip:  # where measured faster: Note [Causal staircase]
        for t in range(0, n, strip):
            m = min(strip, n - t)
            if c0 + t > j0:
                out.append(Rect(i0 + t, i0 + t + m, j0, c0 + t, None, None))
            out.append(Rect(i0 + t, i0 + t + m, c0 + t, c0 + t + m, None, b))
        if i0 + n < i1:  # rows past the square keep every key
            out.append(Rect(i0 + n, i1, j0, j1, None, None))
        return out
    if c0 > j0:
        out.append(Rect(i0, i1, j0, c0, None, None))
    out.append(Rect(i0, i0 + n, c0, c0 + n, None, b))
    if i0 + n < i1:  # rows past the square keep every key of [c0, j1)
        out.append(Rect(i0 + n, i1, c0, j1, None, None))
    return out


def _pair_band(qr: Run, kr: Run, lo: int | None, hi: int | None) -> tuple[int | None, int | None]:
    """The band a <= j - i <= b (local indices) of the window lo <= pos_k - pos_q <= hi for two runs."""
    assert qr.stride == kr.stride, "one layout: the runs of q and k have the same stride"
    s = qr.stride
    d = (kr.base - s * kr.start) - (qr.base - s * qr.start)  # pos_k - pos_q = s * (j - i) + d
    a = None if lo is None else _ceil_div(lo - d, s)
    b = None if hi is None else (hi - d) // s
    return a, b


Segments = list[tuple[int, int, int]]  # (start, end, document id) in local indices, increasing


def segments(ids: list[int]) -> Segments:
    """(start, end, id) of each run of equal ids in a list of local ids."""
    out, s = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[s]:
            out.append((s, i, ids[s]))
            s = i
    return out


def _match(qs: Segments, ks: Segments):
    """Pairs of (query segment, key segment) of the same document (both lists sorted by id)."""
    i = j = 0
    while i < len(qs) and j < len(ks):
        if qs[i][2] == ks[j][2]:
            yield qs[i], ks[j]
            i, j = i + 1, j + 1
        elif qs[i][2] < ks[j][2]:
            i += 1
        else:
            j += 1


def _clip(segs: Segments | None, run: Run) -> Segments:
    end = run.start + run.count
    if segs is None:
        return [(run.start, end, 0)]
    return [(max(s, run.start), min(e, end), d) for s, e, d in segs if s < end and e > run.start]


def block_rects(
    q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], lo: int | None, hi: int | None,
    q_segs: Segments | None = None, k_segs: Segments | None = None, *, tile: int = 0, strip: int = 0,
) -> list[Rect]:
    """Every rectangle of one ring step: query shard ``q_runs`` against key block ``k_runs``, with
    documents given as segments of equal id (None: one document). See Note [Masked ring steps]."""
    q_segs, k_segs = (None if x is None else tuple(x) for x in (q_segs, k_segs))
    return list(_block_rects(tuple(q_runs), tuple(k_runs), lo, hi, q_segs, k_segs, tile, strip))


@functools.lru_cache(maxsize=1024)  # See Note [One plan per call]
def _block_rects(q_runs, k_runs, lo, hi, q_segs, k_segs, tile: int, strip: int) -> tuple[Rect, ...]:
    rects = []
    for qr in q_runs:
        for kr in k_runs:
            a, b = _pair_band(qr, kr, lo, hi)
            for (q0, q1, _), (k0, k1, _) in _match(_clip(q_segs, qr), _clip(k_segs, kr)):
                rects += band_rects(q0, q1, k0, k1, a, b, tile=tile, strip=strip)
    return tuple(rects)


@functools.lru_cache(maxsize=256)  # See Note [One plan per call]
def steps_needed(layout: str, world: int, s_local: int, lo: int | None, hi: int | None, ulysses: int = 1) -> int:
    """How many ring steps (the local one included) the window needs on any rank: steps past the
    last one that any rank needs are neither computed nor sent. See Note [Masked ring steps]."""
    last = 0
    for rank in range(world):
        q = runs(layout, rank, world, s_local, ulysses)
        for t in range(last + 1, world):
            if block_rects(q, runs(layout, (rank - t) % world, world, s_local, ulysses), lo, hi):
                last = t
    return last + 1


@functools.lru_cache(maxsize=16384)  # See Note [One plan per call]
def has_pairs(
    layout: str, rank: int, src: int, world: int, s_local: int, lo: int | None, hi: int | None, ulysses: int = 1
) -> bool:
    """Whether ``rank`` keeps any pair of the block of ``src`` (documents aside)."""
    rs = (runs(layout, x, world, s_local, ulysses) for x in (rank, src))
    return len(block_rects(*rs, lo, hi)) > 0  # not bool(list): Dynamo 2.11 cannot trace it


def kept_pairs(rects: list[Rect]) -> int:
    return sum(r.kept() for r in rects)
