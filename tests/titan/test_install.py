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


def test_integer_histc_equals_float_histc_and_compiles_whole():
    # Note [torchtitan on CPU] 4a: the routers' integer histc, against torch's own on the same values as
    # floats (in-range, the max edge, values below and above the range); static shapes, so fullgraph compiles
    import torch

    from cp_dtensor.titan.shared.cpu import _integer_histc

    histc = _integer_histc(torch.histc.__wrapped__ if hasattr(torch.histc, "__wrapped__") else torch.histc)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randint(-3, 12, (200,), generator=g), torch.tensor([0, 8, 8, 7])])
    for bins, lo, hi in ((8, 0, 8), (3, 0, 8), (5, 1, 6)):
        want = torch.histc(x.double(), bins=bins, min=lo, max=hi).long()
        assert torch.equal(histc(x, bins=bins, min=lo, max=hi), want), (bins, lo, hi)
    compiled = torch.compile(lambda t: histc(t, bins=8, min=0, max=8), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), torch.histc(x.double(), bins=8, min=0, max=8).long())
