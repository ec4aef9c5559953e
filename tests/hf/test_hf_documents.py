"""layout="documents" under cp_dtensor.hf.apply_context_parallel: one plan per batch from the full batch
(cp_dtensor.hf.plan_batch), the batch sharded with it, the model called with cp_layout=plan. Logits, the
training loss and every parameter gradient equal the plain model at CP=1 (each packed row run alone, sdpa,
documents kept apart by transformers' packed-sequence rule; gpt-oss eager with its block-diagonal masks
prepared); bad input raises on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
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

from cp_dtensor import hf  # noqa: E402
from cp_dtensor.core.batch import shard_batch, unshard_batch  # noqa: E402
from cp_dtensor.core.plan.documents import document_layout  # noqa: E402
from cp_dtensor.doors import reduce_gradients  # noqa: E402
from cp_dtensor.hf.documents import model_windows  # noqa: E402

TOL = 1e-5  # fp32, relative to the largest magnitude
N, V = 32, 64
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
# two packed rows: short documents, one longer than S_local at P = 2, a 1-token document
LENGTHS = ([5, 1, 19, 3, 4], [2, 24, 6])


def _model(name: str):
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    if name == "mistral":  # a window of 6 on both layers, shorter than the long documents
        return MistralForCausalLM(MistralConfig(**TINY, sliding_window=6))
    if name == "qwen3-hybrid":  # layer 0 full, layer 1 a window of 5 (layer_types)
        return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=8, use_sliding_window=True, sliding_window=5,
                                            max_window_layers=1))
    if name == "gpt-oss":  # sinks on every layer, layer 0 a window of 5, MoE; transformers runs it with eager
        model = GptOssForCausalLM(GptOssConfig(**{**TINY, "attn_implementation": "eager", "intermediate_size": 32},
                                               head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5))
        with torch.no_grad():  # sinks large enough to matter (initialised near 0)
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
        return model
    raise KeyError(name)


def _dense_masks(lengths, window: int) -> dict:
    """gpt-oss's prepared-mask input for one packed row (its modeling code builds no packed-sequence mask):
    additive [1, 1, N, N] masks per layer type, block-diagonal causal."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i, j = torch.arange(N)[:, None], torch.arange(N)[None, :]
    full = (ids[:, None] == ids[None, :]) & (j <= i)
    add = lambda keep: torch.zeros(N, N).masked_fill(~keep, torch.finfo(torch.float32).min)[None, None]  # noqa: E731
    return {"full_attention": add(full), "sliding_attention": add(full & (i - j < window))}


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (2, N), generator=g)
    weights = torch.randn(2, N, V, generator=g)  # the loss: sum(logits * weights), a fixed linear functional
    positions = torch.stack([torch.cat([torch.arange(x) for x in row]) for row in LENGTHS])
    labels = torch.randint(0, V, (2, N), generator=g)
    labels[0, 7] = labels[1, 3] = -100
    return tokens, positions, weights, labels


def _reference(base, tokens, positions, weights, labels):
    """CP=1: each packed row alone through the plain model (transformers keeps its documents apart from the
    position ids, use_cache off); logits, parameter grads of sum(logits * weights), and the summed training
    loss (labels shifted on the row) with its grads."""
    model = copy.deepcopy(base)
    window = getattr(model.config, "sliding_window", None)
    masks = [_dense_masks(LENGTHS[r], window) if isinstance(model, GptOssForCausalLM) else None for r in range(2)]
    logits = []
    for r in range(2):
        out = model(input_ids=tokens[r:r + 1], position_ids=positions[r:r + 1], attention_mask=masks[r],
                    use_cache=False).logits
        (out * weights[r:r + 1]).sum().backward()
        logits.append(out.detach())
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    loss = 0
    for r in range(2):
        lab = shifted[r:r + 1]
        loss = loss + model(input_ids=tokens[r:r + 1], position_ids=positions[r:r + 1], labels=lab, shift_labels=lab,
                            attention_mask=masks[r], num_items_in_batch=count, use_cache=False).loss
    loss.backward()
    return torch.cat(logits), grads, loss.item(), [p.grad.clone() for p in model.parameters()]


def _cp(model, mesh, plan, tokens, positions, weights, labels):
    """The same under CP: the batch sharded with the plan, every call with cp_layout=plan."""
    tok, pos, w, lab = shard_batch((tokens, positions, weights, hf.shift_labels(labels)), mesh, layout=plan)
    logits = model(input_ids=tok, position_ids=pos, use_cache=False, cp_layout=plan).logits
    (logits * w).sum().backward()
    reduce_gradients(model, mesh)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    count = (hf.shift_labels(labels) != -100).sum()
    loss = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                 use_cache=False, cp_layout=plan).loss
    loss.backward()
    reduce_gradients(model, mesh)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return unshard_batch(logits.detach(), mesh, layout=plan), grads, total.item(), [p.grad.clone() for p in model.parameters()]


def _compare(where: str, got, want) -> None:
    (logits, grads, loss, loss_grads), (ref_logits, ref_grads, ref_loss, ref_loss_grads) = got, want
    assert rel_err(logits, ref_logits) <= TOL, f"{where}: logits {rel_err(logits, ref_logits):.2e}"
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"{where}: loss {loss} vs {ref_loss}"
    for i, (g, r) in enumerate(zip(grads + loss_grads, ref_grads + ref_loss_grads)):
        assert rel_err(g, r) <= TOL, f"{where}: grad {i} {rel_err(g, r):.2e}"


def _check_match(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, weights, labels = _batch()
    for name, layout, checkpointing in (("llama", "documents", False), ("llama", "documents", True),
                                        ("mistral", "documents", False), ("qwen3-hybrid", "documents", False),
                                        ("gpt-oss", "documents", False),
                                        ("llama", "striped", False), ("llama", "headtail", False)):
        base = _model(name)
        want = _reference(base, tokens, positions, weights, labels)
        model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout=layout)
        if checkpointing:
            model.gradient_checkpointing_enable()
            model.train()
        plan = hf.plan_batch(model, position_ids=positions)  # the full batch, the same on every rank
        assert plan.placement == layout and plan.cp_size == world and tuple(plan.order.shape) == (2, N)
        _compare(f"{name} {layout} P={world} ckpt={checkpointing}", _cp(model, mesh, plan, tokens, positions, weights,
                                                                      labels), want)
    # the reference really keeps the documents apart: across them (a cache on: no packed-sequence rule) it differs
    crossing = _model("llama")(input_ids=tokens, position_ids=positions, use_cache=True).logits.detach()
    assert rel_err(crossing, _reference(_model("llama"), tokens, positions, weights, labels)[0]) > 1e-2
    # the plan balances every layer's kept pairs: the windows come from the config (W keeps q - W < k <= q)
    assert model_windows(_model("mistral").config) == [5, 5]
    assert model_windows(_model("qwen3-hybrid").config) == [None, 4]
    assert model_windows(_model("llama").config) == [None, None]
    assert model_windows(_model("gpt-oss").config) == [4, None]
    # the named layouts without a plan still derive the documents from the gathered positions
    base = _model("llama")
    want = _reference(base, tokens, positions, weights, labels)
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="striped")
    tok, pos, w = shard_batch((tokens, positions, weights), mesh, layout="striped")
    logits = model(input_ids=tok, position_ids=pos, use_cache=False).logits
    assert rel_err(unshard_batch(logits.detach(), mesh, layout="striped"), want[0]) <= TOL


def _check_padding(rank: int, world: int) -> None:
    """Right and left padding: the plan keeps each pad token apart; equal to CP=1 on the real tokens."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, -6:] = 0
    mask[1, :5] = 0
    positions = torch.arange(N).expand(2, N)
    base = _model("llama")
    ref = copy.deepcopy(base)(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False).logits
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="documents")
    plan = hf.plan_batch(model, position_ids=positions, attention_mask=mask)
    tok, pos, m = shard_batch((tokens, positions, mask), mesh, layout=plan)
    got = unshard_batch(model(input_ids=tok, position_ids=pos, attention_mask=m, use_cache=False,
                              cp_layout=plan).logits.detach(), mesh, layout=plan)
    keep = mask.bool()
    assert rel_err(got[keep], ref.detach()[keep]) <= TOL, rel_err(got[keep], ref.detach()[keep])


def _expect_error(fn, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fn()


def _check_errors(rank: int, world: int) -> None:
    """Every bad input raises on every rank, also when one rank's is bad; then a good call still matches."""
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, weights, labels = _batch()
    base = _model("llama")
    model = hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="documents")
    plan = hf.plan_batch(model, position_ids=positions)
    tok, pos = shard_batch((tokens, positions), mesh, layout=plan)
    call = lambda **kw: model(**{"input_ids": tok, "position_ids": pos, "use_cache": False, "cp_layout": plan, **kw})  # noqa: E731

    _expect_error(lambda: call(cp_layout=None), "plan of its batch")  # no plan
    _expect_error(lambda: call(cp_layout=None if rank == 0 else plan), "plan of its batch")  # on rank 0 only
    _expect_error(lambda: call(cp_layout="documents"), "takes the batch's plan")
    # a plan of another batch (other documents, the same shape), on one rank or all
    other = hf.plan_batch(model, position_ids=torch.arange(N).expand(2, N) % 8)
    _expect_error(lambda: call(cp_layout=other), "another batch")
    _expect_error(lambda: call(cp_layout=other if rank == world - 1 else plan), "another batch|rejected")
    # a plan that cuts a document once more than the positions, on rank 1 only (Note [A plan fits its batch])
    ids = (positions == 0).long().cumsum(1) + (rank > 0) * (torch.arange(N) >= 20).long()
    finer = hf.plan_batch(model, document_ids=ids)
    fine_tok, fine_pos = shard_batch((tokens, positions), mesh, layout=finer)
    _expect_error(lambda: call(input_ids=fine_tok, position_ids=fine_pos, cp_layout=finer), "does not fit")
    # plans that differ across ranks, each consistent with the positions (rank 1's balanced for a window):
    # the agreement on the plan's key
    mine = document_layout(plan.ids, world, windows=[2] if rank > 0 else None)
    mine_tok, mine_pos = shard_batch((tokens, positions), mesh, layout=mine)
    _expect_error(lambda: call(input_ids=mine_tok, position_ids=mine_pos, cp_layout=mine), "plan key")
    # a plan for another mesh size, for another batch shape
    _expect_error(lambda: call(cp_layout=document_layout(plan.ids, 2 * world)), "built for")
    _expect_error(lambda: call(cp_layout=hf.plan_batch(model, position_ids=positions[:1])), "built for")
    # a named layout's plan for a documents model
    _expect_error(lambda: call(cp_layout=document_layout(plan.ids, world, placement="striped")), "placement")
    # padding the plan does not keep apart
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, -6:] = 0
    _expect_error(lambda: call(attention_mask=shard_batch(mask, mesh, layout=plan)), "padding apart|more than one")
    # built from the full batch: N not divisible by P, ids that decrease, padding inside a row -- every rank
    _expect_error(lambda: hf.plan_batch(model, position_ids=positions[:, :N - 1]), "divisible")
    _expect_error(lambda: hf.plan_batch(model, document_ids=torch.arange(N).flip(0).expand(2, N)), "decrease")
    middle = torch.ones(2, N, dtype=torch.long)
    middle[1, 9:13] = 0
    _expect_error(lambda: hf.plan_batch(model, position_ids=positions, attention_mask=middle), "padding inside")
    # what the document exchange does not take, when CP is applied
    _expect_error(lambda: hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="documents",
                                                    kv_exchange="allgather"), "Drop it")
    _expect_error(lambda: hf.apply_context_parallel(copy.deepcopy(base), mesh, layout="document"), "or 'documents'")
    hybrid = copy.deepcopy(base)  # linear-attention layers pass state along the sequence: headtail / contiguous
    hybrid.config.layer_types = ["full_attention", "linear_attention"]
    _expect_error(lambda: hf.apply_context_parallel(hybrid, mesh, layout="documents"), "for attention models")
    # still in step
    want = _reference(base, tokens, positions, weights, labels)
    model.zero_grad()
    _compare("after the errors", _cp(model, mesh, plan, tokens, positions, weights, labels), want)


def _all(rank: int, world: int) -> None:
    _check_match(rank, world)
    _check_padding(rank, world)
    _check_errors(rank, world)


def test_documents_layout_matches_cp1_and_refuses_bad_input():
    """P = 2: Llama (also with gradient checkpointing), Mistral's window, Qwen3's per-layer window, gpt-oss's
    sinks and per-layer windows; a named layout's plan; padding; every error on every rank. One spawn."""
    run_ranks(2, _all)
