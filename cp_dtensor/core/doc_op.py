"""The document exchange as a compile boundary: ``cp_dtensor::doc_attn`` and ``cp_dtensor::doc_attn_backward``.

Note [Compiled document exchange]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The eager exchange (Note [Document exchange] in doc_exchange.py) is host code: the plan's rows are found with
Python loops and ``.tolist()``, its split sizes are Python ints, and each batch row receives another number of
keys. Traced, all of that would either break the graph or be baked into it as constants of one batch, so a
new batch would recompile (or, worse, run another batch's plan). So under ``torch.compile`` the whole call is
one opaque custom op whose inputs are tensors and per-model constants only:

* tensors: q, k, v, sinks, the layout's ``order`` and ``ids`` [B, N] (int64, host) and its ``key_tensor``
  (the layout key as int64 [1]), the optional ``document_ids``; constants: this trace's option error (or
  None), ``is_causal``, the window, the scale and the group's name -- the same for every batch. Dynamo reads
  only those fields of the ``DocumentLayout`` argument (the tensors become graph inputs, ``placement``,
  ``world`` and ``seq_len`` are guarded constants), never its ``key`` int: a batch with new document
  boundaries runs the same graph.
* the fake implementations give shapes that do not depend on the plan: out [B, Hq, S, Dv] (q's dtype) and lse
  [B, Hq, S] (fp32, fp64 for fp64 inputs); the backward's dq, dk, dv, dsinks like q, k, v, sinks (dsinks
  [0] without sinks).
* at run time ``doc_attn`` rebuilds the layout from its tensors (kept in a small cache by key, checked
  against the tensors, so every layer of a batch reuses one layout and its cached exchange plans), then
  runs eager's code: the agreement (``agree_call``: every rank raises the same ValueError, before any K/V
  moves, as eager) and ``attend`` (the all-to-all-v and the dense masked attention), autograd off.
* ``doc_attn_backward`` (``register_autograd``) computes the gradients in closed form from the final out
  and lse (``ds = p * (dp - rowsum(do * out))``; sinks: ``dsink = -sum p_sink * rowsum(do * out)``): it
  sends the needed K/V rows again (no received row is saved between the two ops), then each row's dK/dV
  back to its holder by the reversed all-to-all-v. The compiled backward so moves 2x the forward's bytes
  (eager's autograd keeps the received rows and moves 1x), as the compiled ring re-sends K/V (Note
  [Compiled backward re-sends K/V] in ring.py).

The op talks over the group by name inside its implementation, like torch's functional collectives, and reads
its rank there: unlike the ring's (Note [Rank-specialised compiled graphs] in _compat.py) the graph is the same
on every rank, so a compile cache shared by the ranks is safe. As for the ring, two independent document calls
on one group in one graph could be ordered differently on different ranks -- successive layers depend on each
other and are fine.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from .._compat import resolve_process_group
from .doc_exchange import _keep, _rows, agree_call, attend, exchange_plan, options_error, received
from .documents import DocumentLayout

__all__ = ["compiled_document_attention", "doc_attn", "doc_attn_backward"]

_LAYOUTS: OrderedDict[tuple[int, int], DocumentLayout] = OrderedDict()  # (key, world) -> layout; see _layout
_KEEP = 4  # layouts kept: the batch in flight and a few before it (each holds its exchange plans)


def _layout(order: Tensor, ids: Tensor, key: Tensor, world: int) -> DocumentLayout:
    """The ``DocumentLayout`` of these tensors, from the cache when the same (order, ids) were seen last
    (checked, so a key collision can never hand a batch another batch's plan)."""
    k = int(key.reshape(-1)[0])
    hit = _LAYOUTS.get((k, world))
    if hit is not None and (hit.order is order or torch.equal(hit.order, order.cpu())) and (
            hit.ids is ids or torch.equal(hit.ids, ids.cpu())):
        _LAYOUTS.move_to_end((k, world))
        return hit
    lay = DocumentLayout(world=world, seq_len=order.shape[1], order=order.cpu(), ids=ids.cpu(), key=k)
    _LAYOUTS[(k, world)] = lay
    while len(_LAYOUTS) > _KEEP:
        _LAYOUTS.popitem(last=False)
    return lay


def _window(window: list[int] | None) -> tuple[int, int] | None:
    return None if window is None else (window[0], window[1])


@torch.library.custom_op("cp_dtensor::doc_attn", mutates_args=())
def doc_attn(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, order: Tensor, ids: Tensor, key: Tensor,
    document_ids: Tensor | None, error: str | None, is_causal: bool, window: list[int] | None, scale: float,
    group: str,
) -> tuple[Tensor, Tensor]:
    """A ``ring_attention`` call with a document layout (Note [Compiled document exchange]): the agreement,
    the exchange and the attention. Returns out [B, Hq, S, Dv] (q's dtype) and lse [B, Hq, S] (fp32)."""
    pg = resolve_process_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    lay = _layout(order, ids, key, world)
    win = _window(window)
    agree_call(lay, q, k, v, pg, rank=rank, world=world, error=error, document_ids=document_ids, sinks=sinks,
               is_causal=is_causal, window=win)
    plan = exchange_plan(lay, rank, is_causal, win)
    out, lse = attend(q, k, v, lay, plan, rank=rank, world=world, group=pg, scale=scale, sinks=sinks)
    return out.contiguous(), lse.contiguous()


@doc_attn.register_fake
def _(q, k, v, sinks, order, ids, key, document_ids, error, is_causal, window, scale, group):
    acc = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=acc)


def _grads(qa: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, keep: Tensor,
           scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """One block's gradients from the rows' final lse: qa, do [.., G, S, D]; k, v [.., 1, K, D]; lse, delta
    [.., G, S]; keep [.., 1 | G, S, K]. Returns dq [.., G, S, Dqk], dk [.., K, Dqk], dv [.., K, Dv]. A KV head's
    G query heads are one block of G * S rows (no broadcast matmul, no sum over G)."""
    *lead, g, s, dqk = qa.shape
    rows = (*lead, g * s)
    qf, dof = qa.reshape(*rows, dqk), do.reshape(*rows, do.shape[-1])
    kf, vf = k.squeeze(-3), v.squeeze(-3)  # [.., K, D]
    keep = keep.expand(*keep.shape[:-4], *lead[-1:], g, s, keep.shape[-1]).reshape(*rows, keep.shape[-1])
    p = (qf @ kf.transpose(-1, -2)).mul_(scale).sub_(lse.reshape(*rows, 1)).exp_().masked_fill_(~keep, 0)  # [.., GS, K]
    dv = p.transpose(-1, -2) @ dof
    # softmax backward: ds = p * (dp - rowsum(do * out)), with the scale folded in
    ds = (dof @ vf.transpose(-1, -2)).sub_(delta.reshape(*rows, 1)).mul_(p).mul_(scale)
    dq = (ds @ kf).view(*lead, g, s, dqk)
    dk = ds.transpose(-1, -2) @ qf
    return dq, dk, dv


@torch.library.custom_op("cp_dtensor::doc_attn_backward", mutates_args=())
def doc_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor, order: Tensor,
    ids: Tensor, key: Tensor, is_causal: bool, window: list[int] | None, scale: float, group: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dsinks of :func:`doc_attn` (dsinks [0] without sinks); see Note [Compiled document exchange]."""
    pg = resolve_process_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    lay = _layout(order, ids, key, world)
    plan = exchange_plan(lay, rank, is_causal, _window(window))
    b, hq, s, dqk = q.shape
    hkv, dv_ = k.shape[1], v.shape[3]
    g = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    dev = q.device
    recv = None
    if plan["total"]:  # the rows again (nothing was saved between the ops)
        buf = _rows(k, v).index_select(0, plan["send"].to(dev))
        recv = funcol.all_to_all_single(buf, plan["recv_splits"], plan["send_splits"], pg)
    qa = q.to(acc).view(b, hkv, g, s, dqk)
    do = dout.to(acc).view(b, hkv, g, s, dv_)
    lse5 = lse.to(acc).view(b, hkv, g, s)
    delta = (do * out.to(acc).view(b, hkv, g, s, dv_)).sum(-1)  # [B, Hkv, G, S]
    safe = torch.where(torch.isfinite(lse5), lse5, torch.zeros((), dtype=acc))  # rows that keep nothing: p = 0
    qpos, qids = lay.local_positions(rank, world, lay.seq_len), lay.local_ids(rank)
    keep = _keep(qpos, qids, qpos, qids, *plan["bounds"]).to(dev)[:, None, None]  # [B, 1, 1, S, S]
    dq, dk, dv = _grads(qa, k.to(acc)[:, :, None], v.to(acc)[:, :, None], do, safe, delta, keep, scale)
    if recv is not None:
        recv = funcol.wait_tensor(recv)
        drecv = torch.zeros(recv.shape, dtype=acc, device=dev)  # [R, Hkv * (Dqk + Dv)], the received rows' dK | dV
        for r in range(b):
            idx = plan["rows"][r]
            if idx.numel() == 0:
                continue
            kr, vr, kr_keep = received(recv, plan, r, lay, qpos, qids, (hkv, dqk, dv_), acc)
            dq_r, dk_r, dv_r = _grads(qa[r], kr, vr, do[r], safe[r], delta[r], kr_keep, scale)
            dq[r] += dq_r
            n = idx.numel()
            drecv[idx.to(dev)] = torch.cat([dk_r.transpose(0, 1).reshape(n, -1), dv_r.transpose(0, 1).reshape(n, -1)], 1)
        # back to the holders by the same routes reversed, in the rows' dtype (as eager's autograd sends them)
        back = funcol.wait_tensor(funcol.all_to_all_single(drecv.to(recv.dtype), plan["send_splits"],
                                                           plan["recv_splits"], pg)).to(acc)
        send = plan["send"].to(dev)
        dk_rows = dk.permute(0, 2, 1, 3).reshape(b * s, hkv * dqk).index_add(0, send, back[:, : hkv * dqk])
        dv_rows = dv.permute(0, 2, 1, 3).reshape(b * s, hkv * dv_).index_add(0, send, back[:, hkv * dqk :])
        dk = dk_rows.view(b, s, hkv, dqk).transpose(1, 2)
        dv = dv_rows.view(b, s, hkv, dv_).transpose(1, 2)
    if sinks is not None:  # See Note [Attention sinks] in blocks.py: dsink = -sum p_sink * rowsum(do * out)
        p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse.to(acc))  # [B, Hq, S]
        dsinks = -(p_sink * delta.reshape(b, hq, s)).sum((0, 2)).to(sinks.dtype)
    else:
        dsinks = q.new_zeros(0)
    return (dq.reshape(b, hq, s, dqk).to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(),
            dv.to(v.dtype).contiguous(), dsinks)


@doc_attn_backward.register_fake
def _(dout, q, k, v, sinks, out, lse, order, ids, key, is_causal, window, scale, group):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, order, ids, key, _document_ids, _error, is_causal, window, scale, group = inputs
    ctx.save_for_backward(q, k, v, sinks, *output, order, ids, key)
    ctx.static = (is_causal, window, scale, group)


def _backward(ctx, dout, dlse):
    q, k, v, sinks, out, lse, order, ids, key = ctx.saved_tensors
    # lse is an output for the backward, not a differentiable result
    dq, dk, dv, dsinks = doc_attn_backward(dout.contiguous(), q, k, v, sinks, out, lse, order, ids, key, *ctx.static)
    return dq, dk, dv, (dsinks if sinks is not None else None), *([None] * 9)


doc_attn.register_autograd(_backward, setup_context=_setup_context)


def compiled_document_attention(q, k, v, lay: DocumentLayout, *, group=None, is_causal: bool = False,
                                scale: float | None = None, window_size=None, sinks: Tensor | None = None,
                                document_ids: Tensor | None = None, comm_dtype=None, kv_exchange: str = "ring",
                                two_d: bool = False) -> Tensor:
    """``document_attention`` (doc_exchange.py) while Dynamo traces: one ``doc_attn`` call that reads only the
    layout's tensors (Note [Compiled document exchange]). An option's error goes to the op, which raises it at
    run time on every rank alike; the output's shape needs q, k, v 4-D (else this trace raises)."""
    group = group if group is not None else dist.group.WORLD
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    err = options_error(comm_dtype=comm_dtype, kv_exchange=kv_exchange, two_d=two_d, window_size=window)
    if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, k, v)):
        raise ValueError("ring_attention takes q, k, v as 4-D tensors [B, H, S_local, D].")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = doc_attn(q, k, v, sinks, lay.order, lay.ids, lay.key_tensor, document_ids, err, bool(is_causal),
                      None if err or window is None else list(window), scale, group.group_name)
    return out
