"""``[cp_dtensor] dynamic = true`` (Note [Dynamic CP in torchtitan]): one plan of the global batch over every
dp_shard x cp rank, against the static documents layout.

The slow tier runs llama3 debugmodel_flex_attn at dp_shard 2 x cp 2 (4 ranks, fp32, 3 steps from one seed
checkpoint), static documents, dynamic, and dynamic with full activation checkpointing, compiled blocks and
sequence tiling, and checks from the jobs: the losses and grad norms equal (rel 2e-5), the validation losses
(validation at steps 1 and 2, the same batch sharding; compiled too) equal, the ring runs over all 4 ranks, one
balance line a step (rank 0) with the plan's work max/mean, the K/V rows received and the tokens a rank
(B * N / cp); and static against dynamic under HSDP (dp_replicate 2 x dp_shard 2 x cp 2) with float8 linears
(the exhaustive tier: deepseek_v3 debugmodel_flex_attn (MLA, MoE) dynamic with 2-way expert parallelism
against its static documents job, the experts' balancing biases included). The default tier checks the start-up
refusals of compositions and families dynamic does not serve (config parsing only, no job).

Under tensor parallelism (Note [Documents under tensor parallelism], slow tier, fresh init: the same weights at
every degree): the static documents job at dp_shard 2 x cp 2 x tp 2 (8 ranks) logs the losses and validation
losses of dp_shard 2 x tp 2 at cp 1, and ``dynamic = true`` on the same 8 ranks those of the static job."""

from __future__ import annotations

import importlib.util
import re
import tempfile
from pathlib import Path

import pytest
from _tiers import exhaustive, slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _titan_run import CONFIG, reference_run, seed_checkpoint, step_losses_and_norms, torchrun  # noqa: E402

FLEX = ["--model.flavor", "debugmodel_flex_attn"]
DEEPSEEK = CONFIG.parent / "deepseek_v3_debug.toml"  # debugmodel_flex_attn: MLA, MoE (8 experts, top 3), documents
HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]  # with GRID: dp_replicate 2 x dp_shard 2 x cp 2
GRID = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
        "--cp_dtensor.layout", "documents"]
_BALANCE = re.compile(r"cp_dtensor dynamic: work max/mean ([0-9.]+) over (\d+) ranks \(the dp ranks' rows alone "
                      r"([0-9.]+)\), K/V rows received (\d+) \(busiest rank, a layer\), tokens a rank (\d+)")


def _validation(out: str) -> set[tuple[int, float]]:
    """(step, loss) of torchtitan's validation lines (every rank logs the same)."""
    return {(int(a), float(b)) for a, b in re.findall(r"validate step:\s*(\d+)\s+loss:\s*([0-9.]+)", out)}


@slow("three 4-rank torchtitan jobs, one compiled (about 2 min on a loaded 2-core machine)")
def test_dynamic_equals_static_documents():
    seed = seed_checkpoint(*FLEX)
    common = [*FLEX, *GRID, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
              "--checkpoint.load_only", "--training.steps", "3", "--validation.enable", "--validation.freq", "2",
              "--validation.steps", "2"]  # validation at step 2: 2 batches, sharded by the same hook
    static = torchrun(4, Path(tempfile.mkdtemp(prefix="titan-static-")), *common)
    dynamic = torchrun(4, Path(tempfile.mkdtemp(prefix="titan-dynamic-")), *common, "--cp_dtensor.dynamic", "true")
    want, got = step_losses_and_norms(static), step_losses_and_norms(dynamic)
    # dynamic with full activation checkpointing, every block compiled (Inductor) and the LM head + loss and the
    # MLPs in 64-token tiles: the same numbers, validation (no_grad: the blocks' second graph) included
    both = torchrun(4, Path(tempfile.mkdtemp(prefix="titan-dynamic-ac-compile-")), *common,
                    "--cp_dtensor.dynamic", "true", "--activation_checkpoint.mode", "full", "--compile.enable",
                    "--cp_dtensor.sequence_tiling", "64")
    for line in ("Applied full activation checkpointing", "Compiling each TransformerBlock",
                 "cp_dtensor: sequence tiling, 64 tokens a tile"):
        assert line in both, (line, both[-3000:])
    for run in (got, step_losses_and_norms(both)):
        assert sorted(run) == sorted(want) == [1, 2, 3], (run, want)
        for step in want:
            assert run[step] == pytest.approx(want[step], rel=2e-5), (step, run[step], want[step])
    assert _validation(dynamic) == _validation(static) and len(_validation(static)) >= 1, _validation(dynamic)
    compiled = dict(_validation(both))
    assert sorted(compiled) == sorted(dict(_validation(static))), (compiled, _validation(static))
    for step, loss in _validation(static):  # 4 logged decimals: equal to their rounding
        assert compiled[step] == pytest.approx(loss, abs=1.5e-4), (step, compiled[step], loss)
    assert "Applied cp_dtensor ring attention (layout=documents, dynamic over dp x cp = 4 ranks)" in dynamic
    assert "cp_dtensor dynamic:" not in static
    lines = _BALANCE.findall(dynamic)
    assert len(lines) >= 3 + 2, dynamic[-3000:]  # one a batch sharded (3 steps, the validation's batches), rank 0
    for work, ranks, rows_alone, received, tokens in lines:
        assert int(ranks) == 4 and int(tokens) == 2 * 256 // 2  # local_batch_size * seq_len / cp: equal on every rank
        # the planner's figure (its own tests hold it to its bar): here 1.003-1.034, the dp rows alone 1.02-1.08
        assert 1.0 <= float(work) < 1.1 and 1.0 <= float(rows_alone), (work, rows_alone)
        assert int(received) > 0  # documents cut over ranks: the exchange runs


@slow("two 8-rank torchtitan jobs with float8 linears (50 s on the 2-core machine)")
def test_dynamic_hsdp_float8_equals_static_documents_float8():
    # HSDP (dp_replicate 2 x dp_shard 2 x cp 2: the "loss" mesh the plan spans holds all 8 ranks; FSDP over
    # dp_shard x cp, the replicas' all-reduce beside it) and torchao's float8 linears (emulated gemm on CPU: Note [The float8 gemm on CPU]) under dynamic CP. The recipe
    # rowwise_with_gw_hp scales every activation per token and every weight per row (or whole, all-gathered by
    # FSDP) and keeps the weight gradient in fp32, so which tokens a rank holds changes no float8 scale: the runs
    # differ by fp32 summation order only, the fp32 tests' bar. (Plain "rowwise" scales the weight gradient's
    # operands per feature over a rank's tokens: measured 3.4e-5 apart from step 2, float8 rounding noise as for
    # CP against CP = 1 in test_titan_float8.py.)
    seed = seed_checkpoint(*FLEX)
    f8 = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name",
          "rowwise_with_gw_hp", "--quantize.linear.float8.emulate"]
    common = [*FLEX, *GRID, *HSDP, *f8, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
              "--checkpoint.load_only", "--training.steps", "3"]
    static = torchrun(8, Path(tempfile.mkdtemp(prefix="titan-static-f8-")), *common)
    dynamic = torchrun(8, Path(tempfile.mkdtemp(prefix="titan-dynamic-f8-")), *common, "--cp_dtensor.dynamic", "true")
    assert dynamic.count("Float8 training active with recipe rowwise_with_gw_hp") == 8, dynamic[-3000:]
    assert dynamic.count("Applied HSDP to the model") == 8, dynamic[-3000:]
    lines = _BALANCE.findall(dynamic)
    assert len(lines) == 3 and all(int(ranks) == 8 for _, ranks, *_ in lines), lines  # the plan spans all 8 ranks
    want, got = step_losses_and_norms(static), step_losses_and_norms(dynamic)
    assert sorted(got) == sorted(want) == [1, 2, 3], (got, want)
    print(f"HSDP float8 dynamic vs static: {got} vs {want}")  # shown with -s
    # measured: 1.5e-5 at steps 2 and 3 (1.1e-5 at dp_shard 2 x cp 2; fp32 without float8: every digit equal, HSDP
    # or not), grad norms equal to the printed digits
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=2e-5), (step, got[step], want[step])


def _expert_biases(dump: Path) -> dict:
    """Every MoE layer's expert_bias in the job's last checkpoint (step 3)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(dump / "checkpoint" / "step-3"), str(dump / "model.pt"))
    return {k: v for k, v in torch.load(dump / "model.pt", weights_only=False).items() if k.endswith("expert_bias")}


@exhaustive("two 4-rank deepseek_v3 torchtitan jobs (74 s on a loaded 2-core machine)")
def test_deepseek_v3_dynamic_with_expert_parallelism_equals_static_documents():
    # MLA + MoE (8 routed experts, top 3, 2 shared; auxiliary-loss-free balancing on: torchtitan sums every MoE
    # layer's tokens_per_expert over the "loss" mesh before each step's expert_bias update, so the counts are the
    # global batch's under either sharding: the step-3 checkpoints' expert biases are equal, and step 3 is routed
    # with them). The dynamic job also runs the experts 2-way expert-parallel (tokens dispatched by all-to-all
    # from whatever the plan put on a rank): the losses and grad norms of the static documents job without EP.
    seed = seed_checkpoint(config=DEEPSEEK)
    common = [*GRID, "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed), "--checkpoint.interval", "3",
              "--training.steps", "3"]
    dumps = [Path(tempfile.mkdtemp(prefix=f"titan-ds-{what}-")) for what in ("static", "dynamic")]
    static = torchrun(4, dumps[0], *common, config=DEEPSEEK)
    dynamic = torchrun(4, dumps[1], *common, "--cp_dtensor.dynamic", "true", "--parallelism.expert_parallel_degree",
                       "2", config=DEEPSEEK)
    assert "deepseek_v3 debugmodel_flex_attn" in static and "ep=2" in dynamic, dynamic[-3000:]
    _approx_equal(step_losses_and_norms(dynamic), step_losses_and_norms(static), "deepseek_v3 dynamic + EP 2 vs static")
    want, got = (_expert_biases(d) for d in dumps)
    assert len(want) == 5 and sorted(got) == sorted(want), (want, got)  # layers 1-5 are MoE
    for name, bias in want.items():  # the updates are +-1e-3 a step: moved, and the same under both plans
        assert bias.abs().max() > 1e-4 and got[name].tolist() == pytest.approx(bias.tolist(), abs=1e-9), name
    assert "Applied cp_dtensor ring attention (layout=documents, dynamic over dp x cp = 4 ranks)" in dynamic
    lines = _BALANCE.findall(dynamic)
    assert len(lines) >= 3, dynamic[-3000:]
    for work, ranks, _, received, tokens in lines:
        assert int(ranks) == 4 and int(tokens) == 2 * 256 // 2 and 1.0 <= float(work) < 1.1 and int(received) > 0


def _parse(*overrides: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(CONFIG), *overrides])


def test_dynamic_without_documents_is_refused():
    from cp_dtensor.titan import CPDTensor

    with pytest.raises(ValueError, match=r'dynamic = true .* needs layout = "documents"; got layout = \'striped\''):
        CPDTensor(dynamic=True)  # what the TOML's section builds, on every rank at parse time
    assert CPDTensor(layout="documents", dynamic="true").dynamic is True  # the command line's spelling


@pytest.mark.parametrize(("overrides", "world", "message"), [
    (["--parallelism.pipeline_parallel_degree", "2"], 8, r"pipeline_parallel_degree > 1"),
    (["--parallelism.context_parallel_degree", "1"], 2, r"context_parallel_degree = 1"),
    (["--model.name", "qwen3", "--model.flavor", "debugmodel"], 4,
     r'name = "qwen3" \(dynamic serves the families with block_causal flex flavors, llama3 and deepseek_v3: qwen3 has none'),
    (["--model.converters", "quantize.linear.mx"], 4,
     r"converters \['quantize.linear.mx'\] \(of the converters, dynamic serves quantize.linear.float8\)"),
], ids=["pp", "cp1", "qwen3", "mx"])
def test_unserved_compositions_are_refused_at_start(overrides, world, message):
    from cp_dtensor.titan import check_config

    cfg = _parse(*FLEX, *GRID, "--cp_dtensor.dynamic", "true", *overrides)
    with pytest.raises(ValueError, match=r"dynamic = true is not served with: .*" + message + r".*remove dynamic"):
        check_config(cfg, world_size=world)
    check_config(_parse(*FLEX, *GRID, "--cp_dtensor.dynamic", "true"), world_size=4)  # the served jobs pass
    for served, world in ((["--model.converters", "quantize.linear.float8"], 4),
                          (["--validation.enable", "--compile.enable"], 4), (HSDP, 8),
                          (["--model.name", "deepseek_v3"], 4),
                          (["--model.name", "deepseek_v3", "--parallelism.expert_parallel_degree", "2"], 4)):
        check_config(_parse(*FLEX, *GRID, "--cp_dtensor.dynamic", "true", *served), world_size=world)


TP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
      "--training.steps", "3", "--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
TP_GRID = [*FLEX, *GRID, *TP]  # dp_shard 2 x cp 2 x tp 2: 8 ranks


def _approx_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want) == [1, 2, 3], (what, got, want)
    for step in want:  # grad norms are printed to 4 decimals: rel 1e-4 is their resolution
        assert got[step][0] == pytest.approx(want[step][0], rel=2e-5), (what, step, got[step], want[step])
        assert got[step][1] == pytest.approx(want[step][1], rel=1e-4), (what, step, got[step], want[step])


@slow("a 4-rank and an 8-rank torchtitan job (about 50 s on a quiet 2-core machine)")
def test_documents_under_tp_match_cp1():
    # the static documents layout with sequence parallelism splitting each CP rank's tokens over TP
    ref = torchrun(4, Path(tempfile.mkdtemp(prefix="titan-tp2-cp1-")), *FLEX, *TP,
                   "--parallelism.context_parallel_degree", "1")
    static = reference_run(8, *TP_GRID)  # shared with the next test
    assert "Applied Tensor Parallelism" in static and "Applied cp_dtensor ring attention (layout=documents)" in static
    _approx_equal(step_losses_and_norms(static), step_losses_and_norms(ref), "documents cp 2 x tp 2 vs cp 1 x tp 2")
    want = dict(_validation(ref))
    assert len(want) >= 1 and {s: pytest.approx(v, rel=2e-5) for s, v in _validation(static)} == want


@slow("two 8-rank torchtitan jobs, one shared with the test above (about 35 s more on a quiet 2-core machine)")
def test_dynamic_under_tp_equals_static_documents():
    static = reference_run(8, *TP_GRID)
    dynamic = torchrun(8, Path(tempfile.mkdtemp(prefix="titan-dynamic-tp-")), *TP_GRID, "--cp_dtensor.dynamic", "true")
    _approx_equal(step_losses_and_norms(dynamic), step_losses_and_norms(static), "dynamic vs static, dp 2 x cp 2 x tp 2")
    assert _validation(dynamic) == _validation(static) and len(_validation(static)) >= 1, _validation(dynamic)
    assert "Applied cp_dtensor ring attention (layout=documents, dynamic over dp x cp = 4 ranks)" in dynamic
    lines = _BALANCE.findall(dynamic)  # rank 0 only: one a batch, the TP ranks make the same plan
    assert len(lines) >= 3 + 2, dynamic[-3000:]
    for work, ranks, _, received, tokens in lines:
        assert int(ranks) == 4 and int(tokens) == 2 * 256 // 2 and 1.0 <= float(work) < 1.1 and int(received) > 0
