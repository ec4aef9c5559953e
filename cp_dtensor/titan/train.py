"""Entry point: torchtitan's Trainer with cp_dtensor's context parallelism, on CPU (gloo) or GPU.

    torchrun --standalone --nproc_per_node=2 -m cp_dtensor.titan.train \
        --job.config_file titan_configs/llama3_debug.toml [torchtitan CLI overrides]       # torchtitan 0.2.2
    torchrun --standalone --nproc_per_node=2 -m cp_dtensor.titan.train --module llama3 \
        --config llama3_debugmodel --parallelism.context_parallel_degree 2 [flags]      # torchtitan 0.3

Importing ``cp_dtensor.titan`` first is what lets torchtitan import without triton on a CPU machine
(Note [torchtitan on CPU]); otherwise this is torchtitan's own ``main``, with the job's CP settings
checked before the process group starts.
"""

from __future__ import annotations

import os
import sys

# isort: off
import cp_dtensor.titan  # noqa: F401  registers the plugin (either torchtitan) before torchtitan.train is imported
from .._extras import installed_version
# isort: on

V03 = installed_version("titan") >= (0, 3)  # torchtitan 0.3: the config-registry glue (titan/v03/main.py)

if not V03:
    from torchtitan.train import main as titan_main

    from .v02.trainer import CPTrainer


def _run() -> None:
    from .shared.options import check_cli_spellings

    check_cli_spellings(sys.argv[1:])  # e.g. --cp_dtensor.tile_size: a hint, not torchtitan's "Unrecognized options"
    if V03:
        from .v03.main import main as main_03

        main_03()
    else:
        titan_main(CPTrainer)
    # torchtitan has closed the trainer and destroyed the process group. Leave without running the
    # interpreter's teardown: about one run in eight, destroying gloo's and the checkpointer's
    # background threads there aborted the process ("terminate called without an active exception",
    # SIGABRT) after a run that had finished correctly. Errors above still raise and exit non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _run()
