"""The all-gather K/V exchange: ``ring_attention(..., kv_exchange="allgather")``.

Note [All-gather K/V]
~~~~~~~~~~~~~~~~~~~~~
Instead of P - 1 ring rotations, every rank gathers every rank's K/V once (Llama 3's choice, torch CP's
default): one collective of (P - 1) blocks, which a fast fabric moves as one large transfer and a slow
one no worse than the ring. The steps are the ring's, same order, same per-step code
(``ring.step_forward`` / ``ring.step_backward``), so every layout and mask is exact in the same way;
only where block ``src`` comes from changes.

* Forward: the gather is posted, the local block (step 0) is computed while it travels, then the
  other blocks, each read from the gathered buffer.
* Backward: the gather again (as the ring re-sends K/V; ``after(k, dout)`` keeps it in the backward
  graph when compiled, Note [Compiled backward re-sends K/V] in ring.py), the local block's backward
  while it travels; each other block's dK/dV share goes into row ``src`` of a [P, K/V] buffer in the
  input dtype, and one reduce-scatter sums row r over every rank into rank r (the ring's accumulators
  travel in the input dtype too).

Bytes per rank per layer (``wire.allgather_bytes``): forward (P - 1) * B * S * Hkv * (Dqk + Dv) *
itemsize (the payload, ``comm_dtype`` applies); backward that again plus (P - 1) * B * S * Hkv *
(Dqk + Dv) * itemsize of the reduce-scatter -- the ring's totals exactly, in 1 + 2 collectives instead
of P - 1 + (P - 1). A window that needs few steps gathers every block all the same (use the ring).

Memory (the price): the forward holds the whole sequence's K/V of this layer, P * S * Hkv * (Dqk + Dv)
* itemsize (the ring holds two blocks); the backward holds that plus the [P, K/V] dK/dV buffer of the
same size, against the ring's two blocks and two accumulators. Nothing gathered is saved for the
backward. Overlap: the local block's compute hides the gather (and on a 2-D mesh this runs over the
ring dim, on blocks of U * S tokens); the gathered blocks then compute back to back, and the
reduce-scatter is waited on at once -- a gloo/CPU or one-layer view; on a GPU the next layer's work
would follow it on the stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import all_gather, reduce_scatter, unpack, wait
from .ops import after
from .payload import decode_kv, encode_kv
from .ring import _Mask, _no_mask, add_sinks, step_backward, step_forward

__all__ = ["allgather_forward", "allgather_backward"]


def allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float,
    comm_dtype: torch.dtype | None = None, mask: _Mask | None = None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``ring.ring_forward`` with every block from one all-gather. q: [B, Hq, S, Dqk]; k: [B, Hkv, S,
    Dqk]; v: [B, Hkv, S, Dv]. Returns out [B, Hq, S, Dv] (q's dtype) and lse [B, Hq, S] (fp32/fp64)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mask = mask if mask is not None else _no_mask(layout, world, q.shape[2], is_causal)
    every = all_gather(encode_kv(k, v, comm_dtype), group) if mask.steps > 1 else None  # [P * n], posted
    out, lse = step_forward(None, None, q, k, v, rank=rank, src=rank, mask=mask, scale=scale)  # meanwhile
    if every is not None:
        every = wait(every, group).view(world, -1)  # [P, n]: row p is rank p's encoded K/V
        for step in range(1, mask.steps):
            src = (rank - step) % world
            kb, vb = decode_kv(every[src], k, v, comm_dtype)
            out, lse = step_forward(out, lse, q, kb, vb, rank=rank, src=src, mask=mask, scale=scale)
            del kb, vb
    out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def allgather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    *, group: dist.ProcessGroup, layout: str, is_causal: bool, scale: float, comm_dtype: torch.dtype | None = None,
    mask: _Mask | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``ring.ring_backward`` with the blocks from one all-gather and dK/dV from one reduce-scatter."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mask = mask if mask is not None else _no_mask(layout, world, q.shape[2], is_causal)
    dout = dout.contiguous()
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    every = None
    if mask.steps > 1:
        kk, vv = (after(k, dout), after(v, dout)) if torch.compiler.is_compiling() else (k, v)
        every = all_gather(encode_kv(kk, vv, comm_dtype), group)  # posted; step 0 computes meanwhile
        del kk, vv
    dq, own = step_backward(None, dout, q, k, v, out, lse, rank=rank, src=rank, mask=mask, scale=scale)
    own = own.to(acc_dtype)
    if every is not None:
        every = wait(every, group).view(world, -1)
        n = k.numel() + v.numel()
        shares = k.new_zeros(world, n)  # row p: this rank's share of rank p's dK/dV (own row stays 0)
        for step in range(1, mask.steps):
            src = (rank - step) % world
            kb, vb = decode_kv(every[src], k, v, comm_dtype)
            dq, mine = step_backward(dq, dout, q, kb, vb, out, lse, rank=rank, src=src, mask=mask, scale=scale)
            if mine is not None:
                shares[src] = mine
            del kb, vb, mine
        every = None  # free the gathered K/V before the reduce-scatter's buffer arrives
        own += wait(reduce_scatter(shares.view(-1), group), group)
    dk, dv = unpack(own, k, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
