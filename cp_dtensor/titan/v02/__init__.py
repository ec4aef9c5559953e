"""The torchtitan 0.2.2 glue: context parallelism from the TOML.

``install()`` registers cp_dtensor's train spec for every family the plugin serves (llama3, qwen3,
deepseek_v3, llama4, gpt_oss: Note [How the plugin hooks torchtitan] in spec.py), the shipped dataset,
and on a machine without an accelerator points torchtitan at the CPU (Note [torchtitan on CPU] in
../shared/cpu.py) and lets its float8 linears run there (Note [float8 training on CPU] in
../shared/float8.py). ``cp_dtensor.titan`` calls it once, when the TOML's ``custom_import`` imports the
plugin; it changes torchtitan's registries for the life of the process.
"""

from __future__ import annotations

__all__ = ["install"]

_installed = False


def install() -> None:
    """Register the plugin with torchtitan 0.2.2 (idempotent)."""
    global _installed
    if _installed:
        return
    import torchtitan.protocols.train_spec as _titan_specs

    from ..shared.cpu import allow_integer_histc, use_cpu_device
    from ..shared.data import register_dataset
    from ..shared.float8 import allow_float8_on_cpu
    from .config import FAMILIES
    from .spec import refuse_cp_for_other_models, train_spec

    for family in FAMILIES:
        try:
            _titan_specs.register_train_spec(family, train_spec(family))
        except ValueError:  # someone registered this name already
            if not getattr(_titan_specs.get_train_spec(family).parallelize_fn, "_cp_dtensor", False):
                raise RuntimeError(
                    f'another plugin registered a "{family}" train spec before cp_dtensor.titan; only one can '
                    f"own {family}'s parallelize function. Drop one of the custom imports."
                ) from None
    # Note [Stock torchtitan.train with a [cp_dtensor] section] in spec.py
    _titan_specs.get_train_spec = refuse_cp_for_other_models(_titan_specs.get_train_spec)
    register_dataset()
    use_cpu_device()
    allow_integer_histc()  # see Note [torchtitan on CPU], 4a
    allow_float8_on_cpu()  # see Note [float8 training on CPU]
    _installed = True
