"""Touches of private torch internals that cp_dtensor's own code needs to stay correct, one place each.

Written against torch 2.13.0. tests/test_compat.py checks that every symbol used here still exists.

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
  (dispatch.py). AOTAutograd's cache keys that graph by its inputs' ``DTensor._stable_hash_for_caching``
  -> ``DTensorSpec._stable_hash`` -> ``DeviceMesh._stable_hash``, which (torch 2.13) hashes the mesh's
  ranks, shape and names but not *this rank's coordinate in it*. Every rank computes the same key, the
  last to finish a cold run owns the cache entry, and on the next run every rank loads that one rank's
  forward and backward: the other ranks then post collectives of other sizes (gloo: "Received data
  size doesn't match expected size"; NCCL: a hang or wrong data). Plain DTensor has the same bug without cp_dtensor:
  a compiled ``x.redistribute(placements=[Shard(0)])`` of a replicated ``x`` (a rank-dependent local
  slice) returns rank 1's rows on rank 0 in the second run, silently.

The fix is the key, narrowly: ``include_mesh_coordinate_in_cache_key`` makes ``DeviceMesh._stable_hash``
also hash ``mesh.get_coordinate()`` (this rank's coordinate on every mesh dim, so the rank in the CP
group too), and so every DTensor graph AOTAutograd caches is keyed by the rank it was traced on. Nothing
else reads ``_stable_hash`` in torch 2.13 (DTensor sharding propagation uses ``__hash__``). The cost:
one compile per rank (which happens anyway: the ranks trace concurrently) and one AOTAutograd cache entry
per rank instead of one shared (wrong) one. A model under ``apply_context_parallel`` (module.py)
compiles to the local ring's graph with ``DTensor.from_local`` and the mesh in Dynamo's graph; torch
2.13's AOTAutograd cache bypasses that graph or keys its mesh input differently in every process, and
Inductor's FX graph cache, which sees the rank-specific ring, serves it: safe without the patch.
torchtitan's plugin calls ``ring_attention`` on local shards: the first case.
"""

from __future__ import annotations

import hashlib
import warnings

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["include_mesh_coordinate_in_cache_key"]

TORCH_VERSION = "2.13.0"  # what the touches below were written against
PRIVATE_SYMBOLS = (  # (owner, attribute): checked by tests/test_compat.py
    ("torch.distributed.device_mesh.DeviceMesh", "_stable_hash"),
    ("torch.distributed.tensor._dtensor_spec.DTensorSpec", "_stable_hash"),
    ("torch.distributed.tensor.DTensor", "_stable_hash_for_caching"),
)


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
