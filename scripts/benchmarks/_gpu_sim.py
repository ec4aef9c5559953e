"""gpu_check's section (c), P7: P ranks of a causal ring simulated in one process on one device -- every
rank's blockwise steps (cp_dtensor.ops.block_attn / block_attn_backward on the slices layout.step_block
gives) and the ring's own LSE merge, fwd+bwd -- first checked against a reference, then timed against one
causal call over the whole sequence (the blockwise overhead; target <= 1.15)."""

from __future__ import annotations

import statistics
import time

import torch
from _gpu_ranks import compare, worst

from cp_dtensor.core.compute.ops import block_attn, block_attn_backward
from cp_dtensor.core.compute.ops import merge_ as _merge_  # the ring's own merge, so this checks its math
from cp_dtensor.core.plan.layout import shard_tensor, step_block, unshard_tensor


def abs_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """compare()'s error: inf when anything is non-finite."""
    return compare(a, b)["err"]


def _steps(world: int, rank: int, s: int, layout: str):
    """Rank ``rank``'s causal ring steps in order: (source rank, q rows, kv rows, causal), skipped ones left out."""
    for t in range(world):
        src = (rank - t) % world
        blk = step_block(layout, rank=rank, src=src, world=world, s_local=s, is_causal=True)
        if blk is not None:
            yield src, (slice(None), slice(None), blk.q_rows), (slice(None), slice(None), blk.kv_rows), blk.causal


def ring_forward_sim(qs, ks, vs, *, layout: str, scale: float):
    """Every rank's ring forward, one after another. qs[r]: [B, Hq, S, D]; ks[r], vs[r]: [B, Hkv, S, D].
    Returns outs[r] in q's dtype and lses[r]: [B, Hq, S] fp32."""
    world, s = len(qs), qs[0].shape[2]
    outs, lses = [], []
    for r in range(world):
        out = lse = None
        for src, qr, kr, causal in _steps(world, r, s, layout):
            out_b, lse_b = block_attn(qs[r][qr], ks[src][kr], vs[src][kr], causal, scale)
            if out is None:  # step 0, the diagonal block, covers every row
                out, lse = out_b.float(), lse_b.float()
            else:
                _merge_(out[qr], lse[qr], out_b, lse_b)
        outs.append(out.to(qs[r].dtype))
        lses.append(lse)
    return outs, lses


def ring_backward_sim(dos, qs, ks, vs, outs, lses, *, layout: str, scale: float):
    """Every rank's ring backward; dK/dV of a block accumulate where the ring would send them (fp32)."""
    world, s = len(qs), qs[0].shape[2]
    dqs = [torch.zeros_like(q, dtype=torch.float32) for q in qs]
    dks = [torch.zeros_like(k, dtype=torch.float32) for k in ks]
    dvs = [torch.zeros_like(v, dtype=torch.float32) for v in vs]
    for r in range(world):
        for src, qr, kr, causal in _steps(world, r, s, layout):
            dq_b, dk_b, dv_b = block_attn_backward(dos[r][qr], qs[r][qr], ks[src][kr], vs[src][kr], outs[r][qr],
                                                   lses[r][qr], causal, scale)
            dqs[r][qr] += dq_b
            dks[src][kr] += dk_b
            dvs[src][kr] += dv_b
    return dqs, dks, dvs


def _shards(xs, layout, world):
    return [[shard_tensor(x, seq_dim=2, layout=layout, rank=r, cp_size=world).contiguous() for r in range(world)] for x in xs]


def simulate(q, k, v, do, *, layout: str, world: int, scale: float):
    """Full-sequence out, dq, dk, dv of a P-rank ring on q: [B, Hq, N, D], k, v: [B, Hkv, N, D]."""
    qs, ks, vs, dos = _shards((q, k, v, do), layout, world)
    outs, lses = ring_forward_sim(qs, ks, vs, layout=layout, scale=scale)
    grads = ring_backward_sim(dos, qs, ks, vs, outs, lses, layout=layout, scale=scale)
    return [unshard_tensor(x, seq_dim=2, layout=layout) for x in (outs, *grads)]


def single_call(q, k, v, do, *, scale: float):
    """One causal call of the same kernel over the whole sequence: out, dq, dk, dv."""
    out, lse = block_attn(q, k, v, True, scale)
    return [out, *block_attn_backward(do, q, k, v, out, lse, True, scale)]


def reference_by_group(q, k, v, do, *, scale: float, dtype: torch.dtype):
    """Causal attention in ``dtype`` with autograd, one KV head (and its query heads) at a time (memory)."""
    hkv, groups, n = k.shape[1], q.shape[1] // k.shape[1], q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    res = [torch.empty_like(x, dtype=dtype) for x in (q, q, k, v)]
    for h in range(hkv):
        hs = slice(h * groups, (h + 1) * groups)
        qh = q[:, hs].to(dtype).requires_grad_()
        kh, vh = (x[:, h:h + 1].to(dtype).requires_grad_() for x in (k, v))
        p = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        out = p @ vh
        out.backward(do[:, hs].to(dtype))
        res[0][:, hs], res[1][:, hs] = out.detach(), qh.grad
        res[2][:, h:h + 1], res[3][:, h:h + 1] = kh.grad, vh.grad
        del p, out
    return res


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, iters):
    fn()  # warm-up
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sim_inputs(args, n, device, seed):
    g = torch.Generator().manual_seed(seed)
    shape = lambda h: (1, h, n, args.head_dim)  # noqa: E731
    xs = [torch.randn(shape(h), generator=g) for h in (args.q_heads, args.kv_heads, args.kv_heads, args.q_heads)]
    return [x.to(device=device, dtype=torch.bfloat16) for x in xs]


def check_simulation(args, device, n):
    """The simulated ring vs one causal call of the same kernel, both against a reference (float32 on
    CUDA, float64 on CPU): PASS when the ring's error is within 2x the single call's plus 1e-3."""
    ref_dtype = torch.float32 if device.type == "cuda" else torch.float64
    q, k, v, do = _sim_inputs(args, n, device, 0)
    scale = args.head_dim**-0.5
    ref = reference_by_group(q, k, v, do, scale=scale, dtype=ref_dtype)
    single = [abs_rel_err(x, r) for x, r in zip(single_call(q, k, v, do, scale=scale), ref)]
    rows = []
    for layout in args.layouts:
        errs = [abs_rel_err(x, r) for x, r in zip(simulate(q, k, v, do, layout=layout, world=args.sim_world, scale=scale), ref)]
        rows.append(dict(layout=layout, ring_err=errs, single_err=single, worst=worst(errs),
                         ok=worst(single) < float("inf") and all(e <= 2 * s + 1e-3 for e, s in zip(errs, single))))
    return rows


def check_overhead(args, device, n):
    """P^2 simulated steps (fwd+bwd, merges included) / one causal call over N: the blockwise overhead."""
    q, k, v, do = _sim_inputs(args, n, device, 1)
    scale = args.head_dim**-0.5
    t_single = _time(lambda: single_call(q, k, v, do, scale=scale), device, args.iters)
    rows = []
    for layout in args.layouts:
        qs, ks, vs, dos = _shards((q, k, v, do), layout, args.sim_world)

        def ring(qs=qs, ks=ks, vs=vs, dos=dos):  # bound now: the loop deletes its names below
            outs, lses = ring_forward_sim(qs, ks, vs, layout=layout, scale=scale)
            ring_backward_sim(dos, qs, ks, vs, outs, lses, layout=layout, scale=scale)

        t_ring = _time(ring, device, args.iters)
        rows.append(dict(layout=layout, ring_s=t_ring, single_s=t_single, ratio=t_ring / t_single))
        del qs, ks, vs, dos
    best = rows[[r["layout"] for r in rows].index("striped")]["ring_s"] if "striped" in args.layouts else None
    for r in rows:
        r["vs_striped"] = None if best is None else r["ring_s"] / best
        r["meets_target"] = r["ratio"] <= 1.15
    return rows

