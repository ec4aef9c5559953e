"""cp_dtensor: context parallelism for PyTorch -- ring / striped attention as a PyTorch-native layer.

Importing the package changes nothing and imports no torch: each public name loads its module on first
use (PEP 562), so ``cp-dtensor plan`` (cli.py, plan.py) starts without torch. The SDPA-on-DTensor rule is
installed by ``install_sdpa_dispatch()`` -- explicitly, or by the entry points that create sequence-sharded
DTensors (see Note [SDPA dispatch] in dispatch.py).
"""

from __future__ import annotations

import importlib
import sys
import types

from .layout import LAYOUTS as LAYOUTS  # torch-free

# public name -> the module that defines it
_EXPORTS = {
    "CheckpointError": "_manifest",
    "CheckpointExistsError": "_manifest",
    "export_hf_safetensors": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "load_hf_safetensors": "checkpoint",
    "load_sequence_sharded": "checkpoint",
    "save_checkpoint": "checkpoint",
    "save_sequence_sharded": "checkpoint",
    "relayout": "relayout",
    "to_mesh": "relayout",
    "apply_context_parallel": "module",
    "document_ids_from_positions": "module",
    "reduce_gradients": "module",
    "remove_context_parallel": "module",
    "shard_batch": "module",
    "unshard_sequence": "module",
    "HeadTail": "placement",
    "Striped": "placement",
    "sequence_placement": "placement",
    "shard_sequence": "relayout",
    "ring_attention": "attention",
    "sharded_cache_attention": "decode",
    "install_sdpa_dispatch": "dispatch",
    "uninstall_sdpa_dispatch": "dispatch",
}

__all__ = sorted(["LAYOUTS", *_EXPORTS])


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cp_dtensor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name != "relayout":  # see _Package
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """The package's module type: ``cp_dtensor.relayout`` is the function (``relayout.relayout``), as it
    always was, although the submodule ``cp_dtensor/relayout.py`` has that name too -- the import system
    binds a submodule to its package's attribute on first import, which here would replace the function."""

    @property
    def relayout(self):
        return importlib.import_module(".relayout", __name__).relayout

    @relayout.setter
    def relayout(self, value) -> None:  # the import system binding the submodule: the function stays
        pass


sys.modules[__name__].__class__ = _Package
