"""The document layout: a per-batch placement of packed documents on the CP ranks, and its byte formula.

Importing this module does not import torch (``cp-dtensor plan`` and the benchmark use
it without torch). :func:`plan_row` places one row; :class:`DocumentLayout` (built by
``cp_dtensor.document_layout``) holds the placement of a whole ``[B, N]`` batch and is accepted wherever a
layout name is (``local_positions``, ``shard_tensor`` / ``unshard_tensor``, ``shard_batch`` /
``unshard_batch``, ``ring_attention(..., layout=lay)``); its methods import torch when called.

The placement's math (Notes [Document placement], [Document exchange bytes]) is doc_plan.py.

Note [One plan per batch]
~~~~~~~~~~~~~~~~~~~~~~~~~
A batch's documents are derived once, from the *full* batch, before it is sharded: ``full_document_ids``
(document ids, or position ids restarting at 0) and ``plan_batch`` (the ``DocumentLayout`` of those ids in
the door's layout). Every door builds this one object -- ``apply_context_parallel`` (own models and
Hugging Face), ``with_context_parallel``'s collator, ``context_parallel``, torchtitan -- shards the batch
with it, and passes it as the ``layout`` of every attention call of that forward: layer after layer
reuses it (and its cached exchange plans). ``layout="documents"`` places the documents themselves; a
layout name keeps that layout's order and the plan carries the ids the ring masks by.

Note [A plan fits its batch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A plan is an object the caller passes with each forward (``cp_layout=plan``), so it can be the plan of
another batch: the ring would then mask by the plan's documents, not the batch's, and answer wrong without
a word. Where the batch's documents are in its position ids (restarting at 0 for every document: the
transformers door, the own-model door given positions), ``positions_error`` checks every token a rank holds
against the plan, from that rank's tokens alone: a token ``g`` of the plan document that starts at token
``s`` must have position ``g - s``. A token's own position and its plan document's start are all it needs,
so no pair of tokens has to sit on one rank (a striped shard holds no neighbours; a pair split across ranks
is checked on both sides of the split) and every kind of misfit is seen on the rank holding the first token
it touches: a coarser plan (a position 0 inside a plan document), a finer one (a plan document starting at
a position above 0), a shifted one, a batch sharded in another order, another rank's positions. The row's
first document is the one exception -- a row cut from a longer sequence starts mid-document -- so there
the positions need only go up by 1 (``position - g`` one value >= 0 on each rank). With a 2-D padding mask
(transformers' padded rows: each pad a document, the tokens one sequence whose positions may count the
pads) the tokens of a row must lie in one plan document, the pads in documents of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._deprecated import old_keywords, warn_once
from .doc_plan import Window, lengths_of, needed_rows, plan_intervals, plan_row, rank_work, row_balance, window_lefts

if TYPE_CHECKING:
    import torch

__all__ = ["DocumentLayout", "Window", "document_layout", "full_document_ids", "layout_rows", "plan_batch", "plan_row", "row_balance",
           "rank_work", "needed_rows", "lengths_of", "window_lefts"]


@dataclass(frozen=True, eq=False)
class DocumentLayout:
    """A batch's document placement (``cp_dtensor.document_layout``): row b's global position at local
    slot i of rank r is ``order[b][r * S + i]``. Frozen; one per batch, reused by every layer."""

    cp_size: int  #: the CP degree it was built for (``world``: its deprecated name)
    seq_len: int  #: N, the full row length
    order: Any  #: int64 [B, N] tensor: every rank's positions, rank-major (``global_order``'s analogue)
    ids: Any  #: int64 [B, N] tensor: the document ids it was built from
    windows: tuple[int | None, ...] = (None,)  #: the layers' left reaches its balance counts
    key: int = 0  #: a fingerprint of (order, ids): equal layouts on every rank agree on it
    placement: str = "documents"  #: "documents" (this module's plan) or a layout name kept with the ids
    row_len: int = 0  #: a dynamic plan's (core/dynamic.py): the length of the rows it lays end to end; 0 otherwise
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    #: ``key`` as an int64 [1] tensor, what a compiled graph reads instead of the int (a graph input, so a
    #: new batch does not recompile): see Note [Compiled document exchange] in doc_op.py. Always made from
    #: ``key`` (not an argument: ``dataclasses.replace`` cannot carry a stale one)
    key_tensor: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        import torch

        object.__setattr__(self, "key_tensor", torch.tensor([self.key], dtype=torch.int64))

    @property
    def batch(self) -> int:
        return self.order.shape[0]

    @property
    def world(self) -> int:
        """Deprecated: ``cp_size`` (warns once)."""
        warn_once("DocumentLayout.world", "DocumentLayout.cp_size")
        return self.cp_size

    @property
    def s_local(self) -> int:
        return self.seq_len // self.cp_size

    def local_positions(self, rank: int, world: int, seq_len: int) -> torch.Tensor:
        """int64 [B, N / world]: the global positions ``rank`` holds of each row, in local order."""
        self.check(world, seq_len)
        s = self.s_local
        return self.order[:, rank * s : (rank + 1) * s]

    def check(self, world: int, seq_len: int) -> None:
        if world != self.cp_size or seq_len != self.seq_len:
            raise ValueError(f"this document layout was built for {self.cp_size} ranks and rows of {self.seq_len} "
                             f"tokens; got {world} ranks and {seq_len} tokens. Build one per batch with "
                             f"cp_dtensor.document_layout(document_ids, world).")

    def __repr__(self) -> str:
        return (f"DocumentLayout(placement={self.placement!r}, cp_size={self.cp_size}, batch={self.batch}, "
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
        return self.ids.gather(1, self.local_positions(rank, self.cp_size, self.seq_len))

    def positions_error(self, rank: int, positions, *, real=None) -> str | None:
        """Whether ``positions`` ([B | 1, S], this rank's shard of the batch's position ids, restarting at 0
        for every document) can be the shard of a batch this plan was built for, from this rank's tokens
        only (no communication): see Note [A plan fits its batch]. ``real``: this rank's shard of a 2-D
        padding mask ([B, S] bool, True for tokens) or None. None, or the error."""
        import torch

        held = self.local_positions(rank, self.cp_size, self.seq_len)  # [B_plan, S]: global index of each local slot
        pos = positions.detach().to("cpu", torch.int64)
        rows = max(pos.shape[0], held.shape[0])
        if pos.dim() != 2 or pos.shape[-1] != held.shape[-1] or {pos.shape[0], held.shape[0]} - {1, rows}:
            return None  # the shape checks are the door's
        held, pos = held.expand(rows, -1), pos.expand(rows, -1)
        ids = self.ids.expand(rows, -1)
        n = ids.shape[1]
        start = torch.ones(ids.shape, dtype=torch.bool)
        start[:, 1:] = ids[:, 1:] != ids[:, :-1]
        first = torch.where(start, torch.arange(n).expand(rows, n), 0).cummax(1).values  # [rows, N]: each doc's start
        s = first.gather(1, held)  # [rows, S]: the start of each held token's plan document
        offset = pos - (held - s)  # [rows, S]: 0 wherever the positions restart where the plan's documents do
        free = s == 0  # a row's first document may start mid-document (a row cut from a longer one)
        if real is not None:  # See Note [A plan fits its batch]: a padded row is one run of tokens
            mask = real.detach().to("cpu", torch.bool).expand(rows, -1)
            free = free | mask
            tok_ids = torch.where(mask, ids.gather(1, held), -1)
            one = tok_ids.max(1, keepdim=True).values
            split = mask & (tok_ids != one)
            if bool(split.any()):
                b, i = (int(x) for x in torch.nonzero(split)[0])
                return (f"the plan (cp_layout=) does not fit this batch: row {b}'s tokens (attention_mask 1) lie in "
                        "more than one of the plan's documents, while a padded row is one sequence. Build the plan "
                        "from this batch: cp_dtensor.hf.plan_batch(model, position_ids=..., attention_mask=full_mask).")
            checked = mask
        else:
            checked = torch.ones_like(free)
        bad = checked & ~free & (offset != 0)
        # a free document's offset is one value on this rank (positions go up by 1 inside it) and >= 0
        base = torch.where(checked & free, offset, torch.iinfo(torch.int64).max).min(1, keepdim=True).values
        bad = bad | (checked & free & ((offset != base) | (offset < 0)))
        if not bool(bad.any()):
            return None
        b, i = (int(x) for x in torch.nonzero(bad)[0])
        g, d = int(held[b, i]), int(s[b, i])
        want = f"{g - d}" if d > 0 else "one more than the token before it"
        return (f"the plan (cp_layout=) does not fit this batch's positions: row {b}, global token {g} has position "
                f"{int(pos[b, i])}; the plan has it in a document starting at token {d}, where its position would be "
                f"{want} (positions restart at 0 where a document starts). The plan was built for another batch "
                "(coarser, finer or shifted documents), or the batch was sharded in another order than the plan's "
                "(shard it with cp_dtensor.shard_batch(..., layout=plan), not a layout name), or this rank holds "
                "another rank's shard. Build the plan from this batch's full ids and shard with it.")


def _gather(x, dim: int, idx, batch: int):
    """x.gather along ``dim`` with a per-row index ``idx`` [B, M] (x's dim 0 the batch; 1-D x for B = 1)."""
    import torch

    from .layout import wrap_dim

    dim = wrap_dim(dim, x.dim())
    if x.dim() == 1 or dim == 0 or batch == 1:  # a plan of one row orders every row alike (a [1, N] batch's)
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
            lengths = torch.unique_consecutive(ids[r], return_counts=True)[1].tolist()
            ivs = torch.tensor([iv for rank_ivs in plan_intervals(lengths, world, windows=list(lefts))
                                for iv in rank_ivs], dtype=torch.int64)  # [I, 2]: rank-major runs [a, b)
            runs = ivs[:, 1] - ivs[:, 0]
            # each run's positions a, a + 1, ..., b - 1, laid end to end
            rows.append(torch.arange(n) + torch.repeat_interleave(ivs[:, 0] - (runs.cumsum(0) - runs), runs))
        order = torch.stack(rows)
    else:
        from .layout import check_seq_len, global_order

        check_seq_len(placement, world, n)
        order = global_order(placement, world, n).to(torch.int64).expand(b, n).contiguous()
    return _layout_of(order, ids, world, lefts, placement)


def _layout_of(order, ids, cp_size: int, lefts: tuple, placement: str) -> DocumentLayout:
    import zlib

    key = zlib.crc32(ids.numpy().tobytes(), zlib.crc32(order.numpy().tobytes())) ^ (cp_size << 32)
    return DocumentLayout(cp_size=cp_size, seq_len=ids.shape[1], order=order, ids=ids, windows=lefts, key=key,
                          placement=placement)


def layout_rows(order, ids, *, cp_size: int, windows: tuple = (None,), placement: str = "documents") -> DocumentLayout:
    """The plan of some rows of a batch's plan, from those rows of its ``order`` and ``ids`` ([b, N] each, e.g.
    one pipeline microbatch's) and its ``cp_size``, ``windows`` and ``placement``: each row is planned alone,
    so this is what ``document_layout`` of those rows' ids returns, without planning them again."""
    import torch

    order = order.detach().to("cpu", torch.int64).contiguous()
    ids = ids.detach().to("cpu", torch.int64).contiguous()
    if order.shape != ids.shape or order.dim() != 2:
        raise ValueError(f"layout_rows takes [b, N] rows of a plan's order and ids; got {tuple(order.shape)} and "
                         f"{tuple(ids.shape)}.")
    return _layout_of(order, ids, cp_size, tuple(windows), placement)


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
