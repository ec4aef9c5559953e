"""cp_dtensor: context parallelism for PyTorch -- ring / striped attention as a PyTorch-native layer.

``import cp_dtensor`` installs the SDPA-on-DTensor rule (see Note [SDPA dispatch] in dispatch.py):
from then on ``F.scaled_dot_product_attention`` on sequence-sharded DTensors runs the ring.
"""

from . import dispatch as _dispatch  # noqa: F401  (installs the SDPA handlers)
from .checkpoint import (
    CheckpointError,
    CheckpointExistsError,
    export_hf_safetensors,
    latest_checkpoint,
    load_hf_safetensors,
    load_sequence_sharded,
    relayout,
    save_checkpoint,
    save_sequence_sharded,
)
from .decode import sharded_cache_attention
from .layout import LAYOUTS
from .module import (
    apply_context_parallel,
    document_ids_from_positions,
    reduce_gradients,
    shard_batch,
    unshard_sequence,
)
from .placement import HeadTail, Striped, sequence_placement, shard_sequence
from .relayout import to_mesh
from .ring import ring_attention

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "LAYOUTS",
    "HeadTail",
    "Striped",
    "apply_context_parallel",
    "document_ids_from_positions",
    "export_hf_safetensors",
    "latest_checkpoint",
    "load_hf_safetensors",
    "load_sequence_sharded",
    "reduce_gradients",
    "relayout",
    "ring_attention",
    "save_checkpoint",
    "save_sequence_sharded",
    "sequence_placement",
    "shard_batch",
    "shard_sequence",
    "sharded_cache_attention",
    "to_mesh",
    "unshard_sequence",
]
