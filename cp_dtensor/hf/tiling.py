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

The head can be tiled only when the logits go from ``lm_head(hidden)`` straight to the loss (or through
a served family's scale), which the door proves from an allowlist of families and their config (Note
[The transformers door's allowlist] in hf/served.py): a family not on it, a config entry that may cap or
slice the logits, a loss other than ``ForCausalLM`` (``config.loss_type``, a custom
``model.loss_function``) or a head that is not nn.Linear's forward raise when tiling is applied, naming
what cannot be tiled; the same on every rank, before any communication (apply_context_parallel checks
before it changes the model).

Note [What a tiled call re-checks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model changes after tiling is applied: a soft cap set in its config, a forward hook registered on the
head, the head replaced (``resize_token_embeddings`` puts in a new ``nn.Linear``). Each would make the
tiled loss differ from the model's own, silently. So every tiled call (training mode, labels) runs the
apply-time checks again in the model's pre-hook, before the call runs (the same answer on every rank,
before any collective): the config against the allowlist, and the head against its own allowlist --
``nn.Linear``'s forward (a subclass that keeps it is served; one with its own ``forward`` is refused, as
is a ``forward`` set on the instance), and no forward hook but FSDP2's own post-forward (which reshards
and never reads the output): a forward hook would be handed the hidden states. Forward pre-hooks are
served: they see and may change the head's input, which is what the tiled loss takes. A replaced head
that passes is tiled as the old one was; one that does not raises, saying the head was replaced.

Note [FSDP heads]
~~~~~~~~~~~~~~~~~
Under FSDP2 (``fully_shard``) with the head as its own unit, the head's post-forward reshards its weight
(a DTensor ``Shard(0)`` on the data-parallel mesh) before the model's forward calls the loss, which
reads ``head.weight``: taken for a vocabulary-parallel head it would mix the ranks' batches (Note [Which
DTensor head is vocabulary-parallel] in core/vocab_parallel.py). The loss gathers it again instead, as FSDP's
own forward does: ``head.unshard()``, the tiled loss on the unsharded parameters (the dW of the fused
path accumulates into the unsharded weight's gradient, which FSDP's post-backward reduce-scatters as for
the plain head), ``head.reshard()``. A head in the root unit is unsharded for the whole forward and needs
nothing. The all-gather has the parameters' size on every rank, whatever each rank's sequence length.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from .._compat import is_fsdp_forward_hook, recorded_outputs
from ..core.tiling import check_tile_size, linear_cross_entropy, merge_tiles, tiled_forward
from .logits import replace_logits
from .served import logits_factor, tiling_error

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
        raise ValueError("sequence tiling was already applied to this model: use it as it is, or call "
                         "cp_dtensor.hf.remove_sequence_tiling(model) first to apply it with another tile size.")
    if not hasattr(model, "get_output_embeddings") or not hasattr(model, "config"):
        raise ValueError(f"sequence_tiling tiles a transformers causal LM's head and loss (a ...ForCausalLM); got "
                         f"{name}. Drop sequence_tiling for this model.")
    # See Note [The transformers door's allowlist] in hf/served.py, Note [What a tiled call re-checks]
    error = tiling_error(model) or _head_error(model, model.get_output_embeddings())
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
    _tile_head(head, state)
    for m in [model, *_mlps(model)]:
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


def _tile_head(head: nn.Linear, state: TilingState) -> None:
    head.forward = functools.partial(_head_forward, head)
    setattr(head, TILING_ATTR, state)


def _head_error(model: nn.Module, head) -> str | None:
    """Why ``head`` cannot be served as the tiled head (None: it can): an allowlist -- nn.Linear's own
    forward, no forward hook but FSDP's. See Note [What a tiled call re-checks]."""
    name, kind = type(model).__name__, type(head).__name__
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        what = "not an nn.Linear" if not isinstance(head, nn.Linear) else "an nn.Linear subclass with its own forward"
        return (f"sequence_tiling cannot tile {name}'s LM head: it is {kind}, {what}; the tiled loss computes "
                "hidden @ weight.T + bias (nn.Linear's forward) and would skip any other. Use an nn.Linear head (a "
                "subclass that keeps nn.Linear's forward is served), or drop sequence_tiling for this model.")
    own = head.__dict__.get("forward")
    if own is not None and getattr(own, "func", None) is not _head_forward:
        return (f"sequence_tiling cannot tile {name}'s LM head: its forward was replaced on the instance ({own!r}), "
                "which the tiled loss would skip. Drop sequence_tiling for this model.")
    hooks = [h for h in head._forward_hooks.values() if not is_fsdp_forward_hook(h)]
    if hooks:
        return (f"sequence_tiling cannot tile {name}'s LM head: it has forward hooks ({', '.join(map(repr, hooks))}), "
                "which would be handed the hidden states: a tiled training call never forms the [batch, seq, vocab] "
                "logits. Remove them (forward pre-hooks are served), or drop sequence_tiling for this model.")
    return None


@torch.compiler.disable  # runs eagerly at every call, compiled models too (never folded into guards)
def _check_call(model: nn.Module, state: TilingState) -> None:
    """Note [What a tiled call re-checks]: raised before the call runs (the same on every rank)."""
    error = tiling_error(model)
    if error is not None:
        raise ValueError(error + " (The model changed after sequence tiling was applied: it is checked again at "
                         "every tiled call.)")
    head = model.get_output_embeddings()
    error = _head_error(model, head)
    if getattr(head, TILING_ATTR, None) is state:
        if error is not None:
            raise ValueError(error)
        return
    if error is not None:
        raise ValueError(f"{type(model).__name__}'s LM head was replaced after sequence tiling was applied "
                         "(resize_token_embeddings, set_output_embeddings), and the new head cannot be tiled: " + error)
    _tile_head(head, state)  # a plain nn.Linear put in since (resize_token_embeddings): tiled as the old one was


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
    if state.active:
        try:
            _check_call(model, state)
        except ValueError:
            state.active = False
            raise
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
    factor = None
    if logits is not state.handed:  # a served family's scale: Note [The transformers door's allowlist]
        factor = logits_factor(model)
        if factor is None or state.handed is None or logits.shape != state.handed.shape:
            raise ValueError(f"sequence_tiling: {type(model).__name__}'s loss got a tensor other than the LM head's "
                             "output, which the tiled loss cannot take for hidden states. Drop sequence_tiling for "
                             "this model.")
    state.handed = logits  # the output's logits slot holds this tensor: Note [Logits a tiled call did not compute]
    if shift_labels is None:  # transformers' in-row shift (at CP=1; under CP the hf hooks demand shift_labels)
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    gathered = isinstance(head, FSDPModule) and isinstance(head.weight, DTensor)
    if gathered:  # FSDP resharded the head after its forward: gathered again for the loss (Note [FSDP heads])
        head.unshard()
    try:
        weight, bias = head.weight, head.bias
        if bias is not None and factor is not None:
            bias = bias * factor  # (h W^T + b) f = (h f) W^T + b f; logits: h f
        tp_mesh = weight.device_mesh if isinstance(weight, DTensor) and "tp" in (
            weight.device_mesh.mesh_dim_names or ()) else None  # transformers' TP plan: its mesh's "tp" dim
        # logits: the hidden states [B, S_local, H] (times a served family's scale)
        return linear_cross_entropy(logits, weight, shift_labels.to(logits.device), bias=bias, tile_size=state.tile,
                                    num_items_in_batch=num_items_in_batch, ignore_index=ignore_index, tp_mesh=tp_mesh)
    finally:
        if gathered:
            head.reshard()


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
