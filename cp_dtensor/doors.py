"""The one front door for whole models: ``apply_context_parallel`` / ``remove_context_parallel`` hand a
transformers model to ``cp_dtensor.hf`` and any other module to nn/sdpa_mode.py (the SDPA mode's hooks).

Note [One door for whole models]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two integrations serve whole models, and they read masks from different places: own models from their
SDPA calls (nn/sdpa_mode.py), transformers models from what the model declares -- windows per layer, sinks,
padding, packed position ids (hf/attention.py). A user calls one function either way; this module only
chooses, so neither integration knows the other (nn/ sits below hf/, this module above both).
``cp_dtensor.model`` is the old path of this door and of the SDPA mode's names: it imports this module
(and warns once).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._deprecated import old_keywords
from .core.batch import document_ids_from_positions, shard_batch, unshard_batch  # noqa: F401  (cp_dtensor.model's)
from .dtensor.sharding import unshard_sequence  # noqa: F401  (the old path cp_dtensor.module's name)
from .nn.sdpa_mode import RingSDPA, applied, apply_own_model, reduce_gradients, remove_own_model  # noqa: F401

__all__ = ["apply_context_parallel", "remove_context_parallel"]  # and, for cp_dtensor.model's old path, RingSDPA,
# reduce_gradients, document_ids_from_positions, shard_batch, unshard_batch (Note [One door for whole models])


def _is_transformers_model(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(model).__mro__)


@old_keywords("cp_dtensor.apply_context_parallel", cp_mesh="mesh")
def apply_context_parallel(
    model: nn.Module, mesh: DeviceMesh, *, layout: str = "striped", window_size: tuple[int, int] | None = None,
    documents: str | None = None, comm_dtype: torch.dtype | None = None, kv_exchange: str = "ring",
    sequence_tiling: bool | int = False,
) -> nn.Module:
    """Run ``model``'s ``F.scaled_dot_product_attention`` calls as ring attention over ``mesh`` (the 1-D
    CP mesh).

    Feed the model its local shard of each batch (``shard_batch``), including positions for RoPE;
    ``layout`` must match. Attention calls use ``is_causal`` and no dropout; masks come from:

    * ``layout="documents"``: packed documents placed per batch (short ones whole on a rank). Build the
      batch's plan from its full ids, ``plan = cp_dtensor.document_layout(ids, P, windows=[window_size])``,
      shard the batch with it (``shard_batch(..., layout=plan)``) and call ``model(..., cp_layout=plan)``:
      every attention call of that forward uses it (Note [A plan at the model door]);

    * ``document_ids=`` given to the model's forward (a keyword the hook takes away before the model
      sees it): this rank's shard of the global [B, N] ids, non-decreasing (packed sequences);
    * ``documents="position_ids"``: ids derived from the forward's ``position_ids`` (or ``positions``)
      that restart at 0 for every document, the Hugging Face packed-sequence convention (the full ids
      from one all-gather of the start flags, then the batch's plan in ``layout``);
    * ``window_size=(left, right)``: a sliding window on every attention call.

    ``comm_dtype`` and ``kv_exchange`` are ``ring_attention``'s, for every attention call. An SDPA call with an explicit ``attn_mask`` or dropout raises on every rank before any K/V moves.
    See Note [Module context parallel]. Returns ``model``, changed in place (forward hooks only).

    A Hugging Face transformers model goes to ``cp_dtensor.hf.apply_context_parallel`` instead: its
    masks come from what the model declares (windows per layer, sinks, padding, packed position ids),
    not from SDPA calls whose masks transformers built from local shapes.

    ``sequence_tiling=True`` (or an int: tokens per tile; True is 1024): every submodule named ``mlp``,
    ``feed_forward``, ``ffn`` or ``moe`` (token-wise, [B, S_local, ...] in and out) runs in sequence tiles,
    each recomputed in backward; compute the loss with ``cp_dtensor.linear_cross_entropy(hidden,
    head.weight, labels, num_items_in_batch=...)`` so the [S_local, vocab] logits never exist. A
    transformers model gets its head and loss tiled too (``cp_dtensor.hf.apply_context_parallel``).
    See Note [Sequence tiling] in core/tiling.py.
    """
    if _is_transformers_model(model):  # See Note [transformers under CP] in hf/attention.py
        if window_size is not None:
            raise ValueError(f"a transformers model declares its own windows (config.sliding_window / layer_types); "
                             f"got window_size={window_size!r}. Drop window_size.")
        from .hf import apply_context_parallel as apply_hf  # transformers is installed: the model is one of its

        return apply_hf(model, mesh, layout=layout, documents=documents, comm_dtype=comm_dtype,
                        kv_exchange=kv_exchange, sequence_tiling=sequence_tiling)
    return apply_own_model(model, mesh, layout=layout, window_size=window_size, documents=documents,
                           comm_dtype=comm_dtype, kv_exchange=kv_exchange, sequence_tiling=sequence_tiling)


def remove_context_parallel(model: nn.Module) -> nn.Module:
    """Take context parallelism off ``model``, in place, and return the plain module: undoes
    ``apply_context_parallel`` (its hooks and state) and, for a transformers model,
    ``cp_dtensor.hf.apply_context_parallel`` (hooks, state, the generate() wrapper, and each config's
    attention implementation as it was). Weights are untouched. For a plain copy that leaves the CP model
    as it is: ``remove_context_parallel(copy.deepcopy(model))``."""
    if applied(model):
        return remove_own_model(model)
    if getattr(model, "_cp_dtensor_hf", None) is not None:
        from .hf.state import remove_context_parallel as remove_hf

        return remove_hf(model)
    raise ValueError(f"{type(model).__name__} is not a model context parallelism was applied to "
                     "(cp_dtensor.apply_context_parallel / cp_dtensor.hf.apply_context_parallel).")
