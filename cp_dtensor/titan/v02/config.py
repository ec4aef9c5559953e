"""The ``[cp_dtensor]`` TOML section, and the start-up checks of a torchtitan job that uses it.

torchtitan merges this module's ``JobConfig`` into its own when the TOML says
``[job] custom_config_module = "cp_dtensor.titan.config"``. (No ``from __future__ import
annotations`` here: tyro resolves the field types in torchtitan's namespace.)
"""

from dataclasses import dataclass, field
from typing import Any

from ..shared.compile_check import tp_compile_clash
from ..shared.options import COMM_DTYPES, CPDTensor
from ..shared.plan import DOCUMENTS, titan_unit
from .pipeline_checks import check_pipeline

__all__ = ["COMM_DTYPES", "FAMILIES", "CPDTensor", "JobConfig", "check_config", "cp_section"]

FAMILIES = ("llama3", "qwen3", "deepseek_v3", "llama4", "gpt_oss")  # torchtitan 0.2.2 model names the plugin serves

@dataclass
class JobConfig:
    cp_dtensor: CPDTensor = field(default_factory=CPDTensor)
    """cp_dtensor's context-parallel options."""


def cp_section(job_config: Any) -> CPDTensor:
    """The ``[cp_dtensor]`` section of a parsed torchtitan config, or a clear error without it."""
    section = getattr(job_config, "cp_dtensor", None)
    if section is None:
        raise ValueError(
            "context_parallel_degree > 1 with cp_dtensor needs its config section: add "
            '[job] custom_config_module = "cp_dtensor.titan.config" to the TOML (or pass '
            "--job.custom_config_module cp_dtensor.titan.config)."
        )
    return section


def check_config(job_config: Any, world_size: int) -> None:
    """Raise on every rank, before any collective, for a job cp_dtensor cannot run as configured."""
    par, training = job_config.parallelism, job_config.training
    cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
    if cp < 1:
        raise ValueError(f"context_parallel_degree must be >= 1; got {cp}.")
    old_names = {"float8": "quantize.linear.float8", "mx": "quantize.linear.mx"}  # older torchtitan names
    for name in getattr(job_config.model, "converters", None) or []:
        if name in old_names:
            raise ValueError(
                f'[model] converters: torchtitan 0.2.2 has no converter "{name}"; its float8 / MX linears are '
                f'"{old_names[name]}". Write converters = ["{old_names[name]}"].'
            )
    if world_size % cp != 0:
        raise ValueError(
            f"context_parallel_degree ({cp}) must divide the number of ranks ({world_size}). "
            f"Launch a multiple of {cp} ranks or change [parallelism] context_parallel_degree."
        )
    _check_ulysses(job_config, cp, tp)
    _check_tiling(job_config)
    _check_pipeline(job_config)
    _check_tp_compile(job_config, cp, tp)
    _check_expert_parallel(job_config, world_size, cp, tp)
    _check_dynamic(job_config, cp)
    if cp == 1:
        return
    layout = cp_section(job_config).layout
    unit = titan_unit(layout, cp)
    seq_len = training.seq_len
    if seq_len % (unit * tp) != 0:
        why = f"the {layout} layout on {cp} CP ranks needs a multiple of {unit}"
        if tp > 1:
            why += f", times tensor_parallel_degree ({tp}) for sequence parallelism"
        raise ValueError(
            f"[training] seq_len ({seq_len}) does not fit: {why}. Use seq_len = a multiple of {unit * tp}."
        )
    # windows (gpt_oss) and chunks (llama4) fit every layout and seq_len: the ring masks by global position
    validation = getattr(job_config, "validation", None)
    if validation is not None and validation.enable and validation.seq_len % (unit * tp) != 0:
        raise ValueError(
            f"[validation] seq_len ({validation.seq_len}) does not fit: the validator shards its batches like "
            f"training's, and the {layout} layout on {cp} CP ranks"
            + (f" times tensor_parallel_degree ({tp})" if tp > 1 else "")
            + f" needs a multiple of {unit * tp}. Use [validation] seq_len = a multiple of {unit * tp}."
        )
    if seq_len % (2 * cp * tp) != 0:
        raise ValueError(
            f"[training] seq_len ({seq_len}) must be divisible by 2 * context_parallel_degree * "
            f"tensor_parallel_degree = {2 * cp * tp}: torchtitan 0.2.2's parallelize_llama asserts this "
            "for every layout. Round seq_len up to that multiple."
        )

    unsupported = []
    name = job_config.model.name
    if name not in FAMILIES:
        unsupported.append(f'[model] name = "{name}" (cp_dtensor serves {", ".join(FAMILIES)})')
    elif (attn := _attn_type(name, job_config.model.flavor)) not in ("sdpa", "flex"):
        unsupported.append(f'[model] flavor = "{job_config.model.flavor}" with attn_type "{attn}" (the ring serves '
                           '"sdpa" and "flex" flavors, e.g. "debugmodel", "debugmodel_flex_attn")')
    if layout == DOCUMENTS and not unsupported:
        unsupported.extend(_documents_unsupported(name, job_config.model.flavor))
    if unsupported:
        raise ValueError(
            "cp_dtensor context parallelism does not support: " + "; ".join(unsupported)
            + ". Turn these off or set context_parallel_degree = 1."
        )


def _check_expert_parallel(job_config: Any, world_size: int, cp: int, tp: int) -> None:
    # torchtitan 0.2.2's ParallelDims: EP borrows its ranks from dp_shard x cp (x tp when etp = 1), the sparse mesh
    # (pp, dp_replicate, efsdp, ep, etp) with efsdp = dp_shard * cp * tp / (etp * ep)
    par = job_config.parallelism
    ep, etp = par.expert_parallel_degree, getattr(par, "expert_tensor_parallel_degree", 1)
    if ep == 1:
        return
    dp_shard, rest = par.data_parallel_shard_degree, par.data_parallel_replicate_degree * cp * tp * par.pipeline_parallel_degree
    if dp_shard < 0:
        dp_shard = world_size // rest if world_size % rest == 0 else 0
    borrowed = dp_shard * cp * tp
    if etp not in (1, tp):
        raise ValueError(f"[parallelism] expert_tensor_parallel_degree ({etp}) must be 1 or tensor_parallel_degree "
                         f"({tp}) (torchtitan's rule). Set expert_tensor_parallel_degree = 1.")
    if borrowed == 0 or borrowed % (ep * etp) != 0:
        raise ValueError(
            f"[parallelism] expert_parallel_degree ({ep}) does not divide the ranks torchtitan gives it: EP borrows "
            f"from data_parallel_shard_degree ({dp_shard}) x context_parallel_degree ({cp})"
            + (f" x tensor_parallel_degree ({tp}) / expert_tensor_parallel_degree ({etp})" if tp > 1 else "")
            + f" = {borrowed // etp if borrowed else 0} ranks. Use an expert_parallel_degree that divides "
            f"{borrowed // etp if borrowed else 'that product'}, or change those degrees.")
    name = job_config.model.name
    experts = _num_experts(name, job_config.model.flavor)  # None: a dense flavor (no EP applied) or unknown
    if experts is not None and experts % ep != 0:
        raise ValueError(f"[parallelism] expert_parallel_degree ({ep}) must divide the experts of {name} "
                         f"{job_config.model.flavor} ({experts}): each EP rank holds experts / EP of them. Use a "
                         f"divisor of {experts}.")


def _num_experts(name: str, flavor: str) -> int | None:
    if name not in FAMILIES:
        return None
    try:
        args = _flavor_args(name, flavor)
    except KeyError:  # an unknown flavor: refused below, by name
        return None
    if getattr(args, "moe_enabled", True) is False:
        return None
    return getattr(getattr(args, "moe_args", None), "num_experts", None)


def _check_tp_compile(job_config: Any, cp: int, tp: int) -> None:
    # See Note [Tensor parallelism under torch.compile]
    import torch

    comp = getattr(job_config, "compile", None)
    why = tp_compile_clash(cp=cp, tp=tp, compile_enabled=bool(getattr(comp, "enable", False)),
                           backend=getattr(comp, "backend", "inductor"), accelerator=torch.accelerator.is_available())
    if why is not None:
        raise ValueError(why + ".")


def _check_tiling(job_config: Any) -> None:
    # Note [Sequence tiling in torchtitan]: the loss reads the head's unsharded weights after its forward
    section = getattr(job_config, "cp_dtensor", None)
    if section is None or section.tile_size is None:
        return
    par = job_config.parallelism
    clash = []
    if getattr(par, "fsdp_reshard_after_forward", "default") == "always":
        clash.append('[parallelism] fsdp_reshard_after_forward = "always" (the tiled loss uses the LM head\'s '
                     "unsharded weights after its forward)")
    if clash:
        raise ValueError("[cp_dtensor] sequence_tiling does not support " + "; ".join(clash)
                         + ". Change these or remove sequence_tiling.")


def _check_pipeline(job_config: Any) -> None:
    if job_config.parallelism.pipeline_parallel_degree <= 1:
        return
    name, flavor = job_config.model.name, job_config.model.flavor
    args = _flavor_args(name, flavor) if name in FAMILIES and flavor in _flavors(name) else None  # else refused below
    check_pipeline(job_config, args, f"{name} {flavor}")


def _check_dynamic(job_config: Any, cp: int) -> None:
    # [cp_dtensor] dynamic = true: the compositions it is tested with (llama3 and deepseek_v3, EP too; FSDP, HSDP, TP, compile,
    # activation checkpointing, sequence tiling, validation, gradient accumulation, float8 linears; Note [Dynamic CP in
    # torchtitan]), the rest refused
    section = getattr(job_config, "cp_dtensor", None)
    if section is None or not section.dynamic:
        return
    par = job_config.parallelism
    other = [c for c in getattr(job_config.model, "converters", None) or [] if c != "quantize.linear.float8"]
    refused = [what for what, on in (
        ("context_parallel_degree = 1 (set it > 1: the plan spans dp_shard x cp)", cp == 1),
        (f'[model] name = "{job_config.model.name}" (dynamic serves the families with block_causal flex flavors, '
         "llama3 and deepseek_v3: qwen3 has none in torchtitan 0.2.2, llama4's mask chunks, gpt_oss's no documents)",
         job_config.model.name not in ("llama3", "deepseek_v3")),
        ("pipeline_parallel_degree > 1", par.pipeline_parallel_degree > 1),
        (f"[model] converters {other} (of the converters, dynamic serves quantize.linear.float8)", bool(other)),
    ) if on]
    if refused:
        raise ValueError("[cp_dtensor] dynamic = true is not served with: " + "; ".join(refused) + ". Turn these off, "
                         "or remove dynamic (the static documents layout serves them).")


def _flavors(family: str):
    import importlib

    return importlib.import_module(f"torchtitan.models.{family}").get_train_spec().model_args


def _documents_unsupported(name: str, flavor: str) -> list[str]:
    # layout = "documents" plans the documents of the batch's block_causal masks: Note [One plan per torchtitan batch]
    # (under TP too: Note [Documents under tensor parallelism])
    args = _flavor_args(name, flavor)
    out = []
    if getattr(args, "attn_type", "sdpa") != "flex" or getattr(args, "attn_mask_type", "causal") != "block_causal":
        out.append(f'layout = "documents" with [model] {name} flavor "{flavor}" (its masks mark no documents: the '
                   'documents come from a flex flavor with attn_mask_type = "block_causal", e.g. "debugmodel_flex_attn")')
    if getattr(args, "every_n_layers_nope", None) is not None:
        out.append('layout = "documents" with llama4\'s chunked attention (its RoPE layers mask chunks, not documents)')
    return out


def _check_ulysses(job_config: Any, cp: int, tp: int) -> None:
    # See Note [Ulysses in torchtitan] (attention.py): TP splits the query heads first, then the U ranks of a Ulysses group split
    # each TP rank's Hq / TP heads, so U must divide Hq / TP (K/V heads need no rule: Note [GQA under Ulysses]).
    section = getattr(job_config, "cp_dtensor", None)
    ulysses = 1 if section is None else section.ulysses_degree
    if ulysses == 1:
        return
    if cp % ulysses != 0:
        raise ValueError(
            f"[cp_dtensor] ulysses_degree ({ulysses}) must divide context_parallel_degree ({cp}): CP runs as "
            f"ulysses_degree x ring ranks. Set context_parallel_degree = a multiple of {ulysses} (e.g. "
            f"{ulysses * max(1, cp // ulysses)}) or ulysses_degree = a divisor of {cp}."
        )
    name, flavor = job_config.model.name, job_config.model.flavor
    if name not in FAMILIES:
        return  # refused below with the families the plugin serves
    _attn_type(name, flavor)  # raises for an unknown flavor
    args = _flavor_args(name, flavor)
    n_heads = getattr(args, "n_heads", None)
    if n_heads is None or n_heads % tp != 0:
        return  # torchtitan's TP refuses heads it cannot split
    if (n_heads // tp) % ulysses != 0:
        raise ValueError(
            f"[cp_dtensor] ulysses_degree ({ulysses}) must divide the query heads each TP rank holds: "
            f"{name} {flavor} has n_heads = {n_heads}, tensor_parallel_degree = {tp}, so {n_heads // tp} heads "
            f"per TP rank. Use a ulysses_degree that divides {n_heads // tp}"
            + (", or a smaller tensor_parallel_degree." if tp > 1 else ".")
        )


def _flavor_args(family: str, flavor: str):
    import importlib

    return importlib.import_module(f"torchtitan.models.{family}").get_train_spec().model_args[flavor]


def _attn_type(family: str, flavor: str) -> str:
    import importlib

    flavors = importlib.import_module(f"torchtitan.models.{family}").get_train_spec().model_args
    if flavor not in flavors:
        raise ValueError(f'[model] flavor "{flavor}" is not a {family} flavor of torchtitan; pick one of '
                         f'{", ".join(sorted(flavors))}.')
    return getattr(flavors[flavor], "attn_type", "sdpa")
