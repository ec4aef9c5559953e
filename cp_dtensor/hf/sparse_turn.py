"""A long turn (or prefill chunk) of a DeepSeek Sparse Attention model on the sharded cache, with the new tokens
sharded over the ranks and only the selected latent rows moving: Note [Sharded DSA turns].

Note [Sharded DSA turns]
~~~~~~~~~~~~~~~~~~~~~~~~
A DSA forward of T new tokens after C cached ones runs pass-Q by default (Note [DSA generate() under
CP] in hf/sparse_generate.py): the T tokens replicated on every rank, one all-gather of every query's
partial [out | lse] -- (P - 1) * B * H * T * (Dv + 1) * 4 bytes a rank and layer, 66 KB a new token a
rank for DeepSeek-V3.2 (H = 128). For a long turn the latent rows the picks need are far fewer bytes
(1152 a row in bf16), and the prefill's training forward (Note [DeepSeek Sparse Attention under CP] in
hf/sparse.py) already moves only those. A sharded turn does the same on the cache:

* the base model's pre-hook pads the T new columns on the left to the layout unit (pad columns: no
  global column, never a key, their queries see nothing) and gives each rank its layout shard, as a
  prefill does (:func:`sharded_step`); the layers run on T / P tokens a rank;
* once a forward, one all-gather of every rank's cached slots (their positions and columns, (B + 1) * 8
  bytes a slot) lays out the global key axis: rank r holds its cached share (padded to the largest,
  S_max) then its shard of the new columns, a rank-major order of C + T real columns and unused
  dummies (:func:`_layout`) -- the ``order`` hf/sparse.py's exchange reads;
* the indexer, exactly as at CP=1: each rank needs every cached index key (every new query sees the
  whole cache but its padding): one all-gather of the held keys (``index_head_dim`` numbers a slot); and
  the new tokens' keys only where one of its queries sees them (``seen_keys``' all_to_all of the
  training forward). Laid out by column [B, C + T, D] (zeros where no query of the rank looks), the
  family's indexer scores the rank's queries on rows of CP=1's length with CP=1's mask (causal by
  column, the pads masked), so ``topk`` picks CP=1's columns, ties included;
* the selected latent rows a rank does not hold -- cached or new -- are requested and sent (counts, row
  numbers, rows: hf/sparse.py's ``attend_selected``), and each query attends to its picks; only the
  held rows some pick reads are expanded by ``kv_b_proj``;
* the new tokens are kept where they were computed -- each rank its shard's real columns, as the
  prefill keeps its shard -- their latents and index keys appended to the rank's cache share, so later
  turns and decode steps run unchanged (the balance rule of decoding evens out the shares again);
* a hook after the base model gathers the hidden rows the LM head reads, as after a prefill.

The rule (:func:`dsa_turn_plan`, global facts only, the same on every rank): pass-Q's bytes as sent --
[out | lse] plus its index scores or keys (``gathers_keys``) -- against the most a sharded turn can send:
the cached and new index keys, the rows not held -- at most ``min(T_local * index_topk, C + T - the
smallest share)`` a row of the batch, (``kv_lora_rank`` + ``qk_rope_head_dim``) numbers each -- and the
8-byte row numbers the other ranks ask of it (at most ``min(T_local * index_topk, S_max + T_local)`` from
each). The bound holds whatever the indexer picks, so a sharded turn never sends more
than pass-Q would; a trained indexer's picks cluster and send fewer rows than the bound. Decode steps
(T = 1) stay pass-Q. A failed turn restores the cache and the index keys (Note [Transactional turns]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from .._compat import all_gather_single
from ..core.plan.layout import global_order, layout_unit, shard_tensor
from .cache import ShardedCache, _Step
from .documents import ring_layout
from .sparse import _Gathered, attend_selected, project, seen_keys
from .sparse_rows import index_tiles

__all__ = ["DsaTurnPlan", "dsa_turn_plan", "gathers_keys", "sharded_forward", "sharded_step", "sharded_turn"]

STORE = "_cp_dtensor_index_keys"  # the index keys' attribute on the ShardedCache, slot for slot with the latents


def gathers_keys(t: int, head_dim: int, esize: int) -> bool:
    """Whether a pass-Q forward of ``t`` new tokens gathers every rank's index keys (``esize * head_dim`` bytes a
    cached slot) rather than its fp32 index scores (``4 * t``): Note [DSA generate() under CP] in
    hf/sparse_generate.py. Global facts only."""
    return 4 * t > esize * head_dim


@dataclass(frozen=True)
class DsaTurnPlan:
    """Bytes one rank receives per DSA layer for a turn of ``new`` tokens after ``cached`` ones."""

    pass_q: int  #: pass-Q: [out | lse] of the replicated queries, and the index scores or keys
    sharded: int  #: a sharded turn, at most: the cached and new index keys, the rows not held and their numbers
    mode: str  #: "pass-q" or "sharded"


def dsa_turn_plan(*, new: int, cached: int, cp: int, batch: int, heads: int, value_dim: int, latent_dim: int,
                  index_dim: int, index_topk: int, esize: int = 2, shares: list[int] | None = None,
                  unit: int = 1) -> DsaTurnPlan:
    """The rule of Note [Sharded DSA turns]: bytes a rank receives per layer for ``new`` = T tokens after ``cached``
    = C, pass-Q as it sends them and a sharded turn at most; ``latent_dim``: kv_lora_rank + qk_rope_head_dim;
    ``shares``: each rank's cached tokens (balanced by default); ``unit``: the layout's."""
    shares = shares or [cached // cp + (r < cached % cp) for r in range(cp)]
    s_max, local = max(shares), -(-new // unit) * unit // cp
    after = s_max + -(-new // cp)  # the largest share once the new tokens are kept (pass-Q's balance rule)
    index = index_dim * esize if gathers_keys(new, index_dim, esize) else 4 * new  # pass-Q, a slot
    pq = (cp - 1) * batch * (heads * new * (value_dim + 1) * 4 + after * index)
    rows = min(local * index_topk, cached + new - min(shares))  # the rows a rank asks for, a row of the batch
    asked = (cp - 1) * min(local * index_topk, s_max + local)  # the row numbers the others ask of it
    sh = (cp - 1) * batch * (s_max + local) * index_dim * esize + batch * (rows * latent_dim * esize + asked * 8) \
        + 8 * cp
    return DsaTurnPlan(pq, sh, "sharded" if cp > 1 and new > 1 and sh < pq else "pass-q")


def sharded_turn(state, module: nn.Module, cache: ShardedCache, batch: int, new: int) -> bool:
    """Whether a forward of ``new`` columns on the non-empty DSA ``cache`` runs as a sharded turn (global facts)."""
    if STORE not in vars(cache) or cache.held is None:
        return False
    cfg = module.config.get_text_config(decoder=True)
    cp = state.mesh.size()
    plan = dsa_turn_plan(new=new, cached=cache.seen, cp=cp, batch=batch, heads=cfg.num_attention_heads,
                         value_dim=cfg.v_head_dim, latent_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                         index_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
                         esize=torch.empty((), dtype=module.dtype).element_size(), shares=list(cache.held),
                         unit=layout_unit(ring_layout(state), cp))
    return plan.mode == "sharded"


class _Turn:
    """What a sharded turn's layers share: the new columns' layout, their padding mask, the cached shares."""

    def __init__(self, pad: int, real: Tensor, shares: list[int]):
        self.pad, self.real, self.shares = pad, real, shares  # real: [B, T] the new columns that are not padding
        self.layout: tuple | None = None  # (order [N'], real [B, C + T], S_max): once a forward (_layout)


def sharded_step(state, call, cache: ShardedCache, ids: Tensor, pos: Tensor, col: Tensor, real: Tensor,
                 kwargs: dict) -> None:
    """The pre-hook's part for a sharded turn: shard the new columns in the layout, each rank keeping its shard's
    real columns. ``pos`` [B, n]: the position ids; ``col`` [B, n]: the global columns (Note [Masks by column])."""
    b, n = ids.shape
    layout, cp, rank = ring_layout(state), state.mesh.size(), state.mesh.get_local_rank()
    pad = -n % layout_unit(layout, cp)
    padded = lambda x, v: torch.nn.functional.pad(x, (pad, 0), value=v)  # noqa: E731
    shard = lambda x: shard_tensor(x, seq_dim=1, layout=layout, rank=rank, cp_size=cp).contiguous()  # noqa: E731
    every = global_order(layout, cp, n + pad).view(cp, -1)  # [P, T_local]: each rank's padded new columns
    keep = torch.nonzero(every[rank] >= pad).flatten()  # the local columns this rank keeps: its shard's real ones
    shares = list(cache.held)
    cache.held = [h + int((every[r] >= pad).sum()) for r, h in enumerate(cache.held)]
    kpos = shard(padded(col.masked_fill(~real, -1), -1)).index_select(1, keep.to(ids.device))
    call.step = _Step("pass-kv", kpos, keep, n, q_positions=shard(padded(col, -1)),
                      q_padding=~shard(padded(real, False)), slots=every[rank][keep] - pad + cache.seen)
    call.step.dsa = _Turn(pad, real, shares)
    call.prompt = (n, pad)  # the hook after the base model gathers the rows the LM head reads
    cache.note_tokens(ids, real)
    kwargs["input_ids"], kwargs["position_ids"] = shard(padded(ids, 0)), shard(padded(pos, 0))


def _layout(state, layer, turn: _Turn, bsz: int, dev) -> tuple[Tensor, Tensor, int]:
    """(order [N'] -- the global column at each rank-major slot of [cached share padded to S_max | new shard], the
    pad slots numbered C + T.. --, real [B, C + T] -- the columns that are not padding --, S_max), from one
    all-gather of every rank's cached positions and columns, once a forward."""
    if turn.layout is None:
        group, cp = state.mesh.get_group(), state.mesh.size()
        s_max, held = max(turn.shares), layer.held
        ids = torch.full((bsz + 1, s_max), -1, dtype=torch.long, device=dev)
        ids[:bsz, :held] = layer.positions
        ids[bsz, :held] = layer._pos.cols[:held].to(dev)
        every = funcol.wait_tensor(all_gather_single(ids, 0, group)).view(cp, bsz + 1, s_max)
        c, t = layer.columns - turn.real.shape[1], turn.real.shape[1]  # the cache's update counted the new ones
        new = global_order(ring_layout(state), cp, t + turn.pad).view(cp, -1).to(dev) - turn.pad + c  # [P, T_local]
        cols = torch.cat([every[:, bsz], new.masked_fill(new < c, -1)], 1).reshape(-1)  # [N'], -1: a pad slot
        spare = cols < 0
        order = cols.masked_scatter(spare, c + t + torch.arange(int(spare.sum()), device=dev))
        real = torch.zeros(bsz, c + t, dtype=torch.bool, device=dev)
        cached = every[:, :bsz].permute(1, 0, 2).reshape(bsz, -1)  # [B, P * S_max] positions, -1 padding
        filled = every[:, bsz].reshape(-1) >= 0
        real[:, every[:, bsz].reshape(-1)[filled]] = cached[:, filled] >= 0
        real[:, c:] = turn.real.to(dev)
        turn.layout = (order, real, s_max)
    return turn.layout


class _Keys:
    """The indexer's ``cache`` in a sharded turn: keeps this rank's new index keys, hands back [B, C + T, D] --
    every cached key (one all-gather) and the new keys a query of this rank sees (``seen_keys``' all_to_all)."""

    def __init__(self, state, held: Tensor, turn: _Turn, order: Tensor, real: Tensor, s_max: int):
        self.state, self.held, self.turn, self.order, self.real, self.s_max = state, held, turn, order, real, s_max
        self.new: Tensor | None = None

    def update_indexer(self, k: Tensor, layer_idx: int) -> Tensor:  # k: [B, T_local, D], this rank's new keys
        self.new = k
        state, turn = self.state, self.turn
        group, cp, rank = state.mesh.get_group(), state.mesh.size(), state.mesh.get_local_rank()
        b, t_local, d = k.shape
        buf = k.new_zeros(b, self.s_max, d)
        buf[:, :self.held.shape[1]] = self.held
        every = funcol.wait_tensor(all_gather_single(buf, 0, group)).view(cp, b, self.s_max, d)
        c, t = self.real.shape[1] - turn.real.shape[1], turn.real.shape[1]
        keys = k.new_zeros(b, c + t, d)
        slots = self.order.view(cp, -1)[:, :self.s_max].reshape(-1)  # [P * S_max] cached slots' columns (or spare)
        cached = slots < c
        keys[:, slots[cached]] = every.permute(1, 0, 2, 3).reshape(b, -1, d)[:, cached]
        new_order = global_order(ring_layout(state), cp, t + turn.pad).to(k.device)  # the new columns' own order
        real_new = torch.nn.functional.pad(turn.real.to(k.device), (turn.pad, 0), value=False)  # [B, pad + T]
        seen = seen_keys(new_order, cp, b, ("real", real_new))  # which new keys a query of each rank sees
        keys[:, c:] = _Gathered(group, new_order, rank, seen).update_indexer(k, layer_idx)[:, turn.pad:]
        return keys


def sharded_forward(module: nn.Module, state, h: Tensor, position_embeddings, position_ids, prev, store: dict):
    """A DSA layer's forward in a sharded turn (Note [Sharded DSA turns]): h [B, T_local, hidden], this rank's
    shard of the new tokens. Returns (picks [B, T_local, K] global columns, the layer's output [B, T_local, hidden])."""
    call = state.generating
    step, turn = call.step, call.step.dsa
    bsz, dev = h.shape[0], h.device
    q_resid, query, k_pass, k_rot = project(module, h, position_embeddings)
    call.cache.update(k_pass, k_rot, module.layer_idx)  # counts the new columns; the kept ones are appended below
    layer = call.cache.layers[module.layer_idx]
    order, real, s_max = _layout(state, layer, turn, bsz, dev)
    cols = real.shape[1]
    allowed = (torch.arange(cols, device=dev)[None, None, :] <= step.q_positions[:, :, None]) & real[:, None, :]
    keep = step.keep.to(dev)
    if module.indexer is not None:
        if module.layer_idx not in store:
            raise ValueError(f"generate() of {type(module).__name__} under CP was passed a ShardedCache without its "
                             "index keys (filled by another model's generate()); pass the cache this model's "
                             "generate() returned, or none.")
        scored = allowed  # the indexer's mask as CP=1's implementation builds it: bool (sdpa), or additive (eager)
        if state.attn_implementation.get("") == "eager":
            scored = torch.zeros(allowed.shape, dtype=h.dtype, device=dev).masked_fill(~allowed,
                                                                                       torch.finfo(h.dtype).min)
        keys = _Keys(state, store[module.layer_idx], turn, order, real, s_max)
        picks = index_tiles(module.indexer, h, q_resid, position_embeddings, scored, position_ids, keys)  # [B, T_local, K]
        store[module.layer_idx] = torch.cat([store[module.layer_idx], keys.new.index_select(1, keep)], dim=1)
    else:
        picks = prev
    grow = lambda x: torch.nn.functional.pad(x, (0, 0, 0, s_max - x.shape[2]))  # noqa: E731  [B, 1, S_max, *]
    kp, kr = torch.cat([grow(layer.keys), k_pass], 2), torch.cat([grow(layer.values), k_rot], 2)
    out = attend_selected(module, state, query, kp, kr, picks.long(), allowed.gather(-1, picks.long()), order,
                          compact=True)
    layer.keep_new(k_pass.index_select(2, keep), k_rot.index_select(2, keep), step.positions.to(dev), step.slots)
    return picks, out
