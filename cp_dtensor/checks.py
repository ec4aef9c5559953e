"""Input validation that raises on every rank before the first ring collective.

Note [Agreeing before the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A bad argument on one rank must not leave the others blocked in a collective it never joins. So the
local checks do not raise at once: each rank condenses its arguments -- and whether its local checks
passed -- into a small int64 fingerprint, and one ``all_gather`` of the fingerprints (P * 88 bytes)
lets every rank see every other rank's view. Then every rank raises the same error, or none does.
Only when some rank failed is the text of its error gathered too. Under ``torch.compile`` shapes are
static per graph and a data-dependent raise would break the graph, so only the local checks run
there.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from .comm import lost_peer
from .layout import LAYOUTS

__all__ = ["check_ring_args"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FIELDS = (
    "ok", "batch", "q_heads", "kv_heads", "seq_len_local", "head_dim", "dtype", "layout", "is_causal", "scale",
    "comm_dtype",
)
_COMM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def _local_error(q, k, v, layout: str, is_causal, scale, comm_dtype=None) -> str | None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            return f"ring_attention: {name} must be a Tensor; got {type(x).__name__}."
        if type(x) is not Tensor and x.__class__.__name__ == "DTensor":
            return (
                f"ring_attention takes this rank's local shards; {name} is a DTensor. Call "
                "F.scaled_dot_product_attention on sequence-sharded DTensors instead, or pass .to_local()."
            )
        if x.dim() != 4:
            return f"ring_attention: {name} must be 4-D [B, H, S_local, D]; got shape {tuple(x.shape)}."
        if x.dtype not in _DTYPES:
            return (
                f"ring_attention: {name} has dtype {x.dtype}; supported: float32, bfloat16, float16 "
                "(float64 on CPU). Cast the inputs."
            )
    if not (q.dtype == k.dtype == v.dtype):
        return f"ring_attention: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}."
    if not (q.device == k.device == v.device):
        return f"ring_attention: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}."
    if k.shape != v.shape:
        return f"ring_attention: k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}."
    (b, hq, s, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        return (
            "ring_attention: q [B, Hq, S_local, D] and k, v [B, Hkv, S_local, D] must agree on B, S_local "
            f"and D; got q {tuple(q.shape)}, k {tuple(k.shape)}. Self-attention shards of one sequence only."
        )
    if hkv == 0 or hq % hkv != 0:
        return f"ring_attention: q heads ({hq}) must be a multiple of k/v heads ({hkv}) (GQA/MQA)."
    if s == 0 or d == 0 or b == 0:
        return f"ring_attention: empty input, shape {tuple(q.shape)}; every rank needs at least one token."
    if layout not in LAYOUTS:
        return f"ring_attention: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}."
    if layout == "headtail" and s % 2 != 0:
        return (
            f"ring_attention: the headtail layout needs an even local length (two chunks); got S_local={s}. "
            "Pad the global sequence to a multiple of 2 * cp."
        )
    if not isinstance(is_causal, bool):
        return f"ring_attention: is_causal must be a bool; got {is_causal!r}."
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        return f"ring_attention: scale must be a positive finite number or None; got {scale!r}."
    if comm_dtype not in _COMM_DTYPES:
        return (
            f"ring_attention: comm_dtype must be None, a float dtype or torch.float8_e4m3fn / float8_e5m2; "
            f"got {comm_dtype!r}."
        )
    return None


def _fingerprint(q, k, layout: str, is_causal, scale, comm_dtype, ok: bool) -> list[int]:
    def dims(x, i):
        return int(x.shape[i]) if isinstance(x, Tensor) and x.dim() == 4 else -1

    dtype = _DTYPES.index(q.dtype) if isinstance(q, Tensor) and q.dtype in _DTYPES else -1
    scale_bits = struct.unpack("<q", struct.pack("<d", float(scale)))[0] if isinstance(scale, (int, float)) else -1
    return [
        int(ok), dims(q, 0), dims(q, 1), dims(k, 1), dims(q, 2), dims(q, 3), dtype,
        LAYOUTS.index(layout) if layout in LAYOUTS else -1, int(bool(is_causal)), scale_bits,
        _COMM_DTYPES.index(comm_dtype) if comm_dtype in _COMM_DTYPES else -1,
    ]


def _describe(field: str, value: int):
    """A fingerprint entry as the user wrote it."""
    if value < 0:
        return "invalid"
    if field == "dtype":
        return _DTYPES[value]
    if field == "comm_dtype":
        return _COMM_DTYPES[value]
    if field == "layout":
        return repr(LAYOUTS[value])
    if field == "is_causal":
        return bool(value)
    if field == "scale":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return value


def check_ring_args(q, k, v, *, group: dist.ProcessGroup, layout: str, is_causal, scale, comm_dtype=None) -> float:
    """Validate ``ring_attention``'s arguments on every rank of ``group``; returns the resolved scale."""
    err = _local_error(q, k, v, layout, is_causal, scale, comm_dtype)
    world = dist.get_world_size(group)
    if world > 1 and not torch.compiler.is_compiling():
        device = q.device if isinstance(q, Tensor) and q.device.type != "meta" else torch.device("cpu")
        if dist.get_backend(group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        mine = torch.tensor(_fingerprint(q, k, layout, is_causal, scale, comm_dtype, err is None), device=device)
        try:
            every = funcol.wait_tensor(funcol.all_gather_single(mine, 0, group)).view(world, -1).cpu()
        except RuntimeError as e:
            raise lost_peer(e, group) from e
        if not bool((every[:, 0] == 1).all()):
            errors = [None] * world
            dist.all_gather_object(errors, err, group=group)
            bad = [(r, e) for r, e in enumerate(errors) if e is not None]
            raise ValueError(
                "ring_attention rejected the inputs of rank(s) "
                + ", ".join(str(r) for r, _ in bad) + ": " + bad[0][1]
            )
        differ = (every != every[0]).any(0)
        if bool(differ.any()):
            fields = [f for f, d in zip(_FIELDS, differ.tolist()) if d]
            table = "; ".join(f"rank {r}: " + ", ".join(
                f"{f}={_describe(f, every[r, _FIELDS.index(f)].item())}" for f in fields) for r in range(world))
            raise ValueError(
                f"ring_attention needs the same {', '.join(fields)} on every rank of the CP group; got {table}. "
                "Every rank must hold an equal-length shard of one sequence and pass the same options."
            )
    if err is not None:
        raise ValueError(err)
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
