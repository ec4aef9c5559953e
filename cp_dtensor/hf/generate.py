"""transformers ``generate()`` under CP: a ring prefill into a sequence-sharded KV cache, then decoding from it.

Note [generate() under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~
After ``cp_dtensor.hf.apply_context_parallel(model, cp_mesh, layout=...)`` every rank calls ``model.generate(...)``
with the same full inputs. The wrapper installed here checks the call on every rank (what it cannot
serve raises on every rank before the first token, as do inputs that differ between ranks) and hands
generate a :class:`ShardedCache` -- a transformers ``Cache`` whose layers hold only this rank's tokens:

* prefill (the cache is empty): a pre-hook on the base model pads the prompt to a multiple of the
  layout unit (pad tokens masked: each its own document) and passes each rank its layout shard of
  input_ids, position_ids and the padding mask. The layers run on the shard; ``cache.update`` stores
  the shard's K/V (minus the internal pad columns) with their global positions (-1 for left padding)
  and returns them for the ring (hf/attention.py's attention function, no K/V all-gather). A hook after the base
  model rebuilds only the hidden rows the LM head reads (``logits_to_keep``, 1 in generate) by one
  all-gather of [P, B, k, H], so every rank computes the same logits.
* decode (T new tokens, the same on every rank): the layers run replicated; ``cache.update`` keeps each
  new token on one rank only -- the one holding the fewest tokens, lowest first: column c mod P after a
  striped prefill (the striped layout, continued) -- and returns this rank's
  share; the attention function runs :func:`cp_dtensor.sharded_cache_attention` (decode.py) over it --
  one all-gather of B * Hq * T * (Dv + 1) fp32 values per layer, bit-identical outputs on every rank,
  hence identical logits, sampling (same seed) and EOS decisions: every rank stops at the same step.

Windows and sinks come from the layer as in Note [transformers under CP] (hf/attention.py); masks are by the
positions generate computes (``cumsum(attention_mask) - 1``), which equal transformers' column rule for
left padding. Keys outside a sliding window stay in the cache (masked, not dropped).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._extras import require

require("hf", "cp_dtensor.hf (transformers generate() under context parallelism)")

from transformers.cache_utils import Cache, CacheLayerMixin  # noqa: E402

from ..core.comm import all_gather, all_gather_objects, host_group, wait  # noqa: E402
from ..core.decode import attend, digest, local_error  # noqa: E402
from ..core.layout import global_order, layout_unit, shard_tensor  # noqa: E402

__all__ = ["ShardedCache", "ShardedCacheLayer", "cache_bytes", "enable_generate"]

_GROW = 32  # columns added to a layer's buffer at a time while decoding


class _Positions:
    """The global positions of this rank's cache slots, [B, S_r]: the same for every layer, stored once."""

    def __init__(self):
        self.buf: Tensor | None = None
        self.held = 0

    def extend(self, held: int, pos: Tensor, cap: int) -> Tensor:
        """Slots ``held - t .. held`` hold ``pos`` [B, t] (written by the first layer to get there)."""
        if self.buf is None or self.held < held:
            n = held - pos.shape[1]
            if self.buf is None or held > self.buf.shape[1]:
                grown = pos.new_empty(pos.shape[0], cap)
                if n:
                    grown[:, :n] = self.buf[:, :n]
                self.buf = grown
            self.buf[:, n:held] = pos
            self.held = held
        return self.buf[:, :held]


class _Step:
    """What the base model's pre-hook decided for this forward, read by the cache layers and attention."""

    def __init__(self, kind: str, positions: Tensor, keep: Tensor, columns: int, q_positions: Tensor | None = None):
        self.kind = kind  # "prefill" or "decode"
        self.positions = positions  # [B, n]: global positions of the columns this rank keeps (-1: padding)
        self.keep = keep  # [n]: which of this forward's (local) columns this rank keeps
        self.columns = columns  # columns this forward adds to the global sequence
        self.q_positions = q_positions  # decode: [B, T] positions of the new tokens


class ShardedCacheLayer(CacheLayerMixin):
    """One layer's share of the KV cache on this rank: ``keys`` [B, Hkv, S_r, D], ``values`` [B, Hkv, S_r, Dv]
    and ``positions`` [B, S_r] (global positions; -1 an empty slot). ``get_seq_length`` is the global length."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, ctx, positions: _Positions | None = None):
        super().__init__()
        self._ctx = ctx
        self._k = self._v = None
        self._pos = _Positions() if positions is None else positions
        self.positions: Tensor | None = None
        self.held = 0  # S_r
        self.columns = 0  # the global sequence length seen

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self._k, self._v = key_states[:, :, :0].clone(), value_states[:, :, :0].clone()
        self.keys, self.values = self._k, self._v
        self.is_initialized = True

    def _append(self, k: Tensor, v: Tensor, pos: Tensor) -> None:
        n, t = self.held, k.shape[2]
        if n + t > self._k.shape[2]:  # grow by whole blocks: amortised appends, a bounded overhang
            cap = n + t + (_GROW if self._ctx.step.kind == "decode" else 0)
            grow = lambda x: torch.cat([x[:, :, :n], x.new_empty(*x.shape[:2], cap - n, x.shape[3])], 2)  # noqa: E731
            self._k, self._v = grow(self._k), grow(self._v)
        self._k[:, :, n:n + t], self._v[:, :, n:n + t] = k, v
        self.held = n + t
        self.keys, self.values = self._k[:, :, :n + t], self._v[:, :, :n + t]
        self.positions = self._pos.extend(n + t, pos, self._k.shape[2])

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        step = self._ctx.step
        if step is None:
            raise ValueError("a cp_dtensor ShardedCache is filled by model.generate() under CP only; pass no cache "
                             "to a plain forward, or call generate().")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keep = step.keep.to(key_states.device)
        self._append(key_states.index_select(2, keep), value_states.index_select(2, keep),
                     step.positions.to(key_states.device))
        self.columns += step.columns
        if step.kind == "prefill":  # the ring runs on this rank's shard as it came (pads included)
            return key_states, value_states
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.columns + query_length if self.columns else query_length), 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._k = self._v = self.positions = self.keys = self.values = None
        self._pos = _Positions()
        self.held = self.columns = 0
        self.is_initialized = False

    def _refuse(self, *_args, **_kwargs):
        raise ValueError("a cp_dtensor ShardedCache cannot be cropped, reordered or re-batched (beam search, "
                         "assisted decoding, contrastive search); generate greedily or by sampling under CP.")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse


class ShardedCache(Cache):
    """A transformers ``Cache`` of :class:`ShardedCacheLayer` s: each rank holds its own tokens only."""

    def __init__(self, ctx, num_layers: int):
        positions = _Positions()  # shared: every layer holds the same slots
        super().__init__(layers=[ShardedCacheLayer(ctx, positions) for _ in range(num_layers)])


def cache_bytes(cache: Cache) -> int:
    """Bytes of the K/V (and positions) storage this rank's cache allocates, each buffer once."""
    seen, total = set(), 0
    for layer in cache.layers:
        for x in (layer.keys, layer.values, getattr(layer, "positions", None)):
            if x is not None and x.untyped_storage().data_ptr() not in seen:
                seen.add(x.untyped_storage().data_ptr())
                total += x.untyped_storage().nbytes()
    return total


# -- the model hooks ----------------------------------------------------------------------------------


def _base_pre_hook(ctx, module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, ShardedCache):
        ctx.step = None
        return args, kwargs
    ids, mask, pos = kwargs.get("input_ids"), kwargs.get("attention_mask"), kwargs.get("position_ids")
    if ids is None or args or pos is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("generate() under CP passes input_ids, position_ids and the cache by keyword; got another call.")
    b, n = ids.shape
    pos = pos.expand(b, n)
    cp, rank = ctx.mesh.size(), ctx.mesh.get_local_rank()
    real = torch.ones(b, n, dtype=torch.bool, device=ids.device) if mask is None else mask[:, -n:].bool()
    if cache.get_seq_length() == 0:  # prefill: this rank's layout shard of the padded prompt
        unit = layout_unit(ctx.layout, cp)
        pad = -n % unit
        padded = lambda x, v: torch.nn.functional.pad(x, (0, pad), value=v)  # noqa: E731
        shard = lambda x: shard_tensor(x, seq_dim=1, layout=ctx.layout, rank=rank, world=cp).contiguous()  # noqa: E731
        cols = shard(torch.arange(n + pad, device=ids.device)[None])[0]  # global columns held here
        keep = torch.nonzero(cols < n).flatten()
        kpos = shard(padded(pos.masked_fill(~real, -1), -1)).index_select(1, keep)
        ctx.step = _Step("prefill", kpos, keep, n)
        ctx.prompt = (n, pad)
        every = global_order(ctx.layout, cp, n + pad).view(cp, -1)  # [P, S_local]: each rank's columns
        ctx.held = (every < n).sum(1).tolist()  # the prompt tokens each rank keeps
        kwargs["input_ids"], kwargs["position_ids"] = shard(padded(ids, 0)), shard(padded(pos, 0))
        if mask is not None or pad:
            kwargs["attention_mask"] = shard(padded(real.long(), 0))
        return args, kwargs
    # decode: each new column goes to the rank holding the fewest tokens (the lowest on ties) -- for the
    # striped layout exactly column mod P; after another layout's prefill it evens out the shares
    owners = []
    for _ in range(n):
        owners.append(min(range(cp), key=lambda r: (ctx.held[r], r)))
        ctx.held[owners[-1]] += 1
    keep = torch.nonzero(torch.tensor(owners) == rank).flatten()
    kpos = pos.masked_fill(~real, -1).index_select(1, keep.to(ids.device))
    ctx.step = _Step("decode", kpos, keep, n, q_positions=pos.contiguous())
    return args, kwargs


def _base_post_hook(ctx, module, args, kwargs, output):
    step = ctx.step
    if step is None or step.kind != "prefill":
        return output
    n, pad = ctx.prompt
    keep = ctx.keep_logits
    k = keep if isinstance(keep, int) and 0 < keep <= n else n
    output.last_hidden_state = _gather_columns(ctx, output.last_hidden_state, n + pad, range(n - k, n))
    return output


def _gather_columns(ctx, h: Tensor, total: int, columns) -> Tensor:
    """The rows ``columns`` of the global [B, total, H] from every rank's layout shard ``h`` [B, S_local, H]:
    one all-gather of [B, k, H] per rank, each filling the rows it holds. Exact; the same on every rank."""
    cp, rank = ctx.mesh.size(), ctx.mesh.get_local_rank()
    cols = torch.tensor(list(columns), dtype=torch.long)
    where = torch.argsort(global_order(ctx.layout, cp, total))[cols]  # index into the rank-major concatenation
    s = total // cp
    owner, local = where // s, where % s
    if cp == 1:
        return h.index_select(1, local.to(h.device))
    mine = torch.nonzero(owner == rank).flatten()
    buf = h.new_zeros(h.shape[0], len(cols), h.shape[2])
    buf[:, mine.to(h.device)] = h.index_select(1, local[mine].to(h.device))
    group = ctx.mesh.get_group()
    every = wait(all_gather(buf.reshape(-1), group), group).view(cp, *buf.shape)  # [P, B, k, H]
    return every[owner.to(h.device), :, torch.arange(len(cols), device=h.device)].transpose(0, 1).contiguous()


def decode_attention(ctx, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling, window, sinks):
    """The decode step's attention: the new queries against this rank's share of the layer's cache.
    query: [B, Hq, T, D]; key, value: this rank's [B, Hkv, S_r, D(v)]. Returns [B, T, Hq, Dv]."""
    layer = ctx.cache.layers[module.layer_idx]
    q_pos, k_pos = ctx.step.q_positions, layer.positions
    # every rank computed query, positions and options alike from the agreed call (the generate() wrapper):
    # only the local checks run here, no agreement round per layer
    err = local_error(query, key, value, q_pos, k_pos, scaling, window, sinks)
    if err is not None:
        raise ValueError(err)
    out = attend(query, key, value, q_positions=q_pos, k_positions=k_pos, group=ctx.mesh.get_group(),
                 world=ctx.mesh.size(), scale=scaling, window_size=window, sinks=sinks)
    return out.transpose(1, 2).contiguous()


# -- the generate() wrapper ----------------------------------------------------------------------------

_REFUSED_OPTIONS = {
    "output_attentions": "attention weights are never formed under CP",
    "output_hidden_states": "each rank holds its shard of the prompt's hidden states",
}


def _generate_error(model, args, kwargs) -> tuple[str | None, tuple]:
    """(why this call cannot be served, or None; a fingerprint of the call that every rank must share)."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if kwargs.get("inputs_embeds") is not None:
        return "generate() under CP takes input_ids, not inputs_embeds.", ()
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        return f"generate() under CP needs input_ids as a [B, N] int64 tensor; got {type(ids).__name__}.", ()
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            return (f"generate() under CP builds its own sequence-sharded cache; got {name}=. Pass no cache (the "
                    "returned one, past_key_values, holds this rank's tokens only and cannot be continued).", ())
    for name in ("assistant_model", "prefix_allowed_tokens_fn", "negative_prompt_ids", "custom_generate"):
        if kwargs.get(name) is not None:
            return f"generate() under CP does not serve {name}= (assisted / constrained / guided decoding).", ()
    try:
        config, _ = model._prepare_generation_config(kwargs.get("generation_config"),
                                                     **{k: v for k, v in kwargs.items() if k != "generation_config"})
    except Exception as e:  # noqa: BLE001 -- transformers' own validation: every rank fails alike
        return f"generate() rejected its arguments: {e}", ()
    if config.num_beams != 1 or getattr(config, "num_beam_groups", 1) not in (None, 1):
        return (f"generate() under CP serves greedy decoding and sampling (num_beams=1); got num_beams="
                f"{config.num_beams}. Beam search reorders the cache across beams, which a sharded cache does not.", ())
    if config.use_cache is False:
        return ("generate() under CP needs use_cache=True (the default): without a cache every step would re-run "
                "the whole sequence on each rank's shard. Drop use_cache=False.", ())
    if config.cache_implementation is not None:
        return (f"generate() under CP uses its own sequence-sharded cache; cache_implementation="
                f"{config.cache_implementation!r} (static / offloaded / quantized / paged) cannot be sharded. "
                "Leave cache_implementation unset.", ())
    if getattr(config, "prefill_chunk_size", None) is not None:
        return "generate() under CP prefills the whole prompt with the ring; drop prefill_chunk_size.", ()
    if getattr(config, "prompt_lookup_num_tokens", None) is not None or getattr(config, "penalty_alpha", None):
        return "generate() under CP does not serve prompt lookup or contrastive search.", ()
    for name, why in _REFUSED_OPTIONS.items():
        if getattr(config, name, False):
            return f"generate() under CP does not return {name}: {why}. Drop {name}=True.", ()
    mask = kwargs.get("attention_mask")
    pad, eos = config.pad_token_id, config.eos_token_id
    eos = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])
    if mask is None and isinstance(pad, int) and pad not in eos and bool((ids == pad).any()):
        mask = (ids != pad).long()  # the mask generate() infers from pad tokens
    if mask is not None:
        if not isinstance(mask, Tensor) or tuple(mask.shape) != tuple(ids.shape):
            return f"attention_mask must be a 2-D [B, N] = {tuple(ids.shape)} padding mask under CP.", ()
        if not bool(mask[:, -1].bool().all()):
            return ("generate() under CP needs left padding: some row's last token is padding (right padding). "
                    "Pad on the left (tokenizer.padding_side = 'left').", ())
    if kwargs.get("position_ids") is not None:
        return "generate() under CP computes position_ids from the attention_mask; do not pass position_ids.", ()
    settings = tuple(repr(getattr(config, a, None)) for a in (
        "max_length", "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
        "eos_token_id", "pad_token_id", "num_return_sequences", "repetition_penalty", "return_dict_in_generate",
        "output_logits", "output_scores"))
    given = kwargs.get("attention_mask")
    return None, (tuple(ids.shape), digest(ids.cpu()), digest(None if given is None else given.cpu()), settings)


def enable_generate(model: nn.Module, ctx) -> None:
    """Install the generate() support on a model that ``cp_dtensor.hf.apply_context_parallel`` has prepared."""
    ctx.step, ctx.cache, ctx.prompt, ctx.held, ctx.keep_logits = None, None, None, None, 0
    base = model.base_model
    base.register_forward_pre_hook(lambda m, a, k: _base_pre_hook(ctx, m, a, k), with_kwargs=True)
    base.register_forward_hook(lambda m, a, k, o: _base_post_hook(ctx, m, a, k, o), with_kwargs=True)

    def keep_logits(m, a, k):
        ctx.keep_logits = k.get("logits_to_keep", 0)
        return a, k

    model.register_forward_pre_hook(keep_logits, with_kwargs=True)
    ctx.decode = lambda *a: decode_attention(ctx, *a)
    original = model.generate  # the bound GenerationMixin.generate

    def generate(*args, **kwargs):
        """``GenerationMixin.generate`` under CP: see Note [generate() under CP] in cp_dtensor/hf_generate.py."""
        err, fingerprint = _generate_error(model, args, kwargs)
        cp = ctx.mesh.size()
        if cp > 1:  # Note [Agreeing before the ring] (checks.py): every rank raises, or none
            every = all_gather_objects((err, fingerprint), host_group(ctx.mesh.get_group()))
            bad = [(r, e) for r, (e, _) in enumerate(every) if e is not None]
            if bad:
                raise ValueError(f"generate() under CP refused the call on rank(s) {[r for r, _ in bad]}: {bad[0][1]}")
            if any(f != every[0][1] for _, f in every):
                raise ValueError(
                    "generate() under CP needs the same call on every rank of the CP group -- the full, unsharded "
                    "input_ids and attention_mask and the same generation options -- but the ranks differ (a "
                    "sharded prompt?). Pass every rank the whole prompt.")
        elif err is not None:
            raise ValueError(err)
        text = model.config.get_text_config(decoder=True)
        ctx.cache = ShardedCache(ctx, text.num_hidden_layers)
        try:
            return original(*args, cache=ctx.cache, **kwargs)
        finally:
            ctx.step, ctx.cache = None, None

    model.generate = generate
