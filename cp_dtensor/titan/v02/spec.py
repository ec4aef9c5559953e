"""cp_dtensor's train specs: torchtitan's own for every family, with context parallelism through the ring.

Note [How the plugin hooks torchtitan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Three hooks, none a fork, the same for every family in ``FAMILIES``.

* Train spec. ``register_train_spec(name, ...)`` -- torchtitan looks up user-registered specs
  before its own -- installs torchtitan's spec for the family with ``parallelize_fn`` wrapped, and
  with each flavor's ``update_from_config`` run with CP hidden: deepseek_v3, llama4 and gpt_oss refuse
  ``context_parallel_degree > 1`` with flex attention (gpt_oss at all) there, because *torch's* CP
  cannot serve them; the ring can.
* Attention. The wrapper applies ``apply_ring_attention`` (families.py) when CP is on or the flavor
  uses flex attention, then runs the family's own parallelize function for TP, activation
  checkpointing, compile and FSDP. During that call its CP step (``apply_cp_to_attention_module``,
  which would route attention through torch's CUDA-only CP) is replaced by a check that the ring is
  in place, and CP is hidden from its flex refusal.
* Batch. The trainer (and the validator) shard each batch by calling the global name
  ``prepare_context_parallel_input`` of their module. The wrapper rebinds that name, in every loaded
  module that holds torchtitan's function, to ``shard_cp_batch`` with the configured layout -- in
  ``torchtitan.train`` whether it was imported or run as ``__main__``.
* Validation. The spec's ``build_validator_fn`` is ``RingValidator`` (Note [Validation under CP] in
  validate.py) for every family, deepseek_v3 and gpt_oss included (torchtitan registers none for them).

Note [Stock torchtitan.train with a [cp_dtensor] section]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``python -m torchtitan.train`` (torchtitan's own main and Trainer) with one of our TOMLs either runs
the ring or refuses at start; it never falls back to torch's own CP:

* A ``[cp_dtensor]`` section parses only with ``[job] custom_config_module =
  "cp_dtensor.titan.config"``; without it torchtitan's config parser stops at once ("Invalid field
  names ... {'cp_dtensor'}"). Importing that module imports this package first, so the plugin is
  registered before the Trainer looks up a train spec -- even if ``[experimental] custom_import``
  is missing.
* For a served family the Trainer gets the plugin's spec: the ring, the batch sharding and the validator.
* For any other model name (``llama3_ft``, ``flux``, an experiment, a user's spec), the plugin wraps
  ``torchtitan.protocols.train_spec.get_train_spec``: the spec it returns is torchtitan's, with a
  ``parallelize_fn`` that first runs ``check_config`` when the job has a ``[cp_dtensor]`` section
  and ``context_parallel_degree > 1``, which raises on every rank, before any parallelism is applied,
  naming the families the plugin serves. Jobs without the section are untouched.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torchtitan.distributed.context_parallel as titan_cp
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from ..._compat import TITAN_CP_INPUT, TITAN_CP_STEP
from ..shared.cpu import (
    init_as_unsharded,
    init_stages_as_whole,
    unsharded_template,
    use_for_loop_experts,
    use_param_dtype,
    use_sum_reduction_on_gloo,
)
from ..shared.tiling import apply_sequence_tiling, tag_after_tp, tiled_loss
from .attention import RingAttention, shard_cp_batch
from .config import FAMILIES, CPDTensor, check_config, cp_section
from .families import (
    apply_family_fixes,
    apply_ring_attention,
    attention_modules,
    tied_embedding_fsdp,
    tied_embedding_tp,
)
from .pipeline import attach_stage_masks, schedule_masks
from .validate import build_ring_validator

__all__ = ["FAMILIES", "parallelize_with_ring", "refuse_cp_for_other_models", "train_spec"]

_HOOK = TITAN_CP_INPUT
_TITAN_PREPARE = titan_cp.prepare_context_parallel_input


@contextlib.contextmanager
def _swapped(module: types.ModuleType, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def _cp_hidden(job_config) -> Iterator[None]:
    # torchtitan's refusals of CP with flex read context_parallel_degree; see Note [How the plugin hooks torchtitan]
    with _swapped(job_config.parallelism, "context_parallel_degree", 1):
        yield


def _ring_in_place(attention_modules, cp_mesh, attention_type: str) -> None:
    # stands in for torchtitan's apply_cp_to_attention_module; see Note [How the plugin hooks torchtitan]
    assert all(isinstance(m, RingAttention) for m in attention_modules), "ring attention was not attached"
    first = attention_modules[0]
    payload = "as the input dtype" if first.comm_dtype is None else f"comm_dtype={str(first.comm_dtype)[6:]}"
    ulysses = f", ulysses={first.group.size(0)} x ring={first.group.size(1)}" if isinstance(first.group, DeviceMesh) else ""
    exchange = "" if first.kv_exchange == "ring" else f", kv_exchange={first.kv_exchange}"
    if getattr(first, "dynamic", False):  # Note [Dynamic CP in torchtitan]
        exchange += f", dynamic over dp x cp = {torch.distributed.get_world_size(first.group)} ranks"
    logger.info(f"Applied cp_dtensor ring attention (layout={first.layout}{ulysses}{exchange}) to the model; "
                f"K/V ring payload {payload}")


def _bind_batch_sharding(layout: str, ulysses: int = 1, pipeline: bool = False, grid: DeviceMesh | None = None) -> None:
    bound = functools.partial(shard_cp_batch, layout=layout, ulysses=ulysses, pipeline=pipeline, grid=grid)
    bound._cp_dtensor = True
    n_bound = 0
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType) or module is titan_cp:
            continue
        fn = vars(module).get(_HOOK)
        if fn is _TITAN_PREPARE or getattr(fn, "_cp_dtensor", False):
            setattr(module, _HOOK, bound)
            n_bound += 1
    if n_bound == 0:
        raise RuntimeError(
            f"cp_dtensor found no loaded module that calls torchtitan's {_HOOK}, so batches would not be "
            "sharded. Run torchtitan's Trainer (torchtitan.train) or cp_dtensor.titan.train."
        )


def parallelize_with_ring(model: nn.Module, parallel_dims, job_config, *, titan_fn) -> nn.Module:
    """``titan_fn`` (a family's own parallelize function) with CP through cp_dtensor's ring attention."""
    check_config(job_config, parallel_dims.world_size)
    titan_module = sys.modules[titan_fn.__module__]
    param_dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    if n := use_param_dtype(model, param_dtype):
        logger.info(f"cp_dtensor: {n} parameters built in another dtype now {param_dtype} (CPU; Note [torchtitan on CPU])")
    if n := use_for_loop_experts(model):
        logger.info(f"cp_dtensor: {n} MoE expert modules use torchtitan's for-loop experts (CPU; Note [torchtitan on CPU])")
    # CPU: Note [torchtitan on CPU] 6; a pipeline stage's init is installed by _whole_model_init (step 7)
    template = None if parallel_dims.pp_enabled else unsharded_template(model)
    apply_family_fixes(model)
    tile = getattr(getattr(job_config, "cp_dtensor", None), "tile_size", None)
    if tile is not None:  # before the family's AC / compile / FSDP wrap the blocks: Note [Sequence tiling in torchtitan]
        compiled = getattr(getattr(job_config, "compile", None), "enable", False)  # MoE layers tiled in eager only
        tiled, whole = apply_sequence_tiling(model, tile, tile_mlps=not parallel_dims.tp_enabled, tile_moe=not compiled,
                                             stage=parallel_dims.pp_enabled)
        head = "the LM head + loss and " if getattr(model, "output", None) is not None else ""  # PP: last stage only
        logger.info(f"cp_dtensor: sequence tiling, {tile} tokens a tile: {head}{tiled} MLPs"
                    + (f" ({whole} MoE layers whole)" if whole and not parallel_dims.tp_enabled else "")
                    + (f" ({whole} MLPs whole under TP)" if whole and parallel_dims.tp_enabled else ""))

    flex = getattr(model.model_args, "attn_type", "sdpa") == "flex"
    with contextlib.ExitStack() as stack:
        if parallel_dims.cp_enabled or flex:
            section = cp_section(job_config) if parallel_dims.cp_enabled else getattr(job_config, "cp_dtensor", CPDTensor())
            # dynamic = true: the ring over the flattened dp x cp ("loss") mesh: Note [Dynamic CP in torchtitan]
            grid = parallel_dims.get_mesh("loss") if parallel_dims.cp_enabled and section.dynamic else None
            ring_mesh = grid if grid is not None else parallel_dims.get_mesh("cp") if parallel_dims.cp_enabled else None
            apply_ring_attention(model, ring_mesh, section)
            if grid is not None:
                for a in attention_modules(model):
                    a.inner_attention.dynamic = True
            stack.enter_context(_cp_hidden(job_config))
        if parallel_dims.cp_enabled:
            _bind_batch_sharding(section.layout, section.ulysses_degree, pipeline=parallel_dims.pp_enabled, grid=grid)
            if hasattr(titan_module, TITAN_CP_STEP):
                stack.enter_context(_swapped(titan_module, TITAN_CP_STEP, _ring_in_place))
            else:  # gpt_oss: its parallelize has no CP step
                _ring_in_place([a.inner_attention for a in attention_modules(model)], None, "")
        if parallel_dims.pp_enabled and (parallel_dims.cp_enabled or flex):  # Note [CP under pipeline parallelism]
            attach_stage_masks(model)
            if flex and not parallel_dims.cp_enabled:
                model.get_attention_masks = schedule_masks(model.get_attention_masks)
        if getattr(model.model_args, "enable_weight_tying", False) and hasattr(titan_module, "apply_fsdp"):
            stack.enter_context(_swapped(titan_module, "apply_fsdp", tied_embedding_fsdp(titan_module.apply_fsdp)))
        if getattr(model.model_args, "enable_weight_tying", False) and hasattr(titan_module, "apply_non_moe_tp"):
            stack.enter_context(_swapped(titan_module, "apply_non_moe_tp", tied_embedding_tp(titan_module.apply_non_moe_tp)))
        model = titan_fn(model, parallel_dims, job_config)
    if tile is not None and parallel_dims.tp_enabled:  # Note [Sequence tiling in torchtitan]: past TP's output hook
        tag_after_tp(model)
    use_sum_reduction_on_gloo(model)
    if getattr(parallel_dims, "ep_enabled", False) and not torch.accelerator.is_available():
        logger.info(f"cp_dtensor: expert parallelism over {parallel_dims.ep} ranks, its tokens permuted on CPU by "
                    "torchtitan's generate_permute_indices(use_cpu=True) (Note [torchtitan on CPU] 1)")
    if init_as_unsharded(model, template, prepare=apply_family_fixes):
        logger.info("cp_dtensor: weights initialised on an unsharded CPU replica, then sharded: the same at every "
                    "CP / FSDP / TP degree (Note [torchtitan on CPU] 6)")
    return model


def _update_with_cp_hidden(update):
    # update: the model args class's function; bound to each flavor's args (a bound method deep-copies with them)
    @functools.wraps(update)
    def wrapped(self, job_config, *args, **kwargs):
        with _cp_hidden(job_config):
            return update(self, job_config, *args, **kwargs)

    return wrapped


def train_spec(family: str):
    """torchtitan's train spec for ``family`` with ``parallelize_fn = parallelize_with_ring(titan's own)``
    and its flavors' start-up CP refusals lifted (Note [How the plugin hooks torchtitan])."""
    spec = importlib.import_module(f"torchtitan.models.{family}").get_train_spec()
    titan_fn = spec.parallelize_fn
    spec.parallelize_fn = functools.wraps(titan_fn)(functools.partial(parallelize_with_ring, titan_fn=titan_fn))
    spec.parallelize_fn._cp_dtensor = True
    flavors = {}
    for name, args in spec.model_args.items():
        args = copy.deepcopy(args)  # torchtitan's table stays untouched
        args.update_from_config = types.MethodType(_update_with_cp_hidden(type(args).update_from_config), args)
        flavors[name] = args
    spec.model_args = flavors
    spec.build_validator_fn = build_ring_validator  # see Note [Validation under CP] in validate.py
    spec.build_loss_fn = _tiled_loss_builder(spec.build_loss_fn)
    if spec.pipelining_fn is not None:
        spec.pipelining_fn = _whole_model_init(spec.pipelining_fn)
    return spec


def _loads_checkpoint(job_config) -> bool:
    ckpt = job_config.checkpoint  # a seed checkpoint, or a resume from the job's own folder
    if not ckpt.enable or ckpt.create_seed_checkpoint:
        return False
    folder = Path(job_config.job.dump_folder) / ckpt.folder
    return bool(ckpt.initial_load_path) or (folder.is_dir() and any(folder.glob("step-*")))


def _whole_model_init(pipelining_fn):
    # torchtitan's pipelining_fn whose stages initialise as the whole model does: Note [torchtitan on CPU] 7
    @functools.wraps(pipelining_fn)
    def wrapped(model, parallel_dims, job_config, *args, **kwargs):
        template = unsharded_template(model)  # the whole model, before torchtitan cuts it into stages
        if template is not None:
            use_param_dtype(template, TORCH_DTYPE_MAP[job_config.training.mixed_precision_param])
        schedule, stages, *rest = pipelining_fn(model, parallel_dims, job_config, *args, **kwargs)
        if init_stages_as_whole(stages, template, prepare=apply_family_fixes):
            logger.info("cp_dtensor: pipeline stages initialised from one CPU replica of the whole model: the "
                        "weights of a one-rank run (Note [torchtitan on CPU] 7)")
        elif not _loads_checkpoint(job_config):
            logger.warning("cp_dtensor: under pipeline parallelism torchtitan seeds each stage differently, so a "
                           "fresh start's weights differ from a run without PP. To compare runs, start every run "
                           "from one seed checkpoint (--checkpoint.initial_load_path; docs/torchtitan.md).")
        logger.warning("cp_dtensor: torchtitan 0.2.2 backpropagates each microbatch's loss sum under pipeline "
                       "parallelism and divides only the logged loss by the token count: gradients and grad_norm are "
                       "the batch's valid-token count times those without PP, and --training.max_norm clips that "
                       "scale (docs/torchtitan.md, Pipeline parallelism).")
        return (schedule, stages, *rest)

    return wrapped


def _tiled_loss_builder(build):
    # the spec's loss, tiled with the head when [cp_dtensor] sequence_tiling is on: Note [Sequence tiling in torchtitan]
    @functools.wraps(build)
    def wrapped(job_config, *args, **kwargs):
        loss_fn = build(job_config, *args, **kwargs)
        tile = getattr(getattr(job_config, "cp_dtensor", None), "tile_size", None)
        return loss_fn if tile is None else tiled_loss(loss_fn, tile)

    return wrapped


def _refusing_cp(parallelize_fn):
    @functools.wraps(parallelize_fn)
    def wrapped(model, parallel_dims, job_config, *args, **kwargs):
        if getattr(job_config, "cp_dtensor", None) is not None and job_config.parallelism.context_parallel_degree > 1:
            check_config(job_config, parallel_dims.world_size)  # raises for a model the plugin does not serve
        return parallelize_fn(model, parallel_dims, job_config, *args, **kwargs)

    return wrapped


def refuse_cp_for_other_models(get_train_spec):
    """torchtitan's ``get_train_spec`` whose specs for models the plugin does not serve refuse CP when the
    job has a ``[cp_dtensor]`` section; see Note [Stock torchtitan.train with a [cp_dtensor] section]."""
    if getattr(get_train_spec, "_cp_dtensor", False):
        return get_train_spec

    @functools.wraps(get_train_spec)
    def wrapped(name: str):
        spec = get_train_spec(name)
        if getattr(spec.parallelize_fn, "_cp_dtensor", False):
            return spec
        return dataclasses.replace(spec, parallelize_fn=_refusing_cp(spec.parallelize_fn))

    wrapped._cp_dtensor = True
    return wrapped
