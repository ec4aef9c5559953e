"""torchtitan plugin: context parallelism through cp_dtensor's ring attention, turned on from the TOML.

Importing this package (``[experimental] custom_import = "cp_dtensor.titan"``) registers cp_dtensor's
train spec for every family it serves (llama3, qwen3, deepseek_v3, llama4, gpt_oss) and, on a machine without an accelerator, points torchtitan at the CPU and lets its
float8 linears run there. See Note [How the plugin hooks torchtitan] in spec.py, Note [torchtitan on
CPU] in _cpu.py and Note [float8 training on CPU] in float8.py.
"""

from ._cpu import install_triton_stand_in

install_triton_stand_in()  # before the first `import torchtitan`; see Note [torchtitan on CPU]

import torchtitan.protocols.train_spec as _titan_specs  # noqa: E402

from ._cpu import allow_integer_histc, use_cpu_device  # noqa: E402
from .config import FAMILIES, CPDTensor, check_job_config  # noqa: E402
from .data import register_dataset  # noqa: E402
from .families import apply_ring_attention  # noqa: E402
from .float8 import allow_float8_on_cpu  # noqa: E402
from .spec import parallelize_with_ring, refuse_cp_for_other_models, train_spec  # noqa: E402

__all__ = ["FAMILIES", "CPDTensor", "apply_ring_attention", "check_job_config", "parallelize_with_ring", "train_spec"]


def _register() -> None:
    for family in FAMILIES:
        try:
            _titan_specs.register_train_spec(family, train_spec(family))
        except ValueError:  # someone registered this name already
            if not getattr(_titan_specs.get_train_spec(family).parallelize_fn, "_cp_dtensor", False):
                raise RuntimeError(
                    f'another plugin registered a "{family}" train spec before cp_dtensor.titan; only one can '
                    f"own {family}'s parallelize function. Drop one of the custom imports."
                ) from None


_register()
_titan_specs.get_train_spec = refuse_cp_for_other_models(_titan_specs.get_train_spec)  # Note [Stock torchtitan.train with a [cp_dtensor] section]
register_dataset()
use_cpu_device()
allow_integer_histc()  # see Note [torchtitan on CPU], 4a
allow_float8_on_cpu()  # see Note [float8 training on CPU]
