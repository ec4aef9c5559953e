"""The KV cache of generate() under CP (transformers' cache interface): each rank's share of the attention
layers' K/V (``ShardedCacheLayer``, in the layout's order of global positions, grown by ``_GROW`` columns at a
time while decoding) and the full recurrent / conv states of a hybrid's linear-attention layers
(``ReplicatedLinearLayer``, the same on every rank). See Note [generate() under CP] in generate.py and Note
[Hybrid generate() under CP] in linear.py.

Note [Masks by column]
~~~~~~~~~~~~~~~~~~~~~~
transformers masks a cached forward by *column* -- the cache position, pads included -- not by the
position ids the rotary embedding reads (``cumsum(attention_mask) - 1``): a query at column q sees the
unpadded keys at columns k with q - W < k <= q. With left padding only the two agree up to a row's
constant, but padding *inside* a conversation (rows whose follow-ups differ in length, padded on the
left of each follow-up; a chunk of a chunked prefill) makes them differ: the window then spans fewer
real tokens in the padded row. So the sharded cache records, for each slot, its global column (-1 for
padding), and the decode and pass-KV attention mask by those columns: causality is the same either way
(positions grow with columns), the window is the model's own. The ring prefill's mask is by column
already (its global index, the layout's pad columns before the prompt). The position ids go only to the
model (its rotary embedding), as transformers passes them.

Note [Windowed caches]
~~~~~~~~~~~~~~~~~~~~~~
A layer with a sliding window W (Mistral; gpt-oss's alternate layers) never reads a cached key again once
it is W - 1 or more columns behind the next query: the next forward's first query is at the column the
cache has seen, c, and sees keys at columns >= c - (W - 1). So each windowed layer drops the slots below
that column -- before every append (prefill chunks, turns, decode steps) and when generate() returns --
and keeps only what the window can still reach: at most W - 1 columns across the ranks (plus the pads
among them), as transformers' sliding cache keeps W - 1. The new columns go to the ranks by the balance
rule (the rank holding the fewest tokens), which deals consecutive columns round the ranks after a
striped prefill, so each rank keeps about (W - 1) / P of them. The layer learns W from its attention
(``note_reach``, the window the attention runs with), so a layer is trimmed only by the window it uses.
A trimmed layer holds its own slot columns (``_Positions.suffix``), no longer the full layers' shared ones;
a pass-KV turn gathers them (one small all-gather per windowed layer, trimmed here or not: whether a
rank trimmed differs between ranks, the layer's window does not) for its blocks. A share is never
empty (the last slot stays). Trimming slices views, so a failed turn's saved state stays whole (Note
[Transactional turns] in hf/turns.py); the dropped prefix is freed when the buffer next grows.
After a contiguous or headtail prefill the prompt's last columns lie on one or two ranks, which then keep
up to min(W - 1, their share) until decoding deals new columns round the ranks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from .._extras import require

require("hf", "cp_dtensor.hf (transformers generate() under context parallelism)")

from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer  # noqa: E402

__all__ = ["GenerateCall", "ReplicatedLinearLayer", "ShardedCache", "ShardedCacheLayer", "cache_bytes", "token_fingerprint"]

_GROW = 32  # columns added to a layer's buffer at a time while decoding


class _Positions:
    """The global columns of this rank's cache slots, [B, S_r] (-1 padding), and the same without the padding,
    [S_r] on the host (``cols``): shared by the layers that hold the same slots (all but the windowed ones, Note
    [Windowed caches])."""

    def __init__(self):
        self.buf: Tensor | None = None
        self.cols = torch.empty(0, dtype=torch.long)
        self.held = 0

    def extend(self, held: int, pos: Tensor, cols: Tensor, cap: int) -> Tensor:
        """Slots ``held - t .. held`` hold ``pos`` [B, t], at columns ``cols`` [t] (written by the first layer to
        get there)."""
        if self.buf is None or self.held < held:
            n = held - pos.shape[1]
            if self.buf is None or held > self.buf.shape[1] or _frozen(self.buf):
                grown = pos.new_empty(pos.shape[0], cap)
                if n:
                    grown[:, :n] = self.buf[:, :n]
                self.buf = grown
            self.buf[:, n:held] = pos
            self.cols = torch.cat([self.cols[:n], cols])
            self.held = held
        return self.buf[:, :held]

    def suffix(self, d: int) -> _Positions:
        """A copy holding the slots from ``d`` on (a windowed layer's own, once it drops slots)."""
        out = _Positions()
        out.buf, out.cols, out.held = self.buf[:, d:self.held], self.cols[d:self.held], self.held - d
        return out


def _frozen(x: Tensor) -> bool:
    """Whether ``x`` cannot be written in place here: an inference tensor (a turn run under
    ``torch.inference_mode()``) outside inference mode. It is copied instead, as transformers' ``torch.cat``
    copies its cache (Note [Transactional turns])."""
    return x.is_inference() and not torch.is_inference_mode_enabled()


class _Step:
    """What the base model's pre-hook decided for this forward, read by the cache layers and attention."""

    def __init__(self, kind: str, positions: Tensor, keep: Tensor, columns: int, q_positions: Tensor | None = None,
                 q_padding: Tensor | None = None, *, slots: Tensor):
        self.kind = kind  # "prefill" or "decode"
        self.positions = positions  # [B, n]: global columns of the columns this rank keeps (-1: padding)
        self.slots = slots  # [n] int64 on the host: those columns, padding or not
        self.keep = keep  # [n]: which of this forward's (local) columns this rank keeps
        self.columns = columns  # columns this forward adds to the global sequence
        self.q_positions = q_positions  # decode: [B, T] positions of the new tokens
        self.q_padding = q_padding  # decode: [B, T] bool, the new columns that are padding (a prefill chunk's)


@dataclass(eq=False)
class GenerateCall:
    """One generate() call's state, in ``HFState.generating`` while it runs (Note [CP state on a model])."""

    cache: ShardedCache | None = None  #: this rank's share of the KV cache
    step: _Step | None = None  #: what the base model's pre-hook decided for the current forward
    prompt: tuple[int, int] | None = None  #: (prompt length N, internal pad columns) of the prefill


class ShardedCacheLayer(CacheLayerMixin):
    """One layer's share of the KV cache on this rank: ``keys`` [B, Hkv, S_r, D], ``values`` [B, Hkv, S_r, Dv]
    and ``positions`` [B, S_r] (the slots' global columns: Note [Masks by column]; -1 a padding slot). ``get_seq_length`` is the global length."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, call: GenerateCall | None, positions: _Positions | None = None):
        super().__init__()
        self._call = call
        self._k = self._v = None
        self._pos = _Positions() if positions is None else positions
        self.positions: Tensor | None = None
        self.held = 0  # S_r
        self.columns = 0  # the global sequence length seen
        self.reach: int | None = None  # a windowed layer's W - 1 (its attention says so): Note [Windowed caches]
        self.latent = False  # holds what its attention expands (an MLA latent), not the K/V: Note [Pass-KV turns]

    def trim(self) -> None:
        """Drop the slots no later query can reach: columns below ``columns - reach`` (Note [Windowed caches]).
        The last slot stays (a share is never empty). Views, not copies: a failed turn's saved state stays whole."""
        if self.reach is None or self.held < 2:
            return
        d = min(int((self._pos.cols[:self.held] < self.columns - self.reach).sum()), self.held - 1)
        if d == 0:
            return
        self._pos = self._pos.suffix(d)
        self._k, self._v = self._k[:, :, d:], self._v[:, :, d:]
        self.held -= d
        self.keys, self.values = self._k[:, :, :self.held], self._v[:, :, :self.held]
        self.positions = self._pos.buf[:, :self.held]

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self._k, self._v = key_states[:, :, :0].clone(), value_states[:, :, :0].clone()
        self.keys, self.values = self._k, self._v
        self.is_initialized = True

    def _append(self, k: Tensor, v: Tensor, pos: Tensor, cols: Tensor) -> None:
        self.trim()
        n, t = self.held, k.shape[2]
        if n + t > self._k.shape[2] or _frozen(self._k):  # grow by whole blocks: amortised appends, a bounded overhang
            cap = max(n + t + (_GROW if self._call.step.kind == "decode" else 0), self._k.shape[2])
            grow = lambda x: torch.cat([x[:, :, :n], x.new_empty(*x.shape[:2], cap - n, x.shape[3])], 2)  # noqa: E731
            self._k, self._v = grow(self._k), grow(self._v)
        self._k[:, :, n:n + t], self._v[:, :, n:n + t] = k, v
        self.held = n + t
        self.keys, self.values = self._k[:, :, :n + t], self._v[:, :, :n + t]
        self.positions = self._pos.extend(n + t, pos, cols, self._k.shape[2])

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        step = None if self._call is None else self._call.step
        if step is None:
            raise ValueError("a cp_dtensor ShardedCache is filled by model.generate() under CP only; pass no cache "
                             "to a plain forward, or call generate().")
        if step.kind == "pass-kv":  # kept after the attention's gather (keep_new): Note [Pass-KV turns]
            self.columns += step.columns
            return key_states, value_states
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keep = step.keep.to(key_states.device)
        self._append(key_states.index_select(2, keep), value_states.index_select(2, keep),
                     step.positions.to(key_states.device), step.slots)
        self.columns += step.columns
        if step.kind == "prefill":  # the ring runs on this rank's shard as it came (pads included)
            return key_states, value_states
        return self.keys, self.values

    def keep_new(self, k: Tensor, v: Tensor, positions: Tensor, cols: Tensor) -> None:
        """A pass-KV forward's new columns this rank keeps: k [B, Hkv, m, D], v, positions [B, m], cols [m]."""
        self._append(k, v, positions, cols)

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
        raise ValueError(_REFUSED)

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse


_REFUSED = ("a cp_dtensor ShardedCache cannot be cropped, reordered or re-batched (beam search, assisted decoding, "
            "contrastive search); generate greedily or by sampling under CP.")


class ReplicatedLinearLayer(LinearAttentionLayer):
    """A linear-attention layer's cache under CP: the *full* recurrent state [B, Hv, dk, dv] and conv state
    [B, C, K] -- the same bits on every rank. The CP prefill stores them (the fold of every rank's summary and
    the prompt's last K conv inputs, Note [Prefill for decoding] in core/linear/linear_attention.py); each decode step
    then runs transformers' own recurrent step on them, on every rank alike. Cropping, reordering, re-batching
    and past recording are refused on every rank, as for the attention layers' shares
    (:class:`ShardedCacheLayer`)."""

    def __init__(self, call: GenerateCall | None):
        super().__init__(number_of_states=1)
        self._call = call

    def update_conv_state(self, conv_states: Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> Tensor:
        step = None if self._call is None else self._call.step
        if step is None:
            raise ValueError("a cp_dtensor ShardedCache is filled by model.generate() under CP only; pass no cache "
                             "to a plain forward, or call generate().")
        if step.kind == "prefill":  # x [B, C, S_local]: the conv runs sharded and stores the state (store_conv)
            return conv_states
        return super().update_conv_state(conv_states, state_idx, conv_kernel_size=conv_kernel_size, **kwargs)

    def store_conv(self, state: Tensor, state_idx: int = 0) -> None:
        """The prefill's conv state: the prompt's last K inputs [B, C, K], the same on every rank."""
        self.lazy_initialization(conv_states=state, state_idx=state_idx)
        self.conv_states[state_idx].copy_(state)
        self.has_previous_state[state_idx] = True

    _STATE = ("conv_states", "recurrent_states", "is_conv_states_initialized", "is_recurrent_states_initialized",
              "has_previous_state", "conv_kernel_size", "device", "dtype")

    def work_on_copies(self) -> dict:
        """The layer's state as it is (returned, to restore), the layer going on with copies of its tensors --
        which a turn outside ``torch.inference_mode()`` may also write after one inside it."""
        saved = {name: getattr(self, name) for name in self._STATE}
        for name in ("conv_states", "recurrent_states"):
            setattr(self, name, {i: None if x is None else x.clone() for i, x in saved[name].items()})
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                     "conv_kernel_size"):
            setattr(self, name, dict(saved[name]))
        return saved

    def restore(self, saved: dict) -> None:
        for name, value in saved.items():
            setattr(self, name, value)

    def _refuse(self, *_args, **_kwargs):
        raise ValueError(_REFUSED)

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = activate_past_recording = _refuse


class ShardedCache(Cache):
    """A transformers ``Cache`` under CP: :class:`ShardedCacheLayer` s holding this rank's tokens only, and for
    the layers in ``linear`` (a hybrid model's linear-attention layers) :class:`ReplicatedLinearLayer` s
    holding the full states. ``maker`` (P, this rank, layout) names the CP run that fills it; ``held`` (each
    rank's token count, the same list on every rank) and ``tokens`` (a fingerprint of the token ids and mask
    it holds, [B] int64) let a later generate() continue it (Note [Continuing a sharded cache] in hf/turns.py)."""

    def __init__(self, call: GenerateCall | None, num_layers: int, linear=(), *,
                 maker: tuple[int, int, str] | None = None, shape: dict | None = None):
        positions = self._shared = _Positions()  # shared: every layer holds the same slots (but trimmed ones)
        super().__init__(layers=[ReplicatedLinearLayer(call) if i in set(linear) else ShardedCacheLayer(call, positions)
                                 for i in range(num_layers)])
        self.maker = maker
        self.shape = shape  # the attention shape of the model it was made for (turns.model_shape)
        self.linear = tuple(sorted(set(linear)))
        self.held: list[int] | None = None  # tokens each rank's share holds, set by the first (prefill) forward
        self.seen = 0  # columns of the global sequence the cache holds
        self.tokens: Tensor | None = None  # [B] int64: fingerprint of those columns' ids and mask (turns.py)
        self.plain: Tensor | None = None  # [B] int64: fingerprint of those columns' ids alone
        self.checkpoints: tuple = ()  # (seen, tokens) where each continuing call began
        self.runs: Counter[str] = Counter()  # forwards by kind: "prefill", "decode" (pass-Q), "pass-kv"

    def _kind(self) -> str:
        layer = self.layers[0]
        return layer._call.step.kind if layer._call is not None and layer._call.step is not None else "?"

    def bind(self, call: GenerateCall) -> None:
        """Let ``call`` (a generate() call continuing this cache) fill it."""
        for layer in self.layers:
            layer._call = call

    def begin_turn(self) -> tuple:
        """Start a generate() call that continues this cache: what :meth:`restore` puts back if the call fails.
        A linear layer works on copies of its states from here on (its originals are the saved state). See
        Note [Transactional turns] in hf/turns.py."""
        shared = {id(x._pos): x._pos for x in self.layers if isinstance(x, ShardedCacheLayer)}
        layers = []
        for x in self.layers:
            if isinstance(x, ShardedCacheLayer):
                layers.append((x._k, x._v, x.keys, x.values, x.positions, x.held, x.columns, x.is_initialized, x._pos))
            else:
                layers.append(x.work_on_copies())
        saved = (None if self.held is None else list(self.held), self.seen, self.tokens, self.plain, self.checkpoints,
                 Counter(self.runs), [(p, p.buf, p.cols, p.held) for p in shared.values()], layers)
        self.checkpoints += ((self.seen, self.tokens),)
        return saved

    def restore(self, saved: tuple) -> None:
        """Put back what :meth:`begin_turn` saved: the cache as it was before the failed call."""
        held, self.seen, self.tokens, self.plain, self.checkpoints, self.runs, shared, layers = saved
        self.held = None if held is None else list(held)
        for p, buf, cols, n in shared:
            p.buf, p.cols, p.held = buf, cols, n
        for x, state in zip(self.layers, layers):
            if isinstance(x, ShardedCacheLayer):
                x._k, x._v, x.keys, x.values, x.positions, x.held, x.columns, x.is_initialized, x._pos = state
            else:
                x.restore(state)

    def shared_layer(self) -> int | None:
        """A layer holding every slot of this rank's share (untrimmed), or None."""
        return next((i for i, x in enumerate(self.layers) if isinstance(x, ShardedCacheLayer) and x._pos is self._shared
                     and x.positions is not None), None)

    def trim(self) -> None:
        """Every windowed layer's share down to what its window can still reach (Note [Windowed caches])."""
        for layer in self.layers:
            if isinstance(layer, ShardedCacheLayer):
                layer.trim()

    def note_reach(self, idx: int, window) -> None:
        """The attention of layer ``idx`` runs with ``window`` ((left, right) or None): a cached key older than
        ``left`` columns before a query is never read again."""
        layer = self.layers[idx]
        if isinstance(layer, ShardedCacheLayer) and window is not None and window[0] >= 0:
            layer.reach = window[0]

    def note_attended(self, idx: int, key: Tensor, value: Tensor) -> None:
        """The attention of layer ``idx`` ran on ``key``, ``value`` [B, Hkv, S, D(v)]: a layer whose stored tensors
        have other heads or dims caches a latent the model expands (transformers' DeepSeek-style MLA caches
        [B, 1, S, kv_lora_rank] and the rotary key), which pass-KV cannot ring (Note [Pass-KV turns])."""
        layer = self.layers[idx]
        if isinstance(layer, ShardedCacheLayer) and layer.keys is not None and layer.values is not None:
            stored = (layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1])
            layer.latent = layer.latent or stored != (key.shape[1], key.shape[-1], value.shape[-1])

    def columns(self, b: int, n: int, device) -> Tensor:
        """[B, n] int64: the global columns of a forward's ``n`` new tokens (Note [Masks by column])."""
        return torch.arange(self.seen, self.seen + n, device=device).expand(b, n)

    def note_tokens(self, ids: Tensor, real: Tensor) -> None:
        """Record the ``ids`` [B, n] (``real`` [B, n]: not padding) a forward adds at columns seen .. seen + n,
        and the kind of the forward (``runs``)."""
        self.runs[self._kind()] += 1
        part = token_fingerprint(ids, real, self.seen)
        self.tokens = part if self.tokens is None else self.tokens + part
        part = token_fingerprint(ids, torch.ones_like(real), self.seen)
        self.plain = part if self.plain is None else self.plain + part
        self.seen += ids.shape[1]


def token_fingerprint(ids: Tensor, real: Tensor, start: int = 0) -> Tensor:
    """A cheap fingerprint per row of token ids [B, n] and their padding mask ``real`` [B, n] at global columns
    ``start ..``: [B] int64, a sum over columns (wrapping), so the fingerprints of consecutive pieces add up to the
    whole's. Computed where the ids live (no device sync)."""
    col = torch.arange(start + 1, start + ids.shape[1] + 1, dtype=torch.int64, device=ids.device)
    x = ids.long() * 2 + real.long() + 1  # [B, n]
    return (x * (col * 1000003 + 7) + x * x * (col * 998244353 + 11)).sum(1)


def cache_bytes(cache: Cache) -> int:
    """Bytes of the K/V (and positions) storage this rank's cache allocates, each buffer once."""
    seen, total = set(), 0
    for layer in cache.layers:
        for x in (layer.keys, layer.values, getattr(layer, "positions", None)):
            if x is not None and x.untyped_storage().data_ptr() not in seen:
                seen.add(x.untyped_storage().data_ptr())
                total += x.untyped_storage().nbytes()
    return total
