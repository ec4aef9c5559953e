"""The document placement's math: where each packed document's tokens go (``plan_row``), the work each
rank's queries do (``rank_work``) and the K/V rows the masks make it receive (``needed_rows``).

Pure integer math, no torch: ``cp-dtensor plan`` and the benchmark use it as it is; documents.py builds the
``DocumentLayout`` of a batch from it.

Note [Document placement]
~~~~~~~~~~~~~~~~~~~~~~~~~
Causal attention inside a document costs ``c(i) = sum over layers of min(i + 1, left + 1)`` kept pairs for
the query at offset i of its document (``left`` unbounded for a global layer), so a document of L tokens
costs ``F(L) = sum_{i < L} c(i)``, closed form (``_prefix_cost``). Every rank must hold exactly S = N / P
tokens of the row (shapes stay equal) and about ``F_total / P`` of the work.

The placement is a greedy pass over the documents, longest first:

* a document that fits whole on a rank -- token room for it and work room within ``1 + tol`` of the
  target -- goes whole to the least loaded such rank: its queries need no K/V from anywhere;
* otherwise the rank with the most work room (the least loaded with token room) takes a *piece* of what is
  left of the document, ``[lo, hi)``: ``h`` tokens from its head and ``t - h`` from its tail, with ``t``
  the rank's token room (or the rest of the document). A piece's work falls as ``h`` grows (head tokens
  are cheap, tail ones dear), so a binary search on ``h`` picks the piece whose work fills the rank's work
  room as closely as it can without passing it (all head when even that passes it: the rank is then
  over, but by the least). A long document so ends in head-tail pieces on as few ranks as its size and
  the balance need (head-tail over all P ranks is the special case of a document that fills the row).

Longest first leaves the short, cheap documents for last, where they fill the token rooms left with
little work. A few large documents leave the greedy coarse (14 documents a row: one rank at 0.81 of the
mean), so a last pass evens it out (``rebalance`` in doc_recut.py): the busiest rank and a less busy one that share a
document cut their tokens of it again -- the busier keeps as many tokens as it had, the window of their
union whose work evens the pair (a query's work grows with its offset), the other the rest. Work moves,
every token count stays, no document is added between the two, and a document stays a few runs however
often it is re-cut (the kernels run once per run pair, so fragments would cost time). Re-cuts repeat until
the busiest rank is within ``tol / 2`` of the mean or none helps; only when the greedy's busiest rank is
over ``tol`` (its byte-lean placement stands otherwise). A rank's local order is increasing global
position, as in every layout, so the local causal mask is the global one and ``shard_tensor`` is one
gather.

Note [Fast document greedy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The greedy above, as first written, looped over every piece and tested every rank for each; where every
rank is over its work budget, ``_cut``'s piece is one head token, so a long document was dealt one token
at a time (27k passes at P = 32, N = 262144: most of a second). ``plan_intervals`` computes the *same*
placement (tests/core/test_doc_plan_fast.py holds the old code and compares) faster:

* the ranks with room sit in a list sorted by (load, rank): the least loaded is its head, and whether
  some rank takes the rest whole is one test on the first rank with the token room (a rank's test only
  passes where a less loaded one's does: float rounding is monotone);
* a run of one-token pieces is dealt without the loop's tests (``_peel_run``) as far as they provably
  hold for every token of the run: a bound below every load the run can meet (each load only moves by the
  dealt tokens' work minus rho, so it stays above the least load plus the run's negative steps), above
  every budget, and the tests are concave in the token index (the rest's work minus rho per token falls
  by a non-decreasing step), so they hold between the run's two ends; margins far above float rounding.
  What is left is a heap of (load, rank): each token to the head;
* only a shared document's token count, work and first token on each rank survive the greedy (what
  ``defragment`` reads); a document one rank holds is one interval;
* the re-cuts (doc_recut.py) keep each pair's union of a document and skip the documents whose cheapest
  window is no cheaper than the busier rank's own tokens (no window moves work); a one-run union under
  one global layer has a window work linear in its start, solved and stepped onto the binary search's
  answer.

Note [Document exchange bytes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank r's queries need the key at position j, held by another rank, iff some query i of r's in j's
document keeps it: ``lo <= j - i <= hi`` (causal: hi = 0; a window: lo = -left). Those rows, and only
those, travel from their holder straight to r, once (all-to-all-v): ``needed_rows`` counts them. The
striped ring sends (P - 1) * S rows per rank whatever the documents.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable
from heapq import heappop, heapreplace
from typing import Any

from .doc_recut import defragment, rebalance

__all__ = ["Window", "lengths_of", "needed_rows", "plan_intervals", "plan_row", "rank_work", "row_balance", "window_lefts"]

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


def _prefix_fn(lefts: tuple[int | None, ...]) -> Callable[[int], int]:
    """``_prefix_cost`` of ``lefts`` as a one-argument function (a closed form for one global layer)."""
    if lefts == (None,):
        return lambda x: x * (x + 1) // 2
    return lambda x: _prefix_cost(x, lefts)


def plan_row(lengths: list[int], world: int, *, windows: Any = None, tol: float = 0.02, sand_share: int = 4,
             small: int = 16) -> list[list[int]]:
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


def plan_intervals(lengths: list[int], world: int, *, windows: Any = None, tol: float = 0.02, sand_share: int = 4,
                   small: int = 16) -> list[list[tuple[int, int]]]:
    """:func:`plan_row` as each rank's sorted intervals ``[a, b)`` of global positions (what
    ``document_layout`` builds its order from without a Python int per token). Note [Fast document greedy]."""
    n = sum(lengths)
    if world < 1 or n % world:
        raise ValueError(f"document_layout needs the row length divisible by the CP degree ({world}); got {n}. "
                         f"Pad the batch to a multiple of {world}.")
    if any(length < 1 for length in lengths):
        raise ValueError(f"document lengths must be positive; got {lengths}.")
    lefts = window_lefts(windows)
    f = _prefix_fn(lefts)
    quadratic = lefts == (None,)

    def piece(start: int, lo: int, hi: int, h: int, t: int) -> int:  # _piece_cost
        return f(lo + h - start) - f(lo - start) + f(hi - start) - f(hi - (t - h) - start)

    s = n // world
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    costs = [f(length) for length in lengths]
    total = sum(costs)
    target = total / world
    thr = target * (1 + tol)
    # the density of the documents that will fill the last token rooms: see Note [Document placement]
    sand = [d for d in range(len(lengths)) if costs[d] * sand_share <= target and lengths[d] * sand_share <= s]
    rho = sum(costs[d] for d in sand) / max(1, sum(lengths[d] for d in sand))
    room = [s] * world
    load = [rho * s] * world  # effective load: the work held plus rho per token of room still to fill
    queue = [(load[r], r) for r in range(world)]  # (load, r) of the ranks with room, sorted
    free = n  # sum(room)
    whole: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # the documents a rank holds alone
    shared = []  # (first rank, order, d, {r: [tokens, work, first position]}) of the documents ranks share
    for i_d, d in enumerate(sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))):
        start = starts[d]
        lo, hi = start, start + lengths[d]
        got: dict[int, list[int]] = {}
        while lo < hi:
            rest = hi - lo
            cost = f(hi - start) - f(lo - start)  # the whole rest
            r = -1
            # the least loaded rank with token room for the rest, if its work room (or smallness) admits it:
            # the loads only pass the bound in queue order (Note [Fast document greedy])
            if queue[0][0] + cost - rho * rest <= thr or cost * small <= target:
                for ld, q in queue:
                    if room[q] >= rest:
                        if ld + cost - rho * rest <= thr or cost * small <= target:
                            r = q
                        break
            if r >= 0:
                h = t = rest
            else:
                ld, r = queue[0]
                budget = target - ld
                t = 0
                if free != room[r]:  # _cut's t, and its answer for one token (the peeling of Note [Fast document greedy])
                    k = max(2, math.ceil((cost - rho * rest) / max(budget, 1.0)))
                    t = min(room[r], -(-rest // k))
                    if t == rest and rest > 1:
                        t = rest - 1
                    t = max(1, t)
                if t == 1:
                    h = 0 if f(hi - start) - f(hi - 1 - start) - rho * t <= budget else 1
                else:
                    h, t = _cut(start, lo, hi, room[r], budget, rho, cost, piece, last=free == room[r])
                if h == t == 1 and (taken := _peel_run(queue, room, load, got, f, start, lo, hi, target=target, thr=thr,
                                                       rho=rho, small=small, quadratic=quadratic)):
                    lo += taken  # a run of head tokens, each to the least loaded rank: Note [Fast document greedy]
                    free -= taken
                    continue
                if h == t == 1:  # rank r peels head tokens while it stays the least loaded: Note [Fast document greedy]
                    nxt = queue[1] if len(queue) > 1 else None
                    ld, rm, first, taken, work = load[r], room[r], lo, 0, 0
                    tail = f(hi - start) - f(hi - 1 - start) - rho
                    while True:  # one token of the loop above, then the loop's tests for the next one
                        w = f(lo + 1 - start) - f(lo - start)
                        ld += w - rho
                        rm -= 1
                        free -= 1
                        lo += 1
                        taken += 1
                        work += w
                        rest = hi - lo
                        if not rest or not rm or free == rm or (nxt is not None and (ld, r) >= nxt):
                            break
                        cost = f(hi - start) - f(lo - start)
                        if ld + cost - rho * rest <= thr or cost * small <= target:
                            break
                        budget = target - ld
                        k = max(2, math.ceil((cost - rho * rest) / max(budget, 1.0)))
                        t = min(rm, -(-rest // k))
                        if t == rest and rest > 1:
                            t = rest - 1
                        if max(1, t) != 1 or tail <= budget:
                            break
                    del queue[0]  # r's entry
                    load[r], room[r] = ld, rm
                    if rm:
                        insort(queue, (ld, r))
                    mine = got.get(r)
                    if mine is None:
                        got[r] = [taken, work, first]
                    else:
                        mine[0] += taken
                        mine[1] += work
                        mine[2] = min(mine[2], first)
                    continue
            work = piece(start, lo, hi, h, t)
            old = load[r]
            load[r] += work - rho * t
            room[r] -= t
            free -= t
            del queue[bisect_left(queue, (old, r))]
            if room[r]:
                insort(queue, (load[r], r))
            first = lo if h else hi - t
            mine = got.get(r)
            if mine is None:
                got[r] = [t, work, first]
            else:
                mine[0] += t
                mine[1] += work
                mine[2] = min(mine[2], first)
            lo, hi = lo + h, hi - (t - h)
        if len(got) == 1:
            whole[next(iter(got))].append((start, start + lengths[d]))
        else:
            shared.append((min(got), i_d, d, got))
    # the greedy's ranks listed the shared documents by first rank, then placement order
    cuts = defragment({d: got for *_, d, got in sorted(shared, key=lambda x: x[:2])}, starts, lengths, piece)
    mine_of: list[dict[int, list[tuple[int, int]]]] = [{} for _ in range(world)]
    for d, by_rank in cuts.items():
        for r, offs in by_rank.items():
            mine_of[r][d] = offs
    doc_at = {start: d for d, start in enumerate(starts)}
    held = [sum(costs[doc_at[a]] for a, _ in whole[r]) + sum(f(y) - f(x) for offs in mine_of[r].values()
                                                             for x, y in offs) for r in range(world)]
    rebalance(held, mine_of, f, tol=tol, quadratic=quadratic)
    out = []
    for r in range(world):
        ivs = list(whole[r])
        for d, offs in mine_of[r].items():
            ivs += [(starts[d] + x, starts[d] + y) for x, y in offs if y > x]
        ivs.sort()
        out.append(ivs)
    return out


def _peel_run(queue: list, room: list[int], load: list[float], got: dict, f, start: int, lo: int, hi: int, *,
              target: float, thr: float, rho: float, small: int, quadratic: bool = False) -> int:
    """The head tokens of the rest [lo, hi) of a document that the greedy deals one at a time to the least
    loaded rank, dealt here without its tests, as far as they provably hold (Note [Fast document greedy]);
    ``queue``: the sorted (load, rank) of the ranks with room, kept sorted; ``quadratic``: ``f`` is one global
    layer's x (x + 1) / 2. Returns the tokens dealt (0: the tests are too close to call; the greedy's loop
    goes on)."""
    low, rest = queue[0][0], hi - lo
    head, end = f(hi - start), f(lo - start)
    tail = head - f(hi - 1 - start) - rho
    a, b = 0, rest  # the cheap head tokens (work under rho: a load falls as it takes one) come first
    while a < b:
        mid = (a + b) // 2
        if f(lo + mid + 1 - start) - f(lo + mid - start) < rho:
            a = mid + 1
        else:
            b = mid
    low += f(lo + a - start) - end - rho * a  # below every load the run can meet
    most = max(target - low, 1.0)  # above every budget the greedy divides by
    if not _above(tail, target - low):
        return 0  # the head token is not always the cheaper one

    def holds(j: int) -> bool:  # the greedy's tests before the j-th token: no rank takes the rest whole, it is
        cost, left = head - f(lo + j - start), rest - j  # not small, and _cut's piece is one token
        return (_above(low + cost - rho * left, thr) and cost * small > target
                and _above((cost - rho * left) / most, left - 1))

    if not holds(0):
        return 0
    a, b = 0, rest - 1  # the last j that holds (the tests are concave in j: they hold between two that do)
    while a < b:
        mid = (a + b + 1) // 2
        if holds(mid):
            a = mid
        else:
            b = mid - 1
    world = len(room)
    count, work, first = [0] * world, [0] * world, [0] * world
    prev = end
    for pos in range(lo, lo + a + 1):
        ld, r = queue[0]
        if quadratic:  # one global layer: a token's work is its offset + 1
            w = pos - start + 1
        else:
            nxt = f(pos + 1 - start)
            w = nxt - prev
            prev = nxt
        ld += w - rho
        if not count[r]:
            first[r] = pos
        count[r] += 1
        work[r] += w
        room[r] -= 1
        if room[r]:
            heapreplace(queue, (ld, r))
        else:
            load[r] = ld
            heappop(queue)
            if len(queue) == 1:  # the next token goes to the last rank with room: the greedy's own case
                break
    for ld, r in queue:
        load[r] = ld
    for r in range(world):
        if count[r]:
            mine = got.get(r)
            if mine is None:
                got[r] = [count[r], work[r], first[r]]
            else:
                mine[0] += count[r]
                mine[1] += work[r]
                mine[2] = min(mine[2], first[r])
    queue.sort()
    return pos + 1 - lo


def _above(x: float, y: float) -> bool:
    """x > y by far more than the rounding of a few float operations on either."""
    return x > y + 1e-9 * (abs(x) + abs(y) + 1.0)


def _cut(start: int, lo: int, hi: int, room: int, budget: float, rho: float, cost: int, piece, *, last: bool):
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
        if piece(start, lo, hi, mid, t) - rho * t <= budget:
            b = mid
        else:
            a = mid + 1
    if a == t and not last and piece(start, lo, hi, t, t) - rho * t > budget:
        # even all head passes the budget: fewer head tokens, leaving the room to cheaper ones
        a2, b2 = 1, t
        while a2 < b2:
            mid = (a2 + b2 + 1) // 2
            if piece(start, lo, hi, mid, mid) - rho * mid <= budget:
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
