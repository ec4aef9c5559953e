"""The plugin's install() under either torchtitan (0.2.2: titan/v02, 0.3: titan/v03): importing
cp_dtensor.titan installs it once; installing again changes nothing it patched."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)

import cp_dtensor.titan as titan  # noqa: E402  before any torchtitan import: see Note [torchtitan on CPU]


def _patched() -> dict:
    """What install() changes, by identity: torch.histc (both), 0.2.2's train-spec lookup and registry."""
    import torch

    state = {"histc": torch.histc}
    if titan.VERSION < (0, 3):
        import torchtitan.protocols.train_spec as specs

        state["get_train_spec"] = specs.get_train_spec
        state["specs"] = {family: specs.get_train_spec(family).parallelize_fn for family in titan.FAMILIES}
    return state


def test_install_twice_changes_nothing():
    before = _patched()
    titan.install()
    titan.install()
    assert _patched() == before
