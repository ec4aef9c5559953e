"""End-to-end: torchtitan 0.2.2's Trainer with cp_dtensor context parallelism, on CPU under torchrun.

Reference: the same job at CP = 1 on one rank, from the same seed checkpoint. Every CP run must log
the same losses for steps 1-4 to rel 1e-5. Measured here: CP = 2 differs from CP = 1 by <= 2e-7
relative, while dropping the RoPE positions of the shards (a plausible plugin bug) moves the loss by
1.3e-5 relative at step 2 and 1.5e-4 at step 4 -- so 1e-5, not 1e-4, is what catches that bug.
Losses are parsed from torchtitan's step log lines ("step:  3  loss:  7.55022 ..."), which every
rank prints (5 decimals: ~1e-6 relative resolution); all ranks must agree.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
from _tiers import exhaustive, slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _titan_run import CONFIG, REPO, TRAIN, run_torchrun, seed_checkpoint, step_losses, torchrun  # noqa: E402  the one launcher

STEPS = 4
RTOL = 1e-5


def _torchrun(nproc: int, dump: Path, *overrides: str, entry: list[str] | None = None, config: Path = CONFIG,
              timeout: int = 420) -> str:
    """Run one training job (tests/_titan_run.py); returns its combined output, or fails with its tail."""
    return torchrun(nproc, dump, *overrides, entry=entry or TRAIN, config=config, timeout=timeout)


def _losses(out: str, steps: int = STEPS) -> list[float]:
    """The logged loss of steps 1..steps, which every rank must agree on."""
    return step_losses(out, last=steps)


def _assert_close(losses: list[float], ref: list[float]) -> None:
    assert losses == pytest.approx(ref, rel=RTOL), f"CP losses {losses} vs reference losses {ref}"


_E2E = slow("an end-to-end torchtitan run (20-60 s on 2 CPU cores): the default suite stays under 15 minutes")
_FOUR_RANKS = slow("4 ranks on 2 CPU cores: ~40-55 s each")


@pytest.fixture(scope="module")
def seed_ckpt(tmp_path_factory) -> Path:
    """fp32 model weights at step 0, made once a session on one rank and loaded by every run."""
    return seed_checkpoint()


def _from_seed(seed_ckpt: Path) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_ckpt), "--checkpoint.load_only",
            "--training.steps", str(STEPS)]


@pytest.fixture(scope="module")
def cp1_losses(seed_ckpt, tmp_path_factory) -> list[float]:
    out = _torchrun(1, tmp_path_factory.mktemp("cp1"), "--parallelism.context_parallel_degree", "1",
                    *_from_seed(seed_ckpt))
    losses = _losses(out)
    assert losses[-1] < losses[0], f"the reference run does not train: {losses}"
    return losses


@pytest.mark.parametrize("layout", ["striped", pytest.param("headtail", marks=_E2E)])
def test_cp2_matches_cp1(layout, seed_ckpt, cp1_losses, tmp_path):
    out = _torchrun(2, tmp_path, "--parallelism.context_parallel_degree", "2", "--cp_dtensor.layout", layout,
                    *_from_seed(seed_ckpt))
    assert f"Applied cp_dtensor ring attention (layout={layout})" in out
    _assert_close(_losses(out), cp1_losses)


@slow("stock torchtitan main under torchrun: ~20 s")
def test_stock_torchtitan_main_with_custom_import(seed_ckpt, cp1_losses, tmp_path):
    # torchtitan's own main() and Trainer, reached only through the TOML's custom_import and
    # custom_config_module; the launcher imports cp_dtensor.titan first only because this machine has
    # no triton (Note [torchtitan on CPU]). contiguous layout, to cover the third layout.
    launcher = tmp_path / "stock_torchtitan_train.py"
    launcher.write_text(textwrap.dedent("""\
        import runpy
        import cp_dtensor.titan  # noqa: F401
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    """))
    out = _torchrun(2, tmp_path / "dump", "--cp_dtensor.layout", "contiguous", *_from_seed(seed_ckpt),
                    entry=[str(launcher)])
    assert "Applied cp_dtensor ring attention (layout=contiguous)" in out
    _assert_close(_losses(out), cp1_losses)


@_E2E
def test_cp2_full_activation_checkpointing(seed_ckpt, cp1_losses, tmp_path):
    # the backward recomputes each block's forward, ring collectives included, on both ranks
    out = _torchrun(2, tmp_path, "--activation_checkpoint.mode", "full", *_from_seed(seed_ckpt))
    _assert_close(_losses(out), cp1_losses)




@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(["--parallelism.context_parallel_degree", "4"], marks=_FOUR_RANKS),
        pytest.param(["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
                     marks=_FOUR_RANKS),
        pytest.param(["--parallelism.context_parallel_degree", "4", "--compile.enable"], marks=exhaustive("4 ranks compiling on 2 CPU cores; CP = 2 compiled runs by default")),
    ],
    ids=["cp4", "cp2xtp2", "cp4_compiled"],
)
def test_four_ranks_match_cp1(overrides, seed_ckpt, cp1_losses, tmp_path):
    _assert_close(_losses(_torchrun(4, tmp_path, *overrides, *_from_seed(seed_ckpt))), cp1_losses)


@_FOUR_RANKS
def test_fsdp2_x_cp2_matches_fsdp2(seed_ckpt, tmp_path):
    # two data-parallel groups read different data, so the reference is the same job without CP
    dp2 = ["--parallelism.data_parallel_shard_degree", "2", *_from_seed(seed_ckpt)]
    ref = _losses(_torchrun(2, tmp_path / "fsdp2", "--parallelism.context_parallel_degree", "1", *dp2))
    _assert_close(_losses(_torchrun(4, tmp_path / "fsdp2_cp2", "--parallelism.context_parallel_degree", "2", *dp2)), ref)


@_E2E
def test_cp2_compiled_blocks_match_cp1(seed_ckpt, cp1_losses, tmp_path):
    # torchtitan compiles each block with fullgraph=True: the ring must trace without a graph break
    _assert_close(_losses(_torchrun(2, tmp_path, "--compile.enable", *_from_seed(seed_ckpt))), cp1_losses)


def test_bad_config_fails_on_every_rank(tmp_path):
    code, out = run_torchrun(2, tmp_path, "--cp_dtensor.layout", "headtail", "--training.seq_len", "254", timeout=120)
    assert code != 0
    assert out.count("headtail layout on 2 CP ranks needs a multiple of 4") >= 2, out[-3000:]  # both ranks


# ---- in-process checks: config parsing, start-up validation, batch sharding (no ranks started) ----

GPU_CONFIGS = {  # file -> the world size it is written for
    "llama3_8b_128k_cp8.toml": 8,
    "llama3_8b_cp4_fsdp2.toml": 8,
    "llama3_8b_cp4_tp2.toml": 8,
}


def _parse(config: Path, *overrides: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(config), *overrides])


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_example_configs_parse(name):
    from torchtitan.distributed import ParallelDims

    from cp_dtensor.titan import check_config

    cfg = _parse(REPO / "titan_configs" / name)
    world = GPU_CONFIGS[name]
    check_config(cfg, world_size=world)
    p = cfg.parallelism
    ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                 cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                 ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world)
    assert cfg.experimental.custom_import == "cp_dtensor.titan"
    assert cfg.cp_dtensor.layout in ("striped", "headtail", "contiguous")
    assert cfg.parallelism.context_parallel_degree > 1


def test_unknown_layout_is_rejected():
    from cp_dtensor.titan import CPDTensor

    with pytest.raises(ValueError, match=r"layout must be one of striped, headtail, contiguous, documents; got 'diagonal'"):
        CPDTensor(layout="diagonal")


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["--parallelism.context_parallel_degree", "3"], 2, r"context_parallel_degree \(3\) must divide .* \(2\)"),
        (["--cp_dtensor.layout", "headtail", "--training.seq_len", "254"], 2,
         r"seq_len \(254\) does not fit: the headtail layout on 2 CP ranks needs a multiple of 4"),
        (["--parallelism.context_parallel_degree", "4", "--training.seq_len", "250"], 4,
         r"striped layout on 4 CP ranks needs a multiple of 4"),
        (["--training.seq_len", "250"], 2, r"divisible by 2 \* context_parallel_degree \* tensor_parallel_degree = 4"),
        (["--model.name", "flux"], 2, r'name = "flux" \(cp_dtensor serves llama3, qwen3, deepseek_v3, llama4, gpt_oss\)'),
        (["--model.flavor", "debugmodel_varlen_attn"], 2, r'attn_type "varlen" \(the ring serves "sdpa" and "flex"'),
        (["--model.name", "qwen3", "--model.flavor", "8B_flex"], 2, r'"8B_flex" is not a qwen3 flavor'),
        (["--model.name", "gpt_oss", "--model.flavor", "debugmodel_flex_attn"], 2,
         r'"debugmodel_flex_attn" is not a gpt_oss flavor of torchtitan; pick one of 120b, 20b, debugmodel'),
        (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "4"], 2,
         r"expert_parallel_degree \(4\) does not divide the ranks torchtitan gives it: EP borrows from "
         r"data_parallel_shard_degree \(1\) x context_parallel_degree \(2\) = 2 ranks"),
        (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--parallelism.expert_parallel_degree", "3"], 6,
         r"expert_parallel_degree \(3\) must divide the experts of deepseek_v3 debugmodel \(8\)"),
        (["--cp_dtensor.layout", "headtail", "--validation.enable", "--validation.seq_len", "250"], 2,
         r"\[validation\] seq_len \(250\) does not fit: .* headtail layout on 2 CP ranks needs a multiple of 4"),
        (["--parallelism.tensor_parallel_degree", "2", "--validation.enable", "--validation.seq_len", "250"], 4,
         r"\[validation\] seq_len \(250\) .* times tensor_parallel_degree \(2\) needs a multiple of 4"),
        # Note [Tensor parallelism under torch.compile]: wrong gradients at CP 2 x TP 2, a crash at TP 2 alone
        (["--parallelism.tensor_parallel_degree", "2", "--compile.enable"], 4,
         r"\[compile\] enable with tensor_parallel_degree = 2 \(context_parallel_degree = 2\) on CPU ranks: .* wrong "
         r"gradients .* pass --compile.backend eager"),
        (["--parallelism.context_parallel_degree", "1", "--parallelism.tensor_parallel_degree", "2", "--compile.enable",
          "--compile.backend", "aot_eager"], 2, r'tensor_parallel_degree = 2 \(context_parallel_degree = 1\) .* "aot_eager"'),
    ],
)
def test_bad_cp_config_is_rejected(overrides, world, message):
    from cp_dtensor.titan import check_config

    cfg = _parse(CONFIG, *overrides)
    with pytest.raises(ValueError, match=message):
        check_config(cfg, world_size=world)


def test_tp_compile_runs_where_it_is_exact():
    from cp_dtensor.titan import check_config
    from cp_dtensor.titan.shared.compile_check import tp_compile_clash

    # Dynamo without AOTAutograd logs the eager losses (Note [Tensor parallelism under torch.compile])
    check_config(_parse(CONFIG, "--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.backend",
                        "eager"), world_size=4)
    check_config(_parse(CONFIG, "--compile.enable"), world_size=2)  # CP without TP compiles
    assert tp_compile_clash(cp=1, tp=2, compile_enabled=True, backend="inductor", accelerator=True) is None
    assert "with cp_dtensor context parallelism" in tp_compile_clash(cp=2, tp=2, compile_enabled=True,
                                                                     backend="inductor", accelerator=True)


def test_cp1_needs_no_cp_section():
    from types import SimpleNamespace

    from cp_dtensor.titan import check_config

    cfg = _parse(CONFIG, "--parallelism.context_parallel_degree", "1")
    check_config(cfg, world_size=2)
    bare = SimpleNamespace(parallelism=cfg.parallelism, training=cfg.training, model=cfg.model)
    check_config(bare, world_size=1)  # no [cp_dtensor] section is fine without CP
    bare.parallelism.context_parallel_degree = 2
    with pytest.raises(ValueError, match="custom_config_module"):
        check_config(bare, world_size=2)


class _FakeCPMesh:
    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def get_local_rank(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.world


@pytest.mark.parametrize("layout", ["striped", "headtail", "contiguous"])
@pytest.mark.parametrize("world", [2, 4])
def test_shard_cp_batch_keeps_tokens_with_positions(layout, world):
    # reference: a token at global position p is inputs[:, p] and its label is labels[:, p]
    import torch

    from cp_dtensor.titan.v02.attention import shard_cp_batch

    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 1000, (3, 32), generator=g)
    labels = torch.randint(0, 1000, (3, 32), generator=g)
    seen = []
    for rank in range(world):
        x, y, kw = shard_cp_batch(inputs, labels, {}, _FakeCPMesh(rank, world), torch.device("cpu"), layout=layout)
        pos = kw["positions"]
        assert pos.shape == (1, 32 // world) and x.shape == y.shape == (3, 32 // world)
        assert torch.equal(x, inputs[:, pos[0]]) and torch.equal(y, labels[:, pos[0]])
        assert bool((pos[0, 1:] > pos[0, :-1]).all()), "local order must be increasing global order"
        seen.append(pos[0])
    assert sorted(torch.cat(seen).tolist()) == list(range(32))


def test_varlen_attention_flavor_is_rejected():
    import torch
    from torchtitan.models.llama3 import Transformer, llama3_args

    from cp_dtensor.titan import CPDTensor, apply_ring_attention

    with torch.device("meta"):
        model = Transformer(llama3_args["debugmodel_varlen_attn"])
    with pytest.raises(ValueError, match=r'supports attn_type "sdpa" and "flex"; this model flavor uses "varlen"'):
        apply_ring_attention(model, None, CPDTensor())


@pytest.mark.parametrize("world", [2, 4])
def test_shard_cp_batch_documents_plans_the_batch_once(world):
    # layout = "documents": one plan from the full batch's block_causal documents shards tokens, labels, RoPE
    # positions and the mask ids alike. Reference: the token at global position p is inputs[b, p]; every
    # position is held exactly once (where the planner puts them: tests/core/test_documents.py).
    import torch

    from cp_dtensor.core.plan.documents import DocumentLayout
    from cp_dtensor.titan.v02.attention import shard_cp_batch
    from cp_dtensor.titan.v02.flex import RingMask

    g = torch.Generator().manual_seed(0)
    n = 64
    inputs = torch.randint(0, 1000, (2, n), generator=g)
    labels = torch.randint(0, 1000, (2, n), generator=g)
    starts = [[0, 3, 5, 40, 47], [0, 60]]  # row 0: documents of 3, 2, 35, 7, 17 tokens; row 1: 60 and 4
    ids = torch.zeros(2, n, dtype=torch.long)
    for b, row in enumerate(starts):
        for s in row[1:]:
            ids[b, s:] += 1
    held = [[] for _ in range(2)]
    for rank in range(world):
        masks = {"basic_mask": RingMask.make(ids), "sliding_window_mask": RingMask.make(ids, window_size=(7, 0))}
        x, y, kw = shard_cp_batch(inputs, labels, {"attention_masks": masks}, _FakeCPMesh(rank, world),
                                  torch.device("cpu"), layout="documents")
        pos = kw["positions"]
        assert pos.shape == x.shape == y.shape == (2, n // world)
        assert torch.equal(x, inputs.gather(1, pos)) and torch.equal(y, labels.gather(1, pos))
        for m in kw["attention_masks"].values():
            assert isinstance(m.plan, DocumentLayout) and m.plan is kw["attention_masks"]["basic_mask"].plan
            assert torch.equal(m.ids, ids.gather(1, pos))
        assert kw["attention_masks"]["sliding_window_mask"].window_size == (7, 0)
        for b in range(2):
            held[b].append(set(pos[b].tolist()))
    for b in range(2):
        assert sorted(p for h in held[b] for p in h) == list(range(n))


def test_shard_cp_batch_documents_refuses_masks_without_documents():
    import torch

    from cp_dtensor.titan.v02.attention import shard_cp_batch
    from cp_dtensor.titan.v02.flex import RingMask

    x = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r'layout = "documents" needs the batch\'s documents'):
        shard_cp_batch(x, x, {}, _FakeCPMesh(0, 2), torch.device("cpu"), layout="documents")
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    chunks = {"rope": RingMask.make(ids * 2 + torch.arange(8) // 4), "nope": RingMask.make(ids)}  # llama4's
    with pytest.raises(ValueError, match=r"the 'rope' mask masks by other ids"):
        shard_cp_batch(x, x, {"attention_masks": chunks}, _FakeCPMesh(0, 2), torch.device("cpu"), layout="documents")


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["--model.flavor", "debugmodel"], 2, r'layout = "documents" with \[model\] llama3 flavor "debugmodel" \(its '
         r"masks mark no documents"),
        (["--model.name", "llama4", "--model.flavor", "debugmodel_irope"], 2, r"llama4's chunked attention"),
        (["--parallelism.context_parallel_degree", "4", "--training.seq_len", "250"], 4,
         r"documents layout on 4 CP ranks needs a multiple of 4"),
    ],
    ids=["sdpa", "llama4", "seq_len"],
)
def test_bad_documents_config_is_rejected(overrides, world, message):
    from cp_dtensor.titan import check_config

    cfg = _parse(CONFIG, "--cp_dtensor.layout", "documents", "--model.flavor", "debugmodel_flex_attn", *overrides)
    with pytest.raises(ValueError, match=message):
        check_config(cfg, world_size=world)


def test_documents_config_is_accepted():
    # [compile] with the documents layout: accepted (test_titan_flex.py runs the compiled blocks)
    from cp_dtensor.titan import check_config

    cfg = _parse(CONFIG, "--cp_dtensor.layout", "documents", "--model.flavor", "debugmodel_flex_attn", "--compile.enable")
    check_config(cfg, world_size=2)
    # and under TP (Note [Documents under tensor parallelism]; the jobs: test_titan_dynamic.py), static and dynamic
    for extra in ([], ["--cp_dtensor.dynamic", "true", "--parallelism.data_parallel_shard_degree", "2"]):
        check_config(_parse(CONFIG, "--cp_dtensor.layout", "documents", "--model.flavor", "debugmodel_flex_attn",
                            "--parallelism.tensor_parallel_degree", "2", *extra), world_size=8 if extra else 4)


@pytest.mark.parametrize("key", [["--cp_dtensor.comm_dtype", "bfloat16"], ["--cp_dtensor.kv_exchange", "allgather"],
                                 ["--cp_dtensor.ulysses_degree", "2"]], ids=["comm_dtype", "kv_exchange", "ulysses"])
def test_documents_layout_refuses_other_exchanges(key):
    from cp_dtensor.titan import CPDTensor

    name, value = key[0].split(".")[1], key[1]
    with pytest.raises(ValueError, match=rf'layout = "documents" has its own exchange .* does not take {name}'):
        CPDTensor(layout="documents", **{name: int(value) if value.isdigit() else value})


@_E2E
def test_cp2_documents_layout_matches_cp1(tmp_path):
    # [cp_dtensor] layout = "documents" on the block_causal flex flavor (the tiny data packs eos-separated
    # documents into every row): the plan of each batch's documents, all steps' losses equal CP = 1's
    flags: list[str] = []
    flex = ["--model.flavor", "debugmodel_flex_attn", "--training.steps", str(STEPS)]
    ref = _losses(_torchrun(1, tmp_path / "cp1", "--parallelism.context_parallel_degree", "1", *flex))
    out = _torchrun(2, tmp_path / "cp2", "--parallelism.context_parallel_degree", "2", "--cp_dtensor.layout",
                    "documents", *flex, *flags)
    assert "Applied cp_dtensor ring attention (layout=documents)" in out
    _assert_close(_losses(out), ref)
