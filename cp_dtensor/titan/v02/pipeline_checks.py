"""Start-up checks of a torchtitan 0.2.2 job with pipeline parallelism (Note [CP under pipeline parallelism]).

``check_config`` runs them on every rank before torchtitan builds a mesh. They refuse what torchtitan or
torch would refuse only later (after the mesh, some with a bare ``assert``) and what they would run wrong
without a word: torchtitan keeps only the stages' named modules, so a stage list that names part of a layer
(``layers.0.attention``), names a layer twice or leaves one out trains another model; and a single-stage
schedule given two stages per rank runs only the first.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_pipeline"]


def check_pipeline(job_config: Any, model_args: Any | None, model: str) -> None:
    """Raise for a PP job whose batch, schedule or stage cut cannot run. ``model_args``: the flavor's
    torchtitan model args (None for a model the plugin refuses elsewhere); ``model``: its name for messages."""
    par, training = job_config.parallelism, job_config.training
    pp = par.pipeline_parallel_degree
    if pp <= 1:
        return
    batch, micro = training.local_batch_size, par.pipeline_parallel_microbatch_size
    if micro < 1 or batch % micro:
        raise ValueError(
            f"[training] local_batch_size ({batch}) must be a multiple of [parallelism] "
            f"pipeline_parallel_microbatch_size ({micro}): the pipeline schedule splits each batch into "
            f"microbatches of that many rows. Use a local_batch_size that is a multiple of {max(micro, 1)} or a "
            f"microbatch size that divides {batch}.")
    validation = getattr(job_config, "validation", None)
    if validation is not None and validation.enable and (validation.local_batch_size, validation.seq_len) != (
            batch, training.seq_len):
        raise ValueError(
            f"[validation] local_batch_size ({validation.local_batch_size}) and seq_len ({validation.seq_len}) must "
            f"equal [training]'s ({batch}, {training.seq_len}) with pipeline_parallel_degree = {pp}: the validator "
            "runs the training schedule, whose stages exchange microbatches of the training shape. Set them equal.")
    from torch.distributed.pipelining import schedules as S

    try:
        schedule = S.get_schedule_class(par.pipeline_parallel_schedule)
    except ValueError:
        return  # torchtitan names the schedules it knows
    stages = _stage_count(par, model_args, model, schedule)
    if stages is not None and not getattr(par, "pipeline_parallel_schedule_csv", ""):
        _check_microbatches(par.pipeline_parallel_schedule, schedule, batch // micro, pp, stages, batch, micro)


def _stage_count(par: Any, model_args: Any | None, model: str, schedule: type) -> int | None:
    """The number of stages torchtitan cuts the model into (checked); None when it cannot be known here."""
    from torch.distributed.pipelining import schedules as S

    pp, name = par.pipeline_parallel_degree, par.pipeline_parallel_schedule
    looped = issubclass(schedule, S.PipelineScheduleMulti)
    layers = getattr(model_args, "n_layers", None)
    per_layer = par.pipeline_parallel_layers_per_stage
    if par.module_fqns_per_model_part is not None:
        stages = len(par.module_fqns_per_model_part)
        if layers is not None:
            _check_named_cut(par.module_fqns_per_model_part, layers, model)
        how = f"module_fqns_per_model_part lists {stages} stages"
    elif per_layer is not None:
        if layers is None:
            return None
        first, last = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
        stages = math.ceil((layers + first + last) / per_layer)
        how = f"pipeline_parallel_layers_per_stage = {per_layer} cuts {model}'s {layers} layers into {stages} stages"
    else:
        stages = pp * (2 if looped else 1)  # torchtitan's default: two stages per rank for looped schedules
        how = f"the {name} schedule's default cut is {stages} stages"
    per_rank = stages // pp
    v_style = issubclass(schedule, (S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV))
    if stages % pp or (not looped and per_rank != 1) or (v_style and per_rank != 2) or (
            looped and per_layer is not None and per_rank < 2) or per_rank < 1:
        want = "exactly 2" if v_style else "at least 2" if looped and per_layer is not None else (
            "one or more" if looped else "exactly 1")
        raise ValueError(
            f"[parallelism] {how}, which does not fit pipeline_parallel_degree = {pp} with the {name} schedule: it "
            f"runs {want} stage(s) on every rank, the same number on each. Give {pp} x that many stages "
            "(pipeline_parallel_layers_per_stage or module_fqns_per_model_part), or pick a "
            + ("looped schedule (Interleaved1F1B) for several stages per rank." if not looped
               else "single-stage schedule (1F1B, GPipe) for one stage per rank."))
    if layers is not None and par.module_fqns_per_model_part is None:
        _check_default_cut(par, layers, model, stages)
    return stages


def _check_default_cut(par: Any, layers: int, model: str, stages: int) -> None:
    # torchtitan's generate_llm_fqn_per_model_part: the embedding and the head weigh first / last "layers" each
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    first, last = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
    if stages > layers + first + last:
        raise ValueError(
            f"pipeline_parallel_degree = {par.pipeline_parallel_degree} with the {par.pipeline_parallel_schedule} "
            f"schedule cuts {model} into {stages} stages, more than its {layers} layers + embedding + head"
            + (f" (weighing {first} and {last} layers)" if (first, last) != (1, 1) else "")
            + ": a stage would split a layer. Use fewer stages: a smaller pipeline_parallel_degree, a single-stage "
            "schedule (1F1B, GPipe) or a larger pipeline_parallel_layers_per_stage.")
    try:
        generate_llm_fqn_per_model_part(stages, layers, first, last)
    except ValueError as err:
        raise ValueError(
            f"torchtitan cannot cut {model} ({layers} layers) into {stages} stages: {err} Use fewer stages or smaller "
            "pipeline_parallel_first_stage_less_layers / pipeline_parallel_last_stage_less_layers.") from None


def _check_named_cut(parts: list[list[str]], layers: int, model: str) -> None:
    # torchtitan keeps whole children of the model (tok_embeddings, norm, output) and whole layers.<i>; any other
    # name keeps nothing, and a layer no stage names is dropped: the job would train a different model
    seen: dict[str, int] = {}
    for stage, names in enumerate(parts):
        for fqn in names:
            head, _, rest = fqn.partition(".")
            if rest and not (head == "layers" and rest.isdigit() and int(rest) < layers):
                raise ValueError(
                    f"[parallelism] module_fqns_per_model_part: stage {stage} names {fqn!r}, which splits a module "
                    f"torchtitan cannot split: a stage holds whole layers (layers.0 .. layers.{layers - 1} of "
                    f"{model}) and whole top-level modules (tok_embeddings, norm, output). Name the whole layer.")
            if fqn in seen:
                raise ValueError(
                    f"[parallelism] module_fqns_per_model_part names {fqn!r} in stages {seen[fqn]} and {stage}: "
                    "each module belongs to exactly one stage. Name it once.")
            seen[fqn] = stage
    missing = [f"layers.{i}" for i in range(layers) if f"layers.{i}" not in seen]
    if missing:
        raise ValueError(
            f"[parallelism] module_fqns_per_model_part leaves out {', '.join(missing)} of {model}: torchtitan drops "
            "every layer no stage names, so the job would train a smaller model. Name each layer in one stage.")


def _check_microbatches(name: str, schedule: type, n_mb: int, pp: int, stages: int, batch: int, micro: int) -> None:
    # torch's schedules refuse these when they are built (after the mesh and the model)
    from torch.distributed.pipelining import schedules as S

    rows = (f"local_batch_size ({batch}) / pipeline_parallel_microbatch_size ({micro}) = {n_mb} microbatches")
    if issubclass(schedule, (S.Schedule1F1B, S.ScheduleDualPipeV)) and n_mb < stages:
        raise ValueError(
            f"[parallelism] the {name} schedule needs at least as many microbatches as stages ({stages}); "
            f"{rows}. Use local_batch_size >= {stages * micro} (or a smaller microbatch size), or the GPipe schedule.")
    if issubclass(schedule, (S.ScheduleInterleaved1F1B, S.ScheduleInterleavedZeroBubble)):
        rounds = max(1, n_mb // pp)
        if n_mb % rounds:
            raise ValueError(
                f"[parallelism] the {name} schedule runs microbatches in rounds of pipeline_parallel_degree ({pp}) "
                f"and needs their number to be a multiple of the rounds ({rounds}); {rows}. Use a number of "
                f"microbatches below {pp} or a multiple of {pp}.")
