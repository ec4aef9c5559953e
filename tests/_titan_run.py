"""The one torchrun launcher and step-loss parser for end-to-end torchtitan runs.

Used by test_titan*.py, test_float8.py and scripts/benchmarks/fp8_loss_curve.py. Every job runs
``python -m torch.distributed.run --standalone`` on this machine's CPUs, one intra-op thread per rank,
offline, with the repo on PYTHONPATH; the output of all ranks comes back as one string.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import _titan_zygote

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "titan_configs" / "llama3_debug.toml"
TRAIN = ("-m", "cp_dtensor.titan.train")  # the plugin's launcher (Note [torchtitan on CPU])
_STEP_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)")


def titan_version() -> tuple[int, ...] | None:
    """The installed torchtitan's (major, minor, patch); None when it is not installed."""
    try:
        text = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split("+")[0].split(".")[:3])


def skip_unless_titan(series: tuple[int, int]) -> None:
    """Skip the calling test module unless torchtitan ``series`` (major, minor) is installed: the 0.2.2 TOML
    plugin's tests run in the dev leg, 0.3's (test_titan03.py) where torchtitan 0.3 is installed."""
    import pytest

    have = titan_version()
    if have is None:
        pytest.skip("torchtitan is not installed", allow_module_level=True)
    if have[:2] != series:
        pytest.skip(f"these tests are for torchtitan {series[0]}.{series[1]}; this environment has "
                    f"{'.'.join(map(str, have))}", allow_module_level=True)


class TorchrunFailed(AssertionError):
    """A job that had to succeed exited non-zero; the message ends with the tail of its output."""


def _launch(nproc: int, args: Sequence[str], *, launcher_args: Sequence[str] = (), timeout: float | None
            ) -> tuple[int, str]:
    """One job: ``args`` is the entry (``-m module`` or a script) and its flags. The plugin's own entry runs on
    ranks forked from a pre-imported zygote (tests/_titan_zygote.py); any other entry, launcher arguments, or
    CP_DTENSOR_TITAN_FORK=0, through torchrun's fresh interpreters."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if tuple(args[:2]) == _titan_zygote.ENTRY and not launcher_args and _titan_zygote.enabled():
        return _titan_zygote.run_job(nproc, args[1], list(args[2:]), env=env, cwd=REPO, timeout=timeout)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *launcher_args, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def run_torchrun(nproc: int, dump: Path, *overrides: str, entry: Sequence[str] = TRAIN, config: Path = CONFIG,
                 timeout: float | None = 420, launcher_args: Sequence[str] = ()) -> tuple[int, str]:
    """Run one training job of ``nproc`` ranks; returns its exit code and the output of every rank."""
    args = [*entry, "--job.config_file", str(config), "--job.dump_folder", str(dump), *overrides]
    return _launch(nproc, args, launcher_args=launcher_args, timeout=timeout)


def torchrun(nproc: int, dump: Path, *overrides: str, **kwargs) -> str:
    """:func:`run_torchrun` for a job that must succeed: its output, or :class:`TorchrunFailed`."""
    code, out = run_torchrun(nproc, dump, *overrides, **kwargs)
    if code != 0:
        raise TorchrunFailed(f"exit {code}: {nproc} ranks, {' '.join(overrides)}\n...\n{out[-6000:]}")
    return out


_REFERENCES: dict[tuple, str] = {}


def reference_run(nproc: int, *overrides: str, config: Path = CONFIG) -> str:
    """The output of a job that only serves as a reference (its losses are compared, its dump folder is not
    read): run once per pytest run for the same ranks, TOML and overrides, whichever test asks first."""
    key = (nproc, str(config), overrides)
    if key not in _REFERENCES:
        _REFERENCES[key] = torchrun(nproc, Path(tempfile.mkdtemp(prefix="titan-reference-")), *overrides,
                                    config=config)
    return _REFERENCES[key]


_SEEDS: dict[tuple, Path] = {}


def seed_checkpoint(*overrides: str, config: Path = CONFIG) -> Path:
    """The step-0 checkpoint (fp32 weights before any step) of one rank's job with ``overrides``, made once a
    pytest run, for every test that starts from it."""
    key = (str(config), overrides)
    if key not in _SEEDS:
        dump = Path(tempfile.mkdtemp(prefix="titan-seed-"))
        torchrun(1, dump, "--parallelism.context_parallel_degree", "1", *overrides, "--checkpoint.enable",
                 "--checkpoint.create_seed_checkpoint", config=config)
        step0 = dump / "checkpoint" / "step-0"
        assert (step0 / ".metadata").is_file(), f"no seed checkpoint in {dump}"
        _SEEDS[key] = step0
    return _SEEDS[key]


def step_losses(out: str, *, first: int = 1, last: int | None = None) -> list[float]:
    """The losses torchtitan logged for steps first..last (last: the newest logged); every step must be
    there and every rank that logged it must agree."""
    by_step: dict[int, set[float]] = {}
    for step, loss in _STEP_LINE.findall(out):
        by_step.setdefault(int(step), set()).add(float(loss))
    last = max(by_step, default=first - 1) if last is None else last
    assert sorted(by_step) == list(range(first, last + 1)), f"steps logged: {sorted(by_step)}\n{out[-3000:]}"
    assert all(len(v) == 1 for v in by_step.values()), f"ranks disagree on the loss: {by_step}"
    return [by_step[s].pop() for s in range(first, last + 1)]



_STEP_NORM = re.compile(r"step:\s*(\d+)\s+loss:\s*([0-9.]+)\s+grad_norm:\s*([0-9.]+)")


def step_losses_and_norms(out: str) -> dict[int, tuple[float, float]]:
    """(loss, grad_norm) of each logged step; every rank that logged it must agree."""
    by_step: dict[int, set] = {}
    for step, loss, norm in _STEP_NORM.findall(out):
        by_step.setdefault(int(step), set()).add((float(loss), float(norm)))
    assert all(len(v) == 1 for v in by_step.values()), f"ranks disagree: {by_step}"
    return {s: v.pop() for s, v in sorted(by_step.items())}

# ---- torchtitan 0.3: --module / --config instead of a TOML (tests/titan/v03/test_titan03.py) ----

def run_torchrun_03(nproc: int, dump: Path, *args: str, entry: Sequence[str] = TRAIN, timeout: float | None = 420,
                    ) -> tuple[int, str]:
    """Run one torchtitan 0.3 job of ``nproc`` ranks (``args``: --module, --config and flags); returns its exit
    code and the output of every rank."""
    return _launch(nproc, [*entry, *args, "--dump_folder", str(dump), "--metrics.disable_color_printing"],
                   timeout=timeout)


def torchrun_03(nproc: int, dump: Path, *args: str, **kwargs) -> str:
    """:func:`run_torchrun_03` for a job that must succeed: its output, or :class:`TorchrunFailed`."""
    code, out = run_torchrun_03(nproc, dump, *args, **kwargs)
    if code != 0:
        raise TorchrunFailed(f"exit {code}: {nproc} ranks, {' '.join(args)}\n...\n{out[-6000:]}")
    return out
