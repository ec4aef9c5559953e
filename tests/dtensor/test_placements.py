"""Layout placements against index formulas written out here, never against dtensor/placements.py itself."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from cp_dtensor.dtensor.placements import (
    HeadTail,
    Striped,
    full_tensor,
    install_headtail_propagation,
    sequence_placement,
)
from cp_dtensor.dtensor.sharding import shard_sequence, to_mesh
from _dist import run_ranks

LAYOUTS = ("striped", "headtail", "contiguous")


def expected_positions(layout: str, rank: int, world: int, n: int) -> list[int]:
    """The layouts of Note [Sequence layouts], spelled out independently."""
    s = n // world
    if layout == "contiguous":
        return list(range(rank * s, rank * s + s))
    if layout == "striped":
        return list(range(rank, n, world))
    c = s // 2
    return list(range(rank * c, rank * c + c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))


def expected_local(x: torch.Tensor, layout: str, rank: int, world: int, dim: int) -> torch.Tensor:
    return x.index_select(dim, torch.tensor(expected_positions(layout, rank, world, x.shape[dim])))


def assert_correct_or_refused(fn, want: torch.Tensor, *, refused: bool) -> None:
    """Never silently wrong: ``fn()`` equals ``want``, or -- where torch cannot carry the head-tail split
    factor (Note [HeadTail placement]) -- DTensor's sharding propagation refuses it."""
    if refused:
        with pytest.raises(RuntimeError, match="Sharding propagation failed"):
            fn()
    else:
        assert torch.equal(fn(), want)


def _check_layouts(rank: int, world: int) -> None:
    install_headtail_propagation()
    mesh = init_device_mesh("cpu", (world,))
    n = 4 * world
    x = torch.arange(2 * n * 3, dtype=torch.float32).view(2, n, 3)
    for layout in LAYOUTS:
        d = shard_sequence(x, mesh, seq_dim=1, layout=layout)
        assert torch.equal(d.to_local(), expected_local(x, layout, rank, world, 1)), layout
        assert d.shape == x.shape
        assert torch.equal(d.full_tensor(), x), layout
        assert torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), x), layout
        # to and from Replicate, Shard and every layout
        for target in LAYOUTS:
            p = sequence_placement(1, layout=target, seq_len=n, cp_size=world)
            moved = d.redistribute(mesh, [p])
            assert torch.equal(moved.to_local(), expected_local(x, target, rank, world, 1)), (layout, target)
            assert torch.equal(full_tensor(moved), x), (layout, target)
            back = moved.redistribute(mesh, d.placements)
            assert torch.equal(back.to_local(), d.to_local()), (layout, target)
        from_rep = distribute_tensor(x, mesh, [Replicate()]).redistribute(mesh, d.placements)
        assert torch.equal(from_rep.to_local(), d.to_local()), layout
        assert torch.equal(d.redistribute(mesh, [Shard(1)]).to_local(), x.chunk(world, 1)[rank]), layout
        # elementwise ops keep the placement; ops that mix along the sequence gather correctly
        y = d * 2 + 1
        assert y.placements == d.placements and torch.equal(full_tensor(y), x * 2 + 1), layout
        z = d + distribute_tensor(torch.ones(3), mesh, [Replicate()])
        assert z.placements == d.placements and torch.equal(full_tensor(z), x + 1), layout
        assert torch.equal(d.sum(1).full_tensor(), x.sum(1)), layout
        assert torch.equal(full_tensor(d.cumsum(1)), x.cumsum(1)), layout
        assert torch.allclose(full_tensor(d.softmax(1)), x.softmax(1)), layout
        assert torch.equal(full_tensor(d.transpose(1, 2)), x.transpose(1, 2)), layout
        assert torch.equal(d.transpose(1, 2).full_tensor(), x.transpose(1, 2)), layout
        assert_correct_or_refused(lambda: full_tensor(d.transpose(1, 2) @ d), x.transpose(1, 2) @ x,
                                  refused=layout == "headtail")  # expand of the head-tail dim
        assert_correct_or_refused(lambda: full_tensor(d.view(2, n, 3, 1)), x.view(2, n, 3, 1),
                                  refused=layout == "headtail")
        r = distribute_tensor(x, mesh, [Replicate()])
        assert (d * r).placements == d.placements and torch.equal(full_tensor(d * r), x * x), layout
    # striped is torch's own _StridedShard; distribute_tensor understands it
    st = distribute_tensor(x, mesh, [Striped(1, seq_len=n, cp_size=world)])
    assert type(st.placements[0]) is _StridedShard
    assert torch.equal(st.to_local(), expected_local(x, "striped", rank, world, 1))
    # head-tail: never silently wrong -- torch paths that cannot honour it fail loudly
    ht = shard_sequence(x, mesh, seq_dim=1, layout="headtail")
    # torch's own check on the split factor -1 (2.13+; 2.11's torch.chunk says it in its words)
    with pytest.raises((AssertionError, RuntimeError), match="num_chunks > 0|`chunks` to be greater than 0"):
        distribute_tensor(x, mesh, [HeadTail(1)])
    with pytest.raises(RuntimeError, match="Cannot unflatten tensor with _StridedShard placement|"
                       "Sharding propagation failed"):  # 2.13+ | 2.11
        ht.reshape(2, n // 2, 6)  # a view splitting the head-tail dim
    with pytest.raises(RuntimeError, match="Sharding propagation failed"):
        ht.reshape(2 * n, 3)  # a view merging the head-tail dim with another
    with pytest.raises(ValueError, match="divisible by"):
        shard_sequence(x[:, :-1], mesh, seq_dim=1, layout="striped")
    with pytest.raises(ValueError, match="non-negative"):
        HeadTail(-1)


@pytest.mark.parametrize("world", [2, 4])
def test_layout_placements(world):
    run_ranks(world, _check_layouts)


def _check_meshes(rank: int, world: int) -> None:
    install_headtail_propagation()
    n = 16
    x = torch.arange(n * 6, dtype=torch.float32).view(1, 2, n, 3)
    small = DeviceMesh("cpu", [0, 1])
    big = init_device_mesh("cpu", (4,))
    for src in LAYOUTS:
        for dst in LAYOUTS:
            d = shard_sequence(x, small, seq_dim=2, layout=src)
            grown = to_mesh(d, big, [sequence_placement(2, layout=dst, seq_len=n, cp_size=4)])
            assert torch.equal(grown.to_local(), expected_local(x, dst, rank, 4, 2)), (src, dst)
            shrunk = to_mesh(grown, small, [sequence_placement(2, layout=src, seq_len=n, cp_size=2)])
            if rank < 2:
                assert torch.equal(shrunk.to_local(), expected_local(x, src, rank, 2, 2)), (src, dst)
                assert torch.equal(full_tensor(shrunk), x)
    # a 2-D (cp, tp) mesh: sequence on cp, heads on tp
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp_rank, tp_rank = mesh.get_coordinate()
    for layout in LAYOUTS:
        d = shard_sequence(x, mesh, seq_dim=2, layout=layout, mesh_dim="cp").redistribute(
            mesh, [sequence_placement(2, layout=layout, seq_len=n, cp_size=2), Shard(1)])
        want = expected_local(x, layout, cp_rank, 2, 2).chunk(2, 1)[tp_rank]
        assert torch.equal(d.to_local(), want), layout
        assert torch.equal(full_tensor(d), x), layout
        for other in LAYOUTS:
            moved = d.redistribute(mesh, [sequence_placement(2, layout=other, seq_len=n, cp_size=2), Shard(1)])
            assert torch.equal(moved.to_local(), expected_local(x, other, cp_rank, 2, 2).chunk(2, 1)[tp_rank])
            assert isinstance(moved, DTensor) and torch.equal(full_tensor(moved), x)


def test_other_meshes():
    run_ranks(4, _check_meshes)
