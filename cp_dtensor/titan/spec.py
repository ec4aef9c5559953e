"""cp_dtensor's llama3 train spec: torchtitan's own, with context parallelism through the ring.

Note [How the plugin hooks torchtitan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Three hooks, none a fork; all take effect only when ``context_parallel_degree > 1``.

* Train spec. ``register_train_spec("llama3", ...)`` -- torchtitan looks up user-registered specs
  before its own -- installs torchtitan's llama3 spec with ``parallelize_fn`` wrapped.
* Attention. The wrapper puts a ``RingAttention`` in every block's ``attention.inner_attention`` (the
  SDPA wrapper torchtitan calls with q, k, v), then runs torchtitan's ``parallelize_llama`` for TP,
  activation checkpointing, compile and FSDP. During that call the CP step of ``parallelize_llama``
  (``apply_cp_to_attention_module``, which would route SDPA through torch's CUDA-only CP) is
  replaced by a check that the ring is in place.
* Batch. The trainer (and the validator) shard each batch by calling the global name
  ``prepare_context_parallel_input`` of their module. The wrapper rebinds that name, in every loaded
  module that holds torchtitan's function, to ``shard_cp_batch`` with the configured layout -- in
  ``torchtitan.train`` whether it was imported or run as ``__main__``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torchtitan.distributed.context_parallel as titan_cp
import torchtitan.models.llama3 as titan_llama3
import torchtitan.models.llama3.infra.parallelize as titan_parallelize
from torchtitan.tools.logging import logger

from ._cpu import use_sum_reduction_on_gloo
from .attention import RingAttention, shard_cp_batch
from .config import check_job_config, cp_section

__all__ = ["parallelize_llama_cp", "llama3_train_spec"]

_HOOK = "prepare_context_parallel_input"
_TITAN_PREPARE = titan_cp.prepare_context_parallel_input


@contextlib.contextmanager
def _swapped(module: types.ModuleType, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _ring_in_place(attention_modules, cp_mesh, attention_type: str) -> None:
    # stands in for torchtitan's apply_cp_to_attention_module; see Note [How the plugin hooks torchtitan]
    assert all(isinstance(m, RingAttention) for m in attention_modules), "ring attention was not attached"
    first = attention_modules[0]
    payload = "as the input dtype" if first.comm_dtype is None else f"comm_dtype={str(first.comm_dtype)[6:]}"
    logger.info(f"Applied cp_dtensor ring attention (layout={first.layout}) to the model; K/V ring payload {payload}")


def _attach_ring(model: nn.Module, cp_mesh, layout: str, comm_dtype: torch.dtype | None = None) -> None:
    attn_type = getattr(model.model_args, "attn_type", "sdpa")
    if attn_type != "sdpa":
        raise ValueError(
            f'cp_dtensor context parallelism supports attn_type "sdpa" only; this model flavor uses '
            f'"{attn_type}". Pick an SDPA flavor (e.g. "debugmodel", "8B") or set context_parallel_degree = 1.'
        )
    group = cp_mesh.get_group()
    for block in model.layers.values():
        block.attention.inner_attention = RingAttention(group=group, layout=layout, comm_dtype=comm_dtype)


def _bind_batch_sharding(layout: str) -> None:
    bound = functools.partial(shard_cp_batch, layout=layout)
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


def parallelize_llama_cp(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """torchtitan's ``parallelize_llama`` with CP through cp_dtensor's ring attention."""
    check_job_config(job_config, parallel_dims.world_size)
    if parallel_dims.cp_enabled:
        section = cp_section(job_config)
        layout = section.layout
        _attach_ring(model, parallel_dims.get_mesh("cp"), layout, section.comm_torch_dtype)
        _bind_batch_sharding(layout)
        with _swapped(titan_parallelize, "apply_cp_to_attention_module", _ring_in_place):
            model = titan_parallelize.parallelize_llama(model, parallel_dims, job_config)
    else:
        model = titan_parallelize.parallelize_llama(model, parallel_dims, job_config)
    use_sum_reduction_on_gloo(model)
    return model


def llama3_train_spec():
    """torchtitan's llama3 train spec with ``parallelize_fn = parallelize_llama_cp``."""
    spec = titan_llama3.get_train_spec()
    spec.parallelize_fn = parallelize_llama_cp
    return spec
