"""The deprecated keyword spellings kept for users' scripts (``group=``, ``world=``, ``dim=``, positional
``layout``) compile under ``torch.compile(fullgraph=True)`` exactly as the new ones (issue 48): no warning is
traced (``warn_once`` stands aside while dynamo compiles), and each compiled old spelling equals the new
spelling run eagerly. aot_eager: the trace is what is tested, not Inductor. One spawn at P=2. (The linear-attention
pieces, sharded_causal_conv1d / sharded_delta_rule, run their checks eagerly behind a graph break under any
spelling: fullgraph is not theirs to test here.)"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.device_mesh import init_device_mesh

import cp_dtensor
from cp_dtensor import _deprecated
from cp_dtensor.core.plan.layout import local_positions, shard_tensor, unshard_tensor
from _dist import run_ranks
from _ref import rel_err


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _cases(rank: int, world: int) -> list[str]:
    grp = init_device_mesh("cpu", (world,)).get_group()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    full = torch.randn(2, 3, 16, generator=g)
    cases = {  # the old spelling (compiled) and the new one (eager)
        "ring_attention(group=)": (lambda: cp_dtensor.ring_attention(q, k, v, group=grp, is_causal=True),
                                   lambda: cp_dtensor.ring_attention(q, k, v, mesh=grp, is_causal=True)),
        "shard_tensor(dim=, world=)": (lambda: shard_tensor(full, dim=2, layout="striped", rank=rank, world=world),
                                       lambda: shard_tensor(full, seq_dim=2, layout="striped", rank=rank,
                                                            cp_size=world)),
        "unshard_tensor(dim=)": (lambda: unshard_tensor([full, full + 1], dim=-1, layout="headtail"),
                                 lambda: unshard_tensor([full, full + 1], seq_dim=-1, layout="headtail")),
        "local_positions(positional, world=)": (
            lambda: local_positions("headtail", rank, world=world, seq_len=16) + full.sum() * 0,
            lambda: local_positions(layout="headtail", rank=rank, cp_size=world, seq_len=16) + full.sum() * 0),
    }
    done = []
    for name, (old, new) in cases.items():
        _deprecated._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _compiled(old)()
        assert not [c for c in caught if issubclass(c.category, FutureWarning)], (name, [str(c.message) for c in caught])
        want = new()
        assert got.shape == want.shape and rel_err(got.double(), want.double()) <= 1e-6, name
        for calls in (1, 0):  # eager, the old spelling still warns, once (each old keyword of it)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                old()
            assert min(1, sum(issubclass(c.category, FutureWarning) for c in caught)) == calls, name
        done.append(name)
    return done


def test_deprecated_keywords_compile_fullgraph():
    assert [len(r) for r in run_ranks(2, _cases)] == [4, 4]
