"""Every family's masks under CP, in process, against an independent reference.

Reference: the same torchtitan model (same weights, float64) with its *own* ``get_attention_masks``
(torchtitan's mask_mods, built into a BlockMask without compile) and every inner attention replaced by
dense float64 attention under that BlockMask's ``mask_mod``, evaluated on the full N x N grid -- no
code of the plugin involved. The plugin's model runs at CP = 2 on local shards (``shard_cp_batch``,
``RingMask``s, RoPE by global position); its logits must equal the reference's at its positions and
its gradients, summed over the CP ranks, the reference's gradients (rel 1e-9).

Cases: packed documents (llama3, qwen3 and deepseek_v3 MLA with block_causal flex), llama4 iRoPE
(chunks of 16 on RoPE layers, documents on NoPE layers), gpt_oss (sliding windows of 8 on even layers,
sinks; causal and torchtitan's block_causal). Shapes are shrunk (N = 64) so all of it takes seconds.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import types

import pytest
import torch
from _tiers import exhaustive, slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _dist import run_ranks  # noqa: E402

B, N, EOS = 2, 64, 1
# documents: lengths 1 (shorter than P), 2, 30, and a tail; the second row one document
EOS_AT = [[0, 2, 33, 40], []]

_GPT_OSS = {"n_layers": 2, "vocab_size": 2048, "sliding_window_size": 8, "n_heads": 16, "n_kv_heads": 4,
            "moe_inter_dim": 256}
CASES = {  # id -> (family, flavor, model-arg overrides)
    "llama3_flex": ("llama3", "debugmodel_flex_attn", {"n_layers": 2}),
    "qwen3_flex": ("qwen3", "debugmodel", {"n_layers": 2, "attn_type": "flex", "attn_mask_type": "block_causal"}),
    "deepseek_v3_flex": ("deepseek_v3", "debugmodel_flex_attn", {"n_layers": 2, "moe_impl": "standard"}),
    "llama4_irope": ("llama4", "debugmodel_irope", {"n_layers": 4, "fixed_attn_block_size": 16}),
    "gpt_oss_causal": ("gpt_oss", "debugmodel", {**_GPT_OSS, "attn_mask_type": "causal"}),
    "gpt_oss_block_causal": ("gpt_oss", "debugmodel", {**_GPT_OSS, "attn_mask_type": "block_causal"}),
}
SLOW_CASES = {"gpt_oss_causal"}  # the default suite keeps gpt_oss_block_causal (windows, sinks and documents)


class _DenseFlex(torch.nn.Module):
    """Reference inner attention: float64 softmax over the full grid under the BlockMask's mask_mod."""

    def __init__(self, key: str | None):
        super().__init__()
        self.key = key

    def forward(self, q, k, v, *, block_mask, scale=None, enable_gqa=False, return_lse=False, score_mod=None):
        from torch.nn.attention.flex_attention import create_mask

        # q, k: [B, Hq | Hkv, N, Dqk]; v: [B, Hkv, N, Dv]
        bm = block_mask[self.key] if isinstance(block_mask, dict) else block_mask
        mask = create_mask(bm.mask_mod, bm.shape[0], None, q.shape[2], k.shape[2], device=q.device)  # [B|1, 1, N, N]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        s = s.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, -1)  # [B, Hq, N]
        out = torch.softmax(s, -1) @ v
        return (out, lse) if return_lse else out


def _model(family: str, flavor: str, overrides: dict):
    from cp_dtensor.titan.shared.cpu import use_for_loop_experts
    from cp_dtensor.titan.v02.families import apply_family_fixes

    spec = importlib.import_module(f"torchtitan.models.{family}").get_train_spec()
    args = copy.deepcopy(spec.model_args[flavor])
    for name, value in overrides.items():
        setattr(args, name, value)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    use_for_loop_experts(model)
    apply_family_fixes(model)
    with torch.no_grad():  # torchtitan initialises under no_grad in its trainer
        model.init_weights(buffer_device=torch.device("cpu"))
    return model.double()


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 700, (B, N), generator=g)
    for row, where in enumerate(EOS_AT):
        tokens[row, where] = EOS
    labels = torch.randint(2, 700, (B, N), generator=g)
    return tokens, labels


def _reference(model, family: str, tokens, labels):
    from torch.nn.attention.flex_attention import create_block_mask

    from cp_dtensor.titan.v02.families import attention_modules

    ref = copy.deepcopy(model)
    module = importlib.import_module(type(ref).__module__)
    uncompiled = functools.partial(create_block_mask, device="cpu")  # torchtitan's own masks, without compile
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "create_attention_mask", uncompiled)
        masks = ref.get_attention_masks(tokens, types.SimpleNamespace(eos_id=EOS))
    for attn in attention_modules(ref):
        key = ("rope" if attn.use_rope else "nope") if hasattr(attn, "use_rope") else None
        attn.inner_attention = _DenseFlex(key)
    logits = ref(tokens, attention_masks=masks)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _masks(masks) -> list:
    return list(masks.values()) if isinstance(masks, dict) else [masks]


def _cp2_matches_reference(rank, world, case, layout, compiled=None):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor.core.plan.documents import DocumentLayout
    from cp_dtensor.titan import CPDTensor, apply_ring_attention
    from cp_dtensor.titan.v02.attention import shard_cp_batch

    family, flavor, overrides = CASES[case]
    model = _model(family, flavor, overrides)
    tokens, labels = _batch()
    ref_logits, ref_grads = _reference(model, family, tokens, labels)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    apply_ring_attention(model, mesh, CPDTensor(layout=layout))
    if compiled:  # every block compiled fullgraph, as torchtitan's [compile] does (the masks carry the plan in)
        for name, block in list(model.layers.named_children()):
            model.layers.register_module(name, torch.compile(block, fullgraph=True, backend=compiled))
    masks = model.get_attention_masks(tokens, types.SimpleNamespace(eos_id=EOS))
    x, y, kw = shard_cp_batch(tokens, labels, {"attention_masks": masks}, mesh, torch.device("cpu"), layout=layout)
    logits = model(x, **kw)
    pos = kw["positions"].expand(B, -1)  # [B, S_local]: per row under the documents layout
    if layout == "documents":
        assert all(isinstance(m.plan, DocumentLayout) for m in _masks(kw["attention_masks"]))
    want = ref_logits.gather(1, pos[..., None].expand(-1, -1, ref_logits.shape[-1]))
    torch.testing.assert_close(logits, want, rtol=1e-9, atol=1e-9)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    loss.backward()
    params = {n.replace("._orig_mod", ""): p for n, p in model.named_parameters()}  # a compiled block's names too
    for name, p in params.items():
        if name in ref_grads:
            dist.all_reduce(p.grad)  # each rank's gradient covers its own tokens
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    if layout == "documents" and case == "llama3_flex" and compiled is None:
        _dynamic_matches_reference(case, tokens, labels, ref_logits, ref_grads)
    return sorted(set(ref_grads) - {n for n, p in params.items() if p.grad is not None})


def _dynamic_matches_reference(case, tokens, labels, ref_logits, ref_grads) -> None:
    """[cp_dtensor] dynamic = true's batch sharding (Note [Dynamic CP in torchtitan]) on a grid of 2 dp ranks x
    cp 1: rank d brings row d; one plan of both rows over both ranks (row 1's 64-token document cut over the
    two), inputs, labels and positions moved to it; logits at each held token and the summed gradients equal
    the float64 dense reference's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor.titan import CPDTensor, apply_ring_attention
    from cp_dtensor.titan.v02.attention import shard_cp_batch

    grid = init_device_mesh("cpu", (2,), mesh_dim_names=("loss",))
    d = grid.get_local_rank()
    model = _model(*CASES[case])
    apply_ring_attention(model, grid, CPDTensor(layout="documents", dynamic=True))
    masks = model.get_attention_masks(tokens[d : d + 1], types.SimpleNamespace(eos_id=EOS))
    one = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "cp"))["cp"]  # this dp rank's cp group: 1 rank
    x, y, kw = shard_cp_batch(tokens[d : d + 1], labels[d : d + 1], {"attention_masks": masks}, one,
                              torch.device("cpu"), layout="documents", grid=grid)
    plan = kw["attention_masks"].plan
    held = plan.order[0, d * N : (d + 1) * N]  # [N]: the global tokens this rank holds (row * N + position)
    assert plan.cp_size == 2 and x.shape == (1, N) and bool((held // N != d).any())  # some tokens moved
    assert torch.equal(x[0], tokens.flatten()[held]) and torch.equal(y[0], labels.flatten()[held])
    assert torch.equal(kw["positions"][0], held % N)  # the original positions: RoPE unchanged
    logits = model(x, **kw)
    torch.testing.assert_close(logits[0], ref_logits.flatten(0, 1)[held], rtol=1e-9, atol=1e-9)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").backward()
    for name, p in model.named_parameters():
        if name in ref_grads:
            dist.all_reduce(p.grad, group=grid.get_group())
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")




@pytest.mark.parametrize("case", [pytest.param(c, marks=exhaustive()) if c in SLOW_CASES else c for c in sorted(CASES)])
def test_cp2_matches_dense_reference(case):
    missing = run_ranks(2, _cp2_matches_reference, case, "striped")
    assert missing == [[], []], f"parameters without a gradient under CP: {missing}"


@pytest.mark.parametrize("layout", [pytest.param("headtail", marks=slow()), pytest.param("contiguous", marks=exhaustive())])
def test_other_layouts_match_dense_reference(layout):
    run_ranks(2, _cp2_matches_reference, "gpt_oss_block_causal", layout)
    run_ranks(2, _cp2_matches_reference, "llama4_irope", layout)


def test_documents_are_torchtitans():
    # the ids the ring gets are exactly the documents of torchtitan's own mask_mod: same doc <=> mask keeps the pair
    from torchtitan.models.attention import get_document_mask_mod

    from cp_dtensor.titan.v02.flex import chunk_ids, document_ids

    tokens, _ = _batch()
    ids = document_ids(tokens, EOS)
    mask_mod = get_document_mask_mod(tokens, EOS)
    q, k = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    for b in range(B):
        keep = mask_mod(torch.tensor(b), torch.tensor(0), q, k)
        assert torch.equal(keep, ids[b][:, None] == ids[b][None, :])
    assert ids[0].unique().numel() == len(EOS_AT[0]) + 1 and ids[1].unique().numel() == 1
    chunks = chunk_ids(ids, 16)
    assert bool((chunks[:, 1:] >= chunks[:, :-1]).all())
    same = chunks[:, :, None] == chunks[:, None, :]
    want = (ids[:, :, None] == ids[:, None, :]) & ((q // 16) == (k // 16))
    assert torch.equal(same, want)


@pytest.mark.parametrize("case", ["llama3_flex", "gpt_oss_block_causal", pytest.param("qwen3_flex", marks=slow()),
                                  pytest.param("deepseek_v3_flex", marks=slow())])
def test_documents_layout_matches_dense_reference(case):
    # [cp_dtensor] layout = "documents": one plan per batch from the block_causal masks' documents (row 0 packed
    # documents of 1, 2, 31, 7 and 23 tokens, row 1 one document), the batch, positions and masks sharded with it;
    # llama3 also with dynamic = true's sharding, on a grid of 2 dp ranks (_dynamic_matches_reference)
    missing = run_ranks(2, _cp2_matches_reference, case, "documents")
    assert missing == [[], []], f"parameters without a gradient under CP: {missing}"


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=slow())])
def test_documents_layout_compiled_blocks_match_dense_reference(backend):
    # [compile] with layout = "documents": every block compiled fullgraph; the document exchange is one custom
    # op pair (Note [Compiled document exchange] in core/exchange/doc_op.py) reading the plan the masks carry
    missing = run_ranks(2, _cp2_matches_reference, "llama3_flex", "documents", backend)
    assert missing == [[], []], f"parameters without a gradient under CP: {missing}"


def _other_batch_on_one_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor.titan import CPDTensor, apply_ring_attention
    from cp_dtensor.titan.v02.attention import shard_cp_batch

    family, flavor, overrides = CASES["llama3_flex"]
    model = _model(family, flavor, overrides)
    tokens, labels = _batch()
    if rank == 1:  # this CP rank read other documents: its plan differs from rank 0's
        tokens[0, 50] = EOS
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    apply_ring_attention(model, mesh, CPDTensor(layout="documents"))
    masks = model.get_attention_masks(tokens, types.SimpleNamespace(eos_id=EOS))
    x, _, kw = shard_cp_batch(tokens, labels, {"attention_masks": masks}, mesh, torch.device("cpu"), layout="documents")
    try:
        model(x, **kw)
    except ValueError as e:
        return str(e)
    return None


def test_documents_layout_with_different_batches_raises_on_every_rank():
    # every CP rank must read the same batch; a rank whose documents differ makes another plan, which the ring's
    # agreement catches on every rank before any K/V moves (no hang, nothing silently wrong)
    errors = run_ranks(2, _other_batch_on_one_rank)
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "needs the same layout key on every rank" in errors[0], errors
