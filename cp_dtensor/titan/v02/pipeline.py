"""Context parallelism inside torchtitan's pipeline stages: the batch and masks as the schedule splits them.

Note [CP under pipeline parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.2.2 builds each pipeline stage as a copy of the model with the other stages' layers
removed, and runs the family's parallelize function on every stage -- the plugin's, so every stage's
attention runs the ring over the ``cp`` mesh (the mesh is (pp, dp, cp, tp): each stage's CP group holds
the ranks of that stage). The trainer then builds the batch's masks on stage 0's model, calls
``prepare_context_parallel_input`` (the plugin's ``shard_cp_batch``) on every rank -- each CP rank keeps
its layout shard of the full [B, N] batch, *before* the schedule sees it -- and hands inputs, labels and
the keyword arguments (positions, masks) to ``pp_schedule.step``, which splits every tensor along dim 0
into microbatches and gives each stage's forward its microbatch's keyword arguments.

Two things would not survive that split, and ``shard_cp_batch(..., pipeline=True)`` reshapes them:

* RoPE positions are [1, S_local] under a named layout (every row alike); the schedule cannot split one
  row into M microbatches (it would refuse: "Expecting M arg_mbs but got 1"). They travel as [B, S_local].
* A ``RingMask`` is a ``BlockMask`` of one batch row, which the schedule gives whole to every microbatch:
  its ids [B, S_local] and the step's document plan (rows of B) would not match a microbatch's rows. The
  masks travel instead as a dict (marked ``STAGE_MASKS``) of tensors the schedule splits by rows -- each
  mask's shard ids, and under ``layout = "documents"`` the plan's ``order`` and full ``ids`` [B, N] --
  beside the rules (causal, window) and the plan's CP size, windows and placement, which it passes whole
  (plain values: FSDP's input cast walks the dict). A forward pre-hook on every stage
  (``attach_stage_masks``) rebuilds the microbatch's ``RingMask``s; the plan of its rows is
  ``layout_rows`` of the plan's rows (the documents placement plans each row alone, so that is the plan
  ``document_layout`` would build from those rows). Every stage thus builds the same plan for a
  microbatch, and the CP ranks of a stage agree on it, as the ring checks before any K/V moves. A flex
flavor at CP = 1 runs the ring too (on one rank), and nothing shards its batch: there the stage's
``get_attention_masks`` returns the travelling form itself (``schedule_masks``), with the full ids.

The loss is unchanged: the last stage's loss function sums cross entropy over its microbatch's S_local
tokens, torchtitan divides the sum over microbatches by the global count of valid tokens, and the
gradients and logged loss are those of CP = 1 (Note [CP batch and positions]). With ``sequence_tiling``
the last stage's head passes its tagged hidden states to the tiled loss as without pipelining (Note
[Sequence tiling in torchtitan]); the other stages have no head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core.plan.documents import DocumentLayout, layout_rows
from .flex import RingMask

__all__ = ["STAGE_MASKS", "attach_stage_masks", "masks_for_schedule", "rows_for_schedule", "schedule_masks"]

STAGE_MASKS = "cp_dtensor_stage_masks"  # the key that marks the masks' travelling form


def masks_for_schedule(masks: RingMask | dict[str, RingMask], plan: Any) -> dict[str, Any]:
    """Sharded ``masks`` (one ``RingMask`` or a dict of them) and the step's ``plan`` as a dict the pipeline
    schedule splits by rows: Note [CP under pipeline parallelism]."""
    one = isinstance(masks, RingMask)
    found = {"": masks} if one else masks
    rules = {k: {"ids": m.ids, "is_causal": m.is_causal, "window_size": m.window_size} for k, m in found.items()}
    travel: dict[str, Any] = {STAGE_MASKS: True, "one": one, "masks": rules, "plan": None}
    if isinstance(plan, DocumentLayout):  # order, ids: [B, N] each, the rows of every microbatch's plan
        travel["plan"] = {"order": plan.order, "ids": plan.ids, "cp_size": plan.cp_size,
                          "windows": tuple(plan.windows), "placement": plan.placement}
    return travel


def schedule_masks(get_masks):
    """A stage's ``get_attention_masks`` (the plugin's ``ring_masks``) whose masks travel in the form the
    schedule splits: at CP = 1 no ``shard_cp_batch`` reshapes them (Note [CP under pipeline parallelism])."""
    def wrapped(*args, **kwargs):
        masks = get_masks(*args, **kwargs)
        return None if masks is None else masks_for_schedule(masks, None)

    return wrapped


def _rebuild(travel: dict[str, Any]) -> RingMask | dict[str, RingMask]:
    plan = travel["plan"]
    if plan is not None:  # this microbatch's rows of the step's plan
        plan = layout_rows(plan["order"], plan["ids"], cp_size=plan["cp_size"], windows=plan["windows"],
                           placement=plan["placement"])
    masks = {k: RingMask.make(r["ids"], is_causal=r["is_causal"], window_size=r["window_size"], plan=plan)
             for k, r in travel["masks"].items()}
    return masks[""] if travel["one"] else masks


def _stage_masks_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
    travel = kwargs.get("attention_masks")
    if not (isinstance(travel, dict) and travel.get(STAGE_MASKS)):
        return None
    return args, {**kwargs, "attention_masks": _rebuild(travel)}


def attach_stage_masks(stage: nn.Module) -> None:
    """Let a pipeline stage take its microbatch's masks in their travelling form (idempotent)."""
    if getattr(stage, "_cp_dtensor_stage_masks", False):
        return
    stage.register_forward_pre_hook(_stage_masks_hook, with_kwargs=True, prepend=True)  # before FSDP's input cast
    stage._cp_dtensor_stage_masks = True


def rows_for_schedule(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """RoPE positions [1 | B, S_local] as [B, S_local], which the schedule can split into microbatches."""
    return positions.expand(batch, -1).contiguous()
