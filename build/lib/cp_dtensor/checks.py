"""Input validation that raises on every rank before the first ring collective.

Note [Agreeing before the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A bad argument on one rank must not leave the others blocked in a collective it never joins. So the
local checks do not raise at once: each rank condenses its arguments -- and whether its local checks
passed -- into a small int64 fingerprint, and one ``all_gather`` of the fingerprints (P * 160 bytes)
lets every rank see every other rank's view. On a 2-D mesh (U, R) the fingerprints travel over the ring
group and then the Ulysses group (``comm.all_gather_host``): every rank still sees all P of them before
any K/V or head moves. Then every rank raises the same error, or none does.
Only when some rank failed is the text of its error gathered too. Under ``torch.compile`` shapes are
static per graph and a data-dependent raise would break the graph, so only the local checks run
there.

The fingerprint holds host values only (shapes, dtypes, options; the ids' range, from ids the ring
reads on the host anyway) and travels over the CP group's gloo twin (``comm.host_group``), so on
CUDA the check never makes the host wait for the device. Sinks on a GPU are not read for the
comparison (that would be a sync): equal sinks there are the caller's contract, as for any
replicated parameter.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.distributed as dist
from torch import Tensor

from ._extras import require
from .comm import all_gather_host, all_gather_objects, group_size, host_group
from .layout import LAYOUTS, global_order, layout_unit

__all__ = ["check_documents", "check_ring_args"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FIELDS = (
    "ok", "batch", "q_heads", "kv_heads", "seq_len_local", "head_dim", "dtype", "layout", "is_causal", "scale",
    "comm_dtype", "value_head_dim", "document_ids", "window_left", "window_right", "sinks", "kv_exchange", "ulysses",
)
_PER_RANK = ("id_min", "id_max")  # gathered alongside, allowed to differ between ranks
_ID_DTYPES = (torch.int64, torch.int32)
_COMM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
KV_EXCHANGES = ("ring", "allgather")


def _local_error(
    q, k, v, layout: str, is_causal, scale, comm_dtype=None, document_ids=None, window_size=None, sinks=None,
    kv_exchange="ring", ulysses: int = 1,
) -> str | None:
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
    if q.dtype == torch.float64 and q.device.type == "cuda":
        return (
            "ring_attention: float64 has no fused attention kernel on CUDA (flash and memory-efficient take "
            "fp16, bf16, fp32); cast q, k, v to float32. float64 runs on CPU."
        )
    if not (q.dtype == k.dtype == v.dtype):
        return f"ring_attention: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}."
    if not (q.device == k.device == v.device):
        return f"ring_attention: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}."
    if k.shape[:-1] != v.shape[:-1]:
        return (
            "ring_attention: k [B, Hkv, S_local, Dqk] and v [B, Hkv, S_local, Dv] must agree on all but the "
            f"head size; got {tuple(k.shape)} and {tuple(v.shape)}."
        )
    (b, hq, s, d), (bk, hkv, sk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        return (
            "ring_attention: q [B, Hq, S_local, D] and k, v [B, Hkv, S_local, D] must agree on B, S_local "
            f"and D; got q {tuple(q.shape)}, k {tuple(k.shape)}. Self-attention shards of one sequence only."
        )
    if hkv == 0 or hq % hkv != 0:
        return f"ring_attention: q heads ({hq}) must be a multiple of k/v heads ({hkv}) (GQA/MQA)."
    if s == 0 or d == 0 or b == 0 or v.shape[-1] == 0:
        return f"ring_attention: empty input, shape {tuple(q.shape)}; every rank needs at least one token."
    if layout not in LAYOUTS:
        return f"ring_attention: unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}."
    if s % layout_unit(layout, 1) != 0:  # the divisibility rule on one rank's share
        return (
            f"ring_attention: the {layout} layout needs S_local divisible by {layout_unit(layout, 1)} (even: "
            f"two chunks); got S_local={s}. Pad the global sequence to a multiple of {layout_unit(layout, 1)} * cp."
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
    if kv_exchange not in KV_EXCHANGES:
        return f"ring_attention: kv_exchange must be one of {', '.join(map(repr, KV_EXCHANGES))}; got {kv_exchange!r}."
    if hq % ulysses != 0:
        return (
            f"ring_attention on a 2-D mesh (U, R) = ({ulysses}, ..) splits the q heads over U: Hq ({hq}) must be "
            f"divisible by U ({ulysses}). Use a mesh whose first dim divides Hq, or a 1-D mesh."
        )
    return _mask_error(q, document_ids, window_size, sinks)


def _mask_error(q, document_ids, window_size, sinks) -> str | None:
    b, hq, s = q.shape[0], q.shape[1], q.shape[2]
    if document_ids is not None:
        if not isinstance(document_ids, Tensor) or document_ids.dtype not in _ID_DTYPES:
            got = document_ids.dtype if isinstance(document_ids, Tensor) else type(document_ids).__name__
            return f"ring_attention: document_ids must be an int64 (or int32) tensor [B, S_local]; got {got}."
        if tuple(document_ids.shape) != (b, s):
            return (
                f"ring_attention: document_ids must be [B, S_local] = [{b}, {s}], this rank's layout shard of "
                f"the global [B, N] ids; got shape {tuple(document_ids.shape)}."
            )
        if document_ids.device not in (q.device, torch.device("cpu")):
            return f"ring_attention: document_ids must be on q's device {q.device} or the CPU; got {document_ids.device}."
    if window_size is not None:
        ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
        if not ok or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size):
            return (
                "ring_attention: window_size must be None or (left, right), each -1 (unbounded) or >= 0 "
                f"(flash-attn's convention); got {window_size!r}."
            )
    if sinks is not None:
        if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (hq,):
            got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            return f"ring_attention: sinks must be a [Hq] = [{hq}] tensor of per-head logits; got {got}."
        if sinks.dtype not in (torch.float32, q.dtype):
            return f"ring_attention: sinks must be float32 or q's dtype {q.dtype}; got {sinks.dtype}."
        if sinks.device != q.device:
            return f"ring_attention: sinks must be on q's device {q.device}; got {sinks.device}."
    return None


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _fingerprint(
    q, k, v, layout: str, is_causal, scale, comm_dtype, document_ids, window_size, sinks, kv_exchange, ulysses, ok: bool
):
    def dims(x, i):
        return int(x.shape[i]) if isinstance(x, Tensor) and x.dim() == 4 else -1

    dtype = _DTYPES.index(q.dtype) if isinstance(q, Tensor) and q.dtype in _DTYPES else -1
    scale_bits = _float_bits(scale) if isinstance(scale, (int, float)) else -1
    docs = ok and document_ids is not None
    window = tuple(window_size) if ok and window_size is not None else (-1, -1)
    # the sinks' values, by two weighted sums of their bits (equal sinks on every rank is the contract)
    sink = -1
    if ok and sinks is not None and sinks.device.type != "cpu":
        sink = -2  # compared only where reading them costs no device sync
    elif ok and sinks is not None:
        w = sinks.detach().double()
        sink = _float_bits(float(w.sum()) + 2.0 * float((w * torch.arange(1, w.numel() + 1, device=w.device)).sum()))
    id_min = int(document_ids.min()) if docs and document_ids.numel() else 0
    id_max = int(document_ids.max()) if docs and document_ids.numel() else 0
    return [
        int(ok), dims(q, 0), dims(q, 1), dims(k, 1), dims(q, 2), dims(q, 3), dtype,
        LAYOUTS.index(layout) if layout in LAYOUTS else -1, int(bool(is_causal)), scale_bits,
        _COMM_DTYPES.index(comm_dtype) if comm_dtype in _COMM_DTYPES else -1,
        dims(v, 3), int(docs), int(window[0]), int(window[1]), sink,
        KV_EXCHANGES.index(kv_exchange) if kv_exchange in KV_EXCHANGES else -1, int(ulysses), id_min, id_max,
    ]


def _describe(field: str, value: int):
    """A fingerprint entry as the user wrote it."""
    if field in ("window_left", "window_right"):
        return value
    if field == "document_ids":
        return "given" if value else None
    if field == "sinks":
        return "none" if value == -1 else f"values#{value & 0xFFFF:04x}"
    if value < 0:
        return "invalid"
    if field == "dtype":
        return _DTYPES[value]
    if field == "comm_dtype":
        return _COMM_DTYPES[value]
    if field == "kv_exchange":
        return repr(KV_EXCHANGES[value])
    if field == "layout":
        return repr(LAYOUTS[value])
    if field == "is_causal":
        return bool(value)
    if field == "scale":
        return struct.unpack("<d", struct.pack("<q", value))[0]
    return value


def check_ring_args(
    q, k, v, *, group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...], layout: str, is_causal, scale,
    comm_dtype=None, document_ids=None, window_size=None, sinks=None, kv_exchange="ring", ulysses: int = 1,
    error: str | None = None,
) -> tuple[float, tuple[int, int] | None]:
    """Validate ``ring_attention``'s arguments on every rank of ``group`` -- a group, or a 2-D mesh's
    (ring, Ulysses) groups with ``ulysses`` = U. Returns the resolved scale and the global (min, max)
    document id (None without documents, or when not gathered: compiled)."""
    if comm_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # the row scales come from torchao
        require("float8", f"comm_dtype={comm_dtype}")
    groups = group if isinstance(group, tuple) else (group,)
    if any(g is None or dist.get_rank(g) < 0 for g in groups):
        raise ValueError(
            "ring_attention was called on a rank that is not a member of its CP group "
            f"(global rank {dist.get_rank()}); call it only on the ranks of `group`, or pass their group."
        )
    err = error or _local_error(
        q, k, v, layout, is_causal, scale, comm_dtype, document_ids, window_size, sinks, kv_exchange, ulysses
    )
    world = group_size(groups)
    id_range = None
    if world > 1 and not torch.compiler.is_compiling():
        host = tuple(host_group(g) for g in groups)
        fp = _fingerprint(
            q, k, v, layout, is_causal, scale, comm_dtype, document_ids, window_size, sinks, kv_exchange, ulysses,
            err is None,
        )
        mine = torch.tensor(fp)  # host values only: nothing here waits for the device
        every = all_gather_host(mine, host).view(world, -1)
        if not bool((every[:, 0] == 1).all()):
            errors = all_gather_objects(err, host)
            bad = [(r, e) for r, e in enumerate(errors) if e is not None]
            raise ValueError(
                "ring_attention rejected the inputs of rank(s) "
                + ", ".join(str(r) for r, _ in bad) + ": " + bad[0][1]
            )
        n = len(_FIELDS)
        if document_ids is not None:
            id_range = (int(every[:, n].min()), int(every[:, n + 1].max()))
        every = every[:, :n]
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
    if world == 1 and document_ids is not None and not torch.compiler.is_compiling():
        id_range = (int(document_ids.min()), int(document_ids.max()))
    return (1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)), id_range


def check_documents(ids: Tensor, layout: str, group: dist.ProcessGroup) -> None:
    """Raise, on every rank alike, when the gathered document ids [P, B, S_local] decrease along the
    global sequence (every rank holds the same gathered ids, so every rank decides the same)."""
    if torch.compiler.is_compiling():
        return
    world, b, s = ids.shape
    order = global_order(layout, world, world * s).to(ids.device)
    full = torch.empty(b, world * s, dtype=ids.dtype, device=ids.device)
    full[:, order] = ids.permute(1, 0, 2).reshape(b, world * s)
    bad = torch.nonzero(full[:, 1:] < full[:, :-1])
    if bad.numel():
        row, pos = bad[0].tolist()
        raise ValueError(
            f"ring_attention: document_ids must not decrease along the global sequence; batch row {row} "
            f"drops at global position {pos + 1}. Pass each rank its {layout} shard of global ids that only "
            "grow (e.g. a cumulative count of document starts), with the same layout as q, k, v."
        )
