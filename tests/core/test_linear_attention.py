"""sharded_delta_rule and sharded_causal_conv1d (cp_dtensor/linear_attention.py) against float64
single-device references on the full sequence: a token-by-token recurrence of the gated delta rule (GDN
scalar gates, KDA per-channel gates, GVA, documents restarting the state) and F.conv1d per document;
forward and every input's gradient, P = 2 and 3, contiguous and headtail. Bytes against the formulas,
refusals raising on every rank, and a stand-in with fla's input contract."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiers import exhaustive

from cp_dtensor.core.linear.linear_attention import (
    causal_conv1d_step,
    check_bytes,
    check_linear_layout,
    conv_halo_bytes,
    delta_rule_step,
    linear_state_bytes,
    sharded_causal_conv1d,
    sharded_delta_rule,
)
from cp_dtensor.core.plan.layout import shard_tensor
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import abs_rel_err, f64_kernel, recurrence  # noqa: F401  (f64_kernel: shared with tests/hf)

transformers = pytest.importorskip("transformers")
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule  # noqa: E402


def fla_standin(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """fla's chunk_gated_delta_rule contract (no chunk_size, no **kwargs; [B, T, H, D] contiguous inputs;
    initial_state fp32 [B, Hv, dk, dv]; final state fp32), delegating to transformers' torch kernel."""
    b, t, h, dk = q.shape
    hv, dv = v.shape[2:]
    assert all(x.is_contiguous() for x in (q, k, v, g, beta)), "fla takes contiguous inputs"
    assert k.shape == q.shape and v.shape[:2] == (b, t) and g.shape == (b, t, hv) and beta.shape == (b, t, hv)
    assert q.dtype == k.dtype == v.dtype and scale is None and cu_seqlens is None
    if initial_state is not None:
        assert initial_state.dtype == torch.float32, f"fla wants an fp32 initial_state; got {initial_state.dtype}"
        assert initial_state.is_contiguous() and initial_state.shape == (b, hv, dk, dv)
    o, s = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o.to(v.dtype), s.float() if output_final_state else None


KERNELS = {  # name: (kernel, kwargs, dtype, tolerance, per-channel gates, GVA)
    "gdn": (torch_chunk_gated_delta_rule, {"chunk_size": 8}, torch.float32, 1e-5, False, True),
    "kda": (chunk_kimi_delta_attention, {"chunk_size": 8}, torch.float32, 1e-5, True, False),
    "f64_gdn": (f64_kernel, {}, torch.float64, 1e-9, False, True),
    "f64_kda": (f64_kernel, {}, torch.float64, 1e-9, True, True),
    "fla": (fla_standin, {}, torch.float32, 1e-5, False, True),
    "fla_bf16": (fla_standin, {}, torch.bfloat16, 3e-2, False, True),
}


def make_case(seed, *, b, n, hk, hv, d, per_channel, docs, run_len):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q, k, v = r(b, n, hk, d), r(b, n, hk, d), r(b, n, hv, d)
    g = -F.softplus(r(b, n, hv, d) if per_channel else r(b, n, hv)) * 0.5
    beta = torch.sigmoid(r(b, n, hv))
    do = r(b, n, hv, d)
    ids = None
    if docs == "inside":  # random starts, different per row
        ids = (torch.rand(b, n, generator=gen) < 0.15).long().cumsum(1)
    elif docs == "edges":  # starts exactly on run edges (row 0) and one inside (row 1)
        starts = torch.zeros(b, n, dtype=torch.long)
        starts[0, run_len::run_len] = 1
        starts[1, [run_len, min(n - 1, run_len + 3)]] = 1
        ids = starts.cumsum(1) + 7
    return q, k, v, g, beta, do, ids


def reference(q, k, v, g, beta, do, ids):
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
    reset = None
    if ids is not None:
        reset = torch.ones_like(ids, dtype=torch.bool)
        reset[:, 1:] = ids[:, 1:] != ids[:, :-1]
    o, state = recurrence(*xs, reset=reset)
    o.backward(do)
    return [o.detach()] + [x.grad for x in xs] + [state.detach()]


def _delta_cases(rank, world):
    done = 0
    for ci, (name, layout, docs) in enumerate(
        (n, lay, d) for n in KERNELS for lay in ("contiguous", "headtail") for d in (None, "inside", "edges")
    ):
        kernel, kw, dtype, tol, per_channel, gva = KERNELS[name]
        if name == "fla_bf16" and docs == "inside":
            continue
        s_local = (13 if ci % 2 else 20) if layout == "contiguous" else (14 if ci % 2 else 20)
        run_len = s_local if layout == "contiguous" else s_local // 2
        hk, hv = (2, 4) if gva else (2, 2)
        case = make_case(ci, b=2, n=world * s_local, hk=hk, hv=hv, d=8, per_channel=per_channel, docs=docs,
                         run_len=run_len)
        *xs, do, ids = case
        want = reference(*xs, do, ids)
        shard = lambda x: shard_tensor(x, seq_dim=1, layout=layout, rank=rank, cp_size=world)
        local = [shard(x).to(dtype).requires_grad_() for x in xs]
        final = ci % 2 == 0  # every other case also returns the state after the last token (for decoding)
        o = sharded_delta_rule(kernel, *local, mesh=None, layout=layout, output_final_state=final,
                               document_ids=None if ids is None else shard(ids), use_qk_l2norm_in_kernel=True, **kw)
        if final:
            o, state = o
            want_state = want[-1]
            assert state.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            err = abs_rel_err(state, want_state)
            assert err < tol, f"{name} {layout} docs={docs} P={world} rank {rank}: final state error {err:.3g}"
            every = [torch.empty_like(state) for _ in range(world)]
            dist.all_gather(every, state)
            assert all(torch.equal(e, state) for e in every), "the final state differs between ranks"
        assert o.dtype == dtype and o.shape == (2, s_local, hv, 8)
        o.backward(shard(do).to(dtype))
        got = [o] + [x.grad for x in local]
        for what, a, w in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, want):
            err = abs_rel_err(a, shard(w))
            assert err < tol, f"{name} {layout} docs={docs} P={world} rank {rank}: {what} error {err:.3g} > {tol}"
        done += 1
    return done


def _conv_cases(rank, world):
    done = 0
    for ci, (layout, docs, kk, act) in enumerate(
        (lay, d, kk, act) for lay in ("contiguous", "headtail") for d in (None, "inside", "edges")
        for kk, act in ((4, "silu"), (3, None))
    ):
        s_local = 10 if layout == "contiguous" else 4 + 2 * (ci % 2)  # headtail runs of 2, 3: shorter than K - 1
        run_len = s_local if layout == "contiguous" else s_local // 2
        n, b, c = world * s_local, 2, 5
        gen = torch.Generator().manual_seed(100 + ci)
        x, w, bias, do = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((b, c, n), (c, kk), (c,), (b, c, n)))
        ids = make_case(ci, b=b, n=n, hk=1, hv=1, d=1, per_channel=False, docs=docs, run_len=run_len)[-1]
        # reference: each document on its own, zero-padded
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, bias))
        rows = []
        for bi in range(b):
            row_ids = torch.zeros(n, dtype=torch.long) if ids is None else ids[bi]
            parts = []
            for doc in torch.unique_consecutive(row_ids):
                sel = (row_ids == doc).nonzero().flatten()
                seg = xr[bi:bi + 1, :, sel[0]:sel[-1] + 1]
                parts.append(F.conv1d(seg, wr.unsqueeze(1), br, padding=kk - 1, groups=c)[..., :seg.shape[-1]])
            rows.append(torch.cat(parts, -1))
        ref = torch.cat(rows)
        ref = F.silu(ref) if act else ref
        ref.backward(do)
        shard = lambda t: shard_tensor(t, seq_dim=-1, layout=layout, rank=rank, cp_size=world)
        xl, wl, bl = shard(x).clone().requires_grad_(), w.clone().requires_grad_(), bias.clone().requires_grad_()
        out = sharded_causal_conv1d(xl, wl, bl, act, mesh=None, layout=layout, output_final_state=True,
                                    document_ids=None if ids is None else shard(ids))
        out, state = out  # the conv state for decoding: the sequence's last K inputs, raw
        assert torch.equal(state, x[..., -kk:]), f"conv {layout} K={kk} P={world}: final state"
        out.backward(shard(do))
        for t in (wl.grad, bl.grad):  # replicated parameters: each rank holds its tokens' share
            dist.all_reduce(t)
        for what, a, want in (("out", out, shard(ref.detach())), ("dx", xl.grad, shard(xr.grad)),
                              ("dweight", wl.grad, wr.grad), ("dbias", bl.grad, br.grad)):
            err = abs_rel_err(a, want)
            assert err < 1e-12, f"conv {layout} docs={docs} K={kk} P={world} rank {rank}: {what} error {err:.3g}"
        done += 1
    return done


def _bytes_cases(rank, world):
    out = []
    for layout in ("contiguous", "headtail"):
        for s_local in (8, 24):  # bytes independent of the sequence length
            b, hk, hv, d = 2, 2, 4, 8
            *xs, do, _ = make_case(s_local, b=b, n=world * s_local, hk=hk, hv=hv, d=d, per_channel=False, docs=None,
                                   run_len=s_local)
            shard = lambda x: shard_tensor(x, seq_dim=1, layout=layout, rank=rank, cp_size=world)
            local = [shard(x).float().requires_grad_() for x in xs]
            with CommBytes() as fwd:
                o = sharded_delta_rule(torch_chunk_gated_delta_rule, *local, mesh=None, layout=layout,
                                       use_qk_l2norm_in_kernel=True, chunk_size=8)
            with CommBytes() as bwd:
                o.backward(shard(do).float())
            want = linear_state_bytes(batch=b, heads=hv, dk=d, dv=d, world=world, layout=layout)
            assert fwd.sent == want + check_bytes(world=world), (layout, s_local, fwd.by_op, want)
            assert bwd.sent == want, (layout, s_local, bwd.by_op, want)
            x = torch.randn(b, 6, s_local, dtype=torch.float32, requires_grad=True)
            with CommBytes() as cf:
                y = sharded_causal_conv1d(x, torch.randn(6, 4), None, "silu", mesh=None, layout=layout)
            with CommBytes() as cb:
                y.sum().backward()
            halo = conv_halo_bytes(batch=b, channels=6, kernel_size=4, world=world, layout=layout, itemsize=4,
                                   s_local=s_local)
            assert cf.sent == halo + check_bytes(world=world, conv=True) and cb.sent == halo, (cf.by_op, cb.by_op)
            with CommBytes() as cs, torch.no_grad():  # with the conv state for decoding: one column more per run
                sharded_causal_conv1d(x, torch.randn(6, 4), None, "silu", mesh=None, layout=layout,
                                      output_final_state=True)
            assert cs.sent == check_bytes(world=world, conv=True) + conv_halo_bytes(
                batch=b, channels=6, kernel_size=4, world=world, layout=layout, itemsize=4, s_local=s_local,
                final_state=True), cs.by_op
            out.append((layout, s_local, fwd.sent, bwd.sent))
    return out


def _refusal_cases(rank, world):
    b, s, h, d = 1, 6, 2, 4
    mk = lambda *shape: torch.randn(*shape)
    good = lambda: (mk(b, s, h, d), mk(b, s, h, d), mk(b, s, h, d), -torch.rand(b, s, h), torch.rand(b, s, h))
    call = lambda xs, **kw: sharded_delta_rule(torch_chunk_gated_delta_rule, *xs, mesh=None,
                                               **{"layout": "headtail", "chunk_size": 8, **kw})
    cases = {
        "striped": (lambda: call(good(), layout="striped"), "striped"),
        "bad beta on rank 1": (lambda: call(good()[:4] + ((mk(b, s, h + 1) if rank == 1 else mk(b, s, h)),)),
                               "rejected the inputs of rank(s) 1"),
        "S_local differs": (lambda: call(good() if rank else tuple(x[:, :4] for x in good())), "seq_len_local"),
        "layout differs": (lambda: call(good(), layout="contiguous" if rank else "headtail"), "layout"),
        "bad document_ids on rank 0": (lambda: call(good(), document_ids=torch.zeros(b, s - (rank == 0),
                                                                                     dtype=torch.long)),
                                       "document_ids must be this rank's shard"),
        "conv weight on rank 1": (lambda: sharded_causal_conv1d(mk(b, 3, s), mk(3 + (rank == 1), 4), mesh=None,
                                                                layout="contiguous"), "rejected the inputs"),
        "conv striped": (lambda: sharded_causal_conv1d(mk(b, 3, s), mk(3, 4), mesh=None, layout="striped"),
                         "striped"),
    }
    for what, (fn, match) in cases.items():
        with pytest.raises(ValueError, match=re.escape(match)):
            fn()
            raise AssertionError(f"{what}: no ValueError")
    # the group is still in step: a good call works afterwards
    assert call(good()).shape == (b, s, h, d)
    return len(cases)


def _all(rank, world):
    return _delta_cases(rank, world), _conv_cases(rank, world), _bytes_cases(rank, world), _refusal_cases(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_linear_attention_under_cp(world):
    """Every case on one spawn of ranks: the op vs the float64 recurrence (kernels x layouts x documents),
    the conv vs F.conv1d per document, the bytes (two lengths, the same count), refusals on every rank."""
    results = run_ranks(world, _all, timeout=240)
    n_delta, n_conv, sizes, n_refusals = results[0]
    assert n_delta >= 30 and n_conv == 12 and n_refusals == 7
    for layout in ("contiguous", "headtail"):  # independent of N
        assert len({(f, b) for lay, _, f, b in sizes if lay == layout}) == 1


def test_check_linear_layout():
    assert check_linear_layout("headtail") == "headtail"
    with pytest.raises(ValueError, match="headtail"):
        check_linear_layout("striped")
    with pytest.raises(ValueError, match="unknown"):
        check_linear_layout("zigzag")
    assert linear_state_bytes(batch=1, heads=32, dk=128, dv=128, world=8, layout="headtail") == 7 * 2 * 32 * 128 * 256 * 4


def test_single_rank_is_the_kernel():
    """Without a process group (CP = 1) the op is the kernel: one call, same output."""
    *xs, _, _ = make_case(0, b=1, n=21, hk=2, hv=4, d=8, per_channel=False, docs=None, run_len=21)
    xs = [x.float() for x in xs]
    o = sharded_delta_rule(torch_chunk_gated_delta_rule, *xs, mesh=None, layout="contiguous", chunk_size=8)
    want, _ = torch_chunk_gated_delta_rule(*xs, chunk_size=8)
    assert torch.equal(o, want)


def test_decode_steps_continue_the_prefill():
    """Prefill (CP = 1: the op's fold path) with output_final_state, then delta_rule_step / causal_conv1d_step
    token by token: outputs and states equal the float64 recurrence / F.conv1d over the whole sequence (GDN with
    GVA, KDA; prompts shorter than the conv kernel)."""
    for per_channel, hk in ((False, 2), (True, 4)):
        *xs, _, _ = make_case(3, b=2, n=12, hk=hk, hv=4, d=8, per_channel=per_channel, docs=None, run_len=12)
        want_o, want_s = recurrence(*xs)
        o, state = sharded_delta_rule(f64_kernel, *(x[:, :9] for x in xs), mesh=None, layout="contiguous",
                                      use_qk_l2norm_in_kernel=True, output_final_state=True)
        steps = [delta_rule_step(*(x[:, t:t + 1] for x in xs), state, use_qk_l2norm=True) for t in (9, 10)]
        steps.append(delta_rule_step(*(x[:, 11:] for x in xs), state, use_qk_l2norm=True))
        got = torch.cat([o, *steps], 1)
        assert abs_rel_err(got, want_o) < 1e-12 and abs_rel_err(state, want_s) < 1e-12, per_channel
    gen = torch.Generator().manual_seed(1)
    for m, kk in ((7, 4), (2, 4), (5, 1)):
        x, w, bias = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 3, 9), (3, kk), (3,)))
        want = F.silu(F.conv1d(x, w.unsqueeze(1), bias, padding=kk - 1, groups=3)[..., :9])
        out, conv_state = sharded_causal_conv1d(x[..., :m], w, bias, "silu", mesh=None, layout="contiguous",
                                                output_final_state=True)
        assert conv_state.shape == (2, 3, kk)
        steps = [causal_conv1d_step(x[..., t:t + 1], conv_state, w, bias, "silu") for t in range(m, 9)]
        assert abs_rel_err(torch.cat([out, *steps], -1), want) < 1e-12, (m, kk)
        assert torch.equal(conv_state, x[..., 9 - kk:])


def _compiled(rank, world):
    from torch._dynamo.utils import counters

    counters.clear()
    layout, s_local = "headtail", 20
    *xs, do, _ = make_case(3, b=2, n=world * s_local, hk=2, hv=4, d=8, per_channel=False, docs=None, run_len=10)
    want = reference(*xs, do, None)
    shard = lambda x: shard_tensor(x, seq_dim=1, layout=layout, rank=rank, cp_size=world)
    fn = torch.compile(lambda *a: sharded_delta_rule(torch_chunk_gated_delta_rule, *a, mesh=None, layout=layout,
                                                     use_qk_l2norm_in_kernel=True, chunk_size=8))
    for _ in range(2):
        local = [shard(x).float().requires_grad_() for x in xs]
        o = fn(*local)
        o.backward(shard(do).float())
        for a, w in zip([o] + [x.grad for x in local], want):
            assert abs_rel_err(a, shard(w)) < 1e-5
    breaks = dict(counters["graph_break"])
    assert len(breaks) == 1 and "_check_delta" in next(iter(breaks)), breaks  # the agreement runs eagerly
    return True


@exhaustive("80 s (torch 2.13) to 200 s (2.15) of compiling on 2 CPU cores")
def test_compiled_delta_rule():
    """torch.compile (not fullgraph): exact, forward and backward, twice; one graph break, at the agreement."""
    assert run_ranks(2, _compiled, timeout=600) == [True, True]


def test_bench_smoke(tmp_path):
    """scripts/benchmarks/bench_linear_attention.py at a tiny length: runs, and its measured bytes equal the formula."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "benchmarks"))
    import bench_linear_attention as bench

    report = bench.main(["--seq-len", "128", "--repeats", "1", "--d", "16", "--out", str(tmp_path / "la.json")])
    for layout, got in report["bytes_measured"].items():
        assert got["fwd"] == got["bwd"] == got["formula"] == linear_state_bytes(
            batch=1, heads=4, dk=16, dv=16, world=2, layout=layout)
    assert bench.a2a_bytes(world=2, batch=1, s_local=10, hk=1, hv=2, dk=4, dv=4, itemsize=2) == 10 * (8 + 8 + 2 + 2 + 8)
