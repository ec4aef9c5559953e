"""Compiled calls agree across ranks like eager ones (Note [Compiled agreement] in checks.py).

One bad rank of two (four on the 2-D mesh), ``torch.compile(fullgraph=True)`` with aot_eager and
Inductor: every rank raises the very ValueError the eager call raises, before any K/V moves (gloo would
otherwise abort the process on a size mismatch, or the ranks would return wrong outputs silently).
One spawn of ranks runs every case; shapes are tiny and forward-only, so Inductor compiles little.
"""

from __future__ import annotations

import contextlib
import re
import time
from unittest import mock

import pytest
import torch
from _tiers import slow
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.compile_fx import compile_fx
from torch._inductor.graph import GraphLowering
from torch.distributed.device_mesh import init_device_mesh

import cp_dtensor
from cp_dtensor.core.plan.layout import shard_tensor
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import make_qkv, reference, rel_err


def _x(seed: int, s_local: int, d: int = 8) -> torch.Tensor:
    return torch.randn(1, 2, s_local, d, generator=torch.Generator().manual_seed(seed))


def _ids(rank: int, world: int, s_local: int, *, bad: bool) -> torch.Tensor:
    """This rank's striped shard of global ids [1, N] that never decrease (bad: rank 1's shard of ids
    that do decrease)."""
    n = world * s_local
    ids = torch.arange(n).div(3, rounding_mode="floor").view(1, n)
    if bad:
        ids = ids.flip(1)
    return shard_tensor(ids, seq_dim=1, layout="striped", rank=rank, cp_size=world).contiguous()


# (name, fault: rank -> (S_local, ring_attention keywords, document_ids bad?), words of the message)
FAULTS = [
    ("sequence length", lambda r: (6 + 2 * (r == 1), {}, None), ["seq_len_local", "rank 0: seq_len_local=6"]),
    ("decreasing document ids", lambda r: (6, {}, r == 1), ["must not decrease"]),
    ("window", lambda r: (6, {"window_size": (2 + (r == 1), 0)}, None), ["window_left"]),
    ("layout", lambda r: (6, {"layout": ("striped", "contiguous")[r == 1]}, None), ["layout"]),
    ("local error on one rank", lambda r: (6, {"window_size": (-5 if r == 1 else -1, 0)}, None),
     ["rank(s) 1", "window_size"]),
]


def _call(rank, world, fault, group=None):
    s_local, kwargs, bad_ids = fault(rank)
    q, k, v = _x(1, s_local), _x(2, s_local), _x(3, s_local)
    ids = None if bad_ids is None else _ids(rank, world, s_local, bad=bad_ids)
    kwargs = dict(layout="striped", is_causal=True, mesh=group) | kwargs

    def f(q, k, v, ids):
        return cp_dtensor.ring_attention(q, k, v, document_ids=ids, **kwargs)

    return f, (q, k, v, ids)


def _message(fn, args, *, count: bool) -> str:
    """The ValueError ``fn(*args)`` raises; eager (``count``), also that no K/V collective ran."""
    with CommBytes() if count else contextlib.nullcontext() as sent:
        try:
            fn(*args)
        except ValueError as e:
            msg = str(e)
        else:
            raise AssertionError("no error")
    if count:
        assert sent.by_op["all_to_all_single"] == 0, sent.by_op
    return msg


class _Recording:
    """aot_eager or Inductor, recording the code each forward graph runs as (FX code / Inductor's wrapper)."""

    def __init__(self, backend: str):
        self.backend, self.codes = backend, []

    def __call__(self, gm, example_inputs):
        if self.backend == "inductor":
            return compile_fx(gm, example_inputs)

        def fw(g, _):
            self.codes.append(g.code)
            return g

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    @contextlib.contextmanager
    def recording(self):
        if self.backend != "inductor":
            yield
            return
        with mock.patch.object(GraphLowering, "save_output_code", self.codes.append):
            yield


_COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor")


def _check_order(codes: list[str], where: str) -> None:
    """The agreement op runs, and before any collective of the graph (K/V or heads)."""
    assert len(codes) == 1, f"{where}: {len(codes)} graphs"
    code = codes[0]
    code = code[code.find("def call(") :] if "def call(" in code else code  # Inductor: the wrapper's body
    first = min((i for i in (code.find(c) for c in _COLLECTIVES) if i >= 0), default=len(code))
    at = code.find("cp_dtensor.agree_")
    assert 0 <= at < first, f"{where}: the agreement is not before the first collective:\n{code}"
    tie, sent = (re.search(rf"{op}\.default\((\w+),", code) for op in ("tie_", "all_to_all_single"))
    if "def call(" in codes[0] and tie and sent:  # Inductor re-inplaces the tie: the payload is not copied
        assert tie.group(1) == sent.group(1), f"{where}: the tie copied the K/V payload:\n{code}"


def _faults(rank, world, backends, faults, mesh_shape):
    torch._inductor.config.compile_threads = 1  # the ranks share the two cores
    group = None if mesh_shape is None else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ulysses", "ring"))
    report = {}
    for name, fault, words in faults:
        fn, args = _call(rank, world, fault, group)
        eager = _message(fn, args, count=True)
        missing = [w for w in words if w not in eager]
        assert not missing, f"{name}: eager message lacks {missing}: {eager}"
        for backend in backends:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            be = _Recording(backend)
            with be.recording():
                compiled = _message(torch.compile(fn, backend=be, fullgraph=True), args, count=False)
            assert compiled == eager, f"{name}, {backend}: compiled raised {compiled!r}, eager {eager!r}"
            _check_order(be.codes, f"{name}, {backend}")
            report[f"{name}/{backend}"] = round(time.perf_counter() - t0, 1)
    if backends != ("aot_eager",):
        return report
    # the group still works, compiled: a good call after all those errors matches float64
    torch._dynamo.reset()
    q, k, v, _ = make_qkv(7, 1, 2, 2, 8 * world, 8)
    want = reference(q, k, v, torch.zeros_like(q), is_causal=True)[0]
    shard = lambda x: shard_tensor(x, seq_dim=2, layout="striped", rank=rank, cp_size=world).float().contiguous()  # noqa: E731
    f = torch.compile(lambda q, k, v: cp_dtensor.ring_attention(q, k, v, is_causal=True, mesh=group),
                      backend=backends[0], fullgraph=True)
    err = rel_err(f(shard(q), shard(k), shard(v)), shard(want))
    assert err < 2e-5, err
    return report


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=slow("Inductor: ~25 s"))])
def test_compiled_bad_rank_raises_on_every_rank(backend):
    """Each fault on one rank of two: every rank raises eager's ValueError, nothing K/V-sized moves."""
    reports = run_ranks(2, _faults, (backend,), FAULTS, None, timeout=600)
    assert all(len(r) == len(FAULTS) for r in reports)


@slow("4 ranks compiled: ~15 s")
def test_compiled_bad_rank_raises_on_every_rank_2d():
    """The same on a (U, R) = (2, 2) mesh (heads all-to-all, then the ring): the one preamble."""
    faults = [f for f in FAULTS if f[0] in ("sequence length", "decreasing document ids", "layout")]
    run_ranks(4, _faults, ("aot_eager",), faults, (2, 2), timeout=600)
