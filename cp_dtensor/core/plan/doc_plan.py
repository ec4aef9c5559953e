"""The document placement's math: where each packed document's tokens go (``plan_row``), the work each
rank's queries do (``rank_work``) and the K/V rows the masks make it receive (``needed_rows``).

Pure integer math, no torch: ``cp-dtensor plan`` and the benchmark use it as it is; documents.py builds the
``DocumentLayout`` of a batch from it.

Note [Document placement]
~~~~~~~~~~~~~~~~~~~~~~~~~
Causal attention inside a document costs ``c(i) = sum over layers of min(i + 1, left + 1)`` kept pairs for
the query at offset i of its document (``left`` unbounded for a global layer), so a document of L tokens
costs ``F(L) = sum_{i < L} c(i)``, closed form (``_prefix_cost``). Every rank must hold exactly S = N / P
tokens of the row (shapes stay equal) and as near ``F_total / P`` of the work as a token allows.

A document's *density* is its work per token, ``F(L) / L``: it grows with L (``c`` never falls). Lay the
documents in a line, densest first; each rank in turn takes ``x`` tokens from the dense front and ``S - x``
from the sparse back, ``x`` chosen (a binary search) so that the rank's work is the target: what is left
divided by the ranks left (a rank's rounding is absorbed by the next targets, not piled on the last rank).
The front's first S tokens are the densest and the back's the sparsest, so a rank's work is below the
target at ``x = 0`` and above it at ``x = S`` (what is left averages the target, as every rank before took
its share), and the search brackets it (else the nearer end is taken).

What a rank takes of a document it does not take whole is a *head-tail piece* of the document's rest
``[lo, hi)``: h tokens from its head and t - h from its tail. The piece's work falls as h grows (head tokens
are cheap, tail ones dear), so h picks the work: the rest's density times t (a binary search), so that what
stays of the document -- the middle, ``[lo + h, hi - (t - h))`` -- keeps the density it had and the line
stays sorted. The rank's last piece instead takes exactly the work the rank still lacks (its rounding comes
from the search's estimate: every piece counted at its rest's density). A long document so ends in nested
head-tail pieces, outermost first, on as many ranks as its work needs; the short, sparse documents at the
back go whole to a rank (their queries need no K/V from anywhere); only the rest a rank's front or back
ends in is cut, so a rank holds a few runs. One document covering the row is the special case of a single
rest: each rank a head-tail piece of S tokens, h by the target. O(P log S) tests plus one pass over the
documents (the line's prefix sums answer a search's test without a loop): about 2 ms at P = 32,
N = 262144.

Rows of a few tokens per rank (S ~ 8) leave a token's work a large share of the target; there a last pass
evens out the busiest ranks (``rebalance`` in doc_recut.py): the busiest rank and a less busy one that
share a document cut their tokens of it again -- the busier keeps as many tokens as it had, the window of
their union whose work evens the pair, the other the rest. It runs only when the busiest rank is over
``tol`` of the mean. A rank's local order is increasing global position, as in every layout, so the local
causal mask is the global one and ``shard_tensor`` is one gather.

Note [Document exchange bytes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank r's queries need the key at position j, held by another rank, iff some query i of r's in j's
document keeps it: ``lo <= j - i <= hi`` (causal: hi = 0; a window: lo = -left). Those rows, and only
those, travel from their holder straight to r, once (all-to-all-v): ``needed_rows`` counts them. The
striped ring sends (P - 1) * S rows per rank whatever the documents.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Any

from .doc_recut import _union, rebalance

__all__ = ["Window", "interval_work", "lengths_of", "needed_rows", "plan_intervals", "plan_row", "rank_work", "row_balance", "window_lefts"]

Window = int | tuple[int, int] | None


def window_lefts(windows: Any) -> tuple[int | None, ...]:
    """The left reach of each attention layer: None (global), an int, or (left, right) -> left (-1: None)."""
    if windows is None:
        return (None,)
    if isinstance(windows, (int, tuple)) and not isinstance(windows, bool) and not (
            isinstance(windows, tuple) and any(isinstance(w, (tuple, list)) or w is None for w in windows)):
        windows = [windows]
    out = []
    for w in windows:
        if w is None:
            out.append(None)
        elif isinstance(w, int) and not isinstance(w, bool):
            out.append(None if w < 0 else w)
        elif isinstance(w, (tuple, list)) and len(w) == 2 and all(isinstance(x, int) for x in w):
            out.append(None if w[0] < 0 else int(w[0]))
        else:
            raise ValueError(f"document_layout: windows lists each attention layer's window_size: None (global), an int "
                             f"left reach or a (left, right) pair; got {w!r}.")
    if not out:
        raise ValueError("document_layout: windows is empty; pass None for one global layer.")
    return tuple(out)


def _prefix_cost(x: int, lefts: tuple[int | None, ...]) -> int:
    """F(x) = sum_{i < x} sum over layers of min(i + 1, left + 1): the kept causal pairs of a document's first
    x queries. See Note [Document placement]."""
    total = 0
    for left in lefts:
        m = x if left is None else left + 1
        if x <= m:
            total += x * (x + 1) // 2
        else:
            total += m * (m + 1) // 2 + (x - m) * m
    return total


def lengths_of(ids: list[int]) -> list[int]:
    """Document lengths of one row of non-decreasing ids."""
    out, prev = [], None
    for x in ids:
        if out and x == prev:
            out[-1] += 1
        else:
            out.append(1)
        prev = x
    return out


def _prefix_fn(lefts: tuple[int | None, ...]) -> Callable[[int], int]:
    """``_prefix_cost`` of ``lefts`` as a one-argument function (a closed form for one global layer)."""
    if lefts == (None,):
        return lambda x: x * (x + 1) // 2
    return lambda x: _prefix_cost(x, lefts)


def plan_row(lengths: list[int], world: int, *, windows: Any = None, tol: float = 0.02, sand_share: int | None = None,
             small: int | None = None) -> list[list[int]]:
    """The global positions each of ``world`` ranks holds of one row of packed documents of ``lengths``
    (sum N, a multiple of ``world``), each rank's sorted, N / world each. See Note [Document placement]."""
    s = sum(lengths) // max(world, 1)
    out = []
    for ivs in plan_intervals(lengths, world, windows=windows, tol=tol, sand_share=sand_share, small=small):
        pos: list[int] = []
        for a, b in ivs:
            pos.extend(range(a, b))
        assert len(pos) == s, (len(pos), s)
        out.append(pos)
    return out


def plan_intervals(lengths: list[int], world: int, *, windows: Any = None, tol: float = 0.02,
                   sand_share: int | None = None, small: int | None = None) -> list[list[tuple[int, int]]]:
    """:func:`plan_row` as each rank's sorted intervals ``[a, b)`` of global positions (what
    ``document_layout`` builds its order from without a Python int per token); an interval lies in one
    document. ``tol``: the busiest rank's excess over the mean work above which the re-cuts run (rows of a
    few tokens per rank; Note [Document placement]). ``sand_share``, ``small``: knobs of an earlier
    placement, without effect (they warn once)."""
    n = sum(lengths)
    if world < 1 or n % world:
        raise ValueError(f"document_layout needs the row length divisible by the CP degree ({world}); got {n}. "
                         f"Pad the batch to a multiple of {world}.")
    if any(length < 1 for length in lengths):
        raise ValueError(f"document lengths must be positive; got {lengths}.")
    if sand_share is not None or small is not None:
        from ..._deprecated import warn_once

        warn_once("plan_row / plan_intervals(sand_share=, small=)", "plan_row(lengths, world, windows=, tol=)")
    lefts = window_lefts(windows)
    f = _prefix_fn(lefts)
    whole, whole_work, held = _place(lengths, world, f)
    # held[r][d]: rank r's offsets in document d, of the documents it does not hold whole; the re-cuts only
    # where a token's work is coarse (tiny rows)
    owners: dict[int, int] = {}
    for mine in held:
        for d in mine:
            owners[d] = owners.get(d, 0) + 1
    load = [w + sum(f(y) - f(x) for ivs in mine.values() for x, y in ivs) for w, mine in zip(whole_work, held)]
    shared = [{d: _union([], ivs) for d, ivs in mine.items() if owners[d] > 1} for mine in held]
    rebalance(load, shared, f, tol=tol, quadratic=lefts == (None,))
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    out = []
    for docs, mine, cut in zip(whole, held, shared):
        ivs = [(starts[d], starts[d] + lengths[d]) for d in docs]
        ivs += [(starts[d] + x, starts[d] + y) for d, offs in mine.items() if d not in cut for x, y in offs]
        ivs += [(starts[d] + x, starts[d] + y) for d, offs in cut.items() for x, y in offs if y > x]
        ivs.sort()
        out.append(ivs)
    return out


def _place(lengths: list[int], world: int, f: Callable[[int], int]):
    """(the documents each rank holds whole, their work, each rank's offsets in the others it holds
    ``[{d: [(x, y), ...]}]``): the line of documents, densest first, each rank ``x`` tokens from its front
    and ``S - x`` from its back. See Note [Document placement]."""
    s = sum(lengths) // world
    line = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))  # densest first (F(L) / L grows with L)
    m = len(line)
    size = [lengths[d] for d in line]
    cost = [f(x) for x in size]
    cum_len, cum_cost = [0], [0]  # prefix sums along the line
    for x, c in zip(size, cost):
        cum_len.append(cum_len[-1] + x)
        cum_cost.append(cum_cost[-1] + c)
    lo, hi = [0] * m, list(size)  # each document's rest [lo, hi): offsets not placed yet
    i, j = 0, m - 1  # the line's first and last document with a rest; those between are whole
    left = cum_cost[-1]  # the work not placed yet
    held: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(world)]
    whole: list[list[int]] = [[] for _ in range(world)]
    whole_work = [0] * world

    def take_whole(r: int, k0: int, k1: int) -> int:
        """Rank r takes the untouched line documents k0 .. k1 - 1 whole. Returns their work."""
        whole[r].extend(line[k0:k1])
        lo[k0:k1] = hi[k0:k1]
        w = cum_cost[k1] - cum_cost[k0]
        whole_work[r] += w
        return w

    def untouched(k: int) -> bool:
        return lo[k] == 0 and hi[k] == size[k]

    def take(r: int, k: int, t: int, want: float | None = None) -> int:
        """Rank r takes t tokens of line document k's rest: all of it, or the head-tail piece whose work is
        ``want`` (default: t at the rest's density, so the middle left keeps it). Returns the work."""
        a, b = lo[k], hi[k]
        if t == size[k]:
            return take_whole(r, k, k + 1)
        mine = held[r].setdefault(line[k], [])
        if t == b - a:
            mine.append((a, b))
            lo[k] = b
            return f(b) - f(a)
        if want is None:
            want = t * (f(b) - f(a)) / (b - a)

        def piece(h: int) -> int:  # h head tokens and t - h tail ones: falls as h grows
            return f(a + h) - f(a) + f(b) - f(b - t + h)

        x, y = 0, t  # the smallest h whose piece is at most want, or the one before it if nearer
        while x < y:
            mid = (x + y) // 2
            if piece(mid) <= want:
                y = mid
            else:
                x = mid + 1
        if x and want - piece(x) > piece(x - 1) - want:
            x -= 1
        mine += [iv for iv in ((a, a + x), (b - t + x, b)) if iv[1] > iv[0]]
        lo[k], hi[k] = a + x, b - t + x
        return piece(x)

    for r in range(world - 1):
        target = left / (world - r)
        if i == j:  # one rest left: a head-tail piece of S tokens with the target's work
            left -= take(r, i, s, target)
            continue
        ri, wi = hi[i] - lo[i], f(hi[i]) - f(lo[i])
        rj, wj = hi[j] - lo[j], f(hi[j]) - f(lo[j])
        mid_len = cum_len[j] - cum_len[i + 1]  # the whole documents between i and j

        def front(x: int) -> float:  # the work of the line's first x tokens, each rest at its density
            if x <= ri:
                return x * wi / ri
            x -= ri
            if x > mid_len:
                return wi + cum_cost[j] - cum_cost[i + 1] + (x - mid_len) * wj / rj
            k = bisect_right(cum_len, cum_len[i + 1] + x) - 1  # documents i + 1 .. k - 1 whole, then part of k
            part = x - (cum_len[k] - cum_len[i + 1])
            return wi + cum_cost[k] - cum_cost[i + 1] + (part * cost[k] / size[k] if part else 0)

        def back(y: int) -> float:  # the work of the line's last y tokens, the same way
            if y <= rj:
                return y * wj / rj
            y -= rj
            if y > mid_len:
                return wj + cum_cost[j] - cum_cost[i + 1] + (y - mid_len) * wi / ri
            k = bisect_right(cum_len, cum_len[j] - y)  # documents k .. j - 1 whole, then part of k - 1
            part = y - (cum_len[j] - cum_len[k])
            return wj + cum_cost[j] - cum_cost[k] + (part * cost[k - 1] / size[k - 1] if part else 0)

        def work(x: int) -> float:
            return front(x) + back(s - x)

        if work(s) <= target:
            x = s
        elif work(0) >= target:
            x = 0
        else:  # work(a) <= target < work(b)
            a, b = 0, s
            while b - a > 1:
                mid = (a + b) // 2
                if work(mid) <= target:
                    a = mid
                else:
                    b = mid
            x = a if target - work(a) <= work(b) - target else b
        got, y = 0, s - x
        while y:  # the back: whole rests, the last one a piece at its density
            while lo[j] == hi[j]:
                j -= 1
            if untouched(j) and size[j] <= y:  # as many untouched documents as fit, at once
                k = max(bisect_left(cum_len, cum_len[j + 1] - y), i + 1 if j > i else i)
                got += take_whole(r, k, j + 1)
                y -= cum_len[j + 1] - cum_len[k]
                j = k
                continue
            t = min(y, hi[j] - lo[j])
            got += take(r, j, t)
            y -= t
        while x:  # the front: whole rests, the last one a piece with the work the rank lacks
            while lo[i] == hi[i]:
                i += 1
            k = min(bisect_right(cum_len, cum_len[i] + x) - 1, j if j > i else i + 1)
            if untouched(i) and k > i:  # as many untouched documents as fit, at once
                got += take_whole(r, i, k)
                x -= cum_len[k] - cum_len[i]
                continue
            t = min(x, hi[i] - lo[i])
            got += take(r, i, t, target - got if t == x else None)
            x -= t
        while i < j and lo[i] == hi[i]:
            i += 1
        while j > i and lo[j] == hi[j]:
            j -= 1
        left -= got
    for k in {i, j}:  # the last rank: what is left, S tokens (the documents between i and j untouched)
        if hi[k] > lo[k]:
            take(world - 1, k, hi[k] - lo[k])
    if j > i + 1:
        take_whole(world - 1, i + 1, j)
    return whole, whole_work, held


def interval_work(intervals: list[list[tuple[int, int]]], lengths: list[int], *, windows: Any = None) -> list[int]:
    """Kept causal pairs of each rank's queries (summed over the layers of ``windows``) from its intervals
    (:func:`plan_intervals`' answer; an interval may span documents): :func:`rank_work` without a Python int
    per token, what a per-step balance report reads."""
    f = _prefix_fn(window_lefts(windows))
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    out = []
    for ivs in intervals:
        total = 0
        for a, b in ivs:
            while a < b:
                d = bisect_right(starts, a) - 1
                e = min(b, starts[d + 1])
                total += f(e - starts[d]) - f(a - starts[d])
                a = e
        out.append(total)
    return out


def rank_work(positions: list[list[int]], lengths: list[int], *, windows: Any = None) -> list[int]:
    """Kept causal pairs of each rank's queries (summed over the layers of ``windows``)."""
    lefts = window_lefts(windows)
    offs = []
    for length in lengths:
        offs.extend(range(length))
    out = []
    for pos in positions:
        out.append(sum(_prefix_cost(offs[p] + 1, lefts) - _prefix_cost(offs[p], lefts) for p in pos))
    return out


def row_balance(positions: list[list[int]], lengths: list[int], *, windows: Any = None) -> float:
    """max / mean over ranks of :func:`rank_work`."""
    w = rank_work(positions, lengths, windows=windows)
    return max(w) * len(w) / sum(w)


def _intervals(sorted_pos: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for p in sorted_pos:
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [(a, b) for a, b in out]


def needed_rows(positions: list[list[int]], lengths: list[int], *, is_causal: bool = True,
                window: tuple[int, int] | None = None) -> list[int]:
    """K/V rows each rank must receive for its queries under the mask (documents, causal, ``window``
    (left, right)); see Note [Document exchange bytes]. Works for any placement (striped's positions too)."""
    left, right = window if window is not None else (-1, -1)
    lo = -left if left >= 0 else None
    hi = right if right >= 0 else None
    if is_causal:
        hi = 0 if hi is None else min(hi, 0)
    bounds, acc = [], 0
    for length in lengths:
        bounds.append((acc, acc + length))
        acc += length
    doc_of = []
    for d, length in enumerate(lengths):
        doc_of.extend([d] * length)
    out = []
    for pos in positions:
        local = set(pos)
        need: list[tuple[int, int]] = []
        for a, b in _intervals(sorted(pos)):  # split each query interval by document
            while a < b:
                d = doc_of[a]
                ds, de = bounds[d]
                e = min(b, de)
                k0 = ds if lo is None else max(ds, a + lo)
                k1 = de if hi is None else min(de, e - 1 + hi + 1)
                if k1 > k0:
                    need.append((k0, k1))
                a = e
        count, cur = 0, -1
        for k0, k1 in sorted(need):
            k0 = max(k0, cur)
            if k1 > k0:
                count += sum(1 for j in range(k0, k1) if j not in local)
                cur = k1
        out.append(count)
    return out
