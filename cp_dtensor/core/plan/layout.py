"""Sequence layouts: which global positions each CP rank holds, and what each ring step must compute.

Pure index math, no communication. A layout maps a global sequence of N = P * S_local tokens onto
P ranks; the local order on a rank is always increasing global position.

Note [Sequence layouts]
~~~~~~~~~~~~~~~~~~~~~~~
For rank r of P with S = S_local tokens each:

* ``contiguous``: positions [r*S, (r+1)*S). Simple, but causal work is unbalanced: rank P-1 attends
  to everything, rank 0 only to itself.
* ``striped``: positions r, r+P, r+2P, ... (local i is global i*P + r). Every rank sees every part of
  the sequence, so every causal ring step costs about half a block on every rank (Striped Attention,
  Brandon et al. 2023).
* ``headtail``: N split into 2P chunks of c = S/2 tokens; rank r holds chunk r followed by chunk
  2P-1-r. An early chunk paired with a late one balances causal work with contiguous memory runs
  (the layout of torch's and Megatron's CP).

Note [Causal ring steps]
~~~~~~~~~~~~~~~~~~~~~~~~
At ring step t rank r holds the K/V block of rank s = (r - t) mod P. With ``is_causal`` the part of
q_local x k_block that the mask keeps is always one rectangle of rows x columns, either full or with
a causal diagonal, so each step is a single fused-kernel call on slices -- never a full block that is
masked afterwards:

* s == r (every layout): the local block with an ordinary causal mask (diagonal included); local
  order is increasing global order, so the local causal mask is the global one.
* striped, s < r: key j (global j*P+s) is visible to query i (global i*P+r) iff j <= i: causal.
* striped, s > r: visible iff j < i, i.e. q[1:] against k[:-1], causal (the "striped shift").
  Query row 0 receives nothing from this block.
* contiguous, s < r: every key precedes every query: full. s > r: nothing; the step is skipped
  (the block still travels on).
* headtail, s < r: head chunk s precedes both local chunks, tail chunk 2P-1-s follows both:
  all queries against k[:c], full.
* headtail, s > r: head chunk s follows chunk r but precedes chunk 2P-1-r, and tail chunk 2P-1-s
  precedes chunk 2P-1-r: the tail queries q[c:] against all keys, full.

Striped and headtail steps other than the first therefore cost about half a block on every rank.

This module is the one place that states the layout arithmetic every other module uses: the
divisibility rule (``layout_unit`` / ``check_seq_len``), the blocks each step keeps (``step_block``),
their (query, key) pair counts (``step_pairs``) and the bytes of one K/V message (``payload_bytes``,
the wire format of payload.py). Importing it does not import torch: the cost model behind
``cp-dtensor plan`` (tools/plan.py) uses it and starts without torch; the functions that build or cut
tensors import torch when called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._deprecated import old_keywords, seq_dim_argument

if TYPE_CHECKING:
    import torch

__all__ = [
    "LAYOUTS",
    "Block",
    "check_layout",
    "layout_unit",
    "check_seq_len",
    "local_positions",
    "global_order",
    "shard_tensor",
    "unshard_tensor",
    "in_global_order",
    "wrap_dim",
    "step_block",
    "pairs_upto",
    "block_pairs",
    "step_pairs",
    "FP8_SCALE_BYTES",
    "payload_bytes",
]

LAYOUTS = ("striped", "headtail", "contiguous")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; expected one of {', '.join(LAYOUTS)}.")
    return layout


def layout_unit(layout: str, world: int) -> int:
    """The divisibility rule: ``layout`` on ``world`` ranks needs a global sequence length that is a
    multiple of this (headtail: 2 * world, two chunks a rank; otherwise world). Torch-free."""
    return 2 * world if check_layout(layout) == "headtail" else world


def check_seq_len(layout: str, world: int, seq_len: int, *, fix: str | None = None) -> int:
    """S_local = seq_len / world, or the ValueError every entry point raises when ``seq_len`` breaks
    the rule of :func:`layout_unit`; ``fix`` replaces the default advice. Torch-free."""
    unit = layout_unit(layout, world)
    if seq_len % unit != 0:
        fix = fix or f"Pad the sequence to a multiple of {unit} or change the CP degree."
        raise ValueError(
            f"{layout} layout on {world} ranks needs the sequence length divisible by {unit}; got {seq_len}. {fix}"
        )
    return seq_len // world


@old_keywords("cp_dtensor.local_positions", positional=("layout", "rank", "cp_size", "seq_len"), world="cp_size")
def local_positions(*, layout: str, rank: int, cp_size: int, seq_len: int) -> torch.Tensor:
    """Global positions held by ``rank`` of ``cp_size`` CP ranks, in local order. ``seq_len`` is the global
    length N."""
    import torch

    world = cp_size
    if not isinstance(layout, str):  # a DocumentLayout (documents.py): [B, S_local], a permutation per row
        return layout.local_positions(rank, world, seq_len)
    s_local = check_seq_len(layout, world, seq_len)
    if layout == "contiguous":
        return torch.arange(rank * s_local, (rank + 1) * s_local)
    if layout == "striped":
        return torch.arange(rank, seq_len, world)
    c = s_local // 2
    tail = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(tail * c, (tail + 1) * c)])


def global_order(layout: str, world: int, seq_len: int) -> torch.Tensor:
    """Rank-major concatenation of every rank's positions: ``x.index_select(dim, order)`` lays out a
    full tensor so that chunk r of P is rank r's shard; ``argsort(order)`` undoes it."""
    import torch

    return torch.cat([local_positions(layout=layout, rank=r, cp_size=world, seq_len=seq_len) for r in range(world)])


def wrap_dim(dim: int, ndim: int) -> int:
    """``dim`` as a non-negative index of an ``ndim``-D tensor; out of range raises IndexError, as torch does."""
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim % ndim


def in_global_order(every: torch.Tensor, layout: str) -> torch.Tensor:
    """Every rank's shard, gathered rank-major -- [P, L, S_local] -- as [L, P * S_local] in global order."""
    import torch

    world, lead, s = every.shape
    full = torch.empty(lead, world * s, dtype=every.dtype, device=every.device)
    full[:, global_order(layout, world, world * s).to(every.device)] = every.permute(1, 0, 2).reshape(lead, world * s)
    return full


@old_keywords("cp_dtensor.shard_tensor", world="cp_size")
def shard_tensor(x: torch.Tensor, *, seq_dim: int | None = None, layout: str, rank: int, cp_size: int,
                 **deprecated) -> torch.Tensor:
    """Rank ``rank``'s shard (of ``cp_size`` CP ranks) of the full tensor ``x`` along ``seq_dim`` (a copy
    for striped/headtail)."""
    import torch

    world = cp_size
    dim = wrap_dim(seq_dim_argument(seq_dim, deprecated, "cp_dtensor.shard_tensor"), x.dim())
    if not isinstance(layout, str):  # a DocumentLayout: dim 0 is the batch its rows were planned for
        return layout.shard(x, dim, rank, world)
    seq_len = x.shape[dim]
    s_local = check_seq_len(layout, world, seq_len)
    if layout == "contiguous":
        return x.narrow(dim, rank * s_local, s_local)
    if layout == "striped":
        # [.., N, ..] -> [.., S_local, P, ..]; local i is global i*P + r
        return x.unflatten(dim, (s_local, world)).select(dim + 1, rank).contiguous()
    c = s_local // 2
    tail = 2 * world - 1 - rank
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, tail * c, c)], dim=dim)


def unshard_tensor(shards: list[torch.Tensor], *, seq_dim: int | None = None, layout: str,
                   **deprecated) -> torch.Tensor:
    """Inverse of :func:`shard_tensor`: the full tensor from every rank's shard, in rank order."""
    import torch

    dim = wrap_dim(seq_dim_argument(seq_dim, deprecated, "cp_dtensor.unshard_tensor"), shards[0].dim())
    if not isinstance(layout, str):  # a DocumentLayout
        return layout.unshard(shards, dim)
    check_layout(layout)
    if layout == "contiguous":
        return torch.cat(shards, dim=dim)
    if layout == "striped":
        return torch.stack(shards, dim=dim + 1).flatten(dim, dim + 1)
    c = shards[0].shape[dim] // 2
    heads = [s.narrow(dim, 0, c) for s in shards]
    tails = [s.narrow(dim, c, c) for s in shards]
    return torch.cat(heads + tails[::-1], dim=dim)


@dataclass(frozen=True)
class Block:
    """The part of one ring step that the mask keeps: ``q[q_rows]`` against ``k[kv_rows]``, with a
    top-left aligned causal mask when ``causal``. See Note [Causal ring steps]."""

    q_rows: slice
    kv_rows: slice
    causal: bool


_FULL = Block(slice(None), slice(None), False)
_DIAG = Block(slice(None), slice(None), True)


def step_block(layout: str, *, rank: int, src: int, world: int, s_local: int, is_causal: bool) -> Block | None:
    """What rank ``rank`` computes against the K/V block of rank ``src``; None means nothing."""
    if not is_causal:
        return _FULL
    if src == rank:
        return _DIAG
    if layout == "contiguous":
        return _FULL if src < rank else None
    if layout == "striped":
        if src < rank:
            return _DIAG
        # See Note [Causal ring steps]: the striped shift.
        # k[:-1], not k[:s_local - 1]: a slice bound made from S_local would make torch.compile
        # specialise on the sequence length (see tests/core/test_compile.py).
        return Block(slice(1, None), slice(None, -1), True) if s_local > 1 else None
    c = s_local // 2
    if src < rank:
        return Block(slice(None), slice(0, c), False)
    return Block(slice(c, None), slice(None), False)


def pairs_upto(h: int, nq: int, nk: int) -> int:
    """Kept (query, key) pairs of an nq x nk rectangle whose mask keeps column c of row r iff c - r <= h:
    #{(r, c) in [0, nq) x [0, nk): c - r <= h} = sum over r of clamp(r + h + 1, 0, nk). h = 0 is the
    top-left causal mask; masks.py counts its bands with it too."""

    def tri(t: int) -> int:  # sum of clamp(x, 0, nk) for x <= t
        if t <= 0:
            return 0
        if t <= nk:
            return t * (t + 1) // 2
        return nk * (nk + 1) // 2 + (t - nk) * nk

    return tri(h + nq) - tri(h)


def block_pairs(blk: Block | None, s_local: int) -> int:
    """(query, key) pairs ``blk`` keeps on a q block and a K/V block of ``s_local`` rows each."""
    if blk is None:
        return 0
    rows, cols = len(range(s_local)[blk.q_rows]), len(range(s_local)[blk.kv_rows])
    return pairs_upto(0, rows, cols) if blk.causal else rows * cols


def step_pairs(layout: str, *, rank: int, src: int, s_local: int, causal: bool = True) -> int:
    """(query, key) pairs rank ``rank`` computes against the K/V block of rank ``src``: the pair count
    of :func:`step_block` (the cost model's FLOPs are this times 4 * B * Hq * D)."""
    world = max(rank, src) + 1  # step_block's answer depends only on how rank and src compare
    return block_pairs(step_block(layout, rank=rank, src=src, world=world, s_local=s_local, is_causal=causal), s_local)


FP8_SCALE_BYTES = 1  # float8 payload: one int8 power-of-two exponent per row of K and of V


def payload_bytes(*, rows: int, head_dim: int, itemsize: int, fp8: bool = False, v_head_dim: int | None = None) -> int:
    """Bytes of one K/V message (or of the dK/dV accumulators, shaped alike): K and V of ``rows`` rows
    (B * Hkv * S_local) of ``head_dim`` (V: ``v_head_dim``, default the same) values, ``itemsize`` bytes
    each, plus for float8 one exponent byte a row of K and of V. See Note [float8 ring payload] in
    payload.py, whose ``encode_kv`` builds exactly this many bytes."""
    dv = head_dim if v_head_dim is None else v_head_dim
    return rows * ((head_dim + dv) * itemsize + (2 * FP8_SCALE_BYTES if fp8 else 0))
