"""Sequence-sharded checkpoints that reshard between CP sizes and layouts: DCP with its safetensors
storage (dcp.py), a manifest with checksums (manifest.py). See Note [Checkpointing layout shards] in dcp.py.
"""

from __future__ import annotations

from ..dtensor.sharding import relayout  # noqa: F401  (a name this module has always had)
from .dcp import (
    export_hf_safetensors,
    latest_checkpoint,
    load_hf_safetensors,
    load_sequence_sharded,
    save_checkpoint,
    save_sequence_sharded,
)
from .manifest import CheckpointError, CheckpointExistsError

__all__ = [
    "CheckpointError", "CheckpointExistsError", "export_hf_safetensors", "latest_checkpoint", "load_hf_safetensors",
    "load_sequence_sharded", "save_checkpoint", "save_sequence_sharded",
]
