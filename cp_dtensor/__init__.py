"""cp_dtensor: context parallelism for PyTorch -- ring / striped attention as a PyTorch-native layer.

``import cp_dtensor`` installs the SDPA-on-DTensor rule (see Note [SDPA dispatch] in dispatch.py):
from then on ``F.scaled_dot_product_attention`` on sequence-sharded DTensors runs the ring.
"""

from . import dispatch as _dispatch  # noqa: F401  (installs the SDPA handlers)
from .layout import LAYOUTS
from .module import apply_context_parallel, reduce_gradients, shard_batch, unshard_sequence
from .placement import HeadTail, Striped, sequence_placement, shard_sequence, to_mesh
from .ring import ring_attention

__all__ = [
    "LAYOUTS",
    "HeadTail",
    "Striped",
    "apply_context_parallel",
    "reduce_gradients",
    "ring_attention",
    "sequence_placement",
    "shard_batch",
    "shard_sequence",
    "to_mesh",
    "unshard_sequence",
]
