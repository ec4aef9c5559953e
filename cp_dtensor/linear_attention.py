"""STAND-IN, TO BE REPLACED: the real module is written on branch wt30a (affine state passing, issue #30).

This file only fixes the interface hf_linear.py codes against, with the simplest correct implementation
so the transformers integration can be developed and tested: every rank all-gathers the full inputs
(differentiably), runs the unsharded kernel on each document of the global sequence, and keeps its own
shard of the output. O(N) communication and compute per rank -- a test double, not context parallelism.
On merge take wt30a's file.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor

from .layout import check_layout, in_global_order, shard_tensor, unshard_tensor

__all__ = ["check_linear_layout", "sharded_causal_conv1d", "sharded_delta_rule"]


def check_linear_layout(layout: str) -> str:
    check_layout(layout)
    if layout == "striped":
        raise ValueError("linear attention under CP needs contiguous runs of tokens: use layout='headtail'.")
    return layout


def _full(x: Tensor, group, layout: str, dim: int) -> Tensor:
    world = dist.get_world_size(group)
    every = funcol.all_gather_single_autograd(x.contiguous(), gather_dim=dim, group=group)
    return unshard_tensor(list(every.chunk(world, dim=dim)), dim=dim, layout=layout)


def _runs(document_ids: Tensor | None, group, layout: str, b: int, n: int) -> list[list[tuple[int, int]]]:
    """Per batch row, the (start, end) of each document of the global sequence."""
    if document_ids is None:
        return [[(0, n)] for _ in range(b)]
    world = dist.get_world_size(group)
    every = funcol.wait_tensor(funcol.all_gather_single(document_ids.long().contiguous(), 0, group))
    ids = in_global_order(every.view(world, b, -1), layout)  # [B, N]
    out = []
    for row in ids:
        starts = [0] + [i for i in range(1, n) if row[i] != row[i - 1]] + [n]
        out.append(list(zip(starts[:-1], starts[1:])))
    return out


def sharded_delta_rule(kernel, q, k, v, g, beta, *, group, layout, document_ids=None, use_qk_l2norm_in_kernel=False,
                       **kernel_kwargs) -> Tensor:
    """q, k [B, S_local, Hk, dk]; v [B, S_local, Hv, dv]; g [B, S_local, Hv(, dk)]; beta [B, S_local, Hv]."""
    check_linear_layout(layout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v, g, beta = (_full(x, group, layout, 1) for x in (q, k, v, g, beta))
    b, n = q.shape[:2]
    rows = []
    for i, runs in enumerate(_runs(document_ids, group, layout, b, n)):
        parts = [kernel(q[i:i + 1, s:e], k[i:i + 1, s:e], v[i:i + 1, s:e], g=g[i:i + 1, s:e], beta=beta[i:i + 1, s:e],
                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kernel_kwargs)[0] for s, e in runs]
        rows.append(torch.cat(parts, dim=1))
    return shard_tensor(torch.cat(rows), dim=1, layout=layout, rank=rank, world=world).contiguous()


def sharded_causal_conv1d(x, weight, bias=None, activation=None, *, group, layout, document_ids=None) -> Tensor:
    """x [B, C, S_local] (transformers' causal_conv1d_fn); weight [C, K]."""
    check_linear_layout(layout)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    full = _full(x, group, layout, 2).to(weight.dtype)
    b, c, n = full.shape
    rows = []
    for i, runs in enumerate(_runs(document_ids, group, layout, b, n)):
        parts = [F.conv1d(full[i:i + 1, :, s:e], weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1, groups=c)
                 [..., : e - s] for s, e in runs]
        rows.append(torch.cat(parts, dim=2))
    out = torch.cat(rows)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"stand-in: activation {activation!r}")
    return shard_tensor(out, dim=2, layout=layout, rank=rank, world=world).contiguous().to(x.dtype)
