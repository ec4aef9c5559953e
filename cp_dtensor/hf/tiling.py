"""Sequence tiling for transformers causal LMs: the LM head + loss and each layer's MLP in sequence tiles.

Note [Sequence tiling in transformers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``apply_sequence_tiling(model, tile_size=T)`` (``sequence_tiling=`` of ``apply_context_parallel``)
changes three things on the model, each reading a :class:`TilingState` stored as ``_cp_dtensor_tiling``
on the model, its LM head and its MLPs (module-level functions bound with ``functools.partial``: copies
and pickles carry them to the copy's own modules, as Note [CP state on a model] in state.py asks):

* the top-level call's pre-hook decides whether this call's head is tiled: the call has ``labels`` and
  the model is in training mode (``model.train()``). Evaluation (``model.eval()``: Trainer.evaluate /
  predict) and calls without labels run the head whole and return logits as before.
* the LM head (``get_output_embeddings()``, an ``nn.Linear``), in a tiled call, hands the hidden states
  through unchanged; the model's loss function (``model.loss_function``, transformers' ``ForCausalLMLoss``
  otherwise) then computes ``core.tiling.linear_cross_entropy`` from them with the head's weight: the
  same shift (``shift_labels`` when given -- under CP the globally shifted labels; else ``labels``
  shifted in the row as transformers does), the same reduction (``num_items_in_batch``, ignore_index).
  The output's ``loss`` is that loss; its ``logits`` (or, with ``return_dict=False``, the tuple's entry
  after the loss) is a [B, S_local, 0] ``TiledLogits`` that raises when read: Note [Logits a tiled call
  did not compute] in hf/logits.py. The post-hook puts it in.
* every decoder layer's ``mlp`` (``model.base_model.layers[i].mlp``: SwiGLU, or an MoE block whose
  router scores come back [B * S, E]) runs through ``core.tiling.tiled_forward``: T tokens at a time,
  each tile recomputed in backward, in every call (training or not).

Note [Recorded router logits under tiling]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers records an MoE router's logits with a forward hook on the router module
(``_can_record_outputs``), one entry a call, and the causal LM's ``load_balancing_loss_func`` reads one
[B * S, E] entry a layer (with an ``attention_mask``, rows in [B * S] order). A tiled block calls its router
once a tile, so the tiled MLP call replaces the entries its tiles added with one, merged as the tiles'
outputs are (``core.tiling.merge_tiles``): the router loss, ``outputs.router_logits`` and their gradients
are the untiled model's. The recompute in backward runs after the forward's recorder has closed and records
nothing.

The head can be tiled only when the logits go from ``lm_head(hidden)`` straight to the loss, which the
door proves from an allowlist of families and their config (Note [The transformers door's allowlist] in
hf/served.py): a family not on it, a config entry that may scale, cap or slice the logits, a loss other
than ``ForCausalLM`` (``config.loss_type``, a custom ``model.loss_function``) or a head that is not an
``nn.Linear`` raise when tiling is applied, naming what cannot be tiled; the same on every rank, before
any communication (apply_context_parallel checks before it changes the model).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F

from .._compat import recorded_outputs
from ..core.tiling import check_tile_size, linear_cross_entropy, merge_tiles, tiled_forward
from .logits import replace_logits
from .served import tiling_error

__all__ = ["TILING_ATTR", "TilingState", "apply_sequence_tiling", "check_tileable", "remove_sequence_tiling"]

TILING_ATTR = "_cp_dtensor_tiling"


@dataclass(eq=False)
class TilingState:
    """See Note [Sequence tiling in transformers]."""

    tile: int  #: tokens per tile
    loss: Any  #: the model's loss function before tiling (transformers' LOSS_MAPPING entry)
    active: bool = False  #: this call's head and loss run tiled (labels given, training mode)
    handles: list = None  #: the hooks tiling registered
    handed: Tensor | None = None  #: this call's hidden states the head handed to the loss (the logits slot)


def _mlps(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model.base_model, "layers", None) or ()
    return [layer.mlp for layer in layers if isinstance(getattr(layer, "mlp", None), nn.Module)]


def check_tileable(model: nn.Module, sequence_tiling) -> int | None:
    """The tile size for ``sequence_tiling`` (None: off), or a ValueError naming what cannot be tiled.
    Changes nothing; the same answer on every rank for the same model."""
    tile = check_tile_size(sequence_tiling)
    if tile is None:
        return None
    name = type(model).__name__
    if getattr(model, TILING_ATTR, None) is not None:
        raise ValueError("sequence tiling was already applied to this model.")
    if not name.endswith("ForCausalLM") or not hasattr(model, "get_output_embeddings"):
        raise ValueError(f"sequence_tiling tiles a transformers causal LM's head and loss (a ...ForCausalLM); got "
                         f"{name}. Drop sequence_tiling for this model.")
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"sequence_tiling cannot tile {name}'s LM head: it is {type(head).__name__}, not an "
                         "nn.Linear. Drop sequence_tiling for this model.")
    error = tiling_error(model)  # See Note [The transformers door's allowlist] in hf/served.py
    if error is not None:
        raise ValueError(error)
    loss_type = getattr(model, "loss_type", None)
    if "_loss_function" in model.__dict__ or loss_type not in (None, "ForCausalLM"):
        what = "a custom model.loss_function" if "_loss_function" in model.__dict__ else f"loss_type={loss_type!r}"
        raise ValueError(f"sequence_tiling tiles transformers' causal-LM cross-entropy (ForCausalLM); {name} has "
                         f"{what}. Drop sequence_tiling, or use cp_dtensor.linear_cross_entropy in your own loss.")
    return tile


def apply_sequence_tiling(model: nn.Module, *, tile_size: int | bool = True) -> nn.Module:
    """Run a transformers causal LM's LM head + loss and its MLPs in sequence tiles of ``tile_size`` tokens
    (True: ``core.tiling.DEFAULT_TILE``), in place; with or without context parallelism. A training-mode call
    with labels returns the loss and an empty [B, S, 0] ``logits``; see Note [Sequence tiling in transformers]."""
    tile = check_tileable(model, tile_size)
    if tile is None:
        raise ValueError(f"apply_sequence_tiling takes tile_size=True or a positive int; got {tile_size!r}.")
    head = model.get_output_embeddings()
    state = TilingState(tile=tile, loss=model.loss_function)
    state.handles = [model.register_forward_pre_hook(_call_starts, with_kwargs=True),
                     model.register_forward_hook(_call_ends, always_call=True)]
    model.loss_function = functools.partial(_loss, model)
    head.forward = functools.partial(_head_forward, head)
    for m in [model, head, *_mlps(model)]:
        setattr(m, TILING_ATTR, state)
    for mlp in _mlps(model):
        mlp.forward = functools.partial(_mlp_forward, mlp)
    return model


def remove_sequence_tiling(model: nn.Module) -> nn.Module:
    """Undo ``apply_sequence_tiling`` in place (hooks, the head's and MLPs' forwards, the loss function)."""
    state = getattr(model, TILING_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} has no sequence tiling to remove.")
    for handle in state.handles:
        handle.remove()
    for m in model.modules():
        if getattr(m, TILING_ATTR, None) is state:
            delattr(m, TILING_ATTR)
            m.__dict__.pop("forward", None)
    model.__dict__.pop("_loss_function", None)
    return model


def _labels(model: nn.Module, args, kwargs):
    if "labels" in kwargs:
        return kwargs["labels"]
    try:
        return inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments.get("labels")
    except TypeError:
        return None


def _call_starts(model: nn.Module, args, kwargs):
    state: TilingState = getattr(model, TILING_ATTR)
    state.active = model.training and _labels(model, args, kwargs) is not None
    return args, kwargs


def _call_ends(model: nn.Module, args, output):
    state: TilingState = getattr(model, TILING_ATTR)
    if state.active and state.handed is not None:  # Note [Logits a tiled call did not compute] in hf/logits.py
        output = replace_logits(output, state.handed)
    state.active, state.handed = False, None
    return output


def _head_forward(head: nn.Linear, x: Tensor) -> Tensor:
    # x: [B, S_local, H]; tiled: the hidden states go to the loss as they are (no [B, S_local, V] logits)
    state: TilingState = getattr(head, TILING_ATTR)
    if not state.active:
        return F.linear(x, head.weight, head.bias)
    state.handed = x  # what the output's logits slot will hold: replaced by TiledLogits at the call's end
    return x


def _loss(model: nn.Module, logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch=None,
          ignore_index: int = -100, shift_labels: Tensor | None = None, **kwargs) -> Tensor:
    state: TilingState = getattr(model, TILING_ATTR)
    if not state.active:
        return state.loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                          ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    head = model.get_output_embeddings()
    if shift_labels is None:  # transformers' in-row shift (at CP=1; under CP the hf hooks demand shift_labels)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    # logits: the hidden states [B, S_local, H]
    return linear_cross_entropy(logits, head.weight, shift_labels.to(logits.device), bias=head.bias,
                                tile_size=state.tile, num_items_in_batch=num_items_in_batch,
                                ignore_index=ignore_index)


def _mlp_forward(mlp: nn.Module, x: Tensor, *args, **kwargs):
    state: TilingState = getattr(mlp, TILING_ATTR)
    recorded = recorded_outputs() or {}  # Note [Recorded router logits under tiling]
    before = {key: len(got) for key, got in recorded.items() if isinstance(got, list) and key != "hidden_states"}
    out = tiled_forward(functools.partial(type(mlp).forward, mlp), x, *args, tile_size=state.tile,
                        what=type(mlp).__name__, **kwargs)
    for key, n in before.items():
        if len(recorded[key]) > n + 1:  # one entry a tile: the layer's one entry, tokens in [B * S] order
            recorded[key][n:] = [merge_tiles(recorded[key][n:], x.shape[0], state.tile, 1,
                                             f"{type(mlp).__name__}'s recorded {key}")]
    return out
