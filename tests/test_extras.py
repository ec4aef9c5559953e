"""The core runs on torch alone; each optional extra, when missing, raises an ImportError naming it.

Each case runs in a fresh interpreter whose ``sys.modules`` blocks torchtitan, torchao and transformers
(``sys.modules[name] = None`` is how Python itself marks a module that must not import), so the
installed dev stack cannot leak into it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).parents[1]
_BLOCK = "import sys\nfor _m in ('torchtitan', 'torchao', 'transformers'):\n    sys.modules[_m] = None\n"


def _run(body: str) -> subprocess.CompletedProcess:
    code = _BLOCK + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_core_features_need_no_extra():
    """ring_attention (P = 1, against the textbook float64 formula), the DTensor rule, the module path, the
    planner: with every extra blocked, and none of them imported afterwards."""
    r = _run("""
        import os, tempfile
        import torch
        import torch.distributed as dist
        import cp_dtensor
        from cp_dtensor import plan
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
        s = (q @ k.transpose(-1, -2)) / 2.0
        s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.softmax(s, -1) @ v
        out = cp_dtensor.ring_attention(q, k, v, is_causal=True)
        assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12), (out - ref).abs().max()
        mesh = init_device_mesh("cpu", (1,))
        qd, kd, vd = (cp_dtensor.shard_sequence(x, mesh, dim=2, layout="striped") for x in (q, k, v))
        od = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        assert torch.allclose(od.full_tensor(), ref, rtol=1e-12, atol=1e-12)
        plan.make_plan(plan.PlanInput(seq_len=4096, cp=2, head_dim=64, q_heads=8, kv_heads=2))
        loaded = [m for m in ("torchtitan", "torchao", "transformers") if sys.modules.get(m) is not None]
        assert not loaded, loaded
        dist.destroy_process_group()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_missing_extras_name_themselves():
    r = _run("""
        import tempfile
        import torch
        import torch.distributed as dist
        import cp_dtensor

        def fails(what, fn, extra):
            try:
                fn()
            except ImportError as e:
                assert f"pip install 'cp_dtensor[{extra}]'" in str(e), (what, e)
                print(what, "->", e)
            else:
                raise AssertionError(f"{what} did not raise ImportError")

        import importlib
        fails("cp_dtensor.titan", lambda: importlib.import_module("cp_dtensor.titan"), "titan")
        fails("cp_dtensor.hf", lambda: importlib.import_module("cp_dtensor.hf"), "hf")
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        q = torch.randn(1, 2, 8, 4)
        fails("float8 payload", lambda: cp_dtensor.ring_attention(q, q, q, comm_dtype=torch.float8_e4m3fn), "float8")
        dist.destroy_process_group()
        print("ok")
    """)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]


def test_trainer_extra_missing_leaves_the_rest_of_hf():
    """transformers installed, accelerate and trl not: cp_dtensor.hf imports and serves models; only the Trainer
    names raise, naming the trainer extra."""
    code = textwrap.dedent("""
        import sys
        for _m in ("accelerate", "trl"):
            sys.modules[_m] = None
        import cp_dtensor.hf as hf
        assert callable(hf.apply_context_parallel) and callable(hf.remove_context_parallel)
        try:
            hf.with_context_parallel
        except ImportError as e:
            assert "pip install 'cp_dtensor[trainer]'" in str(e), e
            print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]
