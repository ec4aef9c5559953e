"""Input validation that raises on every rank before the first ring collective.

Note [Agreeing before the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A bad argument on one rank must not leave the others blocked in a collective it never joins. So the
local checks do not raise at once: each rank condenses its arguments -- and whether its local checks
passed -- into a small int64 fingerprint, and one ``all_gather`` of the fingerprints (P * 160 bytes)
lets every rank see every other rank's view (the scheme every entry point shares: Note [One agreement]
in agreement.py; the ring's fields are ``Fingerprint``, read from the call's ``RingSpec``). On a 2-D
mesh (U, R) the fingerprints travel over the ring group and then the Ulysses group
(``comm.all_gather_host``): every rank still sees all P of them before any K/V or head moves. Then every rank raises the same error, or none does.
Only when some rank failed is the text of its error gathered too. Compiled calls agree the same way
(Note [Compiled agreement]).

The fingerprint holds host values only (shapes, dtypes, options; the ids' range, from ids the ring
reads on the host anyway) and travels over the CP group's gloo twin (``comm.host_group``), so on
CUDA the check never makes the host wait for the device. Sinks on a GPU are not read for the
comparison (that would be a sync): equal sinks there are the caller's contract, as for any
replicated parameter. The fields are named in ``Fingerprint``; ``wire.FINGERPRINT_INTS`` is their count.

Note [Compiled agreement]
~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``torch.compile`` the checks cannot raise while tracing: each rank traces its own graph, so a
rank whose input is bad would stop at trace time while the others, tracing fine, would then post K/V
collectives of other sizes (gloo aborts the process: "Received data size doesn't match expected
size") or compute silently wrong outputs. So the cross-rank part runs inside the compiled graph, as
one opaque custom op, ``cp_dtensor::agree_``, that the compiler neither looks into nor drops:

* its arguments are the fingerprint's Python values -- constants of each rank's graph (SymInts when a
  length is dynamic) --, this rank's local error text or None, the CP groups' names, and the tensors
  whose values the fingerprint reads (the document ids, CPU sinks);
* at run time it does what the eager path does (``_agree_and_gather``: the fingerprints' all-gather
  over the gloo twins, the raise, the ids' gather and their check), so every rank raises the same
  ``ValueError`` with eager's text, before any K/V moves; the exception leaves the compiled function as
  a Python exception;
* it mutates a one-element token (a side effect: neither AOTAutograd nor Inductor may eliminate it, even
  when nothing reads its result) and returns the gathered ids [P, B, S_local] (int64; an empty tensor
  without documents). That result is ``Agreed.ids``, or ``Agreed.ready`` without documents; each
  exchange ties its first payload to it with
  ``cp_dtensor::tie_`` (ops.py), so the first K/V collective has a data dependency on the agreement and
  no scheduler can issue it earlier. ``tie_`` "mutates" the payload without writing it: Inductor
  re-inplaces it (no copy); aot_eager clones the payload once per call. A call that moves no K/V (one
  step: a narrow window) ties its output instead: a mutated token nobody reads is dead code to
  AOTAutograd, and the op would be dropped.
* A local error (bad on this rank only) is passed to the op instead of raised; the front door then
  returns a placeholder of the output's shape, which the op's raise at run time never lets anyone see.
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .._compat import resolve_process_group
from .._extras import installed, require
from .agreement import Rules
from .agreement import agree as agree_fingerprints
from .compute.kernels import kernel_error
from .exchange.comm import gather_ids, group_size, host_group
from .plan.layout import LAYOUTS, in_global_order, layout_unit
from .plan.spec import RingSpec
from .plan.wire import FINGERPRINT_INTS, KV_EXCHANGES

__all__ = [
    "Agreed", "Fingerprint", "call_error", "check_call", "check_cp_mesh", "check_documents", "check_ring_args",
    "local_error", "options_error", "ring_preamble",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_PER_RANK = ("id_min", "id_max")  # gathered alongside, allowed to differ between ranks
_ID_DTYPES = (torch.int64, torch.int32)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_HAS_TORCHAO = installed("float8")  # looked up once, not imported (_extras.py)
COMM_DTYPES = _COMM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def check_cp_mesh(cp_mesh) -> None:
    """The CP mesh of the module and transformers paths is 1-D (the same on every rank: raises alike)."""
    if not isinstance(cp_mesh, DeviceMesh):
        raise TypeError(f"the CP mesh must be a torch DeviceMesh; got {type(cp_mesh).__name__}. Make one with "
                        'init_device_mesh(device_type, (cp,), mesh_dim_names=("cp",)), or pass world_mesh["cp"].')
    if cp_mesh.ndim != 1:
        raise ValueError(f"the CP mesh must be 1-D; got a {cp_mesh.ndim}-D mesh {cp_mesh.mesh_dim_names}. "
                         'Pass the CP dimension of a larger mesh, e.g. world_mesh["cp"].')


def options_error(where: str, *, comm_dtype=None, kv_exchange="ring", window_size=None) -> str | None:
    """The ring's own checks of the per-call options a front door fixes once (``comm_dtype``,
    ``kv_exchange``, ``window_size``), on a stand-in call: what ``ring_attention`` would raise for them,
    said at the door, with no tensors and no communication."""
    probe = torch.empty(1, 1, 2, 1)
    error = local_error(probe, probe, probe, "contiguous", False, None, comm_dtype, None, window_size,
                        kv_exchange=kv_exchange)
    return None if error is None else f"{where}: {error.removeprefix('ring_attention: ')}"


def local_error(
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
    # the kernels torch's SDPA switches allow (CUDA): Note [SDPA backend switches] in kernels.py
    return _mask_error(q, document_ids, window_size, sinks) or kernel_error(
        q, v, windowed=window_size is not None or ulysses > 1)


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


class Fingerprint(NamedTuple):
    """What one rank's call looks like, as int64s: every field but the last two must agree across the
    CP group (Note [Agreeing before the ring]). -1 marks a value that is invalid (or absent)."""

    ok: int  #: 1 when this rank's local checks passed
    batch: int
    q_heads: int
    kv_heads: int
    seq_len_local: int
    head_dim: int
    dtype: int  #: index into _DTYPES
    layout: int  #: index into LAYOUTS
    is_causal: int
    scale: int  #: the float's bits
    comm_dtype: int  #: index into _COMM_DTYPES
    value_head_dim: int
    document_ids: int  #: 1 when given
    window_left: int
    window_right: int
    sinks: int  #: -1 none; -2 on a device (not read: no sync); else bits of two weighted sums of the values
    kv_exchange: int  #: index into KV_EXCHANGES
    ulysses: int
    id_min: int  #: this rank's smallest document id (may differ between ranks)
    id_max: int  #: this rank's largest document id (may differ between ranks)


_FIELDS = Fingerprint._fields[:-2]  # those that must agree
assert len(Fingerprint._fields) == FINGERPRINT_INTS  # the all-gather's size, stated in wire.py


def _fingerprint(q, k, v, spec: RingSpec, document_ids, sinks, ok: bool) -> Fingerprint:
    """The fingerprint's trace-time part: shapes, dtypes and options (Python values, constants of a
    compiled graph). ``sinks``, ``id_min`` and ``id_max`` read tensor values: see :func:`_with_values`."""
    def dims(x, i):
        return x.shape[i] if isinstance(x, Tensor) and x.dim() == 4 else -1

    dtype = _DTYPES.index(q.dtype) if isinstance(q, Tensor) and q.dtype in _DTYPES else -1
    scale, layout, comm_dtype = spec.scale, spec.layout, spec.comm_dtype
    scale_bits = _float_bits(scale) if isinstance(scale, (int, float)) else -1
    window = tuple(spec.window) if ok and spec.window is not None else (-1, -1)
    return Fingerprint(
        ok=int(ok), batch=dims(q, 0), q_heads=dims(q, 1), kv_heads=dims(k, 1), seq_len_local=dims(q, 2),
        head_dim=dims(q, 3), dtype=dtype, layout=LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        is_causal=int(bool(spec.is_causal)), scale=scale_bits,
        comm_dtype=_COMM_DTYPES.index(comm_dtype) if comm_dtype in _COMM_DTYPES else -1,
        value_head_dim=dims(v, 3), document_ids=int(ok and document_ids is not None), window_left=int(window[0]),
        window_right=int(window[1]), sinks=-1 if not ok or sinks is None else -2,
        kv_exchange=KV_EXCHANGES.index(spec.kv_exchange) if spec.kv_exchange in KV_EXCHANGES else -1,
        ulysses=int(spec.ulysses), id_min=0, id_max=0,
    )


def _with_values(fp: Fingerprint, document_ids: Tensor | None, sinks: Tensor | None) -> Fingerprint:
    """``fp`` with the fields read from tensor values: the ids' range and CPU sinks (host reads only)."""
    if fp.sinks == -2 and sinks is not None and sinks.device.type == "cpu":
        # the sinks' values, by two weighted sums of their bits (equal sinks on every rank is the contract)
        w = sinks.detach().double()
        fp = fp._replace(sinks=_float_bits(float(w.sum()) + 2.0 * float((w * torch.arange(1, w.numel() + 1)).sum())))
    if fp.document_ids and document_ids.numel():
        fp = fp._replace(id_min=int(document_ids.min()), id_max=int(document_ids.max()))
    return fp


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


# the ring's agreement: Note [One agreement] in agreement.py, with the fields of Fingerprint after ``ok``
_RULES = Rules("ring_attention", _FIELDS[1:], describe=_describe, free=len(_PER_RANK))


def _check_member(spec: RingSpec) -> None:
    if spec.comm_dtype in _FP8 and not _HAS_TORCHAO:  # the row scales come from torchao: the [float8] extra
        require("float8", f"comm_dtype={spec.comm_dtype}")
    if any(g is None or dist.get_rank(g) < 0 for g in spec.groups):
        raise ValueError(
            "ring_attention was called on a rank that is not a member of its CP group "
            f"(global rank {dist.get_rank()}); call it only on the ranks of `group`, or pass their group."
        )


def _agree_ring_fields(fp: Fingerprint, err: str | None, hosts: tuple[dist.ProcessGroup, ...]) -> tuple[int, int] | None:
    """The ring's agreement over the host groups (Note [Agreeing before the ring]): raises the same
    ValueError on every rank when any rank failed its local checks or the ranks disagree. Returns the
    global (min, max) document id (None without documents)."""
    every = agree_fingerprints(_RULES, list(fp)[1:], err, hosts)  # [P, 19]: the fields, then id_min, id_max
    if not fp.document_ids:
        return None
    return int(every[:, -2].min()), int(every[:, -1].max())


def call_error(q, k, v, spec: RingSpec, document_ids=None, sinks=None) -> str | None:
    """:func:`local_error` of a call's ``spec``: this rank's own checks, None when they pass."""
    return local_error(q, k, v, spec.layout, spec.is_causal, spec.scale, spec.comm_dtype, document_ids, spec.window,
                       sinks, spec.kv_exchange, spec.ulysses)


def check_call(
    q, k, v, spec: RingSpec, *, document_ids=None, sinks=None, error: str | None = None,
) -> tuple[float, tuple[int, int] | None]:
    """Validate a ring call (its ``spec`` and tensors) on every rank of the spec's groups, eagerly: the
    same ValueError on every rank, or none. Returns the resolved scale and the global (min, max) document
    id (None without documents). The front door's preamble is :func:`ring_preamble`, which also gathers the ids."""
    _check_member(spec)
    err = error or call_error(q, k, v, spec, document_ids, sinks)
    if torch.compiler.is_compiling():  # the front door's op agrees at run time (Note [Compiled agreement])
        if err is not None and group_size(spec.groups) == 1:
            raise ValueError(err)
        return _resolve_scale(q, spec.scale), None
    fp = _fingerprint(q, k, v, spec, document_ids, sinks, err is None)
    id_range = _agree_ring_fields(_with_values(fp, document_ids, sinks), err, tuple(host_group(g) for g in spec.groups))
    return _resolve_scale(q, spec.scale), id_range


def check_ring_args(
    q, k, v, *, group: dist.ProcessGroup | tuple[dist.ProcessGroup, ...], layout: str, is_causal, scale,
    comm_dtype=None, document_ids=None, window_size=None, sinks=None, kv_exchange="ring", ulysses: int = 1,
    error: str | None = None,
) -> tuple[float, tuple[int, int] | None]:
    """:func:`check_call` with the options spelled out: ``group`` a group, or a 2-D mesh's (ring, Ulysses)
    groups (U, ``ulysses``, is then the second group's size)."""
    groups = group if isinstance(group, tuple) else (group,)
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    spec = RingSpec(groups[0], layout, is_causal, scale, comm_dtype, window, kv_exchange,
                    groups[1] if len(groups) > 1 else None)
    return check_call(q, k, v, spec, document_ids=document_ids, sinks=sinks, error=error)


def _resolve_scale(q: Tensor, scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


class Agreed(NamedTuple):
    """What the preamble hands the exchange: every rank saw the same call."""

    scale: float
    ids: Tensor | None  #: every rank's document ids [P, B, S_local] on the host, checked; None without
    ready: Tensor | None  #: compiled, without ids: the agreement's result, which the first payload must wait for
    failed: str | None = None  #: compiled only: a local error that the agreement raises at run time, on every rank


def ring_preamble(
    q, k, v, spec: RingSpec, *, document_ids=None, sinks=None, error: str | None = None,
    agreed: tuple[int, int] | None = None,
) -> Agreed:
    """The one preamble of ``ring_attention`` for the call's ``spec`` (a group, or a (U, R) mesh's (ring,
    Ulysses) groups): validate locally, agree across ranks, gather the document ids and check them -- on
    every rank alike, before any K/V moves. Eager it runs here; compiled it is one opaque op (Note
    [Compiled agreement]).

    ``agreed``: the caller has just run :func:`check_ring_args` on these arguments (without the ids),
    and derived ``document_ids`` and ``error`` identically on every rank, the ids' global (min, max)
    given here (hf/attention.py): eager, the fingerprints are not gathered again."""
    _check_member(spec)
    groups = spec.groups
    err = error or call_error(q, k, v, spec, document_ids, sinks)
    ok = err is None
    fp = _fingerprint(q, k, v, spec, document_ids, sinks, ok)
    ids = document_ids if ok else None
    sink_values = sinks.detach() if ok and isinstance(sinks, Tensor) else None
    if torch.compiler.is_compiling():  # See Note [Compiled agreement]
        if group_size(groups) == 1 and ids is None and ok:
            return Agreed(_resolve_scale(q, spec.scale), None, None)
        token = torch.zeros(1, dtype=torch.int64)
        names = [g.group_name for g in groups]  # (ring, Ulysses) on a 2-D mesh
        ready = agree_(token, list(fp), err, names[0], names[1] if len(names) > 1 else None, spec.layout, ids,
                       sink_values)
        if not ok:  # the front door returns a placeholder [B, Hq, S_local, Dv]: it needs q and v's shapes
            if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, v)):
                raise ValueError(err)
            return Agreed(1.0, None, ready, failed=err)
        if ids is not None:  # the ids are the result: they carry the dependency (one tensor, not two)
            return Agreed(_resolve_scale(q, spec.scale), ready, None)
        return Agreed(_resolve_scale(q, spec.scale), None, ready)
    hosts = tuple(host_group(g) for g in groups)
    if agreed is not None:
        if err is not None:  # the same on every rank (see above)
            raise ValueError(err)
        gathered = None if ids is None else gather_ids(ids, hosts, agreed)
        if gathered is not None:
            check_documents(gathered, spec.layout)
        return Agreed(_resolve_scale(q, spec.scale), gathered, None)
    gathered = _agree_and_gather(fp, err, hosts, spec.layout, ids, sink_values)
    return Agreed(_resolve_scale(q, spec.scale), gathered, None)


def _agree_and_gather(
    fp: Fingerprint, err: str | None, hosts: tuple[dist.ProcessGroup, ...], layout: str, ids: Tensor | None,
    sinks: Tensor | None,
) -> Tensor | None:
    """Agree (raising on every rank alike), then gather the document ids and check them."""
    id_range = _agree_ring_fields(_with_values(fp, ids, sinks), err, hosts)
    if ids is None:
        return None
    every = gather_ids(ids, hosts, id_range)  # [P, B, S_local] on the host, before K/V moves
    check_documents(every, layout)
    return every


@torch.library.custom_op("cp_dtensor::agree_", mutates_args=("token",))
def agree_(
    token: Tensor, fingerprint: list[int], error: str | None, group: str, ulysses_group: str | None, layout: str,
    document_ids: Tensor | None, sinks: Tensor | None,
) -> Tensor:
    """:func:`ring_preamble`'s cross-rank part as an op a compiled graph runs: see Note [Compiled agreement].
    Returns every rank's document ids [P, B, S_local] (int64, on the host), or an empty tensor."""
    hosts = tuple(host_group(g) for g in _resolve(group, ulysses_group))
    every = _agree_and_gather(Fingerprint(*fingerprint), error, hosts, layout, document_ids, sinks)
    token.fill_(1)
    return token.new_empty(0) if every is None else every.to(torch.int64)


def _resolve(group: str, ulysses_group: str | None) -> tuple[dist.ProcessGroup, ...]:
    return tuple(resolve_process_group(name) for name in (group, ulysses_group) if name is not None)


@agree_.register_fake
def _(token, fingerprint, error, group, ulysses_group, layout, document_ids, sinks):
    if document_ids is None or error is not None:
        return token.new_empty(0)
    world = group_size(_resolve(group, ulysses_group))
    return document_ids.new_empty((world, *document_ids.shape), dtype=torch.int64)


def check_documents(ids: Tensor, layout: str) -> None:
    """Raise, on every rank alike, when the gathered document ids [P, B, S_local] decrease along the
    global sequence (every rank holds the same gathered ids, so every rank decides the same)."""
    full = in_global_order(ids, layout)  # [B, N]
    bad = torch.nonzero(full[:, 1:] < full[:, :-1])
    if bad.numel():
        row, pos = bad[0].tolist()
        raise ValueError(
            f"ring_attention: document_ids must not decrease along the global sequence; batch row {row} "
            f"drops at global position {pos + 1}. Pass each rank its {layout} shard of global ids that only "
            "grow (e.g. a cumulative count of document starts), with the same layout as q, k, v."
        )


def __getattr__(name: str):
    if name == "agree":  # its old name, beside agreement.agree (Note [One agreement])
        from .._deprecated import warn_once

        warn_once("cp_dtensor.core.checks.agree", "cp_dtensor.core.checks.ring_preamble")
        return ring_preamble
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
