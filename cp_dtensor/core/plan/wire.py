"""Bytes on the wire per rank per attention layer for each K/V exchange: ring, all-gather, Ulysses x ring.

Pure arithmetic, torch-free (the planner imports it). Every count is what one rank *sends to other
ranks* in one layer's forward and backward, i.e. what ``debug.CommBytes`` counts, and excludes the
agreement check (``check_bytes``) and the document ids' gather. ``itemsize`` is the input dtype's
bytes; the K/V payload may travel in another dtype (``comm_itemsize``) or as float8 with one exponent
byte per row (``fp8``; Note [float8 ring payload] in payload.py); dK/dV always travel in the input
dtype. ``steps`` is the ring steps a window needs (masks.steps_needed; default: all of them).
"""

from __future__ import annotations

import math

from .layout import payload_bytes

__all__ = ["FINGERPRINT_INTS", "KV_EXCHANGES", "allgather_bytes", "check_bytes", "kv_message_bytes", "ring_bytes", "ulysses_a2a_bytes", "ulysses_bytes"]


def kv_message_bytes(
    b: int, s_local: int, hkv: int, dqk: int, dv: int, itemsize: int, *, comm_itemsize: int | None = None,
    fp8: bool = False,
) -> int:
    """One K/V block, K [B, Hkv, S, Dqk] and V [B, Hkv, S, Dv], in its wire format."""
    itemsize = 1 if fp8 else (comm_itemsize or itemsize)
    return payload_bytes(rows=b * hkv * s_local, head_dim=dqk, v_head_dim=dv, itemsize=itemsize, fp8=fp8)


def _dkv_bytes(b: int, s_local: int, hkv: int, dqk: int, dv: int, itemsize: int) -> int:
    return payload_bytes(rows=b * hkv * s_local, head_dim=dqk, v_head_dim=dv, itemsize=itemsize)


def _totals(fwd: int, bwd: int) -> dict[str, int]:
    return {"fwd": fwd, "bwd": bwd, "total": fwd + bwd}


def ring_bytes(
    *, p: int, b: int, s_local: int, hkv: int, dqk: int, dv: int, itemsize: int, comm_itemsize: int | None = None,
    fp8: bool = False, steps: int | None = None,
) -> dict[str, int]:
    """``kv_exchange="ring"`` on ``p`` ranks: (steps - 1) K/V messages forward; the backward sends K/V
    again and the dK/dV accumulators, (steps - 1) each (Note [Ring backward] in ring.py)."""
    steps = p if steps is None else steps
    kv = kv_message_bytes(b, s_local, hkv, dqk, dv, itemsize, comm_itemsize=comm_itemsize, fp8=fp8)
    dkv = _dkv_bytes(b, s_local, hkv, dqk, dv, itemsize)
    return _totals((steps - 1) * kv, (steps - 1) * (kv + dkv))


def allgather_bytes(
    *, p: int, b: int, s_local: int, hkv: int, dqk: int, dv: int, itemsize: int, comm_itemsize: int | None = None,
    fp8: bool = False, steps: int | None = None,
) -> dict[str, int]:
    """``kv_exchange="allgather"`` on ``p`` ranks: one all-gather forward ((p - 1) messages sent), one
    more and a reduce-scatter of dK/dV ((p - 1) / p of a [p, K/V] buffer) backward; nothing when a
    window needs only the local step (Note [All-gather K/V] in allgather.py)."""
    steps = p if steps is None else steps
    if steps <= 1:
        return _totals(0, 0)
    kv = kv_message_bytes(b, s_local, hkv, dqk, dv, itemsize, comm_itemsize=comm_itemsize, fp8=fp8)
    dkv = _dkv_bytes(b, s_local, hkv, dqk, dv, itemsize)
    return _totals((p - 1) * kv, (p - 1) * (kv + dkv))


def ulysses_a2a_bytes(*, u: int, b: int, s_local: int, hq: int, hkv: int, dqk: int, dv: int, itemsize: int) -> int:
    """The heads all-to-alls of one forward on a (u, r) mesh (q, k, v in, out back): each sends (u - 1) of
    its u equal parts; K/V heads as lcm(hkv, u) (Note [GQA under Ulysses] in ulysses.py)."""
    hkv_rep = math.lcm(hkv, u)
    return (u - 1) * b * (s_local * (hq // u * dqk + hkv_rep // u * (dqk + dv) + hq // u * dv)) * itemsize


def ulysses_bytes(
    *, u: int, r: int, b: int, s_local: int, hq: int, hkv: int, dqk: int, dv: int, itemsize: int,
    kv_exchange: str = "ring", comm_itemsize: int | None = None, fp8: bool = False, steps: int | None = None,
) -> dict[str, int]:
    """A (u, r) mesh (Note [Ulysses x ring] in ulysses.py), ``s_local`` = N / (u * r): the heads
    all-to-alls (q, k, v in; out back; their gradients in the backward), each sending (u - 1) of its u
    equal parts, plus the ring or all-gather over ``r`` ranks on unions of u * s_local tokens and
    lcm(hkv, u) / u K/V heads (Note [GQA under Ulysses]). ``steps``: of the ring over r."""
    hkv_rep = math.lcm(hkv, u)
    a2a = ulysses_a2a_bytes(u=u, b=b, s_local=s_local, hq=hq, hkv=hkv, dqk=dqk, dv=dv, itemsize=itemsize)
    inner = (allgather_bytes if kv_exchange == "allgather" else ring_bytes)(
        p=r, b=b, s_local=u * s_local, hkv=hkv_rep // u, dqk=dqk, dv=dv, itemsize=itemsize,
        comm_itemsize=comm_itemsize, fp8=fp8, steps=steps,
    )
    return _totals(a2a + inner["fwd"], a2a + inner["bwd"])  # the backward's all-to-alls mirror the forward's


KV_EXCHANGES = ("ring", "allgather")  # ring_attention(kv_exchange=...) and [cp_dtensor] kv_exchange
FINGERPRINT_INTS = 20  # int64 fields per rank in the agreement check (checks.Fingerprint)


def check_bytes(p: int, u: int = 1, fields: int = FINGERPRINT_INTS) -> int:
    """The agreement check's all-gather(s) of ``fields`` int64 per rank (Note [Agreeing before the ring]
    in checks.py): over the ring group, then (on a 2-D mesh) the Ulysses group."""
    r = p // u
    return 8 * fields * ((r - 1) + (u - 1) * r)
