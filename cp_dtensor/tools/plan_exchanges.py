"""The planner's comparison of the ways K/V can move (ring, all-gather, Ulysses x ring) for one configuration
(``cp-dtensor plan --island ...``; re-exported by plan.py).

Note [Plan exchanges]
~~~~~~~~~~~~~~~~~~~~~
``compare_exchanges`` costs the three ways the K/V can move (``ring_attention(kv_exchange=...,
group=...)``) on P ranks in islands of G fast-linked ranks (a node's NVLink), ``intra_gbps`` inside an
island and ``inter_gbps`` per rank between islands:

* ring: P - 1 steps, each hiding one K/V block's transfer under one block's compute; a ring that
  leaves the island moves at the inter-island speed (every step waits for its slowest hop).
* allgather: one gather per chunk of K/V heads (2 when Hkv is even), each chunk's transfer under the
  previous chunk's compute, the first exposed; the backward gathers again and reduce-scatters dK/dV
  (Note [All-gather K/V] in allgather.py). Same bytes as the ring in far fewer, larger transfers, but
  the whole sequence's K/V (and in the backward its dK/dV) is held at once.
* U x R: heads all-to-all over U ranks inside an island, the ring over R = P / U ranks between
  islands, on blocks of U * S tokens and lcm(Hkv, U) / U K/V heads (Note [Ulysses x ring] in
  ulysses.py). Each ring step carries the 1-D ring's bytes but U times its compute, so transfers hide
  U times more easily; the all-to-alls (q, k, v in, out back, and their gradients) are exposed.
  Build the mesh so the Ulysses dim is inside the island: mesh[u, r] = rank r * U + u, i.e.
  ``DeviceMesh(device, torch.arange(P).view(R, U).T)``.

Bytes are ``wire.py``'s (what the tests count on the wire). Times are the slowest rank's, from the
FLOPs of Note [Plan FLOPs] at ``tflops`` and the bytes at the link speeds; memory as Note [Plan
memory], with the gathered K/V (allgather) or the all-to-all buffers (U x R) added. The recommendation
is the fastest exchange that fits ``mem_budget_gib`` (ties: less memory). A model, not a measurement:
it ignores latency per message (which favours allgather and U x R at small blocks) and NCCL's
hierarchical all-gather across islands (the model charges it the inter-island speed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..core.plan.wire import ulysses_a2a_bytes
from .plan_ring import (
    BWD_FLOP_FACTOR,
    DTYPE_BYTES,
    GIB,
    PlanInput,
    _rank_pairs,
    _step_work,
    _timing,
    dkv_step_bytes,
    kv_step_bytes,
    memory_bytes,
    ring_steps,
)

__all__ = ["Exchange", "compare_exchanges", "recommend"]


@dataclass(frozen=True)
class Exchange:
    """One way to move K/V for ``inp`` (Note [Plan exchanges]); per rank per attention layer."""

    name: str
    ulysses: int
    ring: int
    kv_exchange: str
    fwd_bytes: int
    bwd_bytes: int
    memory_total: int
    compute_over_comm: float | None
    """Per-transfer compute / transfer time (> 1: the transfers hide); None without transfers."""
    fwd_s: float
    bwd_s: float
    exposed_s: float
    """fwd_s + bwd_s minus the compute: the communication left exposed."""

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def _link(span: int, island: int, intra_gbps: float, inter_gbps: float) -> float:
    """Bytes/s of a collective over ``span`` consecutive ranks: the inter-island speed once it leaves one."""
    return (intra_gbps if span <= island else inter_gbps) * 1e9


def _ring_exchange(inp: PlanInput, name: str, u: int, link: float, a2a_bytes: int, a2a_link: float) -> Exchange:
    """The ring over ``inp.cp`` ranks (the inner ring of U x R when ``u`` > 1), plus exposed all-to-alls."""
    run = replace(inp, link_gbps=link / 1e9)
    kv, dkv = kv_step_bytes(run), dkv_step_bytes(run)
    fpp = 4 * run.batch * run.q_heads * run.head_dim
    steps = _step_work(run)
    t = _timing(run, steps, fpp, kv, dkv)
    n = ring_steps(run)
    compute = sum(w.max_pairs for w in steps) * fpp * (1 + BWD_FLOP_FACTOR) / (run.tflops * 1e12)
    a2a_t = a2a_bytes / a2a_link if a2a_bytes else 0.0
    fwd, bwd = t["fwd_s"] + a2a_t, t["bwd_s"] + a2a_t
    return Exchange(
        name=name, ulysses=u, ring=inp.cp, kv_exchange="ring",
        fwd_bytes=(n - 1) * kv + a2a_bytes, bwd_bytes=(n - 1) * (kv + dkv) + a2a_bytes,
        memory_total=0, compute_over_comm=t["compute_over_comm"] if n > 1 else None,
        fwd_s=fwd, bwd_s=bwd, exposed_s=fwd + bwd - compute,
    )


def _allgather_exchange(inp: PlanInput, name: str, u: int, link: float, a2a_bytes: int, a2a_link: float) -> Exchange:
    """One gather per chunk of K/V heads over ``inp.cp`` ranks; see Note [All-gather K/V] in allgather.py."""
    p, n = inp.cp, 2 if inp.kv_heads % 2 == 0 else 1
    kv, dkv = kv_step_bytes(inp), dkv_step_bytes(inp)
    fpp = 4 * inp.batch * inp.q_heads * inp.head_dim
    c_f = max(_rank_pairs(inp)) * fpp / (inp.tflops * 1e12) / n  # one chunk's forward compute
    c_b = c_f * BWD_FLOP_FACTOR
    g, rs = (p - 1) * kv / n / link, (p - 1) * dkv / n / link  # one chunk's gather, reduce-scatter
    if p == 1:
        g = rs = 0.0
    a2a_t = a2a_bytes / a2a_link if a2a_bytes else 0.0
    fwd = g + (n - 1) * max(c_f, g) + c_f + a2a_t
    bwd = g + (n - 1) * max(c_b, g + rs) + c_b + rs + a2a_t
    return Exchange(
        name=name, ulysses=u, ring=p, kv_exchange="allgather",
        fwd_bytes=(p - 1) * kv + a2a_bytes, bwd_bytes=(p - 1) * (kv + dkv) + a2a_bytes,
        memory_total=0, compute_over_comm=(c_f / g) if g else None,
        fwd_s=fwd, bwd_s=bwd, exposed_s=fwd + bwd - n * (c_f + c_b),
    )


def _allgather_memory(inp: PlanInput) -> int:
    """The ring's memory with its two K/V step buffers (and in the backward its dK/dV hops) replaced by
    the whole sequence's K/V (and the [P, K/V] dK/dV buffers)."""
    m = memory_bytes(inp)
    kv, dkv, p = kv_step_bytes(inp), dkv_step_bytes(inp), inp.cp
    fwd = m["forward_working_set"] - m["forward_messages"] + p * kv
    bwd = m["backward_working_set"] - m["backward_messages"] + p * kv + p * dkv
    return m["saved_all_layers"] + max(fwd, bwd) + m["reserved"]


def compare_exchanges(
    inp: PlanInput, *, island: int, intra_gbps: float, inter_gbps: float, ulysses: list[int] | None = None,
) -> list[Exchange]:
    """Ring, allgather and every U x R (U > 1 dividing P, U <= ``island``, Hq % U == 0, or ``ulysses``)
    for ``inp`` (its ``tflops`` required); see Note [Plan exchanges]."""
    if inp.tflops is None:
        raise ValueError("comparing K/V exchanges needs --tflops (sustained attention TFLOP/s).")
    for name, x in (("island", island), ("intra_gbps", intra_gbps), ("inter_gbps", inter_gbps)):
        if x is None or x <= 0:
            raise ValueError(f"{name} must be positive; got {x}.")
    p = inp.cp
    link = _link(p, island, intra_gbps, inter_gbps)
    out = [_ring_exchange(inp, "ring", 1, link, 0, 1.0), _allgather_exchange(inp, "allgather", 1, link, 0, 1.0)]
    out = [replace(out[0], memory_total=memory_bytes(inp)["total"]), replace(out[1], memory_total=_allgather_memory(inp))]
    us = [u for u in range(2, p + 1) if p % u == 0 and u <= island and inp.q_heads % u == 0] if ulysses is None else ulysses
    for u in us:
        if p % u or inp.q_heads % u:
            raise ValueError(f"Ulysses degree {u} must divide the CP degree ({p}) and the query heads ({inp.q_heads}).")
        r = p // u
        hkv_rep = math.lcm(inp.kv_heads, u)
        inner = replace(inp, cp=r, q_heads=inp.q_heads // u, kv_heads=hkv_rep // u)
        e = DTYPE_BYTES[inp.dtype]
        s = inp.s_local
        d = inp.head_dim
        a2a = ulysses_a2a_bytes(u=u, b=inp.batch, s_local=s, hq=inp.q_heads, hkv=inp.kv_heads, dqk=d, dv=d, itemsize=e)
        a2a_link = _link(u, island, intra_gbps, inter_gbps)
        ring_link = link if r > 1 else a2a_link
        # the received q, k, v are the inner ring's own (counted by memory_bytes(inner)); on top, one
        # all-to-all's staging buffer at a time, at most q-sized
        a2a_mem = inp.batch * s * inp.q_heads * d * e
        for x in ("ring", "allgather"):
            if x == "allgather" and r == 1:
                continue  # Ulysses alone: no K/V exchange left
            make = _ring_exchange if x == "ring" else _allgather_exchange
            ex = make(inner, f"{u}x{r} {x}" if r > 1 else f"{u}x1 (Ulysses)", u, ring_link, a2a, a2a_link)
            mem = (memory_bytes(inner)["total"] if x == "ring" else _allgather_memory(inner)) + a2a_mem
            out.append(replace(ex, ring=r, kv_exchange=x, memory_total=mem))
    return out


def recommend(exchanges: list[Exchange], *, mem_budget_gib: float | None = None) -> Exchange | None:
    """The fastest exchange within ``mem_budget_gib`` per rank (ties: less memory); None if none fits."""
    fits = [x for x in exchanges if mem_budget_gib is None or x.memory_total <= mem_budget_gib * GIB]
    return min(fits, key=lambda x: (round(x.total_s, 9), x.memory_total), default=None)
