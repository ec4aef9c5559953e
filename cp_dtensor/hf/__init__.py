"""Hugging Face transformers models under context parallelism (``pip install 'cp_dtensor[hf]'``).

* ``apply_context_parallel(model, cp_mesh, layout=...)``: the model's attention runs as the ring, through
  transformers' attention and mask interfaces (attention.py); windows, sinks, padding, packed sequences
  and hybrid linear-attention layers (linear.py) follow the model.
* ``model.generate(...)`` then runs under CP: a ring prefill into a sequence-sharded KV cache, then
  decoding from it (generate.py); hybrids keep their linear layers' full states (``ReplicatedLinearLayer``).
* ``remove_context_parallel(model)``: the plain model back (state.py: the one owner of a model's CP state).
"""

from __future__ import annotations

from .._deprecated import renamed
from .attention import NAME, apply_context_parallel, register, shift_labels
from .generate import ReplicatedLinearLayer, ShardedCache, ShardedCacheLayer, cache_bytes
from .state import remove_context_parallel

__all__ = [
    "NAME", "ReplicatedLinearLayer", "ShardedCache", "ShardedCacheLayer", "apply_context_parallel", "cache_bytes",
    "register", "remove_context_parallel", "shift_labels",
]

apply_context_parallel_hf = renamed(apply_context_parallel, "cp_dtensor.hf.apply_context_parallel_hf",
                                    "cp_dtensor.hf.apply_context_parallel")
