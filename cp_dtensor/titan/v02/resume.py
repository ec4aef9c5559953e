"""Resuming a torchtitan run at another CP degree: what torchtitan 0.2.2 already does, and the one check
it lacks.

Note [Resume across CP degrees]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan's checkpointer saves one DCP checkpoint (``step-N/.metadata`` plus per-rank data files):

* Model and optimizer: DTensors sharded over the ``fsdp`` mesh, which is dp_shard x cp (FSDP shards
  parameters over the CP ranks too), or plain tensors when that mesh has size 1. DCP stores boxes of
  the global tensors, so loading at another CP degree is DCP's ordinary reshard.
* ``lr_scheduler`` and ``train_state``: the same on every rank.
* Dataloader: ``ParallelAwareDataloader.state_dict()`` is ``{"dp_rank_<b>": pickled state,
  "world_size": B}`` with b / B the *batch* rank / degree, dp_replicate x dp_shard -- CP excluded. The
  CP ranks of one batch rank read the same data and save the same entry (DCP writes it once). A job
  with the same batch degree therefore finds every key it asks for and continues the same data stream,
  whatever its CP degree.
* Nothing sequence-sharded is saved (batches are sharded afresh each step), so the layout
  (``[cp_dtensor] layout``) may change on resume as well.

Measured (llama3 debugmodel, tests/titan/v02/test_titan_resume.py): saved at CP=2 after step 2, resumed at CP=1
and at CP=4, steps 3 and 4 log the losses of the uninterrupted CP=2 run.

What breaks is a change of the batch degree, easy to cause by accident: with
``data_parallel_shard_degree = -1`` (the ranks left after CP and TP) a new CP degree at the same world
size silently changes it. torchtitan then fails inside the load, after building the model: a grown
batch degree asks for a key the checkpoint lacks ("RuntimeError: Missing key in checkpoint state_dict:
dataloader.dp_rank_1", measured: saved at CP=2 on 2 ranks, resumed at CP=1 on 2 ranks), a shrunk one
trips ``assert dp_degree is inconsistent`` in the dataloader (from the code). ``check_resume`` reads the
saved batch degree from the checkpoint's metadata (no tensor data) and raises, on every rank and before
any load, an error that says which degree to set.

Note [Reading DCP metadata without unpickling]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The saved state keys live only in ``step-N/.metadata``, a pickle (DCP's ``FileSystemReader.read_metadata``
is ``pickle.load``; the ``.distcp`` data files hold bytes without names). Unpickling runs whatever the
file says, so the check must not add that path before training starts. It does not need the objects,
only the key strings, and a pickle states every string literally in its opcode stream:
``pickletools.genops`` decodes the opcodes and their arguments without executing any of them (no
import, no call, no object built), so we collect the strings that look like ``dataloader.dp_rank_<b>``.
This works for any torchtitan checkpoint, including those saved by stock torchtitan, with no hook at
save time. A crafted file can at worst make it report a wrong degree (a refused resume or a skipped
check); torchtitan's own load will unpickle the file anyway -- see docs/checkpoints.md, "Security: what unpickles".
"""

from __future__ import annotations

import os
import pickletools
import re
from collections.abc import Iterator
from typing import Any

from ...checkpoint.manifest import STEP_DIR

__all__ = ["saved_batch_degree", "checkpoint_to_resume", "check_resume"]

_DATALOADER_KEY = re.compile(r"dataloader\.dp_rank_(\d+)")


def saved_batch_degree(step_dir: str | os.PathLike) -> int | None:
    """The batch (data-parallel) degree a torchtitan DCP checkpoint was saved with: how many batch ranks
    saved dataloader state. None when it holds no dataloader state (model-only, seed or HF checkpoints).
    Reads ``.metadata`` without unpickling it (Note [Reading DCP metadata without unpickling])."""
    path = os.path.join(step_dir, ".metadata")
    if not os.path.isfile(path):
        return None
    ranks = {int(m.group(1)) for s in _pickled_strings(path) if (m := _DATALOADER_KEY.fullmatch(s))}
    return len(ranks) or None


def _pickled_strings(path: str) -> Iterator[str]:
    """Every string literal in the pickle at ``path``, decoded without unpickling it; see Note [Reading
    DCP metadata without unpickling]."""
    with open(path, "rb") as f:
        try:
            for opcode, arg, _ in pickletools.genops(f):
                if isinstance(arg, str) and "UNICODE" in opcode.name:
                    yield arg
        except ValueError as e:  # an unknown opcode, a truncated argument: not a pickle we can read
            raise ValueError(f"{path} is not a readable DCP metadata file ({e}), so the batch degree it was "
                             "saved with is unknown. Restore the checkpoint, delete that step directory, or "
                             "resume from another step (--checkpoint.load_step).") from None


def checkpoint_to_resume(folder: str | os.PathLike, *, load_step: int = -1) -> str | None:
    """The step directory torchtitan's checkpointer will resume from in ``folder`` (its
    ``checkpoint.folder`` under the dump folder): ``step-<load_step>``, or the newest ``step-N`` with
    DCP metadata; None when there is none (the run starts fresh or from ``initial_load_path``)."""
    if load_step >= 0:
        path = os.path.join(folder, f"step-{load_step}")
        return path if os.path.isdir(path) else None
    if not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for name in os.listdir(folder)
             if (m := STEP_DIR.fullmatch(name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))]
    return os.path.join(folder, f"step-{max(steps)}") if steps else None


def check_resume(checkpointer: Any, parallel_dims: Any, *, load_step: int = -1) -> None:
    """Before ``checkpointer.load``: raise if the checkpoint it would resume from was saved with another
    batch degree than ``parallel_dims`` has. Reads local files only, so every rank raises alike.
    See Note [Resume across CP degrees]."""
    if not getattr(checkpointer, "enable", False):
        return
    step_dir = checkpoint_to_resume(checkpointer.folder, load_step=load_step)
    saved = saved_batch_degree(step_dir) if step_dir else None
    batch = parallel_dims.dp_replicate * parallel_dims.dp_shard
    if saved is None or saved == batch:
        return
    others = parallel_dims.world_size // batch  # cp x tp x pp
    raise ValueError(
        f"checkpoint {step_dir} was saved with a batch (data-parallel) degree of {saved}; this job has "
        f"{batch} (dp_replicate {parallel_dims.dp_replicate} x dp_shard {parallel_dims.dp_shard}; "
        f"context_parallel_degree {parallel_dims.cp}). torchtitan keys the dataloader state by batch rank, so a "
        f"run resumes exactly at another CP degree only with the same batch degree. Keep it at {saved}: "
        f"world size = {saved} x cp x tp x pp (now cp x tp x pp = {others}), and set "
        f"--parallelism.data_parallel_shard_degree {saved // parallel_dims.dp_replicate} explicitly "
        "rather than -1."
    )
