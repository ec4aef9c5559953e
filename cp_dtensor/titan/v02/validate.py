"""torchtitan's validator under cp_dtensor's context parallelism, for every family the plugin serves.

Note [Validation under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.2.2's ``Validator.validate`` has two problems once the batch is sharded by the ring's
layout (``prepare_context_parallel_input`` -> ``shard_cp_batch``, Note [CP batch and positions]):

1. It builds torch's own ``context_parallel`` context around the already sharded batch, from
   ``[m.freqs_cis for m in model_parts]`` (it never enters it): qwen3 and gpt_oss keep their RoPE table
   in ``rope_cache``, so validation fails there with an ``AttributeError``, and on every family it
   changes torch's global CP rotate method as a side effect.
2. It counts the valid tokens *after* sharding, over the data-parallel ranks only, and then sums the
   loss over dp x cp: at CP = P the logged validation loss is about P times the true one (measured,
   llama3 debugmodel: 15.8967 at CP = 2 vs 7.9484 at CP = 1).

And deepseek_v3 and gpt_oss register no validator at all, so ``[validation] enable = true`` fails an
assertion in torchtitan's Trainer for them.

``RingValidator`` is torchtitan's ``Validator`` (its dataloader, masks and batch sharding, metrics)
with ``validate`` doing what the training step does under CP: count the valid tokens of the whole
sequence before sharding (summed over the batch ranks), run the forward on the rank's shard (the ring
is already in every block; no torch CP context), divide each rank's loss sum by that count and sum over
the ``loss`` mesh (dp x cp). At CP = 1 it is torchtitan's own ``validate``, unchanged -- which is what
the CP = 1 vs CP = P tests compare against. The plugin's train specs install it for every family
(``build_validator_fn``); under pipeline parallelism the schedule runs the forward, as in torchtitan's own
``validate`` (Note [CP under pipeline parallelism] in pipeline.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import Validator
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools import utils as titan_utils

__all__ = ["RingValidator", "build_ring_validator"]


class RingValidator(Validator):
    """torchtitan's ``Validator`` whose ``validate`` is correct under cp_dtensor's CP; see Note [Validation under CP]."""

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        dims = self.parallel_dims
        if not dims.cp_enabled:
            return super().validate(model_parts, step)
        for model in model_parts:
            model.eval()
        device = titan_utils.device_type
        max_steps = self.job_config.validation.steps
        losses = []
        for input_dict, labels in self.validation_dataloader:
            if max_steps != -1 and len(losses) >= max_steps:
                break
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)  # [B, N]: the whole sequence, which every CP rank of a batch rank holds
            valid = (labels != IGNORE_INDEX).sum()
            if dims.dp_enabled:
                valid = torch.tensor(dist_utils.dist_sum(valid, dims.get_mesh("batch"), None), device=device)
            inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels, model_parts)
            # inputs, labels: [B, S_local], this rank's layout shard; extra_kwargs has its positions (and masks)
            if dims.pp_enabled:  # Note [CP under pipeline parallelism]: the schedule splits the sharded batch
                loss_sum = self._pipeline_loss_sum(inputs, labels, extra_inputs, extra_kwargs)
            else:
                with self.validation_context(), self.maybe_enable_amp:
                    loss_sum = self.loss_fn(model_parts[0](inputs, **extra_inputs, **extra_kwargs), labels)
            losses.append(loss_sum.detach() / valid)
        loss = torch.stack(losses).sum() / len(losses)
        self.metrics_processor.log_validation(loss=dist_utils.dist_sum(loss, dims.get_optional_mesh("loss")), step=step)
        for model in model_parts:
            model.train()

    def _pipeline_loss_sum(self, inputs, labels, extra_inputs, extra_kwargs) -> torch.Tensor:
        # torchtitan's own pipeline branch: the last stage sums its microbatches' losses; the others log -1
        targets, losses = (labels, []) if self.pp_has_last_stage else (None, None)
        first = (inputs,) if self.pp_has_first_stage else ()
        more = extra_inputs if self.pp_has_first_stage else {}
        with self.validation_context():
            self.pp_schedule.eval(*first, **more, **extra_kwargs, target=targets, losses=losses)
        if self.pp_has_last_stage:
            return torch.sum(torch.stack(losses)).to(labels.device)
        return torch.tensor([-1.0], device=labels.device)


def build_ring_validator(**kwargs) -> RingValidator:
    """``build_validator_fn`` of the plugin's train specs; takes torchtitan's ``build_validator`` arguments."""
    return RingValidator(**kwargs)
