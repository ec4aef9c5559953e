"""core/tiling.py: the tiled LM head + cross-entropy against F.cross_entropy on whole float64 logits (the mean,
the num_items sum, ignore_index, a bias, autocast, fp32 at 1e-5 / 1e-4, a tied head, frozen parts, a double
backward, a vocabulary-parallel head at TP = 2, every label ignored, an FSDP2-sharded head refused and served
unsharded), the fused path's 3 matmuls a tile (none in backward), the tiled
module forward against the plain one (its outputs and gradients, an MoE router's [B * S, E] output), the refusals,
and a fullgraph compile of both."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _tiers import slow
from torch.utils._python_dispatch import TorchDispatchMode

from cp_dtensor.core.tiling import DEFAULT_TILE, check_tile_size, linear_cross_entropy, tiled_forward
from _dist import run_ranks
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


def test_float64_head_under_bf16_autocast_stays_float64():
    """autocast leaves float64 alone (nn.Linear of a float64 model under bf16 autocast is a float64 matmul):
    the tiled head too, to float64 precision."""
    h, w, b, lab = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w, b).flatten(0, 1), lab.flatten())
        got = linear_cross_entropy(h, w, lab, bias=b, tile_size=4)
    assert got.dtype == torch.float64 and abs(got.item() - ref.item()) <= 1e-12 * abs(ref.item())
    for a, r in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(ref, (h, w, b))):
        assert a.dtype == torch.float64 and rel_err(a, r) <= 1e-12


def _plain64(h, w, lab, b=None, items=None):
    """The whole float64 logits' loss (transformers' reduction) and its gradients w.r.t. (h, w[, b])."""
    h, w = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    args = (h, w) if b is None else (h, w, b.detach().double().requires_grad_())
    logits = F.linear(h, w, None if b is None else args[2]).flatten(0, 1)
    loss = F.cross_entropy(logits, lab.flatten(), reduction="sum" if items else "mean") / (items or 1)
    return loss.item(), torch.autograd.grad(loss, args)


def test_fp32_loss_1e5_grads_1e4_against_float64():
    """fp32 at a realistic scale (vocab 3000, ignored labels, ragged tiles, a bias): the issue's tolerances."""
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(2, 300, 64, generator=g) * 2).requires_grad_()
    w = (torch.randn(3000, 64, generator=g) * 0.3).requires_grad_()
    b = torch.randn(3000, generator=g).requires_grad_()
    lab = torch.randint(0, 3000, (2, 300), generator=g)
    lab[torch.rand(2, 300, generator=g) < 0.2] = -100
    for items, tile in ((None, 128), (517, 1000)):
        want, ref = _plain64(h, w, lab, b, items)
        got = linear_cross_entropy(h, w, lab, bias=b, tile_size=tile, num_items_in_batch=items)
        assert got.dtype == torch.float32 and abs(got.item() - want) <= 1e-5 * abs(want)
        for a, r in zip(torch.autograd.grad(got, (h, w, b)), ref):
            assert a.dtype == torch.float32 and rel_err(a.double(), r) <= 1e-4, (items, tile)


def test_tied_head_frozen_parts_and_no_grad():
    """A head tied to the embedding (its gradient adds both uses), a frozen weight, constant hidden states and
    no_grad: each the float64 reference's (only what requires grad gets a gradient)."""
    h, w, _, lab = _data()
    tok = torch.randint(0, 20, (3, 11), generator=torch.Generator().manual_seed(5))
    tied = lambda loss_fn: loss_fn(torch.tanh(F.embedding(tok, w)) + h, w)  # noqa: E731
    got = tied(lambda x, ww: linear_cross_entropy(x, ww, lab, tile_size=4))
    ref = tied(lambda x, ww: F.cross_entropy(F.linear(x, ww).flatten(0, 1), lab.flatten()))
    for a, r in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(ref, (h, w))):
        assert rel_err(a, r) <= 1e-12
    want, (dh, dw) = _plain64(h, w, lab)
    (gw,) = torch.autograd.grad(linear_cross_entropy(h.detach(), w, lab, tile_size=4), (w,))
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w.detach(), lab, tile_size=4), (h,))
    assert rel_err(gw, dw) <= 1e-12 and rel_err(gh, dh) <= 1e-12
    with torch.no_grad():
        assert abs(linear_cross_entropy(h, w, lab, tile_size=4).item() - want) <= 1e-12 * abs(want)


def test_double_backward_takes_the_recompute_path():
    """create_graph=True: the gradient is itself differentiable (the recompute path), as the plain loss's."""
    h, w, b, lab = _data()

    def second(loss_fn):
        (gh,) = torch.autograd.grad(loss_fn(), (h,), create_graph=True)
        return torch.autograd.grad((gh ** 2).sum(), (h, w, b))

    got = second(lambda: linear_cross_entropy(h, w, lab, bias=b, tile_size=4))
    ref = second(lambda: F.cross_entropy(F.linear(h, w, b).flatten(0, 1), lab.flatten()))
    assert all(rel_err(a, r) <= 1e-12 for a, r in zip(got, ref))


aten = torch.ops.aten


class _Matmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket in (aten.mm, aten.addmm, aten.addmm_, aten.addmv, aten.addmv_, aten.matmul)
        return func(*args, **(kwargs or {}))


def test_fused_path_runs_three_matmuls_a_tile_and_none_in_backward():
    """Note [Sequence tiling]: matmuls 1-3 in the forward (and db's matvec), nothing recomputed in backward;
    with a frozen weight, no dW matmul."""
    h, w, b, lab = _data()
    tiles = -(-33 // 4)
    for frozen, want in ((False, 4 * tiles), (True, 2 * tiles)):
        ww = w.detach() if frozen else w
        with _Matmuls() as fwd:
            loss = linear_cross_entropy(h, ww, lab, bias=None if frozen else b, tile_size=4)
        with _Matmuls() as bwd:
            loss.backward()
        assert (fwd.n, bwd.n) == (want, 0), frozen


def _vocab_parallel(rank, world):
    """A vocabulary-parallel head (weight and bias DTensors Shard(0), 21 rows: uneven shards) at TP = 2 against
    the whole float64 head: hidden states plain (dh all-reduced) and a Replicate DTensor (dh left Partial)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(6)
    h = torch.randn(2, 13, 8, generator=g, dtype=torch.float64)
    w, b = torch.randn(21, 8, generator=g, dtype=torch.float64), torch.randn(21, generator=g, dtype=torch.float64)
    lab = torch.randint(0, 21, (2, 13), generator=g)
    lab[0, 3:7] = -100
    for items, replicated in ((None, False), (19, True)):
        want, ref = _plain64(h, w, lab, b, items)
        dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        db = distribute_tensor(b, mesh, [Shard(0)]).requires_grad_()
        hh = h.clone().requires_grad_()
        x = DTensor.from_local(hh, mesh, [Replicate()]) if replicated else hh
        got = linear_cross_entropy(x, dw, lab, bias=db, tile_size=5, num_items_in_batch=items,
                                   tp_mesh=None if replicated else mesh)  # the TP mesh named, or implied by x
        got.backward()
        assert abs(got.item() - want) <= 1e-12 * abs(want), (items, replicated)
        for a, r in zip((hh.grad, dw.grad.full_tensor(), db.grad.full_tensor()), ref):
            assert rel_err(a, r) <= 1e-12, (items, replicated)
    # every label ignored (mean: 0 / 0): nan loss and zero gradients, as F.cross_entropy
    dw = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
    hh = h.clone().requires_grad_()
    got = linear_cross_entropy(hh, dw, torch.full_like(lab, -100), tile_size=5, tp_mesh=mesh)
    got.backward()
    assert got.isnan() and not hh.grad.any() and not dw.grad.full_tensor().any()
    # Note [Which DTensor head is vocabulary-parallel]: a Shard(0) head with plain hidden states and no tp_mesh
    # (an FSDP shard looks the same) is refused on every rank before any collective
    with pytest.raises(ValueError, match="FSDP-sharded one"):
        linear_cross_entropy(h, distribute_tensor(w, mesh, [Shard(0)]), lab)
    # a label out of [0, V) on one rank only, and unequal token counts: raised on every rank, no hang
    bad = lab.clone()
    bad[1, 2] = (21, -3)[rank] if rank < 2 else 0
    with pytest.raises(IndexError, match="outside"):
        linear_cross_entropy(h, distribute_tensor(w, mesh, [Shard(0)]), bad, tp_mesh=mesh)
    n = 13 - rank
    with pytest.raises(ValueError, match="same tokens on every TP rank"):
        linear_cross_entropy(h[:, :n], distribute_tensor(w, mesh, [Shard(0)]), lab[:, :n], tp_mesh=mesh)
    with pytest.raises(ValueError, match="sharded over the vocabulary"):
        linear_cross_entropy(h, distribute_tensor(w, mesh, [Shard(1)]), lab)
    _fsdp_head(rank, world)
    with pytest.raises(ValueError, match="replicated on the head's mesh"):
        linear_cross_entropy(distribute_tensor(h, mesh, [Shard(1)]), distribute_tensor(w, mesh, [Shard(0)]), lab)
    return True


class _BodyHead(torch.nn.Module):
    """A body whose forward returns the hidden states, and a head the loss reads."""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 21, bias=False)

    def forward(self, x):
        return self.body(x)


def _fsdp_head(rank, world):
    """An FSDP2-sharded head (fully_shard, its own unit; each rank its own batch, of different lengths): its
    weight outside the forward is refused on every rank; unsharded (head.unshard()) it is served, each rank's
    loss its own batch's and the reduced gradient FSDP's plain one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = _BodyHead()
    ref = copy.deepcopy(model)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(10 + rank)
    x, lab = torch.randn(5 + 2 * rank, 8, generator=g), torch.randint(0, 21, (5 + 2 * rank,), generator=g)
    h, head = model(x), model.head
    with pytest.raises(ValueError, match="FSDP-sharded one"):
        linear_cross_entropy(h, head.weight, lab)
    head.unshard()
    loss = linear_cross_entropy(h, head.weight, lab, tile_size=2)
    head.reshard()
    loss.backward()
    want = F.cross_entropy(ref.head(ref(x)), lab)
    want.backward()
    dw = ref.head.weight.grad.clone()
    torch.distributed.all_reduce(dw)
    assert abs(loss.item() - want.item()) <= 1e-6 * want.item()
    assert rel_err(head.weight.grad.full_tensor(), dw / world) <= 1e-5
    return True


def test_vocabulary_parallel_head_at_tp2_equals_whole_head():  # and an FSDP-sharded head
    assert run_ranks(2, _vocab_parallel) == [True, True]


def test_all_labels_ignored_gives_zero_gradients():
    """Nothing labelled: F.cross_entropy's nan mean (or a sum / 0) and its zero gradients -- never nan ones --
    for num_items None and 0, a single token, the fused and the recompute paths."""
    h, w, b, _ = _data()
    for items in (None, 0, torch.tensor([0])):
        for n in (11, 1):
            lab = torch.full((3, n), -100)
            got = linear_cross_entropy(h[:, :n], w, lab, bias=b, tile_size=4, num_items_in_batch=items)
            ref = F.cross_entropy(F.linear(h[:, :n], w, b).flatten(0, 1), lab.flatten(),
                                  reduction="mean" if items is None else "sum") / (1 if items is None else 0)
            assert got.isnan() and ref.isnan()
            for a, r in zip(torch.autograd.grad(got, (h, w, b)), torch.autograd.grad(ref, (h, w, b))):
                assert not r.any() and torch.equal(a, r), (items, n)
    lab = torch.full((3, 11), -100)
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, lab, tile_size=4), (h,), create_graph=True)
    assert not gh.any() and not torch.autograd.grad(gh.sum(), (w,))[0].isnan().any()


def test_num_items_as_a_one_element_tensor():
    h, w, _, lab = _data()
    want = F.cross_entropy(F.linear(h, w).flatten(0, 1), lab.flatten(), reduction="sum") / 17
    got = linear_cross_entropy(h, w, lab, tile_size=4, num_items_in_batch=torch.tensor([17]))
    assert got.shape == () and abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
    with pytest.raises(ValueError, match="one-element tensor"):
        linear_cross_entropy(h, w, lab, num_items_in_batch=torch.tensor([17, 3]))


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
    for tile in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="tile_size must be a positive int"):
            linear_cross_entropy(h, w, lab, tile_size=tile)
    with pytest.raises(TypeError, match="integer labels"):
        linear_cross_entropy(h, w, lab.double())
    with pytest.raises(ValueError, match="bias must be"):
        linear_cross_entropy(h, w, lab, bias=torch.ones(3))
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
