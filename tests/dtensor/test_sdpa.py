"""F.scaled_dot_product_attention on sequence-sharded DTensors vs float64 single-device attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import cp_dtensor.dtensor.sdpa as dispatch
from cp_dtensor.dtensor.placements import full_tensor, sequence_placement
from cp_dtensor.dtensor.sharding import shard_sequence
from _dist import run_ranks
from _ref import make_qkv, reference, rel_err

LAYOUTS = ("striped", "headtail", "contiguous")
TOL = 1e-5  # fp32 against float64, relative to the largest magnitude


def _comm(cm: CommDebugMode) -> dict[str, int]:
    return {str(k).split(".")[-1].rstrip("')"): v for k, v in cm.get_comm_counts().items()}


def _check_sdpa(rank: int, world: int) -> None:
    dispatch.install_sdpa_dispatch()
    mesh = init_device_mesh("cpu", (world,))
    case = 0
    for layout in LAYOUTS:
        for is_causal, scale, (hq, hkv) in ((True, None, (4, 2)), (False, 0.3, (4, 2)), (True, 0.5, (2, 2))):
            case += 1
            q, k, v, do = make_qkv(case, 2, hq, hkv, 4 * world, 8)
            want = reference(q, k, v, do, is_causal=is_causal, scale=scale)
            dq, dk, dv = (shard_sequence(x.float(), mesh, seq_dim=2, layout=layout).requires_grad_() for x in (q, k, v))
            with CommDebugMode() as cm:
                out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=is_causal, scale=scale,
                                                     enable_gqa=hq != hkv)
            # the ring: P - 1 K/V rotations, nothing gathered
            assert _comm(cm) == ({"all_to_all_single": world - 1} if world > 1 else {}), _comm(cm)
            assert isinstance(out, DTensor) and out.placements == dq.placements
            if case % 2:  # grad_out in the layout
                out.backward(shard_sequence(do.float(), mesh, seq_dim=2, layout=layout))
            else:  # grad_out arrives replicated and must be resharded
                (out * distribute_tensor(do.float(), mesh, [Replicate()])).sum().backward()
            for x in (dq, dk, dv):
                assert isinstance(x.grad, DTensor) and x.grad.placements == dq.placements
            got = (out, dq.grad, dk.grad, dv.grad)
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                err = rel_err(full_tensor(a), b)
                assert err <= TOL, f"{layout} causal={is_causal} {name}: rel err {err:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_sdpa_matches_reference(world):
    run_ranks(world, _check_sdpa)


def _check_2d(rank: int, world: int) -> None:
    dispatch.install_sdpa_dispatch()
    cp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    dp_cp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    n = 16
    for i, layout in enumerate(LAYOUTS * 2):
        q, k, v, do = make_qkv(10 + i, 2, 4, 2, n, 8)
        want = reference(q, k, v, do, is_causal=True)
        seq = sequence_placement(2, layout=layout, seq_len=n, cp_size=2)
        # heads on tp, or batch on dp with CP on the second mesh dim
        mesh, placements = (cp_tp, [seq, Shard(1)]) if i < len(LAYOUTS) else (dp_cp, [Shard(0), seq])
        dq, dk, dv = (distribute_tensor(x.float(), mesh, [Replicate(), Replicate()]).redistribute(mesh, placements)
                      .detach().requires_grad_() for x in (q, k, v))
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, enable_gqa=True)
        assert out.placements == dq.placements
        out.backward(distribute_tensor(do.float(), mesh, [Replicate(), Replicate()]).redistribute(mesh, placements))
        for name, a, b in zip(("out", "dq", "dk", "dv"), (out, dq.grad, dk.grad, dv.grad), want):
            assert a.placements == dq.placements, name
            assert rel_err(full_tensor(a), b) <= TOL, f"{layout} {name}"


def test_2d_mesh_cp_and_tp():
    run_ranks(4, _check_2d)


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001 -- we compare whatever happens
        return type(e).__name__, str(e)


def _check_errors(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    q, k, v, _ = make_qkv(0, 1, 2, 2, 8, 4)
    dq, dk, dv = (shard_sequence(x.float(), mesh, seq_dim=2, layout="striped") for x in (q, k, v))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    dmask = distribute_tensor(mask, mesh, [Replicate()])
    dk_contiguous = dk.redistribute(mesh, [Shard(2)])
    aten = torch.ops.aten
    # SDPA calls that are not sequence-sharded behave exactly as without cp_dtensor
    plain = [distribute_tensor(x.float(), mesh, [Replicate()]) for x in (q, k, v)]
    heads = [distribute_tensor(x.float(), mesh, [Shard(1)]) for x in (q, k, v)]
    dispatch.uninstall_sdpa_dispatch()
    before = [_outcome(lambda xs=xs: F.scaled_dot_product_attention(*xs, is_causal=True)) for xs in (plain, heads)]
    dispatch.install_sdpa_dispatch()
    after = [_outcome(lambda xs=xs: F.scaled_dot_product_attention(*xs, is_causal=True)) for xs in (plain, heads)]
    assert [b[0] for b in before] == [a[0] for a in after] and all(
        b[0] != "ok" and b[1] == a[1] for b, a in zip(before, after)), (before, after)
    # mask, dropout, mixed layouts: a clear error on every rank, before any communication
    bad = {
        "attn_mask": lambda: F.scaled_dot_product_attention(dq, dk, dv, attn_mask=mask),
        "attn_mask (DTensor)": lambda: F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dmask),
        "dropout_p": lambda: aten._scaled_dot_product_flash_attention_for_cpu(dq, dk, dv, 0.1, True),
        "one layout": lambda: F.scaled_dot_product_attention(dq, dk_contiguous, dv, is_causal=True),
    }
    for name, call in bad.items():
        with CommDebugMode() as cm:
            with pytest.raises(ValueError, match=name.split(" ")[0]):
                call()
        assert cm.get_total_counts() == 0, name


def test_unsupported_calls():
    run_ranks(2, _check_errors)


def _check_cuda_ops(rank: int, world: int) -> None:
    # The CUDA kernels' aten ops with CPU DTensors: DTensor dispatch reaches our handlers before any
    # kernel, so their argument handling (forward and the autograd-called backward) runs here too.
    aten = torch.ops.aten
    mesh = init_device_mesh("cpu", (world,))
    q, k, v, do = make_qkv(7, 2, 4, 2, 16, 8)
    want = reference(q, k, v, do, is_causal=True, scale=0.4)
    calls = {
        "flash": lambda q, k, v, p=0.0: aten._scaled_dot_product_flash_attention(q, k, v, p, True, scale=0.4),
        "efficient": lambda q, k, v, p=0.0: aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, p, True, scale=0.4),
        "cudnn": lambda q, k, v, p=0.0: aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, p, True, scale=0.4),
    }
    for name, call in calls.items():
        for layout in LAYOUTS:
            dq, dk, dv = (shard_sequence(x.float(), mesh, seq_dim=2, layout=layout).requires_grad_() for x in (q, k, v))
            out = call(dq, dk, dv)[0]
            out.backward(shard_sequence(do.float(), mesh, seq_dim=2, layout=layout))
            for what, a, b in zip(("out", "dq", "dk", "dv"), (out, dq.grad, dk.grad, dv.grad), want):
                assert a.placements == dq.placements
                assert rel_err(full_tensor(a), b) <= TOL, f"{name} {layout} {what}"
        with CommDebugMode() as cm, pytest.raises(ValueError, match="dropout_p"):
            call(dq, dk, dv, 0.1)
        assert cm.get_total_counts() == 0


def test_cuda_op_handlers():
    run_ranks(2, _check_cuda_ops)
