"""torchtitan 0.3's ``--module`` hook: every config of the families the plugin serves, as the plugin's.

    torchrun --nproc_per_node 2 -m torchtitan.train --module cp_dtensor.titan --config llama3_debugmodel \
        --parallelism.context_parallel_degree 2

torchtitan's ConfigManager imports ``cp_dtensor.titan.config_registry`` (which imports the plugin: Note
[torchtitan 0.3 on CPU]) and calls ``CONFIG()``; ``CONFIG`` is any config function of
``torchtitan.models.FAMILY.config_registry`` for a served FAMILY, returned as the plugin's ``CPTrainer.Config``
(``as_cp_config``, shipped assets where torchtitan's test assets are absent), so stock ``main`` builds
cp_dtensor's trainer: the ring, or a refusal at start (Note [How the 0.3 plugin hooks torchtitan]). It also
serves the plugin's own ``qwen35_debugmodel_text`` (qwen3_5 on text: Note [qwen3_5 under the 0.3 plugin]).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def __getattr__(name: str) -> Callable:
    from .v03 import FAMILIES, as_cp_config, linear
    from .v03.main import use_shipped_assets

    if name in linear.CONFIGS:  # the plugin's own (text-only qwen3_5): Note [qwen3_5 under the 0.3 plugin]
        make = linear.CONFIGS[name]

        def own():
            return use_shipped_assets(as_cp_config(make()))

        own.__name__ = own.__qualname__ = name
        return own
    if not name.startswith("_"):
        for family in FAMILIES:
            try:
                registry = importlib.import_module(f"torchtitan.models.{family}.config_registry")
            except ImportError:  # qwen3_5's imports torchvision for its multimodal dataloader
                continue
            make = getattr(registry, name, None)
            if callable(make):
                def config():
                    return use_shipped_assets(as_cp_config(make()))

                config.__name__ = config.__qualname__ = name
                return config
    raise AttributeError(f"cp_dtensor.titan.config_registry has no config {name!r}: it serves the configs of "
                         "torchtitan.models.{" + ",".join(FAMILIES) + "}.config_registry")
