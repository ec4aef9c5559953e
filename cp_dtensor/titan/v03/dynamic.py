"""``--cp_dtensor.dynamic true`` in torchtitan 0.3: one plan of the global batch over every dp_shard x cp
rank each step, as 0.2.2's ``[cp_dtensor] dynamic = true`` (Note [Dynamic CP in torchtitan] in
../v02/dynamic.py; the common part in ../shared/dynamic.py).

Note [Dynamic CP in torchtitan 0.3]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
0.3's ``post_dataloading_process`` gives every rank its dp rank's rows [B, N], the data's own per-document
``positions`` [B, N] and the model's masks (``RingDocs``: the ids ``cumsum(positions == 0)``), then calls
``prepare_context_parallel_input`` -- bound to ``shard_dynamic_batch`` here, with torchtitan's "loss" mesh
(``batch`` x ``cp`` flattened, flat rank ``d * cp + c``) in place of the cp mesh it passes. The global
batch is planned over that mesh and inputs, labels and positions move by one all-to-all each; positions
keep their values (0.3 rotates by the position within the document), so RoPE and the masks are those of
the static run. The ring attention modules run over the same mesh (``parallelize_with_ring``).

The rest is torchtitan's own and needs no change: the global valid-token count is taken from the rows as
loaded (summed over the batch mesh) before this hook, each rank's loss is its tokens' sum over that
count, the logged loss is the sum over the "loss" mesh, FSDP (over dp_shard x cp) sums the gradients
once, and ``ntokens_seen`` counts the labels after this hook (B * N / cp a rank, as static). The one
logged figure that differs from the static run is torchtitan's max loss (``max_loss``: each rank's loss
sum over its dp rank's valid tokens, which a rank no longer holds alone).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..shared.dynamic import shard_on_loss_mesh
from .attention import RingDocs

__all__ = ["dynamic_unsupported", "shard_dynamic_batch"]


def shard_dynamic_batch(inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, Any], grid: DeviceMesh,
                        cp: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """This rank's share of the global batch (Note [Dynamic CP in torchtitan 0.3]): inputs, labels and
    positions [B, N] -> [1, B * N / cp]; the mask: the plan and this rank's ids."""
    mask, positions = extra.get("attention_masks"), extra.get("positions")
    if not isinstance(mask, RingDocs) or positions is None:
        raise ValueError("--cp_dtensor.dynamic true needs the batch's documents: the data's positions and one "
                         "flex or varlen mask (llama3, qwen3 or deepseek_v3, e.g. --config llama3_debugmodel); got "
                         f"attention_masks={type(mask).__name__}, positions={'None' if positions is None else 'given'}.")
    (x, y, pos), plan, ids = shard_on_loss_mesh((inputs, labels, positions), grid, cp, mask.ids, [mask.window_size])
    extra["attention_masks"] = dataclasses.replace(mask, ids=ids, plan=plan)
    extra["positions"] = pos
    return x, y, extra


def dynamic_unsupported(config: Any) -> list[str]:
    """What a ``--cp_dtensor.dynamic true`` job sets that dynamic does not serve (empty: served). Tested: llama3,
    qwen3 and deepseek_v3 with flex masks over FSDP (dp_shard x cp) or HSDP, TP (Note [Documents under tensor
    parallelism]), torchtitan's default selective activation checkpointing, compile, validation, sequence
    tiling, gradient accumulation, float8 linears (a varlen config gets the same ``RingDocs`` masks); the rest
    is refused at start, as 0.2.2 refuses it (Note [Dynamic CP in torchtitan 0.3])."""
    par = config.parallelism
    quantized = re.search(r"MX\w*Linear|NVFP4", repr(config.model_spec.model)) is not None
    return [what for what, on in (
        ("--parallelism.context_parallel_degree 1 (set it > 1: the plan spans dp_shard x cp)",
         par.context_parallel_degree == 1),
        (f"--module {config.model_spec.name} (dynamic serves llama3, qwen3 and deepseek_v3: gpt_oss's sliding-window "
         "and full masks and qwen3_5's Gated DeltaNet layers are not planned by it)",
         config.model_spec.name not in ("llama3", "qwen3", "deepseek_v3")),
        ("--parallelism.expert_parallel_degree > 1", par.expert_parallel_degree > 1),
        ("--parallelism.pipeline_parallel_degree > 1", par.pipeline_parallel_degree > 1),
        ("MX / NVFP4 linears (a quantized --config; float8 is served)", quantized),
    ) if on]
