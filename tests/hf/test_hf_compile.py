"""torch.compile of a Hugging Face model under CP (Note [Compiled HF models] in cp_dtensor/hf/attention.py):
the model compiles around the eager attention and mask functions, and its loss and gradients equal the
plain model's at CP=1; ``fullgraph=True`` raises naming why. Before the fix the traced mask-rule check saw
an anonymous function and refused every model."""

from __future__ import annotations

import pytest
import torch
from _tiers import slow
from torch.distributed.device_mesh import init_device_mesh

from _dist import run_ranks

pytest.importorskip("transformers")

import test_hf_tiling as tiling  # noqa: E402  (its tiny models, batch and CP=1 reference)

from cp_dtensor.core.batch import shard_batch  # noqa: E402
from cp_dtensor.doors import reduce_gradients  # noqa: E402
from cp_dtensor.hf import attention as hf  # noqa: E402


def _compiled(rank: int, world: int, backend: str, cases) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    tokens, positions, labels = tiling._batch()
    shifted = hf.shift_labels(labels)
    count = (shifted != -100).sum()
    done = []
    for name, layout, tile in cases:
        ref = tiling._reference(name, num_items=True)
        model = hf.apply_context_parallel(tiling._model(name), mesh, layout=layout, sequence_tiling=tile)
        tok, pos, lab = shard_batch((tokens, positions, shifted), mesh, layout=layout)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        res = compiled(input_ids=tok, position_ids=pos, labels=lab, shift_labels=lab, num_items_in_batch=count,
                       use_cache=False)
        res.loss.backward()
        reduce_gradients(model, mesh)
        total = res.loss.detach().clone()
        torch.distributed.all_reduce(total)
        tiling._compare(f"compiled {backend} {name} {layout} tile={tile}", total.item(), tiling._grads(model), ref)
        done.append(name)
    torch._dynamo.reset()
    model = hf.apply_context_parallel(tiling._model("llama"), mesh)
    tok, pos, lab = shard_batch((tokens, positions, shifted), mesh)
    with pytest.raises(Exception, match="run eagerly"):
        torch.compile(model, backend=backend, fullgraph=True)(input_ids=tok, position_ids=pos, labels=lab,
                                                              shift_labels=lab, use_cache=False)
    return done


def test_compiled_hf_model_under_cp_equals_plain_cp1():
    cases = [("llama", "striped", None), ("gpt-oss", "headtail", tiling.TILE)]
    assert run_ranks(2, _compiled, "aot_eager", cases) == [["llama", "gpt-oss"]] * 2


@slow("Inductor compiles of a tiny model on two ranks (~40 s)")
def test_inductor_compiled_hf_model_under_cp_equals_plain_cp1():
    assert run_ranks(2, _compiled, "inductor", [("llama", "striped", tiling.TILE)]) == [["llama"]] * 2


@slow("Trainer runs with torch_compile=True at CP=2 and CP=1 (~25 s)")
def test_trainer_torch_compile_logs_plain_cp1_losses(tmp_path, monkeypatch):
    """with_context_parallel(Trainer, sequence_tiling=3) and TrainingArguments(torch_compile=True): the losses
    and evaluation of the plain, uncompiled Trainer at CP=1 (test_hf_tiling's run)."""
    import transformers

    plain_args = transformers.TrainingArguments

    def compiled_args(*args, **kwargs):
        return plain_args(*args, **kwargs, torch_compile=True, torch_compile_backend="aot_eager")

    plain = run_ranks(1, tiling._trainer_run, str(tmp_path), None, timeout=300)[0]
    monkeypatch.setattr(transformers, "TrainingArguments", compiled_args)  # the forked ranks inherit it
    compiled = run_ranks(2, tiling._trainer_run, str(tmp_path), 3, timeout=300)
    assert compiled[0] == compiled[1]
    for a, b in zip(compiled[0]["losses"] + compiled[0]["eval"], plain["losses"] + plain["eval"]):
        assert abs(a - b) <= 2e-5 * abs(b), (compiled[0], plain)
