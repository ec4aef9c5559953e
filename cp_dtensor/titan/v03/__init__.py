"""The torchtitan 0.3 glue: ring context parallelism for its config-registry trainer.

``cp_dtensor.titan`` imports this package when torchtitan 0.3 is installed (0.2.2's TOML glue is ../v02/). ``install()`` points torchtitan at the CPU on a machine without an accelerator
(Note [torchtitan 0.3 on CPU] in _cpu.py), lets its float8 linears build there (Note [float8 training on
CPU] in ../shared/float8.py) and registers the shipped dataset; training goes through
``python -m cp_dtensor.titan.train --module FAMILY --config CONFIG`` (main.py) or stock
``python -m torchtitan.train --module cp_dtensor.titan --config CONFIG`` (config_registry.py). See Note
[How the 0.3 plugin hooks torchtitan] in trainer.py and Note [0.3 inner attention as the ring] in attention.py.
"""

from ..._compat import TITAN03_FLOAT8
from ..shared.cpu import allow_integer_histc
from ..shared.data import register_dataset
from ..shared.float8 import allow_float8_on_cpu
from ._cpu import use_cpu_device
from .trainer import FAMILIES, CPTrainer, as_cp_config, check_config

__all__ = ["FAMILIES", "CPTrainer", "as_cp_config", "check_config", "install"]

_installed = False


def install() -> None:
    """Set torchtitan 0.3 up for the plugin (idempotent): CPU ranks, the shipped dataset, float8 on CPU."""
    global _installed
    if _installed:
        return
    use_cpu_device()
    allow_integer_histc()  # MoE routers count int64 expert ids with torch.histc: Note [torchtitan on CPU] 4a
    register_dataset()
    allow_float8_on_cpu(TITAN03_FLOAT8)  # --config llama3_debugmodel_float8 on CPU: Note [float8 training on CPU]
    _installed = True
