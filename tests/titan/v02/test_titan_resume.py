"""torchtitan runs resumed at another CP degree: saved at CP=2 after step 2, resumed at CP=1 and
at CP=4, steps 3-4 must log the losses of the uninterrupted CP=2 run (rel 1e-5, the
tolerance of test_titan.py; measured here: identical to the printed 5 decimals). Plus the batch-degree
check of cp_dtensor.titan.resume against hand-written checkpoints."""

from __future__ import annotations

import importlib.util
import pickle
import shutil
import types
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _tiers import slow

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from cp_dtensor.titan.v02.resume import check_resume, checkpoint_to_resume, saved_batch_degree  # noqa: E402
from _titan_run import run_torchrun, step_losses  # noqa: E402  the one launcher for every end-to-end test
from test_titan import _torchrun  # noqa: E402

STEPS, SAVED_AT, RTOL = 4, 2, 1e-5


def _losses(out: str, *, first: int = 1) -> list[float]:
    """Steps first..STEPS from torchtitan's step log lines; every rank must log the same loss."""
    return step_losses(out, first=first, last=STEPS)


@pytest.fixture(scope="module")
def cp2_run(tmp_path_factory) -> tuple[Path, list[float]]:
    """An uninterrupted CP=2 run of 4 steps that saves a full checkpoint after step 2."""
    dump = tmp_path_factory.mktemp("cp2")
    out = _torchrun(2, dump, "--parallelism.context_parallel_degree", "2", "--training.steps", str(STEPS),
                    "--checkpoint.enable", "--checkpoint.interval", str(SAVED_AT))
    return dump / "checkpoint" / f"step-{SAVED_AT}", _losses(out)


def _resume(cp: int, cp2_run, tmp_path: Path, *extra: str) -> None:
    step_dir, want = cp2_run
    dump = tmp_path / f"cp{cp}"
    shutil.copytree(step_dir, dump / "checkpoint" / step_dir.name)  # the checkpointer resumes from its newest step
    out = _torchrun(cp, dump, "--parallelism.context_parallel_degree", str(cp), "--training.steps", str(STEPS),
                    "--checkpoint.enable", "--checkpoint.interval", "100", *extra)
    assert f"Loading the checkpoint from {dump / 'checkpoint' / step_dir.name}" in out
    got = _losses(out, first=SAVED_AT + 1)
    assert got == pytest.approx(want[SAVED_AT:], rel=RTOL), f"resumed at CP={cp}: {got} vs CP=2: {want[SAVED_AT:]}"


def test_cp2_checkpoint_resumes_at_cp1(cp2_run, tmp_path):
    assert saved_batch_degree(cp2_run[0]) == 1
    _resume(1, cp2_run, tmp_path)


@slow("4 ranks on 2 CPU cores: ~40 s")
def test_cp2_checkpoint_resumes_at_cp4(cp2_run, tmp_path):
    _resume(4, cp2_run, tmp_path, "--cp_dtensor.layout", "headtail")  # saved striped: the layout may change too


# ---- the batch-degree check, on checkpoints shaped like torchtitan's (no ranks started) ----

def _titan_like_checkpoint(path: Path, batch_degree: int) -> None:
    """The dataloader entries torchtitan 0.2.2 saves: one per batch rank, plus the batch degree."""
    loader = {f"dp_rank_{b}": b"state" for b in range(batch_degree)} | {"world_size": batch_degree}
    dcp.save({"dataloader": loader, "model.w": torch.ones(2)}, checkpoint_id=str(path))


def _dims(dp_replicate: int, dp_shard: int, cp: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp,
                                 world_size=dp_replicate * dp_shard * cp)


def test_check_resume_names_the_batch_degree(tmp_path):
    folder = tmp_path / "checkpoint"
    _titan_like_checkpoint(folder / "step-10", 2)
    _titan_like_checkpoint(folder / "step-20", 2)
    (folder / "step-30").mkdir()  # a save that never wrote its metadata: torchtitan skips it too
    assert checkpoint_to_resume(folder) == str(folder / "step-20")
    assert checkpoint_to_resume(folder, load_step=10) == str(folder / "step-10")
    assert saved_batch_degree(folder / "step-20") == 2
    checkpointer = types.SimpleNamespace(enable=True, folder=str(folder))

    check_resume(checkpointer, _dims(1, 2, 4))  # CP 2 -> 4 at the same batch degree: fine
    check_resume(checkpointer, _dims(2, 1, 1))  # replicate instead of shard: same data ranks
    with pytest.raises(ValueError, match=r"saved with a batch \(data-parallel\) degree of 2; this job has 1 .*"
                                         r"data_parallel_shard_degree 2"):
        check_resume(checkpointer, _dims(1, 1, 4))  # dp_shard=-1 on 4 ranks at CP=4 resolves to 1
    check_resume(types.SimpleNamespace(enable=True, folder=str(tmp_path / "none")), _dims(1, 1, 4))  # fresh run
    check_resume(types.SimpleNamespace(enable=False, folder=str(folder)), _dims(1, 1, 4))  # no checkpointing


class _Plant:
    """Unpickling this creates ``marker``: what a crafted ``.metadata`` could do instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _forbid(*args, **kwargs):
    raise AssertionError("the resume check unpickled something")


def test_resume_check_never_unpickles(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoint"
    _titan_like_checkpoint(folder / "step-10", 3)  # a real DCP .metadata, batch degree 3
    marker = tmp_path / "pwned"
    # a crafted .metadata: DCP-looking keys (batch degree 2) whose values run code when unpickled
    evil = {"state_dict_metadata": {"dataloader.dp_rank_0": _Plant(str(marker)), "dataloader.dp_rank_1": 0}}
    (folder / "step-20").mkdir()
    (folder / "step-20" / ".metadata").write_bytes(pickle.dumps(evil))
    (folder / "step-30").mkdir()
    (folder / "step-30" / ".metadata").write_bytes(b"\xffnot a pickle")

    # the guard can fail: DCP's reader (the old code path) runs the planted code
    with pytest.raises(AttributeError, match="storage_meta"):  # after unpickling: a dict, not DCP's Metadata
        FileSystemReader(str(folder / "step-20")).read_metadata()
    assert marker.exists()
    marker.unlink()

    for name in ("load", "loads", "Unpickler"):  # and every way to unpickle raises from here on
        monkeypatch.setattr(pickle, name, _forbid)
    monkeypatch.setattr(torch, "load", _forbid)
    assert saved_batch_degree(folder / "step-10") == 3
    assert saved_batch_degree(folder / "step-20") == 2  # read, not run
    assert checkpoint_to_resume(folder, load_step=20) == str(folder / "step-20")
    checkpointer = types.SimpleNamespace(enable=True, folder=str(folder))
    with pytest.raises(ValueError, match="saved with a batch \\(data-parallel\\) degree of 2; this job has 1"):
        check_resume(checkpointer, _dims(1, 1, 2), load_step=20)
    with pytest.raises(ValueError, match=r"step-30/.metadata is not a readable DCP metadata file"):
        check_resume(checkpointer, _dims(1, 1, 2))  # the newest step: garbage, named
    assert not marker.exists()


def test_trainer_checks_resume_before_loading(tmp_path, monkeypatch):
    """CPTrainer.train itself (not a copy of it) runs check_resume before torchtitan's train, which loads."""
    from torchtitan.train import Trainer

    from cp_dtensor.titan.train import CPTrainer

    folder = tmp_path / "checkpoint"
    _titan_like_checkpoint(folder / "step-20", 2)
    loaded = []
    monkeypatch.setattr(Trainer, "train", lambda self: loaded.append(self))
    trainer = CPTrainer.__new__(CPTrainer)  # the attributes train() reads, without starting a job
    trainer.checkpointer = types.SimpleNamespace(enable=True, folder=str(folder))
    trainer.job_config = types.SimpleNamespace(checkpoint=types.SimpleNamespace(load_step=-1))
    trainer.parallel_dims = _dims(1, 1, 2)  # batch degree 1, saved with 2
    with pytest.raises(ValueError, match="saved with a batch \\(data-parallel\\) degree of 2; this job has 1"):
        trainer.train()
    assert loaded == []
    trainer.parallel_dims = _dims(1, 2, 1)  # batch degree 2, as saved: on to torchtitan's train
    trainer.train()
    assert loaded == [trainer]


@slow("~40 s on 2 CPU cores")
def test_trainer_hook_rejects_a_changed_batch_degree(cp2_run, tmp_path):
    # The trainer's own hook (CPTrainer.train calling check_resume before torchtitan's load), end to end.
    # Saved at CP=2 on 2 ranks (batch degree 1); CP=1 on 2 ranks makes it 2.
    dump = tmp_path / "dump"
    shutil.copytree(cp2_run[0], dump / "checkpoint" / cp2_run[0].name)
    code, out = run_torchrun(2, dump, "--checkpoint.enable", "--parallelism.context_parallel_degree", "1", timeout=300)
    assert code != 0
    assert out.count("was saved with a batch (data-parallel) degree of 1; this job has 2") >= 2, out[-3000:]
    assert "Missing key in checkpoint" not in out  # it stopped before torchtitan's load
