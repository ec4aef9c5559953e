"""The front door: ``ring_attention`` for a process group or a (U, R) mesh -- the call's ``RingSpec``
(spec.py), one preamble (validate, agree, gather the document ids, check them: ``checks.ring_preamble``), then
the exchange, under one autograd Function.

The path of a call: ``ring_attention`` -> ``ring_spec`` (once) -> ``run_ring_attention`` ->
``checks.ring_preamble`` (every rank alike, before any K/V moves) -> on a 2-D mesh the heads all-to-all
(ulysses.py) -> ``_RingAttention`` -> the exchange's forward (ring.py: rotations; allgather.py: one
all-gather) -> blocks.py per block -> ops.py's kernels. Integrations that check more of the call
themselves (hf/, nn/sdpa_mode.py) build the spec with ``ring_spec`` and call ``run_ring_attention`` with their
own local ``error`` and prior agreement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .._compat import function_output
from .._deprecated import old_keywords
from .checks import ring_preamble
from .compute.blocks import Mask, sinks_grad
from .compute.ordering import tie
from .exchange.allgather import allgather_backward, allgather_forward
from .exchange.doc_exchange import document_attention
from .exchange.doc_op import compiled_document_attention
from .exchange.ring import ring_backward, ring_forward
from .exchange.ulysses import gather_heads, kv_replicas, mesh_group, scatter_heads, union_order
from .plan.spec import RingSpec

__all__ = ["plan_attention", "ring_attention", "ring_spec", "run_ring_attention"]

_EXCHANGES = {"ring": (ring_forward, ring_backward), "allgather": (allgather_forward, allgather_backward)}


class _RingAttention(torch.autograd.Function):
    """The exchange of a checked call: (q, k, v, sinks, ids, ready, spec) -> out; see Note [One spec per
    ring call] in spec.py. ``ids``: every rank's document ids [P, B, S_local] or None; ``ready``: the
    agreement's result, compiled (Note [Compiled agreement] in checks.py)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ids, ready, spec: RingSpec):
        if ready is None and ids is not None and torch.compiler.is_compiling():
            ready = ids  # the agreement's result (Note [Compiled agreement] in checks.py)
        mask = Mask.of(spec, q.shape[2], ids)
        out, lse = _EXCHANGES[spec.kv_exchange][0](q, k, v, spec, mask=mask, sinks=sinks, ready=ready)
        if mask.steps == 1:  # no K/V payload took the agreement: the output does (Note [Compiled agreement])
            tie(out, ready)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.spec, ctx.mask = spec, mask
        return function_output(out)  # a copy on torch 2.11 compiling: Note [torch 2.11 to 2.15] in _compat/torch_versions.py

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _EXCHANGES[ctx.spec.kv_exchange][1](dout, q, k, v, out, lse, ctx.spec, mask=ctx.mask)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None


@old_keywords("cp_dtensor.ring_attention", group="mesh")
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mesh: DeviceMesh | dist.ProcessGroup | None = None,
    layout: str = "striped",
    is_causal: bool = False,
    scale: float | None = None,
    comm_dtype: torch.dtype | None = None,
    document_ids: Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    sinks: Tensor | None = None,
    kv_exchange: str = "ring",
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``mesh`` (the CP group: a 1-D DeviceMesh
    or a ProcessGroup; default: the world).

    q, k: [B, Hq | Hkv, S_local, Dqk]; v: [B, Hkv, S_local, Dv] with Hq % Hkv == 0 -- this rank's shards
    in ``layout`` ("striped", "headtail" or "contiguous"; see Note [Sequence layouts] in layout.py), or
    in a ``DocumentLayout`` from ``cp_dtensor.document_layout(ids, P)`` (packed documents placed per batch;
    ``document_ids`` optional, the layout carries them; see Note [Document exchange] in doc_exchange.py).
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

    ``mesh`` may also be a 2-D ``DeviceMesh`` of shape (U, R): heads all-to-all (Ulysses) over the
    first dim, the ring (or the all-gather) over the second. Each rank still passes and gets back its
    shard of 1-D CP over all P = U * R ranks, its rank being its row-major index in the mesh; Hq must
    be a multiple of U. See Note [Ulysses x ring] in ulysses.py.
    """
    if not isinstance(layout, str):  # a DocumentLayout: its own exchange (Note [Document exchange])
        return plan_attention(q, k, v, layout, mesh=mesh, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype,
                              document_ids=document_ids, window_size=window_size, sinks=sinks, kv_exchange=kv_exchange)
    spec = ring_spec(mesh, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype,
                     window_size=window_size, kv_exchange=kv_exchange)
    return run_ring_attention(q, k, v, spec, document_ids=document_ids, sinks=sinks)


def plan_attention(q: Tensor, k: Tensor, v: Tensor, lay, *, mesh, error: str | None = None, **options) -> Tensor:
    """``ring_attention`` with a ``DocumentLayout`` (``cp_dtensor.document_layout``) on a group or a mesh: a
    "documents" placement runs its exchange (doc_exchange.py); a named one the ring in that layout with the
    plan's document ids (Note [One plan per batch] in documents.py). ``error``: a front door's own local
    error, raised on every rank by the call's agreement (as ``run_ring_attention``'s)."""
    if lay.placement != "documents":
        ids = options.pop("document_ids")
        if ids is None:
            ids = lay.local_ids(_cp_rank(mesh))  # on the host, where the ring reads ids (run_ring_attention)
        spec = ring_spec(mesh, layout=lay.placement, is_causal=options.pop("is_causal"), scale=options.pop("scale"),
                         comm_dtype=options.pop("comm_dtype"), window_size=options.pop("window_size"),
                         kv_exchange=options.pop("kv_exchange"))
        if spec.world * spec.ulysses != lay.cp_size:
            raise ValueError(f"ring_attention: {lay!r} was built for {lay.cp_size} ranks; the CP group has "
                             f"{spec.world * spec.ulysses}. Build the plan with this group's size.")
        return run_ring_attention(q, k, v, spec, document_ids=ids, sinks=options.pop("sinks"), error=error)
    group, ulysses_group = mesh, None
    if isinstance(group, DeviceMesh):
        group = mesh_group(group)  # a 1-D mesh's group; a 2-D mesh stays (raises on any other)
        if isinstance(group, DeviceMesh):
            group, ulysses_group = group.get_group(1), group.get_group(0)
    if torch.compiler.is_compiling():  # one custom op pair: Note [Compiled document exchange] in doc_op.py
        return compiled_document_attention(q, k, v, lay, group=group, ulysses_group=ulysses_group, error=error,
                                           **options)
    return document_attention(q, k, v, lay, group=group, ulysses_group=ulysses_group, error=error, **options)


def _cp_rank(mesh) -> int:
    """This rank's index in 1-D CP over ``mesh`` (a group, a 1-D mesh, or a (U, R) mesh row-major)."""
    if isinstance(mesh, DeviceMesh):
        coord = mesh.get_coordinate()
        index = 0
        for c, size in zip(coord, mesh.shape):
            index = index * size + c
        return index
    return dist.get_rank(mesh if mesh is not None else dist.group.WORLD)


def ring_spec(
    group: dist.ProcessGroup | DeviceMesh | None = None, *, layout: str = "striped", is_causal: bool = False,
    scale: float | None = None, comm_dtype: torch.dtype | None = None, window_size: tuple[int, int] | None = None,
    kv_exchange: str = "ring",
) -> RingSpec:
    """The ``RingSpec`` of a ``ring_attention`` call with these options (Note [One spec per ring call] in
    spec.py): ``group`` None is the world; a 1-D mesh its group; a (U, R) mesh the ring over dim 1 and
    the heads all-to-all over dim 0 (Note [Ulysses x ring] in ulysses.py). The options are kept as
    given: :func:`run_ring_attention` checks them, on every rank alike."""
    group = group if group is not None else dist.group.WORLD
    ulysses_group = None
    if isinstance(group, DeviceMesh):
        group = mesh_group(group)  # a 1-D mesh's group; a 2-D mesh stays (raises on any other)
        if isinstance(group, DeviceMesh):
            group, ulysses_group = group.get_group(1), group.get_group(0)  # See Note [Ulysses x ring] in ulysses.py
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    return RingSpec(group=group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype, window=window,
                    kv_exchange=kv_exchange, ulysses_group=ulysses_group)


def run_ring_attention(
    q: Tensor, k: Tensor, v: Tensor, spec: RingSpec, *, document_ids: Tensor | None = None, sinks: Tensor | None = None,
    error: str | None = None, agreed: tuple[int, int] | None = None,
) -> Tensor:
    """``ring_attention`` for a call's ``spec`` (:func:`ring_spec`). ``error``: the caller's own local error
    (e.g. an unsupported argument the module path saw), raised on every rank through the agreement, like
    a bad argument; ``agreed``: see ``checks.ring_preamble`` (the transformers path, which agreed before deriving
    the documents)."""
    if isinstance(document_ids, Tensor) and document_ids.device.type != "cpu":
        # the one host copy of a call with documents: the kernels are chosen per document on the host
        document_ids = document_ids.cpu()
    agreed = ring_preamble(q, k, v, spec, document_ids=document_ids, sinks=sinks, error=error, agreed=agreed)
    if agreed.failed is not None:  # compiled: the agreement raises at run time (Note [Compiled agreement])
        return tie(q.new_zeros((*q.shape[:3], v.shape[3])), agreed.ready)  # tied, so the op is not dropped
    if spec.ulysses_group is None:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return _RingAttention.apply(q, k, v, sinks, agreed.ids, agreed.ready, spec)
    return _two_d(q, k, v, spec, sinks=sinks, ids=agreed.ids, ready=agreed.ready)


def _ring_attention(q, k, v, *, group, layout, is_causal, scale, comm_dtype=None, document_ids=None,
                    window_size=None, sinks=None, kv_exchange="ring", error: str | None = None,
                    agreed: tuple[int, int] | None = None) -> Tensor:
    """:func:`run_ring_attention` with the options spelled out (the entry integrations used before it)."""
    spec = ring_spec(group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype,
                     window_size=window_size, kv_exchange=kv_exchange)
    return run_ring_attention(q, k, v, spec, document_ids=document_ids, sinks=sinks, error=error, agreed=agreed)


def _two_d(q, k, v, spec: RingSpec, *, sinks, ids, ready) -> Tensor:
    """The checked call on a (U, R) mesh; see Note [Ulysses x ring] in ulysses.py. q: [B, Hq, S, Dqk],
    k: [B, Hkv, S, Dqk], v: [B, Hkv, S, Dv], this rank's 1-D layout shard over P = U * R; ``ids``: every
    1-D rank's ids [P, B, S] (p = u * R + r). Returns [B, Hq, S, Dv]."""
    u_, r_, ulysses_group = spec.ulysses, spec.world, spec.ulysses_group
    b, hq, s = q.shape[:3]
    order = torch.tensor(union_order(spec.layout, u_, s), device=q.device)
    if ids is not None:  # [R, B, U * S]: each ring rank's union
        union = ids.view(u_, r_, b, s).permute(1, 2, 0, 3).reshape(r_, b, u_ * s)
        ids = union.index_select(2, order.to(union.device))
    reps = kv_replicas(k.shape[1], u_)
    if reps > 1:  # See Note [GQA under Ulysses] in ulysses.py
        k, v = k.repeat_interleave(reps, 1), v.repeat_interleave(reps, 1)
    u = dist.get_rank(ulysses_group)  # the mesh coordinate on the Ulysses dim
    if sinks is not None:
        sinks = sinks[u * (hq // u_) : (u + 1) * (hq // u_)]
    if ready is None and ids is not None and torch.compiler.is_compiling():
        ready = ids  # See Note [Compiled agreement] in checks.py
    if u_ > 1:
        q, k, v = (scatter_heads(x.contiguous(), ulysses_group, order, ready) for x in (q, k, v))
        ready = None  # the ring's payloads come from the heads all-to-all, after the agreement
    else:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # striped unions are striped shards over R (Note [Ulysses unions] in ulysses.py): RingSpec.ring_ulysses
    out = _RingAttention.apply(q, k, v, sinks, ids, ready, spec)
    if u_ == 1:
        return out
    return gather_heads(out, ulysses_group, torch.argsort(order))
