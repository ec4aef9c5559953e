"""End-to-end: torchtitan 0.3's config-registry trainer with cp_dtensor's ring, on CPU ranks under torchrun.

    torchrun --nproc_per_node P -m cp_dtensor.titan.train --module FAMILY --config FAMILY_debugmodel \
        --parallelism.context_parallel_degree P

Reference: the same command at CP = 1 on one rank. The plugin fixes the seed (torchtitan 0.3 draws a new one
per run otherwise) and, on CPU, initialises the weights on an unsharded replica, so both runs start from the
same weights (Note [torchtitan 0.3 on CPU]). The runs here are fp32 (``--training.mixed_precision_param
float32``; torchtitan's default is bf16 parameters under FSDP) and short (3 steps, seq_len 128, batch 1), and
the logged losses must agree within 2e-5 (5 printed decimals). Measured (llama3, fp32): CP = 2 equals
CP = 1 to every printed digit; with bf16 parameters they differ by up to 7e-5 (bf16 rounding of a
different reduction order), which is why the comparison runs in fp32.
Skipped unless torchtitan 0.3 is installed (CI's newest leg); the 0.2.2 TOML plugin has test_titan*.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _titan_run import run_torchrun_03, skip_unless_titan, step_losses, torchrun_03

skip_unless_titan((0, 3))

STEPS = 3
ATOL = 2e-5
SMALL = ["--training.steps", str(STEPS), "--training.seq_len", "128", "--training.local_batch_size", "1",
         "--training.mixed_precision_param", "float32"]
STOCK = ("-m", "torchtitan.train")  # torchtitan's own main, with the plugin named as the --module

_SLOW = pytest.mark.skipif(os.environ.get("CP_DTENSOR_SLOW") != "1",
                           reason="more torchrun jobs on 2 CPU cores (~40 s each); set CP_DTENSOR_SLOW=1")


def _run(nproc: int, dump: Path, family: str, *flags: str, entry=None) -> str:
    args = ["--module", family, "--config", f"{family}_debugmodel", "--parallelism.context_parallel_degree",
            str(nproc), *SMALL, *flags]
    return torchrun_03(nproc, dump, *args, **({} if entry is None else {"entry": entry}))


def _losses(out: str) -> list[float]:
    return step_losses(out, last=STEPS)


def _assert_close(losses: list[float], ref: list[float]) -> None:
    assert losses == pytest.approx(ref, abs=ATOL, rel=0), f"CP losses {losses} vs CP = 1 losses {ref}"


_CP1: dict[str, list[float]] = {}


def _cp1(family: str, tmp_path_factory) -> list[float]:
    """The CP = 1 losses of ``family``'s debug model, one run per session."""
    if family not in _CP1:
        out = _run(1, tmp_path_factory.mktemp(f"{family}_cp1"), family)
        assert "Applied cp_dtensor ring attention (layout=striped, cp=1)" in out
        losses = _losses(out)
        assert losses[-1] < losses[0], f"the reference run does not train: {losses}"
        _CP1[family] = losses
    return _CP1[family]


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cp2_matches_cp1(family, tmp_path, tmp_path_factory):
    out = _run(2, tmp_path, family)
    assert "Applied cp_dtensor ring attention (layout=striped, cp=2)" in out
    _assert_close(_losses(out), _cp1(family, tmp_path_factory))


@_SLOW
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_moe_families_cp2_match_cp1(family, tmp_path, tmp_path_factory):
    out = _run(2, tmp_path, family)
    assert "Applied cp_dtensor ring attention (layout=striped, cp=2)" in out
    _assert_close(_losses(out), _cp1(family, tmp_path_factory))


@_SLOW
@pytest.mark.parametrize("flags", [["--cp_dtensor.layout", "headtail"], ["--cp_dtensor.kv_exchange", "allgather"]],
                         ids=["headtail", "allgather"])
def test_cp2_options_match_cp1(flags, tmp_path, tmp_path_factory):
    _assert_close(_losses(_run(2, tmp_path, "llama3", *flags)), _cp1("llama3", tmp_path_factory))


def test_stock_main_with_the_plugin_as_module(tmp_path, tmp_path_factory):
    # torchtitan's own main: `--module cp_dtensor.titan` makes its ConfigManager import the plugin's config
    # registry, whose configs build cp_dtensor's trainer; contiguous layout, to cover a third layout
    args = ["--module", "cp_dtensor.titan", "--config", "llama3_debugmodel", "--parallelism.context_parallel_degree",
            "2", "--cp_dtensor.layout", "contiguous", *SMALL]
    out = torchrun_03(2, tmp_path, *args, entry=STOCK)
    assert "Applied cp_dtensor ring attention (layout=contiguous, cp=2)" in out
    _assert_close(_losses(out), _cp1("llama3", tmp_path_factory))


def test_bad_config_fails_on_every_rank_at_start(tmp_path):
    # stock main, the plugin named: a backend the ring does not run under is refused before any collective
    args = ["--module", "cp_dtensor.titan", "--config", "llama3_debugmodel", "--parallelism.context_parallel_degree",
            "2", "--parallelism.spmd_backend", "spmd_types", *SMALL]
    code, out = run_torchrun_03(2, tmp_path, *args, entry=STOCK, timeout=300)
    assert code != 0
    assert "Applied cp_dtensor ring attention" not in out and "step:  1" not in out
    assert out.count('--parallelism.spmd_backend spmd_types (cp_dtensor runs under "partial_dtensor"') >= 2, out[-3000:]


# ---- in-process: the config the plugin builds and its start-up checks (no ranks started) ----

def _config(family: str = "llama3", *flags: str):
    from cp_dtensor.titan.v03.main import PluginConfigManager

    return PluginConfigManager().parse_args(["--module", family, "--config", f"{family}_debugmodel", *flags])


def test_plugin_config_defaults_and_flags(capsys):
    from cp_dtensor.titan.v03 import CPTrainer

    cfg = _config()
    assert isinstance(cfg, CPTrainer.Config)
    assert cfg.parallelism.spmd_backend == "partial_dtensor" and cfg.debug.seed == 42
    assert cfg.cp_dtensor.layout == "striped" and cfg.cp_dtensor.kv_exchange == "ring"
    if not Path("tests/assets/c4_test").exists():  # torchtitan's test assets are not pip-installed
        assert cfg.dataloader.dataset == "cp_dtensor_tiny" and cfg.hf_assets_path.endswith("assets/tokenizer")
    cfg = _config("qwen3", "--cp_dtensor.layout", "headtail", "--debug.seed", "7", "--cp_dtensor.kv_exchange",
                  "allgather")
    assert (cfg.cp_dtensor.layout, cfg.cp_dtensor.kv_exchange, cfg.debug.seed) == ("headtail", "allgather", 7)
    with pytest.raises(SystemExit):  # tyro reports the section's __post_init__ error and exits
        _config("llama3", "--cp_dtensor.layout", "zigzag")
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())  # tyro wraps its message in a box
    assert "layout must be one of striped, headtail, contiguous; got 'zigzag'" in err


@pytest.mark.parametrize(("flags", "world", "message"), [
    (["--parallelism.context_parallel_degree", "2", "--parallelism.spmd_backend", "full_dtensor"], 2,
     r'spmd_backend full_dtensor \(cp_dtensor runs under "partial_dtensor"'),
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "130"], 2,
     r"--training.seq_len \(130\) does not fit: the striped layout on 2 CP ranks"),
    (["--parallelism.context_parallel_degree", "2", "--cp_dtensor.layout", "headtail", "--training.seq_len", "134"], 2,
     r"headtail layout on 2 CP ranks needs a multiple of 4"),
    (["--parallelism.context_parallel_degree", "3"], 4, r"context_parallel_degree \(3\) must be >= 1 and divide"),
    (["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"], 4,
     r"tensor_parallel_degree > 1 \(not yet on torchtitan 0.3\)"),
])
def test_start_up_checks(flags, world, message):
    from cp_dtensor.titan.v03 import check_config

    with pytest.raises(ValueError, match=message):
        check_config(_config("llama3", *flags), world_size=world)
