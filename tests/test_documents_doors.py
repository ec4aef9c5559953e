"""``layout="documents"`` at the own-model and torch-API doors, and the DTensor path's refusal (issue 42).

Each door's loss, logits and gradients on packed documents against the plain CP=1 model given the dense mask
(same document, causal, the window); the same doors with ``layout="striped"`` on the same batch (their
documents now go through the batch's plan, Note [One plan per batch]); bad input -- ids that differ across
ranks, ids that decrease, N not divisible by P, a plan of another batch, a missing plan -- raising on every
rank before any K/V moves (no all-to-all bytes). One spawn per CP size, many cases inside."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiers import slow
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import cp_dtensor
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import rel_err

TOL = 1e-5  # fp32, relative to the largest magnitude
B, N = 2, 24
LENGTHS = [[5, 1, 11, 7], [14, 10]]  # packed documents per row: a 1-token one, ones longer than N / P


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2 * self.kv_heads, self.hd).transpose(1, 2).chunk(2, dim=1)
        o = F.scaled_dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v, attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(x)


class TinyLM(nn.Module):
    """Two attention layers, RoPE indexed by the (global) positions; ``mask`` only for the CP=1 reference."""

    def __init__(self, vocab=32, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, kv_heads) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim // heads, 2) / (dim // heads)))

    def forward(self, tokens, positions, mask=None):
        freqs = positions[:, None, :, None].float() * self.inv_freq  # [B | 1, 1, S, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        return self.head(x)


def _loss(logits, labels, n_tokens=B * N):
    """Each rank's tokens over the global count: the ranks' losses sum to CP=1's."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens


def _batch(lengths):
    positions = torch.stack([torch.cat([torch.arange(x) for x in row]) for row in lengths])  # restart at 0
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    return positions, ids


def _dense_mask(ids, window):
    """[B, 1, N, N] bool: same document, causal, inside the window -- the CP=1 reference's mask."""
    i, j = torch.arange(ids.shape[1])[:, None], torch.arange(ids.shape[1])[None, :]
    keep = (j <= i) & ((j >= i - window[0]) if window else True)
    return (ids[:, None, :, None] == ids[:, None, None, :]) & keep


def _reference(base, tokens, labels, positions, ids, window):
    ref = copy.deepcopy(base)
    logits = ref(tokens, positions, _dense_mask(ids, window))
    loss = _loss(logits, labels)
    loss.backward()
    return loss.item(), logits.detach(), [p.grad for p in ref.parameters()]


def _compare(where, mesh, model, loss, logits, want):
    """The ranks' summed loss, the unsharded logits and the summed gradients = CP=1's."""
    want_loss, want_logits, want_grads = want
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    assert abs(total.item() - want_loss) <= TOL * abs(want_loss), f"{where}: loss {total.item()} vs {want_loss}"
    assert rel_err(logits, want_logits) <= TOL, f"{where}: logits {rel_err(logits, want_logits):.2e}"
    cp_dtensor.reduce_gradients(model, mesh)
    for (name, p), g in zip(model.named_parameters(), want_grads):
        assert rel_err(p.grad, g) <= TOL, f"{where}: grad {name} {rel_err(p.grad, g):.2e}"


def _raises_everywhere(where, fn, match):
    """``fn`` raises ValueError (matching) on this rank -- each rank runs it -- with no K/V moved."""
    with CommBytes() as sent, pytest.raises(ValueError, match=match):
        fn()
    assert sent.sent == sent.by_op.get("all_gather_into_tensor", 0), (where, dict(sent.by_op))  # agreement only
    assert not torch._C._is_torch_function_mode_enabled(), where  # nothing left behind


def _model_door(mesh, base, tokens, labels) -> None:
    world, rank = mesh.size(), mesh.get_local_rank()
    positions, ids = _batch(LENGTHS)
    for window in (None, (3, 0)):
        want = _reference(base, tokens, labels, positions, ids, window)
        for layout, how in (("documents", "position_ids"), ("documents", "document_ids"), ("striped", "position_ids"),
                            ("striped", "plan"), ("headtail", "position_ids")):
            where = f"model door P={world} {layout} {how} window={window}"
            model = cp_dtensor.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout, window_size=window,
                                                      documents="position_ids" if how == "position_ids" else None)
            plan = layout
            if layout == "documents" or how == "plan":  # the caller's plan: See Note [A plan at the model door]
                plan = cp_dtensor.document_layout(ids, world, windows=[window], placement=layout)
            tok, lab, pos, lid = cp_dtensor.shard_batch((tokens, labels, positions, ids), mesh, layout=plan)
            kwargs = {} if isinstance(plan, str) else {"cp_layout": plan}
            if how == "document_ids":
                kwargs["document_ids"] = lid  # checked against the plan's
            logits = model(tok, positions=pos, **kwargs)
            used = model._cp_dtensor_mode.plan
            assert used is not None and used.placement == layout, (where, used)  # one plan for every layer
            full = cp_dtensor.unshard_batch(logits.detach(), mesh, layout=plan)
            loss = _loss(logits, lab)
            loss.backward()
            _compare(where, mesh, model, loss, full, want)

    # rows packed alike: a plan of [1, N] ids orders every row (positions [1, N])
    pos1, ids1 = _batch([LENGTHS[0]])
    want = _reference(base, tokens, labels, pos1, ids1.expand(B, -1), None)
    model = cp_dtensor.apply_context_parallel(copy.deepcopy(base), mesh, layout="documents", documents="position_ids")
    plan = cp_dtensor.document_layout(ids1, world)
    tok, lab, pos = cp_dtensor.shard_batch((tokens, labels, pos1), mesh, layout=plan)
    logits = model(tok, positions=pos, cp_layout=plan)
    full = cp_dtensor.unshard_batch(logits.detach(), mesh, layout=plan)
    loss = _loss(logits, lab)
    loss.backward()
    _compare(f"model door P={world} documents [1, N] plan", mesh, model, loss, full, want)
    # comm_dtype reaches the document exchange: bf16 rows, logits within bf16's rounding of the reference
    model = cp_dtensor.apply_context_parallel(copy.deepcopy(base), mesh, layout="documents", documents="position_ids",
                                              comm_dtype=torch.bfloat16)
    half = cp_dtensor.unshard_batch(model(tok, positions=pos, cp_layout=plan).detach(), mesh, layout=plan)
    assert 0 < (half - full).abs().max() <= 2e-2 * full.abs().max(), (half - full).abs().max()

    # bad input: raises on every rank, before any K/V moves
    model = cp_dtensor.apply_context_parallel(copy.deepcopy(base), mesh, layout="documents", documents="position_ids")
    plan = cp_dtensor.document_layout(ids, world)
    tok, pos = cp_dtensor.shard_batch((tokens, positions), mesh, layout=plan)
    other = ids.clone()
    other[0, 2:] += rank  # rank 0's ids differ from the others'
    mine = cp_dtensor.document_layout(other, world)
    _raises_everywhere("ids differ across ranks", lambda: model(tok, positions=pos, cp_layout=mine),
                       "same plan on every rank|not the shard")
    _raises_everywhere("no plan", lambda: model(tok, positions=pos), "needs each batch's plan")
    moved = cp_dtensor.document_layout(_batch([[3, 21], [24]])[1], world)  # another batch's plan, on every rank
    _raises_everywhere("a plan of another batch", lambda: model(tok, positions=pos, cp_layout=moved), "not the shard")
    if world > 2:
        small = cp_dtensor.document_layout(ids, world - 1)
        _raises_everywhere("a plan for another CP size", lambda: model(tok, positions=pos, cp_layout=small), "ranks")
    falling = ids.clone()
    falling[1, -1] = 0
    _raises_everywhere("decreasing ids", lambda: cp_dtensor.document_layout(falling, world), "must not decrease")
    _raises_everywhere("N not divisible", lambda: cp_dtensor.document_layout(ids[:, : N - 1], world), "divisible")
    with pytest.raises(ValueError, match="kv_exchange"):
        cp_dtensor.apply_context_parallel(TinyLM(), mesh, layout="documents", kv_exchange="allgather")

    class Own(nn.Module):  # a model's own `layout` argument (not a plan) reaches the model
        def forward(self, x, layout="rows"):
            return x * (layout == "columns")

    own = cp_dtensor.apply_context_parallel(Own(), mesh, layout="striped")
    assert own(torch.ones(2), layout="columns").sum().item() == 2


def _torch_door(mesh, base, tokens, labels) -> None:
    from cp_dtensor import context_parallel, context_parallel_unshard

    world, rank = mesh.size(), mesh.get_local_rank()
    positions, ids = _batch(LENGTHS)
    for window in (None, (3, 0)):
        want = _reference(base, tokens, labels, positions, ids, window)
        for layout, by in (("documents", "position_ids"), ("documents", "document_ids"), ("striped", "document_ids")):
            where = f"torch door P={world} {layout} {by} window={window}"
            model = copy.deepcopy(base)
            tok, lab, pos = tokens.clone(), labels.clone(), positions.clone()
            docs = {by: positions if by == "position_ids" else ids}
            with context_parallel(mesh, buffers=[tok, lab, pos], buffer_seq_dims=[1, 1, 1], layout=layout,
                                  window_size=window, **docs) as plan:
                assert isinstance(plan, cp_dtensor.DocumentLayout) and plan.placement == layout, where
                logits = model(tok, pos)
                loss = _loss(logits, lab)
                loss.backward()
            assert tok.shape == tokens.shape and torch.equal(tok, tokens), where  # restored
            (full,) = context_parallel_unshard(mesh, [logits.detach()], [1], layout=plan)
            _compare(where, mesh, model, loss, full, want)

    # rows packed alike: [1, N] positions plan every row, the buffers of B rows sharded by it
    pos1, ids1 = _batch([LENGTHS[0]])
    want = _reference(base, tokens, labels, pos1, ids1.expand(B, -1), None)
    model, tok, lab, pos = copy.deepcopy(base), tokens.clone(), labels.clone(), pos1.clone()
    with context_parallel(mesh, buffers=[tok, lab, pos], buffer_seq_dims=[1, 1, 1], layout="documents",
                          position_ids=pos) as plan:
        logits = model(tok, pos)
        loss = _loss(logits, lab)
        loss.backward()
    (full,) = context_parallel_unshard(mesh, [logits.detach()], [1], layout=plan)
    _compare(f"torch door P={world} documents [1, N] positions", mesh, model, loss, full, want)

    def enter(**kwargs):
        tok = tokens.clone()
        with context_parallel(mesh, buffers=[tok], buffer_seq_dims=[1], layout="documents", **kwargs):
            raise AssertionError("entered")

    other = ids.clone()
    other[0, 2:] += rank
    _raises_everywhere("torch door: ids differ across ranks", lambda: enter(document_ids=other), "plan")
    falling = ids.clone()
    falling[1, -1] = 0
    _raises_everywhere("torch door: decreasing ids", lambda: enter(document_ids=falling), "must not decrease")
    _raises_everywhere("torch door: no ids", lambda: enter(), "needs the batch's documents")
    _raises_everywhere("torch door: allgather", lambda: enter(document_ids=ids, kv_exchange="allgather"), "kv_exchange")
    odd = torch.zeros(B, N + 1, dtype=torch.long)

    def enter_odd():
        with context_parallel(mesh, buffers=[odd.clone()], buffer_seq_dims=[1], layout="documents", document_ids=odd):
            raise AssertionError("entered")

    _raises_everywhere("torch door: N not divisible", enter_odd, "divisible")
    rope = torch.zeros(N, 4)  # a [N, D] table cannot follow rows placed differently

    def enter_table():
        with context_parallel(mesh, buffers=[tokens.clone(), rope], buffer_seq_dims=[1, 0], layout="documents",
                              document_ids=ids):
            raise AssertionError("entered")

    _raises_everywhere("torch door: a table under B > 1 rows", enter_table, "batch dim")
    def enter_plan(plan, **kwargs):
        with context_parallel(mesh, buffers=[tokens.clone()], buffer_seq_dims=[1], layout=plan, **kwargs):
            raise AssertionError("entered")

    moved = cp_dtensor.document_layout(_batch([[3, 21], [24]])[1], world)
    _raises_everywhere("torch door: a plan of other ids", lambda: enter_plan(moved, document_ids=ids), "other document ids")
    _raises_everywhere("torch door: a plan for another CP size",
                       lambda: enter_plan(cp_dtensor.document_layout(ids, 1)), "built for 1 ranks")
    _raises_everywhere("torch door: unshard without the plan",
                       lambda: context_parallel_unshard(mesh, [tokens[:, : N // world]], [1], layout="documents"),
                       "plan")


def _dtensor_path(mesh) -> None:
    world = mesh.size()
    plan = cp_dtensor.document_layout(_batch(LENGTHS)[1], world)
    with pytest.raises(ValueError, match="ring_attention.*layout=plan.*apply_context_parallel.*context_parallel"):
        cp_dtensor.sequence_placement(2, layout="documents", seq_len=N, cp_size=world)
    with pytest.raises(ValueError, match="no DTensor placement carries"):
        cp_dtensor.shard_sequence(torch.zeros(B, 4, N, 8), mesh, seq_dim=2, layout=plan)


def _cases(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    base = TinyLM()
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, 32, (B, N), generator=g), torch.randint(0, 32, (B, N), generator=g)
    _model_door(mesh, base, tokens, labels)
    _torch_door(mesh, base, tokens, labels)
    _dtensor_path(mesh)


def test_documents_at_every_door_match_cp1():
    run_ranks(2, _cases)


@slow("three ranks on two cores: ~10 s")
def test_documents_at_every_door_match_cp1_three_ranks():
    run_ranks(3, _cases)
