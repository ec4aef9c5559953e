"""Own models (``nn.Module`` s whose attention calls ``F.scaled_dot_product_attention``) under context
parallelism: the SDPA mode's hooks (sdpa_mode.py). ``cp_dtensor.apply_context_parallel`` (doors.py) hands
such models here and transformers models to ``cp_dtensor.hf``."""

from .sdpa_mode import RingSDPA, apply_own_model, reduce_gradients, remove_own_model

__all__ = ["RingSDPA", "apply_own_model", "reduce_gradients", "remove_own_model"]
