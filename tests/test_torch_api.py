"""torch's context-parallel API on the ring: torch's own test pattern (shard q, k, v in place, SDPA inside
the context, ``context_parallel_unshard`` of the output and the gradients) against float64 SDPA on the full
tensors; buffers restored or kept as asked; a small model trained inside the context = the CP=1 run;
documents and windows against a dense-mask reference; refusals on every rank. One spawn per world size."""

from __future__ import annotations

import copy
import importlib.util
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tiers import exhaustive, slow
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from cp_dtensor import context_parallel, context_parallel_unshard, reduce_gradients, unshard_batch
from cp_dtensor.core.plan.layout import shard_tensor
from cp_dtensor.torch_api import set_rotate_method
from _dist import run_ranks
from _ref import abs_rel_err, make_qkv, masked_reference, reference, rel_err

TOL = 2e-5  # float32 against float64, relative to the largest magnitude
LAYOUTS = ("striped", "headtail", "contiguous")


def _torch_pattern(mesh, *, layout: str, is_causal: bool, hq: int, hkv: int, compiled: bool) -> None:
    """torch's test_ring_attention_sdpa, written as for torch (only the import and ``layout=`` differ)."""
    world = mesh.size()
    q, k, v, do = make_qkv(7, 2, hq, hkv, 8 * world, 8)
    out, dq, dk, dv = reference(q, k, v, do, is_causal=is_causal)
    cp_q, cp_k, cp_v, cp_do = (t.float().clone() for t in (q, k, v, do))
    with context_parallel(mesh, buffers=(cp_q, cp_k, cp_v, cp_do), buffer_seq_dims=(2, 2, 2, 2), layout=layout):
        for t in (cp_q, cp_k, cp_v):
            t.requires_grad = True
        attention = F.scaled_dot_product_attention
        if compiled:
            attention = torch.compile(attention, fullgraph=True, backend="aot_eager")
        cp_out = attention(cp_q, cp_k, cp_v, is_causal=is_causal, enable_gqa=hq != hkv)
        cp_out.backward(cp_do)
        cp_dq, cp_dk, cp_dv = cp_q.grad, cp_k.grad, cp_v.grad
        for t in (cp_q, cp_k, cp_v):
            t.requires_grad = False
    where = f"P={world} {layout} causal={is_causal} gqa={hq}/{hkv} compiled={compiled}"
    (full,) = context_parallel_unshard(mesh, [cp_out], [2], layout=layout)
    assert not full.requires_grad, where
    assert rel_err(full, out) <= TOL, where
    for name, got, want in zip("qkv", context_parallel_unshard(mesh, [cp_dq, cp_dk, cp_dv], [2] * 3, layout=layout),
                               (dq, dk, dv)):
        assert rel_err(got, want) <= TOL, f"{where} d{name}: {rel_err(got, want):.2e}"
    for t, orig in zip((cp_q, cp_k, cp_v, cp_do), (q, k, v, do)):  # restored on exit
        assert t.shape == orig.shape and torch.equal(t, orig.float()), where


def _buffers(mesh) -> None:
    """Restored unless in no_restore_buffers; nested contexts; an exception inside; stock SDPA outside."""
    rank, world = mesh.get_local_rank(), mesh.size()
    n = 4 * world
    a, b = torch.arange(2 * n).view(2, n), torch.randn(n, 3)
    a0, b0 = a.clone(), b.clone()
    with context_parallel(mesh, buffers=[a, b], buffer_seq_dims=[1, 0], no_restore_buffers={a}, layout="headtail"):
        assert torch.equal(a, shard_tensor(a0, seq_dim=1, layout="headtail", rank=rank, cp_size=world))
        assert torch.equal(b, shard_tensor(b0, seq_dim=0, layout="headtail", rank=rank, cp_size=world))
    assert torch.equal(a, shard_tensor(a0, seq_dim=1, layout="headtail", rank=rank, cp_size=world))  # kept sharded
    assert torch.equal(b, b0)
    a = a0.clone()
    with pytest.raises(KeyError, match="inside"):
        with context_parallel(mesh, buffers=[a], buffer_seq_dims=[1]):
            with context_parallel(mesh, buffers=[b], buffer_seq_dims=[0], layout="contiguous"):
                assert a.shape == (2, 4) and b.shape == (4, 3)
                assert torch._C._is_torch_function_mode_enabled()
            assert torch.equal(b, b0) and a.shape == (2, 4)
            raise KeyError("inside")
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert not torch._C._is_torch_function_mode_enabled()
    # SDPA after the context is stock: a local call on one rank's full tensors, no communication
    q, k, v, do = make_qkv(3, 1, 2, 2, 8, 4)
    got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(got, reference(q, k, v, do, is_causal=True)[0]) <= 1e-12
    # a leaf that requires grad is sharded and restored; its .grad stays the shard's gradient
    x = torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True)
    x0 = x.detach().clone()
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
        F.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward()
    assert x.requires_grad and torch.equal(x.detach(), x0) and x.grad.shape == (1, 2, 4, 4)
    ref = x0.clone().requires_grad_()
    F.scaled_dot_product_attention(ref, ref, ref, is_causal=True).sum().backward()
    (full,) = context_parallel_unshard(mesh, [x.grad], [2])
    assert rel_err(full, ref.grad) <= 1e-10
    set_rotate_method("alltoall")  # torch's call, accepted


def _documents(mesh) -> None:
    """Documents (ids, or positions restarting at 0) and windows = float64 attention under the dense mask."""
    world = mesh.size()
    n = 6 * world
    q, k, v, do = make_qkv(11, 2, 4, 2, n, 8)
    cuts = [[3, 1, n - 4 - 5, 5], [n]]  # packed documents per row
    positions = torch.stack([torch.cat([torch.arange(c) for c in row]) for row in cuts])
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in cuts])
    cases = [(dict(position_ids=positions), ids, None), (dict(document_ids=ids), ids, None),
             (dict(window_size=(3, 0)), None, (3, 0)), (dict(position_ids=positions, window_size=(2, 1)), ids, (2, 1))]
    for layout in LAYOUTS:
        for kwargs, want_ids, window in cases:
            causal = window is None or window[1] == 0
            out, dq, dk, dv, _ = masked_reference(q, k, v, do, is_causal=causal, document_ids=want_ids,
                                                  window_size=window)
            cp_q, cp_k, cp_v, cp_do, pos = (t.float().clone() if t.is_floating_point() else t.clone()
                                            for t in (q, k, v, do, positions))
            kw = dict(kwargs, position_ids=pos) if "position_ids" in kwargs else kwargs
            with context_parallel(mesh, buffers=[cp_q, cp_k, cp_v, cp_do, pos], buffer_seq_dims=[2, 2, 2, 2, 1],
                                  layout=layout, **kw):
                for t in (cp_q, cp_k, cp_v):
                    t.requires_grad_()
                cp_out = F.scaled_dot_product_attention(cp_q, cp_k, cp_v, is_causal=causal, enable_gqa=True)
                cp_out.backward(cp_do)
            where = f"P={world} {layout} {sorted(kwargs)} window={window}"
            got = context_parallel_unshard(mesh, [cp_out, cp_q.grad, cp_k.grad, cp_v.grad], [2] * 4, layout=layout)
            for name, g, want in zip(("out", "dq", "dk", "dv"), got, (out, dq, dk, dv)):
                assert abs_rel_err(g, want) <= TOL, f"{where} {name}: {abs_rel_err(g, want):.2e}"


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.wkv(x).view(b, s, 2 * self.kv_heads, self.hd).transpose(1, 2).chunk(2, dim=1)
        o = F.scaled_dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v, is_causal=True,
                                           enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(x)


def _rope(x, cos, sin):
    # x: [B, H, S, hd]; cos, sin: [S, hd/2]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyLM(nn.Module):
    """Two attention layers; RoPE from a precomputed [max_seq_len, hd/2] table held as buffers (torchtitan's
    freqs_cis pattern): under CP the tables are buffers of the context too (seq dim 0)."""

    def __init__(self, max_seq_len: int, vocab=32, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, kv_heads) for _ in range(2))
        self.head = nn.Linear(dim, vocab, bias=False)
        hd = dim // heads
        angles = torch.arange(max_seq_len)[:, None] / 10000 ** (torch.arange(0, hd, 2) / hd)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]  # the local shard's table under CP: sliced to S_local
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.head(x)


def _loss(logits, labels, n_tokens):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_tokens


def _training(mesh, base: TinyLM, batches, ref_losses, ref_params) -> None:
    """A loop written for torch's API (buffers: tokens, labels, the RoPE tables) = the CP=1 run."""
    world = mesh.size()
    b, n = batches[0][0].shape
    for layout in LAYOUTS:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step, (tokens, labels) in enumerate(batches):
            tokens, labels = tokens.clone(), labels.clone()
            with context_parallel(mesh, buffers=[tokens, labels, model.cos, model.sin], buffer_seq_dims=[1, 1, 0, 0],
                                  no_restore_buffers={tokens, labels}, layout=layout):
                loss = _loss(model(tokens), labels, b * n)  # each rank's tokens over the global count
                loss.backward()
            reduce_gradients(model, mesh)  # sum the ranks' shares (DDP / FSDP over CP do this)
            opt.step()
            opt.zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=mesh.get_group())
            where = f"P={world} {layout} step {step}"
            assert abs(loss.item() - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), where
            assert model.cos.shape == base.cos.shape, where  # the model's buffers are restored every step
        for p, want in zip(model.parameters(), ref_params):
            assert rel_err(p.detach(), want) <= 1e-5, f"P={world} {layout} parameters after training"


def _torch_modules(mesh) -> None:
    """nn.TransformerEncoder (its SDPA call is inside F.multi_head_attention_forward), causal and not,
    inside the context: the outputs and gradients of the same modules on the full sequence, in float64 (in
    float32 the first layer's in_proj gradients are tiny and carry ~1e-2 of their own size in rounding)."""
    world = mesh.size()
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=16, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).double()
    n = 4 * world
    seq = torch.randn(2, n, 16, dtype=torch.float64)
    for causal in (True, False):
        ref = copy.deepcopy(model)
        mask = nn.Transformer.generate_square_subsequent_mask(n) if causal else None
        want = ref(seq, mask=mask, is_causal=causal)
        want.square().sum().backward()
        cp_model, x = copy.deepcopy(model), seq.clone()
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1], layout="headtail"):
            local = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if causal else None
            out = cp_model(x, mask=local, is_causal=causal)
            out.square().sum().backward()
        reduce_gradients(cp_model, mesh)
        (out,) = context_parallel_unshard(mesh, [out.detach()], [1], layout="headtail")
        assert rel_err(out, want.detach()) <= 1e-10, f"P={world} TransformerEncoder causal={causal}"
        for (name, p), w in zip(cp_model.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, w.grad) <= 1e-9, f"P={world} TransformerEncoder causal={causal} grad {name}"
    mha, x = nn.MultiheadAttention(16, 4, batch_first=True).double(), seq.clone()
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]), pytest.raises(ValueError, match="need_weights"):
        mha(x, x, x)  # need_weights=True by default: weights by matmul on the shard, no SDPA
    assert torch.equal(x, seq)


def _overlapping_buffers(mesh) -> None:
    """Buffers that are overlapping views of one tensor -- q, k, v of a packed qkv; q and k as halves of the
    last dim -- are exact against float64 attention on the full tensors, and their base never changes,
    inside the context or after it, restored or kept sharded (issue 40)."""
    rank, world = mesh.get_local_rank(), mesh.size()
    n, h, d = 8 * world, 2, 8
    g = torch.Generator().manual_seed(11)
    for case in ("qkv[:, :, i]", "x[..., :D], x[..., D:]", "qkv[:, :, i], k kept sharded"):
        if case.startswith("qkv"):
            base = torch.randn(2, n, 3, h, d, generator=g)  # [B, N, 3, H, D]
            q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))  # each [B, H, N, D], one storage
        else:
            base = torch.randn(2, h, n, 2 * d, generator=g)  # [B, H, N, 2D]
            q, k, v = base[..., :d], base[..., d:], torch.randn(2, h, n, d, generator=g)
        keep = {k} if "kept" in case else set()
        base0, full = base.clone(), [t.clone() for t in (q, k, v)]
        want = reference(q, k, v, torch.zeros_like(q), is_causal=True)[0]
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers=keep):
            assert torch.equal(base, base0), f"{case}: the base changed inside the context"
            assert torch.equal(k, shard_tensor(full[1], seq_dim=2, layout="striped", rank=rank, cp_size=world)), case
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (got,) = context_parallel_unshard(mesh, [out], [2])
        assert rel_err(got, want) <= TOL, f"{case}: {rel_err(got, want):.2e}"
        assert torch.equal(base, base0), f"{case}: the base tensor changed"
        assert torch.equal(q, full[0]) and torch.equal(v, full[2]), f"{case}: a buffer was not restored"
        assert torch.equal(k, shard_tensor(full[1], seq_dim=2, layout="striped", rank=rank, cp_size=world) if keep
                           else full[1]), case


def _refusals(mesh) -> None:
    """What the ring cannot serve raises the same error on every rank, with the buffers restored."""
    rank, world = mesh.get_local_rank(), mesh.size()
    x = torch.randn(1, 2, 2 * world, 8)
    x0 = x.clone()
    bad_calls = [
        (dict(attn_mask=torch.ones(2, 2, dtype=torch.bool)), "no explicit attn_mask"),
        (dict(dropout_p=0.1), "no explicit attn_mask"),
        # a mask on one rank only (built from its local shapes): every rank raises
        (dict(attn_mask=torch.ones(2, 2, dtype=torch.bool)) if rank == 1 else {}, "rejected the inputs of rank"),
    ]
    for kwargs, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
                F.scaled_dot_product_attention(x, x, x, **kwargs)
        assert torch.equal(x, x0) and not torch._C._is_torch_function_mode_enabled()
    k = torch.randn(1, 1, 2, 8)
    with context_parallel(mesh), pytest.raises(ValueError, match="enable_gqa=True"):
        F.scaled_dot_product_attention(x[:, :, :2], k, k)
    from torch.nn.attention.flex_attention import flex_attention

    if world == 2:  # flex_attention compiles itself (seconds): the ValueError arrives wrapped by Dynamo
        with context_parallel(mesh), pytest.raises(Exception, match="flex_attention inside a context-parallel"):
            flex_attention(x, x, x)
    # transformers' attention code builds its mask from local shapes: refused, pointing to cp_dtensor.hf
    scope = {"__name__": "transformers.integrations.sdpa_attention", "F": F}
    exec("def sdpa_attention_forward(q, k, v):\n    return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
         scope)
    with context_parallel(mesh), pytest.raises(ValueError, match="cp_dtensor.hf"):
        scope["sdpa_attention_forward"](x[:, :, :2], x[:, :, :2], x[:, :, :2])
    # bad arguments on one rank only: every rank raises at entry, before any buffer changes
    y = torch.randn(2, 3 * world + (rank == 0))
    y0 = y.clone()
    for kwargs, match in [
        (dict(buffers=[y], buffer_seq_dims=[1]), "divisible by"),
        (dict(buffers=[x], buffer_seq_dims=[2], layout="diagonal" if rank == 0 else "striped"), "unknown layout"),
        (dict(buffers=[x, y], buffer_seq_dims=[2]), "one sequence dim per buffer"),
        (dict(buffers=[x], buffer_seq_dims=[2], no_restore_buffers={y}), "subset"),
        (dict(buffers=[nn.Parameter(x)], buffer_seq_dims=[2]), "not parameters"),
        (dict(document_ids=torch.tensor([[0, 1] * world])), "must not decrease"),
        (dict(window_size=(-2, 0)), "window_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            with context_parallel(mesh, **kwargs):
                pass
        assert torch.equal(x, x0) and torch.equal(y, y0)
    with pytest.raises(ValueError, match="layout="):
        context_parallel_unshard(mesh, [x], [2], object())
    # unequal local shards (issue 40): a ValueError on every rank naming each rank's shape -- not gloo's abort
    z = torch.arange(4.0 + rank)[None] + 10 * rank  # [1, 4 + rank]
    shapes = r"rank 0: local shapes={}\(1, 4\) float32; rank 1: local shapes={}\(1, 5\) float32"
    with pytest.raises(ValueError, match="unshard_batch needs the same local shapes .*" + shapes.format("", "")):
        unshard_batch(z, mesh)
    with pytest.raises(ValueError, match=shapes.format(*[r"batch\['labels'\] "] * 2)):
        unshard_batch({"labels": z}, mesh)
    with pytest.raises(ValueError, match="context_parallel_unshard needs the same local shapes.*"
                       + shapes.format(*[r"buffers\[0\] "] * 2)):
        context_parallel_unshard(mesh, [z], [1])
    with pytest.raises(ValueError, match=r"rejected the inputs of rank\(s\) 0: .*seq_dim=2 is out of range"):
        unshard_batch(z, mesh, seq_dim=2 if rank == 0 else 1)
    got = unshard_batch(z[:, :4], mesh, layout="contiguous")  # and the group still works
    assert torch.equal(got, torch.cat([torch.arange(4.0)[None] + 10 * r for r in range(world)], 1))
    with pytest.raises(NotImplementedError):
        set_rotate_method("ring")


def _cases(rank: int, world: int, base: TinyLM, batches, ref_losses, ref_params) -> None:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    for layout in LAYOUTS:
        for is_causal, (hq, hkv) in ((True, (4, 2)), (False, (2, 2)), (True, (2, 2))):
            _torch_pattern(mesh, layout=layout, is_causal=is_causal, hq=hq, hkv=hkv, compiled=False)
    _buffers(mesh)
    _overlapping_buffers(mesh)
    _documents(mesh)
    _training(mesh, base, batches, ref_losses, ref_params)
    _torch_modules(mesh)
    _refusals(mesh)
    example = _example()  # the docs' code (docs/torch_api.md), as torchrun runs it
    example.tutorial(mesh, "cpu")
    example.packed_documents(mesh, "cpu")


def _example():
    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "examples" / "torch_api_example.py"
    spec = importlib.util.spec_from_file_location("torch_api_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cp1(base: TinyLM, batches):
    """The CP=1 run: losses and final parameters of the plain model on the full sequences."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for tokens, labels in batches:
        loss = _loss(model(tokens), labels, tokens.numel())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=slow("P = 4: ~10 s"))])
def test_torch_api_matches_no_cp(world):
    torch.manual_seed(0)
    n = 8 * world
    base = TinyLM(n)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (2, n), generator=g), torch.randint(0, 32, (2, n), generator=g))
               for _ in range(3)]
    run_ranks(world, _cases, base, batches, *_cp1(base, batches))


def _train_compiled(rank: int, world: int, base: TinyLM, batches, ref_losses, ref_params) -> None:
    """The model compiled whole with Inductor, trained inside the context: the CP=1 losses."""
    mesh = init_device_mesh("cpu", (world,))
    model = copy.deepcopy(base)
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    b, n = batches[0][0].shape
    for step, (tokens, labels) in enumerate(batches):
        tokens, labels = tokens.clone(), labels.clone()
        with context_parallel(mesh, buffers=[tokens, labels, model.cos, model.sin], buffer_seq_dims=[1, 1, 0, 0],
                              no_restore_buffers={tokens, labels}):
            loss = _loss(compiled(tokens), labels, b * n)
            loss.backward()
        reduce_gradients(model, mesh)
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=mesh.get_group())
        assert abs(loss.item() - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), f"step {step}"
    for p, want in zip(model.parameters(), ref_params):
        assert rel_err(p.detach(), want) <= 1e-5


@exhaustive("Inductor compiles the whole model: minutes on 2 CPU cores")
def test_torch_api_inductor_model():
    torch.manual_seed(0)
    base = TinyLM(16)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (2, 16), generator=g), torch.randint(0, 32, (2, 16), generator=g))
               for _ in range(3)]
    run_ranks(2, _train_compiled, base, batches, *_cp1(base, batches), timeout=900)


def _compiled(rank: int, world: int) -> None:
    """torch's compiled case (SDPA compiled with fullgraph inside the context), and a function compiled
    and called outside first: stock there, the ring inside, stock again after."""
    mesh = init_device_mesh("cpu", (world,))
    _torch_pattern(mesh, layout="headtail", is_causal=True, hq=4, hkv=2, compiled=True)
    q, k, v, do = make_qkv(5, 1, 2, 2, 4 * world, 8)
    want = reference(q, k, v, do, is_causal=True)[0]
    fn = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), backend="aot_eager")
    full = [t.float() for t in (q, k, v)]
    assert rel_err(fn(*full), want) <= TOL  # outside: stock SDPA on the full tensors
    cp = [t.clone() for t in full]
    with context_parallel(mesh, buffers=cp, buffer_seq_dims=[2] * 3):
        out = fn(*cp)
    (out,) = context_parallel_unshard(mesh, [out], [2])
    assert rel_err(out, want) <= TOL
    assert rel_err(fn(*full), want) <= TOL
    # documents and a window, compiled: the ring's agreement runs inside the graph
    n = q.shape[2]
    positions = torch.cat([torch.arange(3), torch.arange(n - 3)])
    ids = (positions == 0).long().cumsum(0)[None]
    want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=(2, 0))[0]
    cp = [t.clone() for t in full]
    with context_parallel(mesh, buffers=cp, buffer_seq_dims=[2] * 3, position_ids=positions, window_size=(2, 0)):
        out = fn(*cp)
    (out,) = context_parallel_unshard(mesh, [out], [2])
    assert rel_err(out, want) <= TOL


def test_torch_api_compiled():
    run_ranks(2, _compiled)


def _accelerate_loop(rank: int, world: int, family: str, batches, ref_losses) -> None:
    """accelerate's documented loop with ``maybe_context_parallel`` replaced by cp_dtensor's (docs/torch_api.md):
    a transformers model, DDP through ``accelerator.prepare`` on gloo, the same batch on every CP rank."""
    import os

    from accelerate import Accelerator

    from cp_dtensor.hf import apply_context_parallel, shift_labels

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world, "an AcceleratorState leaked into the ranks"
    cp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"]
    model = apply_context_parallel(_hf_model(family), cp_mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step, (input_ids, labels) in enumerate(batches):
        b, n = input_ids.shape
        batch = {"input_ids": input_ids.clone(), "labels": labels.clone(),
                 "position_ids": torch.arange(n).repeat(b, 1), "shift_labels": shift_labels(labels)}
        n_items = (batch["shift_labels"] != -100).sum()  # the full batch's count, before sharding
        buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)):
            loss = model(**batch, num_items_in_batch=n_items).loss  # this rank's tokens / the batch's count
            accelerator.backward(loss * cp_mesh.size())  # DDP averages over the CP ranks: undo it
            optimizer.step()
            optimizer.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=cp_mesh.get_group())
        assert abs(loss.item() - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), f"{family} step {step}"


def _hf_model(family: str):
    import transformers

    torch.manual_seed(0)
    kw = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attn_implementation="sdpa")
    if family == "mistral":  # a window shorter than the sequence: accelerate's own CP refuses this model
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=5, **kw))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_accelerate_loop_matches_cp1(family):
    pytest.importorskip("accelerate")
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 32, (2, 16), generator=g), torch.randint(0, 32, (2, 16), generator=g))
               for _ in range(3)]
    batches[1][1][0, :5] = -100  # a prompt without loss: counts differ between the ranks' shards
    model = _hf_model(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for input_ids, labels in batches:  # CP=1: the plain model on the full batch
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    run_ranks(2, _accelerate_loop, family, batches, losses)


def test_docs_code_is_the_example_script():
    """docs/torch_api.md's first two Python blocks are lines of scripts/examples/torch_api_example.py, which the
    spawns above run: the page shows code that runs."""
    root = pathlib.Path(__file__).resolve().parents[1]
    page = (root / "docs" / "torch_api.md").read_text()
    script = {line.strip() for line in (root / "scripts" / "examples" / "torch_api_example.py").read_text().splitlines()}
    blocks = [b.split("```")[0] for b in page.split("```python\n")[1:]][1:3]  # the first is the import swap
    assert len(blocks) == 2
    for block in blocks:
        missing = [line for line in block.splitlines() if line.strip() and line.strip() not in script]
        assert not missing, f"docs/torch_api.md lines not in scripts/examples/torch_api_example.py: {missing}"
