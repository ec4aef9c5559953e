"""Hybrid linear-attention transformers models under CP (cp_dtensor/hf_linear.py): Qwen3-Next, Qwen3.5 (dense
and MoE) and Kimi Linear equal themselves at CP=1 -- logits and every parameter gradient, fp32 -- at P = 2
and 3, layouts headtail and contiguous; packed sequences equal each document run alone at CP=1; what CP
cannot run raises on every rank."""

from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch
from _tiers import ALL, slow
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_hf_attention import _run  # noqa: E402  one runner for the transformers tests
from transformers import KimiLinearConfig, KimiLinearForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

from cp_dtensor.core.linear.linear_attention import check_bytes, conv_halo_bytes, linear_state_bytes  # noqa: E402
from cp_dtensor.doors import apply_context_parallel, reduce_gradients, shard_batch  # noqa: E402
from cp_dtensor.hf import attention as hf  # noqa: E402
from cp_dtensor.hf import linear as hf_linear  # noqa: E402
from cp_dtensor.tools.debug import CommBytes  # noqa: E402
from _ref import f64_kernel  # noqa: E402

TOL = 1e-4  # fp32, relative to the largest magnitude of each tensor
SLOW = ALL  # every model in every variant (~4 min): the exhaustive tier
N, V = 48, 128  # global sequence length (a multiple of 2P for P = 2, 3), vocabulary
LAYOUTS = ("headtail", "contiguous")
TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]  # linear before and after
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, layer_types=TYPES, max_position_embeddings=256, attn_implementation="sdpa")
GDN = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
           linear_num_key_heads=2, linear_num_value_heads=4)  # two value heads per key head (GVA)
KINDS = {
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, dict(GDN, num_experts=0)),
    "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, GDN),
    "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, dict(
        GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # KDA (per-channel decay) linear layers, MLA full layers (Dqk 24 != Dv 16), dense MLPs
    "kimi_linear": (KimiLinearConfig, KimiLinearForCausalLM, dict(
        num_key_value_heads=4, linear_head_dim=16, linear_num_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, mlp_layer_types=["dense"] * 4, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}
MODELS = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear"]


def _model(name: str):
    """A tiny random-init fp32 model, the same on every rank. The decay rates are drawn from [0.05, 1] instead
    of the checkpoints' init ([0.01, 16] / [1, 16]), so that CP=1 is a reference to TOL: with the faster ones
    the fp32 kernels' gradients of A_log and dt_bias keep ~3 digits at CP=1 itself, and CP rounds them
    differently (Note [fp32 precision with the checkpoints' decays]; _check_default_init covers that init)."""
    cfg_cls, cls, extra = KINDS[name]
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**COMMON, **extra})).float()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer, _ in hf_linear.linear_layers(model, "headtail"):
            a_log = layer.forget_gate.A_log if name == "kimi_linear" else layer.A_log
            a_log.copy_(torch.empty(a_log.shape).uniform_(0.05, 1.0, generator=g).log())
    return model


def _batch(seed: int, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (b, N), generator=g)
    weights = torch.randn(b, N, V, generator=g)  # the loss: sum(logits * weights), a fixed linear functional
    return tokens, weights


def _per_document(model, batch: dict, weights, lengths):
    """The packed reference: each document of the one-row batch run alone at CP=1 (positions from 0)."""
    logits, start = [], 0
    for n in lengths:
        piece = dict(input_ids=batch["input_ids"][:, start:start + n], position_ids=torch.arange(n)[None])
        out = model(**piece, use_cache=False).logits
        (out * weights[:, start:start + n]).sum().backward()
        logits.append(out.detach())
        start += n
    return torch.cat(logits, 1), [p.grad for p in model.parameters()]


def _compare(where, cp, ref, keep):
    (logits, grads), (ref_logits, ref_grads) = cp, ref
    m = keep.bool()
    assert rel_err(logits[m], ref_logits[m]) <= TOL, f"{where}: logits {rel_err(logits[m], ref_logits[m]):.2e}"
    assert len(grads) == len(ref_grads)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g is not None and rel_err(g, r) <= TOL, f"{where}: grad {i} {rel_err(g, r):.2e}"


def _check(name, world, mesh, layouts, batch, weights, keep=None, *, how="hf", checkpointing=False, lengths=None,
           **options):
    """The model under CP on ``layouts`` against CP=1 (per document when ``lengths`` packs the batch)."""
    base = _model(name)
    keep = torch.ones(weights.shape[:2]) if keep is None else keep
    ref_model = copy.deepcopy(base)
    if lengths is not None:
        ref = _per_document(ref_model, batch, weights, lengths)
    else:
        ref = _run(ref_model, batch, weights, keep, use_cache=False)
    for layout in layouts:
        model = copy.deepcopy(base)
        if how == "hf":
            hf.apply_context_parallel(model, mesh, layout=layout)
        else:  # the package's front door hands transformers models to the same integration
            apply_context_parallel(model, mesh, layout=layout)
        if checkpointing:
            model.activation_checkpointing_enable()
            model.train()
        where = f"{name} P={world} {layout} {how} ckpt={checkpointing} {sorted(batch)}"
        _compare(where, _run(model, batch, weights, keep, mesh=mesh, layout=layout, **options), ref, keep)


# See Note [fp32 precision with the checkpoints' decays] in cp_dtensor's linear_attention.py: C bounds CP's
# error by CP=1's own (CP's sums reorder CP=1's: measured ratio <= 1.42 at P = 2, 1.61 at P = 3; 4 catches an
# error an order of magnitude worse); FLOOR is fp32 rounding without the cancellation (measured <= 4e-6).
PRECISION_C, PRECISION_FLOOR = 4.0, 1e-5


def _check_default_init(world, mesh) -> None:
    """Qwen3-Next with transformers' default decay init: |CP - float64| <= C * max(|CP=1 - float64|, FLOOR) for
    the logits and every gradient (relative to the reference's largest magnitude). See Note [fp32 precision
    with the checkpoints' decays]."""
    import transformers.models.qwen3_next.modeling_qwen3_next as mod

    cfg_cls, cls, extra = KINDS["qwen3_next"]
    torch.manual_seed(0)
    base = cls(cfg_cls(**{**COMMON, **extra})).float()  # default init: A_log = log U[0.01, 16]
    tokens, weights = _batch(1)
    batch = dict(input_ids=tokens, position_ids=torch.arange(N).expand(2, N))
    keep = torch.ones(2, N)
    saved, mod.torch_chunk_gated_delta_rule = mod.torch_chunk_gated_delta_rule, f64_kernel
    try:  # the float64 model with a float64 delta rule (the token-by-token recurrence)
        ref = _run(copy.deepcopy(base).double(), batch, weights.double(), keep.double(), use_cache=False)
    finally:
        mod.torch_chunk_gated_delta_rule = saved
    cp1 = _run(copy.deepcopy(base), batch, weights, keep, use_cache=False)
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
    cp = _run(model, batch, weights, keep, mesh=mesh, layout="headtail")
    names = ["logits"] + [n for n, _ in base.named_parameters()]
    flat = lambda r: [r[0], *r[1]]  # noqa: E731
    decay_err = 0.0
    for name, a, one, want in zip(names, flat(cp), flat(cp1), flat(ref)):
        err, err1 = rel_err(a, want), rel_err(one, want)
        assert err <= PRECISION_C * max(err1, PRECISION_FLOOR), f"P={world} {name}: CP {err:.2e}, CP=1 {err1:.2e}"
        if name.endswith(("A_log", "dt_bias")):
            decay_err = max(decay_err, err1)
    assert decay_err > TOL, decay_err  # the regime the test is for: CP=1 itself is off by more than TOL


def _check_all_linear_bytes(world, mesh) -> None:
    """An all-Gated-DeltaNet Qwen3-Next (every layer linear) under CP headtail: the bytes one forward and one
    backward send (CommBytes: every tensor collective), at two sequence lengths, equal layers x (the state
    summaries + the conv halos, + both ops' agreement forward): independent of N. Also with an all-ones
    padding mask (Note [Linear attention in transformers under CP]: no O(N) position gather), and equal to
    CP=1. Not counted: the call's one pickled agreement (all_gather_object, O(P * runs * B))."""
    cfg_cls, cls, extra = KINDS["qwen3_next"]
    torch.manual_seed(0)
    cfg = cfg_cls(**{**COMMON, **extra, "layer_types": ["linear_attention"] * 4})
    base = _model_like(cls(cfg).float())
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
    b, layers, hv, d = 2, 4, GDN["linear_num_value_heads"], GDN["linear_key_head_dim"]
    channels = 2 * GDN["linear_num_key_heads"] * d + hv * d  # q, k, v through the conv
    per_layer = (linear_state_bytes(batch=b, heads=hv, dk=d, dv=d, world=world, layout="headtail")
                 + conv_halo_bytes(batch=b, channels=channels, kernel_size=GDN["linear_conv_kernel_dim"],
                                   world=world, layout="headtail", itemsize=4))
    agree = check_bytes(world=world) + check_bytes(world=world, conv=True)
    seen = set()
    for n in (24, 72):  # headtail runs of >= K - 1 tokens at P = 2, 3
        tokens = torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(n))
        batch = dict(input_ids=tokens, position_ids=torch.arange(n).expand(b, n))
        for mask in (None, torch.ones(b, n, dtype=torch.long)):
            full = dict(batch) if mask is None else dict(batch, attention_mask=mask)
            names = sorted(full)
            local = dict(zip(names, shard_batch(tuple(full[k] for k in names), mesh, layout="headtail")))
            with CommBytes() as fwd:
                logits = model(**local).logits
            with CommBytes() as bwd:
                logits.sum().backward()
            assert fwd.sent == layers * (per_layer + agree), (world, n, mask is None, fwd.by_op)
            assert bwd.sent == layers * per_layer, (world, n, mask is None, bwd.by_op)
            seen.add((fwd.sent, bwd.sent))
    assert len(seen) == 1
    # and the all-linear model is exact (the last length, no mask)
    weights = torch.randn(b, 72, V, generator=torch.Generator().manual_seed(3))
    keep = torch.ones(b, 72)
    ref = _run(copy.deepcopy(base), batch, weights, keep, use_cache=False)
    model.zero_grad()
    _compare(f"all-linear P={world}", _run(model, batch, weights, keep, mesh=mesh, layout="headtail"), ref, keep)


def _model_like(model):
    """``model`` with the test models' decay rates (see :func:`_model`)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer, _ in hf_linear.linear_layers(model, "headtail"):
            layer.A_log.copy_(torch.empty(layer.A_log.shape).uniform_(0.05, 1.0, generator=g).log())
    return model


def _originals(models=None) -> list:
    """The module functions FAMILIES names (of the modeling modules of ``models`` only, if given)."""
    import importlib

    return [getattr(importlib.import_module(f.module), fn) for f in hf_linear.FAMILIES for fn in (f.conv, f.rule)
            if models is None or f.module.rsplit(".", 1)[-1].removeprefix("modeling_") in models]


def _check_models(rank: int, world: int, slow: bool) -> None:
    mesh = init_device_mesh("cpu", (world,))
    assert not any(hasattr(f, "_cp_dtensor_original") for f in _originals())  # importing cp_dtensor patched nothing
    tokens, weights = _batch(1)
    positions = torch.arange(N).expand(2, N)
    batch = dict(input_ids=tokens, position_ids=positions)
    outside = _model("qwen3_next")  # the same family without CP, in the same process
    before = outside(**batch, use_cache=False).logits.detach()
    for name in MODELS:  # use_cache left unset: under CP it defaults to False for hybrids
        _check(name, world, mesh, LAYOUTS if slow or name != "qwen3_5_moe" else ["headtail"], batch, weights)
    assert all(hasattr(f, "_cp_dtensor_original") for f in _originals(MODELS))
    assert torch.equal(outside(**batch, use_cache=False).logits.detach(), before)  # the dispatchers pass through
    _check_default_init(world, mesh)
    _check_all_linear_bytes(world, mesh)

    # gradient checkpointing (the layers recompute with the call's documents), the front door
    for name in (MODELS if slow else ["qwen3_5"]):
        _check(name, world, mesh, ["headtail"], batch, weights, checkpointing=True)
        _check(name, world, mesh, ["contiguous"], batch, weights, how="module")

    # a 2-D padding mask: left padding across a shard edge, right padding; equal CP=1 on the real tokens
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, :13] = 0
    mask[1, -7:] = 0
    gen_positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # generate()'s convention
    padded = dict(input_ids=tokens, position_ids=gen_positions, attention_mask=mask)
    for name in (MODELS if slow else ["qwen3_next"]):
        _check(name, world, mesh, LAYOUTS if slow else ["headtail"], padded, weights, keep=mask.float())

    # packed sequences (one row, position ids restarting at 0): each document run alone at CP=1
    lengths = [5, 1, 19, 3, 20]  # documents shorter than a headtail chunk, and across several ranks
    tok1, w1 = _batch(2, b=1)
    packed = dict(input_ids=tok1, position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
    for name in (MODELS if slow else ["qwen3_5", "kimi_linear"] if world == 2 else ["qwen3_5"]):
        _check(name, world, mesh, LAYOUTS if slow or name != "kimi_linear" else ["headtail"], packed, w1,
               lengths=lengths)
    # explicit document_ids= (this rank's shard of the global ids), positions not restarting
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    _check("qwen3_next", world, mesh, ["contiguous"], dict(input_ids=tok1, position_ids=torch.arange(N)[None],
                                                           document_ids=ids), w1, lengths=lengths)

    # the training loss: labels shifted on the full batch, each rank's sum over the global count
    labels = torch.randint(0, V, (2, N), generator=torch.Generator().manual_seed(5))
    labels[0, 5] = -100
    base = _model("qwen3_next")
    ref = copy.deepcopy(base)
    ref_loss = ref(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False).loss
    ref_loss.backward()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    for layout in LAYOUTS:
        model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout=layout)
        loss = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count).loss
        loss.backward()
        reduce_gradients(model, mesh)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        assert abs(total.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (layout, total, ref_loss)
        for p, r in zip(model.parameters(), ref.parameters()):
            assert rel_err(p.grad, r.grad) <= TOL, layout


def _expect_error(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _check_errors(rank: int, world: int) -> None:
    """Every refusal raises on every rank, also when only one rank's input is bad; the ranks stay in step."""
    mesh = init_device_mesh("cpu", (world,))
    base = _model("qwen3_next")
    outside = dict(input_ids=_batch(4)[0], position_ids=torch.arange(N)[None].expand(2, N), use_cache=False)
    before = base(**outside).logits.detach()
    for apply in (hf.apply_context_parallel, apply_context_parallel):  # striped, refused at apply time
        fresh = copy.deepcopy(base)
        _expect_error(lambda: apply(fresh, mesh, layout="striped"), 'layout="headtail" for hybrid models')
        assert fresh.config._attn_implementation == "sdpa"  # a refused model is left unchanged
    tokens, weights = _batch(4)
    positions = torch.arange(N).expand(2, N)
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="headtail")
    tok, pos = shard_batch((tokens, positions), mesh, layout="headtail")
    s = tok.shape[1]
    call = lambda **kw: model(**{"input_ids": tok, "position_ids": pos, **kw})  # noqa: E731

    _expect_error(lambda: call(use_cache=True), "without a cache")
    _expect_error(lambda: call(use_cache=rank == 0), "without a cache")  # on rank 0 only
    _expect_error(lambda: model.generate(tokens, max_new_tokens=2, num_beams=2), "num_beams")  # generate()'s own
    _expect_error(lambda: call(position_ids=None if rank == world - 1 else pos), "needs position_ids")
    _expect_error(lambda: call(position_ids=pos[:, :1] if rank == 0 else pos), "position_ids must be")
    _expect_error(lambda: call(labels=tok), "shift_labels")
    _expect_error(lambda: call(attention_mask=torch.ones(2, 1, s, s, dtype=torch.bool)), "explicit")
    ids = torch.zeros(2, s, dtype=torch.long)
    _expect_error(lambda: call(document_ids=ids if rank == 1 else None), "same call on every rank")
    _expect_error(lambda: call(attention_mask=torch.ones(2, s, dtype=torch.long) if rank == 0 else None),
                  "some CP ranks only")
    _expect_error(lambda: call(cu_seq_lens_q=torch.tensor([0, s])), "cu_seq_lens")
    def boom(*args, **kwargs):  # a failure inside a running layer, on every rank
        raise ValueError("boom")

    real, hf_linear.sharded_delta_rule = hf_linear.sharded_delta_rule, boom
    try:
        _expect_error(call, "boom")
    finally:
        hf_linear.sharded_delta_rule = real
    # no layer is left marked running: the same family without CP passes through
    assert torch.equal(copy.deepcopy(base)(**outside).logits.detach(), before)
    # still in step: a good call equals CP=1
    keep = torch.ones(2, N)
    ref = _run(copy.deepcopy(base), dict(input_ids=tokens, position_ids=positions), weights, keep, use_cache=False)
    model.zero_grad()
    got = _run(model, dict(input_ids=tokens, position_ids=positions), weights, keep, mesh=mesh, layout="headtail")
    _compare("after the errors", got, ref, keep)


# P = 2 and 3 (~40 s each on 2 cores); CP_DTENSOR_SLOW=all adds every model and layout to the checkpointing /
# front-door / padding / packed variants
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=slow("P = 3: ~18 s"))])
def test_hybrid_models_match_cp1(world):
    run_ranks(world, _check_models, SLOW, timeout=600.0)


@pytest.mark.parametrize("world", [2, 3])
def test_errors_raise_on_every_rank(world):
    run_ranks(world, _check_errors)


def test_transformers_symbols_exist():
    """Every transformers internal hf/linear.py touches (FAMILIES) is still there, as it expects it."""
    import importlib

    for fam in hf_linear.FAMILIES:
        module = importlib.import_module(fam.module)
        layer = getattr(module, fam.layer)
        params = inspect.signature(layer.forward).parameters
        assert all(k in params for k in hf_linear.LAYER_KWARGS), (fam.layer, list(params))
        src = inspect.getsource(layer.forward)
        for fn in (fam.conv, fam.rule):
            assert callable(getattr(module, fn)), (fam.module, fn)
            assert f"{fn}(" in src, (fam.layer, fn)  # the forward calls it by its module-level name
        conv = inspect.signature(getattr(module, fam.conv)).parameters
        assert list(conv)[:4] == ["hidden_states", "weight", "bias", "activation"], (fam.conv, list(conv))
        rule = inspect.signature(getattr(module, fam.rule)).parameters
        assert list(rule)[:5] == ["query", "key", "value", "g", "beta"], (fam.rule, list(rule))
        assert {"initial_state", "output_final_state", "use_qk_l2norm_in_kernel"} <= set(rule), (fam.rule, list(rule))


def test_bench_hybrid_smoke(tmp_path):
    """scripts/benchmarks/bench_hybrid.py at a tiny length: runs CP=1 and CP=2, writes its report; CP=2 saves fewer
    activation bytes per rank than CP=1 (runs of one 64-token kernel chunk each)."""
    import json
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "benchmarks"))
    import bench_hybrid

    out = tmp_path / "hybrid.json"
    report = bench_hybrid.main(["--seq-len", "256", "--repeats", "1", "--out", str(out)])
    (row,) = report["rows"]
    assert row["seq_len"] == 256 and json.loads(out.read_text())["rows"][0]["seq_len"] == 256
    assert row["time_ratio"] > 0 and row["peak_ratio"] > 0 and 0 < row["saved_ratio"] < 1, row
