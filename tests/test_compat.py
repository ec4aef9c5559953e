"""cp_dtensor/_compat.py: the private torch symbols it touches still exist, and its patches do what they say."""

from __future__ import annotations

import importlib

import torch

import cp_dtensor  # noqa: F401  (installs the patches)
from cp_dtensor import _compat
from _dist import run_ranks


def test_private_symbols_exist():
    """If this fails after a torch upgrade, revisit Note [Rank-specialised compiled graphs] in _compat.py
    (written against torch _compat.TORCH_VERSION)."""
    for owner, attr in _compat.PRIVATE_SYMBOLS:
        module, _, name = owner.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        assert hasattr(cls, attr), f"{owner}.{attr} is gone in torch {torch.__version__}"
    from torch.distributed.device_mesh import DeviceMesh

    assert DeviceMesh._stable_hash is _compat._stable_hash_with_coordinate, "the cache-key patch is not installed"


def _hashes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = cp_dtensor.shard_sequence(torch.zeros(1, 1, 2 * world, 1), mesh, dim=2, layout="headtail")
    return mesh._stable_hash(), init_device_mesh("cpu", (world,))._stable_hash(), x._stable_hash_for_caching()


def test_dtensor_cache_hash_names_the_rank():
    """The hash AOTAutograd's cache keys a DTensor graph input by: stable for one rank, different per rank."""
    hashes = run_ranks(2, _hashes)
    for mesh_hash, same_mesh_again, _ in hashes:
        assert mesh_hash == same_mesh_again
    assert len({h[0] for h in hashes}) == 2 and len({h[2] for h in hashes}) == 2, hashes
