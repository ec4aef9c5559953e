"""torchtitan plugin: context parallelism through cp_dtensor's ring attention, turned on from the TOML.

Importing this package (``[experimental] custom_import = "cp_dtensor.titan"``) registers cp_dtensor's
llama3 train spec and, on a machine without an accelerator, points torchtitan at the CPU and lets its
float8 linears run there. See Note [How the plugin hooks torchtitan] in spec.py, Note [torchtitan on
CPU] in _cpu.py and Note [float8 training on CPU] in float8.py.
"""

from ._cpu import install_triton_stand_in

install_triton_stand_in()  # before the first `import torchtitan`; see Note [torchtitan on CPU]

import torchtitan.protocols.train_spec as _titan_specs  # noqa: E402

from ._cpu import use_cpu_device  # noqa: E402
from .config import CPDTensor, check_job_config  # noqa: E402
from .data import register_dataset  # noqa: E402
from .float8 import allow_float8_on_cpu  # noqa: E402
from .spec import llama3_train_spec, parallelize_llama_cp  # noqa: E402

__all__ = ["CPDTensor", "check_job_config", "llama3_train_spec", "parallelize_llama_cp"]


def _register() -> None:
    try:
        _titan_specs.register_train_spec("llama3", llama3_train_spec())
    except ValueError:  # someone registered "llama3" already
        if _titan_specs.get_train_spec("llama3").parallelize_fn is not parallelize_llama_cp:
            raise RuntimeError(
                'another plugin registered a "llama3" train spec before cp_dtensor.titan; only one can '
                "own llama3's parallelize function. Drop one of the custom imports."
            ) from None


_register()
register_dataset()
use_cpu_device()
allow_float8_on_cpu()  # see Note [float8 training on CPU]
