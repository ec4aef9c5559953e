"""cp_dtensor/_compat/__init__.py: the private torch symbols it touches still exist on every torch the project claims
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
_NEW_TORCH = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
_TORCH_ROWS = ([(*row, True) for row in _compat.PRIVATE_SYMBOLS_SINCE_2_13]
               + [(*row, False) for row in _compat.PRIVATE_SYMBOLS_BEFORE_2_13])


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


@pytest.mark.parametrize(("module", "qualname", "params", "since_2_13"), _TORCH_ROWS,
                         ids=[f"{m}.{q}" for m, q, _, _ in _TORCH_ROWS])
def test_version_specific_symbol_still_there(module, qualname, params, since_2_13):
    """The torch names of one side of 2.13 (Note [torch 2.11 to 2.15]): checked on that side."""
    if since_2_13 != _NEW_TORCH:
        pytest.skip(f"a torch {'>=' if since_2_13 else '<'} 2.13 row; this is torch {torch.__version__}")
    test_private_symbol_still_there(module, qualname, params, None)


def test_strided_offset_mode_reads_both_signatures():
    """HeadTail's override answers torch 2.11's ``return_first_offset`` and 2.13's ``offset_mode`` alike."""
    from cp_dtensor.dtensor.placements import HeadTail

    mode = _compat._StridedShardOffsetMode
    assert _compat.strided_offset_mode() is mode.FIRST
    assert _compat.strided_offset_mode(offset_mode=mode.ALL) is mode.ALL
    assert _compat.strided_offset_mode(return_first_offset=False) is mode.ALL
    assert _compat.strided_offset_mode(return_first_offset=True) is mode.FIRST
    positional = (True, mode.FIRST) if _compat.STRIDED_OFFSET_PARAM == "return_first_offset" else (mode.ALL, mode.ALL)
    assert _compat.strided_offset_mode(positional[0]) is positional[1]
    ht = HeadTail(0)  # rank 1 of 2 over 8 positions holds chunks 1 and 2 of 4: positions 2, 3, 4, 5
    assert ht.local_shard_size_and_offset(8, 2, 1) == (4, 2)
    assert ht._local_shard_size_and_offset(8, 2, 1, **{_compat.STRIDED_OFFSET_PARAM: mode.ALL
                                                         if _NEW_TORCH else False}) == (4, [2, 3, 4, 5])


def _waited(t):  # an AsyncCollectiveTensor's data (eager funcol), else t
    return t.wait() if hasattr(t, "wait") else t


def _collectives(rank, world):
    x = torch.arange(4.0).view(2, 2) + 10 * rank  # [2, 2] per rank
    g = torch.distributed.group.WORLD
    x.requires_grad_()
    every = _compat.all_gather_single_autograd(x, 1, g)  # [2, 2 * world]
    (every * torch.arange(2.0 * world)).sum().backward()
    plain = _compat.all_gather_single(x.detach().t(), 0, g)  # a non-contiguous input: 2.11 needs it made so
    summed = _compat.reduce_scatter_single(torch.ones(2 * world, 3), "sum", 0, g)
    return [t.tolist() for t in (_waited(every).detach(), _waited(plain), _waited(summed), x.grad)]  # lists pickle


def test_collectives_on_every_torch():
    """all_gather_single (+ autograd) and reduce_scatter_single through _compat: equal to the formula."""
    world = 2
    outs = run_ranks(world, _collectives)
    xs = [torch.arange(4.0).view(2, 2) + 10 * r for r in range(world)]
    for rank, got in enumerate(outs):
        every, plain, summed, grad = map(torch.tensor, got)
        assert torch.equal(every, torch.cat(xs, 1)) and torch.equal(plain, torch.cat([x.t() for x in xs], 0))
        assert torch.equal(summed, torch.full((2, 3), float(world)))
        # d/dx of sum(every * w): every rank's gather multiplies its columns by w; summed over the world ranks
        assert torch.equal(grad, world * torch.arange(2.0 * world).view(world, 2)[rank].expand(2, 2))


class _Doubles(torch.autograd.Function):
    """An autograd.Function whose output is an intermediate under two traced names (a no-op ``.to``)."""

    @staticmethod
    def forward(ctx, x, fix: bool):
        y = x * 2
        out = y.to(torch.float32)  # y itself for fp32 x
        return _compat.function_output(out) if fix else out

    @staticmethod
    def backward(ctx, g):
        return 2 * g, None


def _compiled_grads(rank, world):
    x = torch.randn(4, requires_grad=True)
    grads = []
    for fix in (True, False):
        x.grad = None
        torch._dynamo.reset()
        torch.compile(lambda t, fix=fix: _Doubles.apply(t, fix), backend="eager", fullgraph=True)(x).sum().backward()
        grads.append(x.grad.tolist())
    return grads


def test_function_output_keeps_the_gradient_under_compile():
    """Note [torch 2.11 to 2.15]: compiled, such a Function's gradient is 0 on torch 2.11 unless its output
    goes through ``function_output`` (the ring and the document exchange do); on 2.13+ it is right either way.
    (In a forked rank: autograd in pytest's own process would break the forks of later tests.)"""
    fixed, plain = run_ranks(1, _compiled_grads)[0]
    assert fixed == [2.0] * 4, fixed
    # without the copy: right on 2.13+; on 2.11 the torch bug itself (if it passes there, the bound can move)
    assert plain == ([2.0] * 4 if _NEW_TORCH else [0.0] * 4), plain


def test_cache_key_patch_installed():
    from torch.distributed.device_mesh import DeviceMesh

    if not _NEW_TORCH:
        pytest.skip("torch 2.11 has no DeviceMesh._stable_hash to key by (install_sdpa_dispatch warns there)")
    cp_dtensor.install_sdpa_dispatch()  # the work-around comes with the dispatch that needs it
    assert DeviceMesh._stable_hash is _compat._stable_hash_with_coordinate, "the cache-key patch is not installed"


def _hashes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    x = cp_dtensor.shard_sequence(torch.zeros(1, 1, 2 * world, 1), mesh, seq_dim=2, layout="headtail")
    return mesh._stable_hash(), init_device_mesh("cpu", (world,))._stable_hash(), x._stable_hash_for_caching()


def test_dtensor_cache_hash_names_the_rank():
    """The hash AOTAutograd's cache keys a DTensor graph input by: stable for one rank, different per rank."""
    if not _NEW_TORCH:
        pytest.skip("torch 2.11 has no DeviceMesh._stable_hash (Note [Rank-specialised compiled graphs])")
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


def test_titan_cpu_permute_indices_loads_without_triton():
    # torchtitan's own CPU token permutation for expert parallelism (Note [torchtitan on CPU] 1): loadable with no
    # triton installed, and no triton left behind; checked against the layout its docstring gives
    import sys

    have = titan_version()
    if have is None or have[:2] != (0, 2):
        pytest.skip("a torchtitan 0.2 row")
    import cp_dtensor.titan  # noqa: F401
    from cp_dtensor._compat import titan_cpu_permute_indices

    counts = torch.tensor([4, 2, 1, 3, 1, 2, 3, 4])  # from rank r to local expert e: [r * 4 + e]
    indices, sizes, offsets = titan_cpu_permute_indices()(counts, 4, 2, 64, 8)
    assert "triton" not in sys.modules and sizes.tolist() == [8, 8, 8, 8] and offsets.tolist() == [8, 16, 24, 32]
    start = torch.cumsum(counts, 0) - counts
    for e in range(4):  # expert e's rows: rank 0's tokens, then rank 1's, then padding (-1)
        want = [*range(start[e], start[e] + counts[e]), *range(start[4 + e], start[4 + e] + counts[4 + e])]
        assert indices[8 * e: 8 * e + len(want)].tolist() == want and (indices[8 * e + len(want): 8 * e + 8] == -1).all()
