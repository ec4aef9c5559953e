"""transformers' hybrid linear-attention models under CP: Qwen3-Next, Qwen3.5 (dense, MoE), Kimi Linear, and
the same Gated DeltaNet / KDA layers in OLMo-Hybrid, Lara-Mini and Bailing-Hybrid.

Every touch of transformers' linear-attention internals is here, in ``FAMILIES`` (tests/hf/test_hf_linear.py
checks that each symbol still exists). hf/attention.py calls :func:`linear_layers` (checks only) before it changes
the model, then :func:`enable_linear`.

Note [Linear attention in transformers under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A Gated DeltaNet / KDA layer mixes tokens in two places, both module-level functions of its modeling
module that the layer's forward looks up in the module's globals at call time: the short causal
convolution (``causal_conv1d_fn``, over [B, C, S]) and the chunked delta rule
(``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention``; either name is transformers' wrapper
that picks fla's kernel when installed). ``enable_linear`` swaps those two globals for dispatchers that
pass every call through unchanged unless a layer of a CP model is running: a forward pre-hook on each
linear layer sets a context variable holding the layer's CP state (and the post-hook clears it), and
while it is set the dispatcher runs ``cp_dtensor.linear_attention``'s sharded op on this rank's shard,
with the original function as the kernel. So no layer code is copied; a model of the same family
without CP, in the same process, runs as before. Importing cp_dtensor patches nothing. The post-hook
checks that the layer made exactly one call of each (a layer whose forward a hub kernel replaced would
otherwise run on its shard alone).

Documents. The linear layers see neither position_ids nor the 2-D padding mask (transformers passes them
``create_recurrent_attention_mask``'s local view, None on a rank whose shard has no padding), so a
pre-hook on the base model keeps the call's position_ids, attention_mask and document_ids, and the
first linear layer of each call derives the documents from the *global* view by hf/attention.py's rule (Note
[transformers under CP]: padding from the mask, else packed sequences from the position ids, or
``document_ids=``), after agreeing on the call across ranks; the later layers and activation
checkpointing's recomputation reuse them until the next call. That derivation gathers the global
positions and mask (O(N) int64s); the agreement's gather also carries, per run of this rank, whether its
positions are consecutive and their first and last values per row, and whether the mask is all ones, and
when those prove a single document per row (no mask and positions consecutive across the runs in global
order, or every mask all ones -- the common case) the O(N) gather is skipped: then an all-linear model
sends per call bytes independent of the sequence length (tests/hf/test_hf_linear.py counts them). The
recurrent state restarts at each document and the convolution does not reach across one, as fla's
kernels run packed sequences (``cu_seqlens``). transformers' torch fallback runs packed sequences as one
sequence (it cannot keep them apart); under CP they are kept apart. Padding: transformers zeroes the pad tokens' hidden states
(``apply_mask_to_padding_states``) with this rank's shard of the mask, and each pad token is a document
of its own, so the real tokens see exactly what they see at CP=1.

Caches. A recurrent state and a conv state summarise the whole prefix, so a *forward* call of a hybrid
model under CP runs without a cache: the base model's ``use_cache`` defaults to False, and
``use_cache=True`` or a cache object raise, on every rank before any state moves. ``generate()`` builds
and fills its own cache: Note [Hybrid generate() under CP].

Note [Hybrid generate() under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``model.generate()`` runs generate.py's wrapper for hybrids too (Note [generate() under CP]): the same
checks and refusals on every rank before the first token, the same agreement, a ``ShardedCache`` -- whose
linear-attention layers are ``ReplicatedLinearLayer`` s holding the *full* states (transformers'
``LinearAttentionLayer``), the attention layers this rank's share of the K/V.

* Prefill (the base model's call with generate()'s cache and its ``prefill`` step): the prompt, padded on
  the left to the layout's unit, arrives sharded; the linear layers run under CP as in training (the
  documents agreed and derived once per call; left padding makes each pad token a document of its own),
  with two differences: the conv dispatcher asks ``sharded_causal_conv1d`` for the conv state and stores
  it in the layer's cache (the layer's own ``update_conv_state`` hands the shard back unchanged), and the
  delta-rule dispatcher answers the layer's ``output_final_state=True`` with ``sharded_delta_rule``'s final
  state, which the layer itself then stores (``update_recurrent_state``) -- Note [Prefill for decoding] in
  core/linear/linear_attention.py. The attention layers write their shares and run the ring.
* Decode (the ``decode`` step): the new token is the same on every rank and the linear layers' hooks stand
  aside: transformers' own single-token path (``causal_conv1d_update``, the recurrent kernel) steps the full
  states, alike on every rank, with no communication; the attention layers run ``sharded_cache_attention``.
  Every rank computes the same logits, hence the same tokens and the same stopping step.

So ``out.past_key_values`` holds this rank's share of every attention layer and every linear layer's full
states; its length (``get_seq_length``) is the global one; cropping, reordering, re-batching and past
recording raise on every rank (nothing rank-dependent decides them). A forward call with that cache, or
any other, is refused as above.

Layouts. The sharded ops summarise each contiguous run of tokens a rank holds by one affine map of the
state; headtail (two runs a rank, the causal ring's balance) and contiguous work, striped (one run per
token) is refused when CP is applied.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor, nn

from .._extras import require

require("hf", "cp_dtensor.hf (hybrid linear-attention transformers models under context parallelism)")

from ..core.agreement import Rules, agree_objects  # noqa: E402
from ..core.linear.linear_attention import (  # noqa: E402, I001
    check_linear_layout,
    run_owner,
    run_starts,
    sharded_causal_conv1d,
    sharded_delta_rule,
)
from ..core.plan.layout import check_layout  # noqa: E402
from .state import ATTR, HFState  # noqa: E402

__all__ = ["FAMILIES", "LinearState", "enable_linear", "linear_layers"]


class Family(NamedTuple):
    """One transformers linear-attention layer and the module-level functions its forward calls."""

    module: str  #: the modeling module (its globals are what the layer's forward reads)
    layer: str  #: the linear-attention layer class in it
    conv: str  #: the causal short convolution, transformers' causal_conv1d_fn(x [B, C, S], weight [C, K], ...)
    rule: str  #: the chunked delta rule (q, k, v, g=, beta=, initial_state=, output_final_state=, ...)


FAMILIES = (
    Family("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet", "causal_conv1d_fn",
           "torch_chunk_gated_delta_rule"),
    Family("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet", "causal_conv1d_fn",
           "torch_chunk_gated_delta_rule"),
    Family("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet", "causal_conv1d_fn",
           "torch_chunk_gated_delta_rule"),
    Family("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention", "causal_conv1d_fn",
           "chunk_kimi_delta_attention"),
    # the same layers in other transformers models
    Family("transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet", "causal_conv1d_fn",
           "torch_chunk_gated_delta_rule"),
    Family("transformers.models.lara_mini.modeling_lara_mini", "LaraMiniGatedDeltaNet", "causal_conv1d_fn",
           "torch_chunk_gated_delta_rule"),
    Family("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridDeltaAttention",
           "causal_conv1d_fn", "chunk_kimi_delta_attention"),
)
# the layers' forward keywords read by the hooks (checked by the symbol test, with the table)
LAYER_KWARGS = ("hidden_states", "cache", "attention_mask")

_RUNNING: contextvars.ContextVar[_Running | None] = contextvars.ContextVar("cp_dtensor_linear", default=None)


def _family_classes() -> list[tuple[Family, type]]:
    out = []
    for fam in FAMILIES:
        try:
            out.append((fam, getattr(importlib.import_module(fam.module), fam.layer)))
        except (ImportError, AttributeError):  # a transformers without this model: nothing of it to serve
            continue
    return out


def _layer_count(config) -> int:
    types = getattr(config, "layer_types", None) or ()
    n = sum(t == "linear_attention" for t in types)
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            n += _layer_count(sub)
    return n


def linear_layers(model: nn.Module, layout: str) -> list[tuple[nn.Module, Family]]:
    """The model's linear-attention layers and their families; raises (changing nothing) when CP cannot
    serve them. The same on every rank (no communication)."""
    check_layout(layout)
    name = type(model).__name__
    classes = _family_classes()
    found = [(m, fam) for m in model.modules() for fam, cls in classes if isinstance(m, cls)]
    expected = _layer_count(model.config)
    if len(found) != expected:
        served = ", ".join(f.layer for f in FAMILIES)
        raise ValueError(
            f"{name} has {expected} linear_attention layers (config.layer_types) but {len(found)} of the kinds context "
            f"parallelism serves ({served}); run it without CP.")
    if layout == "striped":
        raise ValueError(
            f"{name} has linear-attention layers, which need each rank's tokens in contiguous runs: their recurrent "
            "state passes between ranks as one affine summary per run ([dk, dk + dv] per head), and the striped "
            "layout makes every token a run of its own. Use layout=\"headtail\" for hybrid models (it keeps the "
            "causal attention layers' load balance: two runs a rank), or \"contiguous\".")
    check_linear_layout(layout)
    return found


@dataclass(eq=False)
class LinearState:
    """A hybrid model's linear layers under CP: ``HFState.linear`` (Note [CP state on a model] in hf/state.py).
    Every field but ``derive`` belongs to the current call (:meth:`fresh`: what a copy of the model starts with)."""

    derive: Callable  #: hf/attention.py's document rule: derive(state, positions, mask, use_cache, b, probe=) -> (ids, error)
    call: dict | None = None  #: position_ids, attention_mask, document_ids of the base model's call
    pending: str | None = None  #: this call's cache refusal, raised by the first linear layer
    docs: tuple[Tensor | None] | None = None  #: this call's documents, once derived
    generating: str | None = None  #: "prefill" / "decode": a forward of generate() under CP, else None

    def fresh(self) -> LinearState:
        return LinearState(self.derive)


class _Running(NamedTuple):
    state: HFState
    ids: Tensor | None  # this rank's document ids [B, S_local], or None
    calls: dict  # how many times the layer called each dispatcher
    cache: object | None  # generate()'s prefill: the layer's generate.ReplicatedLinearLayer, which keeps the states


_NO_CACHE = ("a hybrid linear-attention model under context parallelism runs without a cache in a forward call: its "
             "recurrent and conv states summarise the whole prefix, which no rank holds. Call it with use_cache=False "
             "(the default under CP) and no cache; model.generate() under CP builds and fills its own cache.")


def _generating(state: HFState, cache) -> str | None:
    """"prefill" / "decode" when this forward is generate()'s under CP (its own cache), else None."""
    call = state.generating
    if cache is None or call is None or call.step is None or cache is not call.cache:
        return None
    return call.step.kind


def _bound(module: nn.Module, args, kwargs) -> tuple[dict, dict]:
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = dict(kwargs)
    extra = bound.get("kwargs") if isinstance(bound.get("kwargs"), dict) else {}
    return bound, extra


def _take_call(module: nn.Module, args, kwargs):
    """Base-model pre-hook: keep the call's inputs for the documents; no cache under CP but generate()'s own."""
    hybrid: LinearState = getattr(module, ATTR).linear
    bound, extra = _bound(module, args, kwargs)
    get = lambda name: bound.get(name, extra.get(name))  # noqa: E731
    cache = next((get(n) for n in ("cache", "past_key_values", "cache_params") if get(n) is not None), None)
    hybrid.generating = _generating(getattr(module, ATTR), cache)  # Note [Hybrid generate() under CP]
    hybrid.pending = _NO_CACHE if hybrid.generating is None and (cache is not None or get("use_cache")) else None
    if get("use_cache") is None and "use_cache" not in bound or "use_cache" in kwargs and kwargs["use_cache"] is None:
        kwargs = {**kwargs, "use_cache": False}  # merge_with_config_defaults would take config.use_cache (True)
    hybrid.call = dict(position_ids=get("position_ids"), attention_mask=get("attention_mask"),
                       document_ids=get("document_ids"))
    hybrid.docs = None
    return args, kwargs


def _call_error(state: HFState, hidden, kwargs) -> str | None:
    """What this rank cannot run, from the call kept by the base model and the first layer's inputs."""
    hybrid = state.linear
    if state.pending is not None or hybrid.pending is not None:
        return state.pending or hybrid.pending
    if kwargs.get("cache") is not None and hybrid.generating is None:
        return _NO_CACHE
    if hybrid.call is None:
        return ("a linear-attention layer under CP ran outside its model's forward: call the model (or its base "
                "model), which hands the layers the position ids and padding they need.")
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        return f"a linear-attention layer expects hidden_states [B, S_local, E]; got {type(hidden).__name__}."
    b, s = hidden.shape[:2]
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seqlens") is not None:
        return ("cu_seq_lens are not supported under context parallelism; for packed sequences pass position_ids "
                "that restart at 0 per sequence, sharded like the tokens.")
    pos, mask, ids = (hybrid.call[k] for k in ("position_ids", "attention_mask", "document_ids"))
    if pos is None:
        return ("a model under context parallelism needs position_ids=: the global positions of this rank's tokens, "
                "sharded like them (cp_dtensor.shard_batch((tokens, positions), cp_mesh, layout=...)).")
    if pos.dim() == 3 and pos.shape[0] == 4:  # Qwen3.5: the text row, then three multimodal rows
        pos = pos[0]
    if pos.dim() != 2 or pos.shape[-1] != s or pos.shape[0] not in (1, b):
        return (f"position_ids must be [B, S_local] or [1, S_local] = [{b}, {s}]; got {tuple(pos.shape)} "
                "(multi-axis positions are not supported under CP).")
    if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2 and tuple(mask.shape) == (b, s)):
        shape = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
        return (f"an explicit {shape} attention mask cannot be split across CP ranks; pass a 2-D padding "
                f"attention_mask [B, S_local] = [{b}, {s}] sharded like the tokens, or none.")
    if ids is not None and mask is not None:
        return "pass document_ids= or a padding attention_mask, not both; fold the padding into the documents."
    if ids is not None and not (isinstance(ids, Tensor) and tuple(ids.shape) == (b, s) and not ids.is_floating_point()):
        return f"document_ids must be an integer tensor [B, S_local] = [{b}, {s}]; got {getattr(ids, 'shape', ids)}."
    return None


def _positions(call: dict, b: int) -> Tensor:
    pos = call["position_ids"]
    return (pos[0] if pos.dim() == 3 else pos).expand(b, -1)


def _runs_summary(call: dict, b: int, layout: str, rank: int, world: int):
    """This rank's share of the one-document test (Note [Linear attention in transformers under CP]):
    (mask: "none" / "ones" / "other", per run: (consecutive positions in every row, first and last position
    per row)); None when the call passes document_ids (nothing to derive)."""
    if call["document_ids"] is not None:
        return None
    mask = call["attention_mask"]
    state = "none" if mask is None else "ones" if bool((mask == 1).all()) else "other"
    pos = _positions(call, b).long()
    s = pos.shape[1]
    runs = []
    for s0, _ in run_starts(layout, rank, world, s):
        run = pos[:, s0:s0 + s // (2 if layout == "headtail" else 1)]
        runs.append((bool((run.diff(dim=1) == 1).all()), run[:, 0].tolist(), run[:, -1].tolist()))
    return state, runs


def _one_document(summaries: list, layout: str, world: int) -> bool:
    """Whether the summaries of every rank prove the call has no documents: every rank's mask all ones
    (transformers then looks at nothing else), or no mask anywhere and positions consecutive across the
    global sequence (no packed sequences)."""
    if any(x is None for x in summaries):
        return False
    states = {state for state, _ in summaries}
    if states == {"ones"}:
        return True
    if states != {"none"}:
        return False
    last = None
    for j in range(world * len(summaries[0][1])):  # the runs in global order
        r, i = run_owner(layout, world, j)
        consecutive, first, end = summaries[r][1][i]
        if not consecutive or (last is not None and any(f != e + 1 for f, e in zip(first, last))):
            return False
        last = end
    return True


# the first linear layer's call agreement (Note [One agreement] in core/agreement.py)
_CALL = Rules(
    "context parallelism", ("layout", "hidden shape", "dtype", "document_ids"),
    refused="{what} refused the call on rank(s) {rank_list}: {error}",
    differ="a hybrid model under CP needs the same call on every rank of the CP group; got {table}. {advice}",
    advice="Every rank must hold an equal-length shard of one batch and pass the same options.",
)


def _start(state: HFState, hidden, kwargs) -> None:
    """The first linear layer of a call: agree across ranks (Note [One agreement] in core/agreement.py, as
    generate() does: one gather of (error, fingerprint, runs summary)), then derive the documents."""
    ctx, hybrid = state, state.linear
    err = _call_error(state, hidden, kwargs)
    call = hybrid.call or {}
    world = ctx.mesh.size()
    # (a mask on some ranks only is found by the documents' gather, which every rank joins)
    fingerprint = summary = None
    if err is None:
        fingerprint = (ctx.layout, tuple(hidden.shape), str(hidden.dtype), call["document_ids"] is not None)
        summary = _runs_summary(call, hidden.shape[0], ctx.layout, ctx.mesh.get_local_rank(), world)
    summaries = agree_objects(_CALL, fingerprint, err, ctx.mesh.get_group(), extra=summary)
    # the same summary on every rank: maybe the full inputs on every rank -- the O(N) derivation below
    # tells (Note [Unsharded inputs] in hf/attention.py)
    one_document = (world > 1 and _one_document(summaries, ctx.layout, world)
                    and any(x != summaries[0] for x in summaries))
    ids = call["document_ids"]
    if ids is None and not one_document:  # the global view: O(N) ids gathered (hf/attention.py's rule)
        pos = call["position_ids"]
        ids, err = hybrid.derive(state, pos[0] if pos.dim() == 3 else pos, call["attention_mask"], False,
                                 hidden.shape[0], probe=hidden)
        if err is not None:  # derived from the global view: the same on every rank
            raise ValueError(err)
    hybrid.docs = (ids,)


def _layer_pre(layer: nn.Module, args, kwargs):
    state: HFState = getattr(layer, ATTR)
    generating = state.linear.generating
    if generating == "decode":  # transformers' own step on the full states, alike on every rank
        return args, kwargs
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if state.linear.docs is None:
        _start(state, hidden, kwargs)
    elif kwargs.get("cache") is not None and generating is None:  # the same on every rank
        raise ValueError(_NO_CACHE)
    cache = kwargs.get("cache") if generating == "prefill" else None
    keep = cache.layers[layer.layer_idx] if cache is not None else None
    layer._cp_dtensor_token = _RUNNING.set(_Running(state, state.linear.docs[0], {"conv": 0, "rule": 0}, keep))
    return args, kwargs


def _layer_post(layer: nn.Module, args, kwargs, output):
    token = getattr(layer, "_cp_dtensor_token", None)
    if token is None:
        return output
    run = _RUNNING.get()
    _RUNNING.reset(token)
    layer._cp_dtensor_token = None
    if output is not None and run is not None and run.calls != {"conv": 1, "rule": 1}:
        raise RuntimeError(
            f"{type(layer).__name__}.forward made {run.calls} calls of the convolution and the delta rule that context "
            "parallelism serves (one each expected): its forward no longer calls transformers' module functions (a hub "
            "kernel, use_kernels=True?), so it saw only this rank's shard. Run it without kernel replacement.")
    return output


def _conv_dispatcher(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def conv(*args, **kwargs):
        run = _RUNNING.get()
        if run is None:
            return original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments  # (hidden_states [B, C, S_local], weight [C, K], bias, activation)
        run.calls["conv"] += 1
        ctx = run.state
        out = sharded_causal_conv1d(a["hidden_states"], a["weight"], a.get("bias"), a.get("activation"),
                                    mesh=ctx.mesh.get_group(), layout=ctx.layout, document_ids=run.ids,
                                    output_final_state=run.cache is not None)
        if run.cache is None:
            return out
        out, state = out  # generate()'s prefill: keep the prompt's last K inputs for decoding
        run.cache.store_conv(state)
        return out

    conv._cp_dtensor_original = original
    return conv


def _rule_dispatcher(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def rule(*args, **kwargs):
        run = _RUNNING.get()
        if run is None:
            return original(*args, **kwargs)
        a = signature.bind(*args, **kwargs).arguments  # q, k [B, S_local, Hk, dk]; v [B, S_local, Hv, dv]; g; beta
        final = bool(a.get("output_final_state"))
        if a.get("initial_state") is not None or final and run.cache is None:
            raise ValueError(_NO_CACHE)  # the call's cache check refused this already, on every rank
        run.calls["rule"] += 1
        ctx = run.state
        extra = {"chunk_size": a["chunk_size"]} if "chunk_size" in a else {}  # the rest: the model's call kwargs
        out = sharded_delta_rule(original, a["query"], a["key"], a["value"], a["g"], a["beta"],
                                 mesh=ctx.mesh.get_group(), layout=ctx.layout, document_ids=run.ids,
                                 use_qk_l2norm_in_kernel=bool(a.get("use_qk_l2norm_in_kernel", False)),
                                 output_final_state=final, **extra)
        return out if final else (out, None)  # final: (o, the state after the prompt), which the layer caches

    rule._cp_dtensor_original = original
    return rule


def _install(fam: Family) -> None:
    """Swap the family's two module functions for dispatchers (once per process; they pass through)."""
    module = importlib.import_module(fam.module)
    for name, make in ((fam.conv, _conv_dispatcher), (fam.rule, _rule_dispatcher)):
        current = getattr(module, name)
        if getattr(current, "_cp_dtensor_original", None) is None:
            setattr(module, name, make(current))


def enable_linear(model: nn.Module, state: HFState, layers: list[tuple[nn.Module, Family]], derive: Callable) -> None:
    """Serve the linear layers found by :func:`linear_layers` under CP (model changed in place; the hooks'
    handles go to ``state``); ``derive``: hf/attention.py's document rule, a module-level function. See Note [Linear
    attention in transformers under CP]."""
    state.linear = LinearState(derive)
    for fam in {fam for _, fam in layers}:
        _install(fam)
    state.handles.append(model.base_model.register_forward_pre_hook(_take_call, with_kwargs=True))
    for layer, _ in layers:
        layer._cp_dtensor_token = None
        state.handles += [layer.register_forward_pre_hook(_layer_pre, with_kwargs=True),
                          layer.register_forward_hook(_layer_post, with_kwargs=True, always_call=True)]
