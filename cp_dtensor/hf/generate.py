"""transformers ``generate()`` under CP: a ring prefill into a sequence-sharded KV cache, then decoding from it.

Note [generate() under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~
After ``cp_dtensor.hf.apply_context_parallel(model, cp_mesh, layout=...)`` every rank calls ``model.generate(...)``
with the same full inputs. The wrapper installed here checks the call on every rank (what it cannot
serve raises on every rank before the first token, as do inputs that differ between ranks) and hands
generate a :class:`ShardedCache` -- a transformers ``Cache`` whose layers hold only this rank's tokens:

* prefill (the cache is empty): a pre-hook on the base model pads the prompt on the left to a multiple
  of the layout unit (pad tokens masked: each its own document; on the left so that the prompt's last
  token ends the sequence, where a hybrid's linear layers take their final states: Note [Hybrid
  generate() under CP] in hf/linear.py) and passes each rank its layout shard of
  input_ids, position_ids and the padding mask. The layers run on the shard; ``cache.update`` stores
  the shard's K/V (minus the internal pad columns) with their global positions (-1 for left padding)
  and returns them for the ring (hf/attention.py's attention function, no K/V all-gather). A hook after the base
  model rebuilds only the hidden rows the LM head reads (``logits_to_keep``, 1 in generate) by one
  all-gather of [P, B, k, H], so every rank computes the same logits.
* decode (T new tokens, the same on every rank): the layers run replicated; ``cache.update`` keeps each
  new token on one rank only -- the one holding the fewest tokens, lowest first: column c mod P after a
  striped prefill (the striped layout, continued) -- and returns this rank's
  share; the attention function runs :func:`decode_attention` -- which the pre-hook registers in the
  model's state for the step (``HFState.decoding``: hf/attention.py calls what it finds there and imports
  nothing of this module's) -- i.e. :func:`cp_dtensor.sharded_cache_attention` (core/decode.py) over it --
  one all-gather of B * Hq * T * (Dv + 1) fp32 values per layer, bit-identical outputs on every rank,
  hence identical logits on every rank; what the ranks decide from them is agreed as Note [Agreed
  stopping and sampling] says, so every rank stops at the same step.

* a later call with the cache this one returns (a second turn), or a prefill chunk after the first, runs
  its new columns into the cache as a decode step of T tokens (pass-Q) or, when that sends fewer bytes,
  sharded in the layout (pass-KV): Note [Continuing a sharded cache] in hf/turns.py, Note [Pass-KV turns]
  in hf/pass_kv.py.

Windows and sinks come from the layer as in Note [transformers under CP] (hf/attention.py); masks are by the
positions generate computes (``cumsum(attention_mask) - 1``), which equal transformers' column rule for
left padding. Keys outside a sliding window stay in the cache (masked, not dropped).

The per-call state (the cache, the current step) is a :class:`GenerateCall` in the model's ``HFState``
(Note [CP state on a model] in hf/state.py); the hooks are module-level functions that read it from the
module they run on, so a deepcopy of the model generates with its own weights.

Note [Agreed stopping and sampling]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank runs transformers' decoding loop; a loop that ends on one rank and not on another leaves
the other waiting in its next collective (gloo aborts: "Received data size doesn't match"). The
prompt and every generation option but ``max_time`` are agreed before the first token (the call's
fingerprint: the whole GenerationConfig), and the logits are bit-identical on every rank; so whatever
generate() derives from options and logits alone -- greedy tokens, max_length, EOS per row, stop
strings, penalties -- agrees by construction. Three things do not:

* Sampling draws from each rank's own generator. So when ``do_sample`` is on, the call's agreement
  gather also carries each rank's state of the default generator of the prompt's device (the one
  ``torch.multinomial`` draws from) and every rank samples from rank 0's: after ``torch.manual_seed(s)``
  on rank 0 the tokens are those of the model at CP=1 after ``torch.manual_seed(s)``, whatever the
  other ranks' seeds (``seed + rank``). Rank 0's generator advances as at CP=1; every other rank gets
  its own state back when generate() returns. Nothing per token.
* ``max_time`` reads each rank's clock, and the caller's ``stopping_criteria`` and ``logits_processor``
  are objects no fingerprint can compare. When any rank's call has one of them (so every rank knows,
  from the same gather), the ``StoppingCriteriaList`` generate() builds is wrapped
  (:class:`AgreedStopping`): every rank evaluates it, then one all-gather over the CP group of each
  rank's [2, B] int64 -- per row, done or not and the token just chosen -- makes rank 0's per-row
  decisions every rank's, and checks that every rank chose the same tokens; if not (a logits processor
  that differs by rank), every rank raises the same error at that step. So ``max_time`` runs on rank
  0's clock and a criterion that differs by rank follows rank 0's. Cost: one all-gather of 16 * B bytes
  a rank per token (scripts/benchmarks/bench_generate_agree.py measures it).
* ``synced_gpus=True``: transformers all-reduces "this rank finished" over the default group every
  step; the ranks of a CP group agree on it by the above, and the option itself is in the fingerprint.

Why this design and not the alternatives: a per-token broadcast of rank 0's token would make sampling
independent of the generators, but the token would have to be replaced after transformers has appended
(and streamed) it, and it would cost a collective on every token of every call; agreeing the generator
once costs nothing per token. An all-reduce of the unfinished-rows flags on every step would cost the
same collective on calls that provably need none; the per-step gather runs only where something the
fingerprint cannot see could make the ranks differ, and there it also checks the tokens.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from .._extras import require

require("hf", "cp_dtensor.hf (transformers generate() under context parallelism)")

from transformers.generation.stopping_criteria import StoppingCriteriaList  # noqa: E402

from .._compat import generation_stopping_criteria, prepare_generation_config  # noqa: E402
from ..core.agreement import agree_objects  # noqa: E402
from ..core.decode import attend, digest, local_error  # noqa: E402
from ..core.exchange.comm import all_gather, host_group, wait  # noqa: E402
from ..core.plan.layout import global_order, layout_unit, shard_tensor  # noqa: E402
from .cache import GenerateCall, ShardedCache, _Step  # noqa: E402
from .cache import ShardedCacheLayer as ShardedCacheLayer  # noqa: E402  (a name of the old path cp_dtensor.hf_generate)
from .cache import cache_bytes as cache_bytes  # noqa: E402  (a name of the old path cp_dtensor.hf_generate)
from .documents import ring_layout  # noqa: E402
from .pass_kv import pass_kv_attention, pass_kv_step, turn_mode  # noqa: E402
from .sparse_turn import sharded_step, sharded_turn  # noqa: E402
from .state import ATTR, HFState  # noqa: E402
from .turns import CallRules, cache_facts, continuation_error, inner_padding_error, model_shape  # noqa: E402

__all__ = ["AgreedStopping", "decode_attention", "enable_generate", "generate"]

# -- the model hooks ----------------------------------------------------------------------------------


def _base_pre_hook(module, args, kwargs):
    state: HFState = getattr(module, ATTR)
    call = state.generating
    state.decoding = None  # set below for a decode step only: Note [generate() under CP]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, ShardedCache):
        if call is not None:
            call.step = None
        return args, kwargs
    if call is None or cache is not call.cache:  # the same on every rank: no collective is pending
        raise ValueError("a cp_dtensor ShardedCache is filled by model.generate() under CP only; pass no cache to a "
                         "forward. To continue a conversation, pass the cache to model.generate(ids, cache=...) with "
                         "the whole conversation on every rank.")
    if len(args) == 1 and "input_ids" not in kwargs and _first_parameter(module) == "input_ids":
        args, kwargs = (), {**kwargs, "input_ids": args[0]}  # GPT-NeoX's causal LM passes the ids by position
    ids, mask, pos = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("position_ids")
    if ids is None or args or pos is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("generate() under CP passes input_ids, position_ids and the cache by keyword; got another call.")
    b, n = ids.shape
    pos = pos.expand(b, n)
    cp, rank = state.mesh.size(), state.mesh.get_local_rank()
    real = torch.ones(b, n, dtype=torch.bool, device=ids.device) if mask is None else mask[:, -n:].bool()
    col = cache.columns(b, n, ids.device)  # [B, n]: the global columns the masks count by (Note [Masks by column])
    if cache.get_seq_length() == 0:  # prefill: this rank's layout shard of the prompt, padded on the left
        unit = layout_unit(ring_layout(state), cp)
        pad = -n % unit  # masked columns before the prompt: its last token ends the sequence (the final states)
        padded = lambda x, v: torch.nn.functional.pad(x, (pad, 0), value=v)  # noqa: E731
        shard = lambda x: shard_tensor(x, seq_dim=1, layout=ring_layout(state), rank=rank, cp_size=cp).contiguous()  # noqa: E731
        cols = shard(torch.arange(n + pad)[None])[0]  # global columns held here (with the pad columns), on the host
        keep = torch.nonzero(cols >= pad).flatten()
        kpos = shard(padded(col.masked_fill(~real, -1), -1)).index_select(1, keep.to(ids.device))
        call.step = _Step("prefill", kpos, keep, n, slots=cols[keep] - pad)
        call.prompt = (n, pad)
        every = global_order(ring_layout(state), cp, n + pad).view(cp, -1)  # [P, S_local]: each rank's columns
        cache.held = (every >= pad).sum(1).tolist()  # the prompt tokens each rank keeps
        cache.note_tokens(ids, real)
        kwargs["input_ids"], kwargs["position_ids"] = shard(padded(ids, 0)), shard(padded(pos, 0))
        if mask is not None or pad:
            kwargs["attention_mask"] = shard(padded(real.long(), 0))
        return args, kwargs
    if turn_mode(state, module, cache, b, n) == "pass-kv":  # a long turn or chunk: Note [Pass-KV turns] in pass_kv.py
        pass_kv_step(state, call, cache, ids, pos, col, real, kwargs)
        state.decoding = pass_kv_attention
        return args, kwargs
    if sharded_turn(state, module, cache, b, n):  # DeepSeek Sparse Attention: Note [Sharded DSA turns]
        sharded_step(state, call, cache, ids, pos, col, real, kwargs)
        return args, kwargs
    # decode, a later turn or prefill chunk (pass-Q: Note [Continuing a sharded cache] in turns.py): each new
    # column goes to the rank holding the fewest tokens (the lowest on ties) -- for the striped layout exactly
    # column mod P; after another layout's prefill it evens out the shares
    owners = []
    for _ in range(n):
        owners.append(min(range(cp), key=lambda r: (cache.held[r], r)))
        cache.held[owners[-1]] += 1
    keep = torch.nonzero(torch.tensor(owners) == rank).flatten()
    kpos = col.masked_fill(~real, -1).index_select(1, keep.to(ids.device))
    call.step = _Step("decode", kpos, keep, n, q_positions=col, q_padding=~real, slots=keep + cache.seen)
    cache.note_tokens(ids, real)
    state.decoding = decode_attention  # what the attention function runs instead of the ring (registered here)
    return args, kwargs


def _first_parameter(module) -> str | None:
    return next(iter(inspect.signature(module.forward).parameters), None)


def _base_post_hook(module, args, kwargs, output):
    state: HFState = getattr(module, ATTR)
    call = state.generating
    if call is None or call.step is None or call.step.kind not in ("prefill", "pass-kv"):
        return output
    n, pad = call.prompt
    keep = state.keep_logits
    k = keep if isinstance(keep, int) and 0 < keep <= n else n
    output.last_hidden_state = _gather_columns(state, output.last_hidden_state, n + pad, range(pad + n - k, pad + n))
    return output


def _gather_columns(state: HFState, h: Tensor, total: int, columns) -> Tensor:
    """The rows ``columns`` of the global [B, total, H] from every rank's layout shard ``h`` [B, S_local, H]:
    one all-gather of [B, k, H] per rank, each filling the rows it holds. Exact; the same on every rank."""
    cp, rank = state.mesh.size(), state.mesh.get_local_rank()
    cols = torch.tensor(list(columns), dtype=torch.long)
    where = torch.argsort(global_order(ring_layout(state), cp, total))[cols]  # index into the rank-major concatenation
    s = total // cp
    owner, local = where // s, where % s
    if cp == 1:
        return h.index_select(1, local.to(h.device))
    mine = torch.nonzero(owner == rank).flatten()
    buf = h.new_zeros(h.shape[0], len(cols), h.shape[2])
    buf[:, mine.to(h.device)] = h.index_select(1, local[mine].to(h.device))
    group = state.mesh.get_group()
    every = wait(all_gather(buf.reshape(-1), group), group).view(cp, *buf.shape)  # [P, B, k, H]
    return every[owner.to(h.device), :, torch.arange(len(cols), device=h.device)].transpose(0, 1).contiguous()


def decode_attention(state: HFState, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling, window,
                     sinks):
    """The decode step's attention: the new queries against this rank's share of the layer's cache.
    query: [B, Hq, T, D]; key, value: this rank's [B, Hkv, S_r, D(v)]. Returns [B, T, Hq, Dv]."""
    call = state.generating
    layer = call.cache.layers[module.layer_idx]
    q_pos, k_pos = call.step.q_positions, layer.positions
    # every rank computed query, positions and options alike from the agreed call (the generate() wrapper):
    # only the local checks run here, no agreement round per layer
    err = local_error(query, key, value, q_pos, k_pos, scaling, window, sinks)
    if err is not None:
        raise ValueError(err)
    out = attend(query, key, value, q_positions=q_pos, k_positions=k_pos, group=state.mesh.get_group(),
                 world=state.mesh.size(), scale=scaling, window_size=window, sinks=sinks,
                 padding=call.step.q_padding)
    return out.transpose(1, 2).contiguous()


def enable_generate(model: nn.Module, state: HFState) -> None:
    """Install the generate() hooks on a model that ``cp_dtensor.hf.apply_context_parallel`` prepared (their handles
    go to ``state``); ``model.generate`` is a state.CPGenerate, which calls :func:`generate`."""
    base = model.base_model
    state.handles += [base.register_forward_pre_hook(_base_pre_hook, with_kwargs=True),
                      base.register_forward_hook(_base_post_hook, with_kwargs=True)]


# -- agreed stopping and sampling ----------------------------------------------------------------------


class AgreedStopping(StoppingCriteriaList):
    """generate()'s stopping criteria under CP: every rank evaluates them, and rank 0's per-row decisions
    are every rank's; the tokens just chosen are checked equal on every rank. See Note [Agreed stopping
    and sampling]."""

    def __init__(self, criteria: StoppingCriteriaList, mesh):
        super().__init__(criteria)
        self.mesh = mesh

    def __call__(self, input_ids: Tensor, scores, **kwargs) -> Tensor:
        done = super().__call__(input_ids, scores, **kwargs)  # [B]: this rank's decisions
        b, cp = input_ids.shape[0], self.mesh.size()
        mine = torch.stack([done.long(), input_ids[:, -1].long()])  # [2, B]: done, the token just chosen
        group = self.mesh.get_group()
        if mine.device.type == "cpu":
            group = host_group(group)
        every = wait(all_gather(mine.reshape(-1), group), group).view(cp, 2, b)  # [P, 2, B]
        differ = (every[:, 1] != every[0, 1]).any(1)  # [P]
        if bool(differ.any()):  # every rank sees the same gathered tokens: every rank raises here
            r = int(torch.nonzero(differ)[0])
            raise ValueError(
                f"generate() under CP: the ranks chose different tokens at sequence length {input_ids.shape[1]} "
                f"(rank 0: {every[0, 1].tolist()}, rank {r}: {every[r, 1].tolist()}), so they would decode different "
                "sequences. Something the ranks do not share changed them: a logits_processor (or stopping "
                "criterion) that differs between ranks, or a forward that draws random numbers on some ranks only "
                "(dropout: call model.eval()). Pass every rank the same generate() arguments.")
        return every[0, 0].bool()


def _generator(device: torch.device):
    """(get_state, set_state) of the default generator ``torch.multinomial`` draws from on ``device``."""
    if device.type == "cpu":
        return torch.get_rng_state, torch.set_rng_state
    module = torch.get_device_module(device)
    return (lambda: module.get_rng_state(device)), (lambda s: module.set_rng_state(s, device))


# -- the generate() wrapper ----------------------------------------------------------------------------

_REFUSED_OPTIONS = {
    "output_attentions": "attention weights are never formed under CP",
    "output_hidden_states": "each rank holds its shard of the prompt's hidden states",
}
_CACHE_KINDS = {"static": "static", "offloaded_static": "static", "sliding_window": "static", "hybrid": "static",
                "hybrid_chunked": "static", "offloaded_hybrid": "static", "offloaded_hybrid_chunked": "static",
                "offloaded": "offloaded", "quantized": "quantized"}


def _origin(model, kwargs: dict, name: str) -> tuple[str, str]:
    """(where the call's generation option ``name`` came from, in words; which of 'kwarg' / 'config' / 'model')."""
    if name in kwargs:
        return f"generate() was passed {name}={kwargs[name]!r}", "kwarg"
    given = kwargs.get("generation_config")
    if given is not None and getattr(given, name, None) is not None:
        return f"the generation_config passed to generate() sets {name}={getattr(given, name)!r}", "config"
    return f"model.generation_config sets {name}={getattr(model.generation_config, name, None)!r}", "model"


def _cache_errors(model, kwargs: dict, config) -> str | None:
    if config.use_cache is False:
        said, where = _origin(model, kwargs, "use_cache")
        fix = {"kwarg": "Drop use_cache=False.", "config": "Set use_cache=True in that generation_config.",
               "model": "Pass use_cache=True (or set model.generation_config.use_cache = True)."}[where]
        return (f"generate() under CP decodes from a KV cache, but {said}: without one every step would re-run the "
                f"whole sequence on each rank's shard. {fix}")
    impl = config.cache_implementation
    if impl is not None and impl != "dynamic":  # "dynamic" is the default kind: the sharded cache is one
        said, where = _origin(model, kwargs, "cache_implementation")
        kind = _CACHE_KINDS.get(impl, repr(impl))
        fix = {"kwarg": "Drop cache_implementation= (or pass 'dynamic').",
               "config": "Set cache_implementation=None (or 'dynamic') in that generation_config.",
               "model": "Pass cache_implementation='dynamic' (or set model.generation_config.cache_implementation "
                        "= None)."}[where]
        return (f"generate() under CP keeps its own sequence-sharded cache, a dynamic cache like transformers' "
                f"default, but {said}: a {kind} cache cannot be split across the ranks. {fix}")
    return None


def _generate_error(model, args, kwargs) -> tuple[str | None, tuple, object]:
    """(why this call cannot be served, or None; a fingerprint of the call that every rank must share; the
    resolved GenerationConfig, or None when the call is refused before it is resolved)."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if kwargs.get("inputs_embeds") is not None:
        return "generate() under CP takes input_ids, not inputs_embeds.", (), None
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        return f"generate() under CP needs input_ids as a [B, N] int64 tensor; got {type(ids).__name__}.", (), None
    if kwargs.get("cache") is not None and kwargs.get("past_key_values") is not None:
        return "generate() was passed both cache= and past_key_values=; pass one (cache=).", (), None
    for name in ("assistant_model", "prefix_allowed_tokens_fn", "negative_prompt_ids", "custom_generate"):
        if kwargs.get(name) is not None:
            return f"generate() under CP does not serve {name}= (assisted / constrained / guided decoding).", (), None
    try:
        config, _ = prepare_generation_config(model, kwargs.get("generation_config"),
                                              **{k: v for k, v in kwargs.items() if k != "generation_config"})
    except Exception as e:  # noqa: BLE001 -- transformers' own validation: every rank fails alike
        return f"generate() rejected its arguments: {e}", (), None
    if config.num_beams != 1 or getattr(config, "num_beam_groups", 1) not in (None, 1):
        return (f"generate() under CP serves greedy decoding and sampling (num_beams=1); got num_beams="
                f"{config.num_beams}. Beam search reorders the cache across beams, which a sharded cache does not.",
                (), config)
    err = _cache_errors(model, kwargs, config)
    if err is not None:
        return err, (), config
    chunk = getattr(config, "prefill_chunk_size", None)
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        return f"prefill_chunk_size must be a positive int or None; got {chunk!r}.", (), config
    if getattr(config, "prompt_lookup_num_tokens", None) is not None or getattr(config, "penalty_alpha", None):
        return "generate() under CP does not serve prompt lookup or contrastive search.", (), config
    for name, why in _REFUSED_OPTIONS.items():
        if getattr(config, name, False):
            return f"generate() under CP does not return {name}: {why}. Drop {name}=True.", (), config
    mask = kwargs.get("attention_mask")
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    if mask is None and isinstance(pad, int) and pad not in eos and bool((ids == pad).any()):
        mask = (ids != pad).long()  # the mask generate() infers from pad tokens
    if mask is not None:
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(ids.shape):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            if _given_cache(kwargs) is not None and isinstance(mask, Tensor) and mask.dim() == 2 \
                    and mask.shape[1] > ids.shape[1]:
                return (f"generate() with a cache takes the whole conversation, as transformers does: input_ids "
                        f"{tuple(ids.shape)} is shorter than its attention_mask {got} (the new tokens alone?). Pass "
                        "the conversation so far (out.sequences) with the follow-up appended as input_ids, and the "
                        "mask of all of it.", (), config)
            return (f"attention_mask must be a 2-D [B, N] padding mask of input_ids' shape {tuple(ids.shape)} under "
                    f"CP; got {got}. Pass the mask of the tokens you pass (1 a token, 0 padding).", (), config)
        if not bool(mask[:, -1].bool().all()):
            return ("generate() under CP needs left padding: some row's last token is padding (right padding). "
                    "Pad on the left (tokenizer.padding_side = 'left').", (), config)
        if _given_cache(kwargs) is None:
            err = inner_padding_error(mask.bool(), chunk)
            if err is not None:
                return err, (), config
    if kwargs.get("position_ids") is not None:
        return ("generate() under CP computes position_ids from the attention_mask; do not pass position_ids.", (),
                config)
    cache = _given_cache(kwargs)
    if cache is not None:  # a later turn: Note [Continuing a sharded cache] in turns.py
        state: HFState = getattr(model, ATTR)
        text = model.config.get_text_config(decoder=True)
        err = continuation_error(cache, maker=_maker(state), shape=model_shape(text, _linear(text)), ids=ids,
                                 mask=mask)
        if err is not None:
            return err, (), config
    # every option but max_time (whose decision is rank 0's: Note [Agreed stopping and sampling]); synced_gpus:
    # transformers all-reduces over the default group each step when it is on -- on every rank or on none
    settings = tuple(sorted((k, _plain_repr(v)) for k, v in config.to_dict().items() if k != "max_time"))
    given = kwargs.get("attention_mask")
    return None, (tuple(ids.shape), digest(ids.cpu()), digest(None if given is None else given.cpu()), settings,
                  repr(kwargs.get("synced_gpus")), cache_facts(cache)), config


def _given_cache(kwargs: dict):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _maker(state: HFState) -> tuple[int, int, str]:
    return state.mesh.size(), state.mesh.get_local_rank(), ring_layout(state)


def _linear(text) -> list[int]:
    """The linear-attention layers of a hybrid's text config."""
    return [i for i, t in enumerate(getattr(text, "layer_types", None) or ()) if t == "linear_attention"]


def _plain_repr(value) -> str:
    """``repr`` without memory addresses (an object's differs between ranks): its type name instead."""
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text


# the wrapper's call agreement (Note [One agreement] in core/agreement.py): _generate_error's fingerprint
_CALL = CallRules(
    "generate() under CP", ("input_ids shape", "input_ids", "attention_mask", "options", "synced_gpus", "cache"),
    refused="{what} refused the call on rank(s) {rank_list}: {error}",
    differ="{what} needs the same call on every rank of the CP group -- the full, unsharded input_ids and "
           "attention_mask and the same generation options -- but the ranks differ (a sharded prompt?). Pass every "
           "rank the whole prompt.",
)


def _steps_to_agree(config, kwargs: dict) -> bool:
    """Whether this rank's stopping decisions or tokens could differ from the other ranks' though the logits
    are the same: a clock (max_time), or objects of the caller's (criteria, logits processors)."""
    return config.max_time is not None or bool(kwargs.get("stopping_criteria")) or bool(kwargs.get("logits_processor"))


def generate(model: nn.Module, *args, **kwargs):
    """``GenerationMixin.generate`` under CP, installed as ``model.generate``: every rank passes the same full
    prompt and options, and every rank returns the same tokens -- those of the model at CP=1 with rank 0's
    generator state when sampling. See Note [generate() under CP] and Note [Agreed stopping and sampling]
    in cp_dtensor/hf/generate.py."""
    state: HFState = getattr(model, ATTR)
    if state.generating is not None:
        raise ValueError("generate() under CP is already running on this model; it cannot be re-entered (from a "
                         "streamer or a stopping criterion).")
    err, fingerprint, config = _generate_error(model, args, kwargs)
    cp, rank = state.mesh.size(), state.mesh.get_local_rank()
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    sampling = err is None and cp > 1 and bool(config.do_sample)
    get_rng, set_rng = _generator(ids.device) if sampling else (None, None)
    own = get_rng() if sampling else None
    # every rank raises, or none (Note [One agreement] in core/agreement.py); with each rank's generator state
    # and whether its stopping needs agreeing
    every = agree_objects(_CALL, fingerprint, err, state.mesh.get_group(),
                          extra=(own, err is None and _steps_to_agree(config, kwargs)))
    steps = cp > 1 and any(x[1] for x in every)  # Note [Agreed stopping and sampling]: decided alike on every rank
    if config.cache_implementation == "dynamic":  # what the sharded cache is: transformers must not build one
        kwargs = {**kwargs, "cache_implementation": None}
    call = GenerateCall()
    text = model.config.get_text_config(decoder=True)
    given, saved = _given_cache(kwargs), None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")}  # None too: ours is passed
    if given is None:
        call.cache = ShardedCache(call, text.num_hidden_layers, _linear(text), maker=_maker(state),
                                  shape=model_shape(text, _linear(text)))
    else:  # a later turn (agreed and checked above): Note [Continuing a sharded cache] in turns.py
        call.cache = given
        given.bind(call)
        saved = given.begin_turn()  # Note [Transactional turns] in turns.py
    state.generating = call
    try:
        if sampling:
            set_rng(every[0][0])  # rank 0's generator: Note [Agreed stopping and sampling]
        agreed = (lambda criteria: AgreedStopping(criteria, state.mesh)) if steps else (lambda criteria: criteria)
        with generation_stopping_criteria(model, agreed):
            out = type(model).generate(model, *args, cache=call.cache, **kwargs)
        call.cache.trim()  # the windowed layers' shares: what the next turn's windows can reach
        return out
    except BaseException:
        if saved is not None:  # the cache as it was before the call: the turn can be retried
            given.restore(saved)
        raise
    finally:
        state.generating, state.decoding, call.step = None, None, None
        if sampling and rank != 0:
            set_rng(own)  # the other ranks' generators as they were
