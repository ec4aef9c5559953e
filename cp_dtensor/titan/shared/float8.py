"""torchtitan's float8 linears (torchao ``Float8Linear``) on a machine without an accelerator.

Note [float8 training on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.2.2's ``Float8LinearConverter`` (``[model] converters = ["quantize.linear.float8"]``)
refuses to build unless ``has_cuda_capability(8, 9)`` -- float8 matmuls need an SM89+ GPU -- or
``[quantize.linear.float8] emulate = true`` with the model not compiled. torchao's ``Float8Linear``
runs forward, backward and under ``torch.compile`` on CPU too. So, on a machine with no accelerator
only, the plugin wraps that converter's ``__init__`` so that, while it runs, the name
``has_cuda_capability`` in torchtitan's float8 module (no other module) is a check that says yes and
logs that it did: the converter then builds the same
``Float8Linear`` layers it builds on an H100, with the same scaling recipe and casts, compiled or not.
That is what lets the CP x float8 tests run in CI on CPU; on a GPU machine nothing is wrapped and
torchtitan's own check decides. The float8 grouped-GEMM converter for MoE experts (its
``torch._scaled_grouped_mm`` has no CPU kernel) keeps torchtitan's refusal on CPU.

Which gemm then multiplies the float8 operands on CPU is chosen at start, once, and logged
(see Note [The float8 gemm on CPU]).

torchtitan 0.3 keeps the converter, the check and the module (``_compat.TITAN03_FLOAT8``); float8 is a
config there (``--config llama3_debugmodel_float8``: the converter is built, and checks, when the
config registry's function runs, so the wrapping happens when the plugin is imported, before that), and
its recipes are "rowwise" (the default) and "rowwise_with_gw_hp": 0.2.2's "tensorwise" is gone. The
wrapped ``__init__`` keeps torchtitan's as ``__wrapped__`` (tests/test_compat.py checks its signature).

Note [The float8 gemm on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchao multiplies two float8 operands either with ``torch._scaled_mm`` (the real fp8 gemm; on CPU
oneDNN's) or, with ``emulate=True``, as ``mm(a_fp8.float() / a_scale, b_fp8.float() / b_scale)``: the
same per-row (or per-tensor) power-of-two scales and the same float8 rounding of both operands, the
product in fp32. The two differ only by the fp32 summation order of the product. oneDNN's fp8 path
depends on the host's ISA: on an AVX2 host it runs at ~2-3x an fp32 matmul of the same shape, but
on some AMX / AVX512-FP16 hosts it takes a reference path ~1000x slower (a 256-768-256 MLP on 512
tokens: 26.7 s a step against 1.5 s emulated), and on others the primitive cannot be created at all.

So when the converter is built on CPU, the plugin measures one small ``torch._scaled_mm``
([64, 128] x [128, 128], rowwise scales, best of 3 after one warm-up; a few ms) against an fp32
matmul of the same shape (:func:`cpu_scaled_mm_cost`, once per process) and:

* uses the real gemm where it costs at most ``SCALED_MM_LIMIT`` (5) fp32 matmuls, logging the ratio (a host
  whose probe read 10.4x ran the llama3 debug model's float8 steps at ~95 s each, about 100x the fp32 step:
  the probe's small shape can understate a slow path by an order of magnitude, so only the ~2-3x regime of
  AVX2 hosts keeps the real gemm);
* otherwise switches the converter to torchao's emulated gemm with the recipe kept (rowwise stays
  rowwise) and logs one warning that names the measured ratio or the error;
* always emulates when the job asks for it (0.2.2 ``[quantize.linear.float8] emulate = true``, 0.3
  ``emulate=True`` in the converter's config), again with the recipe kept: torchtitan 0.2.2 ignores
  ``emulate`` when a recipe is named, and 0.3 drops the recipe when emulating.

The regimes are at least an order of magnitude apart, so ranks that measure on their own agree
(no collective: 0.3 builds the converter before the process group exists). The decision is per
process and needs no accelerator check of its own: it runs only where the wrapping above does.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time

import torch
from torchtitan.tools.logging import logger

from ..._compat import TITAN_FLOAT8

__all__ = ["SCALED_MM_LIMIT", "allow_float8_on_cpu", "cpu_scaled_mm_cost"]

SCALED_MM_LIMIT = 5.0  # torch._scaled_mm over an fp32 matmul above which CPU float8 linears emulate


@functools.cache
def cpu_scaled_mm_cost() -> tuple[float | None, str]:
    """(time of ``torch._scaled_mm`` / time of an fp32 matmul, a phrase saying so) for one rowwise-scaled
    [64, 128] x [128, 128] product on this CPU, measured once per process; (None, the error) where the
    fp8 gemm cannot run here. See Note [The float8 gemm on CPU]."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=g), torch.randn(128, 128, generator=g)
    a8, b8t = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major, as torchao passes it
    scale_a, scale_b = torch.ones(64, 1), torch.ones(1, 128)  # rowwise: one fp32 scale per row / column

    def best(fn) -> float:
        fn()  # oneDNN builds its primitive on the first call
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    try:
        fp8 = best(lambda: torch._scaled_mm(a8, b8t, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16))
    except RuntimeError as err:  # e.g. oneDNN cannot create the fp8 matmul primitive on this ISA
        return None, f"torch._scaled_mm cannot run on this CPU ({str(err).splitlines()[0]})"
    ratio = fp8 / max(best(lambda: a @ b), 1e-9)
    return ratio, f"torch._scaled_mm measured {ratio:.1f}x an fp32 matmul of its shape on this CPU"


def _float8_settings(converter, args, kwargs) -> tuple[str, bool, str | None]:
    """(the converter's attribute holding torchao's config, the job's emulate flag, the recipe name)."""
    if hasattr(converter, "torchao_config"):  # torchtitan 0.3: its own Config in .config
        return "torchao_config", converter.config.emulate, converter.config.recipe_name
    job_config = args[0] if args else kwargs["job_config"]  # 0.2.2: __init__(job_config, parallel_dims)
    f8 = job_config.quantize.linear.float8  # and torchao's config in .config
    return "config", f8.emulate, f8.recipe_name


def _choose_gemm(converter, args, kwargs) -> None:
    """Set ``converter``'s torchao config to the gemm Note [The float8 gemm on CPU] chooses, and log it."""
    from torchao.float8 import Float8LinearConfig

    attr, emulate, recipe = _float8_settings(converter, args, kwargs)
    if emulate:
        why = "the job sets emulate"
    else:
        ratio, why = cpu_scaled_mm_cost()
        if ratio is not None and ratio <= SCALED_MM_LIMIT:
            logger.info(f"cp_dtensor: float8 linears on CPU use torch._scaled_mm, the real fp8 gemm ({why})")
            return
        why += f", over the limit of {SCALED_MM_LIMIT:g}x" if ratio is not None else ""
    base = Float8LinearConfig.from_recipe_name(recipe) if recipe else getattr(converter, attr)
    setattr(converter, attr, dataclasses.replace(base, emulate=True))
    message = (f"cp_dtensor: float8 linears on CPU use torchao's emulated gemm (recipe {recipe or 'tensorwise'} "
               f"kept: the same scales and float8 rounding, the product in fp32) because {why}. "
               "See Note [The float8 gemm on CPU].")
    (logger.info if emulate else logger.warning)(message)


def _float8_runs_on_cpu(major: int, minor: int) -> bool:
    logger.info(
        f"cp_dtensor: no accelerator here, so torchtitan's check for CUDA capability {major}.{minor} is answered "
        "yes: float8 linears run on CPU, for testing (see Note [float8 training on CPU])"
    )
    return True


def allow_float8_on_cpu(module_name: str = TITAN_FLOAT8) -> bool:
    """Apply Note [float8 training on CPU] and Note [The float8 gemm on CPU] to the float8 linear converter of
    torchtitan's module ``module_name``; returns whether it was wrapped."""
    if torch.accelerator.is_available():
        return False
    module = importlib.import_module(module_name)
    titan_check = getattr(module, "has_cuda_capability", None)
    if titan_check is None:  # torchtitan moved it: tests/test_compat.py says so; float8 then needs a GPU
        logger.warning(f"cp_dtensor: {module_name} has no has_cuda_capability; float8 linears will not build on CPU")
        return False
    converter = module.Float8LinearConverter
    titan_init = getattr(converter.__init__, "__wrapped__", converter.__init__)  # installed twice

    @functools.wraps(titan_init)
    def __init__(self, *args, **kwargs):
        # the check answers yes for this converter's build only: the float8 grouped-GEMM (MoE) converter,
        # whose torch._scaled_grouped_mm has no CPU kernel, keeps torchtitan's refusal
        module.has_cuda_capability = _float8_runs_on_cpu
        try:
            titan_init(self, *args, **kwargs)
        finally:
            module.has_cuda_capability = titan_check
        if getattr(self, "enabled", False):
            _choose_gemm(self, args, kwargs)

    converter.__init__ = __init__
    return True


FLOAT8_LINEAR_CONVERTERS = {"quantize.linear.float8": "float8", "quantize.linear.mx": "mx"}  # -> [quantize.linear.X]


def keep_tiled_head_unconverted(job_config, head: str = "output") -> list[str]:
    """Under ``[cp_dtensor] sequence_tiling``, add the LM head to the float8 / MX linear converters' ``filter_fqns``
    (before the converters are built), as the job's config says; returns the converters changed. See Note
    [float8 and the tiled LM head] in tiling.py."""
    changed = []
    quantize = getattr(getattr(job_config, "quantize", None), "linear", None)
    for name in getattr(job_config.model, "converters", None) or []:
        section = getattr(quantize, FLOAT8_LINEAR_CONVERTERS.get(name, ""), None)
        if section is not None and not any(f in head for f in section.filter_fqns):
            section.filter_fqns = [*section.filter_fqns, head]
            changed.append(name)
    for name in changed:
        logger.warning(f'cp_dtensor: sequence_tiling computes the LM head "{head}" with the loss, in tiles, in its '
                       f'parameters\' precision: "{head}" joins [{name}] filter_fqns, so {name} converts every other '
                       f'linear (the same job as the untiled one with filter_fqns including "{head}"). See Note '
                       "[float8 and the tiled LM head].")
    return changed
