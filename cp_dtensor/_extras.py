"""The optional extras: which feature needs which package, and the error that names the extra to install.

torch (and safetensors) are cp_dtensor's only core dependencies: the ring, masks, 2-D CP, the DTensor
rule, the module path, checkpoints and the planner need nothing else. Four features need a package a
user may not have (``pyproject.toml`` ``[project.optional-dependencies]``):

=========  ================  ===============================================================
extra      package           feature
=========  ================  ===============================================================
titan      torchtitan 0.2/0.3 ``cp_dtensor.titan``: the torchtitan plugin (0.2.2 TOML jobs; 0.3 config registry)
float8     torchao           ``comm_dtype=torch.float8_*`` K/V payloads; float8 training in torchtitan
hf         transformers      ``cp_dtensor.hf``: transformers models under CP
trainer    accelerate, trl   ``cp_dtensor.hf.with_context_parallel``: the Trainer (TRL's trainers too) under CP
=========  ================  ===============================================================

Using a feature whose package is missing raises :class:`ImportError` naming the extra
(``pip install 'cp_dtensor[titan]'``). The check only looks the package up (``find_spec``), so it
imports nothing: torchtitan must not be imported before the plugin's CPU preparations (Note [torchtitan
on CPU] in titan/shared/cpu.py). The same environment on every rank means every rank raises alike, before
any communication.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging

__all__ = ["EXTRAS", "torchao_import_quiet", "installed", "installed_version", "require"]

EXTRAS = {"titan": "torchtitan", "float8": "torchao", "hf": "transformers", "trainer": "accelerate"}
# the versions each extra's glue was written for: (lowest, first not served)
_SERVED = {"titan": ((0, 2), (0, 4))}  # 0.2.x: titan/*.py (TOML); 0.3.x: titan/v03/ (config registry)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def installed(extra: str) -> bool:
    """Whether ``extra``'s package can be imported (looked up, not imported)."""
    try:
        return importlib.util.find_spec(EXTRAS[extra]) is not None
    except ValueError:  # sys.modules[package] is None: the import is blocked, as good as absent
        return False


def require(extra: str, feature: str) -> None:
    """Raise ImportError, naming ``pip install 'cp_dtensor[extra]'``, unless ``extra``'s package is
    installed in a version the glue serves."""
    package = EXTRAS[extra]
    if not installed(extra):
        raise ImportError(
            f"{feature} needs {package}, which is not installed. Install the extra: pip install 'cp_dtensor[{extra}]'"
        )
    if extra in _SERVED:
        have = importlib.metadata.version(package)
        lo, hi = _SERVED[extra]
        if not lo <= _version(have)[: len(lo)] < hi:
            want = f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
            raise ImportError(
                f"{feature} serves {package}{want}; this environment has {package} {have}. Install a served "
                f"version: pip install 'cp_dtensor[{extra}]'"
            )


def installed_version(extra: str) -> tuple[int, ...]:
    """(major, minor, patch) of ``extra``'s installed package, read from its metadata (nothing is imported)."""
    return _version(importlib.metadata.version(EXTRAS[extra]))


# Note [torchao's import noise]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``import torchao`` (0.18, and transformers' quantizers import it whenever the Trainer is imported) loads
# every bundled ``_C_*.so`` and logs "Failed to load .../_C_mxfp8...so" for each CUDA-only one on a machine
# without those libraries, then registers Enums as pytree constants, which torch 2.13+ logs as
# deprecated. Neither concerns a cp_dtensor user. Where cp_dtensor imports torchao (the float8 payload)
# or code that imports it (the Trainer glue), the first import runs with those two loggers raised to
# ERROR -- torchao's only without CUDA, where its CUDA kernels cannot load anyway -- and restored after:
# nothing changes for the rest of the process.


@contextlib.contextmanager
def torchao_import_quiet():
    """Run the imports inside without torchao's import-time noise (Note [torchao's import noise])."""
    import torch

    names = ["torch.utils._pytree"] + ([] if torch.cuda.is_available() else ["torchao"])
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
