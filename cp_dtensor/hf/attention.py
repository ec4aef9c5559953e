"""Hugging Face transformers models under context parallelism, through transformers' attention interface.

transformers is an optional extra (``pip install cp_dtensor[hf]``); only this module imports it.

Note [transformers under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A transformers model builds its attention mask in the model's forward, from the shapes it sees -- on a
CP rank the *local* shard: a Mistral layer whose window is longer than S_local gets no mask and
``is_causal=True`` (plain causal where the window should cut), position ids that a layout interleaves
look like packed sequences on some ranks only, left padding is visible only on the rank holding it.
So the mask transformers builds is never used. ``cp_dtensor.hf.apply_context_parallel`` switches the model to the
attention function ``"cp_dtensor"`` (registered with ``AttentionInterface``) and the mask function of
the same name (``AttentionMaskInterface``), and each attention call rebuilds the mask from what holds
for the *global* sequence:

* the window from what the layer declares: the ``sliding_window`` the layer passes (Mistral, Qwen2/3,
  gpt-oss, every ``layer_types`` family), else ``module.sliding_window``, else ``config.layer_types`` /
  ``config.sliding_window``. transformers' window W keeps keys ``q - W < k <= q``: ring ``(W - 1, 0)``.
* sinks from ``s_aux`` / ``module.sinks`` (gpt-oss), ``is_causal`` from the call or the module.
* documents by transformers' own rules for sdpa / eager, applied to the global sequence: with a 2-D
  ``attention_mask`` a query sees the unpadded keys (each row's tokens must be one run: left and / or
  right padding; each pad token becomes a document of its own); without one, and with ``use_cache``
  off, position ids that do not advance by 1 start a new sequence (packed sequences,
  ``DataCollatorWithFlattening``; ``documents="position_ids"`` applies them with use_cache on too);
  ``document_ids=`` in the model call overrides both; a plan in the call (``cp_layout=``, required by
  ``layout="documents"``) replaces the gather: Note [One plan per batch in transformers] in hf/documents.py. So a model equals itself at CP=1 -- except
  gpt-oss, whose modeling code builds no packed-sequence mask at all: under CP its packed documents
  are kept apart, as flash-attention keeps them.

The global view costs one all-gather per forward of each rank's position ids and padding flags
(16 bytes per token), cached while the layers (and activation checkpointing's recomputation) pass the
same position-id tensor. The mask function returns only the 2-D padding mask, or a refusal when the
model composes a mask rule the ring cannot run (``or_mask_function`` / ``and_mask_function``, image
blocks, chunks). Whatever cannot be expressed -- a 4-D mask, dropout, softcapping, a KV cache holding
earlier tokens, padding inside a sequence, missing position ids, labels shifted locally -- raises on
every rank before any K/V moves: the error goes through the ring's agreement check (Note [Agreeing
before the ring] in checks.py), before the gather too.

Note [Pad queries]
~~~~~~~~~~~~~~~~~~
A left pad token sees no key at CP=1 (every key up to it is padding): transformers' SDPA (and flash-attention,
and gpt-oss's eager attention, whose sink takes the whole weight) gives it a zero attention output. Its logits
are not ignored: the loss shifts labels, so the last left pad is scored against the row's first real token
(labels of -100 on the pads leave that term in). Under CP each pad token is a document of its own and would
attend to itself, so that term, the loss and every gradient differed from CP=1's (a left-padded Trainer
batch: grad norms 1.33 vs 1.25 at step 3). So the ring's output is zeroed at every pad query, as SDPA's is at
a fully masked row, and no gradient flows through it. A right pad sees the row's tokens at CP=1 and carries no
label (its label is another pad): its output (zero here) is not CP=1's, and changes nothing else.

Note [Unsharded inputs]
~~~~~~~~~~~~~~~~~~~~~~~
A forward of a CP model takes each rank's shard of the batch. The generate() habit -- every rank
passing the same full inputs -- applied to ``model(...)`` would run without any shape error: each rank's
copy becomes a "shard", the global sequence P interleaved copies, and the logits silently wrong. The
documents' gather tells: in a sharded batch the ranks hold different positions, except packed documents
that each fill exactly one rank's shard. So when every rank holds the same positions and padding flags,
the first layer also gathers two sums of its queries (or, in a hybrid's linear layer, hidden states):
16 bytes a rank, only in that case. Equal sums on every rank mean the same inputs, and every rank raises
the same error, naming ``shard_batch`` and ``generate()``. The one false alarm: P packed documents that
are token for token the same, each filling one rank's shard.

Note [Compiled HF models]
~~~~~~~~~~~~~~~~~~~~~~~~~
``torch.compile(model)`` of a Hugging Face model under CP (and the Trainer's ``torch_compile=True``)
compiles everything but the attention function and the mask function, which run eagerly behind a graph
break each (``torch.compiler.disable``): they read what dynamo cannot trace -- the composed mask rule's
closures (``_unknown_rules``), the position ids' version counter (``_version``), the documents' host-side
plan. Traced, the rule check saw an anonymous function and refused every model. So the MLPs, norms,
projections, the tiled head and loss compile; ``fullgraph=True`` raises dynamo's error with ``_EAGER``'s
reason. One fullgraph graph with the ring inside is for the doors that trace it: ``cp_dtensor.ring_attention``
in your own code, torchtitan's ``compile``.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from .._compat import all_gather_single
from .._deprecated import old_keywords
from .._extras import require

require("hf", "cp_dtensor.hf (transformers models under context parallelism)")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from ..core.agreement import agree_on_call  # noqa: E402
from ..core.attention import ring_attention, ring_spec, run_ring_attention  # noqa: E402
from ..core.checks import check_call, check_cp_mesh, options_error  # noqa: E402
from ..core.plan.layout import in_global_order, shard_tensor  # noqa: E402
from . import latent  # noqa: E402
from .documents import KWARG, check_model_layout, documents_of, plan_error, ring_layout  # noqa: E402
from .generate import enable_generate, generate  # noqa: E402
from .pads import planned_pad_error, scored_pad_error, scored_pads, uniform_pads  # noqa: E402
from .router import enable_router_loss, router_loss_error  # noqa: E402
from .served import cp_error, layer_types  # noqa: E402
from .state import ATTR, CPGenerate, HFState, attach, implementations, remove_context_parallel  # noqa: E402
from .tiling import apply_sequence_tiling, check_tileable  # noqa: E402

__all__ = ["apply_context_parallel", "register", "remove_context_parallel", "shift_labels", "NAME"]

NAME = "cp_dtensor"
_UNSHARDED = (
    "every rank of the CP group was given the same inputs ({s} tokens a row, the same positions and hidden states "
    "on all {p} ranks): a model under context parallelism takes each rank's shard of the batch, and would run "
    "them as {p} copies of one sequence. Shard the batch -- input_ids, position_ids (and labels, attention_mask) "
    "= cp_dtensor.shard_batch((input_ids, position_ids, ...), cp_mesh, layout={layout!r}) -- and gather the "
    "logits with cp_dtensor.unshard_batch(logits, cp_mesh, layout={layout!r}); to generate, call "
    "model.generate(...) with the full prompt on every rank. See Note [Unsharded inputs] in cp_dtensor/hf/attention.py.")
_UNSET = object()
_EAGER = ("cp_dtensor's Hugging Face attention and mask functions run eagerly (Note [Compiled HF models] in "
          "cp_dtensor/hf/attention.py): compile the model without fullgraph=True")
# the transformers.masking_utils rules the ring expresses itself (by global position, not local shapes)
_KNOWN_RULES = {
    "causal_mask_function", "bidirectional_mask_function", "and_masks.<locals>.and_mask",
    "sliding_window_overlay.<locals>.inner_mask", "sliding_window_bidirectional_overlay.<locals>.inner_mask",
    "remap_positions_for_packed_sequence.<locals>.inner_mask", "packed_sequence_mask_function.<locals>.inner_mask",
}


class _Refused:
    """What the mask function hands the attention function for a mask rule the ring cannot run."""

    def __init__(self, why: str):
        self.why = why


def _unknown_rules(fn, seen=None) -> list[str]:
    """Names of mask rules in transformers' composed ``mask_function`` that are not in _KNOWN_RULES."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if not (getattr(fn, "__module__", "") == "transformers.masking_utils" and name in _KNOWN_RULES):
        return [f"{getattr(fn, '__module__', '?')}.{name}"]
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        for f in value if isinstance(value, (tuple, list)) else (value,):
            if callable(f) and not isinstance(f, Tensor):
                out += _unknown_rules(f, seen)
    return out


@torch.compiler.disable(reason=_EAGER)  # See Note [Compiled HF models]
def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
          **kwargs):
    """transformers' mask interface: no dense mask from local shapes -- the 2-D padding mask, or a refusal."""
    unknown = _unknown_rules(mask_function) if mask_function is not None else []
    if unknown:
        return _Refused(
            f"the model composes a mask rule context parallelism cannot run ({', '.join(unknown)}: an "
            "or_mask_function / and_mask_function, image-token blocks or chunked attention); the ring runs "
            "causal, sliding-window, padding and packed-sequence masks only. Run this model without CP."
        )
    if attention_mask is not None and attention_mask.dim() == 2:
        return attention_mask[:, -kv_length:].bool()
    return attention_mask


def register() -> None:
    """Register ``"cp_dtensor"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(NAME, cp_dtensor_attention)
    AttentionMaskInterface.register(NAME, _mask)


def _window(module: nn.Module, sliding_window, is_causal: bool) -> tuple[tuple[int, int] | None, str | None]:
    """(ring window, error) for this layer from what it declares; see Note [transformers under CP]."""
    w = sliding_window
    if w is _UNSET:  # the layer passed no sliding_window: read its declarations
        config = getattr(module, "config", None)
        w = getattr(module, "sliding_window", _UNSET)
        if w is _UNSET:
            types, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
            if types is not None and idx is not None:
                w = getattr(config, "sliding_window", None) if types[idx] == "sliding_attention" else None
            elif getattr(config, "use_sliding_window", True):
                w = getattr(config, "sliding_window", None)
            else:
                w = None
    if w is None:
        return None, None
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        return None, f"sliding_window must be a positive int; the layer declares {w!r}. Fix the model config."
    if not is_causal:
        return None, (f"a bidirectional sliding window (sliding_window={w}, is_causal=False) is not supported under "
                      "context parallelism. Run this model without CP.")
    return (w - 1, 0), None  # transformers keeps q - W < k <= q


def _local_error(state: HFState, query, key, attention_mask, dropout, softcap, kwargs) -> str | None:
    if state.pending is not None:
        return state.pending
    if isinstance(attention_mask, _Refused):
        return attention_mask.why
    if attention_mask is not None and not (isinstance(attention_mask, Tensor) and attention_mask.dim() == 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        return (f"an explicit {shape} attention mask cannot be split across CP ranks; pass a 2-D padding "
                "attention_mask [B, N] sharded like the tokens, or none, and position_ids for packed sequences.")
    if dropout:
        return (f"attention dropout is not supported under context parallelism; got dropout={dropout}. Set "
                "config.attention_dropout = 0 (or call model.eval()).")
    if softcap is not None:
        return (f"attention logit softcapping (softcap={softcap}) is not supported under context parallelism. "
                "Run this model without CP.")
    if kwargs.get("position_bias") is not None or kwargs.get("cu_seq_lens_q") is not None:
        return ("position_bias / cu_seq_lens are not supported under context parallelism; for packed sequences "
                "pass position_ids that restart at 0 per sequence, sharded like the tokens.")
    if key.shape[2] != query.shape[2]:
        return (f"context parallel attention is self-attention over this rank's shard only: got {query.shape[2]} "
                f"queries and {key.shape[2]} keys -- a KV cache holding earlier tokens (past_key_values= from an "
                "earlier call: a hand-written decode loop) or cross-attention. To decode, call model.generate(...) "
                "with the full prompt on every rank: it decodes from a sequence-sharded cache. To run a loop of "
                "your own, use a plain copy: cp_dtensor.remove_context_parallel(copy.deepcopy(model)). "
                "use_cache=True is fine for a single forward.")
    pos = kwargs.get("position_ids")
    if pos is None:
        return ("context parallel attention needs position_ids: call the model with position_ids= (the global "
                "positions, sharded like the tokens by cp_dtensor.shard_batch).")
    if pos.dim() != 2 or pos.shape[-1] != query.shape[2] or pos.shape[0] not in (1, query.shape[0]):
        return (f"position_ids must be [B, S_local] or [1, S_local] = [{query.shape[0]}, {query.shape[2]}]; got "
                f"{tuple(pos.shape)} (multi-axis positions are not supported under CP).")
    if kwargs.get("document_ids") is not None and attention_mask is not None:
        return "pass document_ids= or a padding attention_mask, not both; fold the padding into the documents."
    return None


def _same(a: tuple, b: tuple) -> bool:
    """Tensors by identity, everything else by value."""
    return all(x is y if isinstance(x, Tensor) or isinstance(y, Tensor) else x == y for x, y in zip(a, b))


def _version(t: Tensor) -> int:
    """``t``'s version counter; -1 for an inference tensor (torch.inference_mode), which has none: it
    cannot change between the layers of one forward, and the documents are derived afresh every forward."""
    return -1 if t.is_inference() else t._version


def _gather(x: Tensor, state: HFState) -> Tensor:
    """[R, S_local] on every rank -> [P, R, S_local] (every rank gets the same)."""
    every = funcol.wait_tensor(all_gather_single(x.contiguous(), 0, state.mesh.get_group()))  # [P*R, S_local]
    return every.view(state.mesh.size(), -1, x.shape[-1])


def _unsharded(state: HFState, every: Tensor, probe: Tensor | None) -> bool:
    """Whether every rank was given the same full inputs (see Note [Unsharded inputs]); ``every`` is
    [P, 2B, S_local], the gathered positions and padding flags, the same on every rank."""
    if state.mesh.size() == 1 or probe is None or not bool((every == every[0]).all()):
        return False  # the ranks hold different positions: the common case decides here, without a collective
    x = probe.detach().double()
    sums = torch.stack([x.sum(), x.abs().sum()])  # the same bits on every rank iff (in practice) the same inputs
    return bool((_gather(sums[None], state) == sums).all())


def derive_documents(state: HFState, positions: Tensor, mask: Tensor | None, use_cache: bool, b: int,
                     probe: Tensor | None = None):
    """(this rank's document ids [B, S_local] or None, error or None) from the global positions and padding,
    by transformers' sdpa / eager rules; see Note [transformers under CP]. Identical on every rank.
    ``probe``: a tensor computed from this rank's inputs (the first layer's queries or hidden states), read
    only to tell unsharded inputs from packed documents (Note [Unsharded inputs])."""
    pos = positions.expand(b, -1).long()
    flag = torch.full_like(pos, 2) if mask is None else mask.long()  # 1 real, 0 pad, 2 no mask on this rank
    labels = state.labels
    if mask is not None and isinstance(labels, Tensor) and labels.shape == flag.shape:  # 3: a pad the loss scores
        flag = flag.masked_fill((flag == 0) & (labels.to(flag.device) != -100), 3)  # Note [Scored pads] in hf/pads.py
    every = _gather(torch.cat([pos, flag]), state)  # [P, 2B, S_local]
    layout = ring_layout(state)  # a named layout (generate()'s prefill under layout="documents": striped)
    if _unsharded(state, every, probe):
        return None, _UNSHARDED.format(p=state.mesh.size(), s=pos.shape[1], layout=layout)
    full = in_global_order(every, layout)
    pos, flag = full[:b], full[b:]
    state.scored_pads = scored_pads(flag)
    flag = flag.masked_fill(flag == 3, 0)
    given = flag != 2
    if bool(given.any()) and not bool(given.all()):
        return None, "attention_mask was passed on some CP ranks only; pass it (or None) on every rank."
    # transformers' rules on the global batch, the one derivation (Note [One plan per batch in transformers])
    ids, err = documents_of(pos, flag == 1 if bool(given.all()) else None,
                            packed=not (use_cache and state.documents is None))
    if ids is None:
        return None, err
    rank, cp = state.mesh.get_local_rank(), state.mesh.size()
    state.id_range = (int(ids.min()), int(ids.max()))  # global: every rank derived the same ids
    return shard_tensor(ids, seq_dim=1, layout=layout, rank=rank, cp_size=cp).contiguous(), None


@torch.compiler.disable(reason=_EAGER)  # See Note [Compiled HF models]
def cp_dtensor_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                         dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                         sliding_window=_UNSET, softcap=None, s_aux=None, **kwargs):
    """transformers attention function ``"cp_dtensor"``: ring attention over this rank's shard.
    query: [B, Hq, S_local, D]; key, value: [B, Hkv, S_local, D(v)]. Returns ([B, S_local, Hq, Dv], None)."""
    state: HFState | None = getattr(module, ATTR, None)
    if state is None:  # the same on every rank: no collective is pending
        raise ValueError("attn_implementation='cp_dtensor' needs the CP mesh: call "
                         "cp_dtensor.hf.apply_context_parallel(model, cp_mesh, layout=...) instead of setting it.")
    device = query.device.type
    latents = latent.take_latents(module)  # MLA's latent rows, kept by its expand_kv: Note [MLA latents on the wire]
    handed = latent.take_handed(module)  # a prefill's MLA rows, expanded into key and value
    if state.generating is not None and state.generating.cache is not None and state.decoding is None:  # a prefill
        state.generating.cache.note_inputs(module.layer_idx, *(handed or (key, value)))  # Note [Pass-KV turns]
    if torch.is_autocast_enabled(device) and query.dtype != torch.float64:  # as SDPA under autocast: q, k, v in the
        # autocast dtype (bf16 Trainer runs); float64 is not autocast-eligible and stays (as SDPA keeps it)
        dtype = torch.get_autocast_dtype(device)
        query, key, value = (x.to(dtype) if latents is None or x is query else x for x in (query, key, value))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window, err = _window(module, sliding_window, causal)
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if state.generating is not None and state.generating.cache is not None and err is None:
        state.generating.cache.note_reach(module.layer_idx, window)  # Note [Windowed caches] in hf/cache.py
    if state.decoding is not None:  # a decode step of generate(), registered by generate.py: Note [generate() under CP]
        refused = attention_mask.why if isinstance(attention_mask, _Refused) else None
        err = err or refused or _local_error(state, query, query, None, dropout, softcap, kwargs)
        if err is not None:  # the decode step's inputs are replicated: every rank raises alike
            raise ValueError(err)
        if latents is not None:  # a pass-KV turn of an MLA model: the latent blocks travel (Note [MLA turns])
            key, value = latents
        return state.decoding(state, module, query, key, value, scaling, window, sinks), None
    err = err or _local_error(state, query, key, attention_mask, dropout, softcap, kwargs)
    if latents is not None:  # in hf/latent.py (see Note [MLA latents on the wire] there)
        kw = dict(kwargs, sliding_window=None if window is None else window)
        out = latent.attend(module, state, query, latents, attention_mask, err, scaling, kw, derive_documents, _version)
        return out, None
    if state.generating is None and (state.layout == "documents" or state.plan is not None):  # the batch's plan
        out = _planned(state, query, key, value, attention_mask, err, causal, scaling, window, sinks, kwargs)
        return _zero_pads(out, attention_mask), None
    spec = ring_spec(state.mesh.get_group(), layout=ring_layout(state), is_causal=causal, scale=scaling, window_size=window,
                     comm_dtype=state.comm_dtype, kv_exchange=state.kv_exchange)
    ids, agreed = kwargs.get("document_ids"), None
    if err is None and ids is None:
        pos, use_cache = kwargs["position_ids"], bool(kwargs.get("use_cache"))
        key_ = (pos, _version(pos), attention_mask, use_cache, query.shape[0])  # what the documents depend on
        if state.last is not None and _same(state.last[0], key_):  # the next layer, or a recomputation
            ids, err = state.last[1]
        else:
            # agree on shapes and options before the gather: a bad call raises on every rank here; the
            # documents then come out the same on every rank, so the ring does not agree again (once a
            # call; compiled, the ring's op is the agreement: Note [Compiled agreement] in checks.py)
            compiling = torch.compiler.is_compiling()
            if not compiling:
                check_call(query, key, value, spec, sinks=sinks)
            state.id_range = None
            ids, err = derive_documents(state, pos, attention_mask, use_cache, query.shape[0], probe=query)
            state.last = (key_, (ids, err))
            agreed = None if compiling else state.id_range or (0, 0)
    err = err or scored_pad_error(state)  # global facts: every rank alike (Note [Scored pads] in hf/pads.py)
    out = run_ring_attention(query, key, value, spec, document_ids=ids if err is None else None, sinks=sinks,
                             error=err, agreed=agreed)
    return _zero_pads(out.transpose(1, 2).contiguous(), attention_mask), None


def _zero_pads(out: Tensor, attention_mask) -> Tensor:
    """out [B, S_local, Hq, Dv] with every pad query's row zero, as SDPA's at a fully masked row (Note [Pad
    queries]); attention_mask: this rank's 2-D [B, S_local] shard or None."""
    if isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        out = out * attention_mask[:, -out.shape[1]:, None, None].to(out.dtype)
    return out


def _planned(state: HFState, query, key, value, attention_mask, err, causal, scaling, window, sinks, kwargs) -> Tensor:
    """The attention of a forward with the batch's plan (``cp_layout=``): see Note [One plan per batch in
    transformers] in hf/documents.py. Returns [B, S_local, Hq, Dv]."""
    plan, group, pos = state.plan, state.mesh.get_group(), kwargs.get("position_ids")
    key_ = ("plan", plan, pos, -2 if pos is None else _version(pos), attention_mask)
    first = state.last is None or not _same(state.last[0], key_)
    if first:  # the forward's first layer: the plan's checks; a recomputation or the next layer reuses them
        err = err or plan_error(state, plan, query, pos, attention_mask) or planned_pad_error(state, attention_mask)
        state.last = (key_, None)
    if plan is not None and not isinstance(plan, str) and getattr(plan, "placement", None) != "documents":
        # a named layout's plan: the ring in that layout with the plan's ids, agreed by the ring itself
        ids = None if err is not None else plan.local_ids(state.mesh.get_local_rank()).to(query.device)
        spec = ring_spec(group, layout=ring_layout(state), is_causal=causal, scale=scaling, window_size=window,
                         comm_dtype=state.comm_dtype, kv_exchange=state.kv_exchange)
        out = run_ring_attention(query, key, value, spec, document_ids=ids, sinks=sinks, error=err)
        return out.transpose(1, 2).contiguous()
    if first:  # every rank raises alike, before any K/V moves (the exchange then agrees on each layer's call)
        agree_on_call(err, {"plan key": plan.key if err is None else 0}, group, what="cp_dtensor.hf (layout='documents')")
    elif err is not None:  # a later layer's own error (window, softcap): from the model, the same on every rank
        raise ValueError(err)
    out = ring_attention(query, key, value, mesh=group, layout=plan, is_causal=causal, scale=scaling,
                         window_size=window, sinks=sinks, document_ids=kwargs.get("document_ids"),
                         comm_dtype=state.comm_dtype)
    return out.transpose(1, 2).contiguous()


def _top_level_error(model: nn.Module, args, kwargs) -> str | None:
    try:
        bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = kwargs
    extra = bound.get("kwargs", {}) if isinstance(bound.get("kwargs"), dict) else {}
    get = lambda name: bound.get(name, extra.get(name))  # noqa: E731
    if get("position_ids") is None:
        return ("a model under context parallelism needs position_ids=: the global positions of this rank's tokens, "
                "sharded like them (cp_dtensor.shard_batch((tokens, positions), cp_mesh, layout=...)); transformers "
                "would number the local shard 0..S_local-1.")
    if get("labels") is not None and get("shift_labels") is None:
        return ("labels= alone would be shifted inside this rank's shard, pairing tokens with the labels of other "
                "positions. Shift on the full batch -- lab = cp_dtensor.hf.shift_labels(labels), sharded like the "
                "tokens -- and pass labels=lab, shift_labels=lab, num_items_in_batch= the global count of "
                "labels != -100.")
    if get("shift_labels") is not None and get("num_items_in_batch") is None:
        return ("with shift_labels= under context parallelism pass num_items_in_batch= (the global count of labels "
                "!= -100): each rank's mean would otherwise be over its own tokens only.")
    if getattr(model, ATTR).generating is not None:  # generate() drops the router loss: nothing to refuse
        return None
    return router_loss_error(model, get("output_router_logits"))  # Note [Router loss under CP] in hf/router.py


@old_keywords("cp_dtensor.hf.apply_context_parallel", cp_mesh="mesh")
def apply_context_parallel(
    model: nn.Module, mesh: DeviceMesh, *, layout: str = "striped", documents: str | None = None,
    comm_dtype: torch.dtype | None = None, kv_exchange: str = "ring", sequence_tiling: bool | int = False,
) -> nn.Module:
    """Run a transformers model's attention as ring attention over ``mesh`` (the 1-D CP mesh; changes
    ``model`` in place).

    Switches the model (and its sub-models) to ``attn_implementation="cp_dtensor"``. Call it with this
    rank's shard of every sequence tensor (``cp_dtensor.shard_batch(..., layout=layout)``): input_ids,
    ``position_ids`` (global positions, required), an optional 2-D padding ``attention_mask``, and for the
    loss ``labels=lab, shift_labels=lab`` where ``lab`` is the shard of ``shift_labels(labels)`` (shifted
    on the full batch) with ``num_items_in_batch=`` the global label count. Windows, sinks, padding and packed sequences follow the model; what the ring
    cannot run raises on every rank. See Note [transformers under CP]. Parameter gradients are each
    rank's share: sum them over the CP group (FSDP / DDP, or ``cp_dtensor.reduce_gradients``).

    ``layout="documents"`` places each batch's packed documents (short ones whole on a rank): plan the full
    batch with ``cp_dtensor.hf.plan_batch(model, position_ids=...)``, shard it with the plan and call
    ``model(**shard, cp_layout=plan)`` -- Note [One plan per batch in transformers] in hf/documents.py.

    ``documents=None`` follows transformers' sdpa / eager rule for packed sequences (position ids that do
    not advance by 1 start a sequence when the call has no attention_mask and use_cache is off);
    ``documents="position_ids"`` applies them with use_cache on too.

    ``comm_dtype`` and ``kv_exchange`` are ``ring_attention``'s, for every ring call of the model
    (training, evaluation and generate()'s prefill). ``kv_exchange="latent"`` (opt-in) sends a multi-head
    latent attention model's latent rows instead of its expanded K/V (71x fewer bytes at DeepSeek-V3 sizes,
    unfused attention): Note [MLA latents on the wire] in hf/latent.py; the model's other ring calls run
    ``"ring"``, and a model it does not serve raises.

    ``model.generate(...)`` then runs under CP as well, every rank passing the same full, unsharded inputs:
    a ring prefill into a sequence-sharded KV cache, then decoding from it (Note [generate() under CP] in
    hf/generate.py).

    Hybrid linear-attention models (Qwen3-Next, Qwen3.5, Kimi Linear, OLMo-Hybrid, Lara-Mini, Bailing-Hybrid:
    ``"linear_attention"`` in ``config.layer_types``) take ``layout="headtail"`` or ``"contiguous"`` (striped
    raises), run forward calls without a cache (``use_cache`` defaults to False; a cache raises), and keep
    packed documents apart in their linear layers too: Note [Linear attention in transformers under CP] in
    hf/linear.py. Their ``generate()`` prefills by state passing and decodes from replicated linear states and
    sharded attention caches: Note [Hybrid generate() under CP] there.

    ``sequence_tiling=True`` (or an int: tokens per tile; True is 1024) runs the LM head + cross-entropy and
    every layer's MLP in sequence tiles, so no [S_local, vocab] logits and one tile's MLP intermediates exist
    at a time (works at CP=1 too). A training-mode call with labels then returns the loss and an empty
    [B, S_local, 0] ``logits``; evaluation (``model.eval()``) and calls without labels return logits as
    before. See Note [Sequence tiling in transformers] in hf/tiling.py.
    """
    check_cp_mesh(mesh)
    ring = latent.ring_exchange(kv_exchange)  # "latent": the MLA layers' (Note [MLA latents on the wire]); the ring's calls
    check_model_layout(layout, comm_dtype=comm_dtype, kv_exchange=ring)
    if documents not in (None, "position_ids"):
        raise ValueError(f"documents must be None or 'position_ids'; got {documents!r}.")
    error = options_error("cp_dtensor.hf.apply_context_parallel", comm_dtype=comm_dtype, kv_exchange=ring)
    if error is not None:  # the same arguments on every rank: every rank raises here, before any communication
        raise ValueError(error)
    tile = check_tileable(model, sequence_tiling)  # a head or loss that cannot be tiled raises before any change
    if getattr(model, "_cp_dtensor_hf", None) is not None or getattr(model, "_cp_dtensor_mode", None) is not None:
        raise ValueError("context parallelism was already applied to this model: use it as it is, or call "
                         "cp_dtensor.hf.remove_context_parallel(model) first to apply it with other options.")
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"cp_dtensor.hf.apply_context_parallel takes a transformers PreTrainedModel; got {type(model).__name__}. "
                         "Use cp_dtensor.apply_context_parallel for other modules.")
    types = layer_types(model)  # refuses kinds the door does not serve: Note [The transformers door's allowlist]
    linear = None
    if "linear_attention" in types and layout == "documents":
        raise ValueError(f"{type(model).__name__} has linear_attention layers, whose state passing runs the headtail "
                         "and contiguous layouts only; layout='documents' is for attention models. Use "
                         "layout='headtail'.")
    if "linear_attention" in types:  # Note [Linear attention in transformers under CP] in hf/linear.py
        from .linear import linear_layers  # checks only: a refused model stays unchanged

        linear = linear_layers(model, layout)
    error = cp_error(model, [m for m, _ in linear or ()])
    sparse = None
    if "indexed_attention" in types:  # Note [DeepSeek Sparse Attention under CP] in hf/sparse.py
        from .sparse import door_error, dsa_layers

        sparse, error = dsa_layers(model), error or door_error(model, layout, implementations(model.config))
    if error is None and kv_exchange == "latent":  # opt-in: refused for a model it does not serve
        error = latent.latent_error(model, implementations(model.config), comm_dtype)
    if error is not None:  # the same model on every rank: every rank raises here, before any communication
        raise ValueError(error)
    mla = latent.mla_path(model, implementations(model.config), comm_dtype, kv_exchange)
    register()
    before = implementations(model.config)
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(before)
        raise ValueError(f"{type(model).__name__} does not route its attention through transformers' "
                         "AttentionInterface, so it cannot run context parallel attention.")
    state = attach(model, mesh, layout, documents, before)
    state.comm_dtype, state.kv_exchange = comm_dtype, ring  # Note [CP state on a model] in hf/state.py
    state.uniform_pads = uniform_pads(model, before)  # Note [Scored pads] in hf/pads.py
    state.handles += [model.register_forward_pre_hook(_call_starts, with_kwargs=True),
                      model.register_forward_hook(_call_ends, always_call=True),
                      model.base_model.register_forward_pre_hook(_forward_starts)]
    enable_router_loss(model, state)  # an MoE's load-balancing loss from the global means
    enable_generate(model, state)  # generate(): ring prefill, then a sequence-sharded KV cache
    model.generate = CPGenerate(model, generate)
    if linear is not None:  # the linear layers' convolution and delta rule (state passing; generate()'s states):
        from .linear import enable_linear  # after enable_generate, whose base-model hook hands them the shards

        enable_linear(model, state, linear, derive_documents)
    if mla == "latent":  # Note [MLA latents on the wire] in hf/latent.py
        latent.enable_latent(model, state)
    state.mla = mla
    latent.report(model, mla)
    if sparse is not None:  # the indexed_attention layers' own forward: the global indexer, the selected rows
        from .sparse import enable_sparse
        from .sparse_generate import generating_forward, sparse_generate

        enable_sparse(model, state, sparse, derive_documents, generating_forward)
        model.generate = CPGenerate(model, sparse_generate)  # its refusals, then generate()
    if tile is not None:
        apply_sequence_tiling(model, tile_size=tile)
    return model


def _call_starts(model: nn.Module, args, kwargs):
    """The top-level call: its refusal (raised by the first attention call, on every rank), its logits_to_keep."""
    state: HFState = getattr(model, ATTR)
    state.plan = kwargs.pop(KWARG, None)  # the batch's plan: Note [One plan per batch in transformers]
    state.pending = _top_level_error(model, args, kwargs)
    state.keep_logits = kwargs.get("logits_to_keep", 0)
    state.labels = kwargs.get("shift_labels")  # Note [Scored pads] in hf/pads.py
    return args, kwargs


def _call_ends(model: nn.Module, args, output):
    state = getattr(model, ATTR)
    state.pending = state.real = state.labels = None  # the refusal, the Trainer's padding, the labels: this call's
    return output


def _forward_starts(base: nn.Module, args):
    state = getattr(base, ATTR)
    state.last = state.scored_pads = None  # a new forward derives its documents afresh
    register()  # idempotent: a model unpickled in a fresh process finds "cp_dtensor" registered


def shift_labels(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """transformers' causal-LM label shift on the *full* [B, N] labels (label of token i is token i + 1),
    to shard like the tokens and pass as ``shift_labels=``."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)

