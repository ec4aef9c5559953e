"""The MoE router's load-balancing loss under CP (``output_router_logits=True``; Note [Router loss under CP] in
hf/router.py): transformers' Trainer at CP=2 logs the unchanged Trainer's CP=1 losses and grad norms over 4 steps
for Mixtral (fixed rows and packed rows; Qwen3-MoE and gpt-oss in the slow tier), with a router coefficient of 1
(the router term a large part of the loss); one forward's ``aux_loss`` shares sum to CP=1's with a padding mask
(only its 1 tokens count). A model without CP in the same process still computes transformers' own loss.

One spawn of 2 ranks runs every CP case, then one of 1 rank every reference."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from _tiers import SLOW

from _dist import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
transformers.logging.set_verbosity_error()

from transformers import (  # noqa: E402
    DataCollatorWithFlattening,
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from cp_dtensor import hf  # noqa: E402

V, N = 64, 16
TOL = 1e-4  # the bound, relative (fp32; the ring and the all-reduce sum in another order)
TINY = dict(vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, use_cache=False, output_router_logits=True,
            router_aux_loss_coef=1.0, num_experts_per_tok=2)


def _model(name: str):
    torch.manual_seed(0)
    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**TINY, num_local_experts=4, attn_implementation="sdpa"))
    if name == "qwen3-moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, num_experts=4, moe_intermediate_size=16, head_dim=8,
                                                  attn_implementation="sdpa"))
    if name == "gpt-oss":
        return GptOssForCausalLM(GptOssConfig(**TINY, num_local_experts=4, head_dim=8, sliding_window=3,
                                              attn_implementation="eager"))
    raise KeyError(name)


def _rows(seed: int, count: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(0, V, (N,), generator=g).tolist()), "labels": list(ids)}
            for _ in range(count)]


def _documents(seed: int, count: int = 20) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(2, V, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(count)]


CASES = {  # name -> (model, data, collator); Qwen3-MoE's and gpt-oss's Trainer runs in the slow tier (their
    # forward and gradients under CP are the default tier's: tests/hf/test_hf_served.py::test_router_loss_served_under_cp)
    "mixtral-rows": ("mixtral", _rows(1), default_data_collator),
    "mixtral-packed": ("mixtral", _documents(2), DataCollatorWithFlattening()),
    **({"qwen3-moe-rows": ("qwen3-moe", _rows(3), default_data_collator),
        "gpt-oss-rows": ("gpt-oss", _rows(4), default_data_collator)} if SLOW else {}),
}


def _train(name: str, out: str, cp: int | None) -> dict:
    model, data, collator = CASES[name]
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=4, logging_steps=1, report_to=[],
                             save_strategy="no", learning_rate=1e-2, use_cpu=True, disable_tqdm=True, seed=0, data_seed=0)
    cls = Trainer if cp is None else hf.with_context_parallel(Trainer, cp_size=cp)
    trainer = cls(model=_model(model), args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    history = trainer.state.log_history
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h]}


def _forward(world: int) -> dict:
    """One Mixtral forward on a left-padded batch: aux_loss (the sum of the ranks' shares)."""
    model = _model("mixtral")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, :5] = 0  # left padding: transformers counts only the mask's 1 tokens
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    labels = ids.masked_fill(mask == 0, -100)
    shift = hf.shift_labels(labels)
    count = int((shift != -100).sum())
    if world == 1:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
        return {"aux": float(out.aux_loss), "loss": float(out.loss)}
    from torch.distributed.device_mesh import init_device_mesh

    from cp_dtensor import shard_batch

    mesh = init_device_mesh("cpu", (world,))
    model = hf.apply_context_parallel(model, mesh)
    tok, m, p, lab = shard_batch((ids, mask, pos, shift), mesh)
    out = model(input_ids=tok, attention_mask=m, position_ids=p, labels=lab, shift_labels=lab,
                num_items_in_batch=torch.tensor(count))
    every = [torch.zeros(2) for _ in range(world)]
    torch.distributed.all_gather(every, torch.tensor([float(out.aux_loss), float(out.loss)]))
    total = sum(every)
    # a model without CP in the same process: transformers' own function, unchanged
    plain = _model("mixtral")(input_ids=ids, attention_mask=mask, position_ids=pos, labels=labels)
    return {"aux": float(total[0]), "loss": float(total[1]), "plain_aux": float(plain.aux_loss)}


def _env(rank: int, world: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _ranks(rank: int, world: int, tmp: str) -> dict:
    _env(rank, world)
    out = tempfile.mkdtemp(dir=tmp)
    results = {name: _train(name, out, None if world == 1 else world) for name in CASES}
    results["forward"] = _forward(world)
    return results


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        cp = run_ranks(2, _ranks, tmp, timeout=600)
        ref = run_ranks(1, _ranks, tmp, timeout=600)[0]
    return cp, ref


def _close(a, b, what: str) -> None:
    assert len(a) == len(b) and len(a) > 0, (what, a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= TOL * max(1.0, abs(y)), f"{what}: CP {a} vs CP=1 {b}"


@pytest.mark.parametrize("name", list(CASES))
def test_router_loss_trainer_cp2_equals_cp1(runs, name):
    cp, ref = runs
    for rank in (0, 1):
        for key in ("losses", "grad_norm"):
            _close(cp[rank][name][key], ref[name][key], f"{name} {key} rank {rank}")


def test_router_loss_forward_shares_sum_to_cp1(runs):
    cp, ref = runs
    for rank in (0, 1):
        _close([cp[rank]["forward"]["aux"]], [ref["forward"]["aux"]], f"aux rank {rank}")
        assert abs(cp[rank]["forward"]["plain_aux"] - ref["forward"]["aux"]) < 1e-6  # the plain model: transformers'
