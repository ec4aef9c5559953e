"""cp_dtensor: context parallelism for PyTorch -- ring / striped attention as a PyTorch-native layer.

The layers, bottom to top (imports point down only; ``tests/test_layers.py`` checks it):

* ``core/`` -- layouts, masks, kernels and custom ops, the ring / all-gather / Ulysses exchanges, the
  cross-rank agreement, the front door ``ring_attention``, decoding, linear attention. torch only.
* ``dtensor/`` -- the sequence layouts as DTensor placements, the SDPA-on-DTensor rule, relayouts.
* ``checkpoint/`` -- sequence-sharded checkpoints (DCP, safetensors) that reshard between CP sizes.
* ``doors.py`` (the whole-model door: ``nn/`` for own models or ``hf/``), ``torch_api.py`` (torch's
  ``context_parallel`` API), ``hf/`` (transformers),
  ``titan/`` (torchtitan 0.2.2 and 0.3) -- the integrations; ``tools/`` -- the planner, the CLI, debugging.

Importing the package changes nothing and imports no torch: each public name loads its module on first
use (PEP 562), so ``cp-dtensor plan`` starts without torch. The SDPA-on-DTensor rule is installed by
``install_sdpa_dispatch()`` -- explicitly, or by the entry points that create sequence-sharded DTensors
(see Note [SDPA dispatch] in dtensor/sdpa.py). Old module paths and names keep working and warn once
(``_deprecated.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._deprecated import install_old_paths
from .core.plan.layout import LAYOUTS as LAYOUTS  # torch-free

# old module paths (cp_dtensor.layout, cp_dtensor.core.ring, ...): one table that warns once (Note [Old module paths])
install_old_paths()

# public name -> the module that defines it
_EXPORTS = {
    # the front door and its ops
    "ring_attention": "core.attention",
    "sharded_cache_attention": "core.decode",
    "sharded_delta_rule": "core.linear.linear_attention",
    "sharded_causal_conv1d": "core.linear.linear_conv",
    "shard_tensor": "core.plan.layout",
    "unshard_tensor": "core.plan.layout",
    "local_positions": "core.plan.layout",
    "document_layout": "core.plan.documents",
    "DocumentLayout": "core.plan.documents",
    # DTensor
    "HeadTail": "dtensor.placements",
    "Striped": "dtensor.placements",
    "sequence_placement": "dtensor.placements",
    "install_sdpa_dispatch": "dtensor.sdpa",
    "sdpa_options": "dtensor.sdpa",
    "uninstall_sdpa_dispatch": "dtensor.sdpa",
    "relayout": "dtensor.sharding",
    "shard_sequence": "dtensor.sharding",
    "to_mesh": "dtensor.sharding",
    "unshard_sequence": "dtensor.sharding",
    # a batch's shards; own models
    "apply_context_parallel": "doors",
    "document_ids_from_positions": "core.batch",
    "reduce_gradients": "nn.sdpa_mode",
    "remove_context_parallel": "doors",
    "shard_batch": "core.batch",
    "linear_cross_entropy": "core.tiling",
    "unshard_batch": "core.batch",
    # torch's context-parallel API
    "context_parallel": "torch_api",
    "context_parallel_unshard": "torch_api",
    # checkpoints
    "CheckpointError": "checkpoint.manifest",
    "CheckpointExistsError": "checkpoint.manifest",
    "export_hf_safetensors": "checkpoint.dcp",
    "latest_checkpoint": "checkpoint.dcp",
    "load_hf_safetensors": "checkpoint.dcp",
    "load_sequence_sharded": "checkpoint.dcp",
    "save_checkpoint": "checkpoint.dcp",
    "save_sequence_sharded": "checkpoint.dcp",
    # tools
    "CommBytes": "tools.debug",
}

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CommBytes",
    "DocumentLayout",
    "HeadTail",
    "LAYOUTS",
    "Striped",
    "apply_context_parallel",
    "context_parallel",
    "context_parallel_unshard",
    "document_ids_from_positions",
    "document_layout",
    "export_hf_safetensors",
    "install_sdpa_dispatch",
    "latest_checkpoint",
    "linear_cross_entropy",
    "load_hf_safetensors",
    "load_sequence_sharded",
    "local_positions",
    "reduce_gradients",
    "relayout",
    "remove_context_parallel",
    "ring_attention",
    "save_checkpoint",
    "save_sequence_sharded",
    "sdpa_options",
    "sequence_placement",
    "shard_batch",
    "shard_sequence",
    "shard_tensor",
    "sharded_cache_attention",
    "sharded_causal_conv1d",
    "sharded_delta_rule",
    "to_mesh",
    "uninstall_sdpa_dispatch",
    "unshard_batch",
    "unshard_sequence",
    "unshard_tensor",
]

if TYPE_CHECKING:  # what IDEs, type checkers and the API reference see; at run time the names load lazily
    from .checkpoint.dcp import (
        export_hf_safetensors,
        latest_checkpoint,
        load_hf_safetensors,
        load_sequence_sharded,
        save_checkpoint,
        save_sequence_sharded,
    )
    from .checkpoint.manifest import CheckpointError, CheckpointExistsError
    from .core.attention import ring_attention
    from .core.batch import document_ids_from_positions, shard_batch, unshard_batch
    from .core.decode import sharded_cache_attention
    from .core.linear.linear_attention import sharded_delta_rule
    from .core.linear.linear_conv import sharded_causal_conv1d
    from .core.plan.documents import DocumentLayout, document_layout
    from .core.plan.layout import local_positions, shard_tensor, unshard_tensor
    from .core.tiling import linear_cross_entropy
    from .doors import apply_context_parallel, remove_context_parallel
    from .dtensor.placements import HeadTail, Striped, sequence_placement
    from .dtensor.sdpa import install_sdpa_dispatch, sdpa_options, uninstall_sdpa_dispatch
    from .dtensor.sharding import relayout, shard_sequence, to_mesh, unshard_sequence
    from .nn.sdpa_mode import reduce_gradients
    from .tools.debug import CommBytes
    from .torch_api import context_parallel, context_parallel_unshard


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cp_dtensor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
