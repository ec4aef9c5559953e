"""cp_dtensor/_compat.py: the private torch symbols it touches still exist on every torch the project claims
(this file runs in both CI legs), and its patches do what they say."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

import cp_dtensor
from cp_dtensor import _compat
from _dist import run_ranks
from _titan_run import titan_version


def _resolve(module: str, qualname: str):
    obj = torch.ops._c10d_functional if module == "torch.ops._c10d_functional" else importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


_ROWS = [(*row, (0, 2)) for row in _compat.PRIVATE_SYMBOLS] + [(*row, (0, 3)) for row in _compat.TITAN03_PRIVATE_SYMBOLS]


@pytest.mark.parametrize(("module", "qualname", "params", "titan"), _ROWS,
                         ids=[f"{m}.{q}" + (f"[titan{t[0]}.{t[1]}]" if m.startswith("torchtitan") else "")
                              for m, q, _, t in _ROWS])
def test_private_symbol_still_there(module, qualname, params, titan):
    """If this fails after a torch / torchtitan upgrade, revisit the code _compat.py names for the symbol
    (written against torch _compat.TORCH_VERSION, torchtitan _compat.TORCHTITAN_VERSION / TORCHTITAN03_VERSION)."""
    if module.startswith("torchtitan"):
        have = titan_version()
        if have is None:
            pytest.skip("torchtitan is not installed (the [titan] extra): its rows run in the dev leg")
        if have[:2] != titan:
            pytest.skip(f"a torchtitan {titan[0]}.{titan[1]} row; this environment has torchtitan {have[0]}.{have[1]}")
        import cp_dtensor.titan  # noqa: F401  (the triton stand-in, before torchtitan's modules import)

    try:
        obj = _resolve(module, qualname)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{module}.{qualname} is gone in torch {torch.__version__} / torchtitan: {e}")
    if params is not None:
        got = tuple(inspect.signature(obj).parameters)
        assert got[: len(params)] == params, f"{module}.{qualname}{got}: cp_dtensor relies on {params}"


def test_cache_key_patch_installed():
    from torch.distributed.device_mesh import DeviceMesh

    cp_dtensor.install_sdpa_dispatch()  # the work-around comes with the dispatch that needs it
    assert DeviceMesh._stable_hash is _compat._stable_hash_with_coordinate, "the cache-key patch is not installed"


def _hashes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = cp_dtensor.shard_sequence(torch.zeros(1, 1, 2 * world, 1), mesh, seq_dim=2, layout="headtail")
    return mesh._stable_hash(), init_device_mesh("cpu", (world,))._stable_hash(), x._stable_hash_for_caching()


def test_dtensor_cache_hash_names_the_rank():
    """The hash AOTAutograd's cache keys a DTensor graph input by: stable for one rank, different per rank."""
    hashes = run_ranks(2, _hashes)
    for mesh_hash, same_mesh_again, _ in hashes:
        assert mesh_hash == same_mesh_again
    assert len({h[0] for h in hashes}) == 2 and len({h[2] for h in hashes}) == 2, hashes


def test_running_torch_is_a_claimed_one():
    """The torch under test is one _compat.TORCH_VERSIONS names, and pyproject.toml admits exactly those."""
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert major_minor in _compat.TORCH_VERSIONS, (torch.__version__, _compat.TORCH_VERSIONS)
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    lo, hi = re.search(r'"torch>=([0-9.]+),<([0-9.]+)"', pyproject).groups()
    minors = [int(v.split(".")[1]) for v in _compat.TORCH_VERSIONS]
    assert (lo, hi) == (_compat.TORCH_VERSIONS[0], f"2.{max(minors) + 1}"), (lo, hi, _compat.TORCH_VERSIONS)


@pytest.mark.parametrize(("module", "qualname", "params"), _compat.TITAN03_QWEN35_SYMBOLS,
                         ids=[f"{m}.{q}" for m, q, _ in _compat.TITAN03_QWEN35_SYMBOLS])
def test_qwen3_5_symbol_still_there(module, qualname, params):
    """torchtitan 0.3's qwen3_5, which the plugin changes per layer (Note [qwen3_5 under the 0.3 plugin])."""
    have = titan_version()
    if have is None or have[:2] != (0, 3):
        pytest.skip("a torchtitan 0.3 row")
    from importlib.util import find_spec

    if find_spec("fla") is None:
        pytest.skip("torchtitan's qwen3_5 imports fla (flash-linear-attention), not installed here")
    import cp_dtensor.titan  # noqa: F401

    obj = _resolve(module, qualname)
    assert tuple(inspect.signature(obj).parameters)[: len(params)] == params, f"{module}.{qualname}"


@pytest.mark.parametrize(("module", "qualname", "params"), _compat.TRANSFORMERS_PRIVATE_SYMBOLS,
                         ids=[f"{m}.{q}" for m, q, _ in _compat.TRANSFORMERS_PRIVATE_SYMBOLS])
def test_transformers_symbol_still_there(module, qualname, params):
    """transformers' generate() internals hf_generate.py relies on (through _compat), written against
    _compat.TRANSFORMERS_VERSION."""
    pytest.importorskip("transformers")
    obj = _resolve(module, qualname)
    assert tuple(inspect.signature(obj).parameters)[: len(params)] == params, f"{module}.{qualname}"


def test_multi_head_attention_forward_calls_sdpa_by_global_name():
    """Note [SDPA inside multi_head_attention_forward]: ``with_sdpa`` rebinds the global name the function
    calls SDPA by; if torch stops calling it that way, nn.MultiheadAttention under CP must be revisited."""
    import torch.nn.functional as F

    fn = F.multi_head_attention_forward
    assert fn.__globals__ is vars(F) and "scaled_dot_product_attention" in fn.__code__.co_names
    seen = []
    q = torch.randn(3, 1, 4)  # [S, B, E]
    w, b = torch.randn(12, 4), torch.zeros(12)
    args = (q, q, q, 4, 2, w, b, None, None, False, 0.0, torch.randn(4, 4), None)
    want = fn(*args, need_weights=False)
    got = _compat.with_sdpa(fn, lambda *a, **k: seen.append(1) or F.scaled_dot_product_attention(*a, **k))(
        *args, need_weights=False)
    assert seen == [1] and torch.equal(got[0], want[0])


@pytest.mark.parametrize(("module", "qualname", "params"), _compat.TRAINER_PRIVATE_SYMBOLS,
                         ids=[f"{m}.{q}" for m, q, _ in _compat.TRAINER_PRIVATE_SYMBOLS])
def test_trainer_symbol_still_there(module, qualname, params):
    """accelerate and transformers names hf/trainer.py relies on (Note [The Trainer under CP]); the [trainer] extra."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    try:
        obj = _resolve(module, qualname)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{module}.{qualname} is gone: {e}")
    if params is not None:
        got = tuple(inspect.signature(obj).parameters)
        assert got[: len(params)] == params, f"{module}.{qualname}{got}: cp_dtensor relies on {params}"


def test_accelerate_state_holds_the_device_mesh():
    """replica_dataloaders sets AcceleratorState.device_mesh, which Accelerator.torch_device_mesh reads."""
    accelerate = pytest.importorskip("accelerate")
    assert "self.device_mesh" in inspect.getsource(accelerate.state.AcceleratorState.__init__)
    assert "self.state.device_mesh" in inspect.getsource(accelerate.Accelerator.torch_device_mesh.fget)
