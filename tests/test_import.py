"""Importing cp_dtensor changes nothing; once installed, the SDPA rule acts on sequence-sharded DTensors only.

Each check compares with torch on its own: a fresh interpreter before the import, or the same call with
the dispatch uninstalled (Note [SDPA dispatch] in dtensor/sdpa.py).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _tiers import exhaustive
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from _dist import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout


_STATE = """
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torch.distributed.tensor import _redistribute
from torch.distributed.tensor._ops import _math_ops

def state():  # (torch 2.11 has no DeviceMesh._stable_hash: None there)
    prop = DTensor._op_dispatcher.sharding_propagator
    return (dict(DTensor._op_dispatcher._custom_op_handlers), getattr(DeviceMesh, "_stable_hash", None),
            prop.propagate_op_sharding_non_cached, prop.propagate_op_sharding,
            torch._C._dispatch_dump("aten::_scaled_dot_product_attention_math"),
            _redistribute._gen_transform_infos_non_cached, _math_ops.replicate_reduction_dims)
"""


def test_import_patches_nothing():
    """A fresh interpreter: ``import cp_dtensor`` (and touching a public name) leaves DTensor's handler
    table, DeviceMesh._stable_hash, the sharding propagator, the math SDPA op's kernels and the two rules torch
    2.11 gets from the first strided placement (Note [torch 2.11 to 2.15]) as they were."""
    code = _STATE + """
before = state()
import cp_dtensor
cp_dtensor.ring_attention, cp_dtensor.LAYOUTS, cp_dtensor.apply_context_parallel
after = state()
print(all(a is b or a == b for a, b in zip(before, after)))
cp_dtensor.install_sdpa_dispatch()
installed = state()
cp_dtensor.uninstall_sdpa_dispatch()
undone = state()
print(installed[0] != before[0], installed[4] != before[4], installed[1] is not before[1] or before[1] is None)
print(undone[0] == before[0], undone[4] == before[4], undone[1] is before[1])
"""
    assert _python(code).split() == ["True"] * 7


def test_import_alone_imports_no_torch():
    assert _python("import sys, cp_dtensor; print('torch' in sys.modules, len(cp_dtensor.__all__) > 20)").split() == [
        "False", "True"]


def test_plan_cli_starts_without_torch():
    """The real entry point, ``python -m cp_dtensor.tools.cli plan``: its output, and no torch module imported."""
    args = ["plan", "--seq-len", "64k", "--head-dim", "128", "--heads", "32", "--kv-heads", "8", "--cp", "4", "--json"]
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "cp_dtensor.tools.cli", *args], capture_output=True,
                          text=True, check=True, cwd=ROOT)
    assert json.loads(done.stdout)["input"]["cp"] == 4
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert "cp_dtensor" in imported and "cp_dtensor.tools.plan" in imported  # (tools/cli.py runs as __main__)
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")], "the plan CLI imported torch"


def test_plain_sdpa_identical_with_the_dispatch_installed():
    """Plain tensors: fwd + bwd bit-identical with and without the import and the installation, on the
    default and the math backend (the installation puts a Python kernel on the math op's Autograd keys)."""
    code = """
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.manual_seed(0)
q, k, v, do = (torch.randn(2, 4, 16, 8) for _ in range(4))

def run():
    res = []
    for backends in ([SDPBackend.MATH], [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        for gqa in (False, True):
            x = [t.clone().requires_grad_() for t in (q, k[:, :2] if gqa else k, v[:, :2] if gqa else v)]
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=gqa)
            out.backward(do)
            res += [out.detach(), *(t.grad for t in x)]
            with torch.inference_mode(), sdpa_kernel(backends):
                res.append(F.scaled_dot_product_attention(*x, is_causal=True, enable_gqa=gqa))
    return res

before = run()
import cp_dtensor
imported = run()
cp_dtensor.install_sdpa_dispatch()
installed = run()
print(all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(before, imported, installed)))
"""
    assert _python(code).strip() == "True"


def _outcome(fn):
    """Placements and full values, or the error: what a caller of SDPA sees."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 -- compared as they are
        return type(e).__name__, str(e).split("\n")[0]
    assert isinstance(out, DTensor)
    return "ok", tuple(map(str, out.placements)), out.full_tensor()


def _non_sequence(rank, world, placements):
    import cp_dtensor.dtensor.sdpa as dispatch

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 4, generator=g) for _ in range(3))
    modes = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    backends = {"default": contextlib.nullcontext, "math": lambda: sdpa_kernel([SDPBackend.MATH])}
    cases = []
    for placement in placements:
        for mode in modes:
            for backend in backends:
                for causal in (False, True):
                    cases.append((f"{placement} causal={causal}", mode, backend, placement, causal))

    def run():
        res = []
        for _, mode, backend, placement, causal in cases:
            x = [distribute_tensor(t, mesh, [placement]) for t in (q, k, v)]
            with modes[mode](), backends[backend]():
                res.append(_outcome(lambda x=x, c=causal: F.scaled_dot_product_attention(*x, is_causal=c)))
        return res

    dispatch.uninstall_sdpa_dispatch()
    torch_own = run()
    dispatch.install_sdpa_dispatch()
    ours = run()
    differ = []
    for (p, mode, backend, _, _), a, b in zip(cases, torch_own, ours):
        same = a[:2] == b[:2] and (a[0] != "ok" or (a[1] == b[1] and torch.equal(a[2], b[2])))
        if not same:
            differ.append(f"{p} {mode} {backend}: torch {a[:2]}, installed {b[:2]}")
    assert not differ, "\n".join(differ)
    return sum(a[0] == "ok" for a in torch_own)


_PLACEMENTS = {"Replicate": Replicate(), "Shard(0)": Shard(0), "Shard(1)": Shard(1), "Shard(3)": Shard(3)}


# torch's own sharding propagation of the CPU flash op on sharded DTensors goes through the op's
# decomposition (torch 2.13): up to minutes of CPU per placement and mode on 2 cores, with or without the
# dispatch installed. The default tier keeps Replicate; the sharded placements are exhaustive-tier.
@pytest.mark.parametrize("placements", [pytest.param(("Replicate",), id="replicate"),
                                        pytest.param(("Shard(0)", "Shard(1)", "Shard(3)"), id="sharded", marks=exhaustive(
                                            "torch's own propagation: minutes on 2 CPU cores"))])
def test_non_sequence_dtensors_get_torch_own_sdpa(placements, world=2):
    """Replicate, Shard(0), Shard(1), Shard(3) DTensors; normal, no_grad, inference_mode; default and
    math backends: with the dispatch installed, the placements and values torch gives without it."""
    ok = run_ranks(world, _non_sequence, [_PLACEMENTS[p] for p in placements])
    assert ok[0] > 0  # torch runs some of them (others it refuses alike)


def test_no_torchao_import_noise():
    """cp_dtensor's imports of torchao (the float8 payload; transformers' quantizers under cp_dtensor.hf and
    the Trainer glue) print none of torchao's "Failed to load ..._C_*.so" or torch's pytree-Enum lines on a
    CPU machine, and leave the loggers' levels as they were (Note [torchao's import noise])."""
    pytest.importorskip("torchao")
    pytest.importorskip("trl")
    code = """
import logging
import torch
import cp_dtensor.hf
from cp_dtensor.hf import with_context_parallel
from cp_dtensor.core.exchange.payload import encode_kv
k = torch.randn(1, 1, 4, 8)
encode_kv(k, k, torch.float8_e4m3fn)
print(logging.getLogger("torchao").level, logging.getLogger("torch.utils._pytree").level)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "0"]
    assert "Failed to load" not in done.stderr and "register_constant" not in done.stderr, done.stderr[-3000:]
