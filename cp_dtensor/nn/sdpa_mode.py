"""Context parallelism for whole models whose attention modules call ``F.scaled_dot_product_attention``
(own models; a transformers model goes to hf/ -- doors.py chooses: Note [One door for whole models]).

Note [Module context parallel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The model runs on plain local tensors: each CP rank holds its layout's share of every sequence --
tokens, labels and positions sharded alike by ``shard_batch``. Every layer except attention works
token by token, so it needs nothing, provided position-dependent layers take the positions as an input
(RoPE indexed by ``positions``, not by local index): positions travel with their tokens.

Attention is the one layer that mixes tokens. ``apply_context_parallel`` installs forward hooks that
keep a ``TorchFunctionMode`` active while the model (or any of its submodules, so activation
checkpointing's recomputation is covered too) runs forward. The mode turns each SDPA call on plain
[B, H, S_local, D] tensors into ``ring_attention`` on the same local shards, so every call goes
through the ring's agreement check (Note [Agreeing before the ring] in checks.py): a call that is
bad on one rank only -- an explicit mask one rank's model built from its local shapes, say -- raises
on every rank before any K/V moves. The masks the ring can express come from the hooks: document ids
taken from the top-level call (``document_ids=``, or derived from ``position_ids`` that restart at 0)
and kept until the next top-level call (activation checkpointing recomputes with them), and the
model's window.

Packed documents go through the batch's plan (Note [One plan per batch] in core/plan/documents.py): with
``documents="position_ids"`` the hook all-gathers the start flags once per forward, so the *full* ids,
and builds the ``DocumentLayout`` of the door's layout from them; with ``layout="documents"`` the batch
was sharded by a plan built before the forward (``cp_dtensor.document_layout``: the placement depends on
the ids, so only the full batch can give it), which the call passes as ``cp_layout=plan`` (the Hugging
Face door's keyword too). Either way every SDPA call of that forward gets the one plan as its ``layout``. See Note [A plan at the model door].

Why not run the whole model on DTensors: in torch 2.13 a view that merges [B, S] fails when S carries
a strided placement, and ``nn.Linear`` on [B, S, E] makes exactly that view, so striped and head-tail
activations cannot pass through a Linear as DTensors.

A rank's loss covers its own tokens (normalise by the *global* token count), so each parameter's
gradient is that rank's share and must be summed over the CP group: FSDP / DDP over a mesh dim that
includes CP does this; standalone, call ``reduce_gradients``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from .._compat import flex_attention_op, with_sdpa
from .._deprecated import old_keywords
from ..core.agreement import agree_on_call
from ..core.attention import plan_attention, ring_spec, run_ring_attention
from ..core.batch import full_ids_from_positions
from ..core.checks import check_cp_mesh, options_error
from ..core.plan.documents import DocumentLayout, document_layout, plan_batch
from ..core.plan.layout import check_layout
from ..core.tiling import check_tile_size, tiled_forward

__all__ = ["RingSDPA", "applied", "apply_own_model", "reduce_gradients", "remove_own_model"]


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


class RingSDPA(TorchFunctionMode):
    """Routes SDPA on local sequence shards to the ring while active (``apply_context_parallel``: during
    the model's forward; ``torch_api.context_parallel``: while its context is open), and is a model's CP
    state: stored as ``_cp_dtensor_mode`` on the model and every submodule, read by hooks from the module
    they are called with, so deepcopy / pickling carry it to a copy (Note [CP state on a model] in
    hf/state.py does the same for transformers models). See Note [Module context parallel]. ``ids``: this
    rank's document ids [B | 1, S_local], or None; ``plan``: this forward's (or context's) plan, a
    ``DocumentLayout`` that every SDPA call gets as its layout, or None."""

    def __init__(self, cp_mesh: DeviceMesh, layout: str, window_size, documents: str | None, *,
                 comm_dtype: torch.dtype | None = None, kv_exchange: str = "ring"):
        super().__init__()
        self.mesh, self.layout, self.window, self.documents, self.depth = cp_mesh, layout, window_size, documents, 0
        self.comm_dtype, self.kv_exchange = comm_dtype, kv_exchange
        self.flex = flex_attention_op()  # refused: it would run on the local shard only
        self.ids: Tensor | None = None  # this forward's document ids [B, S_local]; kept for recomputation
        self.plan: DocumentLayout | None = None  # this forward's plan (Note [One plan per batch]); kept too
        self.rows: dict[int, DocumentLayout] = {}  # the plan of one row, for each batch size it served
        self.handles: list[RemovableHandle] = []  # the hooks apply_context_parallel registered
        self.root: nn.Module | None = None  # the module apply_context_parallel was applied to

    def __deepcopy__(self, memo: dict) -> RingSDPA:
        new = RingSDPA(self.mesh, self.layout, self.window, self.documents, comm_dtype=self.comm_dtype,
                       kv_exchange=self.kv_exchange)  # the mesh shared; no forward running
        memo[id(self)] = new
        new.handles, new.root = copy.deepcopy(self.handles, memo), copy.deepcopy(self.root, memo)
        return new

    def __getstate__(self) -> dict:
        return {**self.__dict__, "depth": 0, "ids": None, "plan": None, "rows": {}, "flex": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, flex=flex_attention_op())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q = args[0] if args else kwargs.get("query")
            if isinstance(q, Tensor) and not isinstance(q, DTensor):
                # eager only: who called (a compiled graph has no Python caller to ask)
                caller = "" if torch.compiler.is_compiling() else sys._getframe(1).f_globals.get("__name__", "")
                return self._sdpa(*args, caller=caller, **kwargs)
        if func is self.flex and func is not None:
            error = ("flex_attention inside a context-parallel region attends within this rank's shard only; "
                     "cp_dtensor runs SDPA calls (is_causal, documents, windows). Call "
                     "F.scaled_dot_product_attention, or run flex_attention without CP.")
            if torch.compiler.is_compiling():  # flex_attention always compiles: every rank traces this alike
                raise ValueError(error)
            agree_on_call(error, {}, self.mesh.get_group(), what="context parallel attention")
        if func is F.multi_head_attention_forward:  # See Note [SDPA inside multi_head_attention_forward] in _compat/__init__.py
            q = args[0] if args else kwargs.get("query")
            if isinstance(q, Tensor) and not isinstance(q, DTensor):
                return self._mha(args, kwargs)
        return func(*args, **kwargs)

    def _mha(self, args, kwargs):
        """``F.multi_head_attention_forward`` with its SDPA call on the ring; its ``need_weights=True``
        branch (softmax weights by matmul, no SDPA) refused on every rank."""
        call = _MHA_SIGNATURE.bind(*args, **kwargs)
        call.apply_defaults()
        if call.arguments["need_weights"]:
            agree_on_call(
                "nn.MultiheadAttention with need_weights=True computes the attention weights of this rank's shard "
                "only (no SDPA call the ring could run); pass need_weights=False.", {}, self.mesh.get_group(),
                what="context parallel attention")
        ring = functools.partial(self._sdpa, caller="torch.nn.functional")
        return with_sdpa(F.multi_head_attention_forward, ring)(*args, **kwargs)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              *, caller: str = ""):
        # query: [B, Hq, S_local, D]; key, value: [B, Hkv, S_local, D] -- this rank's tokens
        error = None  # raised on every rank by the ring's agreement check, before any K/V moves
        if caller.startswith("transformers."):  # See Note [transformers under CP] in hf/attention.py
            error = (
                f"context parallel attention got an SDPA call from transformers ({caller}), whose mask was built "
                "from this rank's local shapes. Call cp_dtensor.hf.apply_context_parallel(model, cp_mesh, "
                "layout=...) on the model first: its attention then runs on the ring with the global masks."
            )
        elif attn_mask is not None or dropout_p > 0.0:
            error = (
                "context parallel attention takes no explicit attn_mask and no dropout_p > 0; got attn_mask="
                f"{'a tensor' if attn_mask is not None else None}, dropout_p={dropout_p}. Masks come from "
                "is_causal and the documents and window of apply_context_parallel(..., documents=, window_size=) "
                "or context_parallel(..., document_ids= | position_ids=, window_size=); set the attention "
                "dropout to 0."
            )
        elif not enable_gqa and _heads(query) != _heads(key):
            error = (
                f"scaled_dot_product_attention got {_heads(query)} query heads and {_heads(key)} key/value heads "
                "with enable_gqa=False, which SDPA refuses; pass enable_gqa=True (grouped-query attention)."
            )
        if self.plan is not None:  # See Note [A plan at the model door]
            return plan_attention(query, key, value, self._rows(query), mesh=self.mesh, is_causal=bool(is_causal),
                                  scale=scale, comm_dtype=self.comm_dtype, window_size=self.window,
                                  kv_exchange=self.kv_exchange, document_ids=None, sinks=None, error=error)
        ids = self.ids
        if ids is not None and ids.shape[0] == 1 and isinstance(query, Tensor) and query.dim() == 4:
            ids = ids.expand(query.shape[0], -1)  # one row of ids for every batch row
        spec = ring_spec(self.mesh.get_group(), layout=self.layout, is_causal=bool(is_causal), scale=scale,
                         comm_dtype=self.comm_dtype, window_size=self.window, kv_exchange=self.kv_exchange)
        return run_ring_attention(query, key, value, spec, document_ids=ids, error=error)

    def _rows(self, query) -> DocumentLayout:
        """The plan for ``query``'s batch: a plan of one row ([1, N] ids, as for every row) is rebuilt for B
        equal rows once per batch size (the ring and the exchange take one row of ids per batch row)."""
        plan = self.plan
        b = query.shape[0] if isinstance(query, Tensor) and query.dim() == 4 else plan.batch
        if plan.batch != 1 or b == 1:
            return plan
        if b not in self.rows:
            self.rows[b] = document_layout(plan.ids.expand(b, -1), plan.cp_size, windows=list(plan.windows),
                                           placement=plan.placement)
        return self.rows[b]

    def take_documents(self, kwargs: dict) -> None:
        """Set this forward's documents from the top-level call's keyword arguments: a plan (``cp_layout=``, a
        ``DocumentLayout``), this rank's ``document_ids``, or ids from ``position_ids`` (Note [A plan at the
        model door])."""
        plan = kwargs.pop("cp_layout", None)
        ids = kwargs.pop("document_ids", None)
        self.ids, self.plan, self.rows = None, None, {}
        pos = kwargs.get("position_ids", kwargs.get("positions"))
        if plan is not None or self.layout == "documents":
            self.plan = self._agreed_plan(plan, ids, pos)
        elif ids is None and self.documents == "position_ids":
            if pos is None:
                raise ValueError("apply_context_parallel(documents='position_ids') needs the model to be called "
                                 "with position_ids= (or positions=) restarting at 0 for every document.")
            full = full_ids_from_positions(pos, self.mesh, layout=self.layout)  # [B, N], one all-gather
            self.plan = plan_batch(self.layout, self.mesh.size(), document_ids=full, windows=self._windows(),
                                   where="apply_context_parallel")
        else:
            self.ids = ids

    def _windows(self) -> list:
        return [self.window] if self.window is not None else [None]

    def _agreed_plan(self, plan: DocumentLayout | None, ids, pos) -> DocumentLayout:
        """The plan the forward was given, checked against the door and this rank's shard, the same on every
        rank (one small all-gather, before any K/V moves): see Note [A plan at the model door]."""
        rank, world = self.mesh.get_local_rank(), self.mesh.size()
        error = _plan_error(plan, self.layout, world, rank, ids, pos if self.documents == "position_ids" else None)
        if error is None and ids is None and isinstance(pos, Tensor):  # See Note [A plan fits its batch]
            error = plan.positions_error(rank, pos.reshape(-1, pos.shape[-1]))
        agree_on_call(error, {"plan": plan.key if error is None else -1}, self.mesh.get_group(),
                      what="apply_context_parallel")
        return plan


# Note [A plan at the model door]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The model door gets the batch already sharded, so it cannot place documents itself: a "documents"
# placement depends on the full batch's ids, and the caller shards tokens, labels and positions by it
# before the forward. So with ``layout="documents"`` the caller builds the plan (``document_layout``, from
# the full ids: positions restarting at 0 give them as ``(positions == 0).cumsum(-1)``), shards the batch
# with it (``shard_batch(..., layout=plan)``) and passes it to the forward as ``cp_layout=plan``, a keyword the
# hook takes away (the Hugging Face door's spelling; a model's own ``layout`` argument stays its own). The hook checks it
# -- built for this CP size and a placement the door takes, the positions' and ids' document starts its
# own, the positions restarting at 0 exactly where its documents start and going up by 1 inside them
# (``DocumentLayout.positions_error``: Note [A plan fits its batch]; with ``document_ids=`` the ids are
# checked instead) -- and the ranks agree on it (its key: equal ids on every rank) before the first SDPA call. A named
# layout needs no plan from the caller: from ``position_ids`` the hook gathers the start flags once and
# builds the named placement's plan itself; from ``document_ids`` (this rank's shard) it passes them to
# the ring as they are (no communication).


def _plan_error(plan, layout: str, world: int, rank: int, ids, pos) -> str | None:
    """This rank's problem with the plan a forward (or context) got, or None; ``ids`` / ``pos``: this rank's
    shard of the batch's document ids / positions restarting at 0, checked against the plan when given."""
    if plan is None:
        return (f"apply_context_parallel(layout={layout!r}) needs each batch's plan: plan = "
                f"cp_dtensor.document_layout(ids, {world}) from the full batch's ids (ids = (positions == 0)"
                ".cumsum(-1) for positions restarting at 0), the batch sharded by it (cp_dtensor.shard_batch(..., "
                "layout=plan)), and model(..., cp_layout=plan).")
    if not isinstance(plan, DocumentLayout):
        return (f"cp_layout= takes this batch's plan (cp_dtensor.document_layout(ids, {world}) of the full batch); "
                f"got {type(plan).__name__}.")
    if plan.cp_size != world:
        return (f"this batch's plan was built for {plan.cp_size} ranks; the CP mesh has {world}. Build it with "
                f"cp_dtensor.document_layout(ids, {world}).")
    if layout != "documents" and plan.placement != layout:
        return (f"this batch's plan has placement {plan.placement!r}; the model's layout is {layout!r}. Build it "
                f"with placement={layout!r}, or apply_context_parallel(..., layout={plan.placement!r}).")
    for name, got in (("document_ids", ids), ("position_ids", pos)):
        if got is None:
            continue
        if not isinstance(got, Tensor) or got.dim() not in (1, 2) or got.shape[-1] != plan.s_local:
            return (f"{name} must be this rank's shard [B, {plan.s_local}] of the batch the plan was built for; "
                    f"got {getattr(got, 'shape', type(got).__name__)}.")
        got = got.detach().to("cpu", torch.int64).reshape(-1, plan.s_local)
        want = plan.local_ids(rank) if name == "document_ids" else _starts(plan, rank)  # [B_plan, S]
        if name == "position_ids":  # a position 0 exactly where the plan's documents start
            got = (got == 0) | plan.local_positions(rank, plan.cp_size, plan.seq_len).eq(0)  # a row may start mid-document
        rows = max(got.shape[0], want.shape[0])
        if (got.shape[0] not in (1, rows) or want.shape[0] not in (1, rows)
                or not torch.equal(got.expand(rows, -1), want.expand(rows, -1))):
            return (f"this rank's {name} are not the shard of the batch its plan was built for: build the plan "
                    "from this batch's full ids and shard the batch with it (cp_dtensor.shard_batch(..., "
                    "layout=plan)).")
    return None


def _starts(plan: DocumentLayout, rank: int) -> Tensor:
    """bool [B, S]: where the tokens ``rank`` holds start a document (the plan's ids change; a row's first)."""
    ids = plan.ids
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return new.gather(1, plan.local_positions(rank, plan.cp_size, plan.seq_len))


def _heads(x) -> int | None:
    return x.shape[1] if isinstance(x, Tensor) and x.dim() == 4 else None


_ATTR = "_cp_dtensor_mode"  # the RingSDPA on the model and every submodule


def _take(model: nn.Module, args, kwargs):
    getattr(model, _ATTR).take_documents(kwargs)
    return args, kwargs


def _enter(module: nn.Module, *_) -> None:
    mode = getattr(module, _ATTR)
    if mode.depth == 0:
        mode.__enter__()
    mode.depth += 1


def _exit(module: nn.Module, *_) -> None:
    mode = getattr(module, _ATTR)
    mode.depth -= 1
    if mode.depth == 0:
        mode.__exit__(None, None, None)


def apply_own_model(
    model: nn.Module, mesh: DeviceMesh, *, layout: str = "striped", window_size: tuple[int, int] | None = None,
    documents: str | None = None, comm_dtype: torch.dtype | None = None, kv_exchange: str = "ring",
    sequence_tiling: bool | int = False,
) -> nn.Module:
    """``cp_dtensor.apply_context_parallel`` for a model that is not a transformers one (doors.py
    dispatches): the SDPA mode's hooks. See Note [Module context parallel]."""
    check_cp_mesh(mesh)
    if layout != "documents":  # See Note [A plan at the model door]
        check_layout(layout)
    elif kv_exchange != "ring":
        raise ValueError(f"apply_context_parallel(layout='documents') sends each needed K/V row once by its own "
                         f"exchange (Note [Document exchange]); got kv_exchange={kv_exchange!r}. Drop it, or use a "
                         "layout name.")
    tile = check_tile_size(sequence_tiling)
    tiled = [m for name, m in model.named_modules() if name.rpartition(".")[2] in _TILED] if tile else []
    if tile and not tiled:
        raise ValueError(f"sequence_tiling={sequence_tiling!r} found no MLP to tile in {type(model).__name__}: it tiles "
                         f"submodules named {', '.join(_TILED)}. Drop sequence_tiling, or name the MLPs so.")
    if documents not in (None, "position_ids"):
        raise ValueError(f"documents must be None or 'position_ids'; got {documents!r}.")
    error = options_error("apply_context_parallel", comm_dtype=comm_dtype, kv_exchange=kv_exchange,
                          window_size=window_size)
    if error is not None:  # the same arguments on every rank: every rank raises here, before any communication
        raise ValueError(error)
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("apply_context_parallel was already applied to this model (or to a module holding it).")
    mode = RingSDPA(mesh, layout, window_size, documents, comm_dtype=comm_dtype, kv_exchange=kv_exchange)
    mode.root = model
    mode.handles.append(model.register_forward_pre_hook(_take, with_kwargs=True))
    for m in model.modules():
        setattr(m, _ATTR, mode)
        mode.handles += [m.register_forward_pre_hook(_enter), m.register_forward_hook(_exit, always_call=True)]
    for m in tiled:  # See Note [Sequence tiling] in core/tiling.py
        m._cp_dtensor_tile = tile
        m.forward = functools.partial(_tiled_forward, m)
    return model


_TILED = ("mlp", "feed_forward", "ffn", "moe")  # the submodule names sequence_tiling= tiles in own models


def _tiled_forward(module: nn.Module, x: Tensor, *args, **kwargs):
    return tiled_forward(functools.partial(type(module).forward, module), x, *args, tile_size=module._cp_dtensor_tile,
                         what=type(module).__name__, **kwargs)


def applied(model: nn.Module) -> bool:
    """Whether ``apply_own_model`` changed ``model`` (or a module holding it)."""
    return getattr(model, _ATTR, None) is not None


def remove_own_model(model: nn.Module) -> nn.Module:
    """``cp_dtensor.remove_context_parallel`` of a model ``apply_own_model`` changed (doors.py dispatches)."""
    mode = getattr(model, _ATTR)
    if mode.depth:
        raise ValueError("remove_context_parallel was called inside the model's forward; call it after.")
    if mode.root is not model:
        raise ValueError(f"remove_context_parallel takes the model apply_context_parallel was applied to; "
                         f"{type(model).__name__} is a submodule of one.")
    for handle in mode.handles:
        handle.remove()
    for m in model.modules():
        if getattr(m, _ATTR, None) is mode:
            delattr(m, _ATTR)
        if m.__dict__.pop("_cp_dtensor_tile", None) is not None:
            m.__dict__.pop("forward", None)
    return model


@old_keywords("cp_dtensor.reduce_gradients", cp_mesh="mesh")
@torch.no_grad()
def reduce_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Sum every parameter gradient over the CP group (each rank's covers only its own tokens); a parameter
    whose gradient is None on some ranks only (an MoE expert no token of their shards reached) gets zeros there
    first (one small all-reduce agrees on which). Not needed when FSDP / DDP already reduce over a mesh dim that
    includes CP."""
    check_cp_mesh(mesh)
    group = mesh.get_group()
    params = list(model.parameters())
    if not params:
        return
    # a parameter only some ranks' tokens reached (an MoE expert no token of this shard was routed to) has a
    # gradient there and None here: agree on which have one first, so every rank sums the same tensors
    have = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(have, group=group)
    for p, n in zip(params, have.tolist()):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=group)
