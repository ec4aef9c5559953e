"""core/tiling.py: the tiled LM head + cross-entropy against F.cross_entropy on whole float64 logits (the mean,
the num_items sum, ignore_index, a bias, autocast), the tiled module forward against the plain one (its outputs
and gradients, an MoE router's [B * S, E] output), the refusals, and a fullgraph compile of both."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _tiers import slow

from cp_dtensor.core.tiling import DEFAULT_TILE, check_tile_size, linear_cross_entropy, tiled_forward
from _ref import rel_err


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 11, 8, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(20, 8, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(20, generator=g, dtype=dtype, requires_grad=True)
    lab = torch.randint(0, 20, (3, 11), generator=g)
    lab[1, 2:6] = -100
    return h, w, b, lab


def test_linear_cross_entropy_equals_whole_logits_float64():
    h, w, b, lab = _data()
    for items in (None, 17):
        for tile in (1, 4, 33, 100):
            ref = F.cross_entropy((h @ w.T + b).flatten(0, 1), lab.flatten(), reduction="sum" if items else "mean")
            ref = ref / (items or 1)
            got = linear_cross_entropy(h, w, lab, bias=b, tile_size=tile, num_items_in_batch=items)
            for a, r in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(ref, (h, w, b))):
                assert rel_err(a, r) <= 1e-12, (items, tile)
            assert abs(got.item() - ref.item()) <= 1e-12 * abs(ref.item())


def test_linear_cross_entropy_under_autocast_as_linear_then_float():
    """bf16 autocast around fp32 weights (a Trainer's bf16 run): the head's matmul in bf16, the loss in fp32 --
    what nn.Linear under autocast then ForCausalLMLoss's .float() computes."""
    h, w, _, lab = _data(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float().flatten(0, 1), lab.flatten())
        got = linear_cross_entropy(h, w, lab, tile_size=4)
    assert got.dtype == torch.float32 and abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    gr, gg = torch.autograd.grad(ref, (h, w)), torch.autograd.grad(got, (h, w))
    assert all(a.dtype == torch.float32 and rel_err(a, r) <= 2e-2 for a, r in zip(gg, gr))  # bf16 matmuls


class _Router(torch.nn.Module):
    """An MoE block's shape of output: ([B, S, H], [B * S, E])."""

    def __init__(self):
        super().__init__()
        self.up, self.gate = torch.nn.Linear(8, 16).double(), torch.nn.Linear(8, 3).double()

    def forward(self, x):
        return torch.tanh(self.up(x))[..., :8] * x, self.gate(x.flatten(0, 1)).softmax(-1)


def test_tiled_forward_equals_plain_forward():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    m = _Router()
    for tile in (5, 13, 40):
        got, ref = tiled_forward(m, x, tile_size=tile), m(x)
        assert all(rel_err(a, r) <= 1e-15 for a, r in zip(got, ref))
        loss = lambda out: (out[0] ** 2).sum() + (out[1] * torch.arange(3.0, dtype=torch.float64)).sum()  # noqa: E731
        params = [x, *m.parameters()]
        for a, r in zip(torch.autograd.grad(loss(got), params), torch.autograd.grad(loss(ref), params)):
            assert rel_err(a, r) <= 1e-13


def test_refusals():
    assert check_tile_size(True) == DEFAULT_TILE and check_tile_size(False) is None and check_tile_size(7) == 7
    for bad in (0, -1, 1.5, "8"):
        with pytest.raises(ValueError, match="sequence_tiling must be"):
            check_tile_size(bad)
    h, w, _, lab = _data()
    with pytest.raises(ValueError, match="hidden"):
        linear_cross_entropy(h, w, lab[:, :5])
    with pytest.raises(ValueError, match="tile_size"):
        linear_cross_entropy(h, w, lab, tile_size=0)
    with pytest.raises(ValueError, match="not a tensor per token"):
        tiled_forward(lambda x: x.sum(1), torch.ones(2, 6, 3), tile_size=4)


@slow("a fullgraph compile (~14 s on 2 cores)")
def test_fullgraph_compile_of_the_tiled_paths():
    """One compiled graph (fullgraph, aot_eager) of a tiled MLP then the tiled head + loss: forward and backward
    equal eager's."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 40, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    lab = torch.randint(0, 50, (2, 40), generator=g)
    lab[0, :3] = -100
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))

    def step(h, w, lab):
        return linear_cross_entropy(tiled_forward(mlp, h, tile_size=16), w, lab, tile_size=16, num_items_in_batch=70)

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(h, w, lab)
    ref = step(h, w, lab)
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for a, r in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert rel_err(a, r) <= 1e-6
