"""Validation under cp_dtensor's CP (cp_dtensor/titan/validate.py, Note [Validation under CP]).

Default tier, in process on 2 gloo ranks: ``RingValidator.validate`` on a per-token model (logits of a
token depend on that token only, so the shards' logits are the full sequence's) with labels ignored
unevenly across the CP shards, against a formula: the full-sequence mean cross entropy in float64,
averaged over the validation batches. torchtitan 0.2.2's own ``validate`` on the same batches is off
by the shards' token counts (the bug the plugin fixes; measured below).

Slow tier, end to end: ``[validation] enable = true`` under ``python -m cp_dtensor.titan.train``;
the validation losses at CP = 2 (striped) equal CP = 1's, whose validator is torchtitan's own, to
rel 2e-5 (the log prints 4 decimals: <= 1.3e-5 relative at these losses). qwen3 keeps its RoPE table
in ``rope_cache``, so torchtitan's validator cannot run it under CP at all; deepseek_v3 (MLA, flex
documents: the masks are sharded in the validator too) has no validator in torchtitan.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from types import SimpleNamespace

import pytest
from _tiers import exhaustive, slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

import torch  # noqa: E402

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _dist import run_ranks  # noqa: E402
from _titan_run import REPO, torchrun  # noqa: E402  the one launcher

CONFIGS = REPO / "titan_configs"
V, D, B, N, IGNORE = 32, 8, 2, 16, -100


class _PerToken(torch.nn.Module):
    """logits[b, s] = f(inputs[b, s]): a model whose shards' logits are the full sequence's logits."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(V, D, generator=g))
        self.out = torch.nn.Parameter(torch.randn(D, V, generator=g))
        self.freqs_cis = torch.zeros(N, 2)  # only so that torchtitan's own validate can run (it reads it)

    def get_attention_masks(self, **kwargs):
        return None

    def forward(self, inputs, positions=None, attention_masks=None):
        return self.emb[inputs] @ self.out  # [B, S, V]


def _batches() -> list[tuple[dict, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(2):
        inputs = torch.randint(0, V, (B, N), generator=g)
        labels = torch.randint(0, V, (B, N), generator=g)
        labels[0, 0::2][: 5 + i] = IGNORE  # striped: even positions are rank 0's, so the shards differ in count
        labels[1, 1:4] = IGNORE
        out.append(({"input": inputs}, labels))
    return out


def _reference() -> float:
    model = _PerToken().double()
    per_batch = [torch.nn.functional.cross_entropy(model(x["input"]).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
                 for x, y in _batches()]
    return float(torch.stack(per_batch).mean())


def _validate_on_ranks(rank: int, world: int, which: str) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.components.validate import Validator

    from cp_dtensor.titan.v02.spec import _bind_batch_sharding
    from cp_dtensor.titan.v02.validate import RingValidator

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    _bind_batch_sharding("striped")  # what the plugin's parallelize does: batches sharded by the ring's layout
    logged = []
    cls = RingValidator if which == "ring" else Validator
    v = cls.__new__(cls)  # the attributes Validator.__init__ would set, without its dataloader
    v.job_config = SimpleNamespace(
        validation=SimpleNamespace(steps=-1),
        parallelism=SimpleNamespace(context_parallel_load_balancer=None, context_parallel_rotate_method="allgather"))
    v.tokenizer, v.loss_fn = None, cross_entropy_loss
    v.parallel_dims = SimpleNamespace(cp_enabled=True, dp_enabled=False, pp_enabled=False, dp_cp_enabled=True,
                                      get_mesh=lambda name: mesh, get_optional_mesh=lambda name: mesh)
    v.validation_dataloader = _batches()
    v.validation_context, v.maybe_enable_amp = contextlib.nullcontext, contextlib.nullcontext()
    v.metrics_processor = SimpleNamespace(ntokens_since_last_log=0,
                                          log_validation=lambda loss, step: logged.append(loss))
    v.validate([_PerToken()], step=1)
    assert len(logged) == 1
    return logged[0]


def test_ring_validator_logs_the_full_sequence_loss():
    want = _reference()
    got = run_ranks(2, _validate_on_ranks, "ring")
    assert got[0] == got[1] == pytest.approx(want, rel=1e-6), f"CP=2 validation {got} vs full-sequence {want}"
    # torchtitan 0.2.2's validate on the same shards counts each rank's tokens only: about twice the loss
    stock = run_ranks(2, _validate_on_ranks, "stock")
    assert stock[0] == pytest.approx(stock[1]) and stock[0] > 1.5 * want, f"stock {stock} vs {want}"


def test_every_family_spec_builds_the_ring_validator():
    import torchtitan.protocols.train_spec as titan_specs

    from cp_dtensor.titan import FAMILIES
    from cp_dtensor.titan.v02.validate import build_ring_validator

    for family in FAMILIES:
        assert titan_specs.get_train_spec(family).build_validator_fn is build_ring_validator, family


_VALIDATION = ["--validation.enable", "--validation.freq", "2", "--training.steps", "2"]  # the rest: the TOML's [validation]
_VAL_LINE = re.compile(r"validate step:\s*(\d+)\s+loss:\s*([0-9.]+)")


def _validation_losses(out: str) -> list[float]:
    by_step: dict[int, set[float]] = {}
    for step, loss in _VAL_LINE.findall(out):
        by_step.setdefault(int(step), set()).add(float(loss))
    assert sorted(by_step) == [1, 2], f"validation steps logged: {sorted(by_step)}\n{out[-3000:]}"
    assert all(len(v) == 1 for v in by_step.values()), f"ranks disagree on the validation loss: {by_step}"
    return [by_step[1].pop(), by_step[2].pop()]


@pytest.mark.parametrize("toml", [pytest.param("qwen3_debug.toml", marks=slow()),
                                  pytest.param("deepseek_v3_debug.toml", marks=exhaustive())])
def test_validation_cp2_matches_cp1(toml, tmp_path):
    # no seed checkpoint: on CPU every CP degree initialises the same weights (Note [torchtitan on CPU] 6)
    config = CONFIGS / toml
    cp1 = _validation_losses(torchrun(1, tmp_path / "cp1", "--parallelism.context_parallel_degree", "1",
                                       *_VALIDATION, config=config))
    cp2 = _validation_losses(torchrun(2, tmp_path / "cp2", "--parallelism.context_parallel_degree", "2",
                                       *_VALIDATION, config=config))
    assert cp2 == pytest.approx(cp1, rel=2e-5), f"{toml}: validation CP=2 {cp2} vs CP=1 {cp1}"


@slow("two torchrun jobs (~60 s each on 2 CPU cores)")
def test_validation_documents_and_tiling_cp2_match_cp1(tmp_path):
    # the validator shards through the same plan (layout documents) and computes the spec's (tiled) loss
    config = CONFIGS / "llama3_flex_debug.toml"
    cp1 = _validation_losses(torchrun(1, tmp_path / "cp1", "--parallelism.context_parallel_degree", "1",
                                       *_VALIDATION, config=config))
    cp2 = _validation_losses(torchrun(2, tmp_path / "cp2", "--parallelism.context_parallel_degree", "2",
                                       "--cp_dtensor.layout", "documents", "--cp_dtensor.sequence_tiling=64",
                                       *_VALIDATION, config=config))
    assert cp2 == pytest.approx(cp1, rel=2e-5), f"validation CP=2 documents + tiling {cp2} vs CP=1 {cp1}"
