"""One GPU, one command: the real ring on CUDA tensors, its host syncs, the blockwise overhead at 128k,
and peak memory per rank against the planner. Writes DIR/gpu_check.json and DIR/gpu_check.md.

    python scripts/benchmarks/gpu_check.py --out bench_out/gpu_check            # one CUDA GPU, a few minutes
    .venv/bin/python scripts/benchmarks/gpu_check.py --cpu-smoke --out /tmp/gc  # CPU, tiny: every path but CUDA-only ones

(a) ring: P processes (default 4) share cuda:0 and form one gloo group. The ring's rotation is
    ``funcol.permute_tensor`` -> ``all_to_all_single``; gloo's all-to-all takes CUDA tensors (it stages
    them through pinned host buffers inside ProcessGroupGloo, AsyncAlltoallCUDAWork), so comm.py,
    payload.py, ring.py, kernels.py and the DTensor SDPA handlers run unchanged on CUDA tensors. gloo's
    send/recv would not do (they hand raw pointers to a host socket) and NCCL refuses two ranks on one
    device. Cases: every layout x bf16/fp16 (flash) / fp32 (memory-efficient per KV group) x causal /
    full / masked (documents + window + sinks, Dv < Dqk; documents, window alone: varlen flash), forward and
    backward, against float64 attention by the textbook formula; then F.scaled_dot_product_attention
    on sequence-sharded DTensors under every SDPA backend choice (flash, efficient, cudnn, math, the
    default for fp32 GQA, fp64): the ring (collectives counted: the P - 1 all-to-alls of K/V only) or
    a ValueError, never a gather.
(b) host syncs: ``torch.cuda.set_sync_debug_mode`` around ring calls (fwd+bwd, unmasked, documents,
    DTensor SDPA) on every rank. The mode is process-wide, and gloo's CUDA all-to-all itself
    synchronises its copy streams in its worker thread, so "error" would fail gloo's transfer, not our
    code. "warn" turns each sync into a warning in the thread that made it -- a Python warning in the
    ring's threads (the caller's and autograd's), a log line in gloo's C++ worker -- so the check
    records every Python warning of a sync during the calls and passes only with none.
(c) P7: P = 8 ranks simulated in one process at N = 128k (Hq 32, Hkv 8, D 128, bf16): every rank's
    blockwise steps (cp_dtensor.ops.block_attn / block_attn_backward on the slices layout.step_block
    gives) plus the ring's own LSE merge, fwd+bwd, divided by one causal call over the whole sequence
    (target <= 1.15); striped vs contiguous vs head-tail. First the simulation's own result is checked
    against a float32 reference at --check-seq-len.
(d) memory: on each rank of (a), the peak of torch.cuda.max_memory_allocated over one ring fwd+bwd at
    --mem-seq-len, against cp_dtensor.plan.memory_bytes for the same shapes (Note [Plan memory]).

--cpu-smoke runs (a), (c) and the planner side of (d) on CPU at tiny sizes with 2 ranks; (b) and the
measured side of (d) need CUDA and are reported as skipped. Exit status 0 when every correctness check
passed (overhead and memory are reported, not enforced).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import cp_dtensor  # noqa: E402  (installs the SDPA handlers)
from cp_dtensor.core.layout import LAYOUTS, shard_tensor, step_block, unshard_tensor  # noqa: E402
from cp_dtensor.core.ops import block_attn, block_attn_backward  # noqa: E402
from cp_dtensor.core.ops import merge_ as _merge_  # noqa: E402  (the ring's own merge, so this checks its math)
from cp_dtensor.tools.plan import PlanInput, memory_bytes  # noqa: E402

TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 2e-3, torch.float64: 1e-10}
_DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def abs_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1): relative to the largest magnitude, absolute near zero."""
    a, b = a.detach().double(), b.detach().double().to(a.device)
    return ((a - b).abs().max() / max(b.abs().max().item(), 1.0)).item()


def reference(q, k, v, do, *, is_causal, scale=None, document_ids=None, window=None, sinks=None):
    """Full-sequence attention in float64 by the textbook formula, on q's device: out, dq, dk, dv, dsinks.
    q: [B, Hq, N, D]; k: [B, Hkv, N, D]; v: [B, Hkv, N, Dv]; ids [B, N]; window (left, right); sinks [Hq]."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    sk = None if sinks is None else sinks.detach().double().requires_grad_()
    b, hq, n = q.shape[:3]
    g = hq // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if is_causal:
        keep &= j <= i
    if window is not None:
        if window[0] >= 0:
            keep &= j >= i - window[0]
        if window[1] >= 0:
            keep &= j <= i + window[1]
    keep = keep.expand(b, 1, n, n)
    if document_ids is not None:
        ids = document_ids.to(q.device)
        keep = keep & (ids[:, None, :, None] == ids[:, None, None, :])
    s = s.masked_fill(~keep, float("-inf"))
    if sk is not None:  # one more logit per row, with no value
        p = torch.softmax(torch.cat([s, sk[None, :, None, None].expand(b, hq, n, 1)], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    out = p @ v.repeat_interleave(g, 1)
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad, (None if sk is None else sk.grad)


# ---------------------------------------------------------------------------------------------------
# (a) + (b) + (d): P ranks on one device, one gloo group


def _qkv(seed, b, hq, hkv, n, d, dv, device):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, h, n, e, generator=g, dtype=torch.float64) for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv))]
    return [x.to(device) for x in xs]


def _ring_cases(cfg, rank, world, device):
    """Every layout x case: ring_attention fwd+bwd on this rank's shards vs float64 (errors of this rank)."""
    d = cfg["head_dim"]
    cases = [  # name, dtype, (Hq, Hkv), Dv, causal, masked (True: documents + window + sinks; "docs", "window": one of them)
        ("bf16 GQA causal (flash)", torch.bfloat16, (8, 2), d, True, False),
        ("bf16 GQA full (flash)", torch.bfloat16, (8, 2), d, False, False),
        ("fp16 MHA causal (flash)", torch.float16, (4, 4), d, True, False),
        ("fp32 GQA causal (efficient, per KV group)", torch.float32, (8, 2), d, True, False),
        ("bf16 GQA docs+window+sinks, Dv<Dqk", torch.bfloat16, (8, 2), d // 2, True, True),
        ("bf16 GQA docs (varlen flash), Dv<Dqk", torch.bfloat16, (8, 2), d // 2, True, "docs"),
        ("bf16 GQA sliding window (flash window), Dv<Dqk", torch.bfloat16, (8, 2), d // 2, True, "window"),
        ("fp32 MQA docs+window+sinks, Dv<Dqk", torch.float32, (4, 1), d // 2, True, True),
    ]
    n, bsz, rows = cfg["ring_seq_len"], 2, []
    for li, layout in enumerate(LAYOUTS):
        for ci, (name, dtype, (hq, hkv), dv, causal, masked) in enumerate(cases):
            row = dict(layout=layout, case=name, dtype=str(dtype), tol=TOL[dtype])
            try:
                rows.append(dict(row, **_ring_case(rank, world, device, layout, 100 * li + ci, bsz, n, d, dtype,
                                                   hq, hkv, dv, causal, masked)))
            except Exception as e:  # noqa: BLE001 -- the same on every rank (same code, same shapes): report, go on
                rows.append(dict(row, errors={}, worst=float("inf"), ok=False, error=_last_line(e)))
    return rows


def _last_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"


def _ring_case(rank, world, device, layout, seed, bsz, n, d, dtype, hq, hkv, dv, causal, masked):
    """One ring_attention fwd+bwd on this rank's shards vs float64: the errors of this rank's shards."""
    q, k, v, do = _qkv(seed, bsz, hq, hkv, n, d, dv, device)
    opts, kw = {}, {}
    if masked:
        g = torch.Generator().manual_seed(7 + seed)
        ids = torch.zeros(bsz, n, dtype=torch.int64)
        for cut in torch.randperm(n - 1, generator=g)[:5].add(1).tolist():
            ids[:, cut:] += 1
        ids[1] = ids[1] * 2  # rows differ: per-row document runs
        sinks = torch.randn(hq, generator=g, dtype=torch.float64).to(device)
        opts = dict(document_ids=ids, window=(n // 5, 0), sinks=sinks)
        kw = dict(document_ids=shard_tensor(ids, seq_dim=1, layout=layout, rank=rank, cp_size=world),  # host ids
                  window_size=(n // 5, 0), sinks=sinks.float().requires_grad_())
        if masked == "docs":  # documents alone: every rectangle in the varlen calls (Note [Varlen rectangles])
            opts, kw = dict(document_ids=ids), dict(document_ids=kw["document_ids"])
        if masked == "window":  # a window alone: one band per step, in flash's own window if the build has it
            opts, kw = dict(window=(n // 5, 0)), dict(window_size=(n // 5, 0))
    want = reference(q, k, v, do, is_causal=causal, **opts)
    shard = lambda x: shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world)  # noqa: E731
    ql, kl, vl = (shard(x).to(dtype).contiguous().requires_grad_() for x in (q, k, v))
    out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=causal, **kw)
    out.backward(shard(do).to(dtype))
    errs = {m: abs_rel_err(a, shard(b)) for m, a, b in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), want)}
    if "sinks" in kw:  # each rank holds its queries' share of d sinks: sum them (on the host)
        total = kw["sinks"].grad.detach().cpu().double()
        dist.all_reduce(total)
        errs["dsinks"] = abs_rel_err(total, want[4].cpu())
    worst = max(errs.values())
    # whether torch's flash build took the window bands as flash windows (else: tiles with a bias)
    windows = cp_dtensor.core.kernels.flash_windows(ql) if "window_size" in kw else None
    return dict(errors=errs, worst=worst, ok=worst <= TOL[dtype], flash_windows=windows)


_BACKENDS = [  # name, backend (None: SDPA's own choice), dtype, (Hq, Hkv)
    ("flash", "FLASH_ATTENTION", torch.bfloat16, (4, 4)),
    ("default bf16 GQA", None, torch.bfloat16, (8, 2)),
    ("efficient", "EFFICIENT_ATTENTION", torch.float32, (4, 4)),
    ("cudnn", "CUDNN_ATTENTION", torch.bfloat16, (4, 4)),
    ("math", "MATH", torch.float32, (8, 2)),
    ("default fp32 GQA", None, torch.float32, (8, 2)),  # math on CUDA (no fused fp32 GQA kernel)
    ("default fp64", None, torch.float64, (4, 4)),  # CUDA: refused (no fused fp64 kernel); CPU: the ring
]


def _backend(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name)) if name else contextlib.nullcontext()


def _comm_counts(cm) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}


def _sdpa_cases(cfg, rank, world, device):
    """F.scaled_dot_product_attention on sequence-sharded DTensors under every SDPA backend choice."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.debug import CommDebugMode

    from cp_dtensor.dtensor.sharding import shard_sequence

    mesh = DeviceMesh(device.type, list(range(world)))
    n, d, rows = cfg["ring_seq_len"], cfg["head_dim"], []
    for i, (name, backend, dtype, (hq, hkv)) in enumerate(_BACKENDS):
        row = dict(backend=name, dtype=str(dtype), heads=(hq, hkv))
        gqa = hq != hkv
        try:  # is this backend available here at all? (a plain single-device call)
            p = [x[:, :, :64].to(dtype) for x in _qkv(0, 1, hq, hkv, 64, d, d, device)[:3]]
            with _backend(backend):
                F.scaled_dot_product_attention(*p, is_causal=True, enable_gqa=gqa)
        except RuntimeError as e:
            rows.append(dict(row, status="unavailable", detail=str(e).splitlines()[0][:200], ok=True))
            continue
        q, k, v, do = _qkv(500 + i, 1, hq, hkv, n, d, d, device)
        want = reference(q, k, v, do, is_causal=True)
        xs = [shard_sequence(x.to(dtype), mesh, seq_dim=2, layout="striped").requires_grad_() for x in (q, k, v)]
        refuse = dtype == torch.float64 and device.type == "cuda"
        try:
            with CommDebugMode() as fwd, _backend(backend):
                out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=gqa)
            with CommDebugMode() as bwd:
                out.backward(shard_sequence(do.to(dtype), mesh, seq_dim=2, layout="striped"))
        except ValueError as e:
            rows.append(dict(row, status="ValueError", detail=str(e)[:200], ok=refuse))
            continue
        except Exception as e:  # noqa: BLE001 -- the same on every rank: report, go on
            rows.append(dict(row, status="error", detail=_last_line(e), ok=False))
            continue
        shard = lambda x: shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world)  # noqa: E731
        got = (out.to_local(), *(x.grad.to_local() for x in xs))
        worst = max(abs_rel_err(a, shard(b)) for a, b in zip(got, want))
        comm = dict(forward=_comm_counts(fwd), backward=_comm_counts(bwd))
        ring_only = comm["forward"] == ({"all_to_all_single": world - 1} if world > 1 else {}) and set(
            comm["backward"]) <= {"all_to_all_single"}
        rows.append(dict(row, status="ring", worst=worst, tol=TOL[dtype], comm=comm,
                         ok=not refuse and ring_only and worst <= TOL[dtype]))
    return rows


@contextlib.contextmanager
def watch_syncs(cuda: bool):
    """Collect the Python warnings of host-device syncs made inside the block (see (b) in the docstring).
    Yields a list that holds "file:line: message" per sync once the block has exited."""
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen  # a sync is flagged where the host issues it: nothing to wait for afterwards
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    seen += [f"{w.filename}:{w.lineno}: {w.message}" for w in rec if "synchroniz" in str(w.message)]


def _sync_check(cfg, rank, world, device):
    """(b): ring calls under the sync debug mode; the first round warms up (lazy inits), the second counts."""
    from torch.distributed.device_mesh import DeviceMesh

    from cp_dtensor.dtensor.sharding import shard_sequence

    n, d = cfg["ring_seq_len"], cfg["head_dim"]
    mesh = DeviceMesh(device.type, list(range(world)))
    q, k, v, do = (x.to(torch.bfloat16) for x in _qkv(900, 1, 8, 2, n, d, d, device))
    ids = torch.arange(n).div(n // 3, rounding_mode="floor").unsqueeze(0)  # three documents, on the host

    # inputs sharded up front: the watched region holds the ring calls and nothing else
    shard = lambda x, layout, dim=2: shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)  # noqa: E731
    local = [(layout, [shard(x, layout).contiguous().requires_grad_() for x in (q, k, v)], shard(do, layout),
              shard(ids, layout, 1)) for layout in LAYOUTS]
    xs = [shard_sequence(x, mesh, seq_dim=2).requires_grad_() for x in (q, k, v)]
    dxs = shard_sequence(do, mesh, seq_dim=2)

    def calls():
        for layout, (ql, kl, vl), dout, idl in local:
            for kw in ({}, dict(document_ids=idl, window_size=(n // 4, 0))):
                cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True, **kw).backward(dout)
        F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True).backward(dxs)

    calls()
    cuda = device.type == "cuda"
    with watch_syncs(cuda) as seen:
        calls()
    if not cuda:  # the calls ran; no sync can be flagged without the CUDA debug mode
        return dict(status="skipped", detail="CPU: torch.cuda.set_sync_debug_mode needs CUDA", syncs=seen, ok=not seen)
    return dict(status="checked", syncs=seen, ok=not seen)


def _memory_check(cfg, rank, world, device):
    """(d): peak allocated over one ring fwd+bwd vs the planner, same shapes (bf16, striped, causal)."""
    n, hq, hkv, d = cfg["mem_seq_len"], cfg["q_heads"], cfg["kv_heads"], cfg["mem_head_dim"]
    plan = memory_bytes(PlanInput(seq_len=n, cp=world, head_dim=d, q_heads=hq, kv_heads=hkv, dtype="bf16"))
    row = dict(seq_len=n, cp=world, q_heads=hq, kv_heads=hkv, head_dim=d, planned=plan)
    if device.type != "cuda":
        return dict(row, status="skipped", detail="CPU: torch.cuda.max_memory_allocated needs CUDA", ok=True)
    s = n // world
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    other = torch.cuda.memory_allocated()  # anything this process still holds from before
    q, do = (torch.randn(1, hq, s, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, hkv, s, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True).backward(do)
    torch.cuda.synchronize()
    # q, k, v, dO count, as in the planner (saved for backward / backward working set)
    measured = torch.cuda.max_memory_allocated() - other
    return dict(row, status="measured", measured=measured, ratio=measured / plan["total"],
                ok=measured <= 1.10 * plan["total"])


def _rank_main(rank, world, init, cfg, results):
    code = 0
    try:
        device = torch.device(cfg["device"])
        torch.set_num_threads(cfg["threads"])
        if device.type == "cuda":
            torch.cuda.set_device(device)  # every rank on the one GPU
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg["collective_timeout"]))
        res = {}
        for key, fn in (("memory", _memory_check), ("ring", _ring_cases), ("sdpa", _sdpa_cases), ("sync", _sync_check)):
            try:  # memory first: a clean allocator
                res[key] = fn(cfg, rank, world, device)
            except Exception as e:  # noqa: BLE001 -- the same on every rank: report, go on with the next section
                res[key] = dict(status="error", detail=_last_line(e), trace=traceback.format_exc(), ok=False)
        results.put((rank, True, res))
    except BaseException:  # noqa: BLE001 -- reported by the parent, which stops every rank
        results.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        results.close()
        results.join_thread()
        os._exit(code)


def run_ranks(cfg, world: int) -> list[dict]:
    """``_rank_main`` on ``world`` spawned processes (spawn: CUDA cannot cross a fork); a file rendezvous
    in a fresh temp dir; when one rank fails or the deadline passes, every rank is stopped."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, cfg, results)) for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, dict] = {}
        try:
            deadline = time.monotonic() + cfg["timeout"]
            while len(out) < world:
                try:
                    rank, ok, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(f"ranks {sorted(set(range(world)) - set(out))} of {world} did not finish "
                                       f"within {cfg['timeout']} s") from None
                if not ok:
                    raise RuntimeError(f"rank {rank} of {world} failed:\n{payload}")
                out[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=10 if len(out) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world)]


def merge_ranks(per_rank: list[dict]) -> dict:
    """One row per case: rank 0's, with the worst error and every rank's verdict."""
    merged = {}
    for key in ("ring", "sdpa"):
        failed = [r[key] for r in per_rank if not isinstance(r[key], list)]
        if failed:  # the section raised (on some rank): one failed row
            merged[key] = [dict(layout="-", case="(section failed)", backend="(section failed)", dtype="-",
                                status="error", worst=float("inf"), tol=0.0, detail=failed[0]["detail"],
                                trace=failed[0]["trace"], ok=False)]
            continue
        rows = []
        for i, row in enumerate(per_rank[0][key]):
            others = [r[key][i] for r in per_rank]
            row = dict(row, ok=all(o["ok"] for o in others))
            if "worst" in row:
                row["worst"] = max(o.get("worst", float("inf")) for o in others)
            row["status_per_rank"] = sorted({o.get("status", "ok") for o in others})
            rows.append(row)
        merged[key] = rows
    merged["sync"] = dict(per_rank[0]["sync"], syncs=[s for r in per_rank for s in r["sync"].get("syncs", [])],
                          ok=all(r["sync"]["ok"] for r in per_rank))
    mem = [r["memory"] for r in per_rank]
    merged["memory"] = dict(mem[0], per_rank=[m.get("measured") for m in mem], ok=all(m["ok"] for m in mem))
    if all(m["status"] == "measured" for m in mem):
        merged["memory"]["measured"] = max(m["measured"] for m in mem)
        merged["memory"]["ratio"] = merged["memory"]["measured"] / mem[0]["planned"]["total"]
    return merged


# ---------------------------------------------------------------------------------------------------
# (c): P7, P ranks simulated in one process


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
        rows.append(dict(layout=layout, ring_err=errs, single_err=single,
                         ok=all(e <= 2 * s + 1e-3 for e, s in zip(errs, single))))
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


# ---------------------------------------------------------------------------------------------------
# report


def _fmt_bytes(x):
    return "-" if x is None else f"{x / 2**20:,.1f} MiB"


def markdown(res: dict) -> str:
    c = res["config"]
    lines = [f"# gpu_check on {res['device']}", "",
             f"{'PASS' if res['ok'] else 'FAIL'} in {res['seconds']:.0f} s. Command: `{res['command']}`", "",
             f"## (a) the ring on {c['ranks']} ranks sharing {c['device']} (gloo all-to-all on device tensors), "
             f"N = {c['ring_seq_len']}, D = {c['head_dim']}", "",
             "| layout | case | worst error vs float64 | tol | ok |", "|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['case']}{' ERROR ' + r.get('error', r.get('detail', '')) if 'error' in r or 'detail' in r else ''}"
              f" | {r['worst']:.2e} | {r['tol']:.0e} | {r['ok']} |" for r in res["ring"]]
    lines += ["", "F.scaled_dot_product_attention on sequence-sharded DTensors, per SDPA backend choice:", "",
              "| backend | dtype | status | worst error | collectives fwd / bwd | ok |", "|---|---|---|---|---|---|"]
    for r in res["sdpa"]:
        comm = r.get("comm")
        comm = f"{comm['forward']} / {comm['backward']}" if comm else r.get("detail", "")
        err = f"{r['worst']:.2e}" if "worst" in r else "-"
        lines.append(f"| {r['backend']} | {r['dtype']} | {r['status']} | {err} | {comm} | {r['ok']} |")
    s = res["sync"]
    lines += ["", f"## (b) host syncs in ring calls: {s['status']}"
              + (f", {len(s['syncs'])} found" if s["status"] == "checked" else f" ({s.get('detail', '')})")]
    lines += [f"- {x}" for x in s["syncs"][:20]]
    lines += ["", f"## (c) P7: {c['sim_world']} ranks simulated, N = {c['seq_len']}, Hq {c['q_heads']} Hkv "
              f"{c['kv_heads']} D {c['head_dim_sim']} bf16, fwd+bwd", "",
              "simulation vs reference at N = " + str(c["check_seq_len"]) + ": "
              + ", ".join(f"{r['layout']} {'PASS' if r['ok'] else 'FAIL'} (max err {max(r['ring_err']):.1e}, "
                          f"one call {max(r['single_err']):.1e})" for r in res["simulation"]), "",
              "| layout | blockwise steps + merges | one causal call | ratio (target <= 1.15) | vs striped |",
              "|---|---|---|---|---|"]
    for r in res["overhead"]:
        vs = "-" if r["vs_striped"] is None else f"{r['vs_striped']:.3f}"
        lines.append(f"| {r['layout']} | {r['ring_s'] * 1e3:.1f} ms | {r['single_s'] * 1e3:.1f} ms | "
                     f"{r['ratio']:.3f}{'' if r['meets_target'] else ' (over)'} | {vs} |")
    m = res["memory"]
    if m["status"] == "error":
        return "\n".join(lines + ["", f"## (d) peak memory per rank: ERROR {m['detail']}", ""])
    lines += ["", f"## (d) peak memory per rank, N = {m['seq_len']}, P = {m['cp']}, Hq {m['q_heads']} Hkv "
              f"{m['kv_heads']} D {m['head_dim']} bf16 striped causal fwd+bwd: {m['status']}", "",
              f"planner (cp_dtensor.plan.memory_bytes) total {_fmt_bytes(m['planned']['total'])}; measured "
              + (f"{_fmt_bytes(m['measured'])} (max over ranks; ratio {m['ratio']:.2f}; per rank "
                 + ", ".join(_fmt_bytes(x) for x in m["per_rank"]) + ")" if m["status"] == "measured"
                 else f"- ({m.get('detail', '')})"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out/gpu_check", help="directory for gpu_check.json and gpu_check.md")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny sizes: the code paths, not the numbers")
    p.add_argument("--ranks", type=int, help="processes sharing the device in (a) (default 4; smoke 2)")
    p.add_argument("--ring-seq-len", type=int, help="N of (a) and (b) (default 2048; smoke 64)")
    p.add_argument("--seq-len", type=int, help="N of (c) (default 131072; smoke 256)")
    p.add_argument("--check-seq-len", type=int, help="N of the simulation check in (c) (default 8192; smoke 128)")
    p.add_argument("--mem-seq-len", type=int, help="N of (d) (default 32768; smoke 64)")
    p.add_argument("--sim-world", type=int, default=8, help="simulated ranks P in (c)")
    p.add_argument("--q-heads", type=int, help="Hq of (c) and (d) (default 32; smoke 4)")
    p.add_argument("--kv-heads", type=int, help="Hkv of (c) and (d) (default 8; smoke 2)")
    p.add_argument("--head-dim", type=int, help="D of (c) and (d) (default 128; smoke 16)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--iters", type=int, help="timed repeats in (c) (default 3; smoke 1)")
    p.add_argument("--timeout", type=int, default=420, help="seconds for (a), (b), (d) together")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here. Run it on a GPU machine, or pass --cpu-smoke for the CPU path.")
    defaults = dict(ranks=(4, 2), ring_seq_len=(2048, 64), seq_len=(131072, 256), check_seq_len=(8192, 128),
                    mem_seq_len=(32768, 64), q_heads=(32, 4), kv_heads=(8, 2), head_dim=(128, 16), iters=(3, 1))
    for name, (gpu, cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu if smoke else gpu)
    device = torch.device("cpu" if smoke else "cuda", None if smoke else 0)
    for name in ("seq_len", "check_seq_len"):
        if getattr(args, name) % (2 * args.sim_world):
            raise SystemExit(f"gpu_check: --{name.replace('_', '-')} must be a multiple of 2 * --sim-world "
                             f"({2 * args.sim_world}) for every layout; got {getattr(args, name)}.")
    for name in ("ring_seq_len", "mem_seq_len"):
        if getattr(args, name) % (2 * args.ranks):
            raise SystemExit(f"gpu_check: --{name.replace('_', '-')} must be a multiple of 2 * --ranks "
                             f"({2 * args.ranks}); got {getattr(args, name)}.")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)"
    cfg = dict(device=str(device), threads=1 if smoke else 4, timeout=args.timeout, collective_timeout=120, ring_seq_len=args.ring_seq_len,
               head_dim=64 if not smoke else 16, mem_seq_len=args.mem_seq_len, q_heads=args.q_heads,
               kv_heads=args.kv_heads, mem_head_dim=args.head_dim)
    t0 = time.perf_counter()
    print(f"{name}: (a) ring, (b) syncs, (d) memory on {args.ranks} ranks sharing {device} ...", flush=True)
    merged = merge_ranks(run_ranks(cfg, args.ranks))
    print(f"(c) P7: {args.sim_world} simulated ranks, simulation check at N={args.check_seq_len}, "
          f"overhead at N={args.seq_len} ...", flush=True)
    torch.set_num_threads(1 if smoke else torch.get_num_threads())
    simulation = check_simulation(args, device, args.check_seq_len)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    overhead = check_overhead(args, device, args.seq_len)
    ok = (all(r["ok"] for r in merged["ring"] + merged["sdpa"] + simulation) and merged["sync"]["ok"]
          and merged["memory"]["status"] != "error")  # memory is reported, not enforced; a crash is a failure
    config = dict(vars(args), device=str(device), ring_seq_len=args.ring_seq_len, head_dim=cfg["head_dim"],
                  head_dim_sim=args.head_dim)
    res = dict(device=name, command=" ".join(["python", "scripts/benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
               config=config, ok=ok, **merged, simulation=simulation, overhead=overhead,
               seconds=time.perf_counter() - t0)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    report = markdown(res)
    with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
        f.write(report)
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
