"""gpu_check's ring sections, run on every rank of one gloo group sharing the device (gpu_check.py's (a),
(b), (d)): the ring matrix against float64, the document exchange, F.scaled_dot_product_attention on
DTensors per SDPA backend, a compiled ring, host syncs, and peak memory against the planner. Each case is
recorded the moment it ends (``_gpu_ranks.record``), with this rank's errors and non-finite counts."""

from __future__ import annotations

import contextlib
import gc
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _gpu_ranks import compare, last_line, progress, record, worst

import cp_dtensor
from cp_dtensor.core.plan.layout import shard_tensor
from cp_dtensor.tools.plan import PlanInput, memory_bytes

TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 2e-3, torch.float64: 1e-10}
_BF, _FP16, _FP32 = torch.bfloat16, torch.float16, torch.float32

# name, dtype, (Hq, Hkv), Dv = D // dv_div, causal, mask: None, "docs+window+sinks", "docs+window", "docs", "window"
RING_CASES = [
    ("bf16 GQA causal", _BF, (8, 2), 1, True, None),
    ("bf16 GQA full", _BF, (8, 2), 1, False, None),
    ("fp16 MHA causal", _FP16, (4, 4), 1, True, None),
    ("fp32 GQA causal", _FP32, (8, 2), 1, True, None),
    ("fp32 MHA full", _FP32, (4, 4), 1, False, None),
    ("bf16 GQA docs+window+sinks, Dv<Dqk", _BF, (8, 2), 2, True, "docs+window+sinks"),
    ("bf16 GQA docs+window", _BF, (8, 2), 1, True, "docs+window"),
    ("fp16 GQA docs+window+sinks", _FP16, (8, 2), 1, True, "docs+window+sinks"),
    ("bf16 GQA docs, Dv<Dqk", _BF, (8, 2), 2, True, "docs"),
    ("bf16 GQA window, Dv<Dqk", _BF, (8, 2), 2, True, "window"),
    ("fp32 MQA docs+window+sinks, Dv<Dqk", _FP32, (4, 1), 2, True, "docs+window+sinks"),
]
DOC_CASES = [c for c in RING_CASES if c[5] in ("docs+window+sinks", "docs")]  # the document exchange takes documents


def qkv(seed, b, hq, hkv, n, d, dv, device):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(b, h, n, e, generator=g, dtype=torch.float64) for h, e in ((hq, d), (hkv, d), (hkv, dv), (hq, dv))]
    return [x.to(device) for x in xs]


def reference(q, k, v, do, *, is_causal, document_ids=None, window=None, sinks=None):
    """Full-sequence attention in float64 by the textbook formula, on q's device: out, dq, dk, dv, dsinks.
    q: [B, Hq, N, D]; k: [B, Hkv, N, D]; v: [B, Hkv, N, Dv]; ids [B, N]; window (left, right); sinks [Hq]."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    sk = None if sinks is None else sinks.detach().double().requires_grad_()
    b, hq, n = q.shape[:3]
    g = hq // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if is_causal:
        keep &= j <= i
    if window is not None:
        keep &= (j >= i - window[0]) if window[0] >= 0 else keep
        keep &= (j <= i + window[1]) if window[1] >= 0 else keep
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


def _packed_ids(seed, bsz, n):
    """Two packed rows of documents with different cuts (per-row document runs)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(bsz, n, dtype=torch.int64)
    for cut in torch.randperm(n - 1, generator=g)[:5].add(1).tolist():
        ids[:, cut:] += 1
    ids[1] = ids[1] * 2
    return ids


def _verdict(row: dict, results: dict, tol: float) -> dict:
    """``results``: name -> compare(); adds errors, non-finite counts, worst and ok."""
    errs = {m: r["err"] for m, r in results.items()}
    nonfinite = {m: r["nonfinite"] for m, r in results.items() if r["nonfinite"] or r.get("ref_nonfinite")}
    w = worst(errs.values())
    return dict(row, errors=errs, nonfinite=nonfinite, nonfinite_total=sum(nonfinite.values()), worst=w, ok=w <= tol)


def ring_case(cfg, rank, world, device, layout, seed, case) -> tuple[dict, dict]:
    """One ring_attention fwd+bwd on this rank's shards vs float64 (``layout`` "documents": the document
    exchange, cp_dtensor.document_layout of the batch's ids). Returns (extra fields, compare() per result)."""
    name, dtype, (hq, hkv), dv_div, causal, mask = case
    n, d, bsz = cfg["ring_seq_len"], cfg["head_dim"], 2
    q, k, v, do = qkv(seed, bsz, hq, hkv, n, d, d // dv_div, device)
    ids = _packed_ids(7 + seed, bsz, n)
    window = (n // 5, 0)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)
    opts = dict(document_ids=ids if mask and "docs" in mask else None,
                window=window if mask and "window" in mask else None, sinks=sinks if mask and "sinks" in mask else None)
    lay = cp_dtensor.document_layout(ids, world, windows=[opts["window"]]) if layout == "documents" else layout
    shard = lambda x, dim=2: shard_tensor(x, seq_dim=dim, layout=lay, rank=rank, cp_size=world)  # noqa: E731
    kw = {}
    if opts["document_ids"] is not None and layout != "documents":  # the layout carries them otherwise
        kw["document_ids"] = shard(ids, 1)
    if opts["window"] is not None:
        kw["window_size"] = window
    if opts["sinks"] is not None:
        kw["sinks"] = sinks.float().requires_grad_()
    want = reference(q, k, v, do, is_causal=causal, **opts)
    ql, kl, vl = (shard(x).to(dtype).contiguous().requires_grad_() for x in (q, k, v))
    out = cp_dtensor.ring_attention(ql, kl, vl, layout=lay, is_causal=causal, **kw)
    out.backward(shard(do).to(dtype))
    res = {m: compare(a, shard(b)) for m, a, b in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), want)}
    if "sinks" in kw:  # each rank holds its queries' share of d sinks: sum them (on the host)
        total = kw["sinks"].grad.detach().cpu().double()
        dist.all_reduce(total)
        res["dsinks"] = compare(total, want[4].cpu())
    flash_windows = cp_dtensor.core.compute.kernels.flash_windows(ql) if "window_size" in kw else None
    return dict(flash_windows=flash_windows), res


def ring_matrix(cfg, rank, world, device):
    """(a): every layout x RING_CASES, then the document exchange x DOC_CASES."""
    jobs = [(lay, c) for lay in cfg["layouts"] for c in RING_CASES] + [("documents", c) for c in DOC_CASES]
    for i, (layout, case) in enumerate(jobs):
        row = dict(layout=layout, case=case[0], dtype=str(case[1]), tol=TOL[case[1]])
        progress(f"start ring {layout} {case[0]}")
        try:
            extra, res = ring_case(cfg, rank, world, device, layout, i, case)
            record("ring", _verdict(dict(row, **extra), res, TOL[case[1]]))
        except Exception as e:  # noqa: BLE001 -- the same on every rank (same code, same shapes): report, go on
            record("ring", dict(row, errors={}, worst=float("inf"), ok=False, error=last_line(e)))


_BACKENDS = [  # name, backend (None: SDPA's own choice), dtype, (Hq, Hkv)
    ("flash", "FLASH_ATTENTION", _BF, (4, 4)),
    ("default bf16 GQA", None, _BF, (8, 2)),
    ("efficient", "EFFICIENT_ATTENTION", _FP32, (4, 4)),
    ("efficient bf16", "EFFICIENT_ATTENTION", _BF, (4, 4)),
    ("cudnn", "CUDNN_ATTENTION", _BF, (4, 4)),
    ("math", "MATH", _FP32, (8, 2)),
    ("default fp32 GQA", None, _FP32, (8, 2)),  # math on CUDA (no fused fp32 GQA kernel)
    ("default fp64", None, torch.float64, (4, 4)),  # CUDA: refused (no fused fp64 kernel); CPU: the ring
]


def sdpa_backend(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, name)) if name else contextlib.nullcontext()


def _comm_counts(cm) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}


def sdpa_cases(cfg, rank, world, device):
    """F.scaled_dot_product_attention on sequence-sharded DTensors under every SDPA backend choice: the ring
    (only its K/V all-to-alls), a ValueError where it must refuse, or "unavailable" where the device lacks
    the backend."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.debug import CommDebugMode

    from cp_dtensor.dtensor.sharding import shard_sequence

    mesh = DeviceMesh(device.type, list(range(world)))
    n, d = cfg["ring_seq_len"], cfg["head_dim"]
    for i, (name, backend, dtype, (hq, hkv)) in enumerate(_BACKENDS):
        row = dict(backend=name, dtype=str(dtype), heads=(hq, hkv))
        progress(f"start sdpa {name}")
        gqa = hq != hkv
        try:  # is this backend available here at all? (a plain single-device call)
            p = [x[:, :, :64].to(dtype) for x in qkv(0, 1, hq, hkv, 64, d, d, device)[:3]]
            with sdpa_backend(backend):
                F.scaled_dot_product_attention(*p, is_causal=True, enable_gqa=gqa)
        except RuntimeError as e:
            record("sdpa", dict(row, status="unavailable", detail=str(e).splitlines()[0][:200], ok=True))
            continue
        q, k, v, do = qkv(500 + i, 1, hq, hkv, n, d, d, device)
        want = reference(q, k, v, do, is_causal=True)
        xs = [shard_sequence(x.to(dtype), mesh, seq_dim=2, layout="striped").requires_grad_() for x in (q, k, v)]
        # CUDA refuses fp64 (no fused kernel) and a switch choice the ring has no kernel for (cudnn or math
        # alone: Note [SDPA backend switches]), on every rank before any K/V moves
        refuse = device.type == "cuda" and (dtype == torch.float64 or backend in ("CUDNN_ATTENTION", "MATH"))
        try:
            with CommDebugMode() as fwd, sdpa_backend(backend):
                out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=gqa)
            with CommDebugMode() as bwd:  # outside the backend context, as a training step's backward runs
                out.backward(shard_sequence(do.to(dtype), mesh, seq_dim=2, layout="striped"))
        except ValueError as e:
            record("sdpa", dict(row, status="ValueError", detail=str(e)[:200], ok=refuse))
            continue
        except Exception as e:  # noqa: BLE001 -- the same on every rank: report, go on
            record("sdpa", dict(row, status="error", detail=last_line(e), ok=False))
            continue
        shard = lambda x: shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world)  # noqa: E731
        got = (out.to_local(), *(x.grad.to_local() for x in xs))
        res = {m: compare(a, shard(b)) for m, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
        comm = dict(forward=_comm_counts(fwd), backward=_comm_counts(bwd))
        ring_only = comm["forward"] == ({"all_to_all_single": world - 1} if world > 1 else {}) and set(
            comm["backward"]) <= {"all_to_all_single"}
        row = _verdict(dict(row, status="ring", tol=TOL[dtype], comm=comm), res, TOL[dtype])
        record("sdpa", dict(row, ok=row["ok"] and not refuse and ring_only))


def compile_case(cfg, rank, world, device):
    """A compiled ring (fullgraph; Inductor on CUDA, aot_eager on CPU to stay quick) fwd+bwd vs float64 and
    vs eager; the first call's seconds."""
    dtype = _BF if device.type == "cuda" else _FP32
    n, d = cfg["ring_seq_len"], cfg["head_dim"]
    row = dict(case="ring_attention striped causal, fullgraph", dtype=str(dtype),
               backend="inductor" if device.type == "cuda" else "aot_eager")
    progress("start compile")
    try:
        q, k, v, do = qkv(800, 1, 8, 2, n, d, d, device)
        want = reference(q, k, v, do, is_causal=True)
        shard = lambda x: shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world)  # noqa: E731

        def fn(q, k, v):
            return cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True)

        compiled = torch.compile(fn, fullgraph=True, backend=row["backend"])
        results = {}
        for label, f in (("eager", fn), ("compiled", compiled)):
            ql, kl, vl = (shard(x).to(dtype).contiguous().requires_grad_() for x in (q, k, v))
            t0 = time.perf_counter()
            out = f(ql, kl, vl)
            out.backward(shard(do).to(dtype))
            if device.type == "cuda":
                torch.cuda.synchronize()
            row[f"{label}_first_call_s"] = time.perf_counter() - t0
            results[label] = (out.detach(), ql.grad, kl.grad, vl.grad)
        res = {f"{m} vs float64": compare(a, shard(b)) for m, a, b in zip(("out", "dq", "dk", "dv"), results["compiled"], want)}
        res.update({f"{m} vs eager": compare(a, b) for m, a, b in zip(("out", "dq", "dk", "dv"), results["compiled"], results["eager"])})
        record("compile", _verdict(row, res, TOL[dtype]))
    except Exception as e:  # noqa: BLE001 -- reported as a failed row
        # on CPU a torch whose compiled ring cp_dtensor refuses (naming that torch) is a refusal, not a failure
        version = torch.__version__.split("+")[0].rsplit(".", 1)[0]  # "2.11"
        refused = device.type == "cpu" and isinstance(e, (ValueError, NotImplementedError)) and version in str(e)
        record("compile", dict(row, worst=None if refused else float("inf"), ok=refused,
                               status="refused on this torch" if refused else "error", error=last_line(e)))


_SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's warning per sync in "warn" mode


@contextlib.contextmanager
def watch_syncs(cuda: bool):
    """Collect the warnings of host-device syncs made inside the block. Yields (syncs, notices): "file:line:
    message" per sync, and torch's other notices about the mode (e.g. "... is a prototype feature"), which
    are no sync and are reported apart."""
    syncs: list[str] = []
    notices: list[str] = []
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs, notices
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    for w in rec:
        text = f"{w.filename}:{w.lineno}: {w.message}"
        if _SYNC_MESSAGE in str(w.message):
            syncs.append(text)
        elif "synchroniz" in str(w.message).lower():
            notices.append(text)


def sync_check(cfg, rank, world, device):
    """(b): ring calls under the sync debug mode; the first round warms up (lazy inits), the second counts."""
    from torch.distributed.device_mesh import DeviceMesh

    from cp_dtensor.dtensor.sharding import shard_sequence

    progress("start syncs")
    n, d = cfg["ring_seq_len"], cfg["head_dim"]
    mesh = DeviceMesh(device.type, list(range(world)))
    q, k, v, do = (x.to(_BF) for x in qkv(900, 1, 8, 2, n, d, d, device))
    ids = torch.arange(n).div(n // 3, rounding_mode="floor").unsqueeze(0)  # three documents, on the host
    shard = lambda x, layout, dim=2: shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)  # noqa: E731
    local = [(layout, [shard(x, layout).contiguous().requires_grad_() for x in (q, k, v)], shard(do, layout),
              shard(ids, layout, 1)) for layout in cfg["layouts"]]
    xs = [shard_sequence(x, mesh, seq_dim=2).requires_grad_() for x in (q, k, v)]
    dxs = shard_sequence(do, mesh, seq_dim=2)

    def calls():
        for layout, (ql, kl, vl), dout, idl in local:
            for kw in ({}, dict(document_ids=idl, window_size=(n // 4, 0))):
                cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True, **kw).backward(dout)
        F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True).backward(dxs)

    calls()
    cuda = device.type == "cuda"
    with watch_syncs(cuda) as (syncs, notices):
        calls()
    if not cuda:  # the calls ran; no sync can be flagged without the CUDA debug mode
        return record("sync", dict(status="skipped", detail="CPU: torch.cuda.set_sync_debug_mode needs CUDA",
                                   syncs=syncs, notices=notices, ok=not syncs))
    return record("sync", dict(status="checked", syncs=syncs, notices=notices, ok=not syncs))


def memory_check(cfg, rank, world, device):
    """(d): peak allocated over one ring fwd+bwd vs the planner, same shapes (bf16, striped, causal); q, k, v
    and dO are counted, as in the planner (Note [Plan memory])."""
    n, hq, hkv, d = cfg["mem_seq_len"], cfg["q_heads"], cfg["kv_heads"], cfg["mem_head_dim"]
    progress("start memory")
    plan = memory_bytes(PlanInput(seq_len=n, cp=world, head_dim=d, q_heads=hq, kv_heads=hkv, dtype="bf16",
                                  device=device.type))
    row = dict(seq_len=n, cp=world, q_heads=hq, kv_heads=hkv, head_dim=d, planned=plan)
    if device.type != "cuda":
        return record("memory", dict(row, status="skipped", detail="CPU: torch.cuda.max_memory_allocated needs CUDA",
                                     ok=True))
    s = n // world
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    other = torch.cuda.memory_allocated()  # anything this process still holds from before
    q, do = (torch.randn(1, hq, s, d, device=device, dtype=_BF) for _ in range(2))
    k, v = (torch.randn(1, hkv, s, d, device=device, dtype=_BF) for _ in range(2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    cp_dtensor.ring_attention(q, k, v, layout="striped", is_causal=True).backward(do)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - other
    return record("memory", dict(row, status="measured", measured=measured, ratio=plan["total"] / measured,
                                 ok=True))


def ring_sections(cfg, rank, world, device):
    """Every section of this group, memory first (a clean allocator); a section that raises is one failed row."""
    for section, fn in (("memory", memory_check), ("ring", ring_matrix), ("sdpa", sdpa_cases),
                        ("compile", compile_case), ("sync", sync_check)):
        if section in cfg.get("skip", ()):
            continue
        try:
            fn(cfg, rank, world, device)
        except Exception as e:  # noqa: BLE001 -- the same on every rank: report, go on with the next section
            import traceback

            record(section, dict(status="error", detail=last_line(e), trace=traceback.format_exc(), ok=False,
                                 worst=float("inf"), case="(section failed)", layout="-", backend="(section failed)"))
