"""torchtitan's float8 linears (torchao ``Float8Linear``) on a machine without an accelerator, for testing.

Note [float8 training on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.2.2's ``Float8LinearConverter`` (``[model] converters = ["quantize.linear.float8"]``)
refuses to build unless ``has_cuda_capability(8, 9)`` -- float8 matmuls need an SM89+ GPU -- or
``[quantize.linear.float8] emulate = true`` with the model not compiled. With torch 2.13 on CPU,
``torch._scaled_mm`` has a CPU kernel, and torchao's ``Float8Linear`` runs forward, backward and under
``torch.compile`` there. So, on a machine with no accelerator only, the plugin rebinds the name
``has_cuda_capability`` in torchtitan's float8 module (no other module) to a check that says yes and
logs that it did: the converter then builds the same ``Float8Linear`` layers it builds on an H100,
with the same scaling recipe, casts and ``torch._scaled_mm`` calls, compiled or not. That is what lets
the CP x float8 tests run in CI; it is not a speed-up (CPU float8 matmuls are reference kernels).
On a GPU machine nothing is rebound and torchtitan's own check decides.

torchtitan 0.3 keeps the converter, the check and the module (``_compat.TITAN03_FLOAT8``); float8 is a
config there (``--config llama3_debugmodel_float8``: the converter is built, and checks, when the
config registry's function runs, so the rebinding happens when the plugin is imported, before that), and
its recipes are "rowwise" (the default) and "rowwise_with_gw_hp": 0.2.2's "tensorwise" is gone. The
rebound name keeps torchtitan's function as ``__wrapped__`` (tests/test_compat.py checks its signature).
"""

from __future__ import annotations

import importlib

import torch
from torchtitan.tools.logging import logger

from ..._compat import TITAN_FLOAT8

__all__ = ["allow_float8_on_cpu"]


def _float8_runs_on_cpu(major: int, minor: int) -> bool:
    logger.info(
        f"cp_dtensor: no accelerator here, so torchtitan's check for CUDA capability {major}.{minor} is answered "
        "yes: float8 linears run on CPU through torch._scaled_mm, for testing (see Note [float8 training on CPU])"
    )
    return True


def allow_float8_on_cpu(module_name: str = TITAN_FLOAT8) -> bool:
    """Apply Note [float8 training on CPU] to torchtitan's float8 module ``module_name``; returns whether
    the check was rebound."""
    if torch.accelerator.is_available():
        return False
    module = importlib.import_module(module_name)
    titan_check = getattr(module, "has_cuda_capability", None)
    if titan_check is None:  # torchtitan moved it: tests/test_compat.py says so; float8 then needs a GPU
        logger.warning(f"cp_dtensor: {module_name} has no has_cuda_capability; float8 linears will not build on CPU")
        return False
    titan_check = getattr(titan_check, "__wrapped__", titan_check)  # imported twice

    def has_cuda_capability(major: int, minor: int) -> bool:
        return _float8_runs_on_cpu(major, minor)

    has_cuda_capability.__wrapped__ = titan_check
    module.has_cuda_capability = has_cuda_capability
    return True
