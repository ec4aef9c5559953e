"""One ring step against one K/V block, forward and backward, whichever exchange delivered the block
(the ring's rotations, ring.py, or one all-gather, allgather.py); the sinks' final merge.

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
docs/compile.md). CUDA kernels want every head at once: one chunk per block there.
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
from torch import Tensor

from ..plan.layout import step_block
from ..plan.masks import flat_runs, has_pairs, mask_bounds, runs, steps_needed
from ..plan.spec import RingSpec
from .kernels import sdpa_backends
from .ops import (
    block_attn,
    block_attn_backward_into_,
    masked_block_attn,
    masked_block_attn_backward,
    masked_block_attn_merge_,
    merge_,
)

__all__ = ["Mask", "add_sinks", "no_mask", "sinks_grad", "step_backward", "step_forward"]


class Mask:
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

        self._args: dict[tuple[int, int], tuple] = {}  # (rank, src) -> the op's arguments, derived once
        # the CUDA kernels allowed, read once per call (compiled: at trace time): Note [SDPA backend switches]
        self.backends = sdpa_backends()

    @classmethod
    def of(cls, spec: RingSpec, s_local: int, ids: Tensor | None = None) -> Mask:
        """The mask plan of a call (Note [One spec per ring call] in spec.py): ``spec``'s exchange group,
        layout, causality, window and Ulysses union; ``ids`` [P, B, S_local] or None."""
        return cls(spec.layout, spec.world, s_local, spec.is_causal, spec.window, ids, spec.ring_ulysses)

    def keeps(self, rank: int, src: int) -> bool:
        return has_pairs(self.layout, rank, src, self.world, self.s_local, self.lo, self.hi, self.ulysses)

    def args(self, rank: int, src: int) -> tuple:
        """masked_block_attn's arguments after q, k, v (before scale): the same objects for the forward
        and the backward of the call (Note [One plan per call] in masks.py)."""
        if (rank, src) not in self._args:
            q_ids = k_ids = None
            if self.ids is not None:
                q_ids, k_ids = self._row(rank), self._row(src)
            rs = (flat_runs(runs(self.layout, r, self.world, self.s_local, self.ulysses)) for r in (rank, src))
            self._args[rank, src] = (q_ids, k_ids, *rs, self.lo, self.hi)
        return self._args[rank, src]

    def _row(self, r: int) -> Tensor:
        """Rank r's ids [B, S_local]: one view per rank and call."""
        key = (r, -1)
        if key not in self._args:
            self._args[key] = (self.ids[r],)
        return self._args[key][0]


def no_mask(layout: str, world: int, s_local: int, is_causal: bool) -> Mask:
    return Mask(layout, world, s_local, is_causal, None, None)



def step_forward(
    out: Tensor | None, lse: Tensor | None, q: Tensor, kb: Tensor, vb: Tensor, *, rank: int, src: int, mask: Mask,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One step of the loop: q against the K/V block of rank ``src``, merged into (out, lse) -- started
    when None (step 0, the local block, which covers every row). Returns (out, lse)."""
    if mask.active:  # See Note [Masks in the ring]
        if out is None:  # step 0: every query keeps at least itself, so this covers every row
            return masked_block_attn(q, kb, vb, *mask.args(rank, src), scale, mask.backends)
        if mask.keeps(rank, src):
            masked_block_attn_merge_(out, lse, q, kb, vb, *mask.args(rank, src), scale, mask.backends)
        return out, lse
    blk = step_block(mask.layout, rank=rank, src=src, world=mask.world, s_local=mask.s_local, is_causal=mask.causal)
    if blk is not None:
        q_rows, kv_rows = (slice(None), slice(None), blk.q_rows), (slice(None), slice(None), blk.kv_rows)
        out_b, lse_b = block_attn(q[q_rows], kb[kv_rows], vb[kv_rows], blk.causal, scale, mask.backends)
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
    blk, scale: float, acc_dtype: torch.dtype, backends: int = -1,
) -> Tensor:
    """One ring step's backward: adds the block's dq into ``dq`` (allocated when None: step 0, whose
    diagonal block covers every row) and writes its dk, dv into ``dkv`` (flat, [dk | dv] shaped like k
    and v; rows outside ``blk.kv_rows`` untouched). Returns dq. See Note [Backward in head chunks]."""
    first = dq is None
    if first:
        dq = q.new_empty(q.shape, dtype=acc_dtype)
    s = q.shape[2]
    block_attn_backward_into_(
        dq, dkv, dout, q, k, v, out, lse, *_rows(blk.q_rows, s), *_rows(blk.kv_rows, s), blk.causal, scale, not first,
        backends,
    )
    return dq



def step_backward(
    dq: Tensor | None, dout: Tensor, q: Tensor, kb: Tensor, vb: Tensor, out: Tensor, lse: Tensor, *, rank: int,
    src: int, mask: Mask, scale: float,
) -> tuple[Tensor, Tensor | None]:
    """One step of the backward loop: the block of rank ``src``'s share of dq, added into ``dq`` (started
    when None: step 0), and its flat [dk | dv] (None where nothing is kept; the local step's in fp32,
    others in the input dtype). Returns (dq, dkv)."""
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    mine = None
    if mask.active:  # See Note [Masks in the ring]
        if dq is None or mask.keeps(rank, src):
            dq_b, mine = masked_block_attn_backward(dout, q, kb, vb, out, lse, *mask.args(rank, src), scale,
                                                    mask.backends)
            dq = dq_b if dq is None else dq.add_(dq_b)
        return dq, mine
    blk = step_block(mask.layout, rank=rank, src=src, world=mask.world, s_local=mask.s_local, is_causal=mask.causal)
    if blk is not None:
        # allocated from q, not the received block: no data edge from the transfer (compiled schedules)
        alloc = q.new_zeros if blk.kv_rows != slice(None) else q.new_empty
        mine = alloc(kb.numel() + vb.numel(), dtype=acc_dtype if dq is None else kb.dtype)
        dq = _block_backward_(dq, mine, dout, q, kb, vb, out, lse, blk, scale, acc_dtype, mask.backends)
    return dq, mine

