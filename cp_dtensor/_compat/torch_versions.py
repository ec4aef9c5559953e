"""The torch-version half of _compat: what differs between torch 2.11 and 2.15, bridged in one place (the rest
of cp_dtensor imports these names from ``cp_dtensor._compat``, never from here). See Note [torch 2.11 to 2.15].
"""

from __future__ import annotations

import contextlib
import enum

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "STRIDED_OFFSET_PARAM",
    "_StridedShardOffsetMode",
    "all_gather_single",
    "all_gather_single_autograd",
    "compiling_while_traced",
    "function_output",
    "plan_strided_redistributions",
    "reduce_scatter_single",
    "strided_offset_mode",
]

# Note [torch 2.11 to 2.15]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# One code base runs on torch 2.11 (the GPU image's torch) through 2.15. Every difference is bridged here,
# detected by the feature where one can be (a Dynamo bug by the version), each with a test in tests/test_compat.py:
# * funcol's ``all_gather_single`` / ``reduce_scatter_single`` (+ ``_autograd``) are 2.13's names, and there the
#   plain ones carry autograd too; 2.11 has ``all_gather_tensor`` (contiguous input only) /
#   ``reduce_scatter_tensor`` (+ ``_autograd``), which 2.13 keeps as deprecated aliases. The functions below
#   are the new ones where they exist; a caller that needs a gradient through a gather calls the _autograd one.
# * ``_StridedShard.local_shard_size_and_offset`` (which HeadTail overrides) takes ``offset_mode``
#   (``_StridedShardOffsetMode``: FIRST, ALL, NONE) in 2.13, ``return_first_offset`` (True: FIRST, False: ALL)
#   in 2.11, positionally or by keyword: ``strided_offset_mode`` reads either.
# * Dynamo before 2.13 loses the gradient of an ``autograd.Function`` whose forward returns a tensor that is
#   also another traced value (``out_b.to(torch.float32)`` of an fp32 ``out_b`` is ``out_b`` itself): it lists
#   the forward's intermediates as outputs too, the same tensor twice, and the gradient reaches the wrong one --
#   the backward gets ``dout`` = 0 and returns zero gradients, silently (fp32; in bf16 the output is a cast,
#   a fresh tensor). ``function_output`` returns a copy there, under compile only; tests/test_compat.py has it.
# * ``torch.compiler.is_compiling()`` is false in 2.11 while AOTAutograd traces DTensor's dispatch (2.13 sets
#   it for the whole torch.compile call): the SDPA handler opens ``compiling_while_traced`` around the ring.
# * DTensor 2.11 reads every ``_StridedShard`` in a redistribution as a device shard order (FSDP x TP's
#   encoding) and raises where it is none -- striped and head-tail on one mesh dim; 2.13 plans those greedily
#   instead; and its reduction rules miss a ``_StridedShard`` on the reduced dim (``isinstance(p, Shard)``), so
#   ``cumsum`` over a striped dim came back wrong. ``plan_strided_redistributions`` gives 2.11 2.13's two
#   fixes, installed where cp_dtensor's placements are made.
_NEW_FUNCOL = hasattr(funcol, "all_gather_single")  # torch >= 2.13
try:
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode  # torch >= 2.13
    STRIDED_OFFSET_PARAM = "offset_mode"
except ImportError:  # torch 2.11: return_first_offset; the same three modes, for HeadTail's override
    STRIDED_OFFSET_PARAM = "return_first_offset"

    class _StridedShardOffsetMode(enum.IntEnum):
        FIRST = 0
        ALL = 1
        NONE = 2


def strided_offset_mode(*args, **kwargs) -> _StridedShardOffsetMode:
    """What torch asks ``_StridedShard.local_shard_size_and_offset`` for, from the arguments after ``rank``
    (``offset_mode`` in 2.13+, ``return_first_offset`` in 2.11). See Note [torch 2.11 to 2.15]."""
    if "offset_mode" in kwargs:
        return _StridedShardOffsetMode(kwargs["offset_mode"])
    if "return_first_offset" in kwargs or (args and STRIDED_OFFSET_PARAM == "return_first_offset"):
        first = kwargs["return_first_offset"] if "return_first_offset" in kwargs else args[0]
        return _StridedShardOffsetMode.FIRST if first else _StridedShardOffsetMode.ALL
    return _StridedShardOffsetMode(args[0]) if args else _StridedShardOffsetMode.FIRST


_DYNAMO_OUTPUT_ALIAS = torch.torch_version.TorchVersion(torch.__version__) < (2, 13)  # 2.13: checked right


def function_output(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an ``autograd.Function``'s forward output: a copy where torch's compile would lose its
    gradient (torch < 2.13, compiling), else ``t``. See Note [torch 2.11 to 2.15]."""
    return t.clone() if _DYNAMO_OUTPUT_ALIAS and torch.compiler.is_compiling() else t


_COMPILE_SESSION = hasattr(torch.compiler, "_compile_session_context")  # torch >= 2.13


@contextlib.contextmanager
def compiling_while_traced(x: torch.Tensor):
    """While open, ``torch.compiler.is_compiling()`` is true if ``x`` is a fake tensor (AOTAutograd tracing a
    DTensor op's handler): torch 2.13 sets it for the whole torch.compile call, 2.11 only inside Dynamo, so the
    ring's compiled branches (Note [Ring under torch.compile]) went unused there. Nothing on 2.13+."""
    if _COMPILE_SESSION or torch.compiler.is_compiling() or not torch._subclasses.fake_tensor.is_fake(x):
        yield
        return
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


_NOT_A_SHARD_ORDER = "is unable to be interpreted into a corresponding shard_order"  # 2.11's ValueError


def _via_replicate(info, transform_info) -> list:
    """A step 2.11 cannot run (strided <-> plain shard, partial -> strided) as two it can, through Replicate,
    as 2.13 runs it."""
    src, dst = info.src_dst_placements
    strided_src, strided_dst = isinstance(src, _StridedShard), isinstance(dst, _StridedShard)
    plain_src, plain_dst = src.is_shard() and not strided_src, dst.is_shard() and not strided_dst
    if not ((strided_src and plain_dst) or (strided_dst and (plain_src or src.is_partial()))):
        return [info]
    return [transform_info(info.mesh_dim, (src, Replicate()), info.logical_shape),
            transform_info(info.mesh_dim, (Replicate(), dst), info.logical_shape)]


def plan_strided_redistributions() -> None:
    """torch 2.11: plan a redistribution whose ``_StridedShard`` is no shard order greedily, as torch 2.13+
    does, instead of raising (idempotent; nothing to do on 2.13+). See Note [torch 2.11 to 2.15]."""
    from torch.distributed.tensor import _redistribute as r

    inner = r._gen_transform_infos_non_cached
    if hasattr(r, "_StridedShardNotDecodableError") or getattr(inner, "_cp_dtensor", False):
        return

    def _gen_transform_infos_non_cached(src_spec, dst_spec, use_graph_based_transform=None):
        try:
            return inner(src_spec, dst_spec, use_graph_based_transform)
        except ValueError as e:
            if _NOT_A_SHARD_ORDER not in str(e):
                raise
            planner = r.get_redistribute_planner(src_spec.device_mesh, src_spec.tensor_meta)
            return [step for info in planner.generate_greedy_transform_infos(src_spec, dst_spec)
                    for step in _via_replicate(info, r._TransformInfo)]

    _gen_transform_infos_non_cached._cp_dtensor = True
    r._gen_transform_infos_non_cached = _gen_transform_infos_non_cached
    from torch.distributed.tensor._ops import _math_ops

    _math_ops.replicate_reduction_dims = _replicate_reduction_dims  # read by name in the reduction rules


def _replicate_reduction_dims(placements: tuple, reduction_dims: list[int]) -> tuple:
    """torch 2.13's ``replicate_reduction_dims``: 2.11's tests ``isinstance(p, Shard)``, which a ``_StridedShard``
    is not there, so a non-linear reduction (cumsum, softmax) over a striped dim ran on the shards and came back
    ``Partial(sum)``: silently wrong."""
    return tuple(Replicate() if p.is_partial() or (isinstance(p, Shard | _StridedShard) and p.dim in reduction_dims)
                 else p for p in placements)


def all_gather_single(x: torch.Tensor, gather_dim: int, group) -> torch.Tensor:
    """funcol's all-gather along ``gather_dim`` (an AsyncCollectiveTensor in eager); no gradient on 2.11."""
    if _NEW_FUNCOL:
        return funcol.all_gather_single(x, gather_dim, group)
    return funcol.all_gather_tensor(x.contiguous(), gather_dim, group)


def all_gather_single_autograd(x: torch.Tensor, gather_dim: int, group) -> torch.Tensor:
    """:func:`all_gather_single` whose backward reduce-scatters the gradient."""
    if _NEW_FUNCOL:
        return funcol.all_gather_single_autograd(x, gather_dim, group)
    return funcol.all_gather_tensor_autograd(x, gather_dim, group)


def reduce_scatter_single(x: torch.Tensor, op: str, scatter_dim: int, group) -> torch.Tensor:
    """funcol's reduce-scatter (``op``: "sum", ...) along ``scatter_dim``; no gradient on 2.11."""
    if _NEW_FUNCOL:
        return funcol.reduce_scatter_single(x, op, scatter_dim, group)
    return funcol.reduce_scatter_tensor(x, op, scatter_dim, group)
