"""The document placement's last pass (Note [Document placement] in doc_plan.py): the busiest ranks evened
out by re-cutting a document two of them share (``rebalance``), where a token's work is a large share of a
rank's (rows of a few tokens per rank). Pure integer math, no torch.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable

__all__ = ["rebalance"]

Intervals = list[tuple[int, int]]


def _union(x: Intervals, y: Intervals) -> Intervals:
    """The union of two disjoint sorted interval lists, sorted, touching intervals joined."""
    out: list[list[int]] = []
    for lo, hi in sorted(x + y):
        if out and out[-1][1] == lo:
            out[-1][1] = hi
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _window(ivs: Intervals, i: int, n: int) -> tuple[Intervals, Intervals]:
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


def _prefix(union: Intervals, cum: list[int], pre: list[int], x: int, f: Callable[[int], int]) -> int:
    """The work of the first ``x`` tokens of ``union`` (``cum``, ``pre``: the tokens and the work before each
    of its intervals)."""
    j = min(bisect_right(cum, x) - 1, len(union) - 1)
    lo = union[j][0]
    return pre[j] + f(lo + x - cum[j]) - f(lo)


def rebalance(load: list[int], mine: list[dict[int, Intervals]], f: Callable[[int], int], *, tol: float,
              max_cuts: int = 8, quadratic: bool = False) -> None:
    """Even out the placement in place when its busiest rank is more than ``tol`` over the mean, by re-cutting
    a document two ranks share (``recut``): work moves, token counts stay, no new document spans the two
    ranks. ``load``: each rank's work; ``mine[r][d]``: rank r's offsets in shared document d (sorted
    intervals); ``f``: the prefix cost (``quadratic``: it is x (x + 1) / 2, one global layer's). See Note [Document placement]. Interval arithmetic throughout (a
    document is a few runs), at most ``max_cuts * world`` re-cuts."""
    world = len(load)
    mean = sum(load) / world
    if max(load) <= mean * (1 + tol):
        return

    def work(ivs: Intervals) -> int:  # kept pairs of the queries at these offsets of a document
        return sum(f(hi) - f(lo) for lo, hi in ivs)

    # a rank's shared documents never change here, only its tokens of them: the pairs' common documents once,
    # and what a pair can move in each, kept while neither rank's tokens of it change (keyed on the lists)
    common = {(a, b): list(mine[a].keys() & mine[b].keys()) for a in range(world) for b in range(world) if a != b}
    partners = [[b for b in range(world) if common.get((a, b))] for a in range(world)]
    cache: dict[tuple[int, int, int], tuple] = {}

    def movable_docs(a: int, b: int):
        """(d, U: the union of a's and b's tokens of d, a's count n, a's work, the count and the work before
        each interval of U) of the documents a shares with b whose cheapest n tokens of U are cheaper than
        a's own (else no window moves work to b)."""
        for d in common[(a, b)]:
            x, y = mine[a][d], mine[b][d]
            hit = cache.get((a, b, d))
            if hit is None or hit[0] is not x or hit[1] is not y:
                union = _union(x, y)
                cum, pre = [0], [0]
                for lo, hi in union:
                    cum.append(cum[-1] + hi - lo)
                    pre.append(pre[-1] + f(hi) - f(lo))
                n, have = sum(hi - lo for lo, hi in x), work(x)
                got = (d, union, n, have, cum, pre) if _prefix(union, cum, pre, n, f) < have else None
                cache[(a, b, d)] = hit = (x, y, got)
            if hit[2] is not None:
                yield hit[2]

    def recut(a: int, b: int):
        """The best re-cut from busier ``a`` to ``b``: (the pair's new max, document, a's new intervals, b's,
        work moved) or None. The two ranks' tokens of a document they share, U (sorted), are cut again: ``a``
        keeps as many as it had, a window U[i : i + n] (work grows with i), ``b`` the rest -- so repeated
        re-cuts never fragment a document into more than a few runs."""
        gap, best = load[a] - load[b], None
        for d, union, n, have, cum, pre in movable_docs(a, b):
            want = have - gap / 2  # a's work in d that evens the pair
            lo_i, hi_i = 0, cum[-1] - n  # the smallest i whose window reaches it (window work grows with i)
            if quadratic and len(union) == 1:  # one run [u, ..): its window's work n (u + i) + n (n + 1) / 2 is
                u = union[0][0]  # linear in i: solved, then stepped onto the exact answer
                lo_i = min(max(0, math.ceil((want - n * (n + 1) / 2) / n) - u), hi_i)
                while lo_i > 0 and f(u + lo_i - 1 + n) - f(u + lo_i - 1) >= want:
                    lo_i -= 1
                while lo_i < hi_i and f(u + lo_i + n) - f(u + lo_i) < want:
                    lo_i += 1
                hi_i = lo_i
            while lo_i < hi_i:
                mid = (lo_i + hi_i) // 2
                if _prefix(union, cum, pre, mid + n, f) - _prefix(union, cum, pre, mid, f) >= want:
                    hi_i = mid
                else:
                    lo_i = mid + 1
            for i in {max(0, lo_i - 1), lo_i}:
                moved = have - (_prefix(union, cum, pre, i + n, f) - _prefix(union, cum, pre, i, f))
                top = max(load[a] - moved, load[b] + moved)
                if moved > 0 and top < load[a] and (best is None or top < best[0]):
                    best = (top, d, *_window(union, i, n), moved)
        return best

    def wide_pairs():  # the widest pairs that can re-cut: only built when the busiest rank's own ones fail
        return sorted(((a, b) for a in range(world) for b in range(world) if load[a] > load[b] and common[(a, b)]),
                      key=lambda ab: load[ab[1]] - load[ab[0]])[: 4 * world]

    for _ in range(max_cuts * world):
        top = max(range(world), key=lambda r: (load[r], -r))
        if load[top] <= mean * (1 + tol / 2):
            break
        # the busiest rank's best re-cut; else (no partner it shares a document with is less busy) the
        # widest pairs that can re-cut, so that work flows towards the busiest rank's partners first
        found = None
        for b in sorted(partners[top], key=lambda r: load[r]):  # a rank it shares nothing with moves nothing
            if load[top] > load[b] and (found := recut(top, b)) is not None:
                a = top
                break
        else:
            for a, b in wide_pairs():
                if a != b and load[a] > load[b] and (found := recut(a, b)) is not None:
                    break
        if found is None:
            break
        _, d, mine[a][d], mine[b][d], moved = found
        load[a] -= moved
        load[b] += moved
