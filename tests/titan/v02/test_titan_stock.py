"""Stock ``python -m torchtitan.train`` with a ``[cp_dtensor]`` TOML: the ring, or a refusal at start --
never torch's own CP (Note [Stock torchtitan.train with a [cp_dtensor] section] in titan/v02/spec.py).

Measured before the refusal existed: ``--model.name llama3_ft`` (torchtitan's fault-tolerant llama3,
which the plugin does not serve) with llama3_debug.toml at CP = 2 logged "Applied Context Parallel to
the model" -- torch's CP -- and then failed on gloo only because of an unrelated CPU limitation. The
ring itself under stock torchtitan's main is tested in test_titan.py (test_stock_torchtitan_main_with_custom_import).
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

from _tiers import slow  # noqa: E402

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _titan_run import CONFIG, run_torchrun  # noqa: E402  the one launcher

UNSERVED = r'name = "llama3_ft" \(cp_dtensor serves llama3, qwen3, deepseek_v3, llama4, gpt_oss\)'


def _parse(config: Path, *overrides: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(config), *overrides])


def test_cp_dtensor_section_without_config_module_stops_the_parse(tmp_path):
    toml = tmp_path / "no_config_module.toml"
    toml.write_text("\n".join(line for line in CONFIG.read_text().splitlines() if "custom_config_module" not in line))
    with pytest.raises(ValueError, match=r"Invalid field names .*'cp_dtensor'"):
        _parse(toml)


def test_served_families_get_the_ring_and_other_models_refuse_cp():
    import torchtitan.protocols.train_spec as titan_specs

    from cp_dtensor.titan import FAMILIES
    from cp_dtensor.titan.v02.spec import _refusing_cp

    for family in FAMILIES:
        assert getattr(titan_specs.get_train_spec(family).parallelize_fn, "_cp_dtensor", False), family
    dims = SimpleNamespace(world_size=2)
    with pytest.raises(ValueError, match=UNSERVED):  # before torchtitan's parallelize touches the model
        titan_specs.get_train_spec("llama3_ft").parallelize_fn(None, dims, _parse(CONFIG, "--model.name", "llama3_ft"))

    def titan_fn(model, parallel_dims, job_config):
        return "torchtitan's own"

    # untouched: CP = 1, or no [cp_dtensor] section (a job that never asked for the plugin)
    assert _refusing_cp(titan_fn)(None, dims, _parse(CONFIG, "--model.name", "llama3_ft",
                                                     "--parallelism.context_parallel_degree", "1")) == "torchtitan's own"
    bare = SimpleNamespace(parallelism=SimpleNamespace(context_parallel_degree=2))
    assert _refusing_cp(titan_fn)(None, dims, bare) == "torchtitan's own"


@slow("stock torchtitan main under torchrun: ~12 s")
def test_stock_main_refuses_an_unserved_model_on_every_rank(tmp_path):
    # torchtitan's own main and Trainer; the launcher imports cp_dtensor.titan first only because this
    # machine has no triton (Note [torchtitan on CPU]) -- with triton the TOML's custom_config_module does it
    launcher = tmp_path / "stock_torchtitan_train.py"
    launcher.write_text(textwrap.dedent("""\
        import runpy
        import cp_dtensor.titan  # noqa: F401
        runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    """))
    code, out = run_torchrun(2, tmp_path / "dump", "--model.name", "llama3_ft", entry=[str(launcher)], timeout=180)
    assert code != 0
    assert "Applied Context Parallel" not in out, "torch's own CP was applied"
    assert len(re.findall(r"\[rank(\d)\]: ValueError: cp_dtensor context parallelism does not support: \[model\] "
                          + UNSERVED, out)) == 2, out[-3000:]
