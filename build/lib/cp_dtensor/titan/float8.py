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
"""

from __future__ import annotations

import importlib

import torch
from torchtitan.tools.logging import logger

from .._compat import TITAN_FLOAT8

__all__ = ["allow_float8_on_cpu"]

_FLOAT8 = TITAN_FLOAT8


def _float8_runs_on_cpu(major: int, minor: int) -> bool:
    logger.info(
        f"cp_dtensor: no accelerator here, so torchtitan's check for CUDA capability {major}.{minor} is answered "
        "yes: float8 linears run on CPU through torch._scaled_mm, for testing (see Note [float8 training on CPU])"
    )
    return True


def allow_float8_on_cpu() -> bool:
    """Apply Note [float8 training on CPU]; returns whether the check was rebound."""
    if torch.accelerator.is_available():
        return False
    module = importlib.import_module(_FLOAT8)
    module.has_cuda_capability = _float8_runs_on_cpu
    return True
