"""Per-(rank, step) causal work of the ring, for bench_ring.py: exact pair counts and measured block times.

Pure parts (no process group): the work table from layout math, a brute-force count for tests, the
balance ratio P2, standalone block timing in one process, and the planner's time prediction.

Tables are ``table[rank][step]``; at step t rank r holds the K/V block of rank (r - t) mod P, as in
cp_dtensor.comm.RingComm.src_at.
"""

from __future__ import annotations

import time

import torch

from cp_dtensor.core.compute.ops import block_attn, block_attn_backward
from cp_dtensor.core.plan.layout import local_positions, step_block, step_pairs
from cp_dtensor.tools.plan import PlanInput, make_plan

PLAN_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _slice_len(sl: slice, n: int) -> int:
    return len(range(*sl.indices(n)))


def work_table(layout: str, world: int, s_local: int) -> list[list[int]]:
    """Kept pairs per (rank, step) of a causal ring: cp_dtensor.layout.step_pairs (step_block's slices)."""
    return [[step_pairs(layout, rank=r, src=(r - t) % world, s_local=s_local) for t in range(world)]
            for r in range(world)]


def brute_force_table(layout: str, world: int, s_local: int) -> list[list[int]]:
    """The same table counted over global positions: pairs (i, j) with pos_k[j] <= pos_q[i]."""
    n = world * s_local
    pos = [local_positions(layout=layout, rank=r, cp_size=world, seq_len=n) for r in range(world)]
    return [
        [int((pos[(r - t) % world][None, :] <= pos[r][:, None]).sum()) for t in range(world)]
        for r in range(world)
    ]


def balance(table: list[list[float]]) -> float:
    """P2: the busiest rank's total work over the mean rank's."""
    totals = [sum(row) for row in table]
    return max(totals) / (sum(totals) / len(totals))


def critical_path(table: list[list[float]]) -> float:
    """Sum over steps of the slowest rank's work: a step lasts as long as its slowest rank."""
    return sum(max(row[t] for row in table) for t in range(len(table[0])))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(q, k, v, blk, scale: float, *, repeats: int = 1) -> float:
    """Seconds of one block's fwd+bwd kernel calls (cp_dtensor.ops), best of ``repeats`` after a warm-up."""
    if blk is None:
        return 0.0
    qs, ks, vs = q[:, :, blk.q_rows], k[:, :, blk.kv_rows], v[:, :, blk.kv_rows]
    qs, ks, vs = qs.contiguous(), ks.contiguous(), vs.contiguous()
    do = torch.ones_like(qs)
    best = float("inf")
    for i in range(repeats + 1):
        _sync(q.device)
        t0 = time.perf_counter()
        out, lse = block_attn(qs, ks, vs, blk.causal, scale)
        block_attn_backward(do, qs, ks, vs, out, lse, blk.causal, scale)
        _sync(q.device)
        if i:  # the first call is the warm-up
            best = min(best, time.perf_counter() - t0)
    return best


def measured_table(layout: str, world: int, q, k, v, *, repeats: int = 1, progress=None,
                   cache: dict | None = None) -> list[list[float]]:
    """Seconds per (rank, step): every rank's causal block of every step run standalone in this process.
    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] -- one shard's shape (the values do not change the time).
    Blocks of the same slices cost the same, so each distinct one is timed once (``cache`` may be shared
    between calls with the same q, k, v)."""
    s_local, scale = q.shape[2], q.shape[-1] ** -0.5
    cache = {} if cache is None else cache
    table = []
    for r in range(world):
        row = []
        for t in range(world):
            blk = step_block(layout, rank=r, src=(r - t) % world, world=world, s_local=s_local, is_causal=True)
            key = None if blk is None else (blk.q_rows.indices(s_local), blk.kv_rows.indices(s_local), blk.causal)
            if key not in cache:
                cache[key] = time_block(q, k, v, blk, scale, repeats=repeats)
            row.append(cache[key])
            if progress is not None:
                progress.update(1)
        table.append(row)
    return table


def calibrate_tflops(t_causal_s: float, *, s_local: int, batch: int, q_heads: int, head_dim: int) -> float:
    """Sustained TFLOP/s of one causal S x S block fwd+bwd, counted as tools/plan.py counts (Note [Plan FLOPs])."""
    plan = make_plan(PlanInput(seq_len=s_local, cp=1, head_dim=head_dim, q_heads=q_heads, kv_heads=1, dtype="fp32",
                               batch=batch))
    return plan.fwd_bwd_flops_max_rank / t_causal_s / 1e12


def plan_ring_seconds(*, layout: str, world: int, s_local: int, batch: int, q_heads: int, kv_heads: int,
                      head_dim: int, dtype: torch.dtype, tflops: float, link_gbps: float) -> float:
    """The planner's forward+backward ring time (tools/plan.py's step timeline with overlap)."""
    inp = PlanInput(seq_len=s_local * world, cp=world, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads,
                    dtype=PLAN_DTYPES[dtype], layout=layout, batch=batch, tflops=tflops, link_gbps=link_gbps)
    timing = make_plan(inp).timing
    return timing["fwd_s"] + timing["bwd_s"]


def _cpu_q_split(rows: int) -> int:
    # the split the CPU flash kernel picks from the query length (kv tiles are always 512 wide)
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def tile_pairs(rows: int, cols: int, causal: bool, *, kv_tile: int = 512) -> int:
    """(query, key) pairs the CPU flash kernel actually computes for one block: with a causal mask it
    skips only whole kv tiles past a query tile's last row, so a partly masked tile costs in full."""
    if not causal:
        return rows * cols
    q_tile, total = _cpu_q_split(rows), 0
    for m in range(0, rows, q_tile):
        qb = min(q_tile, rows - m)
        total += qb * min(cols, -(-min(m + qb, cols) // kv_tile) * kv_tile)
    return total


def tile_table(layout: str, world: int, s_local: int) -> list[list[int]]:
    """Like :func:`work_table`, counting the kernel's tiles instead of kept pairs."""
    table = []
    for r in range(world):
        row = []
        for t in range(world):
            blk = step_block(layout, rank=r, src=(r - t) % world, world=world, s_local=s_local, is_causal=True)
            row.append(0 if blk is None else tile_pairs(_slice_len(blk.q_rows, s_local),
                                                        _slice_len(blk.kv_rows, s_local), blk.causal))
        table.append(row)
    return table


def tile_ring_seconds(layout: str, world: int, s_local: int, *, seconds_per_pair: float) -> float:
    """Compute-only ring fwd+bwd time with tile-counted work: the sum over steps of the slowest rank's
    tile pairs, at ``seconds_per_pair`` (calibrate with a measured causal block / its tile_pairs)."""
    return critical_path(tile_table(layout, world, s_local)) * seconds_per_pair
