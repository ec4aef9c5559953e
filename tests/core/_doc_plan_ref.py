"""The document planner as it was before its fast rewrite (cp_dtensor/core/plan/doc_plan.py + doc_recut.py),
kept verbatim as the reference the rewrite must reproduce exactly (tests/core/test_doc_plan_fast.py):
a Python loop over every piece, one token at a time where the ranks are over their work. Not used by the
package.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Window", "lengths_of", "needed_rows", "plan_row", "rank_work", "row_balance", "window_lefts"]

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


def _piece_cost(start: int, lo: int, hi: int, h: int, t: int, lefts) -> int:
    """Work of the piece [lo, lo + h) + [hi - (t - h), hi) of the document starting at ``start``."""
    f = _prefix_cost
    return f(lo + h - start, lefts) - f(lo - start, lefts) + f(hi - start, lefts) - f(hi - (t - h) - start, lefts)


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


def plan_row(lengths: list[int], world: int, *, windows: Any = None, tol: float = 0.02, sand_share: int = 4,
             small: int = 16) -> list[list[int]]:
    """The global positions each of ``world`` ranks holds of one row of packed documents of ``lengths``
    (sum N, a multiple of ``world``), each rank's sorted, N / world each. See Note [Document placement]."""
    n = sum(lengths)
    if world < 1 or n % world:
        raise ValueError(f"document_layout needs the row length divisible by the CP degree ({world}); got {n}. "
                         f"Pad the batch to a multiple of {world}.")
    if any(length < 1 for length in lengths):
        raise ValueError(f"document lengths must be positive; got {lengths}.")
    lefts = window_lefts(windows)
    s = n // world
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    costs = [_prefix_cost(length, lefts) for length in lengths]
    total = sum(costs)
    target = total / world
    # the density of the documents that will fill the last token rooms: see Note [Document placement]
    sand = [d for d in range(len(lengths)) if costs[d] * sand_share <= target and lengths[d] * sand_share <= s]
    rho = sum(costs[d] for d in sand) / max(1, sum(lengths[d] for d in sand))
    room = [s] * world
    load = [rho * s] * world  # effective load: the work held plus rho per token of room still to fill
    held: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]  # intervals [a, b) of document d per rank
    for d in sorted(range(len(lengths)), key=lambda d: (-lengths[d], d)):
        start = starts[d]
        lo, hi = start, start + lengths[d]
        while lo < hi:
            rest = hi - lo
            cost = _piece_cost(start, lo, hi, rest, rest, lefts)  # the whole rest
            fits = [r for r in range(world) if room[r] >= rest and load[r] + cost - rho * rest <= target * (1 + tol)]
            if not fits and cost * small <= target:  # a small document stays whole (its bytes would cost more)
                fits = [r for r in range(world) if room[r] >= rest]
            if fits:
                r = min(fits, key=lambda r: (load[r], r))
                h = t = rest
            else:
                r = min((r for r in range(world) if room[r] > 0), key=lambda r: (load[r], r))
                h, t = _cut(start, lo, hi, room[r], target - load[r], rho, cost, lefts, last=sum(room) == room[r])
            for iv in ((lo, lo + h, d), (hi - (t - h), hi, d)):
                if iv[1] > iv[0]:
                    held[r].append(iv)
            load[r] += _piece_cost(start, lo, hi, h, t, lefts) - rho * t
            room[r] -= t
            lo, hi = lo + h, hi - (t - h)
    held = _rebalance(_defragment(held, starts, lengths, lefts), starts, lefts, tol=tol)
    out = []
    for r in range(world):
        pos = [p for a, b, _ in sorted(held[r]) for p in range(a, b)]
        assert len(pos) == s, (r, len(pos), s)
        out.append(pos)
    return out


def _defragment(held: list[list[tuple[int, int, int]]], starts: list[int], lengths: list[int],
                lefts) -> list[list[tuple[int, int, int]]]:
    """``held`` with every document that several ranks share cut again into nested head-tail pieces, one
    pair per rank (outermost first: the rank holding its first token), each rank keeping its token count
    and about its work in it. The greedy's pieces may alternate between two ranks many times (one rank's
    room filled a few tokens at a time: hundreds of runs), and the kernels run once per run pair."""
    world = len(held)
    pieces: dict[int, dict[int, list[tuple[int, int]]]] = {}
    for r, ivs in enumerate(held):
        for a, b, d in ivs:
            pieces.setdefault(d, {}).setdefault(r, []).append((a, b))
    out = [[iv for iv in held[r] if len(pieces[iv[2]]) == 1] for r in range(world)]
    for d, by_rank in pieces.items():
        if len(by_rank) == 1:
            continue
        start = starts[d]
        count = {r: sum(b - a for a, b in ivs) for r, ivs in by_rank.items()}
        work = {r: sum(_prefix_cost(b - start, lefts) - _prefix_cost(a - start, lefts) for a, b in ivs)
                for r, ivs in by_rank.items()}
        order = sorted(by_rank, key=lambda r: min(a for a, _ in by_rank[r]))  # the outermost piece first
        lo, hi = start, start + lengths[d]
        for i, r in enumerate(order):
            t = count[r]
            if i == len(order) - 1:
                h = t  # the innermost rank takes what is left: [lo, hi)
            else:
                a_, b_ = 0, t  # the smallest h whose piece's work is at most the rank's (it falls as h grows)
                while a_ < b_:
                    mid = (a_ + b_) // 2
                    if _piece_cost(start, lo, hi, mid, t, lefts) <= work[r]:
                        b_ = mid
                    else:
                        a_ = mid + 1
                h = a_
            for iv in ((lo, lo + h, d), (hi - (t - h), hi, d)):
                if iv[1] > iv[0]:
                    out[r].append(iv)
            lo, hi = lo + h, hi - (t - h)
    return out


def _union(x: list[tuple[int, int]], y: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of two disjoint sorted interval lists, sorted, touching intervals joined."""
    out: list[list[int]] = []
    for lo, hi in sorted(x + y):
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _offset(ivs: list[tuple[int, int]], i: int) -> tuple[int, int]:
    """(interval index, offset) of the i-th token of the sorted intervals ``ivs`` (i may be their count)."""
    seen = 0
    for j, (lo, hi) in enumerate(ivs):
        if i < seen + hi - lo:
            return j, lo + i - seen
        seen += hi - lo
    return len(ivs), ivs[-1][1] if ivs else 0


def _window(ivs: list[tuple[int, int]], i: int, n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(tokens [i, i + n) of the sorted intervals ``ivs``, the rest), both as sorted intervals."""
    inside, rest, seen = [], [], 0
    for lo, hi in ivs:
        a, b = max(lo, lo + i - seen), min(hi, lo + i + n - seen)
        if a < b:
            inside.append((a, b))
            rest += [iv for iv in ((lo, a), (b, hi)) if iv[1] > iv[0]]
        else:
            rest.append((lo, hi))
        seen += hi - lo
    return inside, rest


def _rebalance(held: list[list[tuple[int, int, int]]], starts: list[int], lefts, *, tol: float,
               max_cuts: int = 8) -> list[list[tuple[int, int, int]]]:
    """The greedy placement (``held``: intervals [a, b) of document d per rank), evened out when its busiest
    rank is more than ``tol`` over the mean, by re-cutting a document two ranks share (``recut``): work
    moves, token counts stay, no new document spans the two ranks. See Note [Document placement]. Interval
    arithmetic throughout (a document is a few runs), at most ``max_cuts * world`` re-cuts."""
    world = len(held)

    def work(ivs: list[tuple[int, int]]) -> int:  # kept pairs of the queries at these offsets of a document
        return sum(_prefix_cost(hi, lefts) - _prefix_cost(lo, lefts) for lo, hi in ivs)

    spans: dict[int, set[int]] = {}
    for r, ivs in enumerate(held):
        for _, _, d in ivs:
            spans.setdefault(d, set()).add(r)
    split = {d for d, ranks in spans.items() if len(ranks) > 1}
    mine: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(world)]  # rank -> split doc -> offsets
    load = [0] * world
    for r, ivs in enumerate(held):
        for a, b, d in ivs:
            load[r] += _prefix_cost(b - starts[d], lefts) - _prefix_cost(a - starts[d], lefts)
            if d in split:
                mine[r][d] = _union(mine[r].get(d, []), [(a - starts[d], b - starts[d])])
    mean = sum(load) / world
    if max(load) <= mean * (1 + tol):
        return held

    def window_work(union: list[tuple[int, int]], pre: list[int], i: int, n: int) -> int:
        """Work of tokens [i, i + n) of ``union`` (``pre``: the work before each of its intervals)."""
        (j0, o0), (j1, o1) = _offset(union, i), _offset(union, i + n)
        at = lambda j, o: pre[j] + (_prefix_cost(o, lefts) - _prefix_cost(union[j][0], lefts) if j < len(union) else 0)  # noqa: E731
        return at(j1, o1) - at(j0, o0)

    def recut(a: int, b: int):
        """The best re-cut from busier ``a`` to ``b``: (the pair's new max, document, a's new intervals, b's,
        work moved) or None. The two ranks' tokens of a document they share, U (sorted), are cut again: ``a``
        keeps as many as it had, a window U[i : i + n] (work grows with i), ``b`` the rest -- so repeated
        re-cuts never fragment a document into more than a few runs."""
        gap, best = load[a] - load[b], None
        for d in mine[a].keys() & mine[b].keys():
            union = _union(mine[a][d], mine[b][d])
            pre = [0]
            for lo, hi in union:
                pre.append(pre[-1] + _prefix_cost(hi, lefts) - _prefix_cost(lo, lefts))
            n = sum(hi - lo for lo, hi in mine[a][d])
            have = work(mine[a][d])
            want = have - gap / 2  # a's work in d that evens the pair
            lo_i, hi_i = 0, sum(hi - lo for lo, hi in union) - n  # the smallest i whose window reaches it
            while lo_i < hi_i:
                mid = (lo_i + hi_i) // 2
                if window_work(union, pre, mid, n) >= want:
                    hi_i = mid
                else:
                    lo_i = mid + 1
            for i in {max(0, lo_i - 1), lo_i}:
                moved = have - window_work(union, pre, i, n)
                top = max(load[a] - moved, load[b] + moved)
                if moved > 0 and top < load[a] and (best is None or top < best[0]):
                    best = (top, d, *_window(union, i, n), moved)
        return best

    for _ in range(max_cuts * world):
        top = max(range(world), key=lambda r: (load[r], -r))
        if load[top] <= mean * (1 + tol / 2):
            break
        # the busiest rank's best re-cut; else (no partner it shares a document with is less busy) the
        # widest pairs that can re-cut, so that work flows towards the busiest rank's partners first
        pairs = [(top, b) for b in sorted(range(world), key=lambda r: load[r])]
        pairs += sorted(((a, b) for a in range(world) for b in range(world) if load[a] > load[b] and mine[a].keys()
                         & mine[b].keys()), key=lambda ab: load[ab[1]] - load[ab[0]])[: 4 * world]
        for a, b in pairs:
            if a != b and load[a] > load[b] and (found := recut(a, b)) is not None:
                break
        else:
            break
        _, d, mine[a][d], mine[b][d], moved = found
        load[a] -= moved
        load[b] += moved
    out = []
    for r in range(world):
        ivs = [iv for iv in held[r] if iv[2] not in split]
        for d, offs in mine[r].items():
            ivs += [(starts[d] + x, starts[d] + y, d) for x, y in offs if y > x]
        out.append(ivs)
    return out


def _cut(start: int, lo: int, hi: int, room: int, budget: float, rho: float, cost: int, lefts, *, last: bool):
    """(h, t): the piece of the rest [lo, hi) of a document that a rank with ``room`` tokens and ``budget``
    effective work left takes -- h head tokens and t - h tail ones. See Note [Document placement]."""
    rest = hi - lo
    # about as many ranks as the work needs: a piece of rest / k tokens, k >= 2
    k = max(2, math.ceil((cost - rho * rest) / max(budget, 1.0)))
    t = rest if last else min(room, -(-rest // k))
    if t == rest and not last and rest > 1:
        t = rest - 1
    t = max(1, t)
    a, b = 0, t  # smallest h whose piece fits the budget (its cost falls as h grows)
    while a < b:
        mid = (a + b) // 2
        if _piece_cost(start, lo, hi, mid, t, lefts) - rho * t <= budget:
            b = mid
        else:
            a = mid + 1
    if a == t and not last and _piece_cost(start, lo, hi, t, t, lefts) - rho * t > budget:
        # even all head passes the budget: fewer head tokens, leaving the room to cheaper ones
        a2, b2 = 1, t
        while a2 < b2:
            mid = (a2 + b2 + 1) // 2
            if _piece_cost(start, lo, hi, mid, mid, lefts) - rho * mid <= budget:
                a2 = mid
            else:
                b2 = mid - 1
        return a2, a2
    return a, t


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
