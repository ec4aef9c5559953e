"""One unsharded replica of the model, initialised once, as the source of every rank's weights on CPU.

Steps 6 (sharded parameters) and 7 (pipeline stages) of Note [torchtitan on CPU] (cpu.py): torchtitan's own
``init_weights`` runs on a replica materialised from a meta copy taken before sharding (or before the model
was cut into stages), from rank 0's RNG state, and each rank copies its part of every parameter.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["WRAPPER_NAMES", "init_as_unsharded", "init_stages_as_whole", "unsharded_template", "unwrapped_name"]

# submodule names torch's wrappers insert, which the unwrapped model does not have: torch.compile's
# OptimizedModule (torchtitan compiles each block) and activation checkpointing's CheckpointWrapper
WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module")


def unwrapped_name(name: str) -> str:
    """The dotted name of a submodule or parameter with torch's wrapper levels removed."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def unsharded_template(model: nn.Module) -> nn.Module | None:
    """Step 6 of Note [torchtitan on CPU]: a copy of the model as built, on meta (no memory), taken
    before sharding; None where step 6 does not apply (an accelerator, or a model not on meta)."""
    if torch.accelerator.is_available():
        return None
    if not all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return None
    return copy.deepcopy(model)


def _rank0_rng_state() -> None:
    # every rank draws the replica from one RNG state; torchtitan seeds all SPMD ranks alike, this makes it sure
    if dist.is_initialized() and dist.get_world_size() > 1:
        state = torch.get_rng_state()
        dist.broadcast(state, src=0)
        torch.set_rng_state(state)


@torch.no_grad()
def _copy_shards(full: nn.Module, model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    full_modules = dict(full.named_modules())
    for name, module in model.named_modules(remove_duplicate=False):
        source = full_modules.get(unwrapped_name(name))
        for pname, p in module._parameters.items():
            if p is None:
                continue
            assert source is not None and pname in source._parameters, f"no unsharded twin of {name}.{pname}"
            value = source._parameters[pname]
            if isinstance(p, DTensor):
                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p = p.to_local()
            assert p.shape == value.shape, f"{name}.{pname}: shard {tuple(p.shape)} vs {tuple(value.shape)}"
            p.copy_(value)
        for bname, b in module._buffers.items():
            if b is not None:
                assert source is not None and bname in source._buffers, f"no unsharded twin of buffer {name}.{bname}"
                value = source._buffers[bname]
                if isinstance(b, DTensor):  # torchtitan 0.3 under TP: e.g. the RoPE cache, Replicate on the TP mesh
                    value = distribute_tensor(value, b.device_mesh, b.placements, src_data_rank=None)
                module._buffers[bname] = value


def init_as_unsharded(model: nn.Module, template: nn.Module | None, *, prepare=None) -> bool:
    """Step 6 of Note [torchtitan on CPU]: ``model.init_weights`` initialises an unsharded replica of
    ``template`` (after ``prepare(replica)``, e.g. the plugin's init fixes: a deep copy does not carry
    an ``init_weights`` wrapped in a closure) with torchtitan's own ``init_weights`` and copies each
    rank's shards. Returns whether installed."""
    from torch.distributed.tensor import DTensor

    if template is None or not any(isinstance(p, DTensor) for p in model.parameters()):
        return False

    def init_weights(*args, **kwargs):
        _copy_shards(_initialised_replica(template, prepare, args, kwargs), model)  # the replica is freed on return

    model.init_weights = init_weights
    return True


def _initialised_replica(template: nn.Module, prepare, args: tuple, kwargs: dict) -> nn.Module:
    full = copy.deepcopy(template).to_empty(device="cpu")
    if prepare is not None:
        prepare(full)
    _rank0_rng_state()
    with torch.no_grad():
        full.init_weights(*args, **kwargs)
    return full


def init_stages_as_whole(stages: list[nn.Module], template: nn.Module | None, *, prepare=None) -> bool:
    """Step 7 of Note [torchtitan on CPU]: each pipeline stage's ``init_weights`` copies its parameters
    (or its shards of them) from one unsharded replica of the whole model (``template``: a meta copy taken
    before the model was cut into ``stages``), initialised once per rank from rank 0's RNG state. Returns
    whether installed."""
    if template is None or not stages:
        return False
    shared: dict[str, object] = {"full": None, "left": 0}

    def install(stage: nn.Module) -> None:
        def init_weights(*args, **kwargs):
            if shared["full"] is None:  # the rank's first stage: every rank gets here together (a broadcast)
                own = torch.get_rng_state()
                shared["full"], shared["left"] = _initialised_replica(template, prepare, args, kwargs), len(stages)
                torch.set_rng_state(own)  # torchtitan's per-stage stream for what follows
            _copy_shards(shared["full"], stage)
            shared["left"] -= 1
            if shared["left"] == 0:
                shared["full"] = None  # the last stage is done: free the replica

        stage.init_weights = init_weights

    for stage in stages:
        install(stage)
    return True
