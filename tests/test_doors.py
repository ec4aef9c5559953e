"""The ring's options reach every door (issue 41): ``comm_dtype`` and ``kv_exchange`` through
``cp_dtensor.apply_context_parallel``, ``cp_dtensor.hf.apply_context_parallel`` and the DTensor SDPA rule
(``cp_dtensor.sdpa_options``). Each door's output against float64 attention on the full sequence, and the
bytes it sent (``CommBytes``) against the formula: the all-gather exchange gathers K/V instead of rotating
them, and a bfloat16 payload of float32 K/V is half the bytes. Bad options raise at the door. One spawn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import cp_dtensor
from cp_dtensor import _extras
from cp_dtensor.tools.debug import CommBytes
from _dist import run_ranks
from _ref import make_qkv, reference, rel_err

B, HQ, HKV, D = 1, 4, 2, 8
OPTIONS = [(None, "ring"), (None, "allgather"), (torch.bfloat16, "ring")]


class _Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _kv_bytes(world: int, n: int, itemsize: int) -> int:
    """What a rank sends of K and V in one forward, either exchange: its shard to each of the P - 1 others."""
    return (world - 1) * 2 * B * HKV * (n // world) * D * itemsize


def _check(where: str, got: torch.Tensor, want: torch.Tensor, sent: CommBytes, world: int, n: int,
           comm_dtype, kv_exchange) -> None:
    tol = 2e-5 if comm_dtype is None else 2e-2  # bf16 K/V on the wire: its rounding
    assert rel_err(got, want) <= tol, f"{where} {comm_dtype} {kv_exchange}: {rel_err(got, want):.2e}"
    gathered = sent.by_op.get("all_gather_into_tensor", 0)
    rotated = sent.sent - gathered
    itemsize = 4 if comm_dtype is None else 2
    if kv_exchange == "allgather":
        assert gathered >= _kv_bytes(world, n, itemsize), (where, dict(sent.by_op))
    else:  # the ring: K/V rotate; an all-gather, if any, is the small agreement only
        assert gathered < _kv_bytes(world, n, 1) and rotated >= _kv_bytes(world, n, itemsize), (where, dict(sent.by_op))
        assert rotated < _kv_bytes(world, n, itemsize) + _kv_bytes(world, n, 1), (where, dict(sent.by_op))


def _model_door(mesh, q, k, v, want) -> None:
    rank, world = mesh.get_local_rank(), mesh.size()
    n = q.shape[2]
    shards = [cp_dtensor.shard_tensor(x.float(), seq_dim=2, layout="striped", rank=rank, cp_size=world) for x in (q, k, v)]
    for comm_dtype, kv_exchange in OPTIONS:
        model = cp_dtensor.apply_context_parallel(_Attention(), mesh, comm_dtype=comm_dtype, kv_exchange=kv_exchange)
        with CommBytes() as sent:
            out = model(*shards)
        got = cp_dtensor.unshard_batch(out, mesh, seq_dim=2)
        _check("apply_context_parallel", got, want, sent, world, n, comm_dtype, kv_exchange)
    with pytest.raises(ValueError, match="kv_exchange"):
        cp_dtensor.apply_context_parallel(_Attention(), mesh, kv_exchange="alltoall")
    with pytest.raises(ValueError, match="comm_dtype"):
        cp_dtensor.apply_context_parallel(_Attention(), mesh, comm_dtype=torch.int8)


def _dtensor_door(mesh, q, k, v, want) -> None:
    # the ring's collectives run inside DTensor's dispatch, where CommBytes (a dispatch mode) does not see
    # them: CommDebugMode counts them, and the bf16 payload shows in the output's rounding
    from torch.distributed.tensor.debug import CommDebugMode

    dq, dk, dv = (cp_dtensor.shard_sequence(x.float(), mesh, seq_dim=2, layout="striped") for x in (q, k, v))
    counts, errors = {}, {}
    for comm_dtype, kv_exchange in OPTIONS:
        with cp_dtensor.sdpa_options(comm_dtype=comm_dtype, kv_exchange=kv_exchange), CommDebugMode() as cm:
            out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, enable_gqa=True)
        counts[comm_dtype, kv_exchange] = {str(op).split(".")[-1]: c for op, c in cm.get_comm_counts().items()}
        errors[comm_dtype, kv_exchange] = rel_err(out.full_tensor(), want)
    assert errors[None, "ring"] <= 2e-5 and errors[None, "allgather"] <= 2e-5, errors
    assert 1e-4 < errors[torch.bfloat16, "ring"] <= 2e-2, errors  # K/V went as bf16
    assert counts[None, "allgather"].get("all_gather_into_tensor", 0) >= 1, counts
    assert counts[None, "ring"].get("all_gather_into_tensor", 0) == 0, counts
    with pytest.raises(ValueError, match="kv_exchange"):
        with cp_dtensor.sdpa_options(kv_exchange="alltoall"):
            pass


def _hf_door(mesh) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from cp_dtensor.hf import apply_context_parallel

    world = mesh.size()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=HQ,
                      num_key_value_heads=HKV, attn_implementation="sdpa")
    plain = LlamaForCausalLM(cfg).double()
    tokens = torch.randint(0, 64, (1, 16))
    want = plain(input_ids=tokens, use_cache=False).logits  # [1, N, V] float64, without CP
    for comm_dtype, kv_exchange in OPTIONS:
        model = LlamaForCausalLM(cfg)
        model.load_state_dict(plain.state_dict())
        model = apply_context_parallel(model, mesh, comm_dtype=comm_dtype, kv_exchange=kv_exchange)
        tok, pos = cp_dtensor.shard_batch((tokens, torch.arange(16)[None]), mesh)
        with CommBytes() as sent:
            logits = model(input_ids=tok, position_ids=pos, use_cache=False).logits
        got = cp_dtensor.unshard_batch(logits, mesh)
        tol = 1e-4 if comm_dtype is None else 3e-2
        assert rel_err(got, want) <= tol, f"hf {comm_dtype} {kv_exchange}: {rel_err(got, want):.2e}"
        gathered = sent.by_op.get("all_gather_into_tensor", 0)
        kv = _kv_bytes(world, 16, 4 if comm_dtype is None else 2) * cfg.num_hidden_layers  # head_dim 32 / 4 = D
        assert (gathered >= kv) == (kv_exchange == "allgather"), dict(sent.by_op)
    with pytest.raises(ValueError, match="kv_exchange"):
        apply_context_parallel(LlamaForCausalLM(cfg), mesh, kv_exchange="alltoall")


def _cases(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    q, k, v, do = make_qkv(3, B, HQ, HKV, 16 * world, D)
    want = reference(q, k, v, do, is_causal=True)[0]
    _model_door(mesh, q, k, v, want)
    _dtensor_door(mesh, q, k, v, want)
    if _extras.installed("hf"):
        _hf_door(mesh)


def test_ring_options_reach_every_door():
    run_ranks(2, _cases)
