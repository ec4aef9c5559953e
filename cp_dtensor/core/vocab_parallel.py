"""Which DTensor LM head is vocabulary-parallel, and the checks its tiled loss makes before its collectives.

Note [Which DTensor head is vocabulary-parallel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A weight placed ``Shard(0)`` on a 1-D mesh is what tensor parallelism's ``ColwiseParallel`` makes of a
head (each rank computes logits for its V / TP rows of the *same* tokens) and also what FSDP2's
``fully_shard`` leaves outside the head's forward (each rank holds V / DP rows, and the ranks hold
*different* tokens). The placement cannot tell them apart, and taking an FSDP shard for a vocabulary
shard mixes the ranks' tokens into one loss (and hangs once their lengths differ: the per-tile
all-reduces stop pairing up). So a DTensor head is served as vocabulary-parallel only when the caller
says so: ``tp_mesh=`` names the TP mesh, or the hidden states come as a DTensor replicated on the
head's mesh (what TP's input hook hands the head's forward: torchtitan's plan). Anything else is
refused on every rank (the same placements everywhere) before any collective; an FSDP head is served by
passing its weight unsharded, as FSDP's own forward sees it (hf/tiling.py gathers it for the call).
Under TP a label outside [0, V) would fall in no rank's shard and add a finite loss where
``F.cross_entropy`` raises, and ranks with different token counts would hang in the per-tile
collectives; one all-reduce (MAX of the count, minus the count and a bad-label flag) before the tiles
raises both on every rank. It costs one host sync a call, on the TP path only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["check_tp_batch", "vocab_parallel_head"]


def vocab_parallel_head(weight, bias, hidden, tp_mesh):
    """(local weight, local bias, hidden as a local tensor, group, vocabulary offset, reduce dh) for a head
    whose weight is a DTensor sharded over the vocabulary by tensor parallelism; (weight, bias, hidden, None,
    0, False) for a plain one; a ValueError for a DTensor head the fused path cannot serve, or cannot tell
    from an FSDP-sharded one (Note [Which DTensor head is vocabulary-parallel])."""
    if not isinstance(weight, DTensor):
        if isinstance(bias, DTensor) or isinstance(hidden, DTensor) or tp_mesh is not None:
            raise ValueError("linear_cross_entropy takes hidden, weight and bias all as plain tensors, or a weight "
                             "(and bias) as DTensors sharded over the vocabulary; got a plain weight with a DTensor "
                             "hidden or bias, or with tp_mesh=. Pass local tensors and no tp_mesh.")
        return weight, bias, hidden, None, 0, False
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"linear_cross_entropy serves a DTensor LM head sharded over the vocabulary (placements "
                         f"(Shard(0),) on a 1-D mesh: the vocabulary-parallel head); got placements "
                         f"{tuple(weight.placements)} on a {mesh.ndim}-D mesh. Shard the head's weight with "
                         "ColwiseParallel (over the vocabulary), or pass it as a full local tensor.")
    if tp_mesh is None and not isinstance(hidden, DTensor):  # See Note [Which DTensor head is vocabulary-parallel]
        raise ValueError(
            f"linear_cross_entropy got a DTensor weight placed (Shard(0),) on a 1-D mesh of {mesh.size()} ranks, "
            "which may be a vocabulary-parallel (tensor-parallel) head or an FSDP-sharded one: the placement alone "
            "cannot tell. For a tensor-parallel head pass tp_mesh=<its TP mesh> (or the hidden states as a DTensor "
            "replicated on it); for an FSDP-sharded head (fully_shard) pass the unsharded weight: call the loss "
            "inside the head's forward, where FSDP has gathered it, or between head.unshard() and head.reshard().")
    if tp_mesh is not None and tp_mesh != mesh:
        raise ValueError(f"linear_cross_entropy: tp_mesh {tp_mesh} is not the mesh the weight is sharded on "
                         f"({mesh}). Pass the head's TP mesh.")
    if bias is not None and (not isinstance(bias, DTensor) or tuple(bias.placements) != (Shard(0),)
                             or bias.device_mesh != mesh):
        raise ValueError("linear_cross_entropy: a vocabulary-parallel head's bias must be a DTensor placed "
                         f"(Shard(0),) on the weight's mesh; got {type(bias).__name__} "
                         f"{getattr(bias, 'placements', '')}. Shard the bias with the weight.")
    rows = -(-weight.shape[0] // mesh.size())  # torch's Shard(0): chunks of ceil(V / TP) rows
    offset = mesh.get_local_rank() * rows
    reduce_dh = True
    if isinstance(hidden, DTensor):
        if hidden.device_mesh != mesh or any(not isinstance(p, Replicate) for p in hidden.placements):
            raise ValueError(f"linear_cross_entropy: under a vocabulary-parallel head the hidden states must be "
                             f"replicated on the head's mesh; got placements {tuple(hidden.placements)}. "
                             "Redistribute them to Replicate() first.")
        hidden, reduce_dh = hidden.to_local(grad_placements=(Partial(),)), False  # its redistribute reduces dh
    local_bias = None if bias is None else bias.to_local()
    return weight.to_local(), local_bias, hidden, mesh.get_group(), offset, reduce_dh


def check_tp_batch(labels: Tensor, vocab: int, ignore_index: int, group) -> None:
    """One all-reduce before the tiles' collectives: every TP rank holds the same number of tokens (else the
    per-tile collectives would not pair up: a hang) and no label is outside [0, V) but ignore_index (a
    rank owning none of it would add a finite loss). Raised on every rank alike."""
    bad = ((labels != ignore_index) & ((labels < 0) | (labels >= vocab))).any()
    n = labels.new_tensor(labels.numel())
    got = torch.stack([n, -n, bad.long()])
    dist.all_reduce(got, op=dist.ReduceOp.MAX, group=group)
    hi, lo, bad = got.tolist()
    if hi != -lo:
        raise ValueError(f"linear_cross_entropy under a vocabulary-parallel head needs the same tokens on every TP "
                         f"rank (the hidden states replicated over TP); the ranks hold {-lo} to {hi} tokens. Pass "
                         "each TP rank the same batch.")
    if bad:
        raise IndexError(f"linear_cross_entropy: a label is outside [0, {vocab}) and not ignore_index "
                         f"({ignore_index}) on some TP rank, as F.cross_entropy refuses. Fix the labels (or their "
                         "vocabulary size).")
