"""apply_context_parallel on a small transformer: CP=2 and CP=4 training matches the CP=1 run."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiers import SLOW
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import cp_dtensor
from cp_dtensor._compat import mesh_flatten
from cp_dtensor.core.batch import shard_batch, unshard_batch
from cp_dtensor.core.dynamic import plan_report
from cp_dtensor.core.plan.documents import needed_rows, row_balance
from cp_dtensor.doors import apply_context_parallel, reduce_gradients
from cp_dtensor.dtensor.sdpa import install_sdpa_dispatch
from _dist import run_ranks
from _ref import rel_err

TOL = 1e-5  # fp32, relative to the largest magnitude


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, S, hd]; cos, sin: [B, 1, S, hd/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cos, sin, mask=None, window=None):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.wkv(h).view(b, s, 2 * self.kv_heads, self.hd).transpose(1, 2).chunk(2, dim=1)
        o = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=32, dim=32, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim // heads, 2) / (dim // heads)))

    def forward(self, tokens, positions, mask=None):
        # tokens, positions: [B, S] -- positions are global, so RoPE follows the layout
        freqs = positions[:, None, :, None].float() * self.inv_freq  # [B, 1, S, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        return self.head(self.norm(x))


def _loss(logits, labels, n_tokens):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens


def _check_training(rank: int, world: int) -> None:
    install_sdpa_dispatch()
    torch.manual_seed(0)
    base = TinyLM()
    b, n, steps = 2, 16, 3
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (b, n), generator=g), torch.randint(0, 32, (b, n), generator=g))
               for _ in range(steps)]
    positions = torch.arange(n).expand(b, n)

    # CP=1: the plain model on the full sequence, on every rank alike
    ref, ref_losses, ref_grads, ref_logits = copy.deepcopy(base), [], [], []
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for tokens, labels in batches:
        logits = ref(tokens, positions)
        loss = _loss(logits, labels, b * n)
        opt.zero_grad()
        loss.backward()
        ref_losses.append(loss.item())
        ref_grads.append([p.grad.clone() for p in ref.parameters()])
        ref_logits.append(logits.detach())
        opt.step()

    meshes = {4: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]}
    for cp, layout in ((cp, layout) for cp in (2, 4) for layout in ("striped", "headtail", "contiguous")):
        cp_mesh = meshes[cp]
        model = apply_context_parallel(copy.deepcopy(base), cp_mesh, layout=layout)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step, (tokens, labels) in enumerate(batches):
            tok, lab, pos = shard_batch((tokens, labels, positions), cp_mesh, layout=layout)
            logits = model(tok, pos)
            loss = _loss(logits, lab, b * n)
            opt.zero_grad()
            loss.backward()
            reduce_gradients(model, cp_mesh)
            total = loss.detach().clone()
            dist.all_reduce(total, group=cp_mesh.get_group())
            where = f"cp={cp} {layout} step {step}"
            assert abs(total.item() - ref_losses[step]) <= TOL * abs(ref_losses[step]), where
            for (name, p), want in zip(model.named_parameters(), ref_grads[step]):
                assert rel_err(p.grad, want) <= TOL, f"{where} grad {name}: {rel_err(p.grad, want):.2e}"
            full = unshard_batch(logits.detach(), cp_mesh, layout=layout)
            assert rel_err(full, ref_logits[step]) <= TOL, where
            opt.step()

    # attn_mask / dropout inside a CP model: a clear error before any communication
    class Bad(nn.Module):
        def forward(self, x, **kw):
            return F.scaled_dot_product_attention(x, x, x, **kw)

    bad = apply_context_parallel(Bad(), meshes[4], layout="striped")
    x = torch.randn(1, 2, 4, 8)
    # on every rank, or on one rank only (a mask built from one rank's local shapes): every rank raises,
    # after the agreement check's all-gathers (fingerprints, then the error texts), before any K/V moves
    for kw in (dict(dropout_p=0.1), dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)),
               dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)) if rank == 1 else dict(is_causal=True)):
        with CommDebugMode() as cm, pytest.raises(ValueError, match="no explicit attn_mask"):
            bad(x, **kw)
        counts = {str(k).split(".")[-1]: n for k, n in cm.get_comm_counts().items()}
        assert "all_to_all_single" not in counts and counts["all_gather_into_tensor"] == 1, counts
        assert not torch._C._is_torch_function_mode_enabled()  # the failed forward left no mode behind
    with pytest.raises(ValueError, match="already applied"):
        apply_context_parallel(bad, meshes[4])


def test_transformer_training_matches_cp1():
    run_ranks(4, _check_training)


def _dense_mask(ids: torch.Tensor, window: tuple[int, int] | None) -> torch.Tensor:
    """[B, 1, N, N] boolean: same document, causal, inside the window -- the CP=1 reference's mask."""
    n = ids.shape[1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = (j <= i) & ((j >= i - window[0]) if window else True)
    return (ids[:, None, :, None] == ids[:, None, None, :]) & keep


def _check_packed(rank: int, world: int, packed: bool = True) -> None:
    torch.manual_seed(0)
    base = TinyLM()
    b, n = 2, 24
    g = torch.Generator().manual_seed(3)
    tokens, labels = torch.randint(0, 32, (b, n), generator=g), torch.randint(0, 32, (b, n), generator=g)
    lengths = [[5, 1, 11, 7], [24]]  # packed documents per row (HF convention: positions restart at 0)
    positions = torch.stack([torch.cat([torch.arange(x) for x in row]) for row in lengths])
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])
    mesh = init_device_mesh("cpu", (world,))
    for window in ((None, (3, 0)) if packed else ()):
        ref = copy.deepcopy(base)
        ref_logits = ref(tokens, positions, _dense_mask(ids, window))
        _loss(ref_logits, labels, b * n).backward()
        for layout in ("striped", "headtail", "contiguous"):
            for how in ("document_ids", "position_ids"):
                model = apply_context_parallel(copy.deepcopy(base), mesh, layout=layout, window_size=window,
                                               documents="position_ids" if how == "position_ids" else None)
                tok, lab, pos, lid = shard_batch((tokens, labels, positions, ids), mesh, layout=layout)
                # the hook reads keyword arguments: positions by keyword for the position_ids path
                logits = model(tok, pos, document_ids=lid) if how == "document_ids" else model(tok, positions=pos)
                _loss(logits, lab, b * n).backward()
                reduce_gradients(model, mesh)
                where = f"P={world} {layout} {how} window={window}"
                full = unshard_batch(logits.detach(), mesh, layout=layout)
                assert rel_err(full, ref_logits.detach()) <= TOL, where
                for (name, p), want in zip(model.named_parameters(), ref.parameters()):
                    assert rel_err(p.grad, want.grad) <= TOL, f"{where} grad {name}"
    if world == 4:
        _check_dynamic(rank, base)


def _check_dynamic(rank: int, base: nn.Module) -> None:
    """shard_batch(dynamic=True) on a dp 2 x cp 2 grid: one plan of the global batch (dp ranks with very
    unequal documents) over the 4 ranks; loss, logits and gradients equal the static documents run (each dp
    rank's rows on its own cp ranks) and the float64 model on the whole global batch, both normalised by
    the global count of valid tokens."""
    from cp_dtensor import document_layout
    from cp_dtensor.tools.debug import CommBytes

    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    d = grid.get_coordinate()[0]
    lengths = [[[24], [20, 4]], [[3, 5, 2, 6, 8], [1, 1, 22]]]  # dp rank -> its rows' documents
    g = torch.Generator().manual_seed(5)
    tokens, labels = torch.randint(0, 32, (4, 24), generator=g), torch.randint(0, 32, (4, 24), generator=g)
    labels[1, :3] = labels[3, 5:9] = -100  # ignored labels: the loss divides by the global count of the others
    positions = torch.stack([torch.cat([torch.arange(x) for x in row]) for rows in lengths for row in rows])
    ids = (positions == 0).cumsum(1)
    count = int((labels != -100).sum())
    tok, lab, pos = (x[2 * d : 2 * d + 2] for x in (tokens, labels, positions))  # this dp rank's rows

    def loss_of(logits, lab):
        return F.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum", ignore_index=-100) / count

    for window in (None, (3, 0)):
        ref = copy.deepcopy(base).double()  # float64, the whole global batch on one device
        ref_logits = ref(tokens, positions, _dense_mask(ids, window))
        ref_loss = loss_of(ref_logits, labels)
        ref_loss.backward()
        runs = {}
        for how in ("static", "dynamic"):
            model = apply_context_parallel(copy.deepcopy(base), mesh_flatten(grid) if how == "dynamic"
                                           else grid["cp"], layout="documents", window_size=window,
                                           documents="position_ids")
            if how == "static":
                mesh, plan = grid["cp"], document_layout((pos == 0).cumsum(1), 2, windows=[window])
                t, lb, p = shard_batch((tok, lab, pos), mesh, layout=plan)
            else:
                with CommBytes() as sent:
                    (t, lb, p), plan, mesh = shard_batch((tok, lab, pos), grid, layout="documents", dynamic=True,
                                                         position_ids=pos, windows=[window])
                assert mesh.size() == 4 and plan.cp_size == 4 and t.shape == (1, 24), (t.shape, plan)
                assert sent.by_op["all_to_all_single"] > 0, dict(sent.by_op)  # token ids moved
                assert cp_dtensor.core.dynamic.DynamicBatch(None, plan, mesh).valid_tokens(lb) == count
                # the balance report against the planner's own pure-Python figures
                held = plan.order[0].view(4, -1).sort(1).values.tolist()
                docs = torch.unique_consecutive(plan.ids[0], return_counts=True)[1].tolist()
                report = plan_report(plan)
                assert report["tokens"] == 24 and report["rows"] == max(needed_rows(held, docs)), report
                assert abs(report["work"] - row_balance(held, docs, windows=[window])) < 1e-9, report
                if window is None:  # each dp rank's own rows: sum of L (L + 1) / 2 over its documents
                    per_dp = [sum(x * (x + 1) // 2 for row in rows for x in row) for rows in lengths]
                    want_dp = max(per_dp) * 2 / sum(per_dp)
                    assert abs(plan_report(plan, dp=2)["dp_rows"] - want_dp) < 1e-9, (report, want_dp)
            logits = model(t, positions=p, cp_layout=plan)
            loss = loss_of(logits, lb)
            loss.backward()
            flat = mesh_flatten(grid)
            reduce_gradients(model, flat)  # the dp x cp gradient reduction, once
            total = loss.detach().clone()
            dist.all_reduce(total, group=flat.get_group())
            full = unshard_batch(logits.detach(), mesh, layout=plan)  # [B, N] static (this dp rank), [1, 4 * N] dynamic
            runs[how] = (total.item(), full.reshape(-1, 24, 32), [q.grad for q in model.parameters()])
        for how, (loss, full, grads) in runs.items():
            where = f"{how} window={window}"
            assert abs(loss - ref_loss.item()) <= DYN_TOL * abs(ref_loss.item()), (where, loss, ref_loss.item())
            want = ref_logits.detach().float() if how == "dynamic" else ref_logits.detach().float()[2 * d : 2 * d + 2]
            assert rel_err(full, want) <= DYN_TOL, where
            for (name, q), got in zip(ref.named_parameters(), grads):
                err = rel_err(got, q.grad.float())
                assert err <= DYN_TOL, f"{where} grad {name}: {err:.2e}"
        s_loss, _, s_grads = runs["static"]
        assert abs(runs["dynamic"][0] - s_loss) <= DYN_TOL * abs(s_loss)
        assert all(rel_err(a, b) <= DYN_TOL for a, b in zip(runs["dynamic"][2], s_grads))

    # bad input: every rank raises, before any token moves (no all-to-all)
    other = torch.cat([torch.arange(20), torch.arange(4)]).expand(2, 24)
    cases = [
        ("no documents layout", dict(position_ids=pos), "needs layout='documents'"),
        ("labels off the ids", dict(layout="documents", position_ids=pos, batch=(tok, lab[:, :12])), "follow the"),
        ("positions off the ids", dict(layout="documents", position_ids=pos[:, :12], batch=(tok, pos)), "follow the"),
        ("global batch shapes differ", dict(layout="documents", position_ids=pos[: 1 + (rank == 3)],
                                            batch=(tok[: 1 + (rank == 3)],)), "same batch shapes|rejected"),
        ("cp ranks disagree", dict(layout="documents", position_ids=other if rank == 1 else pos), "same rows"),
        ("N not divisible", dict(layout="documents", position_ids=pos[:1, :23], batch=(tok[:1, :23],)), "divisible"),
    ]
    for where, kw, match in cases:
        batch = kw.pop("batch", (tok, lab, pos))
        with CommBytes() as sent, pytest.raises(ValueError, match=match):
            shard_batch(batch, grid, dynamic=True, **kw)
        assert "all_to_all_single" not in sent.by_op, (where, dict(sent.by_op))


DYN_TOL = 2e-5  # fp32 against the float64 reference, relative to the largest magnitude


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_and_windows_match_cp1_dense_mask(world):
    """Packed sequences (ids, or position ids restarting at 0) and a sliding window through
    apply_context_parallel: logits and gradients equal a CP=1 model given the dense mask. At 4 ranks also
    dynamic CP (shard_batch(..., dynamic=True)) on a dp 2 x cp 2 grid against the static documents run (the
    packed cases at 4 ranks: slow tier)."""
    run_ranks(world, _check_packed, world == 2 or SLOW)


def _grad_on_some_ranks(rank: int, world: int) -> list[float]:
    """A parameter only some ranks' tokens reach (an MoE expert unused on this rank's shard): grad None here.
    reduce_gradients agrees on which parameters have one, so every rank sums the same tensors (no mismatched
    collective), and the result is the sum over the ranks that reached it."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.ModuleDict({"shared": nn.Linear(3, 3), "expert": nn.Linear(3, 3)})
    x = torch.full((2, 3), float(rank + 1))
    out = model["shared"](x)
    if rank == 0:  # only rank 0's tokens were routed to the expert
        out = model["expert"](out)
    out.sum().backward()
    want = model["expert"].weight.grad.clone() if rank == 0 else None
    reduce_gradients(model, mesh)
    got = model["expert"].weight.grad
    assert got is not None
    if rank == 0:
        assert torch.equal(got, want)  # rank 1 added zeros
    return got.flatten().tolist()


def test_reduce_gradients_with_a_parameter_only_some_ranks_reached():
    results = run_ranks(2, _grad_on_some_ranks)
    assert results[0] == results[1] and any(v != 0 for v in results[0])


def test_dynamic_example_is_the_docs_block():
    """docs/documents.md's dynamic CP example (run by tests/test_docs.py on 2 ranks) is scripts/examples/dynamic_cp.py."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    script = (root / "scripts" / "examples" / "dynamic_cp.py").read_text()
    page = (root / "docs" / "documents.md").read_text().split("## Dynamic CP", 1)[1]
    block = page.split("<!-- example: ranks=2 -->\n```python\n", 1)[1].split("```", 1)[0]
    assert block.strip() and block in script, "docs/documents.md's dynamic CP example differs from the script"
