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
   0.2.2's steps 3-7, applied by the same functions (``use_sum_reduction_on_gloo``, ``allow_integer_histc``,
   ``use_for_loop_experts``, ``unsharded_template`` / ``init_as_unsharded``, and ``init_stages_as_whole``
   through the model spec's ``pipelining_fn``): a run starts from the weights of a one-rank run at every
   CP / FSDP / PP degree (0.3 seeds each PP rank apart too: step 1 of PP = 2 x CP = 2 was 8.12520 for 8.13709). (0.3's experts have no ``use_grouped_mm``, so
   ``use_for_loop_experts`` finds none there; step 5 is 0.3's.)
4. Parameter dtype. torchtitan 0.3's default ``mixed_precision_param`` is bf16 (FSDP casts parameters for
   the forward); on CPU that buys nothing and makes CP = 1 and CP = 2 differ by bf16 rounding of different
   reduction orders (llama3 debug: up to 7e-5 at step 3). The plugin's configs use fp32 there
   (``as_cp_config`` in trainer.py); ``--training.mixed_precision_param bfloat16`` still wins.
5. MoE experts in the parameters' dtype. torchtitan 0.3's ``GroupedExperts`` and ``GptOssGroupedExperts``
   call ``.bfloat16()`` on the routed tokens and on every expert weight before ``torch._grouped_mm``,
   whatever the parameter dtype (``_compat.TITAN03_BF16_EXPERTS``). The weight gradient of a bf16 matmul is
   its sum over tokens rounded to bf16, and each CP rank sums only its own tokens: CP = 2 rounds two half
   sums (then adds them in fp32 in FSDP's reduce-scatter) where CP = 1 rounds one, so the expert gradients
   differ by bf16 rounding (~4e-3 of the largest element at the debug models' dims; tests/titan/v03/test_titan03.py)
   and Adam turns that into a loss difference (gpt_oss debug, lr 8e-4: 3e-4 at step 2, 2e-2 at step 3;
   torchtitan sums the load-balancing token counts over data parallel x CP, so the bias is not it). On
   CPU, where ``_grouped_mm`` runs in fp32 as well, ``experts_in_param_dtype`` runs each expert module's
   forward under a torch-function mode that makes ``Tensor.bfloat16()`` return its input: with fp32
   parameters the experts compute, and their gradients are summed, in fp32 (CP = 2 then equals CP = 1 to
   every printed digit); with bf16 parameters the casts were no-ops anyway. Not on an accelerator
   (torchtitan's kernels there).
"""

from __future__ import annotations

import importlib
import types

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..._compat import TITAN03_BF16_EXPERTS, TITAN03_DEVICE_HOLDERS
from ..shared.cpu import CpuDeviceModule

__all__ = ["experts_in_param_dtype", "use_cpu_device"]


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


class KeepDtype(TorchFunctionMode):
    """``Tensor.bfloat16()`` returns its input unchanged (step 5 of Note [torchtitan 0.3 on CPU])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16 and len(args) == 1 and not kwargs:
            return args[0]
        return func(*args, **(kwargs or {}))


def _forward_in_param_dtype(self, *args, **kwargs):
    # bound to each expert module (a deepcopy binds to the copy); the class's forward (FSDP adds hooks, not one)
    with KeepDtype():
        return type(self).forward(self, *args, **kwargs)


def experts_in_param_dtype(model: nn.Module) -> int:
    """Step 5 of Note [torchtitan 0.3 on CPU]: torchtitan's MoE experts compute in their parameters' dtype on
    CPU. Returns how many expert modules were switched."""
    if torch.accelerator.is_available():
        return 0
    classes = tuple(getattr(importlib.import_module(module), name) for module, name in TITAN03_BF16_EXPERTS)
    switched = [m for m in model.modules() if isinstance(m, classes)]
    for m in switched:
        m.forward = types.MethodType(_forward_in_param_dtype, m)
    return len(switched)
