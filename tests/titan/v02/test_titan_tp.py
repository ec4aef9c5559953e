"""The plugin's attention under tensor parallelism, in process (Note [TP heads into the ring], titan/v02/attention.py).

qwen3's TP plan hands attention q, k, v as DTensors sharded over heads on the TP mesh. On 2 gloo ranks
(TP = 2, CP = 1 per rank), ``RingAttention`` on those DTensors must return a DTensor with the same
placement whose full tensor, and the gradients of q, k, v, equal float64 causal GQA attention on the
unsharded tensors (rel 1e-9). End to end (qwen3 CP2 x TP2 vs CP1, slow tier): test_titan_families.py.
"""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("torchtitan") is None:
    pytest.skip("torchtitan is not installed", allow_module_level=True)
from _titan_run import skip_unless_titan  # noqa: E402

skip_unless_titan((0, 2))  # torchtitan 0.3: tests/test_titan03*.py

import torch  # noqa: E402

import cp_dtensor.titan  # noqa: E402, F401  before any torchtitan import: see Note [torchtitan on CPU]
from _dist import run_ranks  # noqa: E402

B, HQ, HKV, S, D = 2, 4, 2, 16, 8


def _reference(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v  # [B, HQ, S, D]


def _tp_heads(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from cp_dtensor.titan.v02.attention import RingAttention

    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cp_group, _ = dist.new_subgroups(group_size=1)  # CP = 1: the ring on this rank alone
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV)]
    dout = torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64)
    ref_in = [t.clone().requires_grad_() for t in full]
    ref = _reference(*ref_in)
    ref.backward(dout)

    dts = [distribute_tensor(t, tp, [Shard(1)]).requires_grad_() for t in full]  # [B, H / 2, S, D] per rank
    out = RingAttention(group=cp_group, layout="striped")(*dts, scale=D**-0.5)
    assert out.placements == (Shard(1),) and out.shape == (B, HQ, S, D)
    out.backward(distribute_tensor(dout, tp, [Shard(1)]))
    torch.testing.assert_close(out.full_tensor(), ref.detach(), rtol=1e-9, atol=1e-12)
    for dt, r in zip(dts, ref_in):
        torch.testing.assert_close(dt.grad.full_tensor(), r.grad, rtol=1e-9, atol=1e-12)

    q_rep = distribute_tensor(full[0], tp, [Replicate()])
    with pytest.raises(NotImplementedError, match=r"DTensors sharded over heads \(Shard\(1\)\)"):
        RingAttention(group=cp_group, layout="striped")(q_rep, *dts[1:])


def test_ring_attention_runs_each_tp_ranks_heads():
    run_ranks(2, _tp_heads)
