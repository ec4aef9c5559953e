"""The document exchange: ``ring_attention(q, k, v, layout=document_layout(ids, P), ...)``.

Note [Document exchange]
~~~~~~~~~~~~~~~~~~~~~~~~
A ``DocumentLayout`` (documents.py) places every short document whole on one rank and cuts long ones in
head-tail pieces over few ranks. Every rank knows the whole placement and every document id, so every rank
can say, without asking anyone, which K/V rows each rank's queries need from each other rank (Note
[Document exchange bytes] in doc_plan.py) -- the *exchange plan* of a (layout, mask), derived once on the
host and kept on the layout (every layer of the batch reuses it). Then:

* forward: one all-to-all-v (``funcol.all_to_all_single_autograd``) sends each needed K/V row once,
  straight from its holder to the rank that needs it; the local keys' attention runs while it travels
  (the eager result is an ``AsyncCollectiveTensor``, waited on at first use); then the received keys'
  attention, and the two partial results merge by their log-sum-exp
  (``out = sum_i exp(lse_i - lse) * out_i``, ``lse = logaddexp(lse_1, lse_2)``);
* backward: autograd's backward of the all-to-all returns each received row's dK/dV to its holder by the
  same routes reversed -- one all-to-all-v of exactly the forward's rows; nothing else travels (the ring
  re-sends K/V in its backward).

The attention itself -- the queries against the local rows, then against the received ones -- runs the
ring's masked block kernels, per kept rectangle, with the ring's backward: Note [Document blocks] in
doc_blocks.py.

Note [Documents on a 2-D mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
On a (U, R) mesh, as Note [Ulysses x ring] in ulysses.py: mesh rank (u, r) is 1-D rank p = u * R + r of
the layout (built for P = U * R). The heads all-to-all gives ring rank r the union of the U shards of
ranks u' * R + r, on Hq / U heads; sorted per row (``_union_perm``), that union is ring rank r's shard of
``union_layout`` -- the same placement seen by R ranks -- and the exchange above runs over the ring group
on it; the output goes back by the inverse permutation and the heads all-to-all. The agreement runs over
both groups first (every rank alike, before any K/V moves).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..agreement import agree_on_call
from ..checks import COMM_DTYPES
from ..compute.kernels import kernel_error
from ..plan.documents import DocumentLayout
from ..plan.masks import mask_bounds
from .doc_blocks import doc_attention, doc_blocks
from .ulysses import gather_heads, kv_replicas, scatter_heads

__all__ = ["agree_call", "call_error", "document_attention", "exchange_of", "exchange_plan", "options_error",
           "union_layout"]


def _starts(lay: DocumentLayout) -> Tensor:
    """int64 [B, N]: the position where each token's document starts."""
    ids, n = lay.ids, lay.seq_len
    pos = torch.arange(n)
    new = torch.ones(ids.shape, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(new, pos, torch.zeros((), dtype=torch.int64)).cummax(1).values


def _needs(lay: DocumentLayout, r: int, keys: Tensor, start: Tensor, lo: int | None, hi: int | None) -> Tensor:
    """bool [B, M]: rank r's queries keep some pair with the key at each global position of ``keys`` [B, M]
    (Note [Document exchange bytes] in doc_plan.py): the first query of r's at or after the earliest that may
    keep it (its document's start, or key - hi), if that query is in the key's document and within lo."""
    s = lay.s_local
    qpos = lay.order[:, r * s : (r + 1) * s].contiguous()  # [B, S], sorted
    first = start.gather(1, keys)
    if hi is not None:
        first = torch.maximum(first, keys - hi)
    idx = torch.searchsorted(qpos, first)  # [B, M]
    i = qpos.gather(1, idx.clamp(max=s - 1))
    keep = (idx < s) & (lay.ids.gather(1, i) == lay.ids.gather(1, keys))
    if lo is not None:
        keep &= keys - i >= lo
    return keep


def _doc_index(lay: DocumentLayout) -> Tensor:
    """int64 [B, N]: each token's document as 0, 1, ... along its row."""
    new = torch.zeros(lay.ids.shape, dtype=torch.int64)
    new[:, 1:] = (lay.ids[:, 1:] != lay.ids[:, :-1]).long()
    return new.cumsum(1)


def _last_queries(lay: DocumentLayout, owner: Tensor, doc: Tensor) -> Tensor:
    """int64 [B, P, D]: the last global position each rank holds of each document of each row (-1: none);
    ``doc``: ``_doc_index(lay)``."""
    b, n = lay.ids.shape
    docs = int(doc[:, -1].max()) + 1
    last = torch.full((b * lay.cp_size * docs,), -1, dtype=torch.int64)
    slot = (torch.arange(b)[:, None] * lay.cp_size + owner) * docs + doc  # [B, N]
    last.scatter_reduce_(0, slot.view(-1), torch.arange(n).expand(b, n).reshape(-1), "amax")
    return last.view(b, lay.cp_size, docs)


def _needs_all(lay: DocumentLayout, keys: Tensor, start: Tensor, lo: int | None, hi: int | None) -> Tensor:
    """bool [B, P, M]: ``_needs`` of every rank p at once, for the keys [B, P, M] (global positions)."""
    b, world, m = keys.shape
    s = lay.s_local
    qpos = lay.order.view(b * world, s)  # each rank's sorted positions
    first = start.gather(1, keys.reshape(b, world * m))
    if hi is not None:
        first = torch.maximum(first, keys.reshape(b, world * m) - hi)
    idx = torch.searchsorted(qpos, first.view(b * world, m))  # [B * P, M]
    i = qpos.gather(1, idx.clamp(max=s - 1)).view(b, world * m)
    keep = (idx.view(b, world * m) < s) & (lay.ids.gather(1, i) == lay.ids.gather(1, keys.reshape(b, world * m)))
    if lo is not None:
        keep &= keys.reshape(b, world * m) - i >= lo
    return keep.view(b, world, m)


def exchange_plan(lay: DocumentLayout, rank: int, is_causal: bool, window) -> dict:
    """The exchange of ``rank`` under the mask (Note [Document exchange]), cached on the layout: the local
    rows it sends to each peer (``send``: flat b * S + i indices, peer-major; ``send_splits``), the rows it
    receives (``recv_splits``; per batch row b, ``rows[b]``: indices into the received buffer and ``pos[b]``:
    their global positions), ``total``: 1 when some document spans ranks (then every rank joins the
    all-to-all, possibly with nothing to send), else 0 (no collective at all; the same on every rank).
    O(N log S) host work a rank: its own keys against each peer's queries, every key against its own."""
    lo, hi = mask_bounds(is_causal, window)
    key = (rank, lo, hi)
    if key in lay._cache:
        return lay._cache[key]
    world, s, b = lay.cp_size, lay.s_local, lay.batch
    start = _starts(lay)
    owner = torch.empty_like(lay.order)
    owner.scatter_(1, lay.order, (torch.arange(lay.seq_len) // s).expand_as(lay.order))
    mine = lay.order[:, rank * s : (rank + 1) * s]  # [B, S]
    # what every peer needs of mine, all peers at once: peer p's queries against my keys, [B, P, S]
    if lo is None:  # a query keeps every earlier key of its document within hi: each rank's last query will do
        doc = _doc_index(lay)
        last = _last_queries(lay, owner, doc)  # [B, P, docs]
        first = start if hi is None else torch.maximum(start, torch.arange(lay.seq_len) - hi)  # [B, N]
        out_rows = last.gather(2, doc.gather(1, mine)[:, None, :].expand(b, world, s)) >= first.gather(1, mine)[:, None, :]
        need = last[:, rank].gather(1, doc) >= first  # [B, N]: what I need
    else:
        out_rows = _needs_all(lay, mine[:, None, :].expand(b, world, s), start, lo, hi)  # [B, P, S]
        need = _needs(lay, rank, torch.arange(lay.seq_len).expand(b, -1), start, lo, hi)  # [B, N]: what I need
    out_rows[:, rank] = False  # what each peer needs of mine
    send_splits = out_rows.sum((0, 2)).tolist()
    peer_b_i = torch.nonzero(out_rows.transpose(0, 1))  # [M, 3]: (peer, b, i), peer-major, ascending position per b
    send = peer_b_i[:, 1] * s + peer_b_i[:, 2]  # a row's flat index in this rank's [B * S] rows
    bb, jj = torch.nonzero(need & (owner != rank), as_tuple=True)  # row-major (b, j)
    src = owner[bb, jj]
    by_peer = torch.sort(src, stable=True).indices  # peer-major: the order each peer sends them in
    bb, jj = bb[by_peer], jj[by_peer]
    recv_splits = torch.bincount(src, minlength=world).tolist()
    rows = [torch.nonzero(bb == r, as_tuple=True)[0] for r in range(b)]
    spans = bool((owner != owner.gather(1, start)).any())  # a document on more than one rank
    plan = {
        "send": send,
        "send_splits": send_splits, "recv_splits": recv_splits,
        "rows": rows, "pos": [jj[r] for r in rows], "total": int(spans), "bounds": (lo, hi),
    }
    lay._cache[key] = plan
    return plan


def options_error(*, comm_dtype, kv_exchange: str, window_size) -> str | None:
    """The error of a call's non-tensor options with a document layout (the same on every rank), or None."""
    if comm_dtype not in COMM_DTYPES:
        return (f"ring_attention: comm_dtype must be None, a float dtype or torch.float8_e4m3fn / float8_e5m2; "
                f"got {comm_dtype!r}.")
    if kv_exchange != "ring":
        return (f"ring_attention with a document layout has its own exchange (Note [Document exchange]); got "
                f"kv_exchange={kv_exchange!r}. Drop kv_exchange.")
    w = window_size
    if w is not None and not (isinstance(w, (tuple, list)) and len(w) == 2
                              and all(isinstance(x, int) and not isinstance(x, bool) for x in w)):
        return f"ring_attention: window_size is (left, right) ints, -1 unbounded; got {window_size!r}."
    return None


def call_error(lay: DocumentLayout, q, k, v, *, rank: int, world: int, document_ids, sinks,
               ulysses: int = 1) -> str | None:
    """This rank's error for the tensors of a ``ring_attention`` call with a document layout, or None."""
    if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, k, v)):
        return "ring_attention takes q, k, v as 4-D tensors [B, H, S_local, D]."
    (b, hq, s, dqk), (bk, hkv, sk, dk), (bv, hv, sv, _) = q.shape, k.shape, v.shape
    if (bk, sk, dk) != (b, s, dqk) or (bv, hv, sv) != (b, hkv, s) or hkv == 0 or hq % hkv:
        return (f"ring_attention needs q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with Hq % Hkv == 0; got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if world != lay.cp_size or s * world != lay.seq_len or b != lay.batch:
        return (f"this document layout was built for {lay.cp_size} ranks and a batch [{lay.batch}, {lay.seq_len}]; the "
                f"call has {world} ranks and q's shard [{b}, {s}] (a batch [{b}, {s * world}]). Build the layout "
                "from this batch's document ids: cp_dtensor.document_layout(ids, world).")
    if document_ids is not None:
        mine = lay.local_ids(rank)
        if not isinstance(document_ids, Tensor) or tuple(document_ids.shape) != tuple(mine.shape) or not torch.equal(
                document_ids.detach().to("cpu", torch.int64), mine):
            return ("ring_attention: document_ids are not the ids this document layout was built from (its shard for "
                    "this rank). Build the layout from this batch's ids, or drop document_ids: the layout carries them.")
    if hq % ulysses:
        return (f"ring_attention on a 2-D mesh (U, R) = ({ulysses}, ..) splits the q heads over U: Hq ({hq}) must be "
                f"divisible by U ({ulysses}). Use a mesh whose first dim divides Hq, or a 1-D mesh.")
    if sinks is not None and (not isinstance(sinks, Tensor) or tuple(sinks.shape) != (hq,)):
        return f"ring_attention: sinks must be a tensor [Hq] = [{hq}]; got {getattr(sinks, 'shape', sinks)}."
    return None


def agree_call(lay: DocumentLayout, q, k, v, groups, *, rank: int, world: int, error: str | None, document_ids, sinks,
               is_causal: bool, window, comm_dtype, ulysses: int = 1) -> None:
    """Every rank's checks of a call, agreed (Note [One agreement]): the same ValueError on every rank, before
    any K/V moves, when one rank's checks failed (``error``: its option or door error, or None) or the ranks'
    layout keys, masks, payloads or shapes differ. Eager here; compiled inside ``cp_dtensor::doc_attn``."""
    err = error or call_error(lay, q, k, v, rank=rank, world=world, document_ids=document_ids, sinks=sinks,
                              ulysses=ulysses) or kernel_error(q, v, windowed=window is not None)
    shapes = [int(x) for t in (q, k, v) for x in (tuple(t.shape) if isinstance(t, Tensor) else ())]
    left, right = window if err is None and window is not None else (-1, -1)
    fingerprint = {"layout key": lay.key, "is_causal": int(bool(is_causal)), "left": left, "right": right,
                   "sinks": int(sinks is not None),
                   "comm_dtype": COMM_DTYPES.index(comm_dtype) if comm_dtype in COMM_DTYPES else -1,
                   "q, k, v shapes": hash(tuple(shapes)) & 0x7FFFFFFF}
    agree_on_call(err, fingerprint, groups, what="ring_attention")  # every rank alike, before any K/V moves


def document_attention(q: Tensor, k: Tensor, v: Tensor, lay: DocumentLayout, *, group=None, is_causal: bool = False,
                       scale: float | None = None, window_size=None, sinks: Tensor | None = None,
                       document_ids: Tensor | None = None, comm_dtype=None, kv_exchange: str = "ring",
                       ulysses_group=None, error: str | None = None) -> Tensor:
    """``ring_attention`` with a ``DocumentLayout``: see Note [Document exchange]. q: [B, Hq, S, Dqk],
    k: [B, Hkv, S, Dqk], v: [B, Hkv, S, Dv], this rank's shards in ``lay``; returns [B, Hq, S, Dv].
    ``ulysses_group``: a (U, R) mesh's heads group (``group`` its ring group): Note [Documents on a 2-D mesh].
    ``error``: the caller's own local error (a front door's), raised on every rank by the agreement. Eager;
    the compiled twin is doc_op.py's ``compiled_document_attention`` (Note [Compiled document exchange])."""
    group = group if group is not None else dist.group.WORLD
    r, ring = dist.get_rank(group), dist.get_world_size(group)
    u, u_ = (0, 1) if ulysses_group is None else (dist.get_rank(ulysses_group), dist.get_world_size(ulysses_group))
    rank, world = u * ring + r, u_ * ring  # the 1-D rank of Note [Ulysses x ring] in ulysses.py
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    err = error or options_error(comm_dtype=comm_dtype, kv_exchange=kv_exchange, window_size=window)
    groups = group if ulysses_group is None else (group, ulysses_group)
    agree_call(lay, q, k, v, groups, rank=rank, world=world, error=err, document_ids=document_ids, sinks=sinks,
               is_causal=is_causal, window=window, comm_dtype=comm_dtype, ulysses=u_)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if ulysses_group is None or u_ == 1:
        return _exchange(q, k, v, lay if u_ == 1 else union_layout(lay, u_), r, group, is_causal=is_causal,
                         window=window, sinks=sinks, scale=scale, comm_dtype=comm_dtype)
    b, hq, s, _ = q.shape
    union = union_layout(lay, u_)
    perm = _union_perm(lay, union, u, r, u_)  # [B, U * S]: received part u' * S + j -> sorted union order
    reps = kv_replicas(k.shape[1], u_)
    if reps > 1:  # See Note [GQA under Ulysses] in ulysses.py
        k, v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
    if sinks is not None:
        sinks = sinks[u * (hq // u_) : (u + 1) * (hq // u_)]
    same = torch.arange(u_ * s, device=q.device)

    def gather_rows(x: Tensor, idx: Tensor) -> Tensor:  # per batch row, along the sequence dim
        return x.gather(2, idx.to(x.device)[:, None, :, None].expand(x.shape[0], x.shape[1], idx.shape[1], x.shape[3]))

    qs, ks, vs = (gather_rows(scatter_heads(x.contiguous(), ulysses_group, same), perm) for x in (q, k, v))
    out = _exchange(qs, ks, vs, union, r, group, is_causal=is_causal, window=window, sinks=sinks, scale=scale,
                    comm_dtype=comm_dtype)
    return gather_heads(gather_rows(out, torch.argsort(perm, 1)), ulysses_group, same)


def exchange_of(lay: DocumentLayout, rank: int, group, *, is_causal, window, scale, comm_dtype):
    """(the blocks, the exchange) of a checked call: what doc_blocks' forward and backward take."""
    plan = exchange_plan(lay, rank, bool(is_causal), window)
    ex = {"send": plan["send"], "send_splits": plan["send_splits"], "recv_splits": plan["recv_splits"],
          "total": plan["total"], "bounds": plan["bounds"], "scale": scale, "group": group, "comm_dtype": comm_dtype}
    return doc_blocks(lay, rank, plan), ex


def _exchange(q, k, v, lay: DocumentLayout, rank: int, group, *, is_causal, window, sinks, scale, comm_dtype) -> Tensor:
    """The agreed call on a 1-D group: the exchange plan, then the exchange and the attention."""
    blocks, ex = exchange_of(lay, rank, group, is_causal=is_causal, window=window, scale=scale, comm_dtype=comm_dtype)
    return doc_attention(q.contiguous(), k.contiguous(), v.contiguous(), sinks, blocks, ex)


def union_layout(lay: DocumentLayout, ulysses: int) -> DocumentLayout:
    """The layout over the R = P / U ring ranks of a (U, R) mesh: ring rank r holds the union of 1-D ranks
    u * R + r (u < U), sorted per row. Cached on ``lay``. See Note [Documents on a 2-D mesh]."""
    key = ("union", ulysses)
    if key not in lay._cache:
        ring, s = lay.cp_size // ulysses, lay.s_local
        parts = lay.order.view(lay.batch, ulysses, ring, s).permute(0, 2, 1, 3).reshape(lay.batch, ring, ulysses * s)
        order = parts.sort(-1).values.reshape(lay.batch, lay.seq_len)
        lay._cache[key] = DocumentLayout(cp_size=ring, seq_len=lay.seq_len, order=order, ids=lay.ids, windows=lay.windows,
                                         key=lay.key ^ (ulysses << 40), placement="documents")
    return lay._cache[key]


def _union_perm(lay: DocumentLayout, union: DocumentLayout, u: int, r: int, ulysses: int) -> Tensor:
    """int64 [B, U * S]: for each slot of ring rank r's sorted union, its index in the heads all-to-all's
    received parts (u' * S + j: the j-th token of 1-D rank u' * R + r)."""
    ring, s = union.cp_size, lay.s_local
    parts = lay.order.view(lay.batch, ulysses, ring, s)[:, :, r].reshape(lay.batch, ulysses * s)
    return parts.argsort(-1)
