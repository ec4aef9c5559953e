"""Hugging Face transformers models under context parallelism (``pip install 'cp_dtensor[hf]'``).

* ``apply_context_parallel(model, cp_mesh, layout=...)``: the model's attention runs as the ring, through
  transformers' attention and mask interfaces (attention.py); windows, sinks, padding, packed sequences
  and hybrid linear-attention layers (linear.py) follow the model.
* ``layout="documents"``: ``plan_batch(model, position_ids=...)`` on the full batch, the batch sharded with the
  plan, ``model(**shard, cp_layout=plan)`` (documents.py: one plan per batch, every layer uses it).
* ``model.generate(...)`` then runs under CP: a ring prefill into a sequence-sharded KV cache, then
  decoding from it (generate.py); hybrids keep their linear layers' full states (``ReplicatedLinearLayer``).
  The cache it returns continues a conversation (``generate(..., cache=out.cache)``) and ``prefill_chunk_size``
  fills it chunk by chunk: pass-Q or pass-KV by the bytes each sends (turns.py, pass_kv.py).
* ``apply_sequence_tiling(model, tile_size=...)`` (or ``sequence_tiling=`` of ``apply_context_parallel``): the LM
  head + loss and the MLPs in sequence tiles, no [S_local, vocab] logits (tiling.py).
* ``remove_context_parallel(model)``: the plain model back (state.py: the one owner of a model's CP state).
* ``with_context_parallel(Trainer, cp_size=...)``: transformers' Trainer or any subclass (TRL's SFTTrainer, ...)
  under CP, one line in a script (trainer.py; ``pip install 'cp_dtensor[trainer]'``: accelerate, trl).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._deprecated import renamed
from .._extras import torchao_import_quiet

with torchao_import_quiet():  # transformers' quantizers import torchao: See Note [torchao's import noise]
    from .attention import NAME, apply_context_parallel, register, shift_labels
    from .cache import ReplicatedLinearLayer, ShardedCache, ShardedCacheLayer, cache_bytes
    from .documents import plan_batch
    from .state import remove_context_parallel
    from .tiling import apply_sequence_tiling, remove_sequence_tiling

__all__ = [
    "NAME", "ReplicatedLinearLayer", "ShardedCache", "ShardedCacheLayer", "ShardingCollator", "apply_context_parallel",
    "apply_sequence_tiling", "cache_bytes", "plan_batch", "register", "remove_context_parallel", "remove_sequence_tiling",
    "shift_labels", "with_context_parallel",
]
_TRAINER = ("ShardingCollator", "with_context_parallel")  # need accelerate too: imported when first used

if TYPE_CHECKING:
    from .trainer import ShardingCollator, with_context_parallel  # noqa: F401

apply_context_parallel_hf = renamed(apply_context_parallel, "cp_dtensor.hf.apply_context_parallel_hf",
                                    "cp_dtensor.hf.apply_context_parallel")


def __getattr__(name: str):
    if name in _TRAINER:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'cp_dtensor.hf' has no attribute {name!r}")
