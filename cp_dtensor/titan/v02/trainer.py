"""torchtitan 0.2.2's Trainer with the plugin's start-up checks (the entry point is ``cp_dtensor.titan.train``)."""

from __future__ import annotations

import os

from torchtitan.train import Trainer

from ..shared.float8 import keep_tiled_head_unconverted
from .config import check_config
from .resume import check_resume

__all__ = ["CPTrainer"]


class CPTrainer(Trainer):
    """torchtitan's Trainer; fails fast, on every rank, on a CP setup cp_dtensor cannot run or a
    resume that would skip or repeat data (Note [Resume across CP degrees] in resume.py)."""

    def init_distributed(self):
        check_config(self.job_config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        if getattr(self.job_config, "cp_dtensor", None) is not None and self.job_config.cp_dtensor.tile_size is not None:
            keep_tiled_head_unconverted(self.job_config)  # See Note [float8 and the tiled LM head]
        return super().init_distributed()

    def train(self):
        check_resume(self.checkpointer, self.parallel_dims, load_step=self.job_config.checkpoint.load_step)
        return super().train()
