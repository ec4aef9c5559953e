"""cp_dtensor.hf.with_context_parallel: transformers' Trainer and TRL's SFTTrainer at CP=2 log the losses of the
unchanged Trainer class at CP=1 (one process), train and eval, for Llama, Mistral with a window below the shard,
packed rows (DataCollatorWithFlattening, TRL packing), gpt-oss sinks and a Qwen3-Next hybrid; gradient
accumulation; a checkpoint saved at CP=2 resumes at CP=1; what cannot be served raises on every rank.

One spawn of 2 ranks runs every CP case, then one of 1 rank every reference (and the resume): Trainer start-up
is the cost, so the models, data and steps are tiny.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest
import torch
from _tiers import exhaustive, slow

from _dist import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
trl = pytest.importorskip("trl")
transformers.logging.set_verbosity_error()

from transformers import (  # noqa: E402
    DataCollatorWithFlattening,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)
from trl import SFTConfig, SFTTrainer  # noqa: E402

from cp_dtensor import hf  # noqa: E402

V, N = 64, 16  # vocabulary; the row length of the unpacked datasets (S_local = 8 at CP=2)
TOL = 2e-5  # relative, fp32: the ring sums in another order
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa", use_cache=False)


def _model(name: str):
    """A tiny random-init fp32 model, the same in every process. use_cache=False: then transformers' sdpa keeps
    packed documents apart at CP=1 too (with a cache it attends across them; CP keeps them apart always)."""
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    if name == "mistral":  # a window of 4 < S_local = 8
        return MistralForCausalLM(MistralConfig(**TINY, sliding_window=4))
    if name == "gpt-oss":  # sinks on every layer, layer 0 windowed (3), MoE; transformers runs it with eager
        model = GptOssForCausalLM(GptOssConfig(**{**TINY, "attn_implementation": "eager", "intermediate_size": 32},
                                               head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3))
        with torch.no_grad():  # sinks large enough to matter (initialised near 0)
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
        return model
    if name == "qwen3-next":  # linear, full attention; decays in [0.05, 1] (see tests/hf/test_hf_linear.py _model)
        cfg = Qwen3NextConfig(**{**TINY, "num_hidden_layers": 2}, layer_types=["linear_attention", "full_attention"],
                              head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0)
        model = Qwen3NextForCausalLM(cfg).float()
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "A_log"):
                    m.A_log.copy_(torch.empty(m.A_log.shape).uniform_(0.05, 1.0, generator=g).log())
        return model
    raise KeyError(name)


def _rows(seed: int, count: int = 12) -> list[dict]:
    """Fixed-length rows (labels = tokens; the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, V, (N,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def _documents(seed: int, count: int = 16) -> list[dict]:
    """Documents of 2..9 tokens: 4 of them packed into one row of a length that is often odd (CP pads it)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(2, V, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(count)]


def _args(out: str, **kw) -> TrainingArguments:
    base = dict(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=3,
                logging_steps=1, report_to=[], save_strategy="no", learning_rate=1e-2, use_cpu=True, disable_tqdm=True,
                seed=0, data_seed=0, dataloader_drop_last=False)
    return TrainingArguments(**{**base, **kw})


# name -> (model, train data, eval data, collator, layout, TrainingArguments overrides)
CASES = {
    "llama-rows": ("llama", _rows(1), _rows(2, 6), default_data_collator, "striped", {}),
    "llama-packed": ("llama", _documents(3), _documents(4, 14), DataCollatorWithFlattening(), "striped", {}),
    "llama-accumulate": ("llama", _documents(5), None, DataCollatorWithFlattening(), "headtail",
                         dict(gradient_accumulation_steps=2, per_device_train_batch_size=2)),
    "llama-checkpointing": ("llama", _documents(18), None, DataCollatorWithFlattening(), "contiguous",
                            dict(gradient_checkpointing=True)),
    "mistral-window-packed": ("mistral", _documents(6), _documents(7, 6), DataCollatorWithFlattening(), "striped", {}),
    "gpt-oss-sinks": ("gpt-oss", _rows(8), _rows(9, 5), default_data_collator, "striped", {}),
    "qwen3-next-hybrid": ("qwen3-next", _rows(10), _rows(11, 5), default_data_collator, "headtail", {}),
    # compute_loss overrides (_OwnLoss: docs/trainer.md's, and without its process count), 5 eval rows
    "llama-own-loss": ("llama", _rows(19), _rows(20, 5), default_data_collator, "striped", {}),
    "llama-own-loss-plain": ("llama", _rows(19), _rows(20, 5), default_data_collator, "striped", {}),
}


class _OwnLoss(Trainer):
    """docs/trainer.md's "Your own loss": a label-smoothed cross entropy over shift_labels, summed, divided by
    num_items_in_batch and multiplied by the process count as the Trainer does (``plain``: not multiplied, the
    natural first try; the unchanged Trainer then logs 1/dp of the loss with dp processes, and so must CP)."""

    plain = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        shift = inputs.pop("shift_labels", None)  # under CP: shifted on the full row, sharded like the tokens
        if shift is None:  # the unchanged Trainer: shift here
            shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        outputs = model(**inputs)
        loss = torch.nn.functional.cross_entropy(outputs.logits.float().flatten(0, 1), shift.flatten(),
                                                 ignore_index=-100, reduction="sum", label_smoothing=0.1)
        if num_items_in_batch is None:  # nobody counted (TRL's evaluation): this batch's mean
            loss = loss / (shift != -100).sum()
        elif self.plain:
            loss = loss / num_items_in_batch
        else:  # the count over every process, and DDP averages over them
            loss = loss / num_items_in_batch * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss


class _PlainLoss(_OwnLoss):
    plain = True


def _metrics(pred) -> dict:
    """From the full logits and labels the evaluation loop gathers: the mean logit of each next token (order- and
    shard-sensitive) and the row count."""
    logits, labels = pred.predictions[:, :-1], pred.label_ids[:, 1:]
    valid = labels != -100
    picked = np.take_along_axis(logits, np.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
    return {"target_logit": float(picked[valid].mean()), "rows": float(labels.shape[0])}


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _train(name: str, out: str, cp: int | None, layout: str | None = None, **extra) -> dict:
    """Train (and evaluate): the losses, grad norms, token counts (num_input_tokens_seen="all") and total_flos.
    ``layout``: another layout than the case's."""
    model, train, evals, collator, case_layout, kw = CASES[name]
    layout = layout or case_layout
    base = {"llama-own-loss": _OwnLoss, "llama-own-loss-plain": _PlainLoss}.get(name, Trainer)
    cls = base if cp is None else hf.with_context_parallel(base, cp_size=cp, layout=layout)
    trainer = cls(model=_model(model), args=_args(out, **{"include_num_input_tokens_seen": "all", **kw, **extra}),
                  train_dataset=train, eval_dataset=evals, data_collator=collator,
                  compute_metrics=_metrics if name == "llama-packed" else None)
    trainer.train()
    history = trainer.state.log_history
    result = {"losses": _losses(trainer), "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
              "tokens": [float(h["num_input_tokens_seen"]) for h in history if "loss" in h],
              "flos": [trainer.state.total_flos]}
    if evals is not None:
        result["eval"] = trainer.evaluate()
    return result


def _generate(out: str, cp: int | None, layout: str = "striped", **options) -> dict:
    """Seq2SeqTrainer's predict_with_generate on a decoder-only model: eval loss and greedy tokens (4 new)."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    model = _model("llama")
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    model.generation_config.max_new_tokens = 4
    model.config.use_cache = model.generation_config.use_cache = True  # generate() under CP decodes from a cache
    args = Seq2SeqTrainingArguments(output_dir=out, predict_with_generate=True, per_device_eval_batch_size=2,
                                    report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    cls = Seq2SeqTrainer if cp is None else hf.with_context_parallel(Seq2SeqTrainer, cp_size=cp, layout=layout,
                                                                     **options)
    got = {}

    def metrics(pred):
        got["predictions"], got["labels"] = pred.predictions.tolist(), pred.label_ids.tolist()
        return {}

    trainer = cls(model=model, args=args, eval_dataset=_rows(17, 3), data_collator=default_data_collator,
                  compute_metrics=metrics)
    got["eval_loss"] = trainer.evaluate()["eval_loss"]
    return got


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>",
                                   eos_token="<eos>")


def _sft(out: str, cp: int | None, bf16: bool = False, packing: bool = True, layout: str = "striped",
         **options) -> dict:
    """TRL's SFTTrainer with packing (bfd: padding-free rows, position ids restarting per document), or without
    (rows right-padded to the batch's longest, a 2-D attention mask). ``options``: with_context_parallel's."""
    from datasets import Dataset

    # unpacked: a learning rate at which the token accuracy of a partial eval batch's last row is not 0
    args = SFTConfig(output_dir=out, per_device_train_batch_size=2, max_steps=3, logging_steps=1, report_to=[],
                     save_strategy="no", learning_rate=1e-2 if packing else 1e-1, use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
                     packing=packing, max_length=23 if packing else 24, eval_packing=packing, per_device_eval_batch_size=2, bf16=bf16)
    data = Dataset.from_list([{"input_ids": d["input_ids"] + [1]} for d in _documents(12, 24)])
    evals = Dataset.from_list([{"input_ids": d["input_ids"] + [1]} for d in _documents(13, 12)])
    cls = SFTTrainer if cp is None else hf.with_context_parallel(SFTTrainer, cp_size=cp, layout=layout, **options)
    trainer = cls(model=_model("llama"), args=args, train_dataset=data, eval_dataset=evals,
                  processing_class=_tokenizer())
    trainer.train()
    accuracy = [h["mean_token_accuracy"] for h in trainer.state.log_history if "mean_token_accuracy" in h]
    result = {"losses": _losses(trainer), "accuracy": accuracy, "eval": trainer.evaluate(),
              "num_tokens": [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h],
              "planned_over": _planned_over(trainer)}
    if not packing:  # partial last batches (5 rows, 2 a batch): plain rows, prompt-completion rows
        five = [{"input_ids": d["input_ids"] + [1]} for d in _documents(13, 5)]
        result["eval-5"] = trainer.evaluate(eval_dataset=Dataset.from_list(five))
        completion = [{**d, "completion_mask": [0, 0] + [1] * (len(d["input_ids"]) - 2)} for d in five]
        trainer.completion_only_loss = True  # what TRL decides at init from a prompt-completion train set
        result["eval-5-completion"] = trainer.evaluate(eval_dataset=Dataset.from_list(completion))
    return result


def _sft_ragged(out: str, cp: int | None, layout: str = "striped") -> dict:
    """TRL's SFTTrainer unpacked on rows of 6..20 tokens, 4 a batch (right-padded to the batch's longest, then by CP
    to the layout's multiple), fp32: ``bf16=False`` explicitly, since SFTConfig defaults to bf16 autocast (CPU too),
    whose rounding differs between CP and CP=1 by ~1e-5 in the first loss (docs/trainer.md, "Precision")."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(21)
    rows = [{"input_ids": torch.randint(3, V, (int(torch.randint(6, 21, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(24)]
    args = SFTConfig(output_dir=out, per_device_train_batch_size=4, max_steps=3, logging_steps=1, report_to=[],
                     save_strategy="no", learning_rate=1e-2, use_cpu=True, disable_tqdm=True, seed=0, data_seed=0,
                     packing=False, max_length=24, bf16=False)
    cls = SFTTrainer if cp is None else hf.with_context_parallel(SFTTrainer, cp_size=cp, layout=layout)
    trainer = cls(model=_model("llama"), args=args, train_dataset=Dataset.from_list(rows), processing_class=_tokenizer())
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h[key] for h in logged] for key in ("loss", "grad_norm", "mean_token_accuracy", "num_tokens")}


def _env(rank: int, world: int) -> None:
    """What torchrun sets; accelerate reads it (the process group is up already)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


class _OneRankCollator:
    """Collates differently on rank 1: what the fingerprint check catches."""

    def __call__(self, features):
        batch = default_data_collator(features)
        if torch.distributed.get_rank() == 1:
            batch["input_ids"] = batch["input_ids"].flip(1)
        return batch


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(_rows(16, 4))


def _refusals(rank: int, world: int, out: str) -> list[str]:
    """Each case must raise ValueError on every rank (the caller checks both ranks' lists) and leave them in step."""
    raised = []

    def expect(match: str, fn) -> None:
        with pytest.raises(ValueError, match=match):
            fn()
        raised.append(match)

    rows = _rows(14, 4)
    build = lambda cls=Trainer, model="llama", data=rows, collator=default_data_collator, **kw: cls(  # noqa: E731
        model=_model(model), args=_args(out, **kw), train_dataset=data, data_collator=collator)
    cp2 = hf.with_context_parallel(Trainer, cp_size=2)
    expect("must divide the world size", lambda: build(hf.with_context_parallel(Trainer, cp_size=3)))
    expect("average_tokens_across_devices", lambda: build(cp2, average_tokens_across_devices=False))
    expect("label_smoothing_factor.*docs/trainer.md, 'Your own loss'", lambda: build(cp2, label_smoothing_factor=0.1))
    expect("batch_rebalance", lambda: build(cp2, train_sampling_strategy="batch_rebalance"))
    expect("striped layout makes every token a run", lambda: build(cp2, model="qwen3-next"))  # hybrids: headtail
    expect("different batches", lambda: build(cp2, collator=_OneRankCollator()).train())
    expect("dispatch_batches", lambda: build(cp2, data=_Stream(), max_steps=1).get_train_dataloader())
    def classifier():
        torch.manual_seed(0)
        return transformers.LlamaForSequenceClassification(LlamaConfig(**TINY, num_labels=2, pad_token_id=0))

    expect("not a causal language model", lambda: cp2(model=classifier(), args=_args(out), train_dataset=rows,
                                                      data_collator=default_data_collator))
    def evaluate_first():  # accelerate would train the model unwrapped: no gradient sum over the CP ranks
        trainer = cp2(model=_model("llama"), args=_args(out, max_steps=1), train_dataset=rows, eval_dataset=rows,
                      data_collator=default_data_collator)
        trainer.evaluate()
        trainer.train()

    expect("trains without DDP or FSDP", evaluate_first)
    dyn = lambda **kw: hf.with_context_parallel(Trainer, layout="documents", dynamic=True, **kw)  # noqa: E731
    expect("no data-parallel dimension", lambda: build(dyn(cp_size=2)))  # world 2 = cp_size: one replica
    latent = hf.with_context_parallel(Trainer, cp_size=2, kv_exchange="latent")  # MLA's latent rows: no MLA layer
    expect("kv_exchange='latent' sends multi-head latent attention's latent rows", lambda: build(latent))
    with pytest.raises(ValueError, match="dynamic=True .* needs layout='documents'; got layout='striped'"):
        hf.with_context_parallel(Trainer, cp_size=2, dynamic=True)
    with pytest.raises(ValueError, match="dynamic=True with sequence_tiling"):
        dyn(cp_size=2, sequence_tiling=True)
    with pytest.raises(ValueError, match="SFTTrainer .and its subclasses. is served"):
        hf.with_context_parallel(trl.DPOTrainer, cp_size=2)
    with pytest.raises(TypeError, match="unknown options"):
        hf.with_context_parallel(Trainer, cp_size=2, window=4)
    with pytest.raises(TypeError, match="Trainer or a subclass"):
        hf.with_context_parallel(object, cp_size=2)
    # still in step: a good run after the refusals trains
    assert len(_losses(_run_once(out))) == 1
    return raised


def _run_once(out: str):
    trainer = hf.with_context_parallel(Trainer, cp_size=2)(model=_model("llama"), args=_args(out, max_steps=1),
                                                          train_dataset=_rows(15, 4), data_collator=default_data_collator)
    trainer.train()
    return trainer


def _cp_ranks(rank: int, world: int, tmp: str) -> dict:
    _env(rank, world)
    out = tempfile.mkdtemp(dir=tmp)
    results = {name: _train(name, out, world) for name in CASES}
    results["sft-packed"] = _sft(out, world)
    results["sft-bf16"] = _sft(out, world, bf16=True)  # TRL's default: bf16 autocast around fp32 weights
    results["sft-padded"] = _sft(out, world, packing=False)
    results["generate"] = _generate(out, world)
    results.update(_documents_runs(out, world))
    # a checkpoint at save_steps: resumed at CP=1 by the reference ranks
    ckpt = os.path.join(tmp, "ckpt")
    results["save"] = _train("llama-packed", ckpt, world, max_steps=4, save_strategy="steps", save_steps=2)
    with open(os.path.join(ckpt, "checkpoint-2", "config.json")) as f:
        config = json.load(f)
    results["saved_attn"] = [config.get(k) for k in ("attn_implementation", "_attn_implementation")]
    resumed = hf.with_context_parallel(Trainer, cp_size=world)(  # at CP=2 too: the replica's batches skipped
        model=_model("llama"), args=_args(tempfile.mkdtemp(dir=tmp), max_steps=4), data_collator=DataCollatorWithFlattening(),
        train_dataset=CASES["llama-packed"][1])
    resumed.train(resume_from_checkpoint=os.path.join(ckpt, "checkpoint-2"))
    results["resumed"] = _losses(resumed)
    results["refused"] = _refusals(rank, world, out)
    return results


# layout="documents" (one plan per batch, built by the collator): name -> the CP=1 reference it must log
DOCUMENTS = {"llama-packed-documents": "llama-packed", "llama-rows-documents": "llama-rows",
             "mistral-window-documents": "mistral-window-packed", "sft-packed-documents": "sft-packed",
             "sft-padded-documents": "sft-padded"}


def _documents_runs(out: str, world: int) -> dict:
    """The layout="documents" runs: packed rows (the collator in a dataloader worker for one: the plan crosses
    its queue), plain rows (one document a row), Mistral's window, TRL's packing and padded rows (each pad token
    a document of the plan), predict_with_generate (the
    loss with the plan, generate() prefilling striped)."""
    return {"llama-packed-documents": _train("llama-packed", out, world, layout="documents", dataloader_num_workers=1),
            "llama-rows-documents": _train("llama-rows", out, world, layout="documents"),
            "mistral-window-documents": _train("mistral-window-packed", out, world, layout="documents"),
            "sft-packed-documents": _sft(out, world, layout="documents"),
            "sft-padded-documents": _sft(out, world, packing=False, layout="documents"),
            "generate-documents": _generate(out, world, layout="documents")}


def _reference_rank(rank: int, world: int, tmp: str) -> dict:
    _env(rank, world)
    out = tempfile.mkdtemp(dir=tmp)
    results = {name: _train(name, out, None) for name in CASES}
    results["sft-packed"] = _sft(out, None)
    results["sft-bf16"] = _sft(out, None, bf16=True)
    results["sft-padded"] = _sft(out, None, packing=False)
    results["generate"] = _generate(out, None)
    results["save"] = _train("llama-packed", out, None, max_steps=4)
    # resume the CP=2 run's checkpoint-2 at CP=1 (the CP class at cp_size=1: one process)
    resumed = hf.with_context_parallel(Trainer, cp_size=1)(
        model=_model("llama"), args=_args(os.path.join(tmp, "ckpt"), max_steps=4, save_strategy="no"),
        train_dataset=CASES["llama-packed"][1], data_collator=DataCollatorWithFlattening())
    resumed.train(resume_from_checkpoint=os.path.join(tmp, "ckpt", "checkpoint-2"))
    results["resumed"] = _losses(resumed)
    return results


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        cp = run_ranks(2, _cp_ranks, tmp, timeout=600)
        ref = run_ranks(1, _reference_rank, tmp, timeout=600)[0]
    return cp, ref


def _close(a: list[float], b: list[float], what: str) -> None:
    assert len(a) == len(b) and len(a) > 0, (what, a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= TOL * max(1.0, abs(y)), f"{what}: CP {a} vs CP=1 {b}"


@pytest.mark.parametrize("name", list(CASES))
def test_trainer_cp2_logs_cp1_losses(runs, name):
    cp, ref = runs
    for rank in (0, 1):  # every rank logs the same (the mean over ranks)
        for key in ("losses", "grad_norm", "tokens", "flos"):  # the counts: CP's own padding left out
            _close(cp[rank][name][key], ref[name][key], f"{name} {key} rank {rank}")
        if "eval" in ref[name]:
            for key in ("eval_loss", "eval_target_logit", "eval_rows"):
                if key in ref[name]["eval"]:
                    _close([cp[rank][name]["eval"][key]], [ref[name]["eval"][key]], f"{name} {key}")


@pytest.mark.parametrize("name", list(DOCUMENTS))
def test_trainer_documents_layout_logs_cp1_losses(runs, name):
    """with_context_parallel(..., layout="documents"): the collator's plan of each batch, used by every layer of
    the step, logs the unchanged class's CP=1 losses, grad norms, token counts and eval metrics."""
    cp, ref = runs
    want = ref[DOCUMENTS[name]]
    for rank in (0, 1):
        got = cp[rank][name]
        keys = ("losses", "accuracy") if name.startswith("sft") else ("losses", "tokens", "flos")
        for key in keys:
            _close(got[key], want[key], f"{name} {key} rank {rank}")
        if "grad_norm" in want:  # after Adam's first step (each element's update about lr * sign(g)) the gradients'
            # rounding shows in the later norms at ~2e-5 for every layout here; the first is CP=1's to 2e-5
            _close(got["grad_norm"][:1], want["grad_norm"][:1], f"{name} grad_norm rank {rank}")
            assert all(abs(x - y) <= 1e-4 * y for x, y in zip(got["grad_norm"], want["grad_norm"])), (name, got, want)
        for evals in ("eval", "eval-5", "eval-5-completion"):
            for key in ("eval_loss", "eval_target_logit", "eval_rows", "eval_mean_token_accuracy"):
                if key in want.get(evals, {}):
                    _close([got[evals][key]], [want[evals][key]], f"{name} {evals} {key} rank {rank}")


@pytest.mark.parametrize("case", ["sft-packed", "sft-padded"])
def test_trl_sft_cp2_matches_cp1(runs, case):
    cp, ref = runs
    for rank in (0, 1):
        got, want = cp[rank][case], ref[case]
        _close(got["losses"], want["losses"], f"SFTTrainer {case} loss")
        _close(got["accuracy"], want["accuracy"], f"SFTTrainer {case} mean_token_accuracy")
        assert got["num_tokens"] == want["num_tokens"] and want["num_tokens"], (case, got, want)  # CP's padding out
        for evals in ("eval", "eval-5", "eval-5-completion"):
            if evals in want:
                for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
                    _close([got[evals][key]], [want[evals][key]], f"SFTTrainer {case} {evals} {key}")


def test_trl_sft_bf16_autocast(runs):
    """bf16 autocast (TRL's default): the attention runs in bf16 as SDPA does under autocast; bf16's 3 digits."""
    cp, ref = runs
    for rank in (0, 1):
        got, want = cp[rank]["sft-bf16"]["losses"], ref["sft-bf16"]["losses"]
        assert len(got) == len(want) == 3
        for x, y in zip(got, want):
            assert abs(x - y) <= 1e-2 * abs(y), (got, want)


@pytest.mark.parametrize("case", ["generate", "generate-documents"])
def test_seq2seq_predict_with_generate(runs, case):
    """Seq2SeqTrainer(predict_with_generate=True): the eval loss from the shards, the greedy tokens generated under
    CP (ring prefill, sharded cache) and the padded labels equal CP=1's; also under layout="documents"."""
    cp, ref = runs
    for rank in (0, 1):
        got, want = cp[rank][case], ref["generate"]
        assert got["predictions"] == want["predictions"] and got["labels"] == want["labels"], rank
        assert len(want["predictions"]) == 3 and len(want["predictions"][0]) > N  # the prompts and new tokens
        _close([got["eval_loss"]], [want["eval_loss"]], "Seq2SeqTrainer eval_loss")


def test_checkpoint_at_save_steps_resumes_at_another_cp_size(runs):
    """Saved at CP=2 after 2 of 4 steps, resumed at CP=1 (and at CP=2): steps 3-4 log what the uninterrupted runs
    log."""
    cp, ref = runs
    _close(cp[0]["save"]["losses"], ref["save"]["losses"], "CP=2 run with saves")
    resumed = ref["resumed"]  # the log history restored from the checkpoint (steps 1-2), then steps 3-4
    _close(resumed[:2], cp[0]["save"]["losses"][:2], "history restored from the CP=2 checkpoint")
    _close(resumed[2:], ref["save"]["losses"][2:], "resumed at CP=1")
    _close(cp[0]["resumed"][2:], ref["save"]["losses"][2:], "resumed at CP=2")
    assert "cp_dtensor" not in cp[0]["saved_attn"], f"the saved config names the CP attention: {cp[0]['saved_attn']}"


def test_refusals_raise_on_every_rank(runs):
    cp, _ = runs
    assert cp[0]["refused"] == cp[1]["refused"] and len(cp[0]["refused"]) == 11, cp[0]["refused"]


class _HoleOnReplica1:
    """A padding mask with a hole inside a row, on data-parallel replica 1 only (ranks 2 and 3 of dp=2 x cp=2):
    an error that depends on one replica's data."""

    def __call__(self, features):
        batch = default_data_collator(features)
        mask = torch.ones_like(batch["input_ids"])
        if torch.distributed.get_rank() // 2 == 1:
            mask[0, 5] = 0
        batch["attention_mask"] = mask
        return batch


def _skewed(seed: int, count: int = 16) -> list[dict]:
    """Documents of very unequal lengths: 2..5 tokens, every fourth (at random) 24..40: the rows a step's replicas
    draw differ in work several-fold."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(24, 41, (1,), generator=g)) if torch.rand(1, generator=g) < 0.25
               else int(torch.randint(2, 6, (1,), generator=g)) for _ in range(count)]
    return [{"input_ids": torch.randint(2, V, (n,), generator=g).tolist()} for n in lengths]


def _skewed_run(tmp: str, cp: int | None, dynamic: bool = False, evaluate: bool = False, kv_exchange: str = "ring",
                **kw) -> dict:
    """Train on the skewed packed rows (``cp`` None: the unchanged Trainer); with ``evaluate``, eval_strategy every
    2 steps, then evaluate() and predict() on skewed packed rows (a partial last batch: 10 documents, 8 a step)."""
    cls = Trainer if cp is None else hf.with_context_parallel(Trainer, cp_size=cp, layout="documents", dynamic=dynamic,
                                                              kv_exchange=kv_exchange)
    evals = dict(eval_dataset=_skewed(22, 10), compute_metrics=_metrics) if evaluate else {}
    if evaluate:
        kw.update(eval_strategy="steps", eval_steps=2)
    trainer = cls(model=_model("llama"), train_dataset=_skewed(21), data_collator=DataCollatorWithFlattening(),
                  args=_args(tempfile.mkdtemp(dir=tmp), include_num_input_tokens_seen="all", **kw), **evals)
    before = None  # predict() on the initial weights, the same in every run (a trainer of its own: the Trainer's
    if evaluate:  # predict() before train() at dp > 1 changes the training, without CP too)
        before = cls(model=_model("llama"), args=_args(tempfile.mkdtemp(dir=tmp)),
                     data_collator=DataCollatorWithFlattening()).predict(_skewed(23, 10)).predictions
    trainer.train()
    history = trainer.state.log_history
    out = {"losses": _losses(trainer), "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
           "tokens": [float(h["num_input_tokens_seen"]) for h in history if "loss" in h], "before": before,
           "planned_over": _planned_over(trainer)}
    if evaluate:
        out["during"] = [(h["step"], h["eval_loss"], h["eval_target_logit"]) for h in history if "eval_loss" in h]
        out["eval"] = trainer.evaluate()
        pred = trainer.predict(_skewed(23, 10))
        out["predict"] = {"predictions": pred.predictions, "label_ids": pred.label_ids, **pred.metrics}
    return out


def _planned_over(trainer) -> int | None:
    """How many ranks the last training step's plan spans (the grid's under dynamic=True, P without)."""
    plan = getattr(getattr(trainer, "_cp_meta", None), "plan", None)
    return None if plan is None else plan.cp_size


def _dynamic_runs(tmp: str, cp: int) -> dict:
    """dynamic=True and the static documents layout on the same skewed packed rows (one row a replica a micro-batch;
    with gradient accumulation two), evaluating as they train; TRL's packed SFTTrainer; a padding hole on replica 1
    under dynamic=True."""
    out = {}
    for name, kw in (("plain", {"evaluate": True}),
                     ("accumulate", dict(gradient_accumulation_steps=2, per_device_train_batch_size=2))):
        for dynamic in (False, True):
            out[f"{name}-{'dynamic' if dynamic else 'static'}"] = _skewed_run(tmp, cp, dynamic, **kw)
    for dynamic in (False, True):
        out[f"sft-{'dynamic' if dynamic else 'static'}"] = _sft(tempfile.mkdtemp(dir=tmp), cp, layout="documents",
                                                                 dynamic=dynamic)
        out[f"generate-{'dynamic' if dynamic else 'static'}"] = _generate(tempfile.mkdtemp(dir=tmp), cp,
                                                                          layout="documents", dynamic=dynamic)
    trainer = hf.with_context_parallel(Trainer, cp_size=cp, layout="documents", dynamic=True)(
        model=_model("llama"), args=_args(tempfile.mkdtemp(dir=tmp), max_steps=1), train_dataset=_rows(17, 8),
        data_collator=_HoleOnReplica1())
    try:
        trainer.train()
        out["dynamic-error"] = None
    except ValueError as e:
        out["dynamic-error"] = str(e)
    return out


def _dp_cp(rank: int, world: int, tmp: str, cp: int) -> dict:
    _env(rank, world)
    out = {name: _train(name, tempfile.mkdtemp(dir=tmp), cp if cp > 1 else None)
           for name in ("llama-packed", "llama-accumulate", "llama-own-loss", "llama-own-loss-plain")}
    out["sft-padded"] = _sft(tempfile.mkdtemp(dir=tmp), cp if cp > 1 else None, packing=False)
    for layout in ("striped", "headtail") if cp > 1 else ("striped",):  # CP=1: one reference for both
        out[f"sft-ragged-{layout}"] = _sft_ragged(tempfile.mkdtemp(dir=tmp), cp if cp > 1 else None, layout)
    if cp > 1:  # every rank raises, none waits in the gradient all-reduce (the harness's timeout bounds a hang)
        trainer = hf.with_context_parallel(Trainer, cp_size=cp)(
            model=_model("llama"), args=_args(tempfile.mkdtemp(dir=tmp), max_steps=1), train_dataset=_rows(17, 8),
            data_collator=_HoleOnReplica1())
        try:
            trainer.train()
            out["error"] = None
        except (ValueError, RuntimeError) as e:
            out["error"] = [type(e).__name__, str(e)]
        out["dynamic"] = _dynamic_runs(tmp, cp)
    else:  # the CP=1 references of the dynamic runs' evaluation and SFT (dp = 2, the unchanged classes)
        out["dynamic"] = {"plain": _skewed_run(tmp, None, evaluate=True), "sft": _sft(tempfile.mkdtemp(dir=tmp), None),
                          "generate": _generate(tempfile.mkdtemp(dir=tmp), None)}
    return out


@slow("6 ranks in two spawns: ~30 s, ~45 s with dynamic CP's evaluation and SFTTrainer")
def test_data_parallel_replicas_of_cp_ranks():
    """dp=2 x cp=2 on 4 ranks logs what dp=2 without CP (the unchanged Trainer on 2 ranks) logs: the samplers
    count replicas, not ranks; the evaluation gathers each replica's rows once (14 eval rows, 8 a step: the last
    step's remainder, 6, is more than one replica's batch); compute_loss overrides; TRL's eval metrics with a
    partial last batch. dynamic=True (each step's global batch planned over the 4 ranks) logs the static
    documents layout's losses, grad norms and token counts on skewed packed rows, with gradient accumulation
    too; its evaluation (eval_strategy, evaluate(), predict()) gives the static documents trainer's eval_loss,
    metrics and predictions in each replica's row order, and CP=1's (dp = 2), predict_with_generate's tokens
    too; TRL's packed SFTTrainer logs the
    static documents run's losses, token accuracy, num_tokens and eval metrics, and CP=1's; TRL unpacked on ragged
    rows, 4 a batch, fp32 (striped, headtail): the first loss to 1e-6; a replica's padding hole raises on every
    rank before any token moves."""
    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(4, _dp_cp, tmp, 2, timeout=900)
        want = run_ranks(2, _dp_cp, tmp, 1, timeout=900)
    ref = want[0].pop("dynamic")
    want[1].pop("dynamic")
    for rank in range(4):
        dyn = got[rank].pop("dynamic")
        assert "rank 2: with_context_parallel(dynamic=True) takes packed rows" in dyn.pop("dynamic-error"), rank
        for case in ("plain", "accumulate", "sft"):
            assert (dyn[f"{case}-dynamic"]["planned_over"], dyn[f"{case}-static"]["planned_over"]) == (4, 2), case
            for key in ("losses", "grad_norm", "tokens", "accuracy", "num_tokens"):
                if key not in dyn[f"{case}-static"]:
                    continue
                a, b = dyn[f"{case}-dynamic"][key], dyn[f"{case}-static"][key]
                assert len(a) == len(b) == 3, (case, key, a, b)
                assert all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b)), (case, key, rank, a, b)
        _close(dyn["plain-static"]["losses"], ref["plain"]["losses"], f"dp x cp documents, skewed rows, rank {rank}")
        for layout in ("dynamic", "static"):
            _same_evaluation(dyn[f"plain-{layout}"], ref["plain"], TOL, f"{layout} vs CP=1 rank {rank}")
            sft, sft_ref = dyn[f"sft-{layout}"], ref["sft"]
            _close(sft["losses"], sft_ref["losses"], f"SFTTrainer {layout} vs CP=1 rank {rank}")
            assert sft["num_tokens"] == sft_ref["num_tokens"], (layout, rank, sft["num_tokens"], sft_ref["num_tokens"])
            for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
                _close([sft["eval"][key]], [sft_ref["eval"][key]], f"SFTTrainer {layout} {key} vs CP=1 rank {rank}")
                _close([dyn["sft-dynamic"]["eval"][key]], [dyn["sft-static"]["eval"][key]], f"SFTTrainer {key}")
            gen, gen_ref = dyn[f"generate-{layout}"], ref["generate"]  # Seq2SeqTrainer's predict_with_generate
            assert gen["predictions"] == gen_ref["predictions"] and gen["labels"] == gen_ref["labels"], (layout, rank)
            _close([gen["eval_loss"]], [gen_ref["eval_loss"]], f"Seq2SeqTrainer {layout} eval_loss rank {rank}")
        _same_evaluation(dyn["plain-dynamic"], dyn["plain-static"], 1e-5, f"dynamic vs static rank {rank}")
        before = dyn["plain-dynamic"]["before"], dyn["plain-static"]["before"]  # the same code on the same weights
        assert before[0].shape == before[1].shape and (before[0] == before[1]).all(), rank
        err = np.abs(before[0] - ref["plain"]["before"]).max() / np.abs(ref["plain"]["before"]).max()
        assert err <= TOL, (rank, err)
    for rank in range(4):  # one replica's data error: its ranks raise it, the other replica's ranks name it
        kind, message = got[rank].pop("error")
        if rank // 2 == 1:
            assert kind == "ValueError" and "padding inside" in message, (rank, message)
        else:
            assert kind == "RuntimeError" and "data-parallel replica 1" in message and "padding inside" in message, (
                rank, message)
    ragged = want[0].pop("sft-ragged-striped")
    for rank in range(4):  # TRL unpacked, ragged rows 4 a batch, fp32: the first loss to rounding, then TOL
        for layout in ("striped", "headtail"):
            run, what = got[rank].pop(f"sft-ragged-{layout}"), f"SFTTrainer ragged rows {layout} rank {rank}"
            assert abs(run["loss"][0] - ragged["loss"][0]) <= 1e-6 * ragged["loss"][0], (what, run, ragged)
            for key in ("loss", "grad_norm", "mean_token_accuracy"):
                _close(run[key], ragged[key], f"{what} {key}")
            assert run["num_tokens"] == ragged["num_tokens"], (what, run, ragged)
    sft = [r.pop("sft-padded") for r in got], want[0].pop("sft-padded")
    for rank in range(4):  # TRL's metrics of partial last batches: replica 0's rows (and accelerate's repeats)
        for evals in ("eval", "eval-5", "eval-5-completion"):
            for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
                _close([sft[0][rank][evals][key]], [sft[1][evals][key]], f"dp x cp SFTTrainer {evals} {key}")
    for name in want[0]:
        for rank in range(4):
            for key in ("losses", "grad_norm", "tokens", "flos"):
                _close(got[rank][name][key], want[0][name][key], f"dp x cp {name} {key} rank {rank}")
            for key in ("eval_loss", "eval_target_logit", "eval_rows"):
                if key in want[0][name].get("eval", {}):
                    _close([got[rank][name]["eval"][key]], [want[0][name]["eval"][key]], f"dp x cp {name} {key}")


def _same_evaluation(got: dict, want: dict, tol: float, what: str) -> None:
    """eval_strategy's evaluations, evaluate()'s metrics, predict()'s loss, logits and labels (row for row)."""
    assert [s for s, *_ in got["during"]] == [s for s, *_ in want["during"]] == [2, 3], (what, got["during"])
    for (_, *a), (_, *b) in zip(got["during"], want["during"]):
        _close(a, b, f"{what}: eval_strategy's eval_loss, eval_target_logit")
    for key in ("eval_loss", "eval_target_logit", "eval_rows"):
        _close([got["eval"][key]], [want["eval"][key]], f"{what}: evaluate() {key}")
    g, w = got["predict"], want["predict"]
    for key in ("test_loss", "test_target_logit", "test_rows"):
        _close([g[key]], [w[key]], f"{what}: predict() {key}")
    assert g["label_ids"].shape == w["label_ids"].shape and (g["label_ids"] == w["label_ids"]).all(), what
    assert g["predictions"].shape == w["predictions"].shape, (what, g["predictions"].shape, w["predictions"].shape)
    err = np.abs(g["predictions"] - w["predictions"]) / np.maximum(1.0, np.abs(w["predictions"]))
    assert err.max() <= tol, f"{what}: predict() logits differ by {err.max():.2e} (relative)"


def _cp3(rank: int, world: int, tmp: str) -> dict:
    _env(rank, world)
    return {name: _train(name, tempfile.mkdtemp(dir=tmp), world)
            for name in ("llama-packed", "llama-accumulate", "mistral-window-packed", "qwen3-next-hybrid")}


@slow("CP=3: 3 ranks")
def test_trainer_cp3_logs_cp1_losses(runs):
    """P = 3: rows padded to multiples of 3 (striped) and 6 (headtail)."""
    _, ref = runs
    with tempfile.TemporaryDirectory() as tmp:
        got = run_ranks(3, _cp3, tmp, timeout=900)
    for name in got[0]:
        for rank in range(3):
            _close(got[rank][name]["losses"], ref[name]["losses"], f"CP=3 {name} rank {rank}")
            if "eval" in ref[name]:
                _close([got[rank][name]["eval"]["eval_loss"]], [ref[name]["eval"]["eval_loss"]], f"CP=3 {name} eval")


SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts")


def _torchrun(nproc: int, script: str, *args: str) -> list[float]:
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(SCRIPTS, "examples", script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return [float(x) for x in re.findall(r"^step \d+: (?:eval_)?loss ([0-9.]+)", r.stdout, re.M)]


@exhaustive("the examples under torchrun: ~50 s")
@pytest.mark.parametrize("script", ["trainer_example.py", "trl_sft_example.py"])
def test_examples_under_torchrun(script, tmp_path):
    """The scripts as documented: CP=2 on 2 processes prints the losses the unchanged class prints on 1."""
    got = _torchrun(2, script, "--steps", "2", "--out", str(tmp_path / "cp2"))
    want = _torchrun(1, script, "--steps", "2", "--cp", "1", "--out", str(tmp_path / "cp1"))
    _close(got, want, script)


@exhaustive("scripts/benchmarks/bench_trainer.py at a tiny length: ~17 s")
def test_bench_trainer_runs(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "trainer.json"
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "benchmarks", "bench_trainer.py"), "--seq-len", "256", "--steps", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(out.read_text())["rows"][0]
    _close(row["cp2"]["losses"], row["cp1"]["losses"], "bench_trainer CP=2 vs CP=1")
