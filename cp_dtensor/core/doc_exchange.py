"""The document exchange: ``ring_attention(q, k, v, layout=document_layout(ids, P), ...)``.

Note [Document exchange]
~~~~~~~~~~~~~~~~~~~~~~~~
A ``DocumentLayout`` (documents.py) places every short document whole on one rank and cuts long ones in
head-tail pieces over few ranks. Every rank knows the whole placement and every document id, so every rank
can say, without asking anyone, which K/V rows each rank's queries need from each other rank (Note
[Document exchange bytes] in documents.py) -- the *exchange plan* of a (layout, mask), derived once on the
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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from .agreement import agree_on_call
from .doc_blocks import doc_attention, doc_blocks
from .documents import DocumentLayout
from .masks import mask_bounds

__all__ = ["document_attention", "exchange_plan"]


def _needed(lay: DocumentLayout, lo: int | None, hi: int | None) -> Tensor:
    """bool [P, B, N]: rank r's queries keep some pair with the key at global position j (its own included)."""
    world, n, s = lay.world, lay.seq_len, lay.s_local
    ids = lay.ids  # [B, N]
    b = ids.shape[0]
    pos = torch.arange(n)
    new = torch.ones(b, n, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(new, pos, torch.zeros((), dtype=torch.int64)).cummax(1).values  # [B, N] document start
    out = torch.zeros(world, b, n, dtype=torch.bool)
    for r in range(world):
        qpos = lay.order[:, r * s : (r + 1) * s]  # [B, S], sorted
        first = start if hi is None else torch.maximum(start, pos - hi)  # the earliest query that may keep j
        idx = torch.searchsorted(qpos, first)  # [B, N]: the first query at or after it
        ok = idx < s
        i = qpos.gather(1, idx.clamp(max=s - 1))
        keep = ok & (ids.gather(1, i) == ids)
        if lo is not None:
            keep &= pos - i >= lo
        out[r] = keep
    return out


def exchange_plan(lay: DocumentLayout, rank: int, is_causal: bool, window) -> dict:
    """The exchange of ``rank`` under the mask (Note [Document exchange]), cached on the layout: the local
    rows it sends to each peer (``send``: flat b * S + i indices, peer-major; ``send_splits``), the rows it
    receives (``recv_splits``; per batch row b, ``rows[b]``: indices into the received buffer and ``pos[b]``:
    their global positions), ``total``: the rows every rank receives, summed (0: no collective at all)."""
    lo, hi = mask_bounds(is_causal, window)
    key = (rank, lo, hi)
    if key in lay._cache:
        return lay._cache[key]
    world, s = lay.world, lay.s_local
    need = _needed(lay, lo, hi)  # [P, B, N]
    owner = torch.empty_like(lay.order)
    slot = torch.empty_like(lay.order)
    ar = torch.arange(lay.seq_len).expand_as(lay.order)
    owner.scatter_(1, lay.order, ar // s)
    slot.scatter_(1, lay.order, ar % s)
    b = lay.batch
    flat = slot + torch.arange(b)[:, None] * s  # [B, N]: a row's flat index in its holder's [B * S] rows
    send, send_splits, recv_splits, recv_pos, total = [], [], [], [], 0
    for peer in range(world):
        out_rows = need[peer] & (owner == rank)  # what peer needs from me
        send_splits.append(int(out_rows.sum()) if peer != rank else 0)
        if peer != rank:
            send.append(flat[out_rows])  # row-major over (b, position): ascending position per b
        in_rows = need[rank] & (owner == peer)
        recv_splits.append(int(in_rows.sum()) if peer != rank else 0)
        if peer != rank:
            bb, jj = torch.nonzero(in_rows, as_tuple=True)
            recv_pos.append((bb, jj))
        total += int((need[peer] & (owner != peer)).sum())
    if recv_pos:
        bb = torch.cat([x[0] for x in recv_pos])
        jj = torch.cat([x[1] for x in recv_pos])
    else:
        bb = jj = torch.zeros(0, dtype=torch.int64)
    rows = [torch.nonzero(bb == r, as_tuple=True)[0] for r in range(b)]
    plan = {
        "send": torch.cat(send) if send else torch.zeros(0, dtype=torch.int64),
        "send_splits": send_splits, "recv_splits": recv_splits,
        "rows": rows, "pos": [jj[r] for r in rows], "total": total // 1, "bounds": (lo, hi),
    }
    lay._cache[key] = plan
    return plan


def call_error(lay: DocumentLayout, q, k, v, group, *, rank: int, world: int, document_ids, sinks, comm_dtype,
               kv_exchange: str, two_d: bool) -> str | None:
    """This rank's error for a ``ring_attention`` call with a document layout, or None."""
    if two_d:
        return ("ring_attention with a document layout runs on a 1-D CP group; got a 2-D mesh. Pass the ring's group, "
                "or a layout name for Ulysses x ring.")
    if comm_dtype is not None:
        return "ring_attention with a document layout sends K/V in their own dtype; got comm_dtype. Drop comm_dtype."
    if kv_exchange != "ring":
        return (f"ring_attention with a document layout has its own exchange (Note [Document exchange]); got "
                f"kv_exchange={kv_exchange!r}. Drop kv_exchange.")
    if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, k, v)):
        return "ring_attention takes q, k, v as 4-D tensors [B, H, S_local, D]."
    (b, hq, s, dqk), (bk, hkv, sk, dk), (bv, hv, sv, _) = q.shape, k.shape, v.shape
    if (bk, sk, dk) != (b, s, dqk) or (bv, hv, sv) != (b, hkv, s) or hkv == 0 or hq % hkv:
        return (f"ring_attention needs q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] with Hq % Hkv == 0; got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if world != lay.world or s * world != lay.seq_len or b != lay.batch:
        return (f"this document layout was built for {lay.world} ranks and a batch [{lay.batch}, {lay.seq_len}]; the "
                f"call has {world} ranks and q's shard [{b}, {s}] (a batch [{b}, {s * world}]). Build the layout "
                "from this batch's document ids: cp_dtensor.document_layout(ids, world).")
    if document_ids is not None:
        mine = lay.local_ids(rank)
        if not isinstance(document_ids, Tensor) or tuple(document_ids.shape) != tuple(mine.shape) or not torch.equal(
                document_ids.detach().to("cpu", torch.int64), mine):
            return ("ring_attention: document_ids are not the ids this document layout was built from (its shard for "
                    "this rank). Build the layout from this batch's ids, or drop document_ids: the layout carries them.")
    if sinks is not None and (not isinstance(sinks, Tensor) or tuple(sinks.shape) != (hq,)):
        return f"ring_attention: sinks must be a tensor [Hq] = [{hq}]; got {getattr(sinks, 'shape', sinks)}."
    return None


def document_attention(q: Tensor, k: Tensor, v: Tensor, lay: DocumentLayout, *, group=None, is_causal: bool = False,
                       scale: float | None = None, window_size=None, sinks: Tensor | None = None,
                       document_ids: Tensor | None = None, comm_dtype=None, kv_exchange: str = "ring",
                       two_d: bool = False) -> Tensor:
    """``ring_attention`` with a ``DocumentLayout``: see Note [Document exchange]. q: [B, Hq, S, Dqk],
    k: [B, Hkv, S, Dqk], v: [B, Hkv, S, Dv], this rank's shards in ``lay``; returns [B, Hq, S, Dv]."""
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    err = call_error(lay, q, k, v, group, rank=rank, world=world, document_ids=document_ids, sinks=sinks,
                     comm_dtype=comm_dtype, kv_exchange=kv_exchange, two_d=two_d)
    if err is None and window is not None and not (len(window) == 2 and all(isinstance(w, int) for w in window)):
        err = f"ring_attention: window_size is (left, right) ints, -1 unbounded; got {window_size!r}."
    shapes = [int(x) for t in (q, k, v) for x in (tuple(t.shape) if isinstance(t, Tensor) else ())]
    left, right = window if err is None and window is not None else (-1, -1)
    fingerprint = {"layout key": lay.key, "is_causal": int(bool(is_causal)), "left": left, "right": right,
                   "sinks": int(sinks is not None), "q, k, v shapes": hash(tuple(shapes)) & 0x7FFFFFFF}
    agree_on_call(err, fingerprint, group, what="ring_attention")  # every rank alike, before any K/V moves
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plan = exchange_plan(lay, rank, bool(is_causal), window)
    b, _, s, dqk = q.shape
    hkv, dv = k.shape[1], v.shape[3]
    recv = None
    if plan["total"]:  # rows: [B * S, Hkv * (Dqk + Dv)] -- each token's K and V heads, joined
        rows = torch.cat([k.permute(0, 2, 1, 3).reshape(b * s, hkv * dqk), v.permute(0, 2, 1, 3).reshape(b * s, hkv * dv)], 1)
        buf = rows.index_select(0, plan["send"].to(q.device))
        recv = funcol.all_to_all_single_autograd(buf, plan["recv_splits"], plan["send_splits"], group)  # in flight
        # a rank that receives nothing still joins the backward's all-to-all: recv stays an input of the
        # attention below (its gradient is then empty), so autograd reaches the collective
    return doc_attention(q.contiguous(), k.contiguous(), v.contiguous(), recv, sinks,
                         doc_blocks(lay, rank, plan), plan["bounds"], scale)
