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
  moves, as eager) and doc_blocks' ``forward`` (the all-to-all-v and the masked block kernels), autograd
  off.
* ``doc_attn_backward`` (``register_autograd``) is doc_blocks' ``backward`` from the final out and lse
  (the ring's kernel backward per block, sinks included): it sends the needed K/V rows again, in the
  forward's ``comm_dtype`` (no received row is saved between the two ops), then each row's dK/dV back to
  its holder by the reversed all-to-all-v. The compiled backward so moves 2x the forward's bytes
  (eager's autograd keeps the received rows and moves 1x), as the compiled ring re-sends K/V (Note
  [Compiled backward re-sends K/V] in ring.py).

The op talks over the group by name inside its implementation, like torch's functional collectives, and reads
its rank there: unlike the ring's (Note [Rank-specialised compiled graphs] in _compat/__init__.py) the graph is the same
on every rank, so a compile cache shared by the ranks is safe. As for the ring, two independent document calls
on one group in one graph could be ordered differently on different ranks -- successive layers depend on each
other and are fine.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import Tensor

from ..._compat import resolve_process_group
from ..plan.documents import DocumentLayout
from . import doc_blocks
from .doc_exchange import agree_call, exchange_of, options_error

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
    lay = DocumentLayout(cp_size=world, seq_len=order.shape[1], order=order.cpu(), ids=ids.cpu(), key=k)
    _LAYOUTS[(k, world)] = lay
    while len(_LAYOUTS) > _KEEP:
        _LAYOUTS.popitem(last=False)
    return lay


def _window(window: list[int] | None) -> tuple[int, int] | None:
    return None if window is None else (window[0], window[1])


def _exchange(order, ids, key, is_causal, window, scale, group, comm_dtype):
    pg = resolve_process_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    lay = _layout(order, ids, key, world)
    blocks, ex = exchange_of(lay, rank, pg, is_causal=is_causal, window=_window(window), scale=scale,
                             comm_dtype=comm_dtype)
    return lay, rank, world, pg, blocks, ex


@torch.library.custom_op("cp_dtensor::doc_attn", mutates_args=())
def doc_attn(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, order: Tensor, ids: Tensor, key: Tensor,
    document_ids: Tensor | None, error: str | None, is_causal: bool, window: list[int] | None, scale: float,
    group: str, comm_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    """A ``ring_attention`` call with a document layout (Note [Compiled document exchange]): the agreement,
    the exchange and the attention. Returns out [B, Hq, S, Dv] (q's dtype) and lse [B, Hq, S] (fp32)."""
    pg = resolve_process_group(group)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    lay = _layout(order, ids, key, world)
    agree_call(lay, q, k, v, pg, rank=rank, world=world, error=error, document_ids=document_ids, sinks=sinks,
               is_causal=is_causal, window=_window(window), comm_dtype=comm_dtype)
    _, _, _, _, blocks, ex = _exchange(order, ids, key, is_causal, window, scale, group, comm_dtype)
    out, lse, _, _ = doc_blocks.forward(q.contiguous(), k.contiguous(), v.contiguous(), sinks, blocks, ex)
    return out.to(q.dtype).contiguous(), lse.contiguous()


@doc_attn.register_fake
def _(q, k, v, sinks, order, ids, key, document_ids, error, is_causal, window, scale, group, comm_dtype):
    acc = torch.promote_types(q.dtype, torch.float32)
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=acc)


@torch.library.custom_op("cp_dtensor::doc_attn_backward", mutates_args=())
def doc_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor, order: Tensor,
    ids: Tensor, key: Tensor, is_causal: bool, window: list[int] | None, scale: float, group: str,
    comm_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dsinks of :func:`doc_attn` (dsinks [0] without sinks); see Note [Compiled document exchange]."""
    _, _, _, _, blocks, ex = _exchange(order, ids, key, is_causal, window, scale, group, comm_dtype)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    rk, rv = doc_blocks.received_rows(doc_blocks.send_rows(k, v, ex), k, v, ex)  # the rows again: nothing was saved
    dq, dk, dv, dsinks = doc_blocks.backward(dout, q, k, v, rk, rv, out, lse, sinks, blocks, ex)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), q.new_zeros(0) if dsinks is None else dsinks


@doc_attn_backward.register_fake
def _(dout, q, k, v, sinks, out, lse, order, ids, key, is_causal, window, scale, group, comm_dtype):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, order, ids, key, _document_ids, _error, is_causal, window, scale, group, comm_dtype = inputs
    ctx.save_for_backward(q, k, v, sinks, *output, order, ids, key)
    ctx.static = (is_causal, window, scale, group, comm_dtype)


def _backward(ctx, dout, dlse):
    q, k, v, sinks, out, lse, order, ids, key = ctx.saved_tensors
    # lse is an output for the backward, not a differentiable result
    dq, dk, dv, dsinks = doc_attn_backward(dout.contiguous(), q, k, v, sinks, out, lse, order, ids, key, *ctx.static)
    return dq, dk, dv, (dsinks if sinks is not None else None), *([None] * 10)


doc_attn.register_autograd(_backward, setup_context=_setup_context)


def compiled_document_attention(q, k, v, lay: DocumentLayout, *, group=None, is_causal: bool = False,
                                scale: float | None = None, window_size=None, sinks: Tensor | None = None,
                                document_ids: Tensor | None = None, comm_dtype=None, kv_exchange: str = "ring",
                                ulysses_group=None, error: str | None = None) -> Tensor:
    """``document_attention`` (doc_exchange.py) while Dynamo traces: one ``doc_attn`` call that reads only the
    layout's tensors (Note [Compiled document exchange]). An option's error goes to the op, which raises it at
    run time on every rank alike; the output's shape needs q, k, v 4-D (else this trace raises)."""
    group = group if group is not None else dist.group.WORLD
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    err = error or options_error(comm_dtype=comm_dtype, kv_exchange=kv_exchange, window_size=window)
    if err is None and ulysses_group is not None and dist.get_world_size(ulysses_group) > 1:
        err = ("ring_attention with a document layout on a 2-D mesh runs eagerly; under torch.compile pass the "
               "ring's 1-D group (or a layout name for Ulysses x ring).")
    if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, k, v)):
        raise ValueError("ring_attention takes q, k, v as 4-D tensors [B, H, S_local, D].")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = doc_attn(q, k, v, sinks, lay.order, lay.ids, lay.key_tensor, document_ids, err, bool(is_causal),
                      None if err or window is None else list(window), scale, group.group_name,
                      None if err else comm_dtype)
    return out
