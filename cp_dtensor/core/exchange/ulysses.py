"""Two-dimensional CP on a (U, R) mesh: the heads all-to-all (Ulysses) helpers; attention.py runs the call.

Note [Ulysses x ring]
~~~~~~~~~~~~~~~~~~~~~
Mesh rank (u, r) is 1-D CP rank p = u * R + r of P = U * R (row-major, ``mesh.mesh.flatten()``) and
holds that rank's layout shard, [B, H, S, D], as with a 1-D group. The call is three steps, each
differentiable, the backward being the same steps reversed:

1. Heads all-to-all over the Ulysses group {(u', r) : u' < U}: rank (u, r) sends head slice u' of its
   q, k, v to (u', r) and receives head slice u of every (u', r)'s tokens. It then holds Hq / U query
   heads (and their K/V heads, Note [GQA under Ulysses]) for the union of the group's U shards:
   [B, H / U, U * S, D], ordered as in Note [Ulysses unions].
2. The 1-D exchange of ring.py / allgather.py (ring or all-gather, every mask) over the ring group {(u, r') : r' < R},
   on those heads and unions: only K/V heads travel in it, U * S tokens a block.
3. The output's all-to-all back: [B, Hq, S, Dv] of this rank's own tokens.

Sinks are per query head: rank (u, r) applies sinks[u * Hq / U : (u + 1) * Hq / U]; the gradient of
``sinks`` it returns is its queries' share on its heads (zeros on the others), so the sum over all P
ranks is the full gradient -- the same contract as the 1-D call (``reduce_gradients`` / FSDP sum it).

Bytes per rank per layer, forward (the backward moves as much again in the all-to-alls, and the ring's
own backward bytes): (U - 1) / U * B * S * (Hq * Dqk + Hkv' * (Dqk + Dv) + Hq * Dv) * itemsize in the
all-to-alls, plus the ring over R ranks on blocks of U * S tokens and Hkv' / U heads -- the same K/V
bytes per hop as 1-D CP's ring (U * S * Hkv' / U = S * Hkv'), but R - 1 hops instead of P - 1.
Formulas: ``wire.ulysses_bytes`` (``wire.py``).

Note [Ulysses unions]
~~~~~~~~~~~~~~~~~~~~~
The ring over R ranks needs, on ring rank r, the union of the shards of 1-D ranks u * R + r, as runs
of global positions (masks.Run). Local order is increasing global position in every layout:

* striped: 1-D rank p holds positions m * P + p. The group's union is {m * P + u * R + r} =
  {i * R + r : i < U * S} with i = m * U + u: exactly ring rank r's striped shard over R ranks, once
  the received parts [u, m] are interleaved to [m, u]. So striped runs as the plain 1-D striped ring
  over R (the fast unmasked path, one kernel a step).
* contiguous: rank p holds chunk p of N / P tokens; the union is chunks r, R + r, ..., (U-1) R + r,
  in u order: U runs of S tokens. Not a contiguous shard over R (it is "striped by chunks"), so the
  ring takes it through the masks' rectangles (masks.runs(..., ulysses=U)): per step, per pair of
  runs, one full rectangle, one causal square, or nothing.
* headtail: rank p holds chunks p and 2P - 1 - p of c = S / 2 tokens; the union is the U head chunks
  u R + r (u ascending) then the U tail chunks 2P - 1 - u R - r (u descending): 2U runs of c tokens,
  again through the rectangles. Causal work stays balanced: every ring rank holds U early and U late
  chunks, mirrored.

``union_order`` is that order as an index into the received [u, local] parts; the output goes back
through its inverse.

Note [GQA under Ulysses]
~~~~~~~~~~~~~~~~~~~~~~~~
Rank u takes query heads [u Hq / U, (u + 1) Hq / U) (Hq % U == 0 is required, checked on every rank
before any communication). Its K/V heads must serve those queries with the kernels' uniform GQA
grouping, so K/V heads are first repeated ``kv_replicas(Hkv, U) = lcm(Hkv, U) / Hkv`` times (each head
next to its copies), giving Hkv' = lcm(Hkv, U) heads, Hkv' / U per rank. When U divides Hkv nothing is
repeated; when Hkv divides U (e.g. Hkv = 2, U = 8) every rank gets the one K/V head its queries use,
each head going to U / Hkv ranks -- the least any split can send. Otherwise (neither divides, e.g.
Hkv = 6, U = 4) lcm is the least replication that keeps the grouping uniform. The cost: the K/V
all-to-all and the ring carry Hkv' instead of Hkv heads (Hkv' / Hkv times the K/V bytes and memory
of the ring), the backward sums each copy's dK/dV into its head (autograd of ``repeat_interleave``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..compute.ordering import tie
from .comm import all_to_all

__all__ = ["gather_heads", "kv_replicas", "mesh_group", "scatter_heads", "union_order"]


def mesh_group(mesh: DeviceMesh) -> dist.ProcessGroup | DeviceMesh:
    """A 1-D mesh's process group; a 2-D mesh as it is; anything else raises (on every rank alike:
    every rank holds the same mesh)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.ndim == 2:
        return mesh
    raise ValueError(
        f"ring_attention takes a 1-D CP mesh or a 2-D (ulysses, ring) mesh; got a {mesh.ndim}-D mesh of shape "
        f"{tuple(mesh.shape)}. Pass the CP sub-mesh, e.g. world_mesh['cp'] or world_mesh['ulysses', 'ring']."
    )


def kv_replicas(hkv: int, ulysses: int) -> int:
    """How many copies of each K/V head the heads all-to-all sends; see Note [GQA under Ulysses]."""
    return math.lcm(hkv, ulysses) // hkv


def union_order(layout: str, ulysses: int, s_local: int) -> list[int]:
    """Index i of a ring rank's union -> u * S + j, the j-th token received from Ulysses rank u.
    See Note [Ulysses unions]."""
    u_, s = ulysses, s_local
    if layout == "striped":  # i = m * U + u
        return [(i % u_) * s + i // u_ for i in range(u_ * s)]
    if layout == "contiguous":
        return list(range(u_ * s))
    c = s // 2
    heads = [u * s + j for u in range(u_) for j in range(c)]
    tails = [u * s + c + j for u in reversed(range(u_)) for j in range(c)]
    return heads + tails


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all of a flat buffer; its own adjoint (part i went to rank i, so the gradient
    of part j received from rank j goes back to rank j)."""

    @staticmethod
    def forward(ctx, buf: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return all_to_all(buf, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_to_all(grad.contiguous(), ctx.group), None


def scatter_heads(x: Tensor, group: dist.ProcessGroup, order: Tensor, ready: Tensor | None = None) -> Tensor:
    """[B, H, S, D] (this rank's tokens, every head) -> [B, H / U, U * S, D] (the group's union, head slice u).
    ``ready``: compiled, the agreement the all-to-all must come after (Note [Compiled agreement] in checks.py)."""
    u_ = dist.get_world_size(group)
    b, h, s, d = x.shape
    parts = x.reshape(b, u_, h // u_, s, d).transpose(0, 1).contiguous()  # [U (to), B, H / U, S, D]
    got = _AllToAll.apply(tie(parts.reshape(-1), ready), group).view(u_, b, h // u_, s, d)  # [U (from), B, H / U, S, D]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // u_, u_ * s, d).index_select(2, order)


def gather_heads(y: Tensor, group: dist.ProcessGroup, inverse: Tensor) -> Tensor:
    """Inverse of :func:`scatter_heads`: [B, H / U, U * S, D] -> [B, H, S, D]."""
    u_ = dist.get_world_size(group)
    b, hu, n, d = y.shape
    s = n // u_
    parts = y.index_select(2, inverse).view(b, hu, u_, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [U (to), ...]
    got = _AllToAll.apply(parts.reshape(-1), group).view(u_, b, hu, s, d)  # [U (from: head slice), B, H/U, S, D]
    return got.transpose(0, 1).reshape(b, u_ * hu, s, d)
