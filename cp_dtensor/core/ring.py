"""The ring exchange: K/V blocks rotate around the CP group, one step of blocks.py per block held.

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

"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .blocks import Mask, add_sinks, no_mask, step_backward, step_forward
from .comm import RingComm, join_bytes, split_bytes, unpack
from .ops import after, tie
from .payload import decode_kv, encode_kv

__all__ = ["ring_backward", "ring_forward"]


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float,
    comm_dtype: torch.dtype | None = None, mask: Mask | None = None, sinks: Tensor | None = None,
    ready: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Unchecked ring forward on local shards (compiled: the first transfer waits for ``ready``, Note
    [Compiled agreement] in checks.py). q, k: [B, H, S, Dqk]; v: [B, Hkv, S, Dv].
    Returns out: [B, Hq, S, Dv] in q's dtype and lse: [B, Hq, S] fp32 (fp64 for fp64 inputs), both
    with the sinks (Note [Attention sinks]) when given."""
    comm = RingComm(group)
    world, rank, s_local = comm.world, comm.rank, q.shape[2]
    mask = mask if mask is not None else no_mask(layout, world, s_local, is_causal)
    out = lse = None  # fp32 accumulators (fp64 for fp64 inputs), started by the local step
    kv = tie(encode_kv(k, v, comm_dtype), ready) if mask.steps > 1 else None
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



def _flat_kv(k: Tensor, v: Tensor, dtype: torch.dtype, *, zero: bool) -> Tensor:
    """A flat [dk | dv] buffer shaped for k and v (v's head size may differ from k's)."""
    return (k.new_zeros if zero else k.new_empty)(k.numel() + v.numel(), dtype=dtype)



def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float, comm_dtype: torch.dtype | None = None,
    mask: Mask | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Unchecked ring backward on local shards; see Note [Ring backward]. ``out`` and ``lse`` are the
    forward's final ones (with sinks, if any). Returns dq, dk, dv."""
    comm = RingComm(group)
    world, rank, s_local = comm.world, comm.rank, q.shape[2]
    mask = mask if mask is not None else no_mask(layout, world, s_local, is_causal)
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

