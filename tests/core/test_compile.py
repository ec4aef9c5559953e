"""torch.compile(fullgraph=True) of the ring with Inductor: exactness, recompiles, the op boundary, overlap.

Compiling costs ~10-40 s per graph on this CPU (the file: 120-170 s with an empty Inductor cache, ~70 s
warm), so each world size is one spawn that compiles a few graphs and reuses them: same shapes never
recompile, which the tests also check.

What the overlap tests read (see Note [Ring under torch.compile] in comm.py):
  * the FX graphs AOTAutograd hands to Inductor (forward, then backward), and
  * the Python wrapper code Inductor writes,
and they require, for each ring transfer, the order all_to_all_single -> attention block -> wait_tensor.
In the backward only the dK/dV accumulators travel: AOTAutograd merges the backward's K/V rotations
with the forward's and keeps the received blocks (it never recomputes a collective), see
``_check_backward_transfers``.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from _tiers import SLOW, slow
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.graph import GraphLowering

import cp_dtensor
from cp_dtensor.core.compute.ops import block_attn, block_attn_backward, block_attn_backward_into_
from cp_dtensor.core.plan.layout import shard_tensor
from _dist import run_ranks
from _ref import make_qkv, reference, rel_err

TOL = 2e-5  # fp32 against float64, relative to the largest magnitude
_COMM = ("all_to_all_single", "wait_tensor")
_ATTN = ("block_attn", "block_attn_backward")
# the backward's block runs as the mutating op cp_dtensor::block_attn_backward_into_: in the FX graph
# under auto_functionalized, in Inductor's code re-inplaced
_KIND = {"block_attn_backward_into_": "block_attn_backward"}
# The Inductor setting under which Inductor's code keeps the overlap that the FX graph has by
# construction. By default its reorder_for_peak_memory pass may move a wait_tensor up, before the block
# it should overlap (that frees the send buffer sooner), depending on the shapes: seen in the forward
# at P=2, S_local=8 and in the backward at P=3, S_local=8; sinking the waits afterwards
# (reorder_for_compute_comm_overlap with "sink_waits_iterative") still left an exposed forward transfer
# at P=3, S_local=5. With the pass off, Inductor keeps the FX graph's order.
OVERLAP_CONFIG = dict(reorder_for_peak_memory=False)


class _Inductor:
    """The default Inductor backend, recording what it compiles: per Dynamo frame, and the ring's ops
    in the order of each FX graph AOTAutograd hands it (forward, then backward)."""

    def __init__(self):
        self.frames = 0
        self.graphs: list[list[tuple[str, str, str | None]]] = []
        self.gms: list = []  # the FX graphs themselves
        self.codes: list[str] = []

    def __call__(self, gm, example_inputs):
        self.frames += 1

        def inner(g, *args, **kwargs):
            self.graphs.append(_fx_events(g))  # before Inductor's own passes change it
            self.gms.append(g)
            return compile_fx_inner(g, *args, **kwargs)

        return compile_fx(gm, example_inputs, inner_compile=inner)

    @contextmanager
    def code(self):
        """Record the wrapper code of every graph Inductor writes (or loads from its cache) inside."""
        with mock.patch.object(GraphLowering, "save_output_code", self.codes.append):
            yield


def _fx_events(gm) -> list[tuple[str, str, str | None]]:
    """(kind, node, waited-on node) for the ring's ops, in graph order."""
    events = []
    for n in gm.graph.nodes:
        target = n.target
        if n.op == "call_function" and "auto_functionalized" in str(target):
            target = n.args[0]
        name = getattr(target, "_opname", None)
        name = _KIND.get(name, name)
        if n.op == "call_function" and name in _COMM + _ATTN:
            events.append((name, n.name, n.args[0].name if name == "wait_tensor" else None))
    return events


_CALL = re.compile(
    r"^\s*(?:(\w+) = )?torch\.ops\.\w+\.(all_to_all_single|wait_tensor|block_attn_backward_into_|block_attn_backward|block_attn)"
    r"\.default\((\w+)?",
    re.M,
)


def _code_events(code: str) -> list[tuple[str, str, str | None]]:
    """The same events from Inductor's wrapper code: ``buf3 = ...all_to_all_single.default(...)``,
    ``...wait_tensor.default(buf3)``, ``buf4 = ...block_attn.default(...)``."""
    body = code[code.index("def call(") :]
    return [
        (_KIND.get(kind, kind), out or arg, arg if kind == "wait_tensor" else None) for out, kind, arg in _CALL.findall(body)
    ]


def _transfers(events, attn: str) -> list[tuple[int, int]]:
    """For each transfer: how many ``attn`` blocks run before it is issued and before it is waited on."""
    blocks = [i for i, (kind, _, _) in enumerate(events) if kind == attn]
    res = []
    for i, (kind, name, _) in enumerate(events):
        if kind == "all_to_all_single":
            waits = [j for j, (k, _, of) in enumerate(events) if k == "wait_tensor" and of == name]
            assert len(waits) == 1, f"transfer {name} is waited on {len(waits)} times: {events}"
            res.append((sum(b < i for b in blocks), sum(b < waits[0] for b in blocks)))
    return res


def _check_forward_transfers(events, world: int, where: str) -> None:
    """Every K/V transfer is issued before a block and waited on after it."""
    tr = _transfers(events, "block_attn")
    assert len(tr) == world - 1, f"{where}: {len(tr)} K/V transfers, expected {world - 1}: {events}"
    for before, at_wait in tr:
        assert at_wait > before, f"{where}: a K/V transfer is waited on before any block runs: {events}"


def _check_backward_transfers(events, world: int, where: str) -> None:
    """The backward re-sends K/V and moves the dK/dV accumulators, one message a step (Note [One
    message per backward step] in ring.py): K/V alone at steps 0 and 1, K/V with the previous step's
    accumulator from step 2, the accumulator alone at the last step (P >= 3), then the hop home. Every
    message but the hop home is waited on only after a block has run."""
    tr = _transfers(events, "block_attn_backward")
    expected = sum(1 for t in range(world) if t + 1 < world or t >= 2) + (world > 1)
    assert len(tr) == expected, f"{where}: {len(tr)} transfers, expected {expected}: {events}"
    for before, at_wait in tr[:-1]:
        assert at_wait > before, f"{where}: a transfer is waited on before the next block: {events}"


_VIEWS = {"view", "_unsafe_view", "reshape", "slice", "select", "narrow", "as_strided", "unsqueeze", "alias",
          "split_with_sizes", "getitem", "t", "transpose", "permute", "expand", "clone", "contiguous"}


def _saved_received(gm) -> list[str]:
    """Forward outputs (the tensors saved for backward included) that are, or are views of, a buffer a
    collective received."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    bad = []
    for node in out.args[0]:
        n = node
        while hasattr(n, "target") and n.op == "call_function":
            name = getattr(n.target, "_opname", getattr(n.target, "__name__", ""))
            if name == "wait_tensor":
                bad.append(node.name)
                break
            if name not in _VIEWS or not n.args:
                break
            n = n.args[0]
    return bad


def _shards(rank, world, layout, seed, hq, hkv, s_local, d=16):
    q, k, v, do = make_qkv(seed, 2, hq, hkv, s_local * world, d)

    def shard(x):
        return shard_tensor(x, seq_dim=2, layout=layout, rank=rank, cp_size=world).float()

    return (q, k, v, do), [shard(x).requires_grad_() for x in (q, k, v)], shard


def _run_and_compare(f, rank, world, layout, causal, seed, hq=4, hkv=2, s_local=8, scale=None) -> float:
    full, (ql, kl, vl), shard = _shards(rank, world, layout, seed, hq, hkv, s_local)
    want = reference(*full, is_causal=causal, scale=scale)
    out = f(ql, kl, vl)
    out.backward(shard(full[3]))
    return max(rel_err(g, shard(w).double()) for g, w in zip((out, ql.grad, kl.grad, vl.grad), want))


def _ring(layout, causal, scale=None):
    return lambda q, k, v: cp_dtensor.ring_attention(q, k, v, layout=layout, is_causal=causal, scale=scale)


# -- P = 2: exactness for every layout, recompiles, a new sequence length, the DTensor path ----------


def _compile_p2(rank, world, every_layout):
    torch._inductor.config.compile_threads = 1  # two ranks already share the two cores
    t0, report = time.perf_counter(), {}

    def lap(name):
        report[f"seconds_{name}"] = round(time.perf_counter() - t0, 1)

    # 1. striped causal with the default Inductor, its FX graphs recorded; then new values, same shapes.
    be = _Inductor()
    f = torch.compile(_ring("striped", True), backend=be, fullgraph=True)
    with torch._functorch.config.patch(enable_autograd_cache=False):  # so that `be` sees the graphs
        err = _run_and_compare(f, rank, world, "striped", True, seed=1)
    assert err <= TOL, f"striped causal: rel err {err:.2e}"
    assert be.frames == 1 and len(be.graphs) == 2, (be.frames, len(be.graphs))
    # Default Inductor keeps the FX graph's order here or not, depending on shapes: see OVERLAP_CONFIG.
    _check_forward_transfers(be.graphs[0], world, "forward FX graph")
    err = _run_and_compare(f, rank, world, "striped", True, seed=2)
    assert err <= TOL and be.frames == 1, f"same shapes, new values: err {err:.2e}, {be.frames} compiles"

    # 2. A new sequence length: Dynamo recompiles once with the length symbolic (automatic dynamic
    # shapes); further lengths reuse that graph.
    for s_local, frames in ((16, 2), (24, 2), (7, 2)):
        err = _run_and_compare(f, rank, world, "striped", True, seed=s_local, s_local=s_local)
        assert err <= TOL, f"S_local={s_local}: rel err {err:.2e}"
        assert be.frames == frames, f"S_local={s_local}: {be.frames} compiles, expected {frames}"
    _check_forward_transfers(be.graphs[2], world, "forward FX graph, dynamic S")
    report["compiles_for_4_lengths"] = be.frames
    lap("striped_and_lengths")

    # 3. The other layouts, causal and not, GQA/MQA/MHA, a custom scale: one graph each. Contiguous
    # causal is the case where rank 0 skips a step but must still pass the block on.
    # (Not one graph for all: the rings of such a graph are independent of each other, and Inductor
    # may then order their transfers differently on different ranks -- whose graphs differ.)
    # (The default tier compiles head-tail; the slow tier adds the other two.)
    cases = [("headtail", True, 4, 2, None), ("contiguous", True, 4, 1, 0.3), ("striped", False, 4, 4, None)]
    for i, (layout, causal, hq, hkv, scale) in enumerate(cases if every_layout else cases[:1]):
        be3 = _Inductor()
        g = torch.compile(_ring(layout, causal, scale), backend=be3, fullgraph=True)
        err = _run_and_compare(g, rank, world, layout, causal, 10 + i, hq, hkv, s_local=6, scale=scale)
        assert err <= TOL and be3.frames == 1, f"{layout} causal={causal}: rel err {err:.2e}, {be3.frames} compiles"

    lap("layouts")

    # 4. F.scaled_dot_product_attention on sequence-sharded DTensors (the SDPA dispatch rule).
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor.dtensor.placements import full_tensor

    mesh = init_device_mesh("cpu", (world,))
    be4 = _Inductor()
    sdpa = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                         backend=be4, fullgraph=True)
    for seed in (20, 21):  # new values, same shapes: no recompile
        q, k, v, do = make_qkv(seed, 2, 4, 2, 8 * world, 16)
        want = reference(q, k, v, do, is_causal=True)
        dq, dk, dv = (cp_dtensor.shard_sequence(x.float(), mesh, seq_dim=2).requires_grad_() for x in (q, k, v))
        with torch._functorch.config.patch(enable_autograd_cache=False):
            out = sdpa(dq, dk, dv)
            out.backward(cp_dtensor.shard_sequence(do.float(), mesh, seq_dim=2))
        assert out.placements == dq.placements and dq.grad.placements == dq.placements
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq.grad, dk.grad, dv.grad), want):
            assert rel_err(full_tensor(a), b) <= TOL, f"DTensor SDPA {name}: {rel_err(full_tensor(a), b):.2e}"
    assert be4.frames == 1, be4.frames
    _check_forward_transfers(be4.graphs[0], world, "DTensor SDPA forward FX graph")
    lap("dtensor")
    return report


def test_compiled_ring_p2_layouts_recompiles_dtensor():
    """P=2: every layout matches float64 through fwd+bwd; no recompile for new values; one recompile
    (dynamic S) for new lengths; SDPA on DTensors compiles to the ring; the forward overlaps."""
    reports = run_ranks(2, _compile_p2, SLOW, timeout=900)
    assert all(r["compiles_for_4_lengths"] == 2 for r in reports)


# -- P = 4: the schedule, forward and backward; nothing received is saved --------------------------------


def _compile_schedule(rank, world):
    torch._inductor.config.compile_threads = 1
    be = _Inductor()
    f = torch.compile(_ring("striped", True), backend=be, fullgraph=True)
    with be.code(), torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(OVERLAP_CONFIG):
        err = _run_and_compare(f, rank, world, "striped", True, seed=3, s_local=5)
    assert err <= TOL, f"striped causal P={world}: rel err {err:.2e}"
    assert len(be.graphs) == 2 and len(be.codes) == 2, (len(be.graphs), len(be.codes))
    fw_code, bw_code = (_code_events(c) for c in be.codes)
    _check_forward_transfers(be.graphs[0], world, "forward FX graph")
    _check_backward_transfers(be.graphs[1], world, "backward FX graph")
    # the compiled step holds what eager holds: no received K/V block is kept for the backward
    assert _saved_received(be.gms[0]) == [], _saved_received(be.gms[0])
    if world == 3:  # Inductor's own order (at P=4 its scheduler moves one forward send after its block)
        _check_forward_transfers(fw_code, world, "forward Inductor code")
        _check_backward_transfers(bw_code, world, "backward Inductor code")


@pytest.mark.parametrize("world", [3, pytest.param(4, marks=slow("P = 4: ~30 s"))])
def test_compiled_schedule_overlaps_and_saves_no_received_block(world):
    """Forward: K/V of step t+1 is sent before step t's block and waited on after it. Backward: K/V is
    re-sent as in eager and each dK/dV hop is waited on after the next block. The forward graph saves
    no buffer a collective received: O(1) K/V blocks per call, not P - 1."""
    run_ranks(world, _compile_schedule, timeout=900)


# -- the compile boundary -----------------------------------------------------------------------------


def _op_cases():
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    # (q, k, v, is_causal): MHA, GQA, MQA; square and not; sliced, non-contiguous views as the ring passes
    base_q, base_kv = rnd(2, 4, 9, 16), rnd(2, 2, 9, 16)
    yield base_q[:, :, 1:], base_kv[:, :, :-1], rnd(2, 9, 2, 16).transpose(1, 2)[:, :, :-1], True  # striped shift
    yield rnd(1, 4, 6, 8), rnd(1, 4, 6, 8), rnd(1, 4, 6, 8), True
    yield rnd(1, 4, 6, 8)[:, :, 3:], rnd(1, 1, 6, 8), rnd(1, 1, 6, 8), False  # headtail: tail rows x all keys
    yield rnd(2, 8, 5, 16), rnd(2, 2, 10, 16)[:, :, :5], rnd(2, 2, 5, 16), False


def test_block_ops_pass_opcheck():
    """cp_dtensor::block_attn and ::block_attn_backward: schema, fake impls, autograd registration and
    AOT dispatch (static and dynamic) agree with the real kernels. Run in a forked rank: opcheck's
    backward passes in the pytest process itself would start autograd's device threads on CUDA builds of
    torch (2.15 on CPU included), after which no later test could fork its ranks."""
    run_ranks(1, _opcheck)


def _opcheck(rank: int, world: int) -> None:
    for q, k, v, causal in _op_cases():
        scale = q.shape[-1] ** -0.5
        q, k, v = (x.requires_grad_() for x in (q.detach(), k.detach(), v.detach()))
        torch.library.opcheck(block_attn, (q, k, v, causal, scale))
        out, lse = block_attn(q.detach(), k.detach(), v.detach(), causal, scale)
        dout = torch.randn_like(out)
        # as the ring passes them: row slices (views with an offset, not contiguous) of the whole shard's
        # out, lse and dout -- e.g. lse[:, :, 1:] for the striped shift, lse[:, :, c:] for head-tail's tail
        def rows(x):
            return torch.cat([torch.zeros_like(x[:, :, :1]), x], 2)[:, :, 1:]

        assert not rows(lse).is_contiguous() and rows(lse).storage_offset() == 1
        torch.library.opcheck(
            block_attn_backward, (rows(dout), q.detach(), k.detach(), v.detach(), rows(out), rows(lse), causal, scale)
        )
        # the ring's form: into its accumulators, rows given as bounds
        sq, sk = q.shape[2], k.shape[2]
        dq, dkv = torch.zeros(q.shape), torch.zeros(k.numel() + v.numel())
        torch.library.opcheck(
            block_attn_backward_into_,
            (dq, dkv, dout, q.detach(), k.detach(), v.detach(), out, lse, 0, sq, 0, sk, causal, scale, True),
        )
        # and a row range of the whole shard's out / lse / dout, as the striped shift passes them (q[1:]
        # against k[:-1]): the op slices lse itself
        k1 = sk - 1 if causal else sk
        torch.library.opcheck(
            block_attn_backward_into_,
            (dq, dkv, dout, q.detach(), k.detach(), v.detach(), out, lse, 1, sq, 0, k1, causal, scale, True),
        )
