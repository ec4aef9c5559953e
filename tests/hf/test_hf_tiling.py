"""Sequence tiling (cp_dtensor.hf: sequence_tiling=; hf/tiling.py, core/tiling.py): the loss and the gradients of
lm_head, the embeddings and the MLP weights equal the plain, untiled model at CP=1 (transformers' own head and
loss on the full sequence); what cannot be tiled raises on every rank."""

from __future__ import annotations

import copy

import pytest
import torch
from _tiers import slow
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks
from _ref import rel_err

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import cp_dtensor  # noqa: E402
from cp_dtensor.core.batch import shard_batch  # noqa: E402
from cp_dtensor.doors import reduce_gradients  # noqa: E402
from cp_dtensor.hf import attention as hf  # noqa: E402
from cp_dtensor.hf.tiling import apply_sequence_tiling, remove_sequence_tiling  # noqa: E402

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # issue #43's bars: relative to the reference (the largest magnitude for grads)
N, V, B = 48, 96, 2
TILE = 5  # ragged: S_local = 48 and 24 are not multiples
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")


def _model(name: str):
    kinds = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen3-tied": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8, tie_word_embeddings=True)),
        "gpt-oss": (GptOssConfig, GptOssForCausalLM, dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                                          intermediate_size=32, attn_implementation="eager")),
    }
    cfg_cls, cls, extra = kinds[name]
    torch.manual_seed(0)
    return cls(cfg_cls(**{**TINY, **extra})).float().train()


def _batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, N), generator=g)
    labels = torch.randint(0, V, (B, N), generator=g)
    labels[0, :7] = -100  # a prompt
    labels[1, 30] = -100
    return tokens, torch.arange(N).expand(B, N), labels


def _grads(model) -> dict:
    """The gradients the bars name: lm_head, the embeddings, one MLP weight (the experts' for gpt-oss)."""
    mlp = model.model.layers[0].mlp
    w = mlp.experts.down_proj if hasattr(mlp, "experts") else mlp.down_proj.weight
    return {"lm_head": model.lm_head.weight.grad.clone(), "embed": model.model.embed_tokens.weight.grad.clone(),
            "mlp": w.grad.clone(), "all": torch.cat([p.grad.flatten() for p in model.parameters()])}


def _reference(name: str, *, num_items: bool):
    """The plain model at CP=1: transformers' head and loss on the full batch."""
    model = _model(name)
    tokens, positions, labels = _batch()
    extra = dict(num_items_in_batch=(hf.shift_labels(labels) != -100).sum()) if num_items else {}
    out = model(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False, **extra)
    out.loss.backward()
    return out.loss.item(), _grads(model)


def _compare(where: str, loss: float, grads: dict, ref) -> None:
    ref_loss, ref_grads = ref
    assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), f"{where}: loss {loss} vs {ref_loss}"
    for k, g in grads.items():
        assert rel_err(g, ref_grads[k]) <= GRAD_TOL, f"{where}: grad {k} {rel_err(g, ref_grads[k]):.2e}"


@pytest.mark.parametrize("name", ["llama", "qwen3-tied", "gpt-oss"])
def test_tiled_at_cp1_equals_plain(name):
    """apply_sequence_tiling without CP: the loss (mean and num_items_in_batch), grads; logits empty in training,
    whole in eval; the head's output never has V columns in a tiled call."""
    tokens, positions, labels = _batch()
    for num_items in (False, True):
        ref = _reference(name, num_items=num_items)
        model = apply_sequence_tiling(_model(name), tile_size=TILE)
        seen = []  # a forward pre-hook is served: it sees the hidden states, as the untiled head's would
        model.lm_head.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[-1]))
        extra = dict(num_items_in_batch=(hf.shift_labels(labels) != -100).sum()) if num_items else {}
        out = model(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False, **extra)
        out.loss.backward()
        assert out.logits.shape == (B, N, 0) and seen == [TINY["hidden_size"]]
        _compare(f"{name} CP=1 num_items={num_items}", out.loss.item(), _grads(model), ref)
    plain = _model(name).eval()
    model.eval()
    with torch.no_grad():
        want = plain(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False)
        got = model(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False)
    assert got.logits.shape == (B, N, V) and rel_err(got.logits, want.logits) <= 1e-5  # eval: logits as before
    assert abs(got.loss.item() - want.loss.item()) <= LOSS_TOL * abs(want.loss.item())
    copied = copy.deepcopy(model.train())  # the copy's head, MLPs and loss serve the copy's own weights
    assert copied.lm_head.forward.args[0] is copied.lm_head and copied.loss_function.args[0] is copied
    with torch.no_grad():
        copied.lm_head.weight.mul_(2.0)
    a = model(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False).loss
    b = copied(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False).loss
    assert abs(a.item() - want.loss.item()) <= LOSS_TOL * abs(want.loss.item()) and abs(b.item() - a.item()) > 1e-3
    remove_sequence_tiling(model)
    assert "forward" not in model.lm_head.__dict__ and "_loss_function" not in model.__dict__


def _cp(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, labels = _batch()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    out = {}
    for name in ("llama", "gpt-oss"):
        ref = _reference(name, num_items=True)
        for how, layout, ckpt in (("hf", "striped", False), ("module", "headtail", True)):
            model = _model(name)
            if ckpt:
                model.gradient_checkpointing_enable()
            if how == "hf":
                hf.apply_context_parallel(model, mesh, layout=layout, sequence_tiling=TILE)
            else:
                cp_dtensor.apply_context_parallel(model, mesh, layout=layout, sequence_tiling=TILE)
            tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout=layout)
            res = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                        use_cache=False)
            res.loss.backward()
            reduce_gradients(model, mesh)
            total = res.loss.detach().clone()
            torch.distributed.all_reduce(total)
            assert res.logits.shape == (B, N // world, 0)
            _compare(f"{name} CP={world} {how} {layout} ckpt={ckpt}", total.item(), _grads(model), ref)
        out[name] = True
    # an all-masked row and nothing labelled, with the Trainer's global count (CP demands one): the plain CP=1
    # model's loss (nan when nothing is labelled: a count of 0) and gradients (zeros, never nan)
    for case in ("masked row", "all ignored"):
        masked = labels.clone()
        masked[0] = -100
        if case == "all ignored":
            masked[:] = -100
        shifted_m = hf.shift_labels(masked)
        extra = dict(num_items_in_batch=(shifted_m != -100).sum())
        plain = _model("llama")
        want = plain(input_ids=tokens, position_ids=positions, labels=masked, use_cache=False, **extra).loss
        want.backward()
        model = hf.apply_context_parallel(_model("llama"), mesh, sequence_tiling=TILE)
        tok, pos, lab = shard_batch((tokens, positions, shifted_m), mesh, layout="striped")
        res = model(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, use_cache=False, **extra)
        res.loss.backward()
        reduce_gradients(model, mesh)
        total = res.loss.detach().clone()
        torch.distributed.all_reduce(total)
        got, ref = _grads(model)["all"], torch.cat([p.grad.flatten() for p in plain.parameters()])
        if case == "all ignored":
            assert extra["num_items_in_batch"] == 0 and total.isnan() and want.isnan() and not ref.any() \
                and not got.any(), case
        else:
            _compare(f"{case} CP={world}", total.item(), {"all": got}, (want.item(), {"all": ref}))
    # labels shifted inside the shard: refused on every rank, before any communication, tiling on or off
    model = hf.apply_context_parallel(_model("llama"), mesh, sequence_tiling=True)
    tok, pos, lab = shard_batch((tokens, positions, labels), mesh, layout="striped")
    with pytest.raises(ValueError, match="shift_labels"):
        model(input_ids=tok, position_ids=pos, labels=lab, use_cache=False)
    # and a tile size that is not one, or a head that cannot be tiled: before the model changes
    for bad in (0, -3, 2.5, "yes"):
        with pytest.raises(ValueError, match="sequence_tiling must be"):
            hf.apply_context_parallel(_model("llama"), mesh, sequence_tiling=bad)
    removed = cp_dtensor.remove_context_parallel(hf.apply_context_parallel(_model("llama"), mesh, sequence_tiling=True))
    assert "forward" not in removed.lm_head.__dict__ and not hasattr(removed, "_cp_dtensor_tiling")
    gemma = Gemma2ForCausalLM(Gemma2Config(**{**TINY, "head_dim": 8, "attn_implementation": "eager"}, final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        hf.apply_context_parallel(gemma, mesh, sequence_tiling=True)
    assert gemma.config._attn_implementation != hf.NAME  # refused before any change
    if world == 2:  # the same ranks as data parallelism: FSDP-sharded heads (Note [FSDP heads])
        out["fsdp"] = _fsdp(rank, world)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_tiled_under_cp_equals_plain_cp1(world):
    fsdp = {"fsdp": True} if world == 2 else {}
    assert run_ranks(world, _cp) == [{"llama": True, "gpt-oss": True, **fsdp}] * world


def _trainer_run(rank: int, world: int, tmp: str, tile) -> dict:
    """transformers' Trainer (3 steps, then evaluate with metrics from the gathered logits): plain when
    ``tile`` is None (CP=1, one process), else with_context_parallel(..., sequence_tiling=tile)."""
    import os

    from transformers import Trainer, TrainingArguments, default_data_collator

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    g = torch.Generator().manual_seed(11)
    rows = [{"input_ids": (ids := torch.randint(0, V, (16,), generator=g).tolist()), "labels": list(ids)}
            for _ in range(12)]

    def metrics(pred):  # needs the logits of every row: evaluation returns them with tiling on
        return {"logit_sum": float(abs(pred.predictions).sum()), "vocab": float(pred.predictions.shape[-1])}

    args = TrainingArguments(output_dir=os.path.join(tmp, f"{rank}-{tile}"), per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, max_steps=3, logging_steps=1, report_to=[],
                             save_strategy="no", learning_rate=1e-2, use_cpu=True, disable_tqdm=True, seed=0)
    cls = Trainer if tile is None else cp_dtensor.hf.with_context_parallel(Trainer, cp_size=world, sequence_tiling=tile)
    trainer = cls(model=_model("llama"), args=args, train_dataset=rows, eval_dataset=rows[:6],
                  data_collator=default_data_collator, compute_metrics=metrics)
    trainer.train()
    ev = trainer.evaluate()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval": [ev["eval_loss"], ev["eval_logit_sum"], ev["eval_vocab"]]}


@slow("a Trainer run at CP=2 and one at CP=1 (~12 s)")
def test_trainer_with_tiling_logs_plain_cp1_losses(tmp_path):
    """with_context_parallel(Trainer, cp_size=2, sequence_tiling=3): the training losses of the plain Trainer at
    CP=1; evaluation still gathers the full logits (compute_metrics sees [rows, N, V])."""
    tiled = run_ranks(2, _trainer_run, str(tmp_path), 3, timeout=300)
    plain = run_ranks(1, _trainer_run, str(tmp_path), None, timeout=300)[0]
    assert tiled[0] == tiled[1]
    assert len(plain["losses"]) == 3 and plain["eval"][2] == V
    for a, b in zip(tiled[0]["losses"] + tiled[0]["eval"], plain["losses"] + plain["eval"]):
        assert abs(a - b) <= 2e-5 * abs(b), (tiled[0], plain)


def test_peak_growth_per_token_tiled_under_015_untiled():
    """scripts/benchmarks/bench_tiling.py's probe at a small size (vocab 8192, hidden 32, CP=2, S_local 256 -> 768): a rank's
    peak (VmHWM after clear_refs) grows per token by <= 0.15x the untiled growth, which is the logits' (about
    16 bytes a vocabulary entry, fp32)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "benchmarks"))
    import bench_tiling

    shape = dict(vocab=8192, hidden=32, layers=1)
    growth = {}
    for tile in (None, 128):
        lo, hi = (bench_tiling.probe(2, s, tile, shape)["peak"] for s in (256, 768))
        growth[tile] = (hi - lo) / 512
    assert growth[None] >= 0.8 * 8192 * 16, growth  # the untiled head dominates, as modelled
    assert growth[128] <= 0.15 * growth[None], growth


def _sft_run(rank: int, world: int, tmp: str, tile) -> list[float]:
    """TRL's SFTTrainer under CP, packed rows, SGD (so a gradient difference shows in the next loss), fp32.
    Its own fused LM head computes the loss; sequence_tiling tiles the MLPs."""
    import os

    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>",
                                  eos_token="<eos>")
    g = torch.Generator().manual_seed(12)
    rows = [{"input_ids": torch.randint(2, V, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
             + [1]} for _ in range(24)]
    args = SFTConfig(output_dir=os.path.join(tmp, f"sft{rank}-{tile}"), per_device_train_batch_size=2, max_steps=3,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                     data_seed=0, packing=True, max_length=24, optim="sgd", learning_rate=0.5, bf16=False)
    kw = {"sequence_tiling": tile} if tile else {}
    trainer = cp_dtensor.hf.with_context_parallel(SFTTrainer, cp_size=world, **kw)(
        model=_model("llama"), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@slow("two TRL SFTTrainer runs at CP=2 (~15 s)")
def test_trl_sft_with_tiling_equals_untiled(tmp_path):
    """SFTTrainer at CP=2 with sequence_tiling=3 logs the losses of SFTTrainer at CP=2 untiled (which
    tests/hf/test_hf_trainer.py compares with CP=1), SGD steps included: the tiled MLPs' gradients are its own."""
    pytest.importorskip("trl")
    tiled = run_ranks(2, _sft_run, str(tmp_path), 3, timeout=300)[0]
    plain = run_ranks(2, _sft_run, str(tmp_path), None, timeout=300)[0]
    assert len(plain) == 3
    for a, b in zip(tiled, plain):
        assert abs(a - b) <= 2e-5 * abs(b), (tiled, plain)


def _untiled_and_tiled(make, tile=TILE, *, after=None, **kw) -> tuple:
    """(untiled, tiled) training calls of two copies of ``make()`` on the batch: each (output, loss, all grads);
    ``after(model)`` changes each copy after tiling (a resize, a hook)."""
    runs = []
    for tiled in (False, True):
        model = make().train()
        if tiled:
            apply_sequence_tiling(model, tile_size=tile)
        if after is not None:
            after(model)
        tokens, positions, labels = _batch()
        out = model(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False, **kw)
        out.loss.backward()
        runs.append((model, out, out.loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()
                                                            if p.grad is not None])))
    return runs


def _equal(where, runs, *, tol=GRAD_TOL):
    (_, _, want, ref), (model, out, got, grads) = runs
    assert abs(got - want) <= LOSS_TOL * abs(want), f"{where}: loss {got} vs {want}"
    assert grads.shape == ref.shape and rel_err(grads, ref) <= tol, f"{where}: grads {rel_err(grads, ref):.2e}"
    return model, out


def _eval_logits_equal(where, plain, tiled):
    tokens, positions, _ = _batch()
    with torch.no_grad():
        a = plain.eval()(input_ids=tokens, position_ids=positions, use_cache=False).logits
        b = tiled.eval()(input_ids=tokens, position_ids=positions, use_cache=False).logits
    assert a.shape == b.shape == (B, N, V) and rel_err(b, a) <= 1e-5, where


class _OwnForwardHead(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5 + 1.0


class _KeptForwardHead(torch.nn.Linear):
    pass


def test_heads_users_customise():
    """Granite's and Cohere's logit scales (a biased head too), a head subclass that keeps nn.Linear's forward and a
    model subclass without a forward: served, equal to the untiled model (loss, grads, eval logits) with the logits
    slot a TiledLogits; a head with its own forward, a forward hook or a soft cap set after tiling: refused
    (Note [What a tiled call re-checks]); a head replaced by resize_token_embeddings: tiled again."""
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

    def biased(model):
        head = torch.nn.Linear(32, V, bias=True)
        torch.nn.init.normal_(head.bias, generator=torch.Generator().manual_seed(5))
        head.weight.data.copy_(model.lm_head.weight.data)
        model.lm_head = head
        return model

    def scaled(kind, bias=False):
        torch.manual_seed(0)
        cfg = GraniteConfig(**TINY, logits_scaling=4.0) if kind == "granite" else CohereConfig(**TINY, logit_scale=0.0625)
        model = (GraniteForCausalLM if kind == "granite" else CohereForCausalLM)(cfg).float()
        return biased(model) if bias else model

    for kind in ("granite", "cohere"):
        for bias in (False, True):
            runs = _untiled_and_tiled(lambda: scaled(kind, bias))
            tiled, out = _equal(f"{kind} bias={bias}", runs)
            assert type(out.logits).__name__ == "TiledLogits" and out.logits.shape == (B, N, 0)
            with pytest.raises(ValueError, match="never computed"):
                out.logits.argmax(-1)
            _eval_logits_equal(f"{kind} bias={bias}", runs[0][0], tiled)

    class MyLlama(LlamaForCausalLM):  # no forward of its own: the family's
        pass

    def kept():
        model = _model("llama")
        head = _KeptForwardHead(32, V, bias=False)
        head.weight = model.lm_head.weight
        model.lm_head = head
        return model

    for where, make in (("model subclass", lambda: MyLlama(_model("llama").config).float()), ("head subclass", kept)):
        torch.manual_seed(0)
        runs = _untiled_and_tiled(make)
        _eval_logits_equal(where, runs[0][0], _equal(where, runs)[0])

    own = _model("llama")
    own.lm_head = _OwnForwardHead(32, V, bias=False)
    with pytest.raises(ValueError, match="subclass with its own forward"):
        apply_sequence_tiling(own)
    tokens, positions, labels = _batch()
    kw = dict(input_ids=tokens, position_ids=positions, labels=labels, use_cache=False)
    checks = {  # a change after tiling: the words of its error
        "own forward": (lambda m: setattr(m, "lm_head", _OwnForwardHead(32, V, bias=False)), "was replaced"),
        "forward hook": (lambda m: m.lm_head.register_forward_hook(lambda *a: None), "forward hooks"),
        "soft cap": (lambda m: setattr(m.config, "final_logit_softcapping", 30.0), "final_logit_softcapping"),
    }
    for where, (change, words) in checks.items():
        model = apply_sequence_tiling(_model("llama"), tile_size=TILE)
        change(model)
        with pytest.raises(ValueError, match=words):
            model(**kw)
        assert not model._cp_dtensor_tiling.active, where
        model.eval()  # evaluation runs the head whole: served
        model(**kw)

    def resize(model):
        model.resize_token_embeddings(V + 8)
        torch.nn.init.normal_(model.lm_head.weight[V:], generator=torch.Generator().manual_seed(2))

    runs = _untiled_and_tiled(lambda: _model("llama"), after=resize)
    tiled, out = _equal("resized", runs)
    assert tiled.lm_head.weight.shape[0] == V + 8 and type(out.logits).__name__ == "TiledLogits"


def test_all_labels_ignored_and_one_element_count():
    """Nothing labelled (num_items None, 0; a single token, whose shifted label is ignored): nan loss and zero
    gradients, as the untiled model; num_items_in_batch as a one-element 1-D tensor, as a 0-d one."""
    tokens, positions, labels = _batch()
    for n, items in ((N, None), (N, 0), (1, None), (1, 0)):
        grads = []
        for tiled in (False, True):
            model = _model("llama")
            if tiled:
                apply_sequence_tiling(model, tile_size=TILE)
            lab = torch.full((B, n), -100) if n > 1 else labels[:, :1]
            extra = {} if items is None else dict(num_items_in_batch=torch.tensor(items))
            out = model(input_ids=tokens[:, :n], position_ids=positions[:, :n], labels=lab, use_cache=False, **extra)
            out.loss.backward()
            assert out.loss.isnan(), (n, items, tiled)
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert not grads[0].any() and torch.equal(grads[1], grads[0]), (n, items)
    count = (hf.shift_labels(labels) != -100).sum()
    runs = _untiled_and_tiled(lambda: _model("llama"), num_items_in_batch=count[None])
    _equal("num_items [1]", runs)


def _fsdp(rank: int, world: int) -> bool:  # run inside _cp's ranks at CP=2
    """FSDP2 data parallelism (fully_shard; the head its own unit, or in the root), each rank its own batch of
    its own length: the tiled model's loss and sharded gradients equal the untiled model's under the same
    wrapping (Note [FSDP heads]); no hang."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))  # the data-parallel mesh
    tokens, positions, labels = _batch(seed=20 + rank)
    n = N - 8 * rank  # unequal lengths per rank
    kw = dict(input_ids=tokens[:, :n], position_ids=positions[:, :n], labels=labels[:, :n], use_cache=False)
    for own_unit in (True, False):
        runs = []
        for tiled in (False, True):
            model = _model("llama")
            if tiled:
                apply_sequence_tiling(model, tile_size=TILE)
            if own_unit:
                fully_shard(model.lm_head, mesh=mesh)
            fully_shard(model, mesh=mesh)
            out = model(**kw)
            out.loss.backward()
            runs.append((out.loss.item(), torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])))
            assert tiled == (type(out.logits).__name__ == "TiledLogits")
        (want, ref), (got, grads) = runs
        assert abs(got - want) <= LOSS_TOL * abs(want), (own_unit, got, want)
        assert rel_err(grads, ref) <= GRAD_TOL, (own_unit, rel_err(grads, ref))
    return True
