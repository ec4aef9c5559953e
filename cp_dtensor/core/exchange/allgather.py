"""The all-gather K/V exchange: ``ring_attention(..., kv_exchange="allgather")``.

Note [All-gather K/V]
~~~~~~~~~~~~~~~~~~~~~
Instead of P - 1 ring rotations, every rank gathers every rank's K/V (Llama 3's choice, torch CP's
default): one collective per chunk of K/V heads, which a fast fabric moves as large transfers and a
slow one no worse than the ring. The steps are the ring's, same order, same per-step code
(``blocks.step_forward`` / ``blocks.step_backward``), so every layout and mask is exact in the same way;
only where block ``src`` comes from changes.

Overlap per chunk: the K/V heads are split in ``gather_chunks`` chunks (2 when Hkv is even, else 1),
each with its query heads; heads are independent, so each chunk is a whole attention of its own.

* Forward: chunk 0's gather is posted, then for each chunk c: its local block (step 0), post the
  gather of chunk c + 1, wait for chunk c's, its other blocks -- so every gather but the first
  travels under the previous chunk's blocks, and the first under chunk 0's local block.
* Backward: the same gathers again (as the ring re-sends K/V; ``after(k, dout)`` keeps them in the
  backward graph when compiled, Note [Compiled backward re-sends K/V] in ring.py). Each block's dK/dV
  share goes into row ``src`` of a [P, chunk K/V] buffer in the input dtype, and one reduce-scatter
  per chunk sums row r over every rank into rank r (the ring's accumulators travel in the input dtype
  too); it is posted when the chunk's blocks are done and waited on after the last chunk, so it
  travels under the next chunk's blocks.

Bytes per rank per layer (``wire.allgather_bytes``): forward (P - 1) * B * S * Hkv * (Dqk + Dv) *
itemsize (the payload, ``comm_dtype`` applies); backward that again plus (P - 1) * B * S * Hkv *
(Dqk + Dv) * itemsize of the reduce-scatters -- the ring's totals exactly, in 2 + 4 collectives
(two chunks) instead of (P - 1) + (P - 1). A window that needs few steps gathers every block all the
same (use the ring).

Memory (the price): the forward holds two chunks' gathered K/V, i.e. the whole sequence's K/V of this
layer with 2 chunks, P * S * Hkv * (Dqk + Dv) * itemsize (the ring holds two blocks, 2 * S * Hkv *
(Dqk + Dv) * itemsize); the backward also holds each chunk's [P, K/V] dK/dV buffer until its
reduce-scatter is waited on: up to as much again. Nothing gathered is saved for the backward. On a
2-D mesh the gathers run over the ring dim, on blocks of U * S tokens (Note [Ulysses x ring]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..compute.blocks import Mask, add_sinks, step_backward, step_forward
from ..compute.ordering import after, tie
from ..plan.spec import RingSpec, as_spec
from .comm import all_gather, reduce_scatter, unpack, wait
from .payload import decode_kv, encode_kv

__all__ = ["allgather_forward", "allgather_backward", "gather_chunks"]


def gather_chunks(q: Tensor, k: Tensor) -> list[tuple[slice, slice]]:
    """(q heads, K/V heads) of each gathered chunk; see Note [All-gather K/V]."""
    hq, hkv = q.shape[1], k.shape[1]
    n = 2 if hkv % 2 == 0 else 1
    g, c = hq // hkv, hkv // n
    return [(slice(i * c * g, (i + 1) * c * g), slice(i * c, (i + 1) * c)) for i in range(n)]


def _heads(x: Tensor, h: slice) -> Tensor:
    return x[:, h]


def allgather_forward(
    q: Tensor, k: Tensor, v: Tensor, spec: RingSpec | None = None, *, mask: Mask | None = None,
    sinks: Tensor | None = None, ready: Tensor | None = None, **options,
) -> tuple[Tensor, Tensor]:
    """``ring.ring_forward`` with every block from all-gathers. q: [B, Hq, S, Dqk]; k: [B, Hkv, S, Dqk];
    v: [B, Hkv, S, Dv]. Returns out [B, Hq, S, Dv] (q's dtype) and lse [B, Hq, S] (fp32/fp64)."""
    spec = as_spec(spec, options, "allgather_forward")
    group, comm_dtype, scale = spec.group, spec.comm_dtype, spec.softmax_scale(q.shape[-1])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mask = mask if mask is not None else Mask.of(spec, q.shape[2])
    chunks = gather_chunks(q, k)

    def post(i: int) -> Tensor | None:  # [P * n] of chunk i's encoded K/V, posted
        if mask.steps <= 1 or i >= len(chunks):
            return None
        hs = chunks[i][1]
        buf = encode_kv(_heads(k, hs), _heads(v, hs), comm_dtype)
        return all_gather(tie(buf, ready) if i == 0 else buf, group)  # chunk 0 after the agreement (compiled)

    outs, lses = [], []
    nxt = post(0)
    for i, (qh, kh) in enumerate(chunks):
        qc, kc, vc = _heads(q, qh), _heads(k, kh), _heads(v, kh)
        out, lse = step_forward(None, None, qc, kc, vc, rank=rank, src=rank, mask=mask, scale=scale)
        cur, nxt = nxt, post(i + 1)
        if cur is not None:
            every = wait(cur, group).view(world, -1)  # [P, n]: row p is rank p's encoded K/V of this chunk
            for step in range(1, mask.steps):
                src = (rank - step) % world
                kb, vb = decode_kv(every[src], kc, vc, comm_dtype)
                out, lse = step_forward(out, lse, qc, kb, vb, rank=rank, src=src, mask=mask, scale=scale)
                del kb, vb
            del every
        outs.append(out)
        lses.append(lse)
    out, lse = (outs[0], lses[0]) if len(chunks) == 1 else (torch.cat(outs, 1), torch.cat(lses, 1))
    out, lse = add_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def allgather_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: RingSpec | None = None,
    *, mask: Mask | None = None, **options,
) -> tuple[Tensor, Tensor, Tensor]:
    """``ring.ring_backward`` with the blocks from all-gathers and dK/dV from reduce-scatters."""
    spec = as_spec(spec, options, "allgather_backward")
    group, comm_dtype, scale = spec.group, spec.comm_dtype, spec.softmax_scale(q.shape[-1])
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mask = mask if mask is not None else Mask.of(spec, q.shape[2])
    dout = dout.contiguous()
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    chunks = gather_chunks(q, k)
    kk, vv = (after(k, dout), after(v, dout)) if torch.compiler.is_compiling() and mask.steps > 1 else (k, v)

    def post(i: int) -> Tensor | None:
        if mask.steps <= 1 or i >= len(chunks):
            return None
        hs = chunks[i][1]
        return all_gather(encode_kv(_heads(kk, hs), _heads(vv, hs), comm_dtype), group)

    dqs, owns = [], []  # per chunk: dq, and (own dK/dV share, its reduce-scatter in flight or None)
    nxt = post(0)
    for i, (qh, kh) in enumerate(chunks):
        qc, kc, vc = _heads(q, qh), _heads(k, kh), _heads(v, kh)
        dc, oc, lc = _heads(dout, qh), _heads(out, qh), _heads(lse, qh)
        dq, own = step_backward(None, dc, qc, kc, vc, oc, lc, rank=rank, src=rank, mask=mask, scale=scale)
        own = own.to(acc_dtype)
        cur, nxt = nxt, post(i + 1)
        rs = None
        if cur is not None:
            every = wait(cur, group).view(world, -1)
            shares = kc.new_zeros(world, kc.numel() + vc.numel())  # row p: this rank's share of p's dK/dV
            for step in range(1, mask.steps):
                src = (rank - step) % world
                kb, vb = decode_kv(every[src], kc, vc, comm_dtype)
                dq, mine = step_backward(dq, dc, qc, kb, vb, oc, lc, rank=rank, src=src, mask=mask, scale=scale)
                if mine is not None:
                    shares[src] = mine
                del kb, vb, mine
            del every
            rs = reduce_scatter(shares.view(-1), group)  # waited on after the last chunk
            del shares
        dqs.append(dq)
        owns.append((own, rs, kc, vc))
    dks, dvs = [], []
    for own, rs, kc, vc in owns:
        if rs is not None:
            own += wait(rs, group)
        dk, dv = unpack(own, kc, vc)
        dks.append(dk)
        dvs.append(dv)
    if len(chunks) > 1:
        dq, dk, dv = torch.cat(dqs, 1), torch.cat(dks, 1), torch.cat(dvs, 1)
    else:
        dq, dk, dv = dqs[0], dks[0], dvs[0]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
