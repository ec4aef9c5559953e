"""Running torchtitan 0.2.2 on CPU with gloo, without forking it.

Note [torchtitan on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.2.2 assumes an accelerator in a few places; each fix below is applied only when there is
no accelerator (or, for 3, only on gloo), so a CUDA run is untouched.

1. Import. ``import torchtitan`` imports its MoE kernels, which ``import triton`` at module level.
   triton is a GPU compiler (~1 GB) that nothing here would run, so we do not install it, and we do
   not fake a ``triton`` package either: torch probes for one to decide what torch.compile may use,
   and a fake would mislead it. Instead, before torchtitan is imported, we register a stand-in for
   the one module that needs it, ``torchtitan.models.moe.kernels``, whose functions raise. Dense
   models (llama3) never call them. This has to happen before the first ``import torchtitan``,
   which is why ``python -m cp_dtensor.titan.train`` is the CPU entry point. The one kernel expert
   parallelism calls on every device, ``generate_permute_indices`` (the order of the tokens an
   all-to-all brought in, grouped by local expert), has a CPU implementation in the same file
   (``use_cpu=True``); the stand-in's ``generate_permute_indices`` is that function, loaded from
   torchtitan's file without triton (``_compat.titan_cpu_permute_indices``).
2. Device. ``torchtitan.tools.utils`` picks ``device_type = _get_available_device_type() or "cuda"``
   at import and other modules copy that name (and ``device_module``). We rebind those names to
   "cpu" and to ``CpuDeviceModule``, which answers the few device-module calls torchtitan makes
   (memory "stats" are the process's peak RSS). The trainer reads ``utils.device_type`` after
   ``[experimental] custom_import``, so importing ``cp_dtensor.titan`` there is early enough.
3. Gradient reduction. torchtitan divides gradients itself and sets FSDP's gradient divide factor to
   1.0; FSDP2 then reduce-scatters with ``ReduceOp.PREMUL_SUM(1.0)``, which gloo does not implement.
   ``set_force_sum_reduction_for_comms(True)`` makes it a plain SUM followed by a division by the
   factor, 1.0, which is skipped: the same gradients.
4. MoE. (a) The routers count tokens per expert with ``torch.histc`` on int64 expert indices, which
   torch has no CPU kernel for (``"histogram_cpu" not implemented for 'Long'``). On CPU,
   ``torch.histc`` is rebound once, here, to a wrapper that computes integer histograms with a
   ``scatter_add`` into bins + 1 counters (the same bins: width (max - min) / bins, max in the last
   bin, outside values counted in the extra bin and dropped) and passes every other call to torch's
   own. Every size in it is static, so torch.compile traces the routers whole (``bincount`` or a
   boolean mask would give Dynamo a size that depends on the data). (b) The grouped-GEMM experts pad with torchtitan's
   triton kernels (step 1); on CPU every MoE layer uses torchtitan's for-loop experts instead
   (``use_grouped_mm = False``, what torchtitan's own args choose below SM90 for most families),
   which also keeps them in the parameters' dtype instead of bf16.
5. Parameter dtype. gpt_oss builds its blocks in bf16 (``.to(torch.bfloat16)``), which on CPU
   without FSDP's casting meets fp32 activations (``mat1 and mat2 must have the same dtype``). On CPU,
   floating parameters are built in ``[training] mixed_precision_param`` (fp32 in the debug TOMLs).
6. Initialisation. torchtitan builds the model on meta, shards it (FSDP over dp x cp, TP) and then
   calls ``init_weights`` on the DTensor parameters. On CUDA, DTensor's offset-based RNG tracker
   makes each shard draw the numbers the unsharded tensor would have there; on CPU there is no
   tracker, every rank draws its local shard from the same seed, and the weights depend on the shard
   degree (llama3 debug, step 1: 8.17354 at CP=1, 8.11423 at CP=2). On CPU, when parameters are
   DTensors, the model's ``init_weights`` instead runs torchtitan's own ``init_weights`` on an
   unsharded replica (a meta copy taken before sharding, materialised on the CPU, every rank from
   rank 0's RNG state) and copies each rank's shard of every parameter into the DTensor
   (``distribute_tensor(..., src_data_rank=None)``: the local slice, no communication; FSDP's uneven
   Shard(0) included); buffers are taken whole. A run then starts from the weights of a one-rank run
   at every CP / FSDP / TP degree, with no seed checkpoint. Cost: one full replica of the model in CPU
   memory while ``init_weights`` runs (fine for the CPU debug models); one rank (no DTensor) and
   CUDA are untouched. Steps 6 and 7 live in ``replica.py``.
7. Pipeline stages. Under PP torchtitan seeds each PP rank differently (seed + pp rank) and calls
   ``init_weights`` on each stage -- a copy of the model with the other stages' layers removed -- so
   a stage draws its layers from its own seed and from the start of its RNG stream: only stage 0's
   draws match the one-rank model's, and under CP each rank also draws its own shard (llama3 debug,
   step 1: 8.06831 at PP = 2, 8.13884 at PP = 2 x CP = 2, for 8.17354). On CPU the plugin takes a meta
   copy of the *whole* model before torchtitan cuts it (the train spec's ``pipelining_fn``), and each stage's
   ``init_weights`` copies its parameters (its shards, as in 6) from one replica of the whole model
   initialised with torchtitan's own ``init_weights`` from rank 0's RNG state -- once per rank, for
   all its stages (looped schedules hold several), freed after the last; the rank's own RNG state
   (torchtitan's per-stage stream) is restored afterwards. This applies with or without DTensor
   parameters (PP alone has none). A PP run then starts from the one-rank model's weights at every
   PP / CP / FSDP / TP degree. On an accelerator torchtitan's per-stage seeds stay, and the plugin warns
   at start unless the job loads a checkpoint: start PP runs from a seed checkpoint there.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import resource
import sys
import types

import torch
import torch.distributed as dist
import torch.nn as nn

from ..._compat import TITAN_DEVICE_HOLDERS, TITAN_MOE_KERNELS, titan_cpu_permute_indices
from .replica import WRAPPER_NAMES, init_as_unsharded, init_stages_as_whole, unsharded_template, unwrapped_name

__all__ = [
    "install_triton_stand_in", "use_cpu_device", "use_sum_reduction_on_gloo", "CpuDeviceModule",
    "allow_integer_histc", "use_for_loop_experts", "use_param_dtype", "unsharded_template", "init_as_unsharded",
    "init_stages_as_whole", "unwrapped_name", "WRAPPER_NAMES",  # steps 6 and 7: replica.py
]

_KERNELS = TITAN_MOE_KERNELS


def install_triton_stand_in() -> bool:
    """Step 1 of Note [torchtitan on CPU]. Returns whether the stand-in was installed."""
    if importlib.util.find_spec("triton") is not None or _KERNELS in sys.modules:
        return False
    if "torchtitan" in sys.modules:
        raise RuntimeError(
            "torchtitan was imported before cp_dtensor.titan and triton is not installed, so its MoE "
            "kernels failed to import. Start training with `python -m cp_dtensor.titan.train` "
            "(or import cp_dtensor.titan before torchtitan)."
        )

    def _needs_triton(*args, **kwargs):
        raise RuntimeError(
            "torchtitan's MoE permutation kernels need triton, which is not installed "
            "(cp_dtensor registered a stand-in for torchtitan.models.moe.kernels so that dense models "
            "train on CPU). Install triton on a GPU machine to train MoE models."
        )

    stand_in = types.ModuleType(_KERNELS, "cp_dtensor stand-in: torchtitan MoE kernels without triton")
    stand_in.generate_permute_indices = _cpu_permute_indices
    stand_in.fill_indices_wrapper = _needs_triton
    stand_in.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
    sys.modules[_KERNELS] = stand_in
    return True


@functools.cache
def _titan_cpu_permute():
    return titan_cpu_permute_indices()


def _cpu_permute_indices(*args, **kwargs):
    # expert parallelism's token permutation through torchtitan's own CPU implementation: Note [torchtitan on CPU] 1
    kwargs.pop("use_cpu", None)
    return _titan_cpu_permute()(*args, **kwargs)


class CpuDeviceModule:
    """The device-module calls torchtitan makes (``torch.cuda.*`` style), answered for the CPU."""

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass  # peak RSS cannot be reset; the reported peak is the process's

    @staticmethod
    def get_device_name(device=None) -> str:
        return f"CPU ({platform.processor() or platform.machine()})"

    @staticmethod
    def get_device_properties(device=None) -> types.SimpleNamespace:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name=CpuDeviceModule.get_device_name())

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0, "num_ooms": 0}


def use_cpu_device() -> bool:
    """Step 2 of Note [torchtitan on CPU]: point torchtitan at the CPU when there is no accelerator."""
    if torch.accelerator.is_available():
        return False
    for name, names in TITAN_DEVICE_HOLDERS.items():  # modules that copied the device names at import
        module = importlib.import_module(name)
        if "device_type" in names:
            module.device_type = "cpu"
        if "device_module" in names:
            module.device_module = CpuDeviceModule
    return True


def use_sum_reduction_on_gloo(model: nn.Module) -> None:
    """Step 3 of Note [torchtitan on CPU]: plain-SUM gradient reduce-scatter for every FSDP module."""
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _integer_histc(histc):
    @functools.wraps(histc)
    def wrapped(input, bins=100, min=0, max=0, *, out=None):
        if input.is_floating_point() or out is not None or input.device.type != "cpu" or min >= max:
            return histc(input, bins=bins, min=min, max=max, **({} if out is None else {"out": out}))
        # static shapes only, so torch.compile traces it (no boolean indexing, no bincount: their sizes
        # depend on the data): values outside [min, max] go to an extra bin that is dropped
        x = input.reshape(-1).double()
        idx = ((x - min) * bins / (max - min)).long().clamp_(0, bins - 1)  # max falls in the last bin
        idx = torch.where((x < min) | (x > max), bins, idx)
        counts = torch.zeros(bins + 1, dtype=torch.long, device=input.device)
        return counts.scatter_add_(0, idx, torch.ones_like(idx))[:bins].to(input.dtype)

    wrapped._cp_dtensor = True
    return wrapped


def allow_integer_histc() -> bool:
    """Step 4a of Note [torchtitan on CPU]: integer ``torch.histc`` on CPU. Returns whether it was installed."""
    if torch.accelerator.is_available() or getattr(torch.histc, "_cp_dtensor", False):
        return False
    torch.histc = _integer_histc(torch.histc)
    return True


def use_for_loop_experts(model: nn.Module) -> int:
    """Step 4b of Note [torchtitan on CPU]: for-loop MoE experts on CPU. Returns how many were switched."""
    if torch.accelerator.is_available():
        return 0
    switched = [m for m in model.modules() if getattr(m, "use_grouped_mm", False) is True]
    for m in switched:
        m.use_grouped_mm = False
    return len(switched)


def use_param_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Step 5 of Note [torchtitan on CPU]: floating parameters in ``dtype`` on CPU. Returns how many changed."""
    if torch.accelerator.is_available():
        return 0
    n = 0
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                n += 1
    return n
