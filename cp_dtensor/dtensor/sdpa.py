"""The SDPA-on-DTensor rule: q, k, v sequence-sharded in one layout -> the ring.

Note [SDPA dispatch]
~~~~~~~~~~~~~~~~~~~~
``F.scaled_dot_product_attention`` is a composite op: it picks a fused kernel and calls its aten op
(``_scaled_dot_product_flash_attention_for_cpu`` on CPU; flash, efficient or cudnn on CUDA), whose
autograd node later calls the matching ``*_backward`` op. DTensor's op dispatcher lets a library
replace its handling of an op (``DTensor._op_dispatcher._custom_op_handlers``, as torch's experimental
context parallel does); ``install_sdpa_dispatch`` registers one handler for all eight ops.

The handler reads the layout from q's placements (see Note [Layout placements] in dtensor/placements.py). When
the sequence dim (2 of [B, H, S, D]) is sharded on one mesh dim, it builds the call's ``RingSpec`` and
runs ``ring_forward`` / ``ring_backward`` on the local shards over that mesh dim's process group and wraps the results with
q's placements; the log-sum-exp it returns is ours too (fp32 [B, Hq, S]), so only our backward ever
reads it. Any other call -- sequence not sharded, e.g. heads-only tensor parallel -- is re-issued with
our handler out of the table, so it takes exactly the path it takes without cp_dtensor (the handler
that was there before ours, if any, else DTensor's own dispatch, redistributions and decompositions
included): same placements, same values.

Nothing is installed at import. ``install_sdpa_dispatch()`` (idempotent; ``uninstall_sdpa_dispatch()``
undoes it) installs the handlers, the math op's kernel below, and the compile cache-key work-around
(Note [Rank-specialised compiled graphs] in _compat/__init__.py: a torch bug that only the rank-specialised
graphs of this dispatch expose). The entry points that make sequence-sharded DTensors call it:
``shard_sequence``, ``relayout``, ``to_mesh`` and the checkpoint loads (dtensor/sharding.py, checkpoint/dcp.py).
DTensors built by hand with ``Striped`` / ``HeadTail`` / ``Shard(2)`` placements need the explicit call.
``HeadTail``'s propagation fix is installed by the first ``HeadTail`` (Note [HeadTail placement]).

Compiled, the ring appears only when AOTAutograd traces through this handler, and it is different on
every rank, while Dynamo's graph (SDPA on DTensors) is the same on all: installing the handlers also
keys compiled DTensor graphs by the rank's mesh coordinate -- see Note [Rank-specialised compiled
graphs] in _compat/__init__.py.

Everything the handler checks comes from DTensor metadata (global shapes, placements) and the call's
own arguments, which every rank has alike, so a bad call raises on every rank before any collective.

When SDPA picks its math kernel instead (CUDA fp32 with GQA, fp64, a head size no fused kernel takes,
``dropout_p > 0`` on CPU, ``sdpa_kernel(SDPBackend.MATH)``, inference mode): see Note [SDPA math path].

Note [SDPA math path]
~~~~~~~~~~~~~~~~~~~~~
The kernel choice (``_fused_sdp_choice``) is a C++ stub, not an op, and the math kernel
``_scaled_dot_product_attention_math`` is composite: its matmuls and softmax would reach DTensor one
by one, and DTensor would all-gather K and V -- silently, no ring. So both composite ops are caught
before they decompose, wherever they show up:

* outside inference mode (``no_grad`` included), the math op's AutogradCPU and AutogradCUDA kernels
  are ``_math_autograd``: a ``torch.library`` registration on the runtime keys, which outrank the
  composite kernel, removed by ``uninstall_sdpa_dispatch``. Plain tensors and DTensors that are not
  sequence-sharded get the composite decomposition exactly as before;
* under ``torch.inference_mode`` composite ops reach DTensor's dispatcher itself, so
  ``scaled_dot_product_attention`` and the math op get DTensor handlers too.

A sequence-sharded call is then re-issued as ``_scaled_dot_product_flash_attention_for_cpu`` on the
same DTensors. Its handler is the one above, whatever the device (the CPU kernel is never reached: the
DTensor handler replaces it), and its autograd formula calls the ``_backward`` op that the same handler
serves. So every backend choice runs the ring or raises the handler's ValueError (a mask, dropout or a
``dropout_mask``, Hq != Hkv without ``enable_gqa``) on every rank before any collective. The
math op's second result (the attention weights, which a sequence-sharded call cannot have) is an
empty placeholder; ``F.scaled_dot_product_attention`` never returns it. Tests: tests/core/test_cuda_paths.py
(CPU: ``sdpa_kernel(MATH)``, ``no_grad``, inference mode, dropout, masks); scripts/benchmarks/gpu_check.py (every
CUDA backend choice).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .._compat import (
    DTensorSpec,
    TensorMeta,
    _StridedShard,
    compiling_while_traced,
    custom_op_handlers,
    include_mesh_coordinate_in_cache_key,
    make_contiguous_strides_for,
    redistribute_local_tensor,
    restore_cache_key,
)
from ..core.checks import call_error, options_error
from ..core.exchange.allgather import allgather_backward, allgather_forward
from ..core.exchange.ring import ring_backward, ring_forward
from ..core.plan.layout import check_seq_len
from ..core.plan.spec import RingSpec
from .placements import as_layout_placements, install_headtail_propagation, placement_layout

__all__ = ["install_sdpa_dispatch", "sdpa_options", "uninstall_sdpa_dispatch"]

aten = torch.ops.aten
_SEQ_DIM = 2  # q, k, v: [B, H, S, D]

_FORWARD_OPS = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
)
_BACKWARD_OPS = (
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
)


_previous: dict[torch._ops.OpOverload, Any] = {}  # handlers ours replaced, restored by uninstall
_EXCHANGES = {"ring": (ring_forward, ring_backward), "allgather": (allgather_forward, allgather_backward)}
# the ring options of the innermost open sdpa_options context: (comm_dtype, kv_exchange)
_options: contextvars.ContextVar[tuple[torch.dtype | None, str]] = contextvars.ContextVar(
    "cp_dtensor_sdpa_options", default=(None, "ring"))


@contextlib.contextmanager
def sdpa_options(*, comm_dtype: torch.dtype | None = None, kv_exchange: str = "ring") -> Iterator[None]:
    """``ring_attention``'s ``comm_dtype`` and ``kv_exchange`` for ``F.scaled_dot_product_attention`` on
    sequence-sharded DTensors while the context is open (a placement cannot carry them); the defaults
    outside. Checked here, on every rank alike (the same arguments), before any communication. Compiled
    code keeps the options that were open when it was traced: open the context around the compiled
    call's first run (and every later one), as around the eager calls."""
    error = options_error("cp_dtensor.sdpa_options", comm_dtype=comm_dtype, kv_exchange=kv_exchange)
    if error is not None:
        raise ValueError(error)
    token = _options.set((comm_dtype, kv_exchange))
    try:
        yield
    finally:
        _options.reset(token)


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in. The eight ops differ only in names
    (``grad_out`` / ``grad_out_``, ``attn_mask`` / ``attn_bias``) and in extra outputs."""
    bound: dict[str, Any] = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    bound["grad_out"] = bound.get("grad_out", bound.get("grad_out_"))
    bound["mask"] = bound.get("attn_mask", bound.get("attn_bias"))
    return bound


class _Ring:
    """What the ring needs, read from q, k, v's DTensor metadata (the same on every rank)."""

    def __init__(self, q: DTensor, k: DTensor, v: DTensor, mesh_dim: int, layout: str):
        self.mesh, self.mesh_dim, self.layout = q.device_mesh, mesh_dim, layout
        self.placements = as_layout_placements(q.placements)
        self.group = self.mesh.get_group(mesh_dim)

    def spec(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> DTensorSpec:
        stride = make_contiguous_strides_for(shape)
        return DTensorSpec(self.mesh, self.placements, TensorMeta(torch.Size(shape), stride, dtype))

    def wrap(self, local: torch.Tensor, shape) -> DTensor:
        return DTensor(local, self.spec(shape, local.dtype), requires_grad=False)

    def local(self, x: DTensor) -> torch.Tensor:
        """x's local shard in the ring's placements (grad_out may arrive e.g. replicated)."""
        target = self.spec(x.shape, x.dtype)
        if tuple(x.placements) != self.placements or x.device_mesh != self.mesh:
            return redistribute_local_tensor(x._local_tensor, x._spec, target).contiguous()
        return x._local_tensor.contiguous()


def _sequence_dim_sharding(x: DTensor) -> list[tuple[int, Placement]]:
    return [(i, p) for i, p in enumerate(x.placements) if isinstance(p, Shard | _StridedShard) and p.dim == _SEQ_DIM]


def _plan(a: dict[str, Any]) -> _Ring | None:
    """None when q is not sequence-sharded (DTensor's ordinary path); raises for a CP call we cannot run."""
    q, k, v = a["query"], a["key"], a["value"]
    if not isinstance(q, DTensor) or q.dim() != 4 or not _sequence_dim_sharding(q):
        return None
    where = "F.scaled_dot_product_attention on sequence-sharded DTensors"
    for name, x in (("key", k), ("value", v)):
        if not isinstance(x, DTensor):
            raise ValueError(f"{where}: query is a DTensor but {name} is a {type(x).__name__}. "
                             "Shard k and v like q (cp_dtensor.shard_sequence).")
        if x.device_mesh != q.device_mesh or as_layout_placements(x.placements) != as_layout_placements(q.placements):
            raise ValueError(f"{where} needs q, k, v on one mesh in one layout; got q {q.placements} and "
                             f"{name} {x.placements}. Redistribute k and v to q's placements.")
    mask, dropout = a["mask"], float(a.get("dropout_p", 0.0))
    if mask is not None:
        raise ValueError(f"{where}: attn_mask is not supported (a mask would have to travel with K/V and "
                         "follow the layout). Use is_causal=True, or all-gather the sequence first.")
    if dropout > 0.0:
        raise ValueError(f"{where}: dropout_p must be 0; got {dropout}. The ring has no dropout: set the "
                         "attention dropout to 0 under context parallelism.")
    if q.shape[_SEQ_DIM] != k.shape[_SEQ_DIM]:
        raise ValueError(f"{where} is self-attention over one sequence: q has {q.shape[_SEQ_DIM]} positions, "
                         f"k {k.shape[_SEQ_DIM]}. Replicate k and v for cross-attention.")
    sharded = _sequence_dim_sharding(q)
    if len(sharded) != 1:
        raise ValueError(f"{where}: the sequence dim is sharded on mesh dims {[i for i, _ in sharded]}; "
                         "shard it on exactly one (the CP dim).")
    mesh_dim, p = sharded[0]
    cp, seq_len = q.device_mesh.size(mesh_dim), q.shape[_SEQ_DIM]
    layout = placement_layout(p, seq_len=seq_len, cp=cp)
    check_seq_len(layout, cp, seq_len)
    for i, other in enumerate(q.placements):
        if i != mesh_dim and not (other.is_replicate() or other.is_shard(0) or other.is_shard(1)):
            raise ValueError(f"{where}: mesh dim {i} has {other}; besides CP only batch (Shard(0)) or heads "
                             "(Shard(1)) sharding, or Replicate, is supported.")
    # the local shards' own rules (heads, dtypes, S_local, ...) are checks.py's, in _sdpa_handler
    return _Ring(q, k, v, mesh_dim, layout)


def _scale(a: dict[str, Any], q: DTensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if a.get("scale") is None else float(a["scale"])


def _empty(op: torch._ops.OpOverload, ring: _Ring, like: torch.Tensor, first: int) -> list[Any]:
    """Placeholders for the outputs past ``first`` (rng state, cum_seq, max_q...) that only our own
    backward would read, and it does not: empty replicated tensors and zeros."""
    extras: list[Any] = []
    replicated = DTensorSpec(ring.mesh, (Replicate(),) * ring.mesh.ndim, TensorMeta(torch.Size([0]), (1,), like.dtype))
    for r in op._schema.returns[first:]:
        is_tensor = isinstance(r.type, torch._C.TensorType)
        extras.append(DTensor(like.new_empty(0), replicated, requires_grad=False) if is_tensor else 0)
    return extras


def _sdpa_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    # See Note [SDPA dispatch]
    a = _bind(op, args, kwargs)
    ring = _plan(a)
    if ring is None:
        return _ordinary(op, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    # the call's spec, built once (Note [One spec per ring call] in core/plan/spec.py)
    comm_dtype, kv_exchange = _options.get()  # See sdpa_options
    spec = RingSpec(ring.group, ring.layout, is_causal=bool(a["is_causal"]), scale=_scale(a, q), comm_dtype=comm_dtype,
                    kv_exchange=kv_exchange)
    forward, backward = _EXCHANGES[kv_exchange]
    ql, kl, vl = ring.local(q), ring.local(k), ring.local(v)  # same placements: no communication
    err = call_error(ql, kl, vl, spec)  # the shards are alike on every rank: every rank raises alike
    if err is not None:
        raise ValueError(err)
    if op in _FORWARD_OPS:
        # out: [B, Hq, S, D]; lse: [B, Hq, S] fp32
        with compiling_while_traced(ql):  # torch 2.11: Note [torch 2.11 to 2.15] in _compat/torch_versions.py
            out, lse = forward(ql, kl, vl, spec)
        res = [ring.wrap(out, (*q.shape[:3], v.shape[3])), ring.wrap(lse, tuple(q.shape[:3]))]
        return tuple(res + _empty(op, ring, ql, 2))
    with compiling_while_traced(ql):
        dq, dk, dv = backward(ring.local(a["grad_out"]), ql, kl, vl, ring.local(a["out"]),
                              ring.local(a["logsumexp"]), spec)
    res = [ring.wrap(dq, q.shape), ring.wrap(dk, k.shape), ring.wrap(dv, v.shape)]
    return tuple(res + [None] * (len(op._schema.returns) - 3))  # efficient's attn_bias grad


def _ordinary(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """``op`` as without ``install_sdpa_dispatch``: re-issued with the handler that was there before ours
    (or none) in the table, so DTensor dispatches it as it would without cp_dtensor. See Note [SDPA dispatch]."""
    handlers = custom_op_handlers()
    ours = handlers.pop(op)
    if op in _previous:
        handlers[op] = _previous[op]
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = ours


# ---------------------------------------------------------------------------------------------------
# The composite ops: see Note [SDPA math path].

_COMPOSITE_OPS = (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_attention_math.default)
_MATH = aten._scaled_dot_product_attention_math.default
_math_lib: torch.library.Library | None = None  # our Autograd kernel of the math op, while installed
# runtime keys, not the Autograd alias: a CompositeImplicitAutograd kernel outranks an alias registration
_MATH_KEYS = ("AutogradCPU", "AutogradCUDA")


def _ring_plan(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[dict[str, Any], _Ring | None]:
    a = _bind(op, args, kwargs)
    return a, _plan(a)


def _as_fused(a: dict[str, Any], ring: _Ring) -> DTensor:
    """A sequence-sharded composite call re-issued as the fused op our handler serves: out [B, Hq, S, Dv]."""
    q, k = a["query"], a["key"]
    where = "F.scaled_dot_product_attention on sequence-sharded DTensors"
    if a.get("dropout_mask") is not None:
        raise ValueError(f"{where}: dropout_mask is not supported (the ring has no dropout). Pass no dropout "
                         "mask and dropout_p=0.")
    if not a.get("enable_gqa", False) and q.shape[1] != k.shape[1]:
        raise ValueError(f"{where}: q has {q.shape[1]} heads and k/v {k.shape[1]}, but enable_gqa is False. "
                         "Pass enable_gqa=True for grouped-query attention.")
    return aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, a["value"], float(a["dropout_p"]), bool(a["is_causal"]), attn_mask=a["mask"], scale=a.get("scale")
    )[0]


def _composite_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    # DTensor's handler of the composite ops (they reach it under inference mode): see Note [SDPA math path]
    a, ring = _ring_plan(op, args, kwargs)
    if ring is None:  # what DTensor does without us
        return _ordinary(op, args, kwargs)
    out = _as_fused(a, ring)
    return (out, *_empty(op, ring, out._local_tensor, 1)) if op is _MATH else out


def _math_autograd(*args, **kwargs):
    # the math op's Autograd kernel: see Note [SDPA math path]
    if isinstance(args[0] if args else kwargs.get("query"), DTensor):
        a, ring = _ring_plan(_MATH, args, kwargs)
        if ring is not None:
            out = _as_fused(a, ring)
            return out, *_empty(_MATH, ring, out._local_tensor, 1)
    return _MATH.decompose(*args, **kwargs)


def install_sdpa_dispatch() -> None:
    """Route ``F.scaled_dot_product_attention`` on sequence-sharded DTensors to the ring (idempotent). Not
    done at import; the entry points that make sequence-sharded DTensors call it. See Note [SDPA dispatch]."""
    install_headtail_propagation()
    # a torch bug work-around this dispatch needs: Note [Rank-specialised compiled graphs] in _compat/__init__.py
    include_mesh_coordinate_in_cache_key()
    handlers = custom_op_handlers()
    for op, handler in [(op, _sdpa_handler) for op in _FORWARD_OPS + _BACKWARD_OPS] + [
        (op, _composite_handler) for op in _COMPOSITE_OPS
    ]:
        if handlers.get(op) is not handler:
            if op in handlers:
                _previous[op] = handlers[op]
            handlers[op] = handler
    global _math_lib
    if _math_lib is None:  # See Note [SDPA math path]
        _math_lib = torch.library.Library("aten", "IMPL")
        for key in _MATH_KEYS:
            _math_lib.impl("_scaled_dot_product_attention_math", _math_autograd, key)


def uninstall_sdpa_dispatch() -> None:
    """Undo :func:`install_sdpa_dispatch`: our handlers (only ours), the math op's kernel, the cache key."""
    handlers = custom_op_handlers()
    for op in _FORWARD_OPS + _BACKWARD_OPS + _COMPOSITE_OPS:
        if handlers.get(op) in (_sdpa_handler, _composite_handler):
            if op in _previous:
                handlers[op] = _previous.pop(op)
            else:
                del handlers[op]
    global _math_lib
    if _math_lib is not None:
        _math_lib._destroy()
        _math_lib = None
    restore_cache_key()
