"""Running torchtitan 0.3 on CPU with gloo, without forking it.

Note [torchtitan 0.3 on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
0.3 keeps 0.2.2's CPU blind spots (Note [torchtitan on CPU] in ../_cpu.py); each fix applies only when
there is no accelerator, so a CUDA run is untouched:

1. Device. ``torchtitan.tools.utils`` picks ``device_type = _get_available_device_type() or "cuda"`` at
   import and other modules copy the names (``_compat.TITAN03_DEVICE_HOLDERS``): rebound to "cpu" and
   ``CpuDeviceModule``, as 0.2.2's step 2. With "cpu", 0.3 picks gloo itself.
2. Import. 0.3 imports no triton on the training path (its triton users, ``overrides/fused_*`` and
   ``distributed/minimal_async_ep``, load only when named), so 0.2.2's stand-in is not needed.
3. Gradient reduction, MoE ``histc`` / for-loop experts, parameter dtype and weight initialisation are
   0.2.2's steps 3-6, applied by the same functions (``use_sum_reduction_on_gloo``, ``allow_integer_histc``,
   ``use_for_loop_experts``, ``unsharded_template`` / ``init_as_unsharded``): a run starts from the
   weights of a one-rank run at every CP / FSDP degree.
4. Parameter dtype. torchtitan 0.3's default ``mixed_precision_param`` is bf16 (FSDP casts parameters for
   the forward); on CPU that buys nothing and makes CP = 1 and CP = 2 differ by bf16 rounding of different
   reduction orders (llama3 debug: up to 7e-5 at step 3). The plugin's configs use fp32 there
   (``as_cp_config`` in trainer.py); ``--training.mixed_precision_param bfloat16`` still wins. (gpt_oss's
   and the common MoE experts cast to bf16 for ``torch._grouped_mm`` whatever this says.)
"""

from __future__ import annotations

import importlib

import torch

from ..._compat import TITAN03_DEVICE_HOLDERS
from .._cpu import CpuDeviceModule

__all__ = ["use_cpu_device"]


def use_cpu_device() -> bool:
    """Step 1 of Note [torchtitan 0.3 on CPU]: point torchtitan at the CPU when there is no accelerator."""
    if torch.accelerator.is_available():
        return False
    for name, names in TITAN03_DEVICE_HOLDERS.items():
        module = importlib.import_module(name)
        if "device_type" in names:
            module.device_type = "cpu"
        if "device_module" in names:
            module.device_module = CpuDeviceModule
    return True
