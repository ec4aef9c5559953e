"""torchtitan 0.3's Trainer with cp_dtensor's context parallelism: the config section, the checks, the hooks.

Note [How the 0.3 plugin hooks torchtitan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torchtitan 0.3 builds a trainer from a ``Trainer.Config`` that a config-registry function returns
(``--module llama3 --config llama3_debugmodel``). The plugin's ``CPTrainer`` subclasses ``Trainer``; its
``Config`` adds the ``cp_dtensor`` section (``--cp_dtensor.layout``, ``.ulysses_degree``, ``.kv_exchange``,
``.comm_dtype``: the 0.2.2 TOML section's fields), and ``as_cp_config`` turns any family's config into
one. Its ``__init__`` checks the job on every rank before the process group starts, then wraps the
model spec's ``parallelize_fn``; the wrapper, around the family's own parallelize function:

* replaces every layer's ``attention.inner_attention`` (FlexAttention or VarlenAttention) with
  ``RingInnerAttention`` over the CP group (or a group of this rank alone at CP = 1), and the model's
  ``get_attention_masks`` with ``ring_masks`` (Note [0.3 inner attention as the ring]); qwen3_5's Gated
  DeltaNet layers run sharded instead (Note [qwen3_5 under the 0.3 plugin] in linear.py);
* swaps the family's ``apply_cp_to_forward`` (0.3's own CP: an all-gather of K/V around FlexAttention)
  for a check that the ring is in place, for the duration of the call;
* rebinds ``prepare_context_parallel_input`` in ``torchtitan.trainer`` and ``torchtitan.components.validate``
  -- which call it from ``post_dataloading_process`` and the validator -- to ``shard_cp_batch`` in the layout;
* under TP, re-ties tied embeddings right after the model's ``parallelize`` (``_retie_after_parallelize``);
  the ring takes each TP rank's heads (Note [0.3 TP heads into the ring] in attention.py).

0.3's ``spmd_types`` and ``full_dtensor`` backends put CP into the model's own sharding (a ``local_map``
boundary that all-gathers K/V); the ring runs under ``partial_dtensor``, which the plugin's configs select
(``as_cp_config``); a job that sets another backend is refused at start, naming ``partial_dtensor``.
``as_cp_config`` also fixes ``--debug.seed`` (42) where the config leaves it unset: torchtitan then draws a
new seed per run, and a CP = 1 and a CP = 2 run of the same command would start from different weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ..._compat import TITAN03_CP_STEP
from ..shared.cpu import (
    init_as_unsharded,
    init_stages_as_whole,
    unsharded_template,
    use_for_loop_experts,
    use_sum_reduction_on_gloo,
)
from ..shared.heads import ulysses_mesh, ulysses_shard_index
from ..shared.options import CPDTensor
from ..shared.plan import titan_unit
from ..shared.tiling import apply_sequence_tiling, tag_after_tp
from ._cpu import experts_in_param_dtype
from .attention import RingInnerAttention, ring_masks, shard_cp_batch
from .dynamic import dynamic_unsupported, shard_dynamic_batch
from .linear import HYBRID, apply_hybrid, check_hybrid, hybrid_masks, is_hybrid, without_cp
from .tiling import tiled_loss_config

__all__ = ["FAMILIES", "CPTrainer", "as_cp_config", "check_config"]

FAMILIES = ("llama3", "qwen3", "deepseek_v3", "gpt_oss", "qwen3_5")  # torchtitan 0.3 model names the plugin serves
TP_FAMILIES = ("llama3", "qwen3")  # served with TP too: the MoE families' TP = 2 gradients differ from TP = 1 (docs/torchtitan03.md)
BACKEND = "partial_dtensor"  # the spmd_backend the ring runs under
SEED = 42  # the plugin's --debug.seed where a config sets none (torchtitan's default rolls a new one per run)
_BATCH_HOLDERS = ("torchtitan.trainer", "torchtitan.components.validate")  # call prepare_context_parallel_input


def _inner_attention_kind(model_config) -> str | None:
    """"flex" / "varlen" / "sdpa" / another class name, of the model's first full-attention layer."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

    first = getattr(model_config, "first_attention", None)
    inner = getattr(first, "inner_attention", None)
    for kind, cls in (("flex", FlexAttention), ("varlen", VarlenAttention), ("sdpa", ScaledDotProductAttention)):
        if isinstance(inner, cls.Config):
            return kind
    return None if inner is None else type(inner).__qualname__


def check_config(config: Any, world_size: int) -> None:
    """Raise on every rank, before any collective, for a job cp_dtensor cannot run as configured."""
    par = config.parallelism
    cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
    section: CPDTensor = config.cp_dtensor
    if cp < 1 or world_size % cp != 0:
        raise ValueError(f"--parallelism.context_parallel_degree ({cp}) must be >= 1 and divide the number of ranks "
                         f"({world_size}). Launch a multiple of {cp} ranks or change the degree.")
    if section.ulysses_degree > 1 and cp % section.ulysses_degree != 0:
        raise ValueError(f"--cp_dtensor.ulysses_degree ({section.ulysses_degree}) must divide "
                         f"--parallelism.context_parallel_degree ({cp}): CP runs as ulysses x ring ranks.")
    first = getattr(config.model_spec.model, "first_attention", None)
    heads = getattr(first, "n_heads", None)
    kv_heads = getattr(first, "n_kv_heads", None) or heads
    if tp > 1 and heads is not None and (heads % tp != 0 or kv_heads % tp != 0):
        raise ValueError(f"--parallelism.tensor_parallel_degree ({tp}) must divide the query heads ({heads}) and the "
                         f"K/V heads ({kv_heads}): each TP rank runs the ring on its own heads (Note [0.3 TP heads "
                         "into the ring]). Use a tensor_parallel_degree that divides both.")
    if section.ulysses_degree > 1 and heads is not None and (heads // tp) % section.ulysses_degree != 0:
        held = f"({heads})" if tp == 1 else f"each TP rank holds ({heads} / TP {tp} = {heads // tp})"
        raise ValueError(f"--cp_dtensor.ulysses_degree ({section.ulysses_degree}) must divide the query heads {held}: "
                         "each Ulysses rank takes 1 / U of them (Note [Ulysses in torchtitan]). Use a ulysses_degree "
                         f"that divides {heads // tp}.")
    unsupported = []
    if par.spmd_backend != BACKEND:
        unsupported.append(f'--parallelism.spmd_backend {par.spmd_backend} (cp_dtensor runs under "{BACKEND}", '
                           "which its trainer selects by default: drop the flag or pass "
                           f"--parallelism.spmd_backend {BACKEND})")
    name = config.model_spec.name
    if name not in FAMILIES:
        unsupported.append(f'--module {name} (cp_dtensor serves {", ".join(FAMILIES)} on torchtitan 0.3)')
    else:
        kind = _inner_attention_kind(config.model_spec.model)
        if getattr(config.model_spec.model, "mtp_layers", None):  # deepseek_v3's multi-token prediction blocks
            unsupported.append(f"{name} {config.model_spec.flavor} with multi-token prediction layers (their attention "
                               "is torchtitan's own, not the ring, and their shifted targets cross the CP ranks' "
                               "shards; use a config without MTP, e.g. deepseek_v3_debugmodel)")
        if kind not in ("flex", "varlen"):
            unsupported.append(f'{name} {config.model_spec.flavor} with inner attention "{kind}" (the ring '
                               'replaces "flex" and "varlen")')
        if is_hybrid(config.model_spec.model):  # Note [qwen3_5 under the 0.3 plugin]
            unsupported.extend(check_hybrid(config))
    if tp > 1 and name in FAMILIES and name not in TP_FAMILIES:
        why = ("its TP = 2 gradients differ from TP = 1 without CP too, e.g. the MoE layers' ffn_norm" if name != HYBRID
               else "its Gated DeltaNet layers are not served under TP")
        unsupported.append(f"--parallelism.tensor_parallel_degree > 1 with {name} ({why}; CP x TP is served for "
                           f"{', '.join(TP_FAMILIES)})")
    if par.expert_parallel_degree > 1:  # torchtitan 0.3's ParallelDims: efsdp = dp_shard * cp * tp / ep
        ep, rest = par.expert_parallel_degree, par.data_parallel_replicate_degree * cp * tp * par.pipeline_parallel_degree
        dp_shard = par.data_parallel_shard_degree
        dp_shard = dp_shard if dp_shard > 0 else (world_size // rest if world_size % rest == 0 else 0)
        if dp_shard * cp * tp == 0 or (dp_shard * cp * tp) % ep != 0:
            raise ValueError(f"--parallelism.expert_parallel_degree ({ep}) does not divide the ranks torchtitan gives "
                             f"it: EP borrows from data_parallel_shard_degree ({dp_shard}) x context_parallel_degree "
                             f"({cp}) x tensor_parallel_degree ({tp}) = {dp_shard * cp * tp} ranks. Use an "
                             "expert_parallel_degree that divides that product, or change those degrees.")
    if section.tile_size is not None:  # Note [Sequence tiling in torchtitan]
        if getattr(par, "fsdp_reshard_after_forward", "default") == "always":
            unsupported.append("--cp_dtensor.sequence_tiling with --parallelism.fsdp_reshard_after_forward always (the "
                               "tiled loss uses the LM head's unsharded weights after its forward)")
    if section.dynamic:  # Note [Dynamic CP in torchtitan 0.3]
        unsupported.extend(f"{what} with --cp_dtensor.dynamic true" for what in dynamic_unsupported(config))
    if unsupported:
        raise ValueError("cp_dtensor context parallelism (torchtitan 0.3) does not support: " + "; ".join(unsupported)
                         + ". Change these or run torchtitan without the plugin.")
    sp = tp if par.enable_sequence_parallel else 1  # sequence parallelism splits each CP rank's tokens over TP
    if cp == 1 and sp == 1:
        return
    unit = 1 if cp == 1 else titan_unit(section.layout, cp)
    titan = sp * (1 if cp == 1 else 2 * cp)  # torchtitan's own rule (its Trainer checks it after the process group)
    factors = " * ".join(([] if cp == 1 else ["2 * CP"]) + ([] if sp == 1 else ["TP (sequence parallelism)"]))
    rules = ([] if cp == 1 else [f"the {section.layout} layout on {cp} CP ranks needs a multiple of {unit}"]) + [
        f"torchtitan a multiple of {factors} = {titan}"]
    for what, seq_len in (("--training.seq_len", config.training.seq_len),
                          ("the validator's seq_len", getattr(config.validator, "seq_len", config.training.seq_len))):
        if seq_len % unit != 0 or seq_len % titan != 0:
            raise ValueError(f"{what} ({seq_len}) does not fit: {' and '.join(rules)}. Use a multiple of "
                             f"{math.lcm(unit, titan)}.")


def as_cp_config(config: Trainer.Config) -> CPTrainer.Config:
    """A family's ``Trainer.Config`` as the plugin's (the same values, the ``cp_dtensor`` section added, and
    ``spmd_backend`` = partial_dtensor: Note [How the 0.3 plugin hooks torchtitan]; qwen3_5 in the headtail
    layout: Note [qwen3_5 under the 0.3 plugin])."""
    if isinstance(config, CPTrainer.Config):
        return config
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values["parallelism"] = dataclasses.replace(config.parallelism, spmd_backend=BACKEND)
    if config.debug.seed is None:  # same initial weights at every CP degree; --debug.seed still wins
        values["debug"] = dataclasses.replace(config.debug, seed=SEED)
    if is_hybrid(config.model_spec.model):  # the linear layers take contiguous runs: Note [qwen3_5 under the 0.3 plugin]
        values["cp_dtensor"] = CPDTensor(layout="headtail")
    if not torch.accelerator.is_available():  # CPU: fp32 parameters (Note [torchtitan 0.3 on CPU] 4); the flag wins
        # and no CUDA graphs to capture (torchtitan refuses EP's all-to-all dispatcher under them); the flags win
        values["training"] = dataclasses.replace(config.training, mixed_precision_param="float32",
                                                 disable_cuda_graphs=True)
    return CPTrainer.Config(**values)


def _single_rank_group() -> dist.ProcessGroup:
    # CP = 1: the ring on this rank alone (every rank creates every group)
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    group, _ = dist.new_subgroups(group_size=1)
    return group


@contextlib.contextmanager
def _swapped(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _ring_in_place(attention_modules, cp_mesh) -> None:
    # stands in for torchtitan's apply_cp_to_forward; see Note [How the 0.3 plugin hooks torchtitan]
    assert all(isinstance(m, RingInnerAttention) for m in attention_modules), "ring attention was not attached"


def _bind_batch_sharding(section: CPDTensor, grid: DeviceMesh | None = None) -> None:
    def prepare(inputs, labels, extra_kwargs, cp_mesh, device, load_balancer_type=None, ptrr_mask_key=None):
        if grid is not None:  # Note [Dynamic CP in torchtitan 0.3]: the global batch over the "loss" mesh
            return shard_dynamic_batch(inputs, labels, extra_kwargs, grid, cp_mesh.size())
        rank, world = cp_mesh.get_local_rank(), cp_mesh.size()
        rank = ulysses_shard_index(rank, world, section.ulysses_degree)  # Note [Ulysses in torchtitan]
        return shard_cp_batch(inputs, labels, extra_kwargs, layout=section.layout, rank=rank, cp_size=world)

    prepare._cp_dtensor = True
    for name in _BATCH_HOLDERS:
        module = importlib.import_module(name)
        assert hasattr(module, "prepare_context_parallel_input"), f"{name} no longer calls prepare_context_parallel_input"
        module.prepare_context_parallel_input = prepare


def apply_ring_attention(model: nn.Module, cp_mesh: DeviceMesh | None, section: CPDTensor) -> list[nn.Module]:
    """Every layer's inner attention -> ``RingInnerAttention`` over ``cp_mesh`` (None: this rank alone), and
    the model's masks -> ring rules. Returns the new inner attention modules."""
    if cp_mesh is None:
        group = _single_rank_group()
    elif section.ulysses_degree > 1:
        group = ulysses_mesh(cp_mesh, section.ulysses_degree)
    else:
        group = cp_mesh.get_group()
    if is_hybrid(model.config):
        return apply_hybrid(model, group, section)  # Note [qwen3_5 under the 0.3 plugin]
    # CP = 1: every layout is the identity on one rank; "documents" plans only sharded batches (no plan at CP = 1)
    layout = "striped" if cp_mesh is None and section.layout == "documents" else section.layout
    ring = []
    for i, block in model.layers.items():
        attn = getattr(block, "attention", None)
        if attn is None or not hasattr(attn, "inner_attention"):
            raise ValueError(f"cp_dtensor: layer {i} of {type(model).__name__} has no attention.inner_attention (a "
                             "linear-attention layer?); the ring serves full-attention decoders. Set "
                             "--parallelism.context_parallel_degree 1 and run torchtitan without the plugin.")
        sinks = attn if isinstance(getattr(attn, "sinks", None), nn.Parameter) else None
        attn.inner_attention = RingInnerAttention(group=group, layout=layout, comm_dtype=section.comm_torch_dtype,
                                                  kv_exchange=section.kv_exchange, sinks_of=sinks)
        ring.append(attn.inner_attention)
    return ring


def _experts_return_input_dtype(model: nn.Module) -> int:
    """gpt_oss's grouped experts compute in bf16 (on an accelerator; Note [torchtitan 0.3 on CPU] 5) and, unlike
    the common experts (``.type_as(x)``), return bf16:
    with fp32 parameters (``--training.mixed_precision_param float32``) the MoE combine's scatter_add then
    fails ("Expected self.dtype to be equal to src.dtype"). Cast their output back to the input's dtype, as
    the common experts do; a no-op under bf16. Returns how many expert modules were fixed."""
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    fixed = [m for m in model.modules() if isinstance(m, GptOssGroupedExperts)]
    for m in fixed:
        m.register_forward_hook(lambda mod, args, out: out.to(args[0].dtype))
    return len(fixed)


def _retie_after_parallelize(model: nn.Module) -> bool:
    """Tied embeddings (qwen3) under TP: torchtitan 0.3's ``Module.parallelize`` gives ``tok_embeddings`` and
    ``lm_head`` each a new DTensor parameter, and only its own weight init re-ties them -- which the plugin's
    CPU init (``init_as_unsharded``) replaces; untied, a TP = 2 run trains two matrices (measured: qwen3 debug
    CP = 2 x TP = 2, loss 7.2383 vs CP = 1 7.2120 at step 3). Re-tie right after ``parallelize``, before
    FSDP groups them. Returns whether installed."""
    if not getattr(model, "enable_weight_tying", False) or not hasattr(model, "parallelize"):
        return False
    parallelize = model.parallelize

    def parallelize_and_retie(parallel_dims) -> None:
        parallelize(parallel_dims)
        model.tok_embeddings.weight = model.lm_head.weight  # both DTensors placed Shard(0) on the TP mesh

    model.parallelize = parallelize_and_retie
    return True


def parallelize_with_ring(model: nn.Module, *, titan_fn, section: CPDTensor, parallel_dims, **kwargs) -> nn.Module:
    """``titan_fn`` (a family's own parallelize function) with the ring in place of its attention."""
    template = unsharded_template(model)  # CPU: Note [torchtitan 0.3 on CPU] 3
    if n := use_for_loop_experts(model):
        logger.info(f"cp_dtensor: {n} MoE expert modules use torchtitan's for-loop experts (CPU)")
    if n := experts_in_param_dtype(model):
        logger.info(f"cp_dtensor: {n} MoE expert modules compute in their parameters' dtype (CPU; Note [torchtitan "
                    "0.3 on CPU] 5)")
    if n := _experts_return_input_dtype(model):
        logger.info(f"cp_dtensor: {n} gpt_oss expert modules return their input's dtype (fp32 training)")
    cp_mesh = parallel_dims.get_mesh("cp") if parallel_dims.cp_enabled else None
    # --cp_dtensor.dynamic true: the ring over the flattened dp x cp ("loss") mesh: Note [Dynamic CP in torchtitan 0.3]
    grid = parallel_dims.get_mesh("loss") if cp_mesh is not None and section.dynamic else None
    if section.tile_size is not None:  # Note [Sequence tiling in torchtitan] (titan/shared/tiling.py)
        tp = parallel_dims.tp_enabled  # under TP the MLPs stay whole and the head is vocabulary-parallel, as on 0.2.2
        tiled, whole = apply_sequence_tiling(model, section.tile_size, head_name="lm_head", tile_mlps=not tp,
                                             stage=parallel_dims.pp_enabled, vocab_sharded_output=tp)
        head = "the LM head + loss and " if getattr(model, "lm_head", None) is not None else ""  # PP: the last stage
        logger.info(f"cp_dtensor: sequence tiling, {section.tile_size} tokens a tile: {head}{tiled} "
                    "MLPs" + (f" ({whole} MLPs whole under TP)" if whole and tp else "")
                    + (f" ({whole} MoE layers whole)" if whole and not tp else ""))
    if parallel_dims.tp_enabled:
        _retie_after_parallelize(model)
    ring = apply_ring_attention(model, cp_mesh if grid is None else grid, section)
    model_config = model.config
    titan_module = sys.modules[titan_fn.__module__]
    with contextlib.ExitStack() as stack:
        if hasattr(titan_module, TITAN03_CP_STEP):
            stack.enter_context(_swapped(titan_module, TITAN03_CP_STEP, _ring_in_place))
        hybrid = is_hybrid(model_config)  # qwen3_5's parallelize refuses CP: Note [qwen3_5 under the 0.3 plugin]
        model = titan_fn(model, parallel_dims=without_cp(parallel_dims) if hybrid else parallel_dims, **kwargs)
    if section.tile_size is not None and parallel_dims.tp_enabled and getattr(model, "lm_head", None) is not None:
        tag_after_tp(model, head_name="lm_head")  # Note [Sequence tiling in torchtitan]: the tag past TP's wrapper
    masks = hybrid_masks if hybrid else ring_masks
    model.get_attention_masks = functools.partial(masks, model_config)  # Note [0.3 inner attention as the ring]
    if cp_mesh is not None:
        _bind_batch_sharding(section, grid)
    first = ring[0]
    logger.info(f"Applied cp_dtensor ring attention (layout={section.layout}, cp={parallel_dims.cp}"
                + (f", ulysses={section.ulysses_degree}" if section.ulysses_degree > 1 else "")
                + ("" if section.kv_exchange == "ring" else f", kv_exchange={section.kv_exchange}")
                + ("" if grid is None else f", dynamic over dp x cp = {grid.size()} ranks")
                + f") to the model; K/V payload {'as the input dtype' if first.comm_dtype is None else first.comm_dtype}")
    use_sum_reduction_on_gloo(model)
    if init_as_unsharded(model, template):
        logger.info("cp_dtensor: weights initialised on an unsharded CPU replica, then sharded: the same at every "
                    "CP / FSDP degree (Note [torchtitan 0.3 on CPU] 3)")
    return model


def _stages_init_as_whole(pipelining_fn):
    # torchtitan 0.3 seeds each PP rank apart and initialises each stage alone, as 0.2.2: Note [torchtitan on CPU] 7
    @functools.wraps(pipelining_fn)
    def wrapped(model: nn.Module, **kwargs):
        template = unsharded_template(model)  # the whole model, before torchtitan cuts it into stages
        schedule, stages, *rest = pipelining_fn(model, **kwargs)
        if init_stages_as_whole(stages, template):
            logger.info("cp_dtensor: pipeline stages initialised from one CPU replica of the whole model: the "
                        "weights of a one-rank run (Note [torchtitan on CPU] 7)")
        return (schedule, stages, *rest)

    wrapped._cp_dtensor = True
    return wrapped


class CPTrainer(Trainer):
    """torchtitan 0.3's Trainer with cp_dtensor's ring attention (Note [How the 0.3 plugin hooks torchtitan])."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        cp_dtensor: CPDTensor = field(default_factory=CPDTensor)
        """cp_dtensor's context-parallel options (as the 0.2.2 TOML's [cp_dtensor] section)."""

    def __init__(self, config: Config):
        check_config(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        if config.cp_dtensor.tile_size is not None:  # the loss is built before the model: see v03/tiling.py
            config.loss = tiled_loss_config(config.loss, config.cp_dtensor.tile_size)
        spec = config.model_spec
        if not getattr(spec.parallelize_fn, "_cp_dtensor", False):
            fn = functools.partial(parallelize_with_ring, titan_fn=spec.parallelize_fn, section=config.cp_dtensor)
            fn._cp_dtensor = True
            config.model_spec = dataclasses.replace(spec, parallelize_fn=fn)
        pipelining = config.model_spec.pipelining_fn
        if pipelining is not None and not getattr(pipelining, "_cp_dtensor", False):
            config.model_spec = dataclasses.replace(config.model_spec, pipelining_fn=_stages_init_as_whole(pipelining))
        super().__init__(config)
