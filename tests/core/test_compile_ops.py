"""``sharded_causal_conv1d``, ``sharded_delta_rule`` and ``sharded_cache_attention`` under
``torch.compile(fullgraph=True)`` (Note [Compiled agreement of the other ops] in agreement.py): aot_eager and
Inductor give eager's forward and input gradients (float64, 1e-5; eager itself is checked against float64
references in test_linear_attention.py and test_decode.py), P = 2; bad input on one rank raises eager's
ValueError on every rank, compiled, and the group still works after it. One spawn runs every case."""

from __future__ import annotations

import time

import pytest
import torch
from _tiers import SLOW, exhaustive, slow

from cp_dtensor.core.decode import sharded_cache_attention
from cp_dtensor.core.linear.linear_attention import sharded_causal_conv1d, sharded_delta_rule
from _dist import run_ranks
from _ref import f64_kernel


def _inputs(rank: int):
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    x, w, bias = r(2, 3, 8), r(3, 4), r(3)
    # global ids [2, 16] in the headtail layout: rank 0 holds runs 0 and 3, rank 1 runs 1 and 2 (4 tokens each)
    ids = torch.tensor([[0] * 5 + [1] * 3, [0] * 8]) if rank == 0 else torch.tensor([[1] * 8, [0] * 3 + [2] * 5])
    q, k, v = r(2, 8, 2, 4), r(2, 8, 2, 4), r(2, 8, 4, 4)
    g = -torch.rand(2, 8, 4, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, 8, 4, generator=gen, dtype=torch.float64)
    return x, w, bias, ids, (q, k, v, g, beta)


def _cases(rank: int):
    x, w, bias, ids, delta = _inputs(rank)
    conv = lambda **kw: lambda x: sharded_causal_conv1d(x, w, bias, "silu", mesh=None, layout="headtail", **kw)  # noqa: E731
    return {  # name -> (inputs, fn returning one tensor)
        "conv": ((x,), conv()),
        "conv documents": ((x,), conv(document_ids=ids)),
        "conv state": ((x,), lambda x: sharded_causal_conv1d(x, w, None, None, mesh=None, layout="contiguous",
                                                             output_final_state=True)[1] * 1.0),
        "delta rule": (delta, lambda *a: sharded_delta_rule(f64_kernel, *a, mesh=None, layout="headtail",
                                                          use_qk_l2norm_in_kernel=True)),
        "delta rule state": (delta, lambda *a: sharded_delta_rule(f64_kernel, *a, mesh=None, layout="contiguous",
                                                                output_final_state=True)[1] * 1.0),
    }


def _decode(rank: int, *, window=(5, 0), bad: bool = False):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((1, 2, 1, 4), (1, 2, 3, 4), (1, 2, 3, 4)))
    qp, kp = torch.tensor([[10 + (bad and rank == 1)]]), torch.tensor([[rank, rank + 2, rank + 4]])
    return (q,), lambda q: sharded_cache_attention(q, k, v, q_positions=qp, k_positions=kp, window_size=window)


def _raises(fn, args) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


def _compiled_ops(rank: int, world: int, backends: tuple[str, ...], names: tuple[str, ...] | None,
                  faults: bool = True) -> dict:
    torch._inductor.config.compile_threads = 1  # the ranks share the two cores
    report = {}
    cases = _cases(rank)
    for name, (xs, fn) in cases.items():
        if names is not None and name not in names:
            continue
        want_in = [x.clone().requires_grad_() for x in xs]
        want = fn(*want_in)
        want.backward(torch.ones_like(want))
        for backend in backends:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            got_in = [x.clone().requires_grad_() for x in xs]
            got = torch.compile(fn, backend=backend, fullgraph=True)(*got_in)
            got.backward(torch.ones_like(got))
            assert (got - want).abs().max() < 1e-5, (name, backend)
            for a, b in zip(got_in, want_in):
                assert (a.grad is None) == (b.grad is None), (name, backend)  # the state does not read q
                assert a.grad is None or (a.grad - b.grad).abs().max() < 1e-5, (name, backend)
            report[f"{name}/{backend}"] = round(time.perf_counter() - t0, 1)
    with torch.no_grad():  # decoding is forward only
        (q,), fn = _decode(rank)
        want = fn(q)
        for backend in backends:
            torch._dynamo.reset()
            assert (torch.compile(fn, backend=backend, fullgraph=True)(q) - want).abs().max() < 1e-5, backend
            report[f"decode/{backend}"] = True
    if not faults:
        return report
    # bad input on rank 1 only, compiled (aot_eager): every rank raises eager's error
    x, w, bias, ids, (q_, k_, v_, g_, b_) = _inputs(rank)
    faults = {
        "conv: kernel size": ((x,), lambda x: sharded_causal_conv1d(x, w[:, : 4 - rank], None, "silu", mesh=None,
                                                                   layout="headtail")),
        "conv: activation": ((x,), lambda x: sharded_causal_conv1d(x, w, None, "relu" if rank else "silu", mesh=None,
                                                                  layout="headtail")),
        "delta rule: value heads": ((q_, k_, v_[:, :, : 4 - 2 * rank], g_[:, :, : 4 - 2 * rank], b_[:, :, : 4 - 2 * rank]),
                                    lambda *a: sharded_delta_rule(f64_kernel, *a, mesh=None, layout="headtail")),
        "delta rule: local error": ((q_, k_, v_, g_, b_), lambda *a: sharded_delta_rule(
            f64_kernel, *a, mesh=None, layout="striped" if rank else "headtail")),
        "decode: replicated queries differ": _decode(rank, bad=True),
        "decode: local error": _decode(rank, window=(5, -3 if rank else 0)),
    }
    for name, (args, fn) in faults.items():
        with torch.no_grad() if name.startswith("decode") else torch.enable_grad():
            eager = _raises(fn, args)
            torch._dynamo.reset()
            compiled = _raises(torch.compile(fn, backend=backends[0], fullgraph=True), args)
        assert compiled == eager, (name, compiled, eager)
        report[name] = eager[:60]
    # the group still works, compiled
    xs, fn = cases["delta rule"]
    torch._dynamo.reset()
    assert (torch.compile(fn, backend=backends[0], fullgraph=True)(*xs) - fn(*xs)).abs().max() < 1e-5
    return report


DEFAULT = ("conv documents", "delta rule state")  # the rest compiles for minutes on 2 cores: slow tier


@pytest.mark.skipif(SLOW, reason="the slow tier's every-case run below is a superset")
def test_ops_compile_fullgraph_aot_eager():
    """aot_eager: forward and input gradients equal eager (the conv, with documents, and the delta rule's final
    state; decoding); faults on one rank raise on both."""
    reports = run_ranks(2, _compiled_ops, ("aot_eager",), DEFAULT, timeout=600)
    assert reports[0].keys() == reports[1].keys() and len(reports[0]) == len(DEFAULT) + 7, reports


@slow("every case, aot_eager: ~4 min on 2 CPU cores")
def test_ops_compile_fullgraph_aot_eager_every_case():
    reports = run_ranks(2, _compiled_ops, ("aot_eager",), None, timeout=900)
    assert reports[0].keys() == reports[1].keys() and len(reports[0]) == 12, reports


@exhaustive("Inductor compiles the conv and the delta rule (~65 s; every case runs on aot_eager in the slow tier)")
def test_ops_compile_fullgraph_inductor():
    # the faults are aot_eager's (the agreement op is the same opaque call under either backend)
    reports = run_ranks(2, _compiled_ops, ("inductor",), ("conv", "delta rule"), False, timeout=1800)
    assert reports[0].keys() == reports[1].keys() == {"conv/inductor", "delta rule/inductor", "decode/inductor"}, reports
