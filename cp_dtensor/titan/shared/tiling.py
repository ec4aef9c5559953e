"""``[cp_dtensor] sequence_tiling``: torchtitan's LM head + cross-entropy and its MLPs in sequence tiles.

Note [Sequence tiling in torchtitan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan's step is ``pred = model(inputs)`` (the head's logits [B, S_local, V]) and then ``loss_fn(pred,
labels)`` (a sum of cross-entropy over the rank's tokens; the trainer divides by the global count of
labelled tokens). With ``sequence_tiling`` the two become one tiled computation (Note [Sequence tiling]
in core/tiling.py), so no [S_local, V] tensor exists in forward or in backward:

* the head (``model.output``, an ``nn.Linear``) passes its input through, the hidden states [B, S_local,
  D], tagged with the head's weight and bias *as its forward saw them* (under FSDP the unsharded
  parameters: the final norm + head group keeps them until the backward under torchtitan's default
  ``fsdp_reshard_after_forward``; "always" would free them, and is refused);
* the train spec's loss becomes ``linear_cross_entropy(hidden, weight, labels, num_items_in_batch=1)``:
  the same sum, ignore index -100, labels already shifted by torchtitan's data; dW accumulates into the
  unsharded weight's gradient, which FSDP reduce-scatters as before. A prediction without the tag (a
  model whose head did not run through the plugin) raises instead of being taken for logits;
* every block's dense ``feed_forward`` (SwiGLU) runs ``tile`` tokens at a time under non-reentrant
  checkpointing (``tiled_forward``), so its [tile, hidden_dim] intermediates exist for one tile at a time.
  MoE layers (``moe``) are left whole: their routers count tokens per expert in forward, which a
  recomputed tile would count twice.

The loss equals the untiled one (fp32: to rounding; tests/titan/v02/test_titan_tiling.py). It applies at
every CP degree, CP = 1 included (the plugin's parallelize runs for every job of a served family).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ...core.tiling import linear_cross_entropy, tiled_forward

__all__ = ["apply_sequence_tiling", "tiled_loss", "HEAD_TAG"]

HEAD_TAG = "_cp_dtensor_head"  # the attribute of the head's output: (weight, bias) as its forward saw them


def _head_forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    # See Note [Sequence tiling in torchtitan]: the hidden states [B, S_local, D], tagged with the head
    out = hidden.view_as(hidden)  # a new tensor object: the tag never lands on a tensor another module holds
    setattr(out, HEAD_TAG, (head.weight, head.bias))
    return out


def apply_sequence_tiling(model: nn.Module, tile: int, *, head_name: str = "output") -> tuple[int, int]:
    """Tile ``model``'s head + loss and its blocks' dense MLPs (Note [Sequence tiling in torchtitan]).
    Refuses, by name, a head that is not an ``nn.Linear``. Returns (tiled MLPs, untiled MoE layers)."""
    head = getattr(model, head_name, None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"[cp_dtensor] sequence_tiling tiles the LM head with the loss; {type(model).__name__}."
                         f"{head_name} is {type(head).__name__}, not an nn.Linear. Remove sequence_tiling for this model.")
    head.forward = functools.partial(_head_forward, head)
    tiled = moe = 0
    for block in getattr(model, "layers", {}).values():
        ffn = getattr(block, "feed_forward", None)
        if getattr(block, "moe_enabled", False) or ffn is None:
            moe += 1
            continue
        ffn.forward = functools.partial(tiled_forward, ffn.forward, tile_size=tile, what=f"{type(ffn).__name__}")
        tiled += 1
    return tiled, moe


def tiled_loss(loss_fn, tile: int):
    """``loss_fn(pred, labels)`` as the tiled head + cross-entropy sum (Note [Sequence tiling in torchtitan])."""

    @functools.wraps(loss_fn)
    def loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = getattr(pred, HEAD_TAG, None)
        if head is None:
            raise ValueError("[cp_dtensor] sequence_tiling: the model's output did not come through the plugin's "
                             "tiled LM head (its loss would take hidden states for logits). Train a family the "
                             "plugin serves, or remove sequence_tiling.")
        weight, bias = head
        return linear_cross_entropy(pred, weight, labels, bias=bias, tile_size=tile, num_items_in_batch=1)

    return loss
