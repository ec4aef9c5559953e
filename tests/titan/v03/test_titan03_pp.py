"""torchtitan 0.3: cp_dtensor context parallelism beside pipeline parallelism.

torchtitan 0.3's trainer splits the batch into microbatches first and then runs ``post_dataloading_process``
on each (masks from the microbatch's positions, then ``prepare_context_parallel_input``: the plugin's
``shard_cp_batch``), so every microbatch carries its own masks and document plan to every stage. The
reference is one rank without PP or CP, both without a seed checkpoint: llama3 debugmodel, fp32, 3 steps,
losses to 2e-5 (slow tier).
"""

from __future__ import annotations

import pytest
from _tiers import slow

from _titan_run import skip_unless_titan, step_losses, torchrun_03

skip_unless_titan((0, 3))

STEPS = 3
ATOL = 2e-5
PP = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", str(STEPS), "--training.seq_len",
      "128", "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32",
      "--training.disable_cuda_graphs",  # torchtitan 0.3 refuses its CUDA graphs with PP
      "--parallelism.pipeline_parallel_degree", "2"]


def _config(*flags: str):
    from cp_dtensor.titan.v03.main import PluginConfigManager

    return PluginConfigManager().parse_args([*PP, *flags])


def test_pipeline_with_cp_is_served():
    from cp_dtensor.titan.v03 import check_config

    check_config(_config("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                         "--parallelism.context_parallel_degree", "2", "--cp_dtensor.sequence_tiling=64"), world_size=4)


@slow("a 1-rank and a 4-rank torchrun job (~30 s and ~50 s on 2 CPU cores)")
def test_pp2_cp2_matches_one_rank(tmp_path):
    assert PP[-2:] == ["--parallelism.pipeline_parallel_degree", "2"]
    ref = step_losses(torchrun_03(1, tmp_path / "one", *PP[:-2]), last=STEPS)
    assert ref[-1] < ref[0], f"the reference run does not train: {ref}"
    # no seed checkpoint: the stages start from the one-rank model's weights (Note [torchtitan on CPU] 7); the
    # headtail layout and the tiled LM head + loss on the last stage in the same job
    out = torchrun_03(4, tmp_path / "cp2", *PP, "--parallelism.pipeline_parallel_schedule", "1F1B",
                      "--parallelism.context_parallel_degree", "2", "--cp_dtensor.layout", "headtail",
                      "--cp_dtensor.sequence_tiling=64")
    assert "Applied cp_dtensor ring attention (layout=headtail, cp=2)" in out
    assert "pipeline stages initialised from one CPU replica of the whole model" in out
    losses = step_losses(out, last=STEPS)
    assert losses == pytest.approx(ref, abs=ATOL, rel=0), f"PP=2 x CP=2 {losses} vs one rank {ref}"
