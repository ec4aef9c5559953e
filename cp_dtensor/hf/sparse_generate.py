"""generate() of DeepSeek Sparse Attention models (``deepseek_v32``, ``glm_moe_dsa``) under CP, from the sharded cache.

Note [DSA generate() under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
generate() runs as for every model (Note [generate() under CP] in hf/generate.py): a prefill on each rank's
layout shard of the prompt (padded on the left to the layout's unit), then decode steps whose query is
the same on every rank, each new token's latent row kept by one rank. The ``ShardedCache`` holds each
rank's MLA latent rows (``kv_lora_rank`` normed latent as the "keys", the rotated ``qk_rope_head_dim`` key
as the "values"), and this module keeps each layer's index keys beside them, slot for slot.

* prefill: the training forward of Note [DeepSeek Sparse Attention under CP] (hf/sparse.py) -- each index
  key sent to the ranks with a query that sees it (causal, not the prompt's padding) -- with the layout's
  pad columns cut from the rows, so each query's indexer row is CP=1's row over the N prompt columns; the
  kept columns' latents and index keys go to the cache.
* decode steps, later turns (``cache=`` from an earlier call) and prefill chunks after the first: the T
  new tokens run replicated (pass-Q, Note [Continuing a sharded cache] in hf/turns.py: the prefill marks
  the cache as holding latents, not what is attended, so no forward runs the plain pass-KV; a long turn
  or chunk runs sharded where that sends fewer bytes, Note [Sharded DSA turns] in hf/sparse_turn.py), each new column kept
  by one rank (the balance rule) with its latent and index key. CP=1's index rows of the T new queries
  -- C + T columns long, as transformers scores a cached forward -- are rebuilt in one of two ways, by
  the bytes a cached slot costs (``gathers_keys``, global facts only):

  - few tokens (4 * T <= an index key's bytes; a decode step): each rank scores the new index queries
    against the index keys it holds (the family's arithmetic, fp32), masked causally by global column,
    and one all-gather of those scores (4 * T bytes a slot of the rank holding most) places them in the
    rows by the slots' columns, the padding columns -inf;
  - a long turn or chunk: one all-gather of every rank's held index keys (``index_head_dim`` numbers a
    slot) lays the keys out by column, and the family's indexer scores the new queries on the full rows
    with transformers' mask (causal by column, the pads masked);

  either way the slots' positions and columns are gathered once a forward, for every layer ((B + 1) * 8
  bytes a slot);

  ``topk`` on the rows then picks CP=1's columns, ties included (a chunk's rows are shorter than the
  whole prompt's: a chunked prefill picks what CP=1's chunked prefill picks). Each rank expands the held
  slots some new query picked (at most T * ``index_topk``), attends each query to its own picks among
  them (``select`` of core/decode.py's ``attend``), and the partials merge by their log-sum-exp in the
  one all-gather of [out | lse] ((P - 1) * B * H * T * (Dv + 1) * 4 bytes a rank receives, as every
  pass-Q turn).

A turn that fails puts the index keys back with the latents (Note [Transactional turns]). Served: greedy
and sampled decoding, left-padded prompts and padding inside a conversation (the pads masked in every
row, as at CP=1), several turns, ``prefill_chunk_size``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from .._compat import all_gather_single
from ..core.decode import attend
from ..core.plan.layout import global_order
from .documents import ring_layout
from .sparse import _SEE, _Gathered, attend_selected, project, real_mask, seen_keys
from .sparse_rows import index_tiles
from .sparse_turn import STORE as _STORE
from .sparse_turn import gathers_keys, sharded_forward

__all__ = ["gathers_keys", "generating_forward", "sparse_generate"]

_STEPS = ("generate() of a DeepSeek Sparse Attention model under CP runs the sharded cache's prefill and pass-Q "
          "forwards (decode steps, later turns, prefill chunks). " + _SEE)


def sparse_generate(model: nn.Module, *args, **kwargs):
    """``model.generate`` of a DSA model under CP: hf/generate.py's generate(), the index keys of a continued
    cache put back as they were when the call fails (Note [Transactional turns] in hf/turns.py)."""
    from .generate import generate

    given = kwargs.get("cache", kwargs.get("past_key_values"))
    store = vars(given).get(_STORE) if hasattr(given, "__dict__") else None
    saved = None if store is None else dict(store)  # a turn replaces the tensors, never writes into them
    try:
        return generate(model, *args, **kwargs)
    except BaseException:
        if saved is not None:
            store.clear()
            store.update(saved)
        raise


class _Prefill(_Gathered):
    """The indexer's ``cache`` in a prefill: keeps this rank's kept index keys, hands back the keys of the
    prompt's columns (the layout's pad columns cut), each sent only to the ranks with a query that sees it."""

    def __init__(self, group, order: Tensor, rank: int, seen: Tensor, pad: int, store: dict, keep: Tensor):
        super().__init__(group, order, rank, seen)
        self.pad, self.store, self.keep = pad, store, keep

    def update_indexer(self, k: Tensor, layer_idx: int) -> Tensor:  # k: [B, S_local, D]
        self.store[layer_idx] = k.index_select(1, self.keep.to(k.device))
        return super().update_indexer(k, layer_idx)[:, self.pad:]


def generating_forward(module: nn.Module, state, hidden_states: Tensor, position_embeddings, attention_mask, cache,
                       position_ids, prev_topk_indices):
    """A DSA layer's forward inside generate() under CP (Note [DSA generate() under CP])."""
    call = state.generating
    step = call.step
    if step is None or step.kind not in ("prefill", "decode", "pass-kv") or cache is not call.cache:
        raise ValueError(_STEPS)
    store = cache.__dict__.setdefault(_STORE, {})
    if step.kind == "pass-kv":  # a long turn, sharded: Note [Sharded DSA turns] in hf/sparse_turn.py
        picks, out = sharded_forward(module, state, hidden_states, position_embeddings, position_ids,
                                     prev_topk_indices, store)
    elif step.kind == "prefill":
        picks, out = _prefill(module, state, hidden_states, position_embeddings, attention_mask, position_ids,
                              prev_topk_indices, store)
    else:
        picks, out = _decode(module, state, hidden_states, position_embeddings, position_ids, prev_topk_indices, store)
    return (out, None, picks) if hasattr(module, "skip_topk") else (out, None)


def _prefill(module, state, h, position_embeddings, attention_mask, position_ids, prev, store):
    call, group = state.generating, state.mesh.get_group()
    rank, world = state.mesh.get_local_rank(), state.mesh.size()
    n, pad = call.prompt
    bsz, s = h.shape[:2]
    dev = h.device
    order = global_order(ring_layout(state), world, s * world).to(dev)
    real = order[rank * s:(rank + 1) * s] - pad  # the prompt columns of this rank's tokens (< 0: the layout's pads)
    if "prompt" not in store:  # the prompt's padding mask [B, n] in column order: one gather, for every layer
        store["prompt"] = real_mask(group, world, attention_mask, order, bsz, s, dev)[:, pad:]
    keys = torch.arange(n, device=dev)[None, None, :]
    allowed = (keys <= real[None, :, None]) & store["prompt"][:, None, :]  # causal, the prompt's pads masked (CP=1's)
    blind = ~allowed.any(-1, keepdim=True)  # a pad query (the layout's or the prompt's) that sees nothing: its own
    allowed = allowed | (blind & (keys == real.clamp(min=0)[None, :, None]))  # column, for a finite, unread output
    scored = allowed
    if state.attn_implementation.get("") == "eager":
        scored = torch.zeros(allowed.shape, dtype=h.dtype, device=dev).masked_fill(~allowed, torch.finfo(h.dtype).min)
    q_resid, query, k_pass, k_rot = project(module, h, position_embeddings)
    call.cache.update(k_pass, k_rot, module.layer_idx)  # the kept columns' latents (the pads' dropped)
    call.cache.attends_cached = False  # the cache holds latents, not what is attended: later turns run pass-Q
    if module.indexer is not None:  # the keys a query of each rank sees: real prompt columns, causally (a blind
        # pad query's own column is its own token's, or a pad query's output no one reads)
        real_full = torch.nn.functional.pad(store["prompt"], (pad, 0), value=False)  # [B, pad + n], global columns
        seen = seen_keys(order, world, bsz, ("real", real_full))
        picks = index_tiles(module.indexer, h, q_resid, position_embeddings, scored, position_ids,
                            _Prefill(group, order, rank, seen, pad, store, call.step.keep))  # [B, S, K]
    else:
        picks = prev
    valid = allowed.gather(-1, picks.long())
    return picks, attend_selected(module, state, query, k_pass, k_rot, picks.long() + pad, valid, order)


def _index_query_key(module, h: Tensor, q_resid: Tensor, position_embeddings) -> tuple[Tensor, Tensor]:
    """The indexer's query [B, T, Hi, D] and key [B, T, D] of the new tokens: the family's arithmetic
    (transformers' ``...Indexer.forward`` up to its cache)."""
    ind, modeling = module.indexer, sys.modules[type(module).__module__]
    b, t, _ = h.shape
    cos, sin = position_embeddings
    q = ind.wq_b(q_resid).view(b, t, ind.n_heads, ind.head_dim)
    q_rot, q_pass = torch.split(q, [ind.qk_rope_head_dim, ind.head_dim - ind.qk_rope_head_dim], dim=-1)
    k = ind.k_norm(ind.wk(h)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ind.qk_rope_head_dim, ind.head_dim - ind.qk_rope_head_dim], dim=-1)
    rope = (modeling.apply_rotary_pos_emb_interleave if module.config.model_type == "glm_moe_dsa"
            else modeling.apply_rotary_pos_emb)  # GLM's indexer rotates interleaved pairs, DeepSeek-V3.2's halves
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)


def _decode(module, state, h, position_embeddings, position_ids, prev, store):
    call, group = state.generating, state.mesh.get_group()
    world, step = state.mesh.size(), state.generating.step
    bsz, t = h.shape[:2]
    q_resid, query, k_pass, k_rot = project(module, h, position_embeddings)
    held_pass, held_rot = call.cache.update(k_pass, k_rot, module.layer_idx)  # this rank's share [B, 1, S_r, .]
    layer = call.cache.layers[module.layer_idx]
    slots, columns = layer.positions, layer.columns  # [B, S_r] global columns; the sequence's length
    if module.indexer is not None:
        if module.layer_idx not in store:  # the same on every rank: the cache's global facts are agreed
            raise ValueError(f"generate() of {type(module).__name__} under CP was passed a ShardedCache without its "
                             "index keys (filled by another model's generate()); pass the cache this model's "
                             "generate() returned, or none.")
        ind = module.indexer
        iq, ik = _index_query_key(module, h, q_resid, position_embeddings)
        held = torch.cat([store[module.layer_idx], ik.index_select(1, step.keep.to(ik.device))], dim=1)
        store[module.layer_idx] = held  # [B, S_r, D], slot for slot with the latents
        if gathers_keys(t, ind.head_dim, held.element_size()):  # a long turn or chunk: the keys are fewer bytes
            store["gathered"] = store.get("gathered", 0) + 1
            picks = _picks_from_keys(module, state, h, q_resid, position_embeddings, position_ids, held, layer)
        else:
            scores = F.relu(torch.matmul(iq.float(), held.transpose(-1, -2).float().unsqueeze(1)) * ind.softmax_scale)
            weights = ind.weights_proj(h.to(ind.weights_proj.weight.dtype)).float() * (ind.n_heads ** -0.5)
            mine = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, T, S_r]
            mine = mine.masked_fill(slots[:, None, :] > step.q_positions[:, :, None], float("-inf"))
            row = _global_row(state, mine, layer)  # [B, T, columns]: CP=1's
            picks = row.topk(min(ind.index_topk, columns), dim=-1).indices
    else:
        picks = prev
    chosen = torch.zeros(bsz, t, columns + 1, dtype=torch.bool, device=h.device).scatter_(-1, picks.long(), True)
    seen = chosen.gather(2, slots.clamp(min=0)[:, None, :].expand(-1, t, -1)) & (slots >= 0)[:, None, :]  # [B, T, S_r]
    union = seen.any(1)  # [B, S_r]: the held slots some new query picked
    m = max(int(union.sum(1).max()), 1)  # at most T * index_topk: only those are expanded, not the whole share
    take = torch.sort(union.long(), dim=1, descending=True, stable=True).indices[:, :m]  # [B, m] picked first
    kpos = slots.gather(1, take).masked_fill(~union.gather(1, take), -1)  # -1: an empty slot
    pick = lambda x: x.gather(2, take[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))  # noqa: E731
    keys, values = module.expand_kv(pick(held_pass), pick(held_rot))  # [B, H, m, D]
    out = attend(query, keys, values, q_positions=step.q_positions, k_positions=kpos, group=group, world=world,
                 scale=module.scaling, window_size=None, sinks=None, padding=step.q_padding,
                 select=seen.gather(2, take[:, None, :].expand(-1, t, -1)))  # [B, H, T, Dv]: each query its own
    # picks among the slots of every rank, merged
    return picks, module.o_proj(out.transpose(1, 2).reshape(bsz, t, -1))


class _Row:
    """The indexer's ``cache`` in a long pass-Q forward: hands back the gathered keys of every column."""

    def __init__(self, keys: Tensor):
        self.keys = keys

    def update_indexer(self, k: Tensor, layer_idx: int) -> Tensor:  # the new columns' keys are among them
        return self.keys


def _picks_from_keys(module, state, h, q_resid, position_embeddings, position_ids, held: Tensor, layer) -> Tensor:
    """CP=1's top-k columns [B, T, K] of the T new (replicated) queries: every rank's held index keys ``held``
    [B, S_r, D] (the new ones it keeps included) gathered and laid out by column, [B, C + T, D], the columns' padding
    mask by one gather of the slots' positions and columns a forward, and the family's indexer on the full rows
    with transformers' mask (causal by column, the pads masked)."""
    call, group, world = state.generating, state.mesh.get_group(), state.mesh.size()
    bsz, columns, most, dev = h.shape[0], layer.columns, max(call.cache.held), h.device
    cols, filled, real = _columns(state, layer, bsz, dev)
    buf = held.new_zeros(bsz, most, held.shape[2])
    buf[:, :held.shape[1]] = held
    every = funcol.wait_tensor(all_gather_single(buf, 0, group)).view(world, bsz, most, -1)
    keys = held.new_zeros(bsz, columns, held.shape[2])
    keys[:, cols] = every.permute(1, 0, 2, 3).reshape(bsz, world * most, -1)[:, filled]  # [B, C + T, D] by column
    allowed = (torch.arange(columns, device=dev)[None, None, :] <= call.step.q_positions[:, :, None]) & real[:, None, :]
    scored = allowed
    if state.attn_implementation.get("") == "eager":
        scored = torch.zeros(allowed.shape, dtype=h.dtype, device=dev).masked_fill(~allowed, torch.finfo(h.dtype).min)
    return index_tiles(module.indexer, h, q_resid, position_embeddings, scored, position_ids, _Row(keys))


def _columns(state, layer, bsz: int, dev) -> tuple[Tensor, Tensor, Tensor]:
    """Where every rank's slots lie, once a forward (the layers hold the same slots): one all-gather of [B + 1,
    most] int64 -- the slots' positions (-1 padding) and their columns. Returns (the columns of the gathered
    slots that exist, their indices in the rank-major gathered axis, the columns' padding mask [B, C + T])."""
    call, group, world = state.generating, state.mesh.get_group(), state.mesh.size()
    step, most = call.step, max(call.cache.held)
    if getattr(step, "dsa_columns", None) is None:
        ids = torch.full((bsz + 1, most), -1, dtype=torch.long, device=dev)
        ids[:bsz, :layer.held] = layer.positions
        ids[bsz, :layer.held] = layer._pos.cols[:layer.held].to(dev)
        every = funcol.wait_tensor(all_gather_single(ids, 0, group)).view(world, bsz + 1, most)
        cols = every[:, bsz].reshape(-1)  # [P * most]: the column of each gathered slot, -1 none
        filled = torch.nonzero(cols >= 0).flatten()
        real = torch.zeros(bsz, layer.columns, dtype=torch.bool, device=dev)
        real[:, cols[filled]] = every[:, :bsz].permute(1, 0, 2).reshape(bsz, -1)[:, filled] >= 0
        step.dsa_columns = (cols[filled], filled, real)
    return step.dsa_columns


def _global_row(state, mine: Tensor, layer) -> Tensor:
    """CP=1's index-score rows [B, T, C + T] from each rank's fp32 scores ``mine`` [B, T, S_r] of its slots: one
    all-gather of [B, T, max S_r] (exact), placed by the slots' columns (:func:`_columns`), the pads -inf."""
    group, world, most = state.mesh.get_group(), state.mesh.size(), max(state.generating.cache.held)
    bsz, t, s_r = mine.shape
    cols, filled, real = _columns(state, layer, bsz, mine.device)
    buf = torch.full((bsz, t, most), float("-inf"), dtype=torch.float32, device=mine.device)
    buf[:, :, :s_r] = mine
    every = funcol.wait_tensor(all_gather_single(buf, 0, group)).view(world, bsz, t, most)
    row = torch.full((bsz, t, layer.columns), float("-inf"), dtype=torch.float32, device=mine.device)
    row[:, :, cols] = every.permute(1, 2, 0, 3).reshape(bsz, t, -1)[:, :, filled]
    return row.masked_fill(~real[:, None, :], float("-inf"))
