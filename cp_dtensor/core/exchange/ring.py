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
from torch import Tensor

from ..compute.blocks import Mask, add_sinks, step_backward, step_forward
from ..compute.ordering import after, tie
from ..plan.spec import RingSpec, as_spec
from .comm import RingComm, join_bytes, split_bytes, unpack
from .payload import decode_kv, encode_kv

__all__ = ["ring_backward", "ring_forward"]


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, spec: RingSpec | None = None, *, mask: Mask | None = None,
    sinks: Tensor | None = None, ready: Tensor | None = None, **options,
) -> tuple[Tensor, Tensor]:
    """Unchecked ring forward on local shards over ``spec.group`` (compiled: the first transfer waits for
    ``ready``, Note [Compiled agreement] in checks.py). q, k: [B, H, S, Dqk]; v: [B, Hkv, S, Dv].
    ``mask``: the call's plan (default ``Mask.of(spec, S)``: no documents). Returns out: [B, Hq, S, Dv]
    in q's dtype and lse: [B, Hq, S] fp32 (fp64 for fp64 inputs), both with the sinks (Note [Attention
    sinks]) when given. (``options``: the keywords taken before the spec, which warn.)"""
    spec = as_spec(spec, options, "ring_forward")
    comm = RingComm(spec.group)
    rank, scale = comm.rank, spec.softmax_scale(q.shape[-1])
    mask = mask if mask is not None else Mask.of(spec, q.shape[2])
    out = lse = None  # fp32 accumulators (fp64 for fp64 inputs), started by the local step
    kv = tie(encode_kv(k, v, spec.comm_dtype), ready) if mask.steps > 1 else None
    for step in range(mask.steps):
        if step + 1 < mask.steps:
            kv_next = comm.rotate(kv)  # posted before this step's compute: overlap
        kb, vb = (k, v) if step == 0 else decode_kv(kv, k, v, spec.comm_dtype)
        out, lse = step_forward(out, lse, q, kb, vb, rank=rank, src=comm.src_at(step), mask=mask, scale=scale)
        del kb, vb  # views of the block just used: free it before the next one arrives
        if step + 1 < mask.steps:
            kv = comm.wait(kv_next)
    out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def _flat_kv(k: Tensor, v: Tensor, dtype: torch.dtype, *, zero: bool) -> Tensor:
    """A flat [dk | dv] buffer shaped for k and v (v's head size may differ from k's)."""
    return (k.new_zeros if zero else k.new_empty)(k.numel() + v.numel(), dtype=dtype)


class _Messages:
    """The backward's one message a step: [the accumulator finished last step | the next step's K/V],
    either part absent where the step has none. See Note [One message per backward step]."""

    def __init__(self, comm: RingComm, acc: tuple[int, torch.dtype], kv: tuple[int, torch.dtype] | None):
        self.comm, self.acc, self.kv = comm, acc, kv  # (numel, dtype) of each part
        self.compiling = torch.compiler.is_compiling()
        self.pending = None  # the accumulator to send with the next message
        self.carrier = None  # the message received last, [pending | K/V] updated in place: sent as it is
        self.joined = None  # the message received last when it had both parts
        self.last = None  # the last message received: what a message of ours must come after (compiled)
        self.parts = (False, False)  # (accumulator, K/V) of the message in flight

    def post(self, kv: Tensor | None) -> Tensor | None:
        """Send [pending | kv] to the next rank; returns the message in flight (None: nothing to send)."""
        acc, has_kv = self.pending, kv is not None
        if acc is not None and has_kv:
            buf = self.carrier if self.carrier is not None else join_bytes(acc, kv)
        elif acc is not None:  # tied to the last message received: see Note [One message per backward step]
            buf = after(acc, self.last) if self.compiling else acc
        else:
            buf = kv
        self.parts, self.pending, self.carrier = (acc is not None, has_kv), None, None
        return None if buf is None else self.comm.rotate(buf)

    def receive(self, msg: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """Wait for ``msg``: (the accumulator that arrived, the K/V that arrived), either None."""
        if msg is None:
            return None, None
        got = self.last = self.comm.wait(msg)
        has_acc, has_kv = self.parts
        if has_acc and has_kv:
            self.joined = got
            return tuple(split_bytes(got, self.acc, self.kv))
        return (got, None) if has_acc else (None, got)

    def send_on(self, acc: Tensor, *, reuse: bool) -> None:
        """``acc`` leaves with the next message; ``reuse``: ``acc`` is the received [acc | K/V] message's
        own part, updated in place, and the next message has both parts -- send that buffer as it is."""
        self.pending = acc
        if reuse and self.joined is not None:
            self.carrier = self.joined
        self.joined = None

    def home(self, acc: Tensor, steps_back: int) -> Tensor:
        """Post the last accumulator straight to its block's owner, ``steps_back`` ranks back."""
        self.joined = None
        return self.comm.rotate(after(acc, self.last) if self.compiling else acc, shift=-steps_back)


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: RingSpec | None = None,
    *, mask: Mask | None = None, **options,
) -> tuple[Tensor, Tensor, Tensor]:
    """Unchecked ring backward on local shards; see Note [Ring backward]. ``out`` and ``lse`` are the
    forward's final ones (with sinks, if any). Returns dq, dk, dv. (``options``: as :func:`ring_forward`.)"""
    spec = as_spec(spec, options, "ring_backward")
    comm = RingComm(spec.group)
    rank, scale, comm_dtype = comm.rank, spec.softmax_scale(q.shape[-1]), spec.comm_dtype
    mask = mask if mask is not None else Mask.of(spec, q.shape[2])
    steps = mask.steps
    dout = dout.contiguous()
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    dq = None  # started by step 0, whose diagonal block covers every row
    own = None  # [dk | dv] of this rank's block: step 0's share, then the accumulator coming home
    if steps > 1 and torch.compiler.is_compiling():  # See Note [Compiled backward re-sends K/V]
        kv = encode_kv(after(k, dout), after(v, dout), comm_dtype)
    else:
        kv = encode_kv(k, v, comm_dtype) if steps > 1 else None
    messages = _Messages(comm, (k.numel() + v.numel(), k.dtype), None if kv is None else (kv.numel(), kv.dtype))
    home = None  # the accumulator of the last block held, on its way to the block's owner
    for step in range(steps):
        msg = messages.post(kv if step + 1 < steps else None)
        kb, vb = (k, v) if step == 0 else decode_kv(kv, k, v, comm_dtype)
        # mine: this rank's share of the block it holds, in the accumulator's layout
        dq, mine = step_backward(dq, dout, q, kb, vb, out, lse, rank=rank, src=comm.src_at(step), mask=mask, scale=scale)
        del kb, vb  # free this step's block before the next one arrives
        kv = None
        incoming, kv = messages.receive(msg)
        del msg
        if step == 0:
            own = mine.to(acc_dtype)
            continue
        mine = None if mine is None else mine.to(k.dtype)
        # the accumulator of the block held now: from the rank that held it before (from step 2 on)
        acc = incoming if incoming is not None else mine if mine is not None else _flat_kv(k, v, k.dtype, zero=True)
        if incoming is not None and mine is not None:
            acc += mine
        reuse = incoming is not None  # acc is the received message's own part, updated in place
        del mine, incoming
        if step + 1 < steps:  # on to the rank that holds this block next, with the next message
            messages.send_on(acc, reuse=reuse and step + 2 < steps)
        else:  # from the last step straight to the block's owner
            home = messages.home(acc, step)
        del acc
    kv = None  # the last block held: free it before the accumulator comes home
    if home is not None:
        own += comm.wait(home)
    dk, dv = unpack(own, k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
