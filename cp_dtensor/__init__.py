"""cp_dtensor: context parallelism for PyTorch -- ring / striped attention as a PyTorch-native layer."""

from .layout import LAYOUTS
from .ring import ring_attention

__all__ = ["LAYOUTS", "ring_attention"]
