"""The ring loop, forward and backward, parameterised by layout: one loop for every layout.

Note [Online softmax merge]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Softmax over a row needs the whole row, but a ring rank only ever sees one K/V block of it at a time.
Each block's kernel returns its normalised output o_b and its log-sum-exp lse_b = log sum_j exp(s_j).
Two partial results of disjoint key sets combine exactly:

    lse = logaddexp(lse_a, lse_b)
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)
        = o_a - sigmoid(lse_b - lse_a) * (o_a - o_b)            # stable merge: no exp() can overflow

We accumulate o and lse in fp32 whatever the input dtype, and start from the local (diagonal) block,
which every row attends to, so no row ever merges two -inf log-sum-exps.

Note [Ring backward]
~~~~~~~~~~~~~~~~~~~~
With the final o and lse of the forward, the kernel's backward on one block yields exactly that
block's share of dq, dk, dv (P = exp(s - lse) and D = rowsum(do * o) are those of the full rows).
dq stays local. K/V rotate again as in the forward; the dK/dV of the block a rank holds at step t >= 1
travel in an accumulator that rides one step behind: rank r adds its share of block (r - t) and sends
the sum to r + 1, which holds that block at step t + 1. After the last step the accumulator arrives
at the block's owner, which adds its own (step 0) share. So K/V and dK/dV each travel P - 1 times.

Note [One message per backward step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The accumulator a rank finishes at the end of step t leaves with the K/V it posts at the start of
step t + 1 -- one message [accumulator | K/V], byte-joined, to the same neighbour -- and arrives when
that message is waited on, after the neighbour's step t + 1 block: the same time as a separate send
right after step t, with one collective a step instead of two. The reason is order. Every message is
built from what the previous one delivered, so the backward's transfers form a single chain that no
scheduler can reorder; two independent chains (K/V rotations and accumulator hops) could be issued
in different orders on different ranks by Inductor (whose graphs differ per rank), and two transfers
of equal size would then silently swap. Where a message carries only an accumulator that the data
does not tie to the previous message (a step with no kept pair contributes zeros), compiled graphs
tie it with ``cp_dtensor::after``.

Note [Compiled backward re-sends K/V]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Compiled, forward and backward are one joint graph until AOTAutograd splits them. The backward's
K/V rotations would rotate the very tensors the forward rotated, so the joint graph would merge them
with the forward's (pure functions of the same inputs), and AOTAutograd, which never recomputes a
collective, would then save every block the forward received: O(N) K/V per attention layer, P - 1
blocks more than eager. The backward instead starts its K/V from ``cp_dtensor::after(k, dout)``: an
opaque copy that cannot exist before the backward's input, so its rotations are the backward's own,
scheduled in the backward graph like eager's, and the forward saves only q, k, v, out and lse. The
price is one K/V copy per call and the bytes of eager (the backward sends K/V again: 2x the forward).

Note [Backward in head chunks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The backward's peak memory is reached inside a step t >= 1: the K/V block held and the next one
arriving, the accumulator being sent and the next one arriving, plus the kernel's fresh dq, dk, dv
for the block. dq alone is as big as q, Hq heads -- for Llama-like GQA (Hq = 8 Hkv) four times the
whole K/V block. On CPU the backward kernel parallelises over (batch, head) pairs only, so calling it
per group of KV heads (with their Hq / Hkv query heads) loses no parallelism as long as every call
still has one pair per thread; each call's dq then goes straight into the accumulator, and the
transient shrinks to one group's. dk and dv go straight into the accumulator's layout, so there is no
separate copy for the send. The chunks live inside one mutating custom op,
``cp_dtensor::block_attn_backward_into_`` (ops.py), so compiled graphs get them too: traced per chunk,
functionalization would copy the accumulator for every chunk's slice update (measured: compiled peak
1.23x eager), while the op writes in place and Inductor re-inplaces it (compiled peak as eager's; see
the README's torch.compile section). CUDA kernels want every head at once: one chunk per block there.
Note [Masks in the ring]
~~~~~~~~~~~~~~~~~~~~~~~~
Documents and windows (see Note [Masked ring steps] in masks.py) change what each step computes, not
the loop: a masked step calls ``masked_block_attn`` (one kernel per kept rectangle) where an unmasked
one calls ``block_attn`` on one slice. Three things follow from the mask:

* Every query keeps at least itself, so the local step 0 still covers every row and starts the
  accumulators; later steps may leave rows untouched (their lse is -inf and the merge keeps them).
* A window shortens the ring: ``steps_needed`` (static, the same on every rank) is one more than the
  last step whose block any rank needs; the K/V rotations stop there. In the backward, the dK/dV
  accumulator of the last step goes straight home (rank r - t) instead of around the rest of the ring.
* Document ids are gathered once per call, before any K/V moves (they also settle whether the ids
  are valid, on every rank: Note [Agreeing before the ring] in checks.py), in the narrowest integer
  type that holds the spread of the global ids: 1-4 bytes per token, against 2 * Hkv * D * itemsize
  for its K/V. Every step then reads the ids of the block it holds from that gathered table. The
  kernels are chosen per document on the host, so the ids live there: on a GPU a call with documents
  makes exactly one device-to-host copy (of this rank's ids) and gathers them over the CP group's
  gloo twin; a call without documents makes none.

Note [Attention sinks]
~~~~~~~~~~~~~~~~~~~~~~
A sink (gpt-oss) adds exp(sink_h) to every softmax denominator of head h, with no value: it is one
more "block" whose output is 0 and whose lse is sink_h. It joins once, after the ring:
lse' = logaddexp(lse, sink), out' = out * exp(lse - lse'). The backward kernels, given out' and lse',
already yield the exact dq, dk, dv (P = exp(s - lse') are the probabilities with the sink, and
D = rowsum(dout * out') is unchanged by a value-less key), and d sink_h = -sum_i exp(sink_h - lse'_i)
* rowsum(dout_i * out'_i) over this rank's queries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .checks import check_documents, check_ring_args
from .comm import RingComm, gather_ids, host_group, join_bytes, split_bytes, unpack
from .layout import step_block
from .masks import flat_runs, has_pairs, mask_bounds, runs, steps_needed
from .ops import (
    after,
    block_attn,
    block_attn_backward_into_,
    masked_block_attn,
    masked_block_attn_backward,
    masked_block_attn_merge_,
    merge_,
)
from .payload import decode_kv, encode_kv

__all__ = ["ring_attention", "ring_forward", "ring_backward"]


class _Mask:
    """What a call masks, for the ring loop: the window's bounds and the gathered document ids.
    ``ids``: [P, B, S_local] (every rank's ids, any integer dtype) or None."""

    def __init__(
        self, layout: str, world: int, s_local: int, is_causal: bool, window, ids: Tensor | None, ulysses: int = 1
    ):
        self.lo, self.hi = mask_bounds(is_causal, window)
        self.ids, self.causal = ids, is_causal
        self.layout, self.world, self.s_local, self.ulysses = layout, world, s_local, ulysses
        # a window with no lower bound and at most the causal upper bound is plain (non-)causal attention
        self.active = ids is not None or self.lo is not None or (self.hi is not None and not (is_causal and self.hi == 0))
        # a Ulysses union of contiguous / headtail shards is no 1-D layout: its runs say what each step
        # keeps (See Note [Ulysses unions] in ulysses.py)
        self.active |= ulysses > 1 and layout != "striped" and self.hi is not None
        self.steps = steps_needed(layout, world, s_local, self.lo, self.hi, ulysses) if self.active else world

    def keeps(self, rank: int, src: int) -> bool:
        return has_pairs(self.layout, rank, src, self.world, self.s_local, self.lo, self.hi, self.ulysses)

    def args(self, rank: int, src: int) -> tuple:
        """masked_block_attn's arguments after q, k, v (before scale)."""
        q_ids = k_ids = None
        if self.ids is not None:
            q_ids, k_ids = self.ids[rank], self.ids[src]
        rs = (flat_runs(runs(self.layout, r, self.world, self.s_local, self.ulysses)) for r in (rank, src))
        return (q_ids, k_ids, *rs, self.lo, self.hi)


def _no_mask(layout: str, world: int, s_local: int, is_causal: bool) -> _Mask:
    return _Mask(layout, world, s_local, is_causal, None, None)


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float,
    comm_dtype: torch.dtype | None = None, mask: _Mask | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Unchecked ring forward on local shards. q, k: [B, H, S, Dqk]; v: [B, Hkv, S, Dv].
    Returns out: [B, Hq, S, Dv] in q's dtype and lse: [B, Hq, S] fp32 (fp64 for fp64 inputs), both
    with the sinks (Note [Attention sinks]) when given."""
    comm = RingComm(group)
    world, rank, s_local = comm.world, comm.rank, q.shape[2]
    mask = mask if mask is not None else _no_mask(layout, world, s_local, is_causal)
    out = lse = None  # fp32 accumulators (fp64 for fp64 inputs), started by the local step
    kv = encode_kv(k, v, comm_dtype) if mask.steps > 1 else None
    for step in range(mask.steps):
        if step + 1 < mask.steps:
            kv_next = comm.rotate(kv)  # posted before this step's compute: overlap
        kb, vb = (k, v) if step == 0 else decode_kv(kv, k, v, comm_dtype)
        out, lse = step_forward(out, lse, q, kb, vb, rank=rank, src=comm.src_at(step), mask=mask, scale=scale)
        del kb, vb  # views of the block just used: free it before the next one arrives
        if step + 1 < mask.steps:
            kv = comm.wait(kv_next)
    out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def step_forward(
    out: Tensor | None, lse: Tensor | None, q: Tensor, kb: Tensor, vb: Tensor, *, rank: int, src: int, mask: _Mask,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One step of the loop: q against the K/V block of rank ``src``, merged into (out, lse) -- started
    when None (step 0, the local block, which covers every row). Returns (out, lse)."""
    if mask.active:  # See Note [Masks in the ring]
        if out is None:  # step 0: every query keeps at least itself, so this covers every row
            return masked_block_attn(q, kb, vb, *mask.args(rank, src), scale)
        if mask.keeps(rank, src):
            masked_block_attn_merge_(out, lse, q, kb, vb, *mask.args(rank, src), scale)
        return out, lse
    blk = step_block(mask.layout, rank=rank, src=src, world=mask.world, s_local=mask.s_local, is_causal=mask.causal)
    if blk is not None:
        q_rows, kv_rows = (slice(None), slice(None), blk.q_rows), (slice(None), slice(None), blk.kv_rows)
        out_b, lse_b = block_attn(q[q_rows], kb[kv_rows], vb[kv_rows], blk.causal, scale)
        if out is None:  # step 0: the diagonal block covers every row
            acc_dtype = torch.promote_types(q.dtype, torch.float32)
            return out_b.to(acc_dtype), lse_b.to(acc_dtype)
        merge_(out[q_rows], lse[q_rows], out_b, lse_b)
    return out, lse


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out, lse) with the sinks joined; see Note [Attention sinks]."""
    if sinks is None:
        return out, lse
    sink = sinks.to(lse.dtype)[None, :, None]
    total = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - total).unsqueeze(-1), total


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks [Hq] from this rank's queries; see Note [Attention sinks]."""
    acc = lse.dtype
    p_sink = torch.exp(sinks.to(acc)[None, :, None] - lse)  # [B, Hq, S]
    d = (dout.to(acc) * out.to(acc)).sum(-1)
    return -(p_sink * d).sum((0, 2)).to(sinks.dtype)


def _rows(rows: slice, n) -> tuple:
    """[start, stop) of ``rows`` (a step's row slice: None or in-range bounds) over ``n`` rows."""
    start = 0 if rows.start is None else rows.start if rows.start >= 0 else n + rows.start
    stop = n if rows.stop is None else rows.stop if rows.stop >= 0 else n + rows.stop
    return start, stop


def _block_backward_(
    dq: Tensor | None, dkv: Tensor, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    blk, scale: float, acc_dtype: torch.dtype,
) -> Tensor:
    """One ring step's backward: adds the block's dq into ``dq`` (allocated when None: step 0, whose
    diagonal block covers every row) and writes its dk, dv into ``dkv`` (flat, [dk | dv] shaped like k
    and v; rows outside ``blk.kv_rows`` untouched). Returns dq. See Note [Backward in head chunks]."""
    first = dq is None
    if first:
        dq = q.new_empty(q.shape, dtype=acc_dtype)
    s = q.shape[2]
    block_attn_backward_into_(
        dq, dkv, dout, q, k, v, out, lse, *_rows(blk.q_rows, s), *_rows(blk.kv_rows, s), blk.causal, scale, not first
    )
    return dq


def _flat_kv(k: Tensor, v: Tensor, dtype: torch.dtype, *, zero: bool) -> Tensor:
    """A flat [dk | dv] buffer shaped for k and v (v's head size may differ from k's)."""
    return (k.new_zeros if zero else k.new_empty)(k.numel() + v.numel(), dtype=dtype)


def step_backward(
    dq: Tensor | None, dout: Tensor, q: Tensor, kb: Tensor, vb: Tensor, out: Tensor, lse: Tensor, *, rank: int,
    src: int, mask: _Mask, scale: float,
) -> tuple[Tensor, Tensor | None]:
    """One step of the backward loop: the block of rank ``src``'s share of dq, added into ``dq`` (started
    when None: step 0), and its flat [dk | dv] (None where nothing is kept; the local step's in fp32,
    others in the input dtype). Returns (dq, dkv)."""
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    mine = None
    if mask.active:  # See Note [Masks in the ring]
        if dq is None or mask.keeps(rank, src):
            dq_b, mine = masked_block_attn_backward(dout, q, kb, vb, out, lse, *mask.args(rank, src), scale)
            dq = dq_b if dq is None else dq.add_(dq_b)
        return dq, mine
    blk = step_block(mask.layout, rank=rank, src=src, world=mask.world, s_local=mask.s_local, is_causal=mask.causal)
    if blk is not None:
        # allocated from q, not the received block: no data edge from the transfer (compiled schedules)
        alloc = q.new_zeros if blk.kv_rows != slice(None) else q.new_empty
        mine = alloc(kb.numel() + vb.numel(), dtype=acc_dtype if dq is None else kb.dtype)
        dq = _block_backward_(dq, mine, dout, q, kb, vb, out, lse, blk, scale, acc_dtype)
    return dq, mine


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float, comm_dtype: torch.dtype | None = None,
    mask: _Mask | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Unchecked ring backward on local shards; see Note [Ring backward]. ``out`` and ``lse`` are the
    forward's final ones (with sinks, if any). Returns dq, dk, dv."""
    comm = RingComm(group)
    world, rank, s_local = comm.world, comm.rank, q.shape[2]
    mask = mask if mask is not None else _no_mask(layout, world, s_local, is_causal)
    steps = mask.steps
    dout = dout.contiguous()
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    n_acc = k.numel() + v.numel()
    dq = None  # started by step 0, whose diagonal block covers every row
    own = None  # [dk | dv] of this rank's block: step 0's share, then the accumulator coming home
    if steps > 1 and torch.compiler.is_compiling():  # See Note [Compiled backward re-sends K/V]
        kv = encode_kv(after(k, dout), after(v, dout), comm_dtype)
    else:
        kv = encode_kv(k, v, comm_dtype) if steps > 1 else None
    kv_spec = None if kv is None else (kv.numel(), kv.dtype)
    compiling = torch.compiler.is_compiling()
    last = None  # the last message received: what a message of ours must come after
    pending = carrier = None  # the accumulator of the block held at the previous step, to send on
    home = None  # the accumulator of the last block held, on its way to the block's owner
    for step in range(steps):
        # One message a step: [the previous step's accumulator | the next step's K/V]; see Note [One
        # message per backward step].
        has_acc, has_kv = pending is not None, step + 1 < steps
        if has_acc and has_kv:  # the message received last step, updated in place, when it has this shape
            buf = carrier if carrier is not None else join_bytes(pending, kv)
        elif has_acc:  # tied to the last message received: see Note [One message per backward step]
            buf = after(pending, last) if compiling else pending
        else:
            buf = kv if has_kv else None
        msg = comm.rotate(buf) if buf is not None else None
        buf = carrier = pending = None
        kb, vb = (k, v) if step == 0 else decode_kv(kv, k, v, comm_dtype)
        # mine: this rank's share of the block it holds, in the accumulator's layout
        dq, mine = step_backward(dq, dout, q, kb, vb, out, lse, rank=rank, src=comm.src_at(step), mask=mask, scale=scale)
        # Free this step's block before the next one arrives.
        del kb, vb
        kv = incoming = joined = None
        if msg is not None:
            got = last = comm.wait(msg)
            if has_acc and has_kv:
                joined = got
                incoming, kv = split_bytes(got, (n_acc, k.dtype), kv_spec)
            elif has_acc:
                incoming = got
            else:
                kv = got
            del got, msg
        if step == 0:
            own = mine.to(acc_dtype)
            continue
        mine = None if mine is None else mine.to(k.dtype)
        # the accumulator of the block held now: from the rank that held it before (from step 2 on)
        acc = incoming if incoming is not None else mine if mine is not None else _flat_kv(k, v, k.dtype, zero=True)
        if incoming is not None and mine is not None:
            acc += mine
        del mine, incoming
        if step + 1 < steps:
            pending = acc  # on to the rank that holds this block next, with the next message
            if joined is not None and step + 2 < steps:
                carrier = joined  # [acc | K/V] in place: the next message as it is, no copy
        else:  # from the last step straight to the block's owner
            home = comm.rotate(after(acc, last) if compiling else acc, shift=-step)
        del acc, joined
    kv = None  # the last block held: free it before the accumulator comes home
    if home is not None:
        own += comm.wait(home)
    dk, dv = unpack(own, k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _exchange(kv_exchange: str):
    """(forward, backward) of a K/V exchange: the ring, or one all-gather (allgather.py)."""
    if kv_exchange == "allgather":
        from .allgather import allgather_backward, allgather_forward

        return allgather_forward, allgather_backward
    return ring_forward, ring_backward


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, layout, is_causal, scale, comm_dtype, window, ids, ulysses=1,
                kv_exchange="ring"):
        mask = _Mask(layout, dist.get_world_size(group), q.shape[2], is_causal, window, ids, ulysses)
        opts = dict(group=group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype, mask=mask)
        out, lse = _exchange(kv_exchange)[0](q, k, v, sinks=sinks, **opts)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.opts, ctx.kv_exchange = opts, kv_exchange
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _exchange(ctx.kv_exchange)[1](dout, q, k, v, out, lse, **ctx.opts)
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None, None, None


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
                    window_size=None, sinks=None, kv_exchange="ring", error: str | None = None) -> Tensor:
    """``ring_attention`` with a caller's own local ``error`` (e.g. an unsupported argument the module
    path saw) that raises on every rank through the agreement check, like a bad argument."""
    group = group if group is not None else dist.group.WORLD
    if isinstance(group, DeviceMesh):
        from .ulysses import mesh_group, ulysses_attention

        group = mesh_group(group)  # a 1-D mesh's group; a 2-D mesh stays (raises on any other)
        if isinstance(group, DeviceMesh):
            return ulysses_attention(q, k, v, mesh=group, layout=layout, is_causal=is_causal, scale=scale,
                                     comm_dtype=comm_dtype, document_ids=document_ids, window_size=window_size,
                                     sinks=sinks, kv_exchange=kv_exchange, error=error)
    if isinstance(document_ids, Tensor) and document_ids.device.type != "cpu":
        # the one host copy of a call with documents: the kernels are chosen per document on the host
        document_ids = document_ids.cpu()
    scale, id_range = check_ring_args(
        q, k, v, group=group, layout=layout, is_causal=is_causal, scale=scale, comm_dtype=comm_dtype,
        document_ids=document_ids, window_size=window_size, sinks=sinks, kv_exchange=kv_exchange, error=error,
    )
    ids = None
    if document_ids is not None:
        ids = gather_ids(document_ids, host_group(group), id_range)  # [P, B, S_local] on the host, before K/V moves
        check_documents(ids, layout, group)
    window = None if window_size is None else tuple(int(w) for w in window_size)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _RingAttention.apply(q, k, v, sinks, group, layout, is_causal, scale, comm_dtype, window, ids, 1, kv_exchange)
