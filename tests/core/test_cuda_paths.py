"""The CUDA branches of kernels.py / ops.py / ring.py, run on CPU through strict stand-ins of the CUDA
attention ops: each stand-in asserts the op's input contract (Note [Kernel contracts] in kernels.py)
and computes by the textbook formula in float64. The ring's results are compared with float64
single-device attention, as everywhere else.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _cuda import StrictCuda
from _cuda import as_cuda as _as_cuda
from _cuda import stack as _stack

import cp_dtensor
import cp_dtensor.core.compute.kernels as kernels
from cp_dtensor.core.plan.layout import shard_tensor
from _dist import run_ranks
from _ref import abs_rel_err, masked_reference

_REAL = torch.ops.aten


def _ring_cases(rank, world):
    rng = random.Random(5)
    standin = StrictCuda()
    worst = {}
    with _as_cuda(standin):
        assert kernels.flash_windows(torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16))  # probed once, before the cases
        for i, (layout, (hq, hkv), dtype, masked) in enumerate(
            (lay, h, dt, m) for lay in cp_dtensor.LAYOUTS for h in ((4, 2), (4, 4), (8, 1))
            for dt in (torch.bfloat16, torch.float32) for m in (False, True)
        ):
            s, d = 8, 16
            n = s * world
            g = torch.Generator().manual_seed(i)
            dv = 8 if masked else d  # MLA-style Dv != Dqk on the masked cases
            q = torch.randn(1, hq, n, d, generator=g, dtype=torch.float64)
            k = torch.randn(1, hkv, n, d, generator=g, dtype=torch.float64)
            v = torch.randn(1, hkv, n, dv, generator=g, dtype=torch.float64)
            do = torch.randn(1, hq, n, dv, generator=g, dtype=torch.float64)
            opts = {}
            if masked:
                ids = torch.zeros(1, n, dtype=torch.int64)
                for cut in sorted(rng.sample(range(1, n), 3)):
                    ids[0, cut:] += 1
                opts = dict(document_ids=ids, window_size=(5, 0), sinks=torch.randn(hq, generator=g, dtype=torch.float64))
            causal = masked or i % 2 == 0
            want = masked_reference(q, k, v, do, is_causal=causal, **opts)

            def shard(x, dim=2):
                return shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)

            ql, kl, vl = (shard(x).to(dtype).requires_grad_() for x in (q, k, v))
            kw = {}
            if masked:
                kw = dict(document_ids=shard(opts["document_ids"], 1), window_size=(5, 0),
                          sinks=opts["sinks"].float().requires_grad_())
            standin.calls.clear()
            out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=causal, **kw)
            out.backward(shard(do).to(dtype))
            err = max(abs_rel_err(a, shard(b)) for a, b in zip((out, ql.grad, kl.grad, vl.grad), want[:4]))
            if masked:
                total = kw["sinks"].grad.clone()
                dist.all_reduce(total)
                err = max(err, abs_rel_err(total, want[4]))
            tol = 3e-2 if dtype == torch.bfloat16 else 2e-5
            assert err <= tol, (layout, hq, hkv, dtype, masked, err)
            # native GQA on flash (K/V with their own heads); efficient: one KV head's group at a time
            for name, qh, kh in standin.calls:
                if name.startswith("flash"):
                    assert (qh, kh) == (hq, hkv), (name, qh, kh)
                else:
                    assert qh == kh == hq // hkv, (name, qh, kh)
            kinds = {name.split("_")[0] for name, _, _ in standin.calls}
            if dtype == torch.float32:
                assert kinds == {"efficient"}, kinds  # no fp32 flash kernel
            elif not masked:
                assert kinds == {"flash"}, kinds
            else:  # flash for full and causal rectangles, efficient (with a bias) for window tiles
                assert kinds <= {"flash", "efficient"}, kinds
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
    return worst


def _varlen_cases(rank, world):
    """Documents and windows on CUDA flash dtypes: every step's rectangles in a few variable-length calls
    (full, causal, one per window the bands need), whatever the number of documents; on a flash build
    without windows, window tiles fall back to the memory-efficient kernel (Note [Varlen rectangles])."""
    worst = 0.0
    windows = [None, (5, 0), (2, 3), (-1, 2), (7, -1), (30, 0)]
    seen = {"windowed flash": 0, "efficient tiles": 0}
    for i, (layout, b, same, (dqk, dv), flash_windows) in enumerate(
        (lay, b, same, hd, fw) for lay in cp_dtensor.LAYOUTS for b, same in ((1, True), (2, True), (2, False))
        for hd in ((16, 16), (16, 8)) for fw in (True, False)
    ):
        standin = StrictCuda(windows=flash_windows)
        window = windows[(i // 2) % len(windows)]
        s, hq, hkv = 12, 4, 2
        n = s * world
        g = torch.Generator().manual_seed(100 + i)
        q = torch.randn(b, hq, n, dqk, generator=g, dtype=torch.float64)
        k = torch.randn(b, hkv, n, dqk, generator=g, dtype=torch.float64)
        v = torch.randn(b, hkv, n, dv, generator=g, dtype=torch.float64)
        do = torch.randn(b, hq, n, dv, generator=g, dtype=torch.float64)
        ids = torch.zeros(b, n, dtype=torch.int64)
        rng = random.Random(i)
        for row in range(b):  # 1-token documents up to ones longer than a block
            for cut in sorted(rng.sample(range(1, n), 6 if (i // 4) % 2 else 2)):
                ids[row, cut:] += 1
            if same:
                ids[row] = ids[0]
        want = masked_reference(q, k, v, do, is_causal=True, document_ids=ids, window_size=window)

        def shard(x, dim=2):
            return shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)

        ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
        with _as_cuda(standin):
            assert kernels.flash_windows(ql) == flash_windows  # the probe: one tiny windowed call
            standin.calls.clear()
            out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True, document_ids=shard(ids, 1),
                                            window_size=window)
            out.backward(shard(do).to(torch.bfloat16))
        err = max(abs_rel_err(a, shard(w)) for a, w in zip((out, ql.grad, kl.grad, vl.grad), want[:4]))
        assert err <= 3e-2, (layout, b, same, dqk, dv, window, flash_windows, err)
        worst = max(worst, err)
        names = [name for name, _, _ in standin.calls]
        assert all((qh, kh) == (hq, hkv) for name, qh, kh in standin.calls if name.startswith("flash")), standin.calls
        if flash_windows or window is None or window[0] < 0:
            assert set(names) <= {"flash_varlen", "flash_varlen_bwd"}, (window, flash_windows, names)
        else:  # window tiles, with a bias, on the memory-efficient kernel
            assert set(names) <= {"flash_varlen", "flash_varlen_bwd", "efficient", "efficient_bwd"}, (window, names)
        seen["windowed flash"] += standin.windowed
        seen["efficient tiles"] += names.count("efficient")
        rows = 1 if same else b  # batch rows with their own documents get their own calls
        varlen = [n_ for n_ in names if n_.startswith("flash_varlen")]
        assert len(varlen) <= 2 * 6 * world * rows, (window, len(varlen))  # <= 6 calls a step, fwd and bwd
    assert all(seen.values()), seen  # both window paths ran
    return worst


@pytest.mark.parametrize("world", [1, 2, 3])
def test_documents_and_windows_run_as_varlen_calls_on_cuda_flash(world):
    """Many documents per block with windows (one- and two-sided, below and above S_local), bf16, every
    layout, one or two batch rows (shared or own ids), Dv != Dqk, flash builds with and without window
    support: exact vs float64 through the varlen stand-ins."""
    run_ranks(world, _varlen_cases)


@pytest.mark.parametrize("world", [2, 3])
def test_cuda_branches_through_strict_standins_match_float64(world):
    """Every layout x GQA/MHA/MQA x bf16 (flash) / fp32 (efficient) x unmasked / masked (documents,
    window, sinks, Dv != Dqk), forward and backward, through the CUDA calls with their contracts checked."""
    run_ranks(world, _ring_cases)


def test_standin_rejects_a_strided_lse():
    """The contract the ring once broke: a slice of the ring's lse handed to the flash backward."""
    standin = StrictCuda()
    q = torch.randn(2, 4, 8, 16, dtype=torch.bfloat16)
    out, lse = standin._scaled_dot_product_flash_attention(q, q, q, 0.0, True, scale=0.25)[:2]
    with pytest.raises(AssertionError, match="lse must be contiguous"):
        standin._scaled_dot_product_flash_attention_backward(
            out[:, :, 1:], q[:, :, 1:], q[:, :, 1:], q[:, :, 1:], out[:, :, 1:], lse[:, :, 1:], None, None, 7, 7,
            0.0, True, None, None, scale=0.25,
        )
    # and kernels.kernel_bwd hands it a contiguous copy
    with _as_cuda(standin):
        kernels.kernel_bwd(out[:, :, 1:], q[:, :, 1:], q[:, :, 1:], q[:, :, 1:], out[:, :, 1:], lse[:, :, 1:], True, 0.25)


# ---------------------------------------------------------------------------------------------------
# The SDPA math path on sequence-sharded DTensors: the ring or a ValueError, never a silent all-gather.
# See Note [SDPA math path] in dtensor/sdpa.py. On CPU the math kernel is chosen by sdpa_kernel(MATH) and by
# dropout; on CUDA also by fp32 with GQA, fp64 and head sizes no fused kernel takes.


def _comm_counts(cm) -> dict[str, int]:
    return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}


def _math_cases(rank, world):
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cp_dtensor.dtensor.placements import full_tensor
    from cp_dtensor.dtensor.sharding import shard_sequence
    from _ref import make_qkv, reference, rel_err

    mesh = init_device_mesh("cpu", (world,))
    ring = {"all_to_all_single": world - 1}
    modes = {
        "math": lambda: sdpa_kernel(SDPBackend.MATH),
        "math+no_grad": lambda: _stack(sdpa_kernel(SDPBackend.MATH), torch.no_grad()),
        "inference": torch.inference_mode,
        "inference+math": lambda: _stack(sdpa_kernel(SDPBackend.MATH), torch.inference_mode()),
    }
    case = 0
    for layout in cp_dtensor.LAYOUTS:
        for mode, ctx in modes.items():
            for is_causal, scale, (hq, hkv) in ((True, None, (4, 2)), (False, 0.3, (2, 2))):
                case += 1
                q, k, v, do = make_qkv(case, 2, hq, hkv, 4 * world, 8)
                want = reference(q, k, v, do, is_causal=is_causal, scale=scale)
                grad = mode == "math"
                xs = [shard_sequence(x, mesh, seq_dim=2, layout=layout).requires_grad_(grad) for x in (q, k, v)]
                with CommDebugMode() as cm, ctx():
                    out = F.scaled_dot_product_attention(*xs, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
                assert _comm_counts(cm) == ring, (layout, mode, _comm_counts(cm))
                assert isinstance(out, DTensor) and out.placements == xs[0].placements
                got = [out]
                if grad:
                    with CommDebugMode() as cm:
                        out.backward(shard_sequence(do, mesh, seq_dim=2, layout=layout))
                    assert set(_comm_counts(cm)) == {"all_to_all_single"}, _comm_counts(cm)  # K/V + dK/dV hops
                    got += [x.grad for x in xs]
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    err = rel_err(full_tensor(a), b)
                    assert err <= 1e-12, (layout, mode, is_causal, name, err)  # float64 ring vs float64
    # calls the ring cannot run: a ValueError on every rank, before any collective
    q, k, v, _ = make_qkv(0, 1, 4, 2, 4 * world, 8)
    xs = [shard_sequence(x, mesh, seq_dim=2, layout="striped").requires_grad_() for x in (q, k, v)]
    bad = [
        ("dropout_p must be 0", contextlib.nullcontext, dict(dropout_p=0.1, enable_gqa=True)),  # math on CPU
        ("enable_gqa is False", lambda: sdpa_kernel(SDPBackend.MATH), dict(is_causal=True)),
        ("attn_mask is not supported", lambda: sdpa_kernel(SDPBackend.MATH),
         dict(attn_mask=distribute_tensor(torch.ones(4 * world, 4 * world, dtype=torch.bool), mesh, [Replicate()]),
              enable_gqa=True)),
        ("dropout_p must be 0", torch.inference_mode, dict(dropout_p=0.1, enable_gqa=True)),
    ]
    for match, ctx, kw in bad:
        with CommDebugMode() as cm, ctx(), pytest.raises(ValueError, match=match):
            F.scaled_dot_product_attention(*xs, **kw)
        assert _comm_counts(cm) == {}, (match, _comm_counts(cm))
    # not sequence-sharded: torch's composite path as before (replicated in, replicated out, no collective;
    # non-causal, as torch's causal math mask is a plain tensor that DTensor refuses to mix)
    rep = [distribute_tensor(x, mesh, [Replicate()], src_data_rank=None) for x in (q, k, v)]
    with CommDebugMode() as cm, sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*rep, enable_gqa=True)
    assert _comm_counts(cm) == {} and out.placements == (Replicate(),)
    assert rel_err(out.to_local(), reference(q, k, v, torch.zeros_like(q), is_causal=False)[0]) <= 1e-12


def test_sdpa_math_path_on_sequence_sharded_dtensors_runs_the_ring_or_raises():
    """sdpa_kernel(MATH), inference mode, no_grad, dropout, a mask, GQA without enable_gqa: every
    layout, out and grads vs float64, collectives counted (only the ring's all-to-alls, never a gather)."""
    run_ranks(2, _math_cases)


def test_math_kernel_on_plain_tensors_is_unchanged():
    """Our Autograd kernel of the math op decomposes plain tensors exactly as torch's composite does."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cp_dtensor.dtensor.sdpa as dispatch
    from _ref import make_qkv, reference, rel_err

    q, k, v, do = make_qkv(3, 2, 4, 2, 12, 8)
    want = reference(q, k, v, do, is_causal=True)
    for installed in (True, False):
        (dispatch.install_sdpa_dispatch if installed else dispatch.uninstall_sdpa_dispatch)()
        assert ("dtensor/sdpa.py" in torch._C._dispatch_dump("aten::_scaled_dot_product_attention_math")) == installed
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(*xs, is_causal=True, enable_gqa=True)
        out.backward(do)
        for a, b in zip((out, *(x.grad for x in xs)), want):
            assert rel_err(a, b) <= 1e-12
    dispatch.install_sdpa_dispatch()


# ---------------------------------------------------------------------------------------------------
# What a ring call on CUDA reads on the host: only host-made integers (the agreement fingerprint, the
# document ids), never a float tensor. See Note [Agreeing before the ring] in checks.py.


_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def _host_reads(rank, world):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Record(TorchDispatchMode):
        """Taints q, k, v, dout (device tensors on a GPU) and everything computed from them; records every
        host read (item/bool/int: _local_scalar_dense) and every collective, with whether it was tainted."""

        def __init__(self, *device_tensors):
            super().__init__()
            self.keep = list(device_tensors)  # alive, so their ids stay theirs
            self.tainted = {id(t) for t in device_tensors}
            self.reads, self.collectives = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            dirty = any(id(t) in self.tainted for t in ins)
            name = func.__name__.split(".")[0]
            if func is torch.ops.aten._local_scalar_dense.default:
                self.reads.append((args[0].dtype, dirty))
            elif func.namespace == "_c10d_functional" and name not in _NOT_COLLECTIVES:
                self.collectives.append((name, args[0].dtype, dirty))
            out = func(*args, **kwargs)
            if dirty:
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                self.keep += outs
                self.tainted |= {id(t) for t in outs}
            return out

    standin = StrictCuda()
    found = {}
    with mock.patch.multiple(kernels, aten=standin, backend=lambda x: "cuda"):
        for layout in cp_dtensor.LAYOUTS:
            for masked in (False, True):
                n, hq = 8 * world, 4
                g = torch.Generator().manual_seed(1)
                q, k, v, do = (torch.randn(1, h, n, 16, generator=g) for h in (hq, 2, 2, hq))
                shard = lambda x, dim=2: shard_tensor(x, seq_dim=dim, layout=layout, rank=rank, cp_size=world)  # noqa: E731
                ql, kl, vl = (shard(x).to(torch.bfloat16).requires_grad_() for x in (q, k, v))
                kw = {}
                if masked:
                    ids = torch.arange(n).div(5, rounding_mode="floor").unsqueeze(0)
                    # (no sinks: these are CPU tensors, and checks.py compares sinks' values only on the CPU)
                    kw = dict(document_ids=shard(ids, 1), window_size=(5, 0))
                dout = shard(do).to(torch.bfloat16)
                mode = Record(ql, kl, vl, dout)
                with mode:
                    out = cp_dtensor.ring_attention(ql, kl, vl, layout=layout, is_causal=True, **kw)
                    out.backward(dout)
                assert not any(dirty for _, dirty in mode.reads), (layout, masked, mode.reads)
                gathers = [(name, dirty) for name, _, dirty in mode.collectives if name != "all_to_all_single"]
                assert not any(dirty for _, dirty in gathers), mode.collectives  # host-made: fingerprint, ids
                assert any(dirty for name, _, dirty in mode.collectives if name == "all_to_all_single")  # K/V
                found[(layout, masked)] = (len(mode.reads), len(gathers))
    mode = Record(ql)  # the recorder itself sees a read of q's values
    with mode:
        bool((ql.float() * 2).sum() > 0)
    assert mode.reads == [(torch.bool, True)], mode.reads
    return found


def test_ring_call_reads_nothing_computed_from_qkv_on_the_host():
    """Per ring call (fwd+bwd, CUDA branches via the stand-ins), nothing computed from q, k, v or dout is
    read on the host (item/bool/int) or gathered: the agreement fingerprint and the document ids are made
    on the host; only the K/V all-to-alls carry device data."""
    found = run_ranks(2, _host_reads)[0]
    # one agreement all-gather per call, plus one of the document ids when there are documents
    assert all(gathers == (2 if masked else 1) for (_, masked), (_, gathers) in found.items()), found


def test_gqa_kv_bytes_per_kernel_call():
    """GQA (Hq 8, Hkv 2): the K/V bytes each CUDA kernel call receives, against the Hq-head expansion the
    ring once made. Flash gets K/V as they are (1/g of it, g = Hq/Hkv); the memory-efficient kernel gets
    one KV head copied for its group (1/Hkv of it), fwd and bwd."""
    sizes = []

    class Bytes(StrictCuda):
        def _common(self, name, q, k, v, dropout_p, is_causal):
            sizes.append((name, k.nbytes + v.nbytes))
            super()._common(name, q, k, v, dropout_p, is_causal)

    b, hq, hkv, s, d = 1, 8, 2, 32, 16
    for dtype, kinds, share in ((torch.bfloat16, {"flash", "flash_bwd"}, hkv / hq), (torch.float32, {"efficient", "efficient_bwd"}, 1 / hkv)):
        g = torch.Generator().manual_seed(0)
        q, do = (torch.randn(b, hq, s, d, generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(b, hkv, s, d, generator=g).to(dtype) for _ in range(2))
        expanded = 2 * b * hq * s * d * dtype.itemsize  # K and V repeated to Hq heads
        sizes.clear()
        with mock.patch.multiple(kernels, aten=Bytes(), backend=lambda x: "cuda"):
            out, lse = kernels.kernel_fwd(q, k, v, True, 0.25)
            kernels.kernel_bwd(do, q, k, v, out.contiguous(), lse, True, 0.25)
        assert {n for n, _ in sizes} == kinds
        assert max(n for _, n in sizes) == expanded * share, (dtype, sizes, expanded)


def test_float64_on_cuda_is_refused_at_validation():
    """No fused CUDA kernel takes float64: validation says so (and what to do) before any kernel runs."""
    from cp_dtensor.core.checks import local_error

    class OnCuda(torch.Tensor):  # a CPU tensor that reports a CUDA device, as validation sees it
        @property
        def device(self):
            return torch.device("cuda", 0)

    q = torch.Tensor._make_subclass(OnCuda, torch.zeros(1, 4, 8, 16, dtype=torch.float64))
    k = torch.Tensor._make_subclass(OnCuda, torch.zeros(1, 2, 8, 16, dtype=torch.float64))
    err = local_error(q, k, k, "striped", True, None)
    assert err is not None and "float64" in err and "cast q, k, v to float32" in err
    assert local_error(q.float(), k.float(), k.float(), "striped", True, None) is None


def test_standins_take_the_real_schemas():
    """Each stand-in takes exactly the positional arguments of the real CUDA op's schema (torch 2.13), and
    every keyword kernels.py passes is one of the schema's: a torch bump that moves an argument fails
    here, not silently on the first GPU."""
    import inspect

    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_flash_attention_forward", "_flash_attention_backward",
    ):
        schema = getattr(_REAL, name).default._schema
        positional = [a.name for a in schema.arguments if not a.kwarg_only]
        keywords = {a.name for a in schema.arguments if a.kwarg_only}
        params = list(inspect.signature(getattr(StrictCuda, name)).parameters.values())[1:]  # past self
        mine_pos = [p for p in params if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        mine_kw = {p.name for p in params if p.kind == inspect.Parameter.KEYWORD_ONLY}
        assert len(mine_pos) == len(positional), (name, [p.name for p in mine_pos], positional)
        assert mine_kw <= keywords, (name, mine_kw - keywords)
