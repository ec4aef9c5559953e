"""transformers models under CP (cp_dtensor.hf): logits and parameter gradients equal the same model at
CP=1 (the plain model on the full sequence, attn_implementation="sdpa"); what the ring cannot run raises
on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
from _tiers import ALL
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from cp_dtensor.core.batch import shard_batch, unshard_batch  # noqa: E402
from cp_dtensor.doors import apply_context_parallel, reduce_gradients  # noqa: E402
from cp_dtensor.hf import attention as hf  # noqa: E402
from cp_dtensor.hf.documents import plan_batch  # noqa: E402

TOL = 1e-5  # fp32, relative to the largest magnitude
LAYOUTS = ("striped", "headtail", "contiguous")
SLOW = ALL  # every model and layout: the exhaustive tier
N, V = 32, 64  # global sequence length, vocabulary
MODELS = ["llama", "qwen3", "qwen3-hybrid", "mistral-below", "mistral-between", "mistral-above", "gpt-oss"]
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, attn_implementation="sdpa")


def _model(name: str, world: int):
    """A tiny random-init fp32 model, the same on every rank. Windows relative to S_local = N / world."""
    s = N // world
    below, between, above = s - 3, (s + N) // 2, N + 8
    kinds = {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2)),  # GQA
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=1, head_dim=8)),  # MQA
        # layer 0 full attention, layer 1 a window below S_local (per-layer windows: layer_types)
        "qwen3-hybrid": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=8, use_sliding_window=True,
                                                             sliding_window=below, max_window_layers=1)),
        "mistral-below": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=below)),
        "mistral-between": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=between)),
        "mistral-above": (MistralConfig, MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=above)),
        # sinks on every layer, layer 0 windowed, layer 1 full; MoE MLP; transformers runs it with eager only
        "gpt-oss": (GptOssConfig, GptOssForCausalLM, dict(num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                                          num_experts_per_tok=2, intermediate_size=32,
                                                          sliding_window=below, attn_implementation="eager")),
    }
    cfg_cls, cls, extra = kinds[name]
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**TINY, **extra})).float()
    if name in ("qwen3-hybrid", "gpt-oss"):
        assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    if name == "gpt-oss":
        with torch.no_grad():  # sinks large enough to matter (initialised near 0)
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


def _batch(seed: int, b: int = 2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (b, N), generator=g)
    weights = torch.randn(b, N, V, generator=g)  # the loss: sum(logits * weights), a fixed linear functional
    return tokens, weights


def _run(model, batch: dict, weights, keep, *, mesh=None, layout=None, **options):
    """(full logits, parameter grads) of sum(logits * weights * keep): on the full batch, or under CP on this
    rank's shard of every [B, N] tensor (CP applied by the caller)."""
    names = sorted(batch)
    if mesh is not None:
        sharded = shard_batch((*(batch[k] for k in names), weights, keep), mesh, layout=layout)
        batch, (weights, keep) = dict(zip(names, sharded[:-2])), sharded[-2:]
    logits = model(**batch, **options).logits
    (logits * weights * keep[..., None]).sum().backward()
    if mesh is not None:
        reduce_gradients(model, mesh)
        logits = unshard_batch(logits.detach(), mesh, layout=layout)
    grads = [p.grad for p in model.parameters()]
    return logits.detach(), grads


def _compare(where, cp, ref, keep):
    (logits, grads), (ref_logits, ref_grads) = cp, ref
    m = keep.bool()
    assert rel_err(logits[m], ref_logits[m]) <= TOL, f"{where}: logits {rel_err(logits[m], ref_logits[m]):.2e}"
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_err(g, r) <= TOL, f"{where}: grad {i} {rel_err(g, r):.2e}"


def _check(name, world, mesh, layouts, batch, weights, keep=None, *, how="hf", checkpointing=False, ref_batch=None,
           ref_options=None, **options):
    base = _model(name, world)
    keep = torch.ones(weights.shape[:2]) if keep is None else keep
    ref_model = copy.deepcopy(base)
    if checkpointing:
        ref_model.activation_checkpointing_enable()
        ref_model.train()
    ref = _run(ref_model, ref_batch or batch, weights, keep, **{**options, **(ref_options or {})})
    for layout in layouts:
        model = copy.deepcopy(base)
        if how == "hf":
            hf.apply_context_parallel(model, mesh, layout=layout)
        else:  # cp_dtensor.apply_context_parallel hands transformers models to the same integration
            apply_context_parallel(model, mesh, layout=layout, documents="position_ids" if how == "module-docs" else None)
        if checkpointing:
            model.activation_checkpointing_enable()
            model.train()
        where = f"{name} P={world} {layout} {how} {options} ckpt={checkpointing}"
        _compare(where, _run(model, batch, weights, keep, mesh=mesh, layout=layout, **options), ref, keep)
    return ref


def _check_models(rank: int, world: int, slow: bool) -> None:
    mesh = init_device_mesh("cpu", (world,))
    tokens, weights = _batch(1)
    positions = torch.arange(N).expand(2, N)
    batch = dict(input_ids=tokens, position_ids=positions)
    for name in MODELS:
        _check(name, world, mesh, LAYOUTS, batch, weights, use_cache=False)
    # use_cache left on (transformers then builds a cache: no packed-sequence detection), gradient checkpointing,
    # and the module path
    for name in (MODELS if slow else ["llama", "mistral-below", "gpt-oss"]):
        _check(name, world, mesh, LAYOUTS if slow else ["striped"], batch, weights)
        _check(name, world, mesh, LAYOUTS if slow else ["headtail"], batch, weights, checkpointing=True)
        _check(name, world, mesh, LAYOUTS if slow else ["contiguous"], batch, weights, how="module")


def _packed_positions(lengths):
    return torch.cat([torch.arange(x) for x in lengths])[None]


def _dense_masks(lengths, window: int) -> dict:
    """gpt-oss's prepared-mask input: additive [1, 1, N, N] masks per layer type, block-diagonal causal."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    full = (ids[:, None] == ids[None, :]) & (j <= i)
    add = lambda keep: torch.zeros(N, N).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]  # noqa: E731
    return {"full_attention": add(full), "sliding_attention": add(full & (i - j < window))}


def _check_packed(rank: int, world: int, slow: bool) -> None:
    """Packed sequences (DataCollatorWithFlattening: one row, position ids restarting at 0) vs CP=1 on the
    same packed batch, and the training loss through shift_labels / num_items_in_batch."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, weights = _batch(2, b=1)
    lengths = [5, 1, 19, 3, 4]  # documents shorter than P, longer than the windows
    positions = _packed_positions(lengths)
    batch = dict(input_ids=tokens, position_ids=positions)
    for name in (MODELS if slow else ["llama", "mistral-below", "gpt-oss"]):
        ref_batch = None
        if name == "gpt-oss":  # its modeling code builds no packed-sequence mask: the reference gets it prepared
            ref_batch = dict(batch, attention_mask=_dense_masks(lengths, _model(name, world).config.sliding_window))
        ref = _check(name, world, mesh, LAYOUTS, batch, weights, use_cache=False, ref_batch=ref_batch)
        _check(name, world, mesh, ["striped"], batch, weights, checkpointing=True, ref_batch=ref_batch)
        # the reference really is block-diagonal: with use_cache on, transformers attends across documents --
        # and so does CP, unless documents="position_ids" asks for them
        crossing = _run(_model(name, world), batch, weights, torch.ones(1, N), use_cache=True)
        assert rel_err(crossing[0], ref[0]) > 1e-2, name
        _check(name, world, mesh, ["headtail"], batch, weights, use_cache=True)
        _check(name, world, mesh, ["contiguous"], batch, weights, how="module-docs", ref_batch=ref_batch,
               ref_options=dict(use_cache=False), use_cache=True)
    # explicit document_ids= (this rank's shard of global ids) in the model call
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    _check("llama", world, mesh, ["striped"], dict(batch, document_ids=ids), weights, ref_batch=batch,
           ref_options=dict(use_cache=False), use_cache=True)

    # the training loss: labels shifted on the full batch, each rank's sum over the global count
    labels = torch.randint(0, V, (1, N), generator=torch.Generator().manual_seed(5))
    labels[0, 5] = -100
    base = _model("llama", world)
    ref = copy.deepcopy(base)
    ref_loss = ref(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False).loss
    ref_loss.backward()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    for layout in LAYOUTS:
        model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout=layout)
        loss = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                     use_cache=False).loss
        loss.backward()
        reduce_gradients(model, mesh)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        assert abs(total.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (layout, total, ref_loss)
        for p, r in zip(model.parameters(), ref.parameters()):
            assert rel_err(p.grad, r.grad) <= TOL, layout


def _check_padding(rank: int, world: int, slow: bool) -> None:
    """A 2-D padding attention_mask: left and right padding equal CP=1 on the unpadded tokens."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, weights = _batch(3, b=3)
    mask = torch.ones(3, N, dtype=torch.long)
    mask[0, :7] = 0  # left padding, across a shard edge
    mask[2, -5:] = 0  # right padding
    gen_positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)  # generate()'s convention
    for name in (MODELS if slow else ["llama", "mistral-below", "gpt-oss"]):
        for positions in (torch.arange(N).expand(3, N), gen_positions):
            batch = dict(input_ids=tokens, position_ids=positions, attention_mask=mask)
            _check(name, world, mesh, LAYOUTS, batch, weights, keep=mask.float(), use_cache=False)
        _check(name, world, mesh, ["headtail"], batch, weights, keep=mask.float())
    _check_left_padded_loss(world, mesh, tokens, mask)
    _check_scored_pads(world, mesh, tokens, mask)


def _check_scored_pads(world, mesh, tokens, mask) -> None:
    """A loss that scores a pad CP cannot reproduce raises on every rank (Note [Scored pads]): a left pad (the row's
    first token as its label) of a model that ran transformers' eager attention (no sinks), a labelled right pad of
    any model; with layout="documents" too. The eager model with that label off equals CP=1's eager run."""
    eager = _model("llama", world)
    eager.set_attn_implementation("eager")
    labels = tokens.masked_fill(mask == 0, -100)
    positions = (mask.cumsum(1) - 1).clamp_min(0)

    def run(base, labels, layout="striped"):
        model = apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        plan = plan_batch(model, position_ids=positions, attention_mask=mask) if layout == "documents" else layout
        shifted = hf.shift_labels(labels)
        tok, m, pos, lab = shard_batch((tokens, mask, positions, shifted), mesh, layout=plan)
        extra = {"cp_layout": plan} if layout == "documents" else {}
        out = model(input_ids=tok, attention_mask=m, position_ids=pos, labels=lab, shift_labels=lab,
                    num_items_in_batch=(shifted != -100).sum(), use_cache=False, **extra)
        out.loss.backward()
        reduce_gradients(model, mesh)
        loss = out.loss.detach().clone()
        torch.distributed.all_reduce(loss)
        return model, loss

    _expect_error(lambda: run(eager, labels), "left pad token at row 0, column 6 .*uniform average")
    _expect_error(lambda: run(eager, labels, "documents"), "uniform average")
    _expect_error(lambda: run(_model("llama", world), labels.masked_fill(mask == 0, 5)), "right pad token at row 2, column 27")
    first = labels.clone()
    first[0, 7] = -100  # no pad scored: the eager model is served, and equals CP=1's eager run
    want = eager(input_ids=tokens, attention_mask=mask, position_ids=positions, labels=first, use_cache=False)
    want.loss.backward()
    model, loss = run(eager, first)
    assert rel_err(loss, want.loss.detach()) <= TOL, (loss, want.loss)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert rel_err(p.grad, q.grad) <= TOL, (name, rel_err(p.grad, q.grad))


def _check_left_padded_loss(world, mesh, tokens, mask) -> None:
    """transformers' own loss on a left-padded batch, labels -100 on the pads: the last pad is scored against the
    row's first token, so its logits count (Note [Pad queries]): loss and gradients equal CP=1's."""
    base = _model("llama", world)
    labels = tokens.masked_fill(mask == 0, -100)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    want = base(input_ids=tokens, attention_mask=mask, position_ids=positions, labels=labels, use_cache=False)
    want.loss.backward()
    model = apply_context_parallel(copy.deepcopy(base), mesh, layout="striped")
    model.zero_grad(set_to_none=True)
    shifted = hf.shift_labels(labels)
    tok, m, pos, lab = shard_batch((tokens, mask, positions, shifted), mesh, layout="striped")
    out = model(input_ids=tok, attention_mask=m, position_ids=pos, labels=lab, shift_labels=lab,
                num_items_in_batch=(shifted != -100).sum(), use_cache=False)
    out.loss.backward()
    reduce_gradients(model, mesh)
    loss = out.loss.detach().clone()
    torch.distributed.all_reduce(loss)
    assert rel_err(loss, want.loss.detach()) <= TOL, (loss, want.loss)
    for (name, p), q in zip(model.named_parameters(), base.parameters()):
        assert rel_err(p.grad, q.grad) <= TOL, (name, rel_err(p.grad, q.grad))


def _expect_error(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _check_errors(rank: int, world: int, slow: bool) -> None:
    """Every failure raises on every rank, also when only one rank's input is bad; the ranks stay in step
    (a good call after the failures still matches CP=1)."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, weights = _batch(4)
    positions = torch.arange(N).expand(2, N)
    base = _model("mistral-below", world)
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="striped")
    tok, pos = shard_batch((tokens, positions), mesh, layout="striped")
    s = tok.shape[1]
    four_d = torch.ones(2, 1, s, s, dtype=torch.bool).tril()
    call = lambda **kw: model(**{"input_ids": tok, "position_ids": pos, "use_cache": False, **kw})  # noqa: E731

    _expect_error(lambda: call(attention_mask=four_d), "explicit")  # an inexpressible mask, on every rank
    _expect_error(lambda: call(attention_mask=four_d if rank == 0 else None), "explicit")  # on rank 0 only
    _expect_error(lambda: call(position_ids=None if rank == world - 1 else pos), "needs position_ids")
    _expect_error(lambda: call(labels=tok), "shift_labels")
    _expect_error(lambda: call(labels=tok, shift_labels=tok), "num_items_in_batch")
    middle = torch.ones(2, N, dtype=torch.long)
    middle[1, 9:13] = 0  # padding inside a sequence: no document split expresses it
    _expect_error(lambda: call(attention_mask=shard_batch(middle, mesh, layout="striped")), "padding inside")
    one_rank = torch.ones(2, s, dtype=torch.long)
    _expect_error(lambda: call(attention_mask=one_rank if rank == 0 else None), "some CP ranks only")
    # a mask rule the ring cannot run (an or_mask_function, as image-token models add), by transformers' builder
    from transformers.masking_utils import create_causal_mask

    attn = model.model.layers[0].self_attn
    refused = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(2, s, 32), attention_mask=None,
                                 cache=None, position_ids=pos, or_mask_function=lambda b, h, q, k: k == 0)
    q, kv = torch.randn(2, 4, s, 8), torch.randn(2, 2, s, 8)
    _expect_error(lambda: hf.cp_dtensor_attention(attn, q, kv, kv, refused, position_ids=pos), "mask rule")
    # what Gemma2 passes (logit softcapping), a bidirectional window, and either on one rank only
    direct = lambda **kw: hf.cp_dtensor_attention(attn, q, kv, kv, None, position_ids=pos, **kw)  # noqa: E731
    _expect_error(lambda: direct(softcap=50.0), "softcapping")
    _expect_error(lambda: direct(softcap=50.0 if rank == 1 else None), "softcapping")
    _expect_error(lambda: direct(is_causal=False, sliding_window=4), "bidirectional sliding window")
    # layers that mix tokens outside attention (linear attention, state-space) are refused when CP is applied
    other = _model("llama", world)
    other.config.layer_types = ["full_attention", "linear_attention"]
    _expect_error(lambda: hf.apply_context_parallel(other, mesh), "linear_attention")
    # attention dropout in training
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    _expect_error(lambda: call(), "dropout")
    model.eval()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    # decoding from a KV cache that holds this rank's shard: refused, not attended locally
    cache = call(use_cache=True).cache
    _expect_error(lambda: call(input_ids=tok[:, :1], position_ids=pos[:, -1:] + world, cache=cache, use_cache=True),
                  "KV cache")
    # still in step: a good call equals CP=1
    keep = torch.ones(2, N)
    ref = _run(copy.deepcopy(base), dict(input_ids=tokens, position_ids=positions), weights, keep, use_cache=False)
    model.zero_grad()
    got = _run(model, dict(input_ids=tokens, position_ids=positions), weights, keep, mesh=mesh, layout="striped",
               use_cache=False)
    _compare("after the errors", got, ref, keep)


# P = 2 and 4 by default (~30 s on 2 cores); CP_DTENSOR_SLOW=all adds every model and layout to the
# use_cache / checkpointing / module-path / packed / padding variants (~2 min)
@pytest.mark.parametrize("world", [2, 4])
def test_models_windows_layouts_match_cp1(world):
    """Llama (GQA), Qwen3 (MQA), Qwen3 with per-layer windows, Mistral with a window below, between and
    above S_local and N, gpt-oss (sinks, per-layer windows); every layout; use_cache off / on, gradient
    checkpointing, the module path."""
    run_ranks(world, _check_models, SLOW)


@pytest.mark.parametrize("world", [2, 4])
def test_packed_sequences_match_cp1(world):
    run_ranks(world, _check_packed, SLOW)


@pytest.mark.parametrize("world", [2, 4])
def test_padding_matches_cp1(world):
    run_ranks(world, _check_padding, SLOW)


@pytest.mark.parametrize("world", [2, 4])
def test_errors_raise_on_every_rank(world):
    run_ranks(world, _check_errors, SLOW)


class _Fingerprints(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the agreement check's all-gathers: int64 [1, 20] fingerprints (checks.Fingerprint)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        x = args[0] if args else None
        if "all_gather" in str(func) and isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.numel() == 20:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _agreements(rank: int, world: int) -> list[int]:
    mesh = init_device_mesh("cpu", (world,))
    tokens, _ = _batch(2)
    counts = []
    for packed in (False, True):  # plain positions; packed sequences (documents derived from the positions)
        positions = torch.arange(N).expand(2, N) % (N // 2 if packed else N)
        model = hf.apply_context_parallel(_model("llama", world), mesh, layout="striped")
        tok, pos = shard_batch((tokens, positions), mesh, layout="striped")
        with _Fingerprints() as fp, torch.no_grad():
            model(input_ids=tok, position_ids=pos, use_cache=False)
        counts.append(fp.n)
    return counts


def test_agreement_runs_once_per_layer_call():
    """The transformers path: one fingerprint all-gather per attention layer call (the first layer's
    check before the documents' gather counts as that layer's), with and without packed documents."""
    layers = TINY["num_hidden_layers"]
    assert run_ranks(2, _agreements) == [[layers, layers]] * 2
