"""CPU weight initialisation independent of the shard degree (Note [torchtitan on CPU] 6, titan/shared/cpu.py).

End to end: torchtitan's Trainer with no seed checkpoint at CP = 2 and CP = 4, PP x CP (slow tier), CP x
TP, compiled blocks with activation checkpointing (exhaustive tier) must log the losses of the same job on
one rank, to rel 1e-5. Without step 6 CP = 2 starts from other weights (llama3 step 1: 8.11423 vs 8.17354, 7e-3
relative). In process: a sharded model initialised through ``init_as_unsharded`` equals the same model
initialised unsharded from the same seed (FSDP's uneven Shard(0), TP's Shard(0) / Shard(1) /
Replicate, buffers), pipeline stages cut from a model initialise as the whole model does (step 7), and the
names torch's wrappers insert are the ones ``unwrapped_name`` removes.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
from _tiers import exhaustive, slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import CONFIG, reference_run, skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

import torch  # noqa: E402
from torch import nn  # noqa: E402

from cp_dtensor.titan.shared.cpu import (  # noqa: E402
    WRAPPER_NAMES,
    init_as_unsharded,
    init_stages_as_whole,
    unsharded_template,
    unwrapped_name,
)
from _dist import run_ranks  # noqa: E402
from test_titan import _assert_close, _losses, _torchrun  # noqa: E402  one launcher for every end-to-end test

_FRESH = ["--training.steps", "4"]  # no seed checkpoint: every run initialises its own weights


@pytest.fixture(scope="module")
def one_rank_losses(tmp_path_factory) -> list[float]:
    out = reference_run(1, "--parallelism.context_parallel_degree", "1", *_FRESH)
    assert "unsharded CPU replica" not in out  # one rank has no DTensor parameters: torchtitan's own init
    return _losses(out)


@slow("an end-to-end torchtitan run (20-60 s on 2 CPU cores): the default suite stays under 15 minutes")
def test_cp2_fresh_init_matches_one_rank(one_rank_losses, tmp_path):
    out = _torchrun(2, tmp_path, "--parallelism.context_parallel_degree", "2", *_FRESH)
    assert "weights initialised on an unsharded CPU replica" in out
    _assert_close(_losses(out), one_rank_losses)


@pytest.mark.parametrize(
    "nproc,overrides",
    [
        pytest.param(4, ["--parallelism.context_parallel_degree", "4"], marks=slow()),
        pytest.param(4, ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
                     marks=exhaustive()),
        pytest.param(2, ["--parallelism.context_parallel_degree", "2", "--compile.enable", "--activation_checkpoint.mode",
                         "full"], marks=exhaustive()),
    ],
    ids=["cp4", "cp2xtp2", "cp2_compile_ac"],
)
def test_fresh_init_matches_one_rank(nproc, overrides, one_rank_losses, tmp_path):
    _assert_close(_losses(_torchrun(nproc, tmp_path, *overrides, *_FRESH)), one_rank_losses)


@slow("a 4-rank pipeline x CP torchtitan run (~35-60 s on 2 CPU cores)")
def test_pp2_cp2_fresh_init_matches_one_rank(one_rank_losses, tmp_path):
    """Note [torchtitan on CPU] 7: two stages per rank (Interleaved1F1B), each sharded over CP = 2, start from
    the one-rank model's weights (without step 7, 1F1B step 1: 8.13884 here, 8.06831 at PP = 2 x CP = 1)."""
    out = _torchrun(4, tmp_path, "--parallelism.context_parallel_degree", "2", "--parallelism.pipeline_parallel_degree",
                    "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", *_FRESH)
    assert "pipeline stages initialised from one CPU replica of the whole model" in out
    _assert_close(_losses(out), one_rank_losses)


# ---- in process ----

def test_trainer_initialises_after_parallelize():
    """The order step 6 relies on (torchtitan 0.2.2): parallelize_fn, then to_empty, then init_weights."""
    from torchtitan.train import Trainer

    src = inspect.getsource(Trainer.__init__)
    tail = src[src.index("model = self.train_spec.parallelize_fn(model"):]
    assert tail.index("model.to_empty(") < tail.index(".init_weights(buffer_device=buffer_device)")


def test_trainer_initialises_stages_after_pipelining():
    """The order step 7 relies on (torchtitan 0.2.2): pipelining_fn cuts and parallelizes the stages, then
    each stage is moved off meta and initialised, one after the other."""
    from torchtitan.train import Trainer

    src = inspect.getsource(Trainer.__init__)
    tail = src[src.index("= self.train_spec.pipelining_fn("):]
    loop = tail[tail.index("for m in self.model_parts:"):]
    assert loop.index("m.to_empty(") < loop.index("m).init_weights(buffer_device=buffer_device)")


def test_pipeline_warns_where_stages_keep_their_seeds(caplog, tmp_path):
    """Where step 7 does not apply (an accelerator; here a model not on meta), a PP job warns at start unless
    it loads a checkpoint: a seed checkpoint, or a resume from its own folder."""
    from torchtitan.config import ConfigManager

    from cp_dtensor.titan.v02.spec import _whole_model_init

    job = ConfigManager().parse_args(["--job.config_file", str(CONFIG), "--job.dump_folder", str(tmp_path),
                                      "--parallelism.pipeline_parallel_degree", "2"])
    stage = nn.Linear(2, 2)  # on the CPU, not on meta: no template
    pipelining = _whole_model_init(lambda model, *args: ("schedule", [model], True, False))

    def warned() -> bool:
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert pipelining(stage, None, job, None, None, None, None) == ("schedule", [stage], True, False)
        assert "the token count" in caplog.text  # torchtitan 0.2.2's PP gradient scale: always said
        return "seeds each stage differently" in caplog.text

    assert warned() and "init_weights" not in vars(stage)
    job.checkpoint.enable = True
    assert warned()  # checkpointing on, but nothing to load yet
    (tmp_path / job.checkpoint.folder / "step-10").mkdir(parents=True)
    assert not warned()  # a resume
    job.checkpoint.folder = "elsewhere"
    job.checkpoint.initial_load_path = str(tmp_path / "seed" / "step-0")
    assert not warned()  # a seed checkpoint


def test_wrapper_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plain = [n for n, _ in model.named_parameters()]
    model[0] = checkpoint_wrapper(model[0])
    model[1] = torch.compile(model[1])
    wrapped = [n for n, _ in model.named_parameters()]
    assert {p for n in wrapped for p in n.split(".")} >= set(WRAPPER_NAMES), wrapped
    assert [unwrapped_name(n) for n in wrapped] == plain


class _Tiny(nn.Module):
    # uneven FSDP shards on 2 ranks (5 rows), a TP-sharded pair, a buffer set by init_weights
    def __init__(self):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(4, 6), nn.Linear(6, 4), nn.LayerNorm(4)
        self.fsdp = nn.Linear(4, 5)
        self.register_buffer("table", torch.empty(3), persistent=False)

    def init_weights(self, buffer_device=None):
        for p in self.parameters():
            nn.init.trunc_normal_(p, std=0.5)
        self.table = torch.arange(3.0)


def _zero_norm_bias_after_init(model: _Tiny) -> None:
    # like families.apply_family_fixes: the model's init_weights wrapped in a closure over the model
    init = model.init_weights

    def init_weights(*args, **kwargs):
        init(*args, **kwargs)
        nn.init.zeros_(model.norm.bias)

    model.init_weights = init_weights


def _sharded_init(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ref = _Tiny()
    _zero_norm_bias_after_init(ref)
    torch.manual_seed(7)
    ref.init_weights()
    assert not ref.norm.bias.any()

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = _Tiny()
    template = unsharded_template(model)
    _zero_norm_bias_after_init(model)  # a closure a deep copy would keep pointing at the template: prepare=
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model.fsdp, mesh=mesh)  # 5 rows on 2 ranks: 3 + 2; the norm stays a plain tensor
    placements = {n: p.placements for n, p in model.named_parameters() if isinstance(p, DTensor)}
    assert placements["up.weight"] == (Shard(0),) and placements["down.weight"] == (Shard(1),)
    assert placements["down.bias"] == (Replicate(),) and placements["fsdp.weight"] == (Shard(0),)
    assert model.fsdp.weight.to_local().shape[0] == (3, 2)[rank] and "norm.weight" not in placements
    model.to_empty(device="cpu")
    assert init_as_unsharded(model, template, prepare=_zero_norm_bias_after_init)
    torch.manual_seed(7 + rank)  # ranks disagree: rank 0's RNG state is the one used
    if rank == 0:
        torch.manual_seed(7)
    model.init_weights()
    got = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for n, p in model.named_parameters()}
    want = dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
    torch.testing.assert_close(model.table, torch.arange(3.0))
    _stage_init(rank, mesh, ref)
    return placements


def _stage_init(rank, mesh, ref):
    # Note [torchtitan on CPU] 7: two stages on this rank (a looped schedule), cut as torchtitan's
    # pipeline_module_split cuts (the other stages' modules set to None), one FSDP-sharded; ranks seeded apart
    import copy

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with torch.device("meta"):
        whole = _Tiny()
    template = unsharded_template(whole)
    stages = [copy.deepcopy(whole), copy.deepcopy(whole)]
    stages[0].down = stages[0].fsdp = None
    stages[1].up = stages[1].norm = None
    fully_shard(stages[1].fsdp, mesh=mesh)
    assert init_stages_as_whole(stages, template, prepare=_zero_norm_bias_after_init)
    torch.manual_seed(7 if rank == 0 else 8)  # rank 0's RNG state is the one used
    for _ in range(2):  # a second init (the replica was freed after the last stage) draws again from rank 0's state
        own = torch.get_rng_state()
        for stage in stages:  # torchtitan: to_empty, then init_weights, one stage after the other
            stage.to_empty(device="cpu")
            stage.init_weights()
        assert torch.equal(torch.get_rng_state(), own)  # the rank's own stream is left as it was
        want = dict(ref.named_parameters())
        got = {n: (p.full_tensor() if isinstance(p, DTensor) else p) for s in stages for n, p in s.named_parameters()}
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, msg=n)
        torch.testing.assert_close(stages[0].table, torch.arange(3.0))
        torch.manual_seed(7 if rank == 0 else 9)


def test_sharded_init_equals_unsharded():
    """Step 6 (TP, uneven FSDP shards, buffers), then step 7 (pipeline stages) in the same ranks."""
    placements = run_ranks(2, _sharded_init)
    assert placements[0] == placements[1]


def test_nothing_to_do_without_dtensors():
    with torch.device("meta"):
        model = _Tiny()
    template = unsharded_template(model)
    assert template is not None and not init_as_unsharded(model.to_empty(device="cpu"), template)
    assert unsharded_template(model) is None  # not on meta: no template
