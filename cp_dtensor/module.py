"""Context parallelism for whole models whose attention modules call ``F.scaled_dot_product_attention``.

Note [Module context parallel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The model runs on plain local tensors: each CP rank holds its layout's share of every sequence --
tokens, labels and positions sharded alike by ``shard_batch``. Every layer except attention works
token by token, so it needs nothing, provided position-dependent layers take the positions as an input
(RoPE indexed by ``positions``, not by local index): positions travel with their tokens.

Attention is the one layer that mixes tokens. ``apply_context_parallel`` installs forward hooks that
keep a ``TorchFunctionMode`` active while the model (or any of its submodules, so activation
checkpointing's recomputation is covered too) runs forward. The mode turns each SDPA call on plain
[B, H, S_local, D] tensors into the same call on sequence-sharded DTensors (``DTensor.from_local``, no
communication), which dispatch.py sends to the ring, and returns the local output (``to_local``). Both
wrappers are differentiable, so backward runs the ring backward.

Why not run the whole model on DTensors: in torch 2.13 a view that merges [B, S] fails when S carries
a strided placement, and ``nn.Linear`` on [B, S, E] makes exactly that view, so striped and head-tail
activations cannot pass through a Linear as DTensors.

A rank's loss covers its own tokens (normalise by the *global* token count), so each parameter's
gradient is that rank's share and must be summed over the CP group: FSDP / DDP over a mesh dim that
includes CP does this; standalone, call ``reduce_gradients``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from .layout import check_layout, layout_unit, shard_tensor, unshard_tensor
from .placement import full_tensor, sequence_placement

__all__ = ["apply_context_parallel", "shard_batch", "unshard_sequence", "reduce_gradients"]


def _check_cp_mesh(cp_mesh: DeviceMesh) -> None:
    if cp_mesh.ndim != 1:
        raise ValueError(f"the CP mesh must be 1-D; got a {cp_mesh.ndim}-D mesh {cp_mesh.mesh_dim_names}. "
                         'Pass the CP dimension of a larger mesh, e.g. world_mesh["cp"].')


class _RingSDPA(TorchFunctionMode):
    """Routes SDPA on local sequence shards through the DTensor front door. See Note [Module context parallel]."""

    def __init__(self, cp_mesh: DeviceMesh, layout: str):
        super().__init__()
        self.mesh, self.layout, self.depth = cp_mesh, layout, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = args[0] if args else kwargs.get("query")
            if isinstance(q, Tensor) and not isinstance(q, DTensor):
                return self._sdpa(*args, **kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # query: [B, Hq, S_local, D]; key, value: [B, Hkv, S_local, D] -- this rank's tokens
        if attn_mask is not None or dropout_p > 0.0:
            raise ValueError(
                "context parallel attention supports neither attn_mask nor dropout_p > 0; got "
                f"attn_mask={'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}. Use "
                "is_causal=True and set the attention dropout to 0 under context parallelism."
            )
        if query.dim() != 4:
            raise ValueError(f"context parallel attention needs 4-D [B, H, S_local, D] inputs; got {tuple(query.shape)}.")
        cp = self.mesh.size()
        seq_len = query.shape[2] * cp
        placements = [sequence_placement(self.layout, 2, seq_len=seq_len, cp=cp)]

        def shard(x: Tensor) -> DTensor:
            shape = (*x.shape[:2], seq_len, x.shape[3])
            stride = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
            return DTensor.from_local(x, self.mesh, placements, run_check=False, shape=shape, stride=stride)

        out = F.scaled_dot_product_attention(shard(query), shard(key), shard(value), is_causal=is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
        return out.to_local()


def _enter(mode: _RingSDPA, *_) -> None:
    if mode.depth == 0:
        mode.__enter__()
    mode.depth += 1


def _exit(mode: _RingSDPA, *_) -> None:
    mode.depth -= 1
    if mode.depth == 0:
        mode.__exit__(None, None, None)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, *, layout: str = "striped") -> nn.Module:
    """Run ``model``'s ``F.scaled_dot_product_attention`` calls as ring attention over ``cp_mesh``.

    Feed the model its local shard of each batch (``shard_batch``), including positions for RoPE;
    ``layout`` must match. Attention calls must use ``is_causal`` (no mask) and no dropout. See
    Note [Module context parallel]. Returns ``model``, changed in place (forward hooks only).
    """
    _check_cp_mesh(cp_mesh)
    check_layout(layout)
    if getattr(model, "_cp_dtensor_mode", None) is not None:
        raise ValueError("apply_context_parallel was already applied to this model.")
    mode = _RingSDPA(cp_mesh, layout)
    model._cp_dtensor_mode = mode
    for m in model.modules():
        m.register_forward_pre_hook(lambda *a, mode=mode: _enter(mode))
        m.register_forward_hook(lambda *a, mode=mode: _exit(mode), always_call=True)
    return model


def shard_batch(cp_mesh: DeviceMesh, *tensors: Tensor, layout: str = "striped", seq_dim: int = 1) -> tuple[Tensor, ...]:
    """This rank's share of each full tensor (inputs, labels, positions...), all sharded alike along
    ``seq_dim`` in ``layout``. Every rank passes the same full tensors; no communication.

        tokens, labels, positions = shard_batch(cp_mesh, tokens, labels, torch.arange(n).expand(b, n))
    """
    _check_cp_mesh(cp_mesh)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    lengths = {t.shape[seq_dim] for t in tensors}
    if len(lengths) != 1:
        raise ValueError(f"shard_batch needs one sequence length along dim {seq_dim}; got {sorted(lengths)}.")
    unit = layout_unit(check_layout(layout), cp)
    if lengths.pop() % unit != 0:
        raise ValueError(f"{layout} layout on {cp} ranks needs the sequence length divisible by {unit}; got "
                         f"{tensors[0].shape[seq_dim]}. Pad the batch to a multiple of {unit}.")
    return tuple(shard_tensor(t, dim=seq_dim, layout=layout, rank=rank, world=cp).contiguous() for t in tensors)


def unshard_sequence(x: Tensor, cp_mesh: DeviceMesh | None = None, *, layout: str = "striped", dim: int = 1) -> Tensor:
    """The full tensor, in original order, from every rank's local shard ``x`` (differentiable), or
    from a sequence-sharded DTensor (then ``cp_mesh`` and ``layout`` are read from it)."""
    if isinstance(x, DTensor):
        return full_tensor(x)
    _check_cp_mesh(cp_mesh)
    dim = dim % x.dim()
    cp = cp_mesh.size()
    gathered = funcol.all_gather_tensor_autograd(x.contiguous(), gather_dim=dim, group=cp_mesh)
    return unshard_tensor(list(gathered.chunk(cp, dim=dim)), dim=dim, layout=layout)


@torch.no_grad()
def reduce_gradients(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Sum every parameter gradient over the CP group (each rank's covers only its own tokens).
    Not needed when FSDP / DDP already reduce over a mesh dim that includes CP."""
    _check_cp_mesh(cp_mesh)
    group = cp_mesh.get_group()
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)
