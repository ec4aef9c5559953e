"""The state context parallelism keeps for one transformers model: one owner, carried by copies, removable.

Note [CP state on a model]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Everything CP keeps for one model lives in one :class:`HFState`, stored as ``_cp_dtensor_hf`` on the
model and on every submodule (the same object). Nothing is kept in module globals and nothing is
captured by a closure: the hooks are module-level functions that read the state from the module they
are called with (the attention function, the linear layers and the cache read it the same way), and
``model.generate`` is a :class:`CPGenerate` object in the model's ``__dict__`` that holds the model.
So whatever copies a module copies its CP state, and the copy serves its *own* weights:

* ``copy.deepcopy(model)`` (an EMA or reference copy): the memo maps the one state to one new state,
  shared by the copy's modules, and :class:`CPGenerate` and the hook handles to the copy's own. The
  mesh is shared (it names process groups); the per-call fields start empty (:meth:`HFState.__deepcopy__`).
* ``torch.save(model)`` / ``torch.load``: the same through pickling; the mesh pickles by its process
  groups' names, so load it where those groups exist (the same ranks). Per-call fields are not saved.
* ``state_dict()`` / ``load_state_dict()``: tensors only; the state is untouched and the hooks read the
  weights from the module when called.

Fields: the options (mesh, layout, documents); what :func:`remove_context_parallel` undoes (each
(sub-)config's attention implementation, the hook handles); the current forward's (the top-level
call's refusal, the documents last derived -- reused by the later layers and activation checkpointing's
recomputation --, ``logits_to_keep``); and one slot per feature module, each holding that module's
own declared dataclass: ``generating`` (generate.py: the generate() call in progress, None outside
one) and ``linear`` (linear.py: a hybrid model's linear layers, None for a model without them).
A copy gets ``linear.fresh()`` (the per-call fields emptied) and no ``generating``. During a decode step
``decoding`` holds the attention generate.py registered for it, which the attention function calls in
place of the ring: hf/attention.py never calls into generate.py (it only installs it).

A feature building on this keeps the same rules: its state in a declared dataclass in a slot of
``HFState`` (a new field here), its hooks module-level functions reading ``getattr(module, ATTR)``,
their handles appended to ``state.handles``, and a generate() of its own as ``CPGenerate(model, fn)``
with ``fn(model, *args, **kwargs)`` a module-level function.

:func:`remove_context_parallel` undoes ``cp_dtensor.hf.apply_context_parallel`` in place and returns the
plain module: hooks removed by their handles, the attribute deleted from every module, ``generate`` back to
the class's, and each (sub-)config's attention implementation restored. The pass-through dispatchers
linear.py puts in transformers' modeling modules stay (they run the original function whenever no
CP layer is running, so a plain model is unaffected).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

__all__ = ["ATTR", "CPGenerate", "HFState", "attach", "implementations", "remove_context_parallel", "state_of"]

ATTR = "_cp_dtensor_hf"  # the attribute holding the HFState on the model and every submodule

_PER_CALL = ("pending", "plan", "last", "id_range", "keep_logits", "generating", "decoding", "real", "labels",
             "scored_pads")


@dataclass(eq=False)
class HFState:
    """Context parallelism's state for one transformers model. See Note [CP state on a model]."""

    mesh: DeviceMesh  #: the 1-D CP mesh
    layout: str  #: the sequence layout of every rank's shard
    documents: str | None  #: None (transformers' rule for packed sequences) or "position_ids"
    attn_implementation: dict  #: each (sub-)config's attention implementation before CP (restored on removal)
    handles: list[RemovableHandle] = field(default_factory=list)  #: the hooks CP registered
    pending: str | None = None  #: the top-level call's refusal, raised by its first attention call
    plan: Any = None  #: the top-level call's ``cp_layout=`` (its batch's DocumentLayout), kept until the next call
    last: tuple | None = None  #: ((positions, version, mask, use_cache, B), (ids, error)) last derived
    id_range: tuple[int, int] | None = None  #: the global (min, max) of the last documents derived
    keep_logits: Any = 0  #: the top-level call's ``logits_to_keep`` (generate's prefill gathers those rows)
    generating: Any = None  #: generate.GenerateCall while a generate() call runs
    decoding: Any = None  #: during a decode step of generate(): the attention it registered (generate.decode_attention)
    linear: Any = None  #: linear.LinearState for a hybrid linear-attention model
    comm_dtype: Any = None  #: ring_attention's comm_dtype for every ring call (None: K/V as they are)
    kv_exchange: str = "ring"  #: ring_attention's kv_exchange for every ring call
    mla: str | None = None  #: "latent", or why the MLA layers run the ring (None: none): hf/latent.py's mla_path
    #: the Trainer's next call: this rank's tokens of the user's rows ([S_local] or [B, S_local] bool; None: no CP
    #: padding), which the router loss counts (Note [Router loss under CP] in router.py); cleared after the call
    real: Any = None
    labels: Any = None  #: the top-level call's ``shift_labels`` (this rank's shard), for Note [Scored pads]
    scored_pads: Any = None  #: the forward's (left, right) pad tokens the loss scores: global (row, column) or None
    uniform_pads: bool = False  #: the attention ran "eager" without sinks at CP=1 (Note [Scored pads])

    def _fresh(self, copied: dict) -> None:
        for f in fields(self):
            if f.name in _PER_CALL:
                copied[f.name] = f.default
        if self.linear is not None:
            copied["linear"] = self.linear.fresh()

    def __deepcopy__(self, memo: dict) -> HFState:
        new = object.__new__(HFState)
        memo[id(self)] = new
        state = {"mesh": self.mesh, "layout": self.layout, "documents": self.documents,
                 "attn_implementation": copy.deepcopy(self.attn_implementation, memo),
                 "handles": copy.deepcopy(self.handles, memo)}
        self._fresh(state)
        new.__dict__.update({**self.__dict__, **state})
        return new

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        self._fresh(state)
        return state


class CPGenerate:
    """``model.generate`` under CP: ``fn(model, *args, **kwargs)`` (generate.generate; a module-level
    function). An object holding the model, not a closure over it, so that copies of the model (deepcopy,
    pickling) generate with their own weights -- see Note [CP state on a model]."""

    def __init__(self, model: nn.Module, fn: Callable):
        self.model, self.fn = model, fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.model, *args, **kwargs)


def state_of(module: nn.Module) -> HFState | None:
    return getattr(module, ATTR, None)


def implementations(config) -> dict:
    """transformers' nested ``attn_implementation`` dict for ``config`` and its sub-configs, as they are now."""
    out = {"": config._attn_implementation}
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out[key] = implementations(sub)
    return out


def attach(model: nn.Module, mesh: DeviceMesh, layout: str, documents: str | None, before: dict) -> HFState:
    """A new state on ``model`` and all its submodules; ``before``: :func:`implementations` before CP."""
    state = HFState(mesh, layout, documents, before)
    for m in model.modules():
        setattr(m, ATTR, state)
    return state


def remove_context_parallel(model: nn.Module) -> nn.Module:
    """Take context parallelism off a transformers model, in place; returns the plain ``model``.

    Undoes ``cp_dtensor.hf.apply_context_parallel``: the hooks, the per-model state and the generate() wrapper go,
    and each (sub-)config gets back the attention implementation it had. The weights are untouched
    (whatever training did to them stays). For a plain copy keep the CP model:
    ``plain = remove_context_parallel(copy.deepcopy(model))``. See Note [CP state on a model]."""
    state, gen = state_of(model), model.__dict__.get("generate")
    if state is None and getattr(model, "_cp_dtensor_mode", None) is not None:
        raise ValueError("this model runs under cp_dtensor.apply_context_parallel: take it off with "
                         "cp_dtensor.remove_context_parallel(model).")
    if state is None or not (isinstance(gen, CPGenerate) and gen.model is model):
        raise ValueError(f"remove_context_parallel takes the model cp_dtensor.hf.apply_context_parallel was applied to; "
                         f"{type(model).__name__} is {'a submodule of one' if state is not None else 'not one'}.")
    if state.generating is not None:
        raise ValueError("remove_context_parallel was called inside the model's generate(); call it after.")
    for handle in state.handles:
        handle.remove()
    for m in model.modules():
        if getattr(m, ATTR, None) is state:
            delattr(m, ATTR)
        if "_cp_dtensor_token" in m.__dict__:
            del m.__dict__["_cp_dtensor_token"]
    model.__dict__.pop("generate", None)
    model.set_attn_implementation(state.attn_implementation)
    if getattr(model, "_cp_dtensor_tiling", None) is not None:  # sequence_tiling= (hf/tiling.py)
        from .tiling import remove_sequence_tiling

        remove_sequence_tiling(model)
    return model
