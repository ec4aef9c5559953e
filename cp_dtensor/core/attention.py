"""The front door: ``ring_attention`` for a process group or a (U, R) mesh -- one preamble (validate,
agree, gather the document ids, check them: ``checks.agree``), then the exchange, under one autograd
Function.

The path of a call: ``ring_attention`` -> ``checks.agree`` (every rank alike, before any K/V moves) ->
on a 2-D mesh the heads all-to-all (ulysses.py) -> ``_RingAttention`` -> the exchange's forward
(ring.py: rotations; allgather.py: one all-gather) -> blocks.py per block -> ops.py's kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .allgather import allgather_backward, allgather_forward
from .blocks import Mask, sinks_grad
from .checks import agree
from .ops import tie
from .ring import ring_backward, ring_forward
from .ulysses import gather_heads, kv_replicas, mesh_group, scatter_heads, union_order

__all__ = ["ring_attention"]

_EXCHANGES = {"ring": (ring_forward, ring_backward), "allgather": (allgather_forward, allgather_backward)}


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, layout, is_causal, scale, comm_dtype, window, ids, ulysses, kv_exchange,
                ready):
        if ready is None and ids is not None and torch.compiler.is_compiling():
            ready = ids  # the agreement's result (Note [Compiled agreement] in checks.py)
        mask = Mask(layout, dist.get_world_size(group), q.shape[2], is_causal, window, ids, ulysses)
        opts = dict(group=group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype, mask=mask)
        out, lse = _EXCHANGES[kv_exchange][0](q, k, v, sinks=sinks, ready=ready, **opts)
        if mask.steps == 1:  # no K/V payload took the agreement: the output does (Note [Compiled agreement])
            tie(out, ready)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.opts, ctx.kv_exchange = opts, kv_exchange
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _EXCHANGES[ctx.kv_exchange][1](dout, q, k, v, out, lse, **ctx.opts)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    layout: str = "striped",
    is_causal: bool = False,
    scale: float | None = None,
    comm_dtype: torch.dtype | None = None,
    document_ids: Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    sinks: Tensor | None = None,
    kv_exchange: str = "ring",
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group`` (default: world).

    q, k: [B, Hq | Hkv, S_local, Dqk]; v: [B, Hkv, S_local, Dv] with Hq % Hkv == 0 -- this rank's shards
    in ``layout`` ("striped", "headtail" or "contiguous"; see Note [Sequence layouts] in layout.py).
    Returns this rank's output shard [B, Hq, S_local, Dv] in q's dtype, equal to full-sequence
    attention masked by global position. Differentiable in q, k, v and ``sinks``. Only K/V heads
    travel: (P - 1) * S_local * (Dqk + Dv) * Hkv * itemsize bytes per forward per rank (fewer steps
    under a window). ``comm_dtype`` (off by default) sends K/V in another dtype; a float8 dtype sends
    float8 with power-of-two row scales, about half the bytes of bf16 -- see Note [float8 ring payload]
    in payload.py.

    Masks (Note [Masked ring steps] in masks.py); a pair is kept when every rule holds:

    * ``is_causal``: key position <= query position.
    * ``document_ids``: int [B, S_local], this rank's layout shard of global ids that never decrease
      along the sequence: a query attends only to keys of its own document (packed sequences; llama4's
      chunked attention is documents that also change every chunk).
    * ``window_size=(left, right)``: query i attends keys i - left <= j <= i + right; -1 is unbounded
      (flash-attn's convention).
    * ``sinks``: [Hq] per-head logits (not multiplied by ``scale``, no value vector) added to every
      softmax denominator (gpt-oss), the same on every rank. ``sinks.grad`` is *this rank's* queries'
      contribution; like any replicated parameter's gradient it must be summed over the CP group (FSDP
      and DDP over a mesh that includes CP do it; standalone, ``reduce_gradients``).

    ``scale=None`` is 1/sqrt(Dqk), as in ``F.scaled_dot_product_attention``.

    ``kv_exchange="allgather"`` replaces the ring by one all-gather of K/V (and, in the backward, one
    more and a reduce-scatter of dK/dV): fewer, larger messages, (P - 1) * S_local * (Dqk + Dv) * Hkv
    * itemsize bytes each, and this layer's whole-sequence K/V in memory -- see Note [All-gather K/V]
    in allgather.py.

    ``group`` may also be a 2-D ``DeviceMesh`` of shape (U, R): heads all-to-all (Ulysses) over the
    first dim, the ring (or the all-gather) over the second. Each rank still passes and gets back its
    shard of 1-D CP over all P = U * R ranks, its rank being its row-major index in the mesh; Hq must
    be a multiple of U. See Note [Ulysses x ring] in ulysses.py.
    """
    return _ring_attention(q, k, v, group=group, layout=layout, is_causal=is_causal, scale=scale,
                           comm_dtype=comm_dtype, document_ids=document_ids, window_size=window_size, sinks=sinks,
                           kv_exchange=kv_exchange)


def _ring_attention(q, k, v, *, group, layout, is_causal, scale, comm_dtype=None, document_ids=None,
                    window_size=None, sinks=None, kv_exchange="ring", error: str | None = None,
                    agreed: tuple[int, int] | None = None) -> Tensor:
    """``ring_attention`` with a caller's own local ``error`` (e.g. an unsupported argument the module
    path saw) that raises on every rank through the agreement check, like a bad argument; ``agreed``:
    see ``checks.agree`` (the transformers path, which agreed before deriving the documents)."""
    group = group if group is not None else dist.group.WORLD
    mesh = None
    if isinstance(group, DeviceMesh):
        group = mesh_group(group)  # a 1-D mesh's group; a 2-D mesh stays (raises on any other)
        if isinstance(group, DeviceMesh):
            mesh, group = group, group.get_group(1)  # See Note [Ulysses x ring] in ulysses.py
    u_ = 1 if mesh is None else mesh.shape[0]
    groups = (group,) if mesh is None else (group, mesh.get_group(0))  # (ring, Ulysses): all P ranks
    if isinstance(document_ids, Tensor) and document_ids.device.type != "cpu":
        # the one host copy of a call with documents: the kernels are chosen per document on the host
        document_ids = document_ids.cpu()
    agreed = agree(
        q, k, v, groups=groups, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype,
        document_ids=document_ids, window_size=window_size, sinks=sinks, kv_exchange=kv_exchange, ulysses=u_,
        error=error, agreed=agreed,
    )
    if agreed.failed is not None:  # compiled: the agreement raises at run time (Note [Compiled agreement])
        return tie(q.new_zeros((*q.shape[:3], v.shape[3])), agreed.ready)  # tied, so the op is not dropped
    window = None if window_size is None else tuple(int(w) for w in window_size)
    if mesh is None:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return _RingAttention.apply(q, k, v, sinks, group, layout, is_causal, agreed.scale, comm_dtype, window,
                                    agreed.ids, 1, kv_exchange, agreed.ready)
    return _two_d(q, k, v, mesh=mesh, layout=layout, is_causal=is_causal, scale=agreed.scale, comm_dtype=comm_dtype,
                  ids=agreed.ids, ready=agreed.ready, window=window, sinks=sinks, kv_exchange=kv_exchange)


def _two_d(q, k, v, *, mesh: DeviceMesh, layout, is_causal, scale, comm_dtype, ids, ready, window, sinks,
           kv_exchange) -> Tensor:
    """The checked call on a (U, R) mesh; see Note [Ulysses x ring] in ulysses.py. q: [B, Hq, S, Dqk],
    k: [B, Hkv, S, Dqk], v: [B, Hkv, S, Dv], this rank's 1-D layout shard over P = U * R; ``ids``: every
    1-D rank's ids [P, B, S] (p = u * R + r). Returns [B, Hq, S, Dv]."""
    u_, r_ = mesh.shape
    ulysses_group, ring_group = mesh.get_group(0), mesh.get_group(1)
    b, hq, s = q.shape[:3]
    order = torch.tensor(union_order(layout, u_, s), device=q.device)
    if ids is not None:  # [R, B, U * S]: each ring rank's union
        union = ids.view(u_, r_, b, s).permute(1, 2, 0, 3).reshape(r_, b, u_ * s)
        ids = union.index_select(2, order.to(union.device))
    reps = kv_replicas(k.shape[1], u_)
    if reps > 1:  # See Note [GQA under Ulysses] in ulysses.py
        k, v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
    u = mesh.get_local_rank(0)
    if sinks is not None:
        sinks = sinks[u * (hq // u_) : (u + 1) * (hq // u_)]
    if ready is None and ids is not None and torch.compiler.is_compiling():
        ready = ids  # See Note [Compiled agreement] in checks.py
    if u_ > 1:
        q, k, v = (scatter_heads(x.contiguous(), ulysses_group, order, ready) for x in (q, k, v))
        ready = None  # the ring's payloads come from the heads all-to-all, after the agreement
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # striped unions are striped shards over R (Note [Ulysses unions] in ulysses.py): the plain 1-D ring
    ring_ulysses = 1 if layout == "striped" else u_
    out = _RingAttention.apply(
        q, k, v, sinks, ring_group, layout, is_causal, scale, comm_dtype, window, ids, ring_ulysses, kv_exchange, ready
    )
    if u_ == 1:
        return out
    return gather_heads(out, ulysses_group, torch.argsort(order))
