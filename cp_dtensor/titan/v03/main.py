"""The 0.3 entry point: torchtitan's own ``main`` with the plugin's config manager.

    torchrun --nproc_per_node 2 -m cp_dtensor.titan.train --module llama3 --config llama3_debugmodel \
        --parallelism.context_parallel_degree 2 [--cp_dtensor.layout headtail] [torchtitan flags]

``PluginConfigManager`` loads ``--module``/``--config`` as torchtitan does, turns the config into the
plugin's (``as_cp_config``) and fills the shipped tokenizer and data where torchtitan's test assets are
absent (``use_shipped_assets``) -- both *before* the command-line flags are applied, so every flag still
wins. Then torchtitan's ``main`` builds ``CPTrainer`` from it and trains.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torchtitan.train as titan_train
from torchtitan.config.manager import ConfigManager
from torchtitan.tools.logging import logger

from ..shared.data import DATASET_NAME, register_dataset  # the 0.2.2 registration serves 0.3's dataset table as is
from .trainer import as_cp_config

__all__ = ["PluginConfigManager", "main", "use_shipped_assets"]

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[3] / "assets" / "tokenizer"  # 753-token byte-level BPE
_TITAN_TEST_DATASET = "c4_test"  # torchtitan's debug configs read tests/assets/c4_test from the working directory


def use_shipped_assets(config):
    """The repository's tokenizer and text where a config points at torchtitan's test assets and they are
    absent (a pip-installed torchtitan has no tests/ folder). Logged; flags override it."""
    if not os.path.exists(config.hf_assets_path) and "tests/assets" in config.hf_assets_path:
        logger.info(f"cp_dtensor: {config.hf_assets_path} is absent; using the shipped tokenizer {SHIPPED_TOKENIZER}")
        config.hf_assets_path = str(SHIPPED_TOKENIZER)
    loader = config.dataloader
    if getattr(loader, "dataset", None) == _TITAN_TEST_DATASET and loader.dataset_path is None \
            and not Path("tests/assets/c4_test").exists():
        logger.info(f"cp_dtensor: tests/assets/c4_test is absent; reading the shipped text ({DATASET_NAME})")
        config.dataloader = dataclasses.replace(loader, dataset=DATASET_NAME)
    validator_loader = getattr(config.validator, "dataloader", None)
    if getattr(validator_loader, "dataset", "").startswith("c4") and not Path("tests/assets/c4_test").exists():
        config.validator = dataclasses.replace(
            config.validator, dataloader=dataclasses.replace(validator_loader, dataset=DATASET_NAME))
    return config


class PluginConfigManager(ConfigManager):
    """torchtitan's ConfigManager; the loaded config becomes the plugin's before the flags apply."""

    def _load_config(self, args: list[str]):
        loaded, rest = super()._load_config(args)
        return use_shipped_assets(as_cp_config(loaded)), rest


def main() -> None:
    register_dataset()
    with contextlib.ExitStack() as stack:
        old = titan_train.ConfigManager
        titan_train.ConfigManager = PluginConfigManager
        stack.callback(setattr, titan_train, "ConfigManager", old)
        titan_train.main()
