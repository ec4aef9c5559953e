"""DeepSeek Sparse Attention under CP: each query's index row of CP=1's length (hf/sparse.py's step 1 when a
dynamic plan lays rows end to end or the Trainer padded the rows).

Note [DSA rows of CP=1's length]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
CP=1 scores a query against its own row of keys, and ``topk`` breaks ties -- index scores ReLU makes exactly 0,
frequent with few index heads -- by its own rule over the whole row, masked entries included: the same
documents in a longer row can pick other keys among the tied ones (a tiny model at CP=1 alone: the same rows
scored as [4, 24] and as [1, 96] differ by 7e-2 in the logits). Two things give a CP row another length:

- a dynamic plan (``shard_batch(..., dynamic=True)``, the Trainer's ``dynamic=True``: Note [One plan over the
  grid] in core/dynamic.py) lays every dp rank's rows end to end as one row of ``dp * B * L`` and places it
  over the dp x cp grid (the model runs over the flattened mesh with it; steps 1-3 serve it as any plan);
  the plan carries the rows' length ``L`` (``DocumentLayout.row_len``);
- the Trainer's collators pad each row's tail to the layout's unit (and, dynamic, to the grid's longest row):
  the rows CP=1 -- the plain Trainer -- never sees. Which tokens are that padding the Trainer tells the model
  (``state.real``); one all-gather puts it in global order and gives each row's length before it.

So when either applies, ``by_rows`` scores each query over its own row only, cut to that row's length: the
family's indexer runs once per row length on this rank's queries grouped by row ([rows, queries, length]),
the index keys exchanged once (step 1) -- inside that call when the rank's rows have one length (the static
Trainer's padding), else before, from a first call that only computes them (rows of several lengths: a
dynamic batch, whose replicas' rows differ) -- and the picks go back to global positions. Each query's index row is then
CP=1's, value for value, so ``topk`` picks CP=1's keys, ties included. A CP padding token's own picks come
from the cut row (nothing attends to it and its labels are ignored). A row shorter than ``index_topk`` gets
fewer picks (its length, as at CP=1); beside longer rows on the same rank its remaining picks point at a
column the query cannot see, so they are masked and never sent.

Note [The DSA indexer in query tiles]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The family's indexer scores its queries against every key of their rows at once: ``index_n_heads`` ReLU'd
dot products a (query, key), [B, S, index_n_heads, N] fp32 -- a rank's 4096 queries against N = 16k keys
with DeepSeek-V3.2's 64 index heads are 17 GB (and the ReLU's copy as much again). It runs without
gradients, so nothing is kept, but the peak is that tensor. ``index_tiles`` calls the same indexer on
tiles of the queries instead, each tile's scores at most ``_INDEX_SCORES`` numbers (B * S_tile *
index_n_heads * N; one query a tile at the least; by_rows' groups: their rows x a tile of their columns);
when the whole call fits, it is the one call it always was (nothing changes at small sizes).

Tiled, the index keys are still exchanged once a layer: a first call on all the queries with a
one-column mask only computes the keys (``_Keys()``: it hands back their first column, so that call's
scores are [B, S, heads, 1]; its index queries, S * heads * ``index_head_dim`` numbers, are the largest
thing it builds); the ``cache`` given -- hf/sparse.py's all_to_all, a prefill's, a sharded turn's
all-gather, by_rows' regrouping -- gets them once, as the untiled call would have given them; every
tile then reads the exchanged keys (``_Keys(keys)``). A query's picks depend on its own row only -- its
index query, the keys, its mask row -- and ``topk`` runs row by row over the same length N, so a tile
picks what the whole call picks, ties included (index scores ReLU makes exactly 0: tests/hf/test_hf_dsa.py
checks an all-ties model against CP=1 with the bound forced to one query).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["by_rows", "index_tiles", "row_lengths"]

_INDEX_SCORES = 2**26  # the most index scores one indexer call builds ([B, S_tile, index_n_heads, N] fp32)


def row_lengths(state, order: Tensor, planned: bool, bsz: int, s: int, gather_rows) -> tuple[int, Tensor]:
    """(L, lens): the rows each query is scored in -- ``L`` tokens each, a dynamic plan's rows laid end to end
    (``row_len``) or the batch's rows -- and each row's tokens before CP's own padding (the Trainer's ``real``: a
    row's tail; one all-gather, ``gather_rows`` of hf/sparse.py), [B * N / L]. See Note [DSA rows of CP=1's length]."""
    world, n = state.mesh.size(), order.shape[1]
    seg = getattr(state.plan, "row_len", 0) if planned else 0
    seg = seg if 0 < seg < n and n % seg == 0 else n
    if state.real is None and seg == n:  # the Trainer's static collator pads every rank's rows or none
        return seg, torch.full((bsz * n // seg,), seg, dtype=torch.long, device=order.device)
    # a dynamic batch's real mask is None on a rank without CP padding: gather on every rank alike
    real = torch.ones(bsz, s, dtype=torch.bool) if state.real is None else state.real.to(order.device).bool()
    real = gather_rows(state.mesh.get_group(), world, (real if real.dim() == 2 else real[None]).expand(bsz, s), order)
    return seg, real.view(-1, seg).sum(1).clamp_(min=1)  # [B * N / L]


class _Keys:
    """The indexer's ``cache`` in :func:`by_rows`: with ``keys`` [R', L', D], hands them back; with ``keys=None``
    keeps the keys the indexer computed (``got``) and hands back their first column (a call that only computes
    them); with ``exchange`` = (cache, slots, filled, rows, seg, length, B, S), puts the computed keys
    [R', M, D] back in this rank's order, exchanges them (``cache``: hf/sparse.py's) and hands back the
    group's rows cut to ``length``."""

    def __init__(self, keys: Tensor | None = None, exchange: tuple | None = None):
        self.keys, self.exchange, self.got = keys, exchange, None

    def update_indexer(self, k: Tensor, layer_idx: int) -> Tensor:
        if self.exchange is not None:
            cache, slots, filled, rows, seg, length, bsz, s = self.exchange
            mine = k.new_zeros(bsz * s, k.shape[-1])
            mine[slots[filled]] = k[filled]
            every = cache.update_indexer(mine.view(bsz, s, -1), layer_idx)  # [B, N, D] in global order
            return every.reshape(-1, seg, k.shape[-1])[rows, :length]
        if self.keys is None:
            self.got = k
            return k[:, :1]
        return self.keys


def _exchanged_keys(indexer: nn.Module, hidden: Tensor, q_resid: Tensor, position_embeddings, mask: Tensor,
                    position_ids: Tensor, cache) -> Tensor:
    """The index keys ``cache`` hands back for the queries' keys, computed by a call of the ``indexer`` with a
    one-column mask (``_Keys()`` keeps them), so that ``cache.update_indexer`` -- the exchange -- runs once."""
    grab = _Keys()
    indexer(hidden, q_resid, position_embeddings, mask[..., :1], position_ids, cache=grab)
    return cache.update_indexer(grab.got, indexer.layer_idx)


def by_rows(indexer: nn.Module, seg: int, lens: Tensor, mine: Tensor, hidden: Tensor, q_resid: Tensor,
            position_embeddings, scored: Tensor, position_ids: Tensor, cache) -> Tensor:
    """The indexer's picks [B, S, K] (global positions) for this rank's queries ``mine`` [B, S], each query scored
    over its own row of keys only, cut to that row's length (``lens``): the rows of ``seg`` tokens a plan's row
    lays end to end (``seg`` = N: the batch's rows), ``lens`` [B * N / seg] each row's tokens before CP's padding.
    ``scored`` [B, S, N]: the mask. See Note [DSA rows of CP=1's length]."""
    bsz, s = mine.shape
    n, dev = scored.shape[-1], mine.device
    row = (torch.arange(bsz, device=dev)[:, None] * (n // seg) + mine // seg).reshape(-1)  # [B * S]: each query's row
    base = (mine // seg * seg).reshape(-1)  # [B * S]: where its row starts in its mask row
    lengths = torch.unique(lens[row]).tolist()
    every = None  # one length on this rank: the one call exchanges the keys; several: a call that computes them first
    if len(lengths) > 1:  # (either way one exchange a rank, the collective every rank calls once)
        every = _exchanged_keys(indexer, hidden, q_resid, position_embeddings, scored, position_ids, cache)
        every = every.reshape(-1, seg, every.shape[-1])  # [R, L, D]: row r = b * N / seg + g // seg
    cos, sin = position_embeddings
    flat = [x.expand(bsz, s, *x.shape[2:]).reshape(bsz * s, *x.shape[2:])
            for x in (hidden, q_resid, cos, sin, position_ids, scored)]
    width = min(int(indexer.index_topk), max(lengths))  # a row shorter than index_topk: fewer picks at CP=1
    out = mine.new_zeros(bsz * s, width)
    if min(lengths) < width:  # its padded picks point at a column the query cannot see (masked, never sent)
        unseen = ~flat[-1] if flat[-1].dtype == torch.bool else flat[-1] != 0  # [B * S, N]
        out[:] = unseen.to(torch.uint8).argmax(-1, keepdim=True)
    for length in lengths:  # one call a row length (no collective inside: the groups differ by rank)
        sel = torch.nonzero(lens[row] == length)[:, 0]  # [Q]: this group's queries
        rows, inv, counts = torch.unique(row[sel], return_inverse=True, return_counts=True)  # its rows
        by = torch.argsort(inv, stable=True)
        col = torch.arange(sel.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[inv[by]]
        grid = torch.zeros(rows.numel(), int(counts.max()), dtype=torch.long, device=dev)  # [R', M]: queries
        filled = torch.zeros(grid.shape, dtype=torch.bool, device=dev)
        grid[inv[by], col], filled[inv[by], col] = sel[by], True
        h, qr, c, sn, pos, mask = (x[grid] for x in flat)
        mask = mask.gather(-1, base[grid][..., None] + torch.arange(length, device=dev))  # [R', M, length]
        if mask.dtype == torch.bool:  # a group's padding slots see nothing (their picks are dropped)
            mask = mask & filled[..., None]
        keys = _Keys(exchange=(cache, grid, filled, rows, seg, length, bsz, s)) if every is None else _Keys(
            every[rows, :length])
        picks = index_tiles(indexer, h, qr, (c, sn), mask, pos, keys)  # [R', M, K]: positions in the row
        out[grid[filled], :picks.shape[-1]] = (picks + base[grid][..., None].to(picks.dtype))[filled].to(out.dtype)
    return out.view(bsz, s, -1)


def index_tiles(indexer: nn.Module, hidden: Tensor, q_resid: Tensor, position_embeddings, mask: Tensor,
                position_ids: Tensor, cache) -> Tensor:
    """The family's ``indexer`` picks [B, S, K] for queries ``hidden`` [B, S, hidden] against the keys ``cache``
    hands back ([B, N, D]), on tiles of the queries whose scores fit ``_INDEX_SCORES``; ``cache.update_indexer`` is
    called once either way. ``mask`` [B, S, N]: bool or additive. See Note [The DSA indexer in query tiles]."""
    bsz, s = hidden.shape[:2]
    step = max(1, _INDEX_SCORES // max(1, bsz * int(indexer.n_heads) * mask.shape[-1]))
    if step >= s:  # it fits: the one call
        return indexer(hidden, q_resid, position_embeddings, mask, position_ids, cache=cache)
    if not (isinstance(cache, _Keys) and cache.keys is not None):  # the keys computed once, exchanged once
        cache = _Keys(_exchanged_keys(indexer, hidden, q_resid, position_embeddings, mask, position_ids, cache))
    cos, sin = position_embeddings
    tile = lambda x, lo: x if x.shape[1] == 1 else x[:, lo:lo + step]  # noqa: E731  a broadcast query axis stays
    return torch.cat([indexer(hidden[:, lo:lo + step], tile(q_resid, lo), (tile(cos, lo), tile(sin, lo)),
                              tile(mask, lo), tile(position_ids, lo), cache=cache) for lo in range(0, s, step)], 1)
