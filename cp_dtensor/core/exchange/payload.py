"""Wire formats of the K/V ring payload: as is, cast, or float8 with power-of-two row scales.

Note [float8 ring payload]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The K/V blocks that travel are the one place where CP adds communication. With
``comm_dtype=torch.float8_e4m3fn`` (or ``float8_e5m2``) each row of each head of K and V -- D values --
is scaled by a power of two chosen with torchao's float8 scaling utilities (axiswise amax -> scale,
rounded down to a power of two) and saturated to float8. Only the scale's exponent travels, as one
int8 per row (``layout.FP8_SCALE_BYTES``), so a row costs D + 1 bytes instead of D * itemsize
(``layout.payload_bytes``, the one statement of the message size; the planner charges it, and
tests/tools/test_plan.py checks it against ``encode_kv``'s buffer): (D + 1) / (2 D) of the bf16 bytes
(0.508 at D = 64, 0.504 at D = 128). A power-of-two
scale loses no precision (it only moves the exponent), so a row's relative error is float8's own:
2^-4 for e4m3. The receiving rank dequantizes into the input dtype before the block's kernel.

The local block (ring step 0) never leaves the rank and stays in full precision; the backward rotates
K/V in the same format, so it sees the very values the forward used, and the dK/dV accumulators
travel in the input dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._extras import torchao_import_quiet
from ..plan.layout import (  # the message size, stated once (torch-free, for tools/plan.py)
    FP8_SCALE_BYTES,
    payload_bytes,
)
from .comm import pack, unpack

__all__ = ["FP8_DTYPES", "FP8_SCALE_BYTES", "encode_kv", "decode_kv", "encode_rows", "decode_rows", "payload_bytes"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _quantize_rows(x: Tensor, fp8: torch.dtype) -> tuple[Tensor, Tensor]:
    # x: [B, H, S, D] -> data: [B, H, S, D] float8 (as uint8), exponent: [B, H, S, 1] int8 (as uint8)
    with torchao_import_quiet():  # See Note [torchao's import noise]
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(
        x, fp8, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1, round_scales_to_power_of_2=True
    )
    exp = torch.log2(scale).round_().clamp_(-126, 126)
    data = to_fp8_saturated(x.float() * torch.exp2(exp), fp8)
    return data.view(torch.uint8), exp.to(torch.int8).view(torch.uint8)


def _dequantize_rows(data: Tensor, exp: Tensor, fp8: torch.dtype, dtype: torch.dtype) -> Tensor:
    return (data.view(fp8).float() * torch.exp2(-exp.view(torch.int8).float())).to(dtype)


def encode_kv(k: Tensor, v: Tensor, comm_dtype: torch.dtype | None) -> Tensor:
    """One flat buffer holding K and V in ``comm_dtype`` (None: as they are)."""
    if comm_dtype is None or comm_dtype == k.dtype:
        return pack(k, v)
    if comm_dtype in FP8_DTYPES:
        (kd, ke), (vd, ve) = _quantize_rows(k, comm_dtype), _quantize_rows(v, comm_dtype)
        return pack(kd, vd, ke, ve)
    return pack(k.to(comm_dtype), v.to(comm_dtype))


def decode_kv(buf: Tensor, k: Tensor, v: Tensor, comm_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """K and V of another rank, shaped and typed like the local ``k`` and ``v``."""
    if comm_dtype is None or comm_dtype == k.dtype:
        kb, vb = unpack(buf, k, v)
        return kb, vb
    if comm_dtype in FP8_DTYPES:
        rows = k.new_empty(k.shape[:-1] + (1,), dtype=torch.uint8)
        kd, vd, ke, ve = unpack(buf, k, v, rows, rows)
        return _dequantize_rows(kd, ke, comm_dtype, k.dtype), _dequantize_rows(vd, ve, comm_dtype, v.dtype)
    kb, vb = unpack(buf, k, v)
    return kb.to(k.dtype), vb.to(v.dtype)


def encode_rows(k: Tensor, v: Tensor, comm_dtype: torch.dtype | None) -> Tensor:
    """K/V token rows k [R, Hkv, Dqk], v [R, Hkv, Dv] as one [R, W] buffer, row r's bytes contiguous (an
    all-to-all splits it by rows): in ``comm_dtype`` (None: as they are; float8: the data, then one
    exponent byte per head of K and of V, ``payload_bytes`` a row)."""
    r = k.shape[0]

    def flat(x: Tensor) -> Tensor:
        return x.reshape(r, math.prod(x.shape[1:]))

    if comm_dtype is None or comm_dtype == k.dtype:
        return torch.cat([flat(k), flat(v)], 1)
    if comm_dtype in FP8_DTYPES:
        (kd, ke), (vd, ve) = (_quantize_rows(x[None], comm_dtype) for x in (k, v))
        return torch.cat([flat(x[0]) for x in (kd, vd, ke, ve)], 1)
    return torch.cat([flat(k).to(comm_dtype), flat(v).to(comm_dtype)], 1)


def decode_rows(buf: Tensor, hkv: int, dqk: int, dv: int, dtype: torch.dtype,
                comm_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`encode_rows`: k [R, Hkv, Dqk], v [R, Hkv, Dv] in ``dtype``."""
    r = buf.shape[0]
    nk, nv = hkv * dqk, hkv * dv
    if comm_dtype in FP8_DTYPES:
        kd, vd = buf[:, :nk].reshape(1, r, hkv, dqk), buf[:, nk : nk + nv].reshape(1, r, hkv, dv)
        ke = buf[:, nk + nv : nk + nv + hkv].reshape(1, r, hkv, 1)
        ve = buf[:, nk + nv + hkv :].reshape(1, r, hkv, 1)
        return _dequantize_rows(kd, ke, comm_dtype, dtype)[0], _dequantize_rows(vd, ve, comm_dtype, dtype)[0]
    return buf[:, :nk].reshape(r, hkv, dqk).to(dtype), buf[:, nk:].reshape(r, hkv, dv).to(dtype)
