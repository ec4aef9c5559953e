"""Continuing a sequence-sharded KV cache under CP: a second turn of a conversation, or the next chunk of a
chunked prefill -- the checks on a cache passed to generate(), and the rule that says what a turn sends.

Note [Continuing a sharded cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``model.generate(ids, cache=out.cache, ...)`` (or ``past_key_values=``) on every rank, with the same full
conversation ``ids`` [B, C + T] of which the cache holds the first C columns: transformers feeds only the T
new columns, and since the cache is not empty the base model's pre-hook (generate.py) runs them as it runs
a decode step -- *pass-Q*:

* the layers run replicated on the T new tokens (every rank alike); each new column's K/V go to the rank
  holding the fewest tokens (the lowest on ties), the cache's balance rule since the prefill: every share
  stays within one of the mean, at most ceil(total / P) tokens;
* attention is Note [Decoding from a sharded cache] (core/decode.py): each rank attends the T queries to
  its share -- the cached turns and the new tokens it keeps -- causally *by global column* (Note [Masks by
  column] in hf/cache.py), so the new tokens see the cached ones and each other exactly, windows reach
  back into the cached turns, sinks join once; one all-gather of ``[out | lse]`` and the stable merge on every rank. No K/V moves: a follow-up
  after a long conversation sends (P - 1) * B * Hq * T * (Dv + 1) * 4 bytes per rank and layer, whatever C.
* a hybrid's linear layers continue their full recurrent and conv states with transformers' own chunked
  rule (the same on every rank).

``prefill_chunk_size=s`` is the same machinery: transformers splits the prompt into chunks of s columns;
the first goes into the empty cache by the ring prefill, every later chunk is a turn without decoding.
Each forward's activations are a chunk's, not the prompt's.

What is checked, on every rank before any communication (a rank that fails raises on every rank through
the call's agreement, Note [One agreement] in core/agreement.py): the cache is a :class:`ShardedCache`
this CP run filled (not a plain ``DynamicCache``, not one of another CP size, rank or layout, nor of
another model shape); the conversation extends what the cache holds -- the same batch, more columns, and
the first C columns' ids and mask equal to those the cache recorded (``ShardedCache.tokens``, a cheap
per-row fingerprint updated by every forward: an edited history is refused); and the cache's global facts
(C, each rank's share, the fingerprint) are part of the call's fingerprint, so ranks passing different
caches or conversations raise alike.

Note [Transactional turns]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A generate() call that continues a cache changes it only if it completes: :meth:`ShardedCache.begin_turn`
saves what a turn moves -- each rank's count, the columns seen, the fingerprints, each attention layer's
buffer references and fill (a turn writes only past the fill, or into new buffers when it grows) and a
linear layer's state tensors (the turn works on copies) -- and a call that raises puts it back
(:meth:`ShardedCache.restore`), so the same turn can be retried, as transformers' cache can be. What makes
a turn fail where it can be foreseen is refused before it starts, on every rank: a cache of another model
shape (layers, linear layers, attention heads, K/V heads, head dims) among the checks above.
A cache filled under ``torch.inference_mode()`` holds inference tensors, which cannot be written in place
outside it: a turn under ``no_grad`` then copies the buffers it appends to (as transformers' ``torch.cat``
copies) instead of writing into them.

*Pass-KV* -- the new tokens sharded in the layout, the K/V moving instead of the queries' results -- is what
a first turn's ring prefill does. For a forward of T > 1 new tokens on a non-empty cache, :func:`turn_plan`
says which of the two sends fewer bytes, from global facts only (the same on every rank), and the pre-hook
runs that one: Note [Pass-KV turns] in pass_kv.py. A decode step (T = 1) and a hybrid's turns are pass-Q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._extras import require

require("hf", "cp_dtensor.hf (transformers generate() under context parallelism)")

from ..core.agreement import Rules  # noqa: E402
from .cache import ShardedCache, token_fingerprint  # noqa: E402

__all__ = ["CallRules", "TurnPlan", "continuation_error", "cache_facts", "inner_padding_error", "kv_dims", "model_shape",
           "turn_plan"]


def _value(config, name: str):
    """``config.name``, None where it is missing; a tuple of the layers' values where the config keeps it per layer
    (Gemma 4 raises on the global read and keeps ``per_layer_config[i].name``)."""
    try:
        return getattr(config, name, None)
    except Exception:
        layers = getattr(config, "per_layer_config", None)
        if not layers:
            raise
        return tuple(getattr(layer, name, None) for layer in layers)


def kv_dims(config) -> tuple:
    """(Hq, Hkv, Dqk, Dv) of a text config's attention layers (each a tuple where the config varies it per layer)."""
    hq = _value(config, "num_attention_heads")
    hkv = _value(config, "num_key_value_heads") or hq
    d = _value(config, "head_dim") or config.hidden_size // hq
    return hq, hkv, d, _value(config, "v_head_dim") or d


def model_shape(config, linear) -> dict:
    """What a cache's K/V fit: the layers, the linear layers, the heads and head dims of a text config."""
    hq, hkv, d, dv = kv_dims(config)
    return {"layers": config.num_hidden_layers, "linear layers": list(linear), "attention heads": hq,
            "K/V heads": hkv, "head dim": d, "value head dim": dv}


def continuation_error(cache, *, maker: tuple[int, int, str], shape: dict, ids: Tensor,
                       mask: Tensor | None) -> str | None:
    """Why generate() cannot continue ``cache`` with the conversation ``ids`` [B, M] (``mask`` [B, M] or None) on
    this rank, or None. Local only; see Note [Continuing a sharded cache]."""
    fix = ("Pass the cache a CP generate() of this model returned (out.cache), or no cache to prefill the whole "
           "conversation.")
    if not isinstance(cache, ShardedCache):
        return (f"generate() under CP continues only the sequence-sharded cache a CP generate() returned; got a "
                f"{type(cache).__name__}, which holds whole sequences, not this rank's share. {fix}")
    if cache.held is None or cache.tokens is None:
        return f"generate() under CP was passed an empty ShardedCache (no generate() filled it). {fix}"
    cp, rank, layout = maker
    if cache.maker != maker:
        got = "unknown" if cache.maker is None else f"P={cache.maker[0]}, rank {cache.maker[1]}, layout " \
                                                    f"{cache.maker[2]!r}"
        return (f"generate() under CP was passed a cache filled by another CP run ({got}); this call runs P={cp}, "
                f"rank {rank}, layout {layout!r}. A cache holds its own rank's share in its layout only. {fix}")
    if cache.shape != shape:
        differ = [k for k in shape if (cache.shape or {}).get(k) != shape[k]]
        got = ", ".join(f"{k} {(cache.shape or {}).get(k)}" for k in differ)
        want = ", ".join(f"{k} {shape[k]}" for k in differ)
        return (f"generate() under CP was passed a cache made for another model shape ({got}; this model: {want}): "
                f"its K/V do not fit this model's attention. A cache continues the model that filled it. {fix}")
    b, m = ids.shape
    c = cache.seen
    if cache.tokens.shape[0] != b:
        return (f"generate() under CP was passed a cache of batch {cache.tokens.shape[0]}, but input_ids has {b} rows. "
                f"{fix}")
    whole = ("Pass the whole conversation so far (out.sequences of the call that returned the cache) with the "
             "follow-up appended, and its attention_mask, as transformers takes them.")
    real = torch.ones(b, c, dtype=torch.long, device=ids.device) if mask is None else mask[:, :c]
    if m > c and torch.equal(token_fingerprint(ids[:, :c], real).cpu(), cache.tokens.cpu()):
        return None
    ones = torch.ones(b, c, dtype=torch.long, device=ids.device)
    if m > c and torch.equal(token_fingerprint(ids[:, :c], ones).cpu(), cache.plain.cpu()):
        return (f"generate() under CP: the first {c} columns of input_ids are the tokens the cache holds, but the "
                "attention_mask over them differs from the one they were cached with (other padding: an edited history). The columns a generate() call "
                "produced keep mask 1 -- pads after a row's EOS too: the cache holds them as tokens -- so extend the "
                "mask you passed with ones for the generated columns (torch.cat([mask, torch.ones(B, new)], 1)) "
                "rather than deriving it from the pad token.")
    for seen, tokens in reversed(cache.checkpoints):  # an earlier turn's end: a second follow-up from one cache
        mark = torch.ones(b, seen, dtype=torch.long, device=ids.device) if mask is None else mask[:, :seen]
        if seen < min(c, m) and torch.equal(token_fingerprint(ids[:, :seen], mark).cpu(), tokens.cpu()):
            return (f"generate() under CP: input_ids continue the conversation the cache held after {seen} columns, but "
                    f"the cache now holds {c}: a later call continued it, and a cache is updated in place (as "
                    "transformers' DynamicCache is). To branch a conversation, copy the cache before each follow-up "
                    "(cache=copy.deepcopy(out.cache)), or pass the conversation the cache holds now.")
    if m <= c:
        alone = " (the follow-up alone?)" if m < c else ""
        return (f"generate() under CP continues a cache of {c} tokens a row from the whole conversation: input_ids must "
                f"hold those {c} columns and at least one new one; got {m}{alone}. {whole}")
    return (f"generate() under CP: the first {c} columns of input_ids / attention_mask are not the tokens the cache "
            f"holds (an edited history, other padding, or another conversation). {whole} Or pass no cache.")


def inner_padding_error(real: Tensor, chunk: int | None) -> str | None:
    """Why the ring prefill cannot run the first chunk of a prompt whose mask ``real`` [B, N] has padding inside a
    row (a pad column after a real one), or None. The later chunks and turns serve it: Note [Masks by column] in
    hf/cache.py."""
    first = real[:, :chunk] if chunk else real
    inner = first & ~torch.nn.functional.pad(first[:, 1:], (0, 1), value=True)  # a real column, then a pad
    if not bool(inner.any()):
        return None
    row, col = (int(x) for x in torch.nonzero(inner)[0])
    after = int(torch.nonzero(inner.any(0))[0]) + 1  # the first pad column after a real one, in any row
    return (f"generate() under CP: attention_mask row {row} has padding inside the prompt (a pad at column {col + 1} "
            f"after a token){'' if chunk is None else f' within its first chunk of {chunk} columns'}; the ring prefill "
            "of a prompt's first chunk runs left padding only. Pad the prompt on the left; or let the first chunk end "
            f"before the inner padding (prefill_chunk_size <= {after}), or send the part after it as a follow-up turn "
            "(generate(..., cache=out.cache)): later chunks and turns mask padding anywhere, as transformers does.")


def _cache_words(facts: tuple) -> str:
    return "no cache" if not facts else f"a ShardedCache of {facts[0]} columns (shares {list(facts[1])})"


class CallRules(Rules):
    """generate()'s call agreement (hf/generate.py), naming the caches when they differ between ranks."""

    def raise_differ(self, rows) -> None:
        at = self.fields.index("cache")
        if any(row[at] != rows[0][at] for row in rows):
            table = "; ".join(f"rank {r}: {_cache_words(row[at])}" for r, row in enumerate(rows))
            raise ValueError(
                f"generate() under CP needs every rank of the CP group to continue the same conversation's cache -- "
                f"each rank its own share, out.cache of the same generate() call -- but the ranks passed different "
                f"caches ({table}). Pass each rank the cache its own rank's call returned, or no cache on every rank.")
        super().raise_differ(rows)


def cache_facts(cache) -> tuple:
    """What every rank's cache must agree on (its global facts): columns held, each rank's share, the
    fingerprint of the tokens."""
    if not isinstance(cache, ShardedCache) or cache.tokens is None:
        return ()
    return cache.seen, tuple(cache.held), tuple(cache.tokens.cpu().tolist())


@dataclass(frozen=True)
class TurnPlan:
    """Bytes one rank sends per attention layer for a turn of ``new`` tokens after ``cached`` ones, both ways."""

    pass_q: int  #: pass-Q: the [out | lse] all-gather of the replicated queries' partial results
    pass_kv: int  #: pass-KV: the all-gather of every rank's K/V (its cache share and its shard of the new)
    mode: str  #: "pass-q" or "pass-kv": which sends fewer bytes (the ring prefill when nothing is cached)


def turn_plan(*, new: int, cached: int, cp: int, batch: int, q_heads: int, kv_heads: int, head_dim: int,
              value_dim: int | None = None, kv_bytes: int = 2, largest_share: int | None = None,
              unit: int = 1, kv_width: int | None = None) -> TurnPlan:
    """The bytes rule of Note [Continuing a sharded cache] (docs/inference.md, "Multi-turn"): what one rank
    sends per attention layer for ``new`` = T tokens after ``cached`` = C, as the code sends it,

    * pass-Q: (P - 1) * B * Hq * T * (Dv + 1) * 4 -- independent of C;
    * pass-KV: (P - 1) * B * (S_max + T_local) * Hkv * (Dqk + Dv) * kv_bytes, S_max the largest rank's share
      of the C cached tokens (``largest_share``; ceil(C / P) by default: the shares are balanced) and
      T_local = T padded to the layout ``unit``, over P -- about (P - 1) / P of all C + T tokens' K/V.

    With Dqk = Dv = D, pass-KV sends fewer bytes when T / (C + T) > kv_bytes * Hkv / (2 * P * Hq) (about):
    a first turn (C = 0; the ring prefill), a long document added to a short conversation; a follow-up of a
    few hundred tokens after a long conversation is pass-Q and never sends the cached K/V. ``kv_width``: the
    numbers a cached token holds when not Hkv * (Dqk + Dv) (MLA's latent row, R + r)."""
    dv = head_dim if value_dim is None else value_dim
    pq = (cp - 1) * batch * q_heads * new * (dv + 1) * 4
    share = -(-cached // cp) if largest_share is None else largest_share
    local = -(-new // unit) * unit // cp
    width = kv_heads * (head_dim + dv) if kv_width is None else kv_width
    pkv = (cp - 1) * batch * (share + local) * width * kv_bytes
    return TurnPlan(pq, pkv, "pass-kv" if cached == 0 or pkv < pq else "pass-q")
