"""``torch.compile(fullgraph=True)`` (Inductor, CPU) of ``ring_attention`` with a document layout passed as an
argument (Note [Compiled document exchange] in doc_op.py): forward + backward against float64 dense attention,
new document boundaries without recompiling, bad input raising on every rank before any K/V moves. One spawn
of two ranks runs every case; shapes are tiny, so Inductor compiles little."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._inductor.compile_fx import compile_fx

import cp_dtensor
from cp_dtensor.core.exchange.doc_op import doc_attn, doc_attn_backward
from cp_dtensor.core.plan.documents import needed_rows
from _dist import run_ranks
from _ref import abs_rel_err, masked_reference

TOL = 2e-5  # fp32 against float64, relative to the largest magnitude
N = 12  # two ranks of S_local = 6


def _ids(*lengths: list[int]) -> torch.Tensor:
    """[B, N] document ids of rows of documents of these lengths."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths])


# four batches with other document boundaries each: short, one document, 1-token documents, one > N / P
BATCHES = [_ids([3, 5, 4], [2, 10]), _ids([12], [1, 2, 3, 6]), _ids([1] * 12, [12]), _ids([8, 1, 3], [5, 7])]


class _Counting:
    """Inductor, counting the graphs Dynamo hands it (one per compilation of a frame)."""

    def __init__(self):
        self.compilations = 0

    def __call__(self, gm, example_inputs):
        self.compilations += 1
        return compile_fx(gm, example_inputs)


def _data(seed: int, ids: torch.Tensor, *, hq: int = 4, hkv: int = 2, d: int = 8, dv: int = 4):
    g = torch.Generator().manual_seed(seed)
    b, n = ids.shape
    q, k = torch.randn(b, hq, n, d, generator=g, dtype=torch.float64), torch.randn(b, hkv, n, d, generator=g,
                                                                                  dtype=torch.float64)
    v, do = torch.randn(b, hkv, n, dv, generator=g, dtype=torch.float64), torch.randn(b, hq, n, dv, generator=g,
                                                                                     dtype=torch.float64)
    return q, k, v, do, torch.randn(hq, generator=g, dtype=torch.float64)


def _errors(rank, world, fn, ids, seed, *, window=None, sinks: bool, pass_ids: bool = False,
            placement: str = "documents") -> list[float]:
    """fn's forward + backward on this rank's shards of a batch against float64 dense attention."""
    q, k, v, do, s = _data(seed, ids)
    want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=window,
                            sinks=s if sinks else None)
    lay = cp_dtensor.document_layout(ids, world, windows=[window], placement=placement)

    def shard(x, dim=2):
        return cp_dtensor.shard_tensor(x, seq_dim=dim, layout=lay, rank=rank, cp_size=world)

    ql, kl, vl = (shard(x).float().requires_grad_() for x in (q, k, v))
    sl = s.float().requires_grad_() if sinks else None
    out = fn(ql, kl, vl, lay, sl, shard(ids, 1) if pass_ids else None)
    out.backward(shard(do).float())
    errs = [abs_rel_err(a, shard(r)) for a, r in zip((out, ql.grad, kl.grad, vl.grad), want[:4])]
    if sinks:
        total = sl.grad.clone()
        dist.all_reduce(total)  # each rank's grad is its queries' share
        errs.append(abs_rel_err(total, want[4]))
    return errs


def _exact(rank, world):
    torch._dynamo.reset()
    counting, windowed = _Counting(), _Counting()

    def attend(q, k, v, lay, sinks, ids):
        return cp_dtensor.ring_attention(q, k, v, layout=lay, is_causal=True, sinks=sinks)

    def attend_window(q, k, v, lay, sinks, ids):
        return cp_dtensor.ring_attention(q, k, v, layout=lay, is_causal=True, window_size=(3, 0), document_ids=ids)

    compiled = torch.compile(attend, backend=counting, fullgraph=True)
    compiled_window = torch.compile(attend_window, backend=windowed, fullgraph=True)
    sent, real = [], funcol.all_to_all_single  # the K/V and dK/dV rows this rank sends, call by call

    def counted(x, out_splits, in_splits, group, *args, **kwargs):
        sent.append(sum(n for r, n in enumerate(in_splits) if r != dist.get_rank(group)))
        return real(x, out_splits, in_splits, group, *args, **kwargs)

    with mock.patch.object(funcol, "all_to_all_single", counted):
        errs = [_errors(rank, world, compiled, BATCHES[0], 0, sinks=True)]
    errs += [_errors(rank, world, compiled, ids, i, sinks=True) for i, ids in enumerate(BATCHES) if i]
    errs += [_errors(rank, world, compiled_window, ids, 10 + i, window=(3, 0), sinks=False, pass_ids=True)
             for i, ids in enumerate(BATCHES[:2])]
    # a named placement ("striped") carries the ids for the ring: its compiled ring masks by them
    striped = _Counting()
    compiled_striped = torch.compile(attend, backend=striped, fullgraph=True)
    errs += [_errors(rank, world, compiled_striped, ids, 20 + i, sinks=True, placement="striped")
             for i, ids in enumerate(BATCHES[:2])]
    # new lengths: one more compilation (N symbolic), then none -- the batch's shape, not its documents
    lengths = _Counting()
    compiled_lengths = torch.compile(attend, backend=lengths, fullgraph=True)
    for n, docs in ((N, [3, 9]), (N + 4, [5, 11]), (N + 8, [7, 13]), (N + 12, [4, 20])):
        errs.append(_errors(rank, world, compiled_lengths, _ids(docs), 30 + n, sinks=False))
    return (max(max(e) for e in errs), sent, counting.compilations, windowed.compilations, striped.compilations,
            lengths.compilations)


def _bad(rank, world):
    """Bad input under compile: every rank raises eager's ValueError; no K/V all-to-all ran; then a good
    call is exact (no rank was left behind in a collective)."""
    torch._dynamo.reset()
    ids = BATCHES[0]
    lay, other = cp_dtensor.document_layout(ids, world), cp_dtensor.document_layout(BATCHES[1], world)
    mine = cp_dtensor.shard_tensor(ids, seq_dim=1, layout=lay, rank=rank, cp_size=world)

    def attend(q, k, v, lay, ids):
        return cp_dtensor.ring_attention(q, k, v, layout=lay, is_causal=True, document_ids=ids)

    def attend_allgather(q, k, v, lay, ids):
        return cp_dtensor.ring_attention(q, k, v, layout=lay, is_causal=True, kv_exchange="allgather")

    compiled = torch.compile(attend, backend=_Counting(), fullgraph=True)
    cases = {
        "ids differ across ranks": (compiled, lay if rank else other, None),
        "ids of another batch": (compiled, lay, mine + 1 if rank == 0 else mine),
        "an option": (torch.compile(attend_allgather, backend=_Counting(), fullgraph=True), lay, None),
    }
    q, k, v = (torch.randn(2, 2, N // world, 8) for _ in range(3))
    messages = {}
    sends = mock.patch.object(funcol, "all_to_all_single_autograd", wraps=funcol.all_to_all_single_autograd)
    for name, (fn, layout, document_ids) in cases.items():
        with sends as sent:
            try:
                fn(q, k, v, layout, document_ids)
            except ValueError as e:
                messages[name] = str(e)
            else:
                raise AssertionError(f"{name}: no error on rank {rank}")
        assert sent.call_count == 0, (name, sent.call_count)
    good = _errors(rank, world, lambda q, k, v, lay, s, i: compiled(q, k, v, lay, i), ids, 0, sinks=False,
                   pass_ids=True)
    return messages, max(good)


def test_compiled_document_layout_exact_and_no_recompiles():
    """Inductor, fullgraph: fp32 forward + backward (q, k, v, sinks) <= 2e-5 of float64 dense attention over
    four batches of other document boundaries (B = 2, GQA, Dv != Dqk, sinks; then a window with
    document_ids given; a named placement carrying the ids), and at most 2 compilations for the four (one
    expected: the layout's key reaches the graph as a tensor); four lengths N: at most 2 (N becomes symbolic);
    the rows on the wire against the masks' count."""
    per_rank = run_ranks(2, _exact)
    worst, sent, *compilations = per_rank[0]
    assert max(worst, per_rank[1][0]) <= TOL, worst
    assert max(compilations) <= 2, compilations
    # the wire, compiled: the forward sends the rows the masks need (documents.py's count, summed over rows
    # and ranks), once; the backward sends them again (nothing received is saved) and their dK/dV back
    lay = cp_dtensor.document_layout(BATCHES[0], 2)
    need = 0
    for b, row in enumerate(BATCHES[0].tolist()):
        pos = [cp_dtensor.local_positions(layout=lay, rank=r, cp_size=2, seq_len=N)[b].tolist() for r in range(2)]
        need += sum(needed_rows(pos, [row.count(x) for x in sorted(set(row))]))
    (fwd0, kv0, grad0), (fwd1, kv1, grad1) = sent, per_rank[1][1]
    assert fwd0 + fwd1 == need > 0 and (kv0, kv1) == (fwd0, fwd1) and grad0 + grad1 == need


def test_compiled_bad_document_input_raises_on_every_rank():
    per_rank = run_ranks(2, _bad)
    (m0, good0), (m1, good1) = per_rank
    assert m0.keys() == m1.keys()
    assert "layout key" in m0["ids differ across ranks"] and "layout key" in m1["ids differ across ranks"]
    assert all("not the ids this document layout was built from" in m["ids of another batch"] for m in (m0, m1))
    assert "rank(s) 0" in m1["ids of another batch"]  # rank 1 raises rank 0's error
    assert all("own exchange" in m["an option"] for m in (m0, m1))
    assert max(good0, good1) <= TOL


def test_document_ops_fake_and_schema():
    """The ops' schemas and fake implementations agree with the real ones (torch.library.opcheck, one rank)."""
    run_ranks(1, _opcheck)


def _opcheck(rank, world):
    ids = BATCHES[3]
    lay = cp_dtensor.document_layout(ids, world)
    q, k, v, do, s = (x.float() for x in _data(0, ids))
    q, k, v, s = (x.requires_grad_() for x in (q, k, v, s))
    group = dist.group.WORLD.group_name
    args = (q, k, v, s, lay.order, lay.ids, lay.key_tensor, None, None, True, None, 8 ** -0.5, group, torch.bfloat16)
    tests = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(doc_attn, args, test_utils=tests)
    out, lse = doc_attn(*args)
    back = (do.float(), q, k, v, s, out, lse, lay.order, lay.ids, lay.key_tensor, True, None, 8 ** -0.5, group,
            torch.bfloat16)
    torch.library.opcheck(doc_attn_backward, tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in back),
                          test_utils=("test_schema", "test_faketensor"))
