"""torchtitan 0.2.2: cp_dtensor context parallelism beside pipeline parallelism (Note [CP under pipeline parallelism]).

End-to-end (slow tier; 4 ranks on 2 CPU cores): llama3 debugmodel, fp32, 3 steps from one seed checkpoint;
every PP = 2 x CP = 2 job logs the losses of PP = 2 x CP = 1 (the same stages and microbatches without CP)
to rel 2e-5, and a documents-layout job on the flex flavor those of PP = 1 x CP = 2; the 1F1B job's checkpoint,
resumed at PP = 2 x CP = 1, continues its losses; TP = 2 x CP = 2 x PP = 2 (8 ranks) logs those of the same mesh at
CP = 1. Default tier: the
batch as the schedule splits it (no processes): each microbatch's positions, mask ids and document plan
equal what sharding that microbatch alone gives, and bad PP x CP configurations raise before any collective.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
from _tiers import exhaustive, slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))

import torch  # noqa: E402

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _titan_run import CONFIG, reference_run, seed_checkpoint, step_losses, torchrun  # noqa: E402
from test_titan import _FakeCPMesh  # noqa: E402  the CP mesh shard_cp_batch reads (rank and size only)

STEPS = 3
SAVED_AT = 2  # the 1F1B job saves here; a PP x CP=1 job resumes from it
RTOL = 2e-5
_PP_JOB = slow("a 4-rank pipeline x CP torchtitan run (~60 s on 2 CPU cores)")


def _parse(config: Path, *overrides: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(config), *overrides])


def _pp(schedule: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule]


@pytest.fixture(scope="module")
def seed_ckpt() -> Path:
    return seed_checkpoint()  # the session's llama3 debugmodel seed, shared with test_titan.py


def _from_seed(seed_ckpt: Path, *, save_at: int | None = None) -> list[str]:
    # save_at: also save a full checkpoint after that step (a job that only loads the seed saves nothing)
    save = ["--checkpoint.load_only"] if save_at is None else ["--checkpoint.interval", str(save_at)]
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_ckpt), *save,
            "--training.steps", str(STEPS)]


@pytest.fixture(scope="module")
def pp2_cp1_losses(seed_ckpt) -> list[float]:
    out = reference_run(2, "--parallelism.context_parallel_degree", "1", *_pp("1F1B"), *_from_seed(seed_ckpt))
    losses = step_losses(out, last=STEPS)  # the last stage logs the loss; the first logs -1 per rank (not parsed)
    assert losses[-1] < losses[0], f"the reference run does not train: {losses}"
    return losses


@_PP_JOB
@pytest.mark.parametrize(
    ("schedule", "extra"),
    [("1F1B", []),
     # several stages per rank, the headtail layout and the tiled LM head + loss on the last stage, in one job
     ("Interleaved1F1B", ["--cp_dtensor.layout", "headtail", "--cp_dtensor.sequence_tiling=64"])],
    ids=["1f1b_striped", "interleaved_headtail_tiled"],
)
def test_pp2_cp2_matches_pp2_cp1(schedule, extra, seed_ckpt, pp2_cp1_losses, tmp_path):
    resume = schedule == "1F1B"  # this job also saves after step SAVED_AT, for a resume at CP = 1
    out = torchrun(4, tmp_path, "--parallelism.context_parallel_degree", "2", *_pp(schedule), *extra,
                   *_from_seed(seed_ckpt, save_at=SAVED_AT if resume else None))
    assert "Applied cp_dtensor ring attention" in out
    losses = step_losses(out, last=STEPS)
    assert losses == pytest.approx(pp2_cp1_losses, rel=RTOL), f"PP x CP {losses} vs PP x CP=1 {pp2_cp1_losses}"
    if resume:
        _resume_at_cp1(tmp_path / "checkpoint" / f"step-{SAVED_AT}", losses, tmp_path / "resumed")


def _resume_at_cp1(step_dir: Path, want: list[float], dump: Path) -> None:
    # the PP = 2 x CP = 2 checkpoint (stages, optimizer, data loader, schedule), resumed at PP = 2 x CP = 1 on 2
    # ranks (the same batch degree, 1): the steps after SAVED_AT log the uninterrupted run's losses
    shutil.copytree(step_dir, dump / "checkpoint" / step_dir.name)  # the checkpointer resumes from its newest step
    out = torchrun(2, dump, "--parallelism.context_parallel_degree", "1", *_pp("1F1B"), "--checkpoint.enable",
                   "--checkpoint.load_only", "--training.steps", str(STEPS))
    assert f"Loading the checkpoint from {dump / 'checkpoint' / step_dir.name}" in out
    got = step_losses(out, first=SAVED_AT + 1, last=STEPS)
    assert got == pytest.approx(want[SAVED_AT:], rel=RTOL), f"resumed at CP=1: {got} vs PP x CP=2: {want[SAVED_AT:]}"


@slow("an 8-rank and a 4-rank torchtitan run on 2 CPU cores (~20 s)")
def test_pp2_tp2_cp2_matches_cp1(seed_ckpt, tmp_path):
    # pp 2 x tp 2 x cp 2 (8 ranks) against the same mesh at CP = 1 (4 ranks): the ring runs on each TP rank's
    # heads inside each stage, sequence parallelism splits the CP shard (seq_len / (2 cp tp) per half-chunk)
    mesh = ["--parallelism.tensor_parallel_degree", "2", *_pp("1F1B"), *_from_seed(seed_ckpt)]
    ref = step_losses(torchrun(4, tmp_path / "cp1", "--parallelism.context_parallel_degree", "1", *mesh), last=STEPS)
    out = torchrun(8, tmp_path / "cp2", "--parallelism.context_parallel_degree", "2", *mesh)
    assert "Applied cp_dtensor ring attention" in out
    losses = step_losses(out, last=STEPS)
    assert losses == pytest.approx(ref, rel=RTOL), f"pp2 x tp2 x cp2 {losses} vs pp2 x tp2 {ref}"


@exhaustive("an 8-rank and a 4-rank torchtitan run on 2 CPU cores (~50 s); documents x TP is in the slow tier "
            "without PP (test_titan_dynamic.py)")
def test_pp2_tp2_cp2_documents_matches_cp1(tmp_path):
    # layout = "documents" (Note [Documents under tensor parallelism]) in each stage's microbatches, fresh init
    # (one replica: Note [torchtitan on CPU] 7). Measured: 8.17441 / 8.01111 / 7.55807 both
    mesh = ["--model.flavor", "debugmodel_flex_attn", "--parallelism.tensor_parallel_degree", "2", *_pp("1F1B"),
            "--training.steps", str(STEPS)]
    ref = step_losses(torchrun(4, tmp_path / "cp1", "--parallelism.context_parallel_degree", "1", *mesh), last=STEPS)
    out = torchrun(8, tmp_path / "cp2", "--parallelism.context_parallel_degree", "2", "--cp_dtensor.layout",
                   "documents", *mesh)
    assert "Applied cp_dtensor ring attention (layout=documents)" in out
    assert step_losses(out, last=STEPS) == pytest.approx(ref, rel=RTOL)


@slow("an 8-rank and a 4-rank torchtitan run on 2 CPU cores")
def test_4d_fsdp2_cp2_pp2_matches_cp1(seed_ckpt, tmp_path):
    # dp_shard 2 x cp 2 x pp 2 (8 ranks): two data-parallel groups read different data, so the reference is the
    # same mesh at CP = 1 (dp_shard 2 x pp 2); FSDP spans dp_shard x cp inside each stage
    mesh = ["--parallelism.data_parallel_shard_degree", "2", *_pp("1F1B"), *_from_seed(seed_ckpt)]
    ref = step_losses(reference_run(4, "--parallelism.context_parallel_degree", "1", *mesh), last=STEPS)
    out = torchrun(8, tmp_path, "--parallelism.context_parallel_degree", "2", *mesh)
    losses = step_losses(out, last=STEPS)
    assert losses == pytest.approx(ref, rel=RTOL), f"dp2 x cp2 x pp2 {losses} vs dp2 x pp2 {ref}"


def _validation_losses(out: str) -> list[float]:
    # the last stage logs the validation loss; the first logs -1 / tokens (not parsed)
    found: dict[int, set[float]] = {}
    for step, loss in re.findall(r"validate step:\s*(\d+)\s+loss:\s*([0-9.]+)", out):
        found.setdefault(int(step), set()).add(float(loss))
    assert sorted(found) == [1, 2] and all(len(v) == 1 for v in found.values()), f"validation losses: {found}"
    return [found[1].pop(), found[2].pop()]


def _train_losses(out: str) -> list[float]:
    return step_losses("\n".join(line for line in out.splitlines() if "validate step" not in line), last=STEPS)


@_PP_JOB
def test_pp2_cp2_documents_matches_pp1_cp2(seed_ckpt, tmp_path):
    # the flex flavor's block_causal masks, planned per batch: every stage rebuilds its microbatch's plan; the
    # validator runs the same schedule. GPipe here, so the two tests cover the three schedules
    flex = ["--model.flavor", "debugmodel_flex_attn", "--cp_dtensor.layout", "documents",
            "--parallelism.context_parallel_degree", "2", "--validation.enable", "--validation.freq", "2",
            "--validation.steps", "2", *_from_seed(seed_ckpt)]
    ref_out = torchrun(2, tmp_path / "pp1", *flex)
    out = torchrun(4, tmp_path / "pp2", *flex, *_pp("GPipe"))
    assert "Applied cp_dtensor ring attention (layout=documents)" in out
    ref, losses = _train_losses(ref_out), _train_losses(out)
    assert losses == pytest.approx(ref, rel=RTOL), f"PP=2 x CP=2 {losses} vs PP=1 x CP=2 {ref}"
    ref_val, val = _validation_losses(ref_out), _validation_losses(out)
    assert val == pytest.approx(ref_val, rel=RTOL), f"validation PP=2 x CP=2 {val} vs PP=1 x CP=2 {ref_val}"


class _Echo(torch.nn.Module):
    def forward(self, tokens, attention_masks=None, positions=None):
        return tokens, attention_masks, positions


def _doc_ids(batch: int, n: int) -> torch.Tensor:
    # every row its own documents: row b starts one at every multiple of (5 + 3 b) and at 2 b + 1
    ids = torch.zeros(batch, n, dtype=torch.long)
    for b in range(batch):
        for s in sorted({2 * b + 1, *range(5 + 3 * b, n, 5 + 3 * b)}):
            ids[b, s:] += 1
    return ids


@pytest.mark.parametrize(("layout", "masks"), [(layout, masks) for layout in ("striped", "headtail", "documents")
                                               for masks in ("none", "one", "dict")
                                               if (layout, masks) != ("documents", "none")])  # refused: test_titan.py
def test_schedule_split_equals_sharding_each_microbatch(layout, masks):
    # shard_cp_batch(pipeline=True), split into microbatches as torch's pipeline schedule splits the step's
    # arguments, then rebuilt by a stage's pre-hook: each microbatch's tokens, positions, masks and document
    # plan equal those of sharding that microbatch's rows alone (the reference: no pipeline, no split)
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from cp_dtensor.core.plan.documents import DocumentLayout
    from cp_dtensor.titan.v02.attention import shard_cp_batch
    from cp_dtensor.titan.v02.flex import RingMask
    from cp_dtensor.titan.v02.pipeline import attach_stage_masks

    batch, n, world, n_mb = 4, 48, 2, 2
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randint(0, 1000, (batch, n), generator=g), torch.randint(0, 1000, (batch, n), generator=g)
    ids = _doc_ids(batch, n)

    def kwargs_of(rows):
        if masks == "none":
            return {}
        if masks == "one":
            return {"attention_masks": RingMask.make(ids[rows])}
        return {"attention_masks": {"basic_mask": RingMask.make(ids[rows], is_causal=False),
                                    "sliding_window_mask": RingMask.make(ids[rows], window_size=(6, 0))}}

    stage = _Echo()
    attach_stage_masks(stage)
    for rank in range(world):
        mesh = _FakeCPMesh(rank, world)
        x, y, kw = shard_cp_batch(inputs, labels, kwargs_of(slice(None)), mesh, torch.device("cpu"), layout=layout,
                                  pipeline=True)
        args_mb, kwargs_mb = split_args_kwargs_into_chunks((x,), kw, n_mb)
        labels_mb = torch.tensor_split(y, n_mb)
        assert len(args_mb) == len(kwargs_mb) == n_mb
        for i in range(n_mb):
            rows = slice(i * batch // n_mb, (i + 1) * batch // n_mb)
            rx, ry, rkw = shard_cp_batch(inputs[rows], labels[rows], kwargs_of(rows), mesh, torch.device("cpu"),
                                         layout=layout)
            tokens, got_masks, pos = stage(*args_mb[i], **kwargs_mb[i])
            assert torch.equal(tokens, rx) and torch.equal(labels_mb[i], ry)
            assert torch.equal(pos, rkw["positions"].expand_as(pos)) and pos.shape == rx.shape
            if masks == "none":
                assert got_masks is None
                continue
            ref_masks = rkw["attention_masks"]
            pairs = [(got_masks, ref_masks)] if masks == "one" else [(got_masks[k], ref_masks[k]) for k in ref_masks]
            for got, ref in pairs:
                assert isinstance(got, RingMask) and torch.equal(got.ids, ref.ids)
                assert (got.is_causal, got.window_size) == (ref.is_causal, ref.window_size)
                if layout == "documents":
                    assert isinstance(got.plan, DocumentLayout) and got.plan.key == ref.plan.key
                    assert torch.equal(got.plan.order, ref.plan.order) and got.plan.windows == ref.plan.windows
                else:
                    assert got.plan is None and ref.plan is None


def test_cp1_flex_masks_split_by_rows():
    # CP = 1 with a flex flavor: nothing shards the batch, so the stage's get_attention_masks gives the travelling
    # form; each microbatch's rebuilt mask holds that microbatch's rows of the full ids
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from cp_dtensor.titan.v02.flex import RingMask
    from cp_dtensor.titan.v02.pipeline import attach_stage_masks, schedule_masks

    ids = _doc_ids(4, 24)
    get_masks = schedule_masks(lambda: {"basic_mask": RingMask.make(ids), "window": RingMask.make(ids, window_size=(3, 0))})
    stage = _Echo()
    attach_stage_masks(stage)
    tokens = torch.arange(4 * 24).view(4, 24)
    args_mb, kwargs_mb = split_args_kwargs_into_chunks((tokens,), {"attention_masks": get_masks()}, 2)
    for i in range(2):
        got_tokens, masks, _ = stage(*args_mb[i], **kwargs_mb[i])
        assert torch.equal(got_tokens, tokens[2 * i : 2 * i + 2])
        assert torch.equal(masks["basic_mask"].ids, ids[2 * i : 2 * i + 2]) and masks["basic_mask"].plan is None
        assert masks["window"].window_size == (3, 0) and torch.equal(masks["window"].ids, ids[2 * i : 2 * i + 2])


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["--parallelism.pipeline_parallel_microbatch_size", "3"], 4,
         r"local_batch_size \(2\) must be a multiple of \[parallelism\] pipeline_parallel_microbatch_size \(3\)"),
        (["--validation.enable", "--validation.local_batch_size", "1"], 4,
         r"\[validation\] local_batch_size \(1\) and seq_len \(256\) must equal \[training\]'s \(2, 256\)"),
        (["--parallelism.pipeline_parallel_degree", "5", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
         10, r"cuts llama3 debugmodel into 10 stages, more than its 6 layers \+ embedding \+ head"),
        (["--training.seq_len", "250"], 4, r"seq_len \(250\) must be divisible by 2 \* context_parallel_degree \* "
                                          r"tensor_parallel_degree = 4"),
        (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "260"], 8,
         r"seq_len \(260\) must be divisible by 2 \* context_parallel_degree \* tensor_parallel_degree = 8"),
        (["--parallelism.pipeline_parallel_degree", "4"], 8,
         r"the 1F1B schedule needs at least as many microbatches as stages \(4\); local_batch_size \(2\) / "
         r"pipeline_parallel_microbatch_size \(1\) = 2 microbatches\. Use local_batch_size >= 4"),
        (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--training.local_batch_size", "5"], 4,
         r"Interleaved1F1B schedule runs microbatches in rounds of pipeline_parallel_degree \(2\) and needs their "
         r"number to be a multiple of the rounds \(2\); .* = 5 microbatches"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"], 4,
         r"pipeline_parallel_layers_per_stage = 2 cuts llama3 debugmodel's 6 layers into 4 stages, which does not fit "
         r"pipeline_parallel_degree = 2 with the 1F1B schedule: it runs exactly 1 stage\(s\) on every rank.*"
         r"looped schedule \(Interleaved1F1B\)"),
        (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B", "--parallelism.pipeline_parallel_layers_per_stage",
          "2", "--parallelism.pipeline_parallel_first_stage_less_layers", "4"], 4,
         r"torchtitan cannot cut llama3 debugmodel \(6 layers\) into 6 stages: input_weight \(4\) exceeds .*"
         r"Use fewer stages or smaller pipeline_parallel_first_stage_less_layers"),
        (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--parallelism.expert_parallel_degree", "8"], 8,
         r"expert_parallel_degree \(8\) does not divide the ranks torchtitan gives it: EP borrows from "
         r"data_parallel_shard_degree \(2\) x context_parallel_degree \(2\) = 4 ranks"),
    ],
    ids=["microbatch", "validation_shape", "stage_cut", "seq_len", "seq_len_tp", "1f1b_microbatches",
         "interleaved_rounds", "layers_per_stage", "first_stage_weight", "ep_degree"],
)
def test_bad_pipeline_config_is_rejected(overrides, world, message):
    # check_config runs on every rank before torchtitan builds a mesh (CPTrainer.init_distributed)
    from cp_dtensor.titan import check_config

    cfg = _parse(CONFIG, *_pp("1F1B"), *overrides)
    with pytest.raises(ValueError, match=message):
        check_config(cfg, world_size=world)


_WHOLE_CUT = [["tok_embeddings", "layers.0", "layers.1", "layers.2"], ["layers.3", "layers.4", "layers.5", "norm", "output"]]


@pytest.mark.parametrize(
    ("cut", "message"),
    [([["tok_embeddings", "layers.0.attention"], ["layers.0.feed_forward", *_WHOLE_CUT[0][2:], *_WHOLE_CUT[1]]],
      r"stage 0 names 'layers.0.attention', which splits a module torchtitan cannot split: .*\(layers.0 \.\. "
      r"layers.5 of llama3 debugmodel.* Name the whole layer"),
     ([_WHOLE_CUT[0], ["layers.2", *_WHOLE_CUT[1]]], r"names 'layers.2' in stages 0 and 1: .* Name it once"),
     ([_WHOLE_CUT[0][:2], _WHOLE_CUT[1]], r"leaves out layers.1, layers.2 of llama3 debugmodel: torchtitan drops"),
     ([_WHOLE_CUT[0], _WHOLE_CUT[1][:1], _WHOLE_CUT[1][1:], ["layers.6"]], r"names 'layers.6', which splits"),
     ([_WHOLE_CUT[0][:2], _WHOLE_CUT[0][2:], _WHOLE_CUT[1][:2], _WHOLE_CUT[1][2:]],
      r"module_fqns_per_model_part lists 4 stages, which does not fit pipeline_parallel_degree = 2 with the 1F1B "
      r"schedule: it runs exactly 1 stage")],
    ids=["part_of_a_layer", "twice", "left_out", "no_such_layer", "two_stages_per_rank_1f1b"],
)
def test_bad_stage_list_is_rejected(cut, message):
    # torchtitan keeps only the named whole modules of each stage: these would train another model or crash late
    from cp_dtensor.titan import check_config

    cfg = _parse(CONFIG, *_pp("1F1B"))
    cfg.parallelism.module_fqns_per_model_part = cut
    with pytest.raises(ValueError, match=message):
        check_config(cfg, world_size=4)
    cfg.parallelism.module_fqns_per_model_part = _WHOLE_CUT  # the same job with a whole cut starts
    check_config(cfg, world_size=4)


def test_pipeline_with_cp_is_served():
    from cp_dtensor.titan import check_config

    check_config(_parse(CONFIG, *_pp("Interleaved1F1B"), "--cp_dtensor.sequence_tiling=64"), world_size=4)
    check_config(_parse(CONFIG, *_pp("GPipe"), "--model.flavor", "debugmodel_flex_attn", "--cp_dtensor.layout",
                        "documents"), world_size=4)
    # two stages of 2 layers (+ the embedding / head) per rank; 4 microbatches for the 1F1B schedule's 4 stages
    check_config(_parse(CONFIG, *_pp("Interleaved1F1B"), "--parallelism.pipeline_parallel_layers_per_stage", "2"),
                 world_size=4)
    check_config(_parse(CONFIG, *_pp("1F1B"), "--parallelism.pipeline_parallel_degree", "4",
                        "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2"), world_size=16)
