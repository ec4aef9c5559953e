"""One run of the warm-cache check (tests/core/test_compile_cache.py runs this script twice, as fresh processes
sharing one TORCHINDUCTOR_CACHE_DIR).

    python tests/_compile_cache_run.py OUT_DIR WORLD CASE[,CASE...]     # CASE: path/layout, e.g. local/striped

Forks WORLD gloo ranks (file rendezvous in a fresh temp dir, one thread each, 60 s collective timeout).
Every rank compiles, per case, one attention call (fullgraph, Inductor, causal, forward + backward):
``dtensor``: ``F.scaled_dot_product_attention`` on sequence-sharded DTensors; ``local``:
``cp_dtensor.ring_attention`` on local shards; ``module``: a module calling SDPA on local shards under
``apply_context_parallel``. It compares with float64 attention and writes OUT_DIR/rank<r>.json: per
case the largest relative error and the compile-cache counters of that case. ``torch.multiprocessing``'s join ends every rank as soon as one
dies (gloo aborts the process on a collective size mismatch), so a mismatch fails fast, not at a timeout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _dist

_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass",
             "autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")


class _SDPA(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _case(path: str, layout: str, rank: int, world: int, mesh) -> float:
    import cp_dtensor
    from cp_dtensor.core.plan.layout import shard_tensor
    from cp_dtensor.dtensor.placements import full_tensor
    from _ref import make_qkv, reference, rel_err

    q, k, v, do = make_qkv(7, 2, 4, 2, 8 * world, 16)  # [B, H, N, D], N = 8 per rank (headtail: 2 chunks of 4)
    want = reference(q, k, v, do, is_causal=True)
    if path == "dtensor":
        attn = _SDPA()

        def shard(x):
            return cp_dtensor.shard_sequence(x.float(), mesh, seq_dim=2, layout=layout)

        unshard = full_tensor
    else:
        if path == "local":
            def attn(q, k, v):
                return cp_dtensor.ring_attention(q, k, v, layout=layout, is_causal=True)
        else:
            assert path == "module", path
            attn = cp_dtensor.apply_context_parallel(_SDPA(), mesh, layout=layout)

        def shard(x):
            return shard_tensor(x.float(), seq_dim=2, layout=layout, rank=rank, cp_size=world)

        want = [shard(w).double() for w in want]
        unshard = torch.Tensor.detach
    f = torch.compile(attn, fullgraph=True)
    xs = [shard(x).requires_grad_() for x in (q, k, v)]
    out = f(*xs)
    out.backward(shard(do))
    return max(rel_err(unshard(a), b) for a, b in zip((out, *(x.grad for x in xs)), want))


def _rank(rank: int, world: int, init: str, out_dir: str, cases: list[str]) -> None:
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # the ranks already share the cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    import cp_dtensor

    mesh = init_device_mesh("cpu", (world,))
    probe = cp_dtensor.shard_sequence(torch.zeros(1, 1, 2 * world, 1), mesh, seq_dim=2)
    report = {"dtensor_cache_hash": getattr(probe, "_stable_hash_for_caching", lambda: None)()}  # None: torch 2.11
    for case in cases:
        torch._dynamo.reset()  # cases share code objects (_SDPA.forward): no guard or dynamic-shape state carries over
        counters.clear()
        err = _case(*case.split("/"), rank, world, mesh)
        seen = {**counters["inductor"], **counters["aot_autograd"]}
        report[case] = {"err": err, **{c: seen.get(c, 0) for c in _COUNTERS}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, world, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, f"file://{tmp}/rendezvous", out_dir, cases), nprocs=world,
                           start_method="fork")
