"""Every touch of a private torch or torchtitan internal, one place each, with the version it was written for.

Written against torch 2.13.0 and torchtitan 0.2.2, and checked on every torch the project claims
(``TORCH_VERSIONS``, the range ``pyproject.toml`` admits): tests/test_compat.py runs in all three CI legs,
torch 2.13.0 (the dev stack), the newest release (scripts/test_newest.sh) and the oldest, 2.11.0
(scripts/test_oldest.sh; what differs there: torch_versions.py beside this file, re-exported here). The rest of cp_dtensor imports the private torch
names it needs from here (``_StridedShard``, ``DTensorSpec``, ``redistribute_local_tensor``, the raw
``_c10d_functional`` ops, ...) and reaches DTensor's dispatcher only through the functions below.
``PRIVATE_SYMBOLS`` lists every hooked symbol with the parameters cp_dtensor relies on;
tests/test_compat.py checks each one, so a torch or torchtitan bump fails one clear test instead of
somewhere deep; a new torch release joins ``TORCH_VERSIONS`` (and the bound in pyproject.toml) when the
newest leg passes on it. The torchtitan rebinds themselves live with the plugin (titan/v02/spec.py, titan/shared/cpu.py,
titan/shared/float8.py, each citing its Note); their targets are listed here.

Note [Rank-specialised compiled graphs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ring's compiled graph is different on every rank of the CP group, by construction: each rank's
``all_to_all_single`` has its own split sizes (send to rank + 1, receive from rank - 1; comm.py) and
each causal step its own slices (rank vs the block's source rank; layout.py ``step_block``). Those are
Python ints chosen when the graph is traced; making them graph inputs would need run-time split sizes
and data-dependent slice bounds, and would not help DTensor's own collectives, which are rank-specialised
the same way. So every rank compiles its own graph, and a compile cache must key it by rank.

* ``ring_attention`` on local shards: Dynamo traces the ring itself, so the rank-specific constants
  are in the graph Dynamo hands on; Inductor's FX graph cache keys differ per rank. Safe as is.
* ``F.scaled_dot_product_attention`` on DTensors: Dynamo's graph is one SDPA call on DTensor inputs,
  the same on every rank; the ring appears only when AOTAutograd traces through DTensor's dispatch
  (dtensor/sdpa.py). AOTAutograd's cache keys that graph by its inputs' ``DTensor._stable_hash_for_caching``
  -> ``DTensorSpec._stable_hash`` -> ``DeviceMesh._stable_hash``, which (torch 2.13) hashes the mesh's
  ranks, shape and names but not *this rank's coordinate in it* (still so in 2.14 and 2.15). Every rank computes the same key, the
  last to finish a cold run owns the cache entry, and on the next run every rank loads that one rank's
  forward and backward: the other ranks then post collectives of other sizes (gloo: "Received data
  size doesn't match expected size"; NCCL: a hang or wrong data). Plain DTensor has the same bug without cp_dtensor:
  a compiled ``x.redistribute(placements=[Shard(0)])`` of a replicated ``x`` (a rank-dependent local
  slice) returns rank 1's rows on rank 0 in the second run, silently.

The fix is the key, narrowly: ``include_mesh_coordinate_in_cache_key`` makes ``DeviceMesh._stable_hash``
also hash ``mesh.get_coordinate()`` (this rank's coordinate on every mesh dim, so the rank in the CP
group too), and so every DTensor graph AOTAutograd caches is keyed by the rank it was traced on. Nothing
else reads ``_stable_hash`` in torch 2.13-2.15 (DTensor sharding propagation uses ``__hash__``). The cost:
one compile per rank (which happens anyway: the ranks trace concurrently) and one AOTAutograd cache entry
per rank instead of one shared (wrong) one. A model under ``apply_context_parallel`` (nn/sdpa_mode.py)
compiles to the local ring's graph with ``DTensor.from_local`` and the mesh in Dynamo's graph; torch
2.13's AOTAutograd cache bypasses that graph or keys its mesh input differently in every process, and
Inductor's FX graph cache, which sees the rank-specific ring, serves it: safe without the patch.
torchtitan's plugin calls ``ring_attention`` on local shards: the first case.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group as resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor._sharding_prop import LocalLRUCache
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from .torch_versions import (  # Note [torch 2.11 to 2.15]
    STRIDED_OFFSET_PARAM,
    _StridedShardOffsetMode,
    all_gather_single,
    all_gather_single_autograd,
    compiling_while_traced,
    function_output,
    plan_strided_redistributions,
    reduce_scatter_single,
    strided_offset_mode,
)

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "TorchDispatchMode",
    "_StridedShard",
    "_StridedShardOffsetMode",
    "all_gather_single",
    "all_gather_single_autograd",
    "compiling_while_traced",
    "c10d_functional",
    "compute_local_shape_and_global_offset",
    "custom_op_handlers",
    "dtensor_default_dispatch",
    "function_output",
    "include_mesh_coordinate_in_cache_key",
    "is_fsdp_forward_hook",
    "make_contiguous_strides_for",
    "mesh_concatenate",
    "mesh_flatten",
    "mesh_unflatten",
    "plan_strided_redistributions",
    "redistribute_local_tensor",
    "reduce_scatter_single",
    "replica_dataloaders",
    "seq2seq_pad",
    "strided_offset_mode",
    "resolve_process_group",
    "restore_cache_key",
    "wrap_sharding_propagation",
    "titan_cpu_permute_indices",
]

TORCH_VERSION = "2.13.0"  # what the torch touches below were written against
# where each is checked: CI's three legs (2.13.0, 2.15.0, the core on 2.11.0); 2.14.1 by hand; 2.12 not run
TORCH_VERSIONS = ("2.11", "2.12", "2.13", "2.14", "2.15")  # what differs: torch_versions.py, Note [torch 2.11 to 2.15]


TORCHTITAN_VERSION = "0.2.2"  # what the torchtitan rebinds (titan/) were written against

# The torchtitan names the plugin rebinds (the rebinding code lives with the plugin, each step citing its Note).
TITAN_MOE_KERNELS = "torchtitan.models.moe.kernels"  # a stand-in before import: Note [torchtitan on CPU] 1
TITAN_CPU_PERMUTE = "generate_permute_indices"  # of TITAN_MOE_KERNELS, with use_cpu=True: Note [torchtitan on CPU] 1
TITAN_DEVICE_HOLDERS = {  # module -> the device names it copied at import: Note [torchtitan on CPU] 2
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.tools.profiling": ("device_module",),
}
TITAN_FLOAT8 = "torchtitan.components.quantization.float8"  # has_cuda_capability: Note [float8 training on CPU]
TITAN_CP = "torchtitan.distributed.context_parallel"  # prepare_context_parallel_input: Note [How the plugin hooks torchtitan]
TITAN_CP_INPUT = "prepare_context_parallel_input"  # rebound in every module that imported it
TITAN_CP_STEP = "apply_cp_to_attention_module"  # swapped in each family's parallelize module for the call

# (module, qualified name, parameters cp_dtensor passes or replaces; None: an attribute, checked to exist).
# Checked by tests/test_compat.py.
PRIVATE_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    # hf/tiling.py: FSDP2's own forward hook on a tiled LM head is served (is_fsdp_forward_hook)
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState._post_forward", ("self", "module", "input",
                                                                                   "output")),
    # dtensor/sdpa.py: the SDPA handlers (Note [SDPA dispatch]) and DTensor's ordinary path
    ("torch.distributed.tensor", "DTensor._op_dispatcher._custom_op_handlers", None),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.unwrap_to_op_info", ("op_call", "args", "kwargs")),
    ("torch.distributed.tensor", "DTensor._op_dispatcher._dispatch_get_local_results_slow_path",
     ("op_call", "args", "op_info")),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate", ("op_info",)),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.wrap", ("res", "spec")),
    ("torch.distributed.tensor._redistribute", "redistribute_local_tensor",
     ("local_tensor", "current_spec", "target_spec")),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec", ("mesh", "placements", "tensor_meta")),
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta", ("shape", "stride", "dtype")),
    ("torch._prims_common", "make_contiguous_strides_for", ("shape",)),
    # titan/v02/attention.py: the (ulysses, ring) mesh of a CP group (Note [Ulysses in torchtitan])
    ("torch.distributed.device_mesh", "DeviceMesh._unflatten", ("self", "dim", "mesh_sizes", "mesh_dim_names")),
    ("torch.distributed.device_mesh", "DeviceMesh._concatenate", ("device_mesh_list",)),
    # core/dynamic.py: the flattened dp x cp group of a dynamic batch (Note [One plan over the grid])
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", ("self", "mesh_dim_name")),
    # dtensor/placements.py: HeadTail subclasses _StridedShard (Note [HeadTail placement]) and fixes propagation
    ("torch.distributed.tensor.placement_types", "_StridedShard.local_shard_size_and_offset",
     ("self", "curr_local_size", "num_chunks", "rank", STRIDED_OFFSET_PARAM)),
    ("torch.distributed.tensor.placement_types", "_StridedShard._local_shard_size_and_offset",
     ("self", "curr_local_size", "num_chunks", "rank", STRIDED_OFFSET_PARAM)),
    ("torch.distributed.tensor.placement_types", "_StridedShard._select_split_tensor",
     ("self", "tensor", "num_chunks", "index")),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached",
     ("op_schema",)),
    ("torch.distributed.tensor._sharding_prop", "LocalLRUCache", ("user_function",)),
    # checkpoint/dcp.py: DCP's box of a strided shard (Note [Checkpointing layout shards])
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
     ("global_shape", "mesh", "placements")),
    # comm.py, tools/debug.py: the raw functional collectives
    ("torch.ops._c10d_functional", "all_to_all_single", None),
    ("torch.ops._c10d_functional", "all_gather_into_tensor", None),
    ("torch.ops._c10d_functional", "reduce_scatter_tensor", None),
    ("torch.ops._c10d_functional", "all_reduce", None),
    ("torch.ops._c10d_functional", "broadcast", None),
    ("torch.ops._c10d_functional", "wait_tensor", None),
    ("torch.distributed.distributed_c10d", "_resolve_process_group", None),  # a pybind builtin: no signature
    ("torch.utils._python_dispatch", "TorchDispatchMode.__torch_dispatch__", ("self", "func", "types", "args", "kwargs")),
    # nn/sdpa_mode.py: nn.MultiheadAttention's SDPA under context parallelism (Note [SDPA inside multi_head_attention_forward])
    ("torch.nn.functional", "multi_head_attention_forward", ("query", "key", "value")),
    # titan/v02/spec.py: Note [How the plugin hooks torchtitan]
    (TITAN_CP, TITAN_CP_INPUT, ("inputs", "labels", "extra_kwargs", "cp_mesh", "device", "load_balancer_type")),
    ("torchtitan.models.llama3.infra.parallelize", TITAN_CP_STEP, ("attention_modules", "cp_mesh", "attention_type")),
    # titan/shared/cpu.py: Note [torchtitan on CPU] (TITAN_MOE_KERNELS needs triton to import: not checked here)
    *((module, name, None) for module, names in TITAN_DEVICE_HOLDERS.items() for name in names),
    # titan/shared/float8.py: Note [float8 training on CPU], Note [The float8 gemm on CPU] (torchao's config in .config)
    (TITAN_FLOAT8, "has_cuda_capability", ("major", "minor")),
    (TITAN_FLOAT8, "Float8LinearConverter.__init__", ("self", "job_config", "parallel_dims")),
)

# The rows of torch 2.13+ only (Note [torch 2.11 to 2.15]), checked by tests/test_compat.py where torch >= 2.13.
PRIVATE_SYMBOLS_SINCE_2_13: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    # Note [Rank-specialised compiled graphs] (below)
    ("torch.distributed.device_mesh", "DeviceMesh._stable_hash", ("self",)),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec._stable_hash", ("self",)),
    ("torch.distributed.tensor", "DTensor._stable_hash_for_caching", ("self",)),
    # dtensor/placements.py: 2.11's _StridedShard is a C++ class (no Python signature); 2.13's offset modes
    ("torch.distributed.tensor.placement_types", "_StridedShard", ("dim", "split_factor")),
    ("torch.distributed.tensor.placement_types", "_StridedShardOffsetMode.FIRST", None),
    # funcol's new names (comm.py, batch.py, ...): 2.11 has all_gather_tensor / reduce_scatter_tensor (+ _autograd)
    ("torch.distributed._functional_collectives", "all_gather_single", ("self", "gather_dim", "group")),
    ("torch.distributed._functional_collectives", "all_gather_single_autograd", ("self", "gather_dim", "group")),
    ("torch.distributed._functional_collectives", "reduce_scatter_single", ("self", "reduceOp", "scatter_dim", "group")),
)
# ... and what stands in for them on torch 2.11 (checked where torch < 2.13).
PRIVATE_SYMBOLS_BEFORE_2_13: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("torch.distributed._functional_collectives", "all_gather_tensor", ("self", "gather_dim", "group")),
    ("torch.distributed._functional_collectives", "all_gather_tensor_autograd", ("self", "gather_dim", "group")),
    ("torch.distributed._functional_collectives", "reduce_scatter_tensor", ("self", "reduceOp", "scatter_dim", "group")),
)

# torchtitan 0.3 (titan/v03/): the rows below are checked when torchtitan 0.3 is installed (the newest leg),
# the torchtitan rows above when 0.2.2 is (the dev leg); see tests/test_compat.py.
TORCHTITAN03_VERSION = "0.3.0"  # what the 0.3 glue (titan/v03/) was written against
TITAN03_DEVICE_HOLDERS = {  # module -> the device names it copied at import: Note [torchtitan 0.3 on CPU] 1
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.tools.profiler": ("device_module",),
}
TITAN03_CP_STEP = "apply_cp_to_forward"  # swapped in each family's parallelize module: Note [How the 0.3 plugin hooks torchtitan]
TITAN03_FLOAT8 = "torchtitan.components.quantization.float8"  # has_cuda_capability: Note [float8 training on CPU]
TITAN03_BF16_EXPERTS = (  # (module, class) whose forward casts to bf16 for _grouped_mm: Note [torchtitan 0.3 on CPU] 5
    ("torchtitan.models.common.moe", "GroupedExperts"),
    ("torchtitan.models.gpt_oss.moe", "GptOssGroupedExperts"),
)
TITAN03_PRIVATE_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    # titan/v03/trainer.py: Note [How the 0.3 plugin hooks torchtitan]
    ("torchtitan.trainer", "Trainer.post_dataloading_process", ("self", "input_dict", "labels")),
    ("torchtitan.trainer", "Trainer.Config", None),
    ("torchtitan.distributed.context_parallel", TITAN03_CP_STEP, ("attention_modules", "cp_mesh")),
    ("torchtitan.models.llama3.parallelize", TITAN03_CP_STEP, ("attention_modules", "cp_mesh")),
    ("torchtitan.models.qwen3.parallelize", TITAN03_CP_STEP, ("attention_modules", "cp_mesh")),
    ("torchtitan.models.deepseek_v3.parallelize", TITAN03_CP_STEP, ("attention_modules", "cp_mesh")),
    ("torchtitan.models.gpt_oss.parallelize", TITAN03_CP_STEP, ("attention_modules", "cp_mesh")),
    ("torchtitan.models.common.attention", "FlexAttention.Config", None),
    ("torchtitan.models.common.attention", "VarlenAttention.Config", None),
    # titan/v03/main.py: the config registry and the trainer's main
    ("torchtitan.config.manager", "ConfigManager._load_config", ("self", "args")),
    ("torchtitan.train", "ConfigManager", None),
    ("torchtitan.train", "main", ()),
    ("torchtitan.hf_datasets.text_datasets", "DATASETS", None),
    ("torchtitan.hf_datasets", "DatasetConfig", ("path", "loader", "sample_processor")),
    # titan/v03/_cpu.py: Note [torchtitan 0.3 on CPU]
    *((module, name, None) for module, names in TITAN03_DEVICE_HOLDERS.items() for name in names),
    *((module, f"{name}.forward", ("self", "x_RD", "num_tokens_per_expert_E")) for module, name in TITAN03_BF16_EXPERTS),
    # titan/shared/float8.py: Note [float8 training on CPU], Note [The float8 gemm on CPU] (.config, .torchao_config)
    (TITAN03_FLOAT8, "has_cuda_capability", ("major", "minor")),
    (TITAN03_FLOAT8, "Float8LinearConverter.__init__", ("self", "config")),
)
# titan/v03/linear.py: Note [qwen3_5 under the 0.3 plugin]. Checked where torchtitan 0.3 and fla (which
# torchtitan's qwen3_5 model module imports) are installed; the layer test runs them (tests/titan/v03/test_titan03.py).
TITAN03_QWEN35_CONV = "_causal_conv"  # GatedDeltaNet's method the plugin binds per layer
TITAN03_QWEN35_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("torchtitan.models.qwen3_5.model", f"GatedDeltaNet.{TITAN03_QWEN35_CONV}",
     ("self", "x_BLD", "conv", "cu_seqlens", "cu_seqlens_cpu")),
    ("torchtitan.models.qwen3_5.model", "GatedDeltaNet.forward", ("self", "x_BLD", "attention_masks")),
    ("torchtitan.models.qwen3_5.model", "GatedDeltaKernel.forward",
     ("self", "xq_BLNK", "xk_BLNK", "xv_BLNV", "g_BLN", "beta_BLN", "cu_seqlens", "cu_seqlens_cpu")),
    ("torchtitan.models.qwen3_5.model", "Qwen35Model.get_attention_masks", ("self", "positions")),
    ("torchtitan.models.qwen3_5.model", "Qwen35TransformerBlock.forward", ("self", "x_BLD", "attention_masks", "positions")),
    ("torchtitan.models.qwen3_5.parallelize", "parallelize_qwen3_5", ("model", "parallel_dims")),
)

# transformers (the [hf] extra), checked where it is installed: hf/generate.py's generate() under CP. Only
# called here, never imported (the rest of _compat must not need transformers).
TRANSFORMERS_VERSION = "5.24.0"  # what the rows below were written against
TRANSFORMERS_PRIVATE_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("transformers.generation.utils", "GenerationMixin._prepare_generation_config", ("self", "generation_config")),
    ("transformers.generation.utils", "GenerationMixin._get_stopping_criteria",
     ("self", "generation_config", "stopping_criteria", "tokenizer")),
    # recorded_outputs: hf/tiling.py's tiled MoE blocks (Note [Recorded router logits under tiling])
    ("transformers.utils.output_capturing", "_active_collector.get", ()),  # a CompileableContextVar's
    ("transformers.utils.output_capturing", "CompileableContextVar.get", ("self",)),
)


# accelerate and transformers (hf/trainer.py: Note [The Trainer under CP]): checked by tests/test_compat.py where
# the [trainer] extra is installed. Written against accelerate 1.15.0 and transformers 5.24.0.
ACCELERATE_VERSION = "1.15.0"
TRAINER_PRIVATE_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    # replica_dataloaders: accelerate shards a dataloader over the mesh dims other than "cp" (and "tp")
    ("accelerate.accelerator", "Accelerator.torch_device_mesh", None),  # reads AcceleratorState.device_mesh
    ("accelerate.accelerator", "Accelerator.prepare_data_loader", ("self", "data_loader", "device_placement")),
    ("accelerate.data_loader", "prepare_data_loader",
     ("dataloader", "device", "num_processes", "process_index", "split_batches", "put_on_device", "rng_types",
      "dispatch_batches", "even_batches", "slice_fn_for_dispatch", "use_seedable_sampler", "data_seed",
      "non_blocking", "use_stateful_dataloader", "torch_device_mesh")),
    # the Trainer hooks hf/trainer.py overrides (documented; their signatures are what it relies on)
    ("transformers.trainer", "Trainer.get_train_dataloader", ("self",)),
    ("transformers.trainer", "Trainer.get_eval_dataloader", ("self", "eval_dataset")),
    ("transformers.trainer", "Trainer.get_test_dataloader", ("self", "test_dataset")),
    ("transformers.trainer", "Trainer.get_total_train_batch_size", ("self", "args")),
    ("transformers.trainer", "Trainer.training_step", ("self", "model", "inputs", "num_items_in_batch")),
    ("transformers.trainer", "Trainer.compute_loss", ("self", "model", "inputs", "return_outputs", "num_items_in_batch")),
    ("transformers.trainer", "Trainer.prediction_step", ("self", "model", "inputs", "prediction_loss_only", "ignore_keys")),
    ("transformers.trainer", "Trainer.floating_point_ops", ("self", "inputs")),
    # the token counter of num_input_tokens_seen (private): handed the batch without the layout's padding
    ("transformers.trainer", "Trainer._track_num_input_tokens", ("self", "inputs")),
    ("transformers.trainer", "Trainer.evaluation_loop",
     ("self", "dataloader", "description", "prediction_loss_only", "ignore_keys", "metric_key_prefix")),
    # seq2seq_pad: Seq2SeqTrainer pads the labels it returns with predict_with_generate to the generated width
    ("transformers.trainer_seq2seq", "Seq2SeqTrainer._pad_tensors_to_max_len", ("self", "tensor", "max_length")),
)


def seq2seq_pad(trainer, tensor: torch.Tensor, length: int) -> torch.Tensor:
    """``tensor`` [B, n] padded to [B, length] the way a Seq2SeqTrainer pads the labels it returns with
    ``predict_with_generate`` (its private ``_pad_tensors_to_max_len``); unchanged for other trainers."""
    pad = getattr(trainer, "_pad_tensors_to_max_len", None)
    return tensor if pad is None else pad(tensor, length)


class replica_dataloaders:  # noqa: N801  (a context manager used as a function)
    """While active, ``accelerator.prepare`` shards dataloaders over the data-parallel replicas of ``mesh``
    (dims ``("dp_replicate", "cp")``), not over ranks: the CP ranks of a replica get the same batches.

    accelerate's ``prepare_data_loader`` divides the process index by the ``"cp"`` dim of the device mesh it
    reads from ``AcceleratorState.device_mesh`` (how its own CP and TP ranks share batches); the mesh is set
    there for the call and restored after. Raises for what accelerate would still hand out per rank: an
    iterable dataset that rank 0 dispatches (``dispatch_batches``), and DeepSpeed (its own rule)."""

    def __init__(self, accelerator, mesh: DeviceMesh, dataset):
        self.accelerator, self.mesh = accelerator, mesh
        if isinstance(dataset, torch.utils.data.IterableDataset) and accelerator.dispatch_batches is not False:
            raise ValueError(
                "an iterable dataset is dispatched by rank 0 to every rank (accelerate's dispatch_batches), which "
                "would give the CP ranks of one replica different batches. Pass TrainingArguments("
                "accelerator_config={'dispatch_batches': False}) or a map-style dataset.")

    def __enter__(self):
        self.saved = self.accelerator.state.device_mesh
        self.accelerator.state.device_mesh = self.mesh
        return self

    def __exit__(self, *exc):
        self.accelerator.state.device_mesh = self.saved
        return False


c10d_functional = torch.ops._c10d_functional  # the raw functional collectives (comm.py, tools/debug.py)


def custom_op_handlers() -> dict[Any, Callable]:
    """DTensor's table of per-op handlers that replace its own dispatch (torch's experimental CP uses it too)."""
    return DTensor._op_dispatcher._custom_op_handlers


def dtensor_default_dispatch(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """What DTensor does for ``op`` without a custom handler: propagate shardings, run locally, wrap."""
    dispatcher = DTensor._op_dispatcher
    info = dispatcher.unwrap_to_op_info(op, args, kwargs)
    dispatcher.sharding_propagator.propagate(info)
    local = dispatcher._dispatch_get_local_results_slow_path(op, args, info)
    return dispatcher.wrap(local, info.output_sharding.output_spec)


def wrap_sharding_propagation(fix: Callable[[object], object]) -> None:
    """Pass every ``OutputSharding`` DTensor's propagator computes through ``fix`` (idempotent per ``fix``)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    inner = propagator.propagate_op_sharding_non_cached
    if getattr(inner, "_cp_dtensor_fix", None) is fix:
        return

    def propagate_op_sharding_non_cached(op_schema):
        return fix(inner(op_schema))

    propagate_op_sharding_non_cached._cp_dtensor_fix = fix
    # the same two instance attributes ShardingPropagator.__init__ sets up: the rule and its cache
    propagator.propagate_op_sharding_non_cached = propagate_op_sharding_non_cached
    propagator.propagate_op_sharding = LocalLRUCache(propagate_op_sharding_non_cached)


def _stable_hash_with_coordinate(self: DeviceMesh) -> str:
    # See Note [Rank-specialised compiled graphs]
    key = f"{_torch_stable_hash(self)}|coordinate={self.get_coordinate()}"
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


_torch_stable_hash = getattr(DeviceMesh, "_stable_hash", None)
_torch_stable_hash = getattr(_torch_stable_hash, "__wrapped__", _torch_stable_hash)  # a reloaded module
_stable_hash_with_coordinate.__wrapped__ = _torch_stable_hash


def include_mesh_coordinate_in_cache_key() -> None:
    """Key compiled DTensor graphs by this rank's mesh coordinate (idempotent); see
    Note [Rank-specialised compiled graphs]."""
    if _torch_stable_hash is None:
        warnings.warn(
            "cp_dtensor: this torch has no DeviceMesh._stable_hash (cp_dtensor was written against torch "
            f"{TORCH_VERSION}); compiled SDPA on DTensors may load another rank's graph from a warm compile "
            "cache. Set TORCHINDUCTOR_AUTOGRAD_CACHE=0 if a second run fails with a collective mismatch.",
            stacklevel=2,
        )
        return
    DeviceMesh._stable_hash = _stable_hash_with_coordinate


def restore_cache_key() -> None:
    """Undo :func:`include_mesh_coordinate_in_cache_key` (``cp_dtensor.uninstall_sdpa_dispatch``)."""
    if _torch_stable_hash is not None:
        DeviceMesh._stable_hash = _torch_stable_hash


def mesh_unflatten(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A 1-D ``mesh`` as a mesh of shape ``sizes`` (row-major), dims named ``names``; new process groups,
    so every rank calls it. torch 2.13's private ``DeviceMesh._unflatten`` (torchtitan's ParallelDims uses it)."""
    return mesh._unflatten(0, sizes, names)


def mesh_flatten(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh with named dims as one 1-D mesh (row-major: flat rank ``d * cp + c`` for a (dp, cp) mesh), dims
    joined by "_"; every rank calls it (the first call makes the group, later ones reuse it). torch 2.13's
    private ``DeviceMesh._flatten`` (torchtitan's ParallelDims uses it)."""
    return mesh._flatten()


def mesh_concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
    """Sub-meshes of one root mesh stacked as the dims of one mesh, in the given order (a transpose when
    reordered); reuses their groups. torch 2.13's private ``DeviceMesh._concatenate``."""
    return DeviceMesh._concatenate(meshes)


def prepare_generation_config(model, generation_config, **kwargs) -> tuple[Any, dict]:
    """transformers' ``GenerationMixin._prepare_generation_config``: (the GenerationConfig a generate() call with
    these arguments runs with, the model kwargs left over). Validates as generate() does."""
    return model._prepare_generation_config(generation_config, **kwargs)


def is_fsdp_forward_hook(hook) -> bool:
    """Whether ``hook`` (a module's forward hook) is FSDP2's own post-forward (``fully_shard`` registers
    ``FSDPState._post_forward``, a bound method): it reshards the parameters and never reads the output's
    values. torch's private ``torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState``."""
    owner = getattr(hook, "__self__", None)
    if owner is None or getattr(hook, "__name__", None) != "_post_forward":
        return False
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return isinstance(owner, FSDPState)


def recorded_outputs() -> dict | None:
    """The lists transformers' output recorders (a model's ``_can_record_outputs``: router logits, attentions,
    hidden states) are filling in the forward now running, by key; None outside one or without transformers.
    transformers' private ``transformers.utils.output_capturing._active_collector``."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    return None if capturing is None else capturing._active_collector.get()


@contextlib.contextmanager
def generation_stopping_criteria(model, wrap: Callable[[Any], Any]) -> Iterator[None]:
    """While open, the ``StoppingCriteriaList`` that ``model.generate()`` builds (transformers'
    ``GenerationMixin._get_stopping_criteria``: max_length, max_time, stop strings, EOS, the caller's) is
    replaced by ``wrap(it)``. An attribute of this instance only, removed on exit."""
    build = type(model)._get_stopping_criteria
    model.__dict__["_get_stopping_criteria"] = lambda *args, **kwargs: wrap(build(model, *args, **kwargs))
    try:
        yield
    finally:
        model.__dict__.pop("_get_stopping_criteria", None)


# Note [SDPA inside multi_head_attention_forward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A TorchFunctionMode runs its handler with itself popped from the mode stack, so a Python-level torch
# function the mode passes on runs its body without the mode: ``F.multi_head_attention_forward`` (every
# ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``) calls ``scaled_dot_product_attention``
# inside, where nn/sdpa_mode.py's ``RingSDPA`` would never see it -- attention within this rank's shard only,
# silently. The function looks SDPA up by its global name in torch.nn.functional (torch 2.13-2.15;
# tests/test_compat.py checks it), so ``with_sdpa`` runs the same code object with that one name bound
# to the ring, in a copy of the globals: torch's module is not touched, other threads see nothing.


def with_sdpa(fn: Callable, sdpa: Callable) -> Callable:
    """``fn`` (a torch Python function calling ``scaled_dot_product_attention`` by its global name) with
    that name bound to ``sdpa``. See Note [SDPA inside multi_head_attention_forward]."""
    scope = dict(fn.__globals__, scaled_dot_product_attention=sdpa)
    out = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def flex_attention_op() -> object | None:
    """The flex_attention higher-order op as a TorchFunctionMode sees it (``func``), or None: nn/sdpa_mode.py
    refuses it under context parallelism (it would attend within one rank's shard)."""
    import torch.nn.attention.flex_attention  # noqa: F401  (registers the op)

    return getattr(torch.ops.higher_order, "flex_attention", None)


def titan_cpu_permute_indices() -> Callable:
    """torchtitan's own ``generate_permute_indices`` (TITAN_MOE_KERNELS) with ``use_cpu=True`` bound: its CPU
    implementation of expert parallelism's token permutation. That module imports triton at its top for its
    GPU kernel; this loads the file as a private module (not in ``sys.modules``) with a ``triton`` stand-in
    present only while the file executes, so nothing else ever sees a triton (Note [torchtitan on CPU] 1)."""
    import functools
    import importlib.util
    import inspect

    class _Anything(types.ModuleType):  # triton.jit, tl.constexpr, ...: the file's decorators and annotations
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self

        def __call__(self, *args, **kwargs):  # @triton.jit: the decorated function as it is
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    package = importlib.util.find_spec(TITAN_MOE_KERNELS.rsplit(".", 1)[0])
    path = next(iter(package.submodule_search_locations)) + "/kernels.py"
    spec = importlib.util.spec_from_file_location("_cp_dtensor_titan_moe_kernels", path)
    module = importlib.util.module_from_spec(spec)
    saved = {name: sys.modules.get(name) for name in ("triton", "triton.language")}
    sys.modules["triton"] = sys.modules["triton.language"] = _Anything("triton")
    try:
        spec.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    fn = getattr(module, TITAN_CPU_PERMUTE)
    assert "use_cpu" in inspect.signature(fn).parameters, "torchtitan's generate_permute_indices lost use_cpu"
    return functools.partial(fn, use_cpu=True)
