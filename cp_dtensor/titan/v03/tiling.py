"""torchtitan 0.3's ``--cp_dtensor.sequence_tiling``: its loss config as the tiled head + cross-entropy.

The same computation as 0.2.2's (Note [Sequence tiling in torchtitan] in titan/shared/tiling.py): the
model's ``lm_head`` hands on the hidden states tagged with its weights, every dense ``feed_forward`` runs in
tiles, and the loss -- 0.3 builds it from ``config.loss`` in ``Trainer.__init__``, before the model, and
hands it to the validator too -- is ``TiledCrossEntropyLoss``: ``CrossEntropyLoss``'s sum over the rank's
tokens divided by the global count of labelled tokens, computed tile by tile. It replaces a plain
``CrossEntropyLoss`` or 0.3's ``ChunkedLossWrapper`` around one (the debug configs' default, which calls the
head itself on chunks of the hidden states and holds one chunk's logits); any other loss is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

from ..shared.tiling import tiled_loss

__all__ = ["TiledCrossEntropyLoss", "tiled_loss_config"]


class TiledCrossEntropyLoss(CrossEntropyLoss):
    """``CrossEntropyLoss`` of the tiled head's hidden states (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        tile_size: int = 1024
        """Tokens per tile of the LM head + cross-entropy."""

    def __init__(self, config: Config, *, compile_config=None):
        super().__init__(config, compile_config=compile_config)
        self.tiled = tiled_loss(self.fn, config.tile_size)

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del kwargs
        loss = self.tiled(pred, labels)  # the sum over this rank's tokens, as cross_entropy_loss's
        if global_valid_tokens is not None:
            loss = loss / global_valid_tokens
        return loss, {}


def tiled_loss_config(loss_config, tile: int):
    """``loss_config`` (a ``CrossEntropyLoss.Config``) as the tiled loss's, or a clear error for another loss."""
    if type(loss_config) is TiledCrossEntropyLoss.Config:
        return dataclasses.replace(loss_config, tile_size=tile)
    if type(loss_config) is ChunkedLossWrapper.Config:  # 0.3's default: chunks of logits, one chunk at a time
        loss_config = loss_config.loss_fn  # the tiles replace the chunks (no logits at all)
    if type(loss_config) is not CrossEntropyLoss.Config:
        raise ValueError(f"--cp_dtensor.sequence_tiling tiles torchtitan's CrossEntropyLoss (alone or in its "
                         f"ChunkedLossWrapper) with the LM head; this job's loss is {type(loss_config).__qualname__}. "
                         "Remove sequence_tiling for this loss.")
    values = {f.name: getattr(loss_config, f.name) for f in dataclasses.fields(loss_config) if f.init}
    return TiledCrossEntropyLoss.Config(**values, tile_size=tile)


