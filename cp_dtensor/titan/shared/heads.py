"""Heads and meshes that both torchtitan versions share: TP's head-sharded q/k/v into the ring, and the
(ulysses, ring) mesh of the CP group.

Note [TP heads into the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under tensor parallelism the attention layer holds Hq / TP query heads and Hkv / TP K/V heads per TP
rank. torchtitan 0.2.2's qwen3 TP plan runs ``wq``/``wk``/``wv`` with ``use_local_output=False`` and
q/k norm as ``SequenceParallel(sequence_dim=2)``, so attention receives DTensors [B, H, S_local, D]
placed Shard(1) (heads) on the TP mesh -- which is why torch's own CP x TP breaks for qwen3 upstream;
torchtitan 0.3's plans hand every family's inner attention q, k, v as DTensors [B, L, N, H] placed
Shard(2). Heads are independent in attention, so each TP rank runs the ring over the CP group (another
mesh dimension) on its local heads only -- each ring step moves Hkv / TP K/V heads -- and hands the
output back as the same DTensor placement; ``wo``'s row-wise plan then reduces over heads as it would
after SDPA. ``tp_head_sharding`` recognises the placement (anything else raises, naming the fix); TP
must divide both Hq and Hkv, checked at start-up on every rank.

Note [Ulysses in torchtitan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``[cp_dtensor] ulysses_degree = U`` splits the P = context_parallel_degree CP ranks into a (U, R = P / U)
mesh for ``ring_attention`` (Note [Ulysses x ring] in ulysses.py): heads all-to-all over U, ring over R.
``ulysses_mesh`` makes U the fast-varying dim of the CP group, mesh[u, r] = CP rank r * U + u, so a
Ulysses group is U consecutive CP ranks -- on a cluster, whose CP ranks fill a node before the next,
the all-to-all stays inside a node and only the ring crosses nodes. ring_attention's contract is that
mesh rank (u, r) holds the 1-D layout shard of its row-major index p = u * R + r, which is *not* its CP
rank r * U + u; so ``shard_cp_batch`` shards inputs, labels, positions and mask ids by
``ulysses_shard_index`` = p (the same permutation of shards for every layout; the loss, a sum over all
tokens, does not care which rank holds which shard). Heads: TP splits Hq first, each Ulysses rank
then takes (Hq / TP) / U of a TP rank's heads, so U must divide Hq / TP (checked at start,
config.check_config); K/V heads follow Note [GQA under Ulysses].
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ..._compat import mesh_concatenate, mesh_unflatten

__all__ = ["tp_head_sharding", "ulysses_mesh", "ulysses_shard_index"]


def tp_head_sharding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, heads_dim: int = 1):
    """(mesh, placements) of q, k, v when they are DTensors sharded over heads (dim ``heads_dim``: 1 in
    0.2.2's [B, H, S, D], 2 in 0.3's [B, L, N, H]) on a TP mesh, else None. See Note [TP heads into the ring].
    """
    dts = [isinstance(t, DTensor) for t in (q, k, v)]
    if not any(dts):
        return None
    heads = (Shard(heads_dim),)
    if not all(dts) or any(t.placements != heads or t.device_mesh != q.device_mesh for t in (q, k, v)):
        raise NotImplementedError(
            "cp_dtensor ring attention takes q, k, v as local tensors or as DTensors sharded over heads "
            f"(Shard({heads_dim})) on one mesh; got {[getattr(t, 'placements', 'local') for t in (q, k, v)]}. "
            "Use torchtitan's TP plan for this family unchanged, or set tensor_parallel_degree = 1.")
    return q.device_mesh, q.placements


def ulysses_mesh(cp_mesh: DeviceMesh, ulysses: int) -> DeviceMesh:
    """The (ulysses, ring) mesh of the CP group ``cp_mesh`` (1-D, P ranks): mesh[u, r] = CP rank r * U + u
    (Note [Ulysses in torchtitan]). Every rank must call it (it makes process groups)."""
    world = cp_mesh.size()
    ring_major = mesh_unflatten(cp_mesh, (world // ulysses, ulysses), ("cp_ring", "cp_ulysses"))  # [r, u] = r * U + u
    out = mesh_concatenate([ring_major["cp_ulysses"], ring_major["cp_ring"]])  # [u, r] = r * U + u
    assert out.mesh.tolist() == cp_mesh.mesh.reshape(-1, ulysses).T.tolist(), "ulysses mesh order"
    return out


def ulysses_shard_index(cp_rank: int, world: int, ulysses: int) -> int:
    """The 1-D shard index p = u * R + r that CP rank r * U + u holds (Note [Ulysses in torchtitan])."""
    return (cp_rank % ulysses) * (world // ulysses) + cp_rank // ulysses
