"""The document layout: a per-batch placement of packed documents on the CP ranks, and its byte formula.

Pure integer math; importing this module does not import torch (``cp-dtensor plan`` and the benchmark use
it without torch). :func:`plan_row` places one row; :class:`DocumentLayout` (built by
``cp_dtensor.document_layout``) holds the placement of a whole ``[B, N]`` batch and is accepted wherever a
layout name is (``local_positions``, ``shard_tensor`` / ``unshard_tensor``, ``shard_batch`` /
``unshard_batch``, ``ring_attention(..., layout=lay)``); its methods import torch when called.

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
mean), so a last pass evens it out (``_rebalance``): the busiest rank swaps equally many tokens of a
document it shares with a less busy one -- its latest queries of it for the other's earliest -- which
moves work and keeps every token count, and adds no document between the two; swaps repeat until the
busiest rank is within ``tol / 2`` of the mean or no swap helps; only when the greedy's busiest rank is
over ``tol`` (its byte-lean placement stands otherwise). A rank's local order is increasing global position, as in every layout, so the local
causal mask is the global one and ``shard_tensor`` is one gather.

Note [Document exchange bytes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Rank r's queries need the key at position j, held by another rank, iff some query i of r's in j's
document keeps it: ``lo <= j - i <= hi`` (causal: hi = 0; a window: lo = -left). Those rows, and only
those, travel from their holder straight to r, once (all-to-all-v): ``needed_rows`` counts them. The
striped ring sends (P - 1) * S rows per rank whatever the documents.

Note [One plan per batch]
~~~~~~~~~~~~~~~~~~~~~~~~~
A batch's documents are derived once, from the *full* batch, before it is sharded: ``full_document_ids``
(document ids, or position ids restarting at 0) and ``plan_batch`` (the ``DocumentLayout`` of those ids in
the door's layout). Every door builds this one object -- ``apply_context_parallel`` (own models and
Hugging Face), ``with_context_parallel``'s collator, ``context_parallel``, torchtitan -- shards the batch
with it, and passes it as the ``layout`` of every attention call of that forward: layer after layer
reuses it (and its cached exchange plans). ``layout="documents"`` places the documents themselves; a
layout name keeps that layout's order and the plan carries the ids the ring masks by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._deprecated import old_keywords

if TYPE_CHECKING:
    import torch

__all__ = ["DocumentLayout", "document_layout", "full_document_ids", "plan_batch", "plan_row", "row_balance", "rank_work", "needed_rows", "lengths_of", "window_lefts"]

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
    held = _rebalance(held, starts, lefts, tol=tol)
    out = []
    for r in range(world):
        pos = [p for a, b, _ in sorted(held[r]) for p in range(a, b)]
        assert len(pos) == s, (r, len(pos), s)
        out.append(pos)
    return out


def _rebalance(held: list[list[tuple[int, int, int]]], starts: list[int], lefts, *, tol: float, max_swaps: int = 64) -> list[list[tuple[int, int, int]]]:
    """The greedy placement (``held``: intervals [a, b) of document d per rank), evened out when its busiest
    rank is more than ``tol`` over the mean, by swaps of equally many tokens *inside* a document two ranks
    share: the busier rank gives its latest queries of it and takes the other's earliest (a query's work
    grows with its offset) -- work moves, token counts stay, no new document spans the two ranks. See
    Note [Document placement]."""
    world = len(held)

    def cost(o: int) -> int:  # one query's kept pairs at offset o of its document, summed over the layers
        return sum(o + 1 if left is None else min(o + 1, left + 1) for left in lefts)

    spans: dict[int, set[int]] = {}
    for r, ivs in enumerate(held):
        for _, _, d in ivs:
            spans.setdefault(d, set()).add(r)
    split = {d for d, ranks in spans.items() if len(ranks) > 1}
    mine: list[dict[int, list[int]]] = [{} for _ in range(world)]  # rank -> split document -> sorted offsets
    load = [0] * world
    for r, ivs in enumerate(held):
        for a, b, d in ivs:
            load[r] += _prefix_cost(b - starts[d], lefts) - _prefix_cost(a - starts[d], lefts)
            if d in split:
                mine[r].setdefault(d, []).extend(range(a - starts[d], b - starts[d]))
    mean = sum(load) / world
    if max(load) <= mean * (1 + tol):
        return held
    for offs in (o for m in mine for o in m.values()):
        offs.sort()

    def swap(a: int, b: int):
        """The best swap from busier ``a`` to ``b``: (the pair's new max, document, k, work moved) or None."""
        gap, best = load[a] - load[b], None
        for d in mine[a].keys() & mine[b].keys():
            give, take = mine[a][d][::-1], mine[b][d]  # a's latest first, b's earliest first
            moved, k = 0, 0
            for hi, lo in zip(give, take):
                step = cost(hi) - cost(lo)
                if step <= 0 or 2 * (moved + step) > gap + step:  # past the middle, or nothing to gain
                    break
                moved += step
                k += 1
            if k and (best is None or max(load[a] - moved, load[b] + moved) < best[0]):
                best = (max(load[a] - moved, load[b] + moved), d, k, moved)
        return best

    for _ in range(max_swaps * world):
        top = max(range(world), key=lambda r: (load[r], -r))
        if load[top] <= mean * (1 + tol / 2):
            break
        # the busiest rank's best swap; else (no partner it shares a document with is less busy) the
        # widest pair that can swap, so that work flows towards the busiest rank's partners first
        pairs = [(top, b) for b in sorted(range(world), key=lambda r: load[r])]
        pairs += sorted(((a, b) for a in range(world) for b in range(world) if load[a] > load[b]),
                        key=lambda ab: load[ab[1]] - load[ab[0]])
        for a, b in pairs:
            if a != b and load[a] > load[b] and (found := swap(a, b)) is not None:
                break
        else:
            break
        _, d, k, moved = found
        give, take = mine[a][d][len(mine[a][d]) - k:], mine[b][d][:k]
        mine[a][d] = sorted(mine[a][d][: len(mine[a][d]) - k] + take)
        mine[b][d] = sorted(mine[b][d][k:] + give)
        load[a] -= moved
        load[b] += moved
    out = []
    for r in range(world):
        ivs = [iv for iv in held[r] if iv[2] not in split]
        for d, offs in mine[r].items():
            ivs += [(starts[d] + x, starts[d] + y, d) for x, y in _intervals(offs)]
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


@dataclass(frozen=True, eq=False)
class DocumentLayout:
    """A batch's document placement (``cp_dtensor.document_layout``): row b's global position at local
    slot i of rank r is ``order[b][r * S + i]``. Frozen; one per batch, reused by every layer."""

    world: int  #: the CP degree it was built for
    seq_len: int  #: N, the full row length
    order: Any  #: int64 [B, N] tensor: every rank's positions, rank-major (``global_order``'s analogue)
    ids: Any  #: int64 [B, N] tensor: the document ids it was built from
    windows: tuple[int | None, ...] = (None,)  #: the layers' left reaches its balance counts
    key: int = 0  #: a fingerprint of (order, ids): equal layouts on every rank agree on it
    placement: str = "documents"  #: "documents" (this module's plan) or a layout name kept with the ids
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch(self) -> int:
        return self.order.shape[0]

    @property
    def s_local(self) -> int:
        return self.seq_len // self.world

    def local_positions(self, rank: int, world: int, seq_len: int) -> torch.Tensor:
        """int64 [B, N / world]: the global positions ``rank`` holds of each row, in local order."""
        self.check(world, seq_len)
        s = self.s_local
        return self.order[:, rank * s : (rank + 1) * s]

    def check(self, world: int, seq_len: int) -> None:
        if world != self.world or seq_len != self.seq_len:
            raise ValueError(f"this document layout was built for {self.world} ranks and rows of {self.seq_len} "
                             f"tokens; got {world} ranks and {seq_len} tokens. Build one per batch with "
                             f"cp_dtensor.document_layout(document_ids, world).")

    def __repr__(self) -> str:
        return (f"DocumentLayout(placement={self.placement!r}, world={self.world}, batch={self.batch}, "
                f"seq_len={self.seq_len}, key={self.key:#x})")

    # --- torch side (imports torch when called) ---

    def shard(self, x: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
        """Rank ``rank``'s shard of ``x`` along ``dim`` (dim 0 is the batch, of B rows, or absent for B = 1)."""
        self.check(world, x.shape[dim])
        idx = self.local_positions(rank, world, x.shape[dim]).to(x.device)  # [B, S]
        return _gather(x, dim, idx, self.batch)

    def unshard(self, shards: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The full tensor from every rank's shard (rank order): the inverse of :meth:`shard`."""
        import torch

        self.check(len(shards), shards[0].shape[dim] * len(shards))
        cat = torch.cat(shards, dim=dim)
        inv = torch.argsort(self.order, dim=1).to(cat.device)  # [B, N]: full position -> rank-major slot
        return _gather(cat, dim, inv, self.batch)

    def local_ids(self, rank: int) -> torch.Tensor:
        """int64 [B, S]: the document ids of the tokens ``rank`` holds."""
        return self.ids.gather(1, self.local_positions(rank, self.world, self.seq_len))


def _gather(x, dim: int, idx, batch: int):
    """x.gather along ``dim`` with a per-row index ``idx`` [B, M] (x's dim 0 the batch; 1-D x for B = 1)."""
    import torch

    from .layout import wrap_dim

    dim = wrap_dim(dim, x.dim())
    if x.dim() == 1 or dim == 0:
        if batch != 1:
            raise ValueError(f"a document layout of {batch} rows shards tensors [B, ..., N, ...] along a dim after "
                             f"the batch; got shape {tuple(x.shape)} with seq_dim={dim}.")
        return x.index_select(dim, idx[0])
    if x.shape[0] != batch:
        raise ValueError(f"this document layout was built for a batch of {batch} rows; got a tensor of shape "
                         f"{tuple(x.shape)} (dim 0 is the batch). Build the layout from this batch's document ids.")
    shape = [batch] + [1] * (x.dim() - 1)
    shape[dim] = idx.shape[1]
    index = idx.view(shape).expand(*[s if i != dim else idx.shape[1] for i, s in enumerate(x.shape)])
    return torch.gather(x, dim, index.contiguous())


PLACEMENTS = ("documents", "striped", "headtail", "contiguous")


@old_keywords("cp_dtensor.document_layout", world="cp_size")
def document_layout(document_ids, cp_size: int, *, windows: Any = None, placement: str = "documents") -> DocumentLayout:
    """The per-batch plan of packed documents on ``cp_size`` CP ranks (Note [Document placement]).

    ``document_ids``: the full int ``[B, N]`` batch (the same on every rank), never decreasing along a row
    (e.g. a cumulative count of document starts); ``windows``: the model's attention layers' window_size
    (None, an int left reach or a (left, right) pair each; default one global layer), so that the balance
    counts every layer's kept pairs. ``placement``: "documents" (short documents whole on a rank, long ones
    in head-tail pieces; the default) or a layout name ("striped", "headtail", "contiguous": that layout's
    order, the plan then only carries the ids for the ring).

    Returns a frozen :class:`DocumentLayout`, usable wherever a layout name is:
    ``local_positions(layout=lay, rank=r, cp_size=P, seq_len=N)`` -> int64 [B, N / P], ``shard_tensor`` /
    ``unshard_tensor``, ``shard_batch`` / ``unshard_batch`` and ``ring_attention(q, k, v, layout=lay, ...)``
    (``document_ids`` optional there: the plan carries them). Build it once per batch; every layer reuses
    it. No communication (the ring's agreement checks that every rank's is equal)."""
    import zlib

    import torch

    world = cp_size
    if not isinstance(document_ids, torch.Tensor) or document_ids.dim() != 2 or document_ids.dtype.is_floating_point:
        got = tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
        raise ValueError(f"document_layout takes the full batch's integer document ids [B, N]; got {got}. "
                         "Pass ids.unsqueeze(0) for one row.")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"document_layout needs the CP degree as a positive int; got {world!r}.")
    if placement not in PLACEMENTS:
        raise ValueError(f"document_layout: placement is one of {', '.join(map(repr, PLACEMENTS))}; got {placement!r}.")
    ids = document_ids.detach().to("cpu", torch.int64).contiguous()
    b, n = ids.shape
    if n % world or n == 0:
        raise ValueError(f"document_layout needs the sequence length divisible by the CP degree ({world}); got N = {n}. "
                         f"Pad the batch to a multiple of {world}.")
    bad = torch.nonzero(ids[:, 1:] < ids[:, :-1])
    if bad.numel():
        row, pos = bad[0].tolist()
        raise ValueError(f"document_layout: document_ids must not decrease along a row; row {row} drops at position "
                         f"{pos + 1} ({ids[row, pos].item()} -> {ids[row, pos + 1].item()}). Pass ids that only grow "
                         "(e.g. a cumulative count of document starts).")
    lefts = window_lefts(windows)
    if placement == "documents":
        rows = []
        for r in range(b):
            pos = plan_row(lengths_of(ids[r].tolist()), world, windows=list(lefts))
            rows.append([p for rank_pos in pos for p in rank_pos])
        order = torch.tensor(rows, dtype=torch.int64).view(b, n)
    else:
        from .layout import check_seq_len, global_order

        check_seq_len(placement, world, n)
        order = global_order(placement, world, n).to(torch.int64).expand(b, n).contiguous()
    key = zlib.crc32(ids.numpy().tobytes(), zlib.crc32(order.numpy().tobytes())) ^ (world << 32)
    return DocumentLayout(world=world, seq_len=n, order=order, ids=ids, windows=lefts, key=key, placement=placement)


def full_document_ids(*, document_ids=None, position_ids=None, where: str = "cp_dtensor"):
    """int64 [B, N] document ids of a *full* batch from ``document_ids`` ([N] or [B, N]) or from
    ``position_ids`` that restart at 0 for every document (a document starts at every position 0); None
    when neither is given. The one derivation every door uses (Note [One plan per batch])."""
    if document_ids is not None and position_ids is not None:
        raise ValueError(f"{where}: pass document_ids or position_ids (documents from positions), not both.")
    if position_ids is not None:
        return (position_ids.reshape(-1, position_ids.shape[-1]) == 0).long().cumsum(-1)
    if document_ids is not None:
        return document_ids.reshape(-1, document_ids.shape[-1]).long()
    return None


def plan_batch(layout: Any, cp_size: int, *, document_ids=None, position_ids=None, windows: Any = None,
               where: str = "cp_dtensor"):
    """The batch's plan (Note [One plan per batch]): ``layout`` itself when it is a name and the batch has no
    documents; else ``document_layout`` of the full batch's ids with ``placement=layout`` ("documents"
    builds the document placement; a batch without ids is then one document per row). ``document_ids`` /
    ``position_ids``: the full batch's ([N], [B, N], or [1, N] for every row). An existing
    ``DocumentLayout`` passes through."""
    import torch

    if isinstance(layout, DocumentLayout):
        return layout
    ids = full_document_ids(document_ids=document_ids, position_ids=position_ids, where=where)
    if ids is None:
        if layout != "documents":
            return layout
        raise ValueError(f"{where}: layout='documents' needs the batch's documents: pass document_ids= or "
                         "position_ids= that restart at 0 for every document.")
    return document_layout(ids.to(torch.int64), cp_size, windows=windows, placement=layout)
