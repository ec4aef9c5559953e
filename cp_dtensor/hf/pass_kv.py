"""Pass-KV for a turn on a non-empty sharded cache: the new tokens sharded in the layout, every rank's K/V
(its cache share and its shard of the new tokens) passed round the ring once per layer, each rank attending
its queries to every block by global column. Chosen per forward by the bytes rule of Note [Continuing a sharded cache]
(hf/turns.py): when the new tokens are a large share of the conversation.

Note [Pass-KV turns]
~~~~~~~~~~~~~~~~~~~~
A turn of T new tokens after C cached ones, in pass-KV (hf/generate.py's pre-hook decides, from
:func:`turn_mode`):

* the pre-hook pads the T columns on the left to the layout unit (pad columns: position -1, never a key,
  their queries padding) and gives each rank its layout shard, as a prefill does; the layers run on the
  shard: each rank computes T / P tokens, not T;
* each attention layer passes every rank's block -- [cache share, padded to the largest share's S_max |
  new shard] K and V in one buffer -- round the ring (core/exchange/comm.py's RingComm, the next block in flight
  while this one is attended): (P - 1) * B * (S_max + T_local) * Hkv * (Dqk + Dv) * e bytes per rank,
  about (P - 1) / P of all C + T tokens' K/V; a rank holds two blocks at a time, not the whole cache.
  The cache shares' positions are gathered once per forward, in the pre-hook. Each rank attends its
  queries to each block causally by global column, with the window, and merges the partials by the
  stable log-sum-exp rule; sinks join once (core/decode.py's :func:`attend_blocks`);
* each new column's K/V are kept by the rank holding the fewest tokens (the lowest on ties), copied from
  the block it arrives in -- the balance rule of decoding, so every share stays within one of the mean;
* a hook after the base model gathers the hidden rows the LM head reads, as after a prefill.

Served for models without linear-attention layers (a hybrid's linear layers would need their state passed
across the shards from the cached state: its turns run pass-Q), and only where every layer's attention takes
the very K/V its layer caches, once a forward: the blocks passed here are what the attention function is
handed, and the columns kept are taken from them. Multi-head latent attention on the latent path passes its
cached latent rows and expands each block on arrival (Note [MLA turns] in hf/latent.py). Not so for an MLA
family on the ring (not proven for the latent path), which expands the cache's latents into per-head K/V
after the cache; DiffLlama, which calls the attention
twice with the value's halves; JetMoE, which repeats the cached heads. The prefill checks it: each
layer's attention call compares its K/V with the tensors the layer's cache update handed back
(``ShardedCache.note_inputs``: the same answer on every rank, from the model's code), and a model where
any differs runs its turns pass-Q -- each rank computes on its own share as the layer does, the queries
travel. Exact either way; pass-Q sends more bytes for a long turn.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._extras import require

require("hf", "cp_dtensor.hf (transformers generate() under context parallelism)")

from ..core.decode import attend_blocks  # noqa: E402
from ..core.exchange.comm import RingComm, all_gather, pack, unpack, wait  # noqa: E402
from ..core.plan.layout import global_order, layout_unit, shard_tensor  # noqa: E402
from .cache import ShardedCache, _Step  # noqa: E402
from .documents import ring_layout  # noqa: E402
from .latent import expand_blocks  # noqa: E402
from .state import HFState  # noqa: E402
from .turns import kv_dims, turn_plan  # noqa: E402

__all__ = ["pass_kv_attention", "pass_kv_step", "turn_mode"]


def turn_mode(state: HFState, module: nn.Module, cache: ShardedCache, batch: int, new: int) -> str:
    """"pass-kv" or "pass-q" for a forward of ``new`` columns on the non-empty ``cache`` (Note [Pass-KV
    turns]); the same on every rank (global facts only). A decode step, a hybrid's turns and a model whose
    attention takes other K/V than it caches: pass-Q. Per-layer head sizes (Gemma 4): the layers' bytes summed."""
    cp = state.mesh.size()
    if cp == 1 or new < 2 or cache.linear or not cache.attends_cached:
        return "pass-q"
    config = module.config.get_text_config(decoder=True)
    if state.mla == "latent":  # the cache holds MLA latent rows, which pass-KV sends: Note [MLA turns] in hf/latent.py
        esize = torch.empty((), dtype=module.dtype).element_size()
        return turn_plan(new=new, cached=cache.seen, cp=cp, batch=batch, q_heads=config.num_attention_heads,
                         kv_heads=1, head_dim=config.v_head_dim, kv_width=config.kv_lora_rank + config.qk_rope_head_dim,
                         kv_bytes=esize, largest_share=max(cache.held),
                         unit=layout_unit(ring_layout(state), cp)).mode
    dims = kv_dims(config)  # a tuple of the layers' values where they vary
    layers = max((len(x) for x in dims if isinstance(x, tuple)), default=1)
    at = lambda x, i: x[i] if isinstance(x, tuple) else x  # noqa: E731
    esize = torch.empty((), dtype=module.dtype).element_size()
    plans = [turn_plan(new=new, cached=cache.seen, cp=cp, batch=batch, q_heads=at(dims[0], i),
                       kv_heads=at(dims[1], i) or at(dims[0], i), head_dim=at(dims[2], i),
                       value_dim=at(dims[3], i) or at(dims[2], i), kv_bytes=esize, largest_share=max(cache.held),
                       unit=layout_unit(ring_layout(state), cp)) for i in range(layers)]
    if layers == 1:
        return plans[0].mode
    return "pass-kv" if sum(p.pass_kv for p in plans) < sum(p.pass_q for p in plans) else "pass-q"


class _PassKV:
    """What a pass-KV forward's layers share: S_max, every rank's cache positions and this rank's sources."""

    def __init__(self, s_max: int, k_positions: Tensor, src: Tensor):
        self.s_max = s_max
        self.k_positions = k_positions  # [B, P * (S_max + T_local)]: the gathered buffer's positions
        self.src = src  # [m]: where this rank's kept new columns lie in the gathered sequence axis


def pass_kv_step(state: HFState, call, cache: ShardedCache, ids: Tensor, pos: Tensor, col: Tensor, real: Tensor,
                 kwargs: dict):
    """The pre-hook's part for a pass-KV forward: shard the new columns, decide who keeps them, gather the
    cache shares' positions. ``pos`` [B, n]: the position ids (the model's rotary embedding); ``col`` [B, n]: the
    global columns the masks count by (Note [Masks by column] in hf/cache.py). See Note [Pass-KV turns]."""
    b, n = ids.shape
    layout, cp, rank = ring_layout(state), state.mesh.size(), state.mesh.get_local_rank()
    pad = -n % layout_unit(layout, cp)
    padded = lambda x, v: torch.nn.functional.pad(x, (pad, 0), value=v)  # noqa: E731
    shard = lambda x: shard_tensor(x, seq_dim=1, layout=layout, rank=rank, cp_size=cp).contiguous()  # noqa: E731
    kpos = col.masked_fill(~real, -1)  # [B, n]
    local = (n + pad) // cp
    before = list(cache.held)
    s_max = max(before)
    owners = []
    for _ in range(n):  # the balance rule of decoding
        owners.append(min(range(cp), key=lambda r: (cache.held[r], r)))
        cache.held[owners[-1]] += 1
    mine = torch.nonzero(torch.tensor(owners) == rank).flatten()  # [m]: the new columns this rank keeps
    where = torch.argsort(global_order(layout, cp, n + pad))[mine + pad]  # rank-major index r * local + j
    src = (where // local) * (s_max + local) + s_max + where % local
    # every rank's cache positions, padded to S_max with -1, then its new shard's (known everywhere)
    full = cache.layers[cache.shared_layer()] if cache.shared_layer() is not None else None
    own = full.positions if full is not None else ids.new_full((b, 0), -1)  # every windowed layer gathers its own
    own = torch.nn.functional.pad(own, (0, s_max - own.shape[1]), value=-1)  # [B, S_max]
    group = state.mesh.get_group()
    cached = wait(all_gather(own.reshape(-1), group), group).view(cp, b, s_max)  # [P, B, S_max]
    every = global_order(layout, cp, n + pad).view(cp, local).to(ids.device)  # [P, T_local]: padded columns
    new_pos = padded(kpos, -1)[:, every]  # [B, P, T_local]
    k_positions = torch.cat([cached.transpose(0, 1), new_pos], 2).reshape(b, -1)  # [B, P * (S_max + T_local)]
    call.step = _Step("pass-kv", kpos.index_select(1, mine.to(ids.device)), mine, n,
                      q_positions=shard(padded(col, -1)), q_padding=~shard(padded(real, False)), slots=mine + cache.seen)
    call.step.pass_kv = _PassKV(s_max, k_positions, src.to(ids.device))
    call.prompt = (n, pad)  # the hook after the base model gathers the rows the LM head reads
    cache.note_tokens(ids, real)
    kwargs["input_ids"], kwargs["position_ids"] = shard(padded(ids, 0)), shard(padded(pos, 0))


def _own_positions(state: HFState, own: Tensor, s_max: int, k_positions: Tensor, s: int) -> Tensor:
    """A windowed layer's block positions, [B, P * S']: every rank's own trimmed share's columns (gathered, padded
    to S_max with -1) in place of the shared ones, the new shards' as planned."""
    b, cp = own.shape[0], state.mesh.size()
    own = torch.nn.functional.pad(own, (0, s_max - own.shape[1]), value=-1)  # [B, S_max]
    group = state.mesh.get_group()
    every = wait(all_gather(own.reshape(-1), group), group).view(cp, b, s_max).transpose(0, 1)  # [B, P, S_max]
    blocks = k_positions.view(b, cp, s).clone()
    blocks[:, :, :s_max] = every
    return blocks.reshape(b, -1)


def pass_kv_attention(state: HFState, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling, window,
                      sinks):
    """A pass-KV forward's attention (Note [Pass-KV turns]). query: [B, Hq, T_local, D]; key, value: this
    rank's shard of the new tokens [B, Hkv, T_local, D(v)]. Returns [B, T_local, Hq, Dv]."""
    call = state.generating
    step, layer, cp = call.step, call.cache.layers[module.layer_idx], state.mesh.size()
    plan = step.pass_kv
    s = plan.s_max + key.shape[2]  # S' = S_max + T_local: one rank's block
    grow = lambda x: torch.nn.functional.pad(x, (0, 0, 0, plan.s_max - x.shape[2]))  # noqa: E731  [B, Hkv, S_max, *]
    k_own, v_own = torch.cat([grow(layer.keys), key], 2), torch.cat([grow(layer.values), value.to(key.dtype)], 2)
    kept_k = key.new_empty(*key.shape[:2], len(plan.src), key.shape[3])  # the new columns this rank keeps
    kept_v = value.new_empty(*value.shape[:2], len(plan.src), value.shape[3])
    ring = RingComm(state.mesh.get_group())
    k_positions = plan.k_positions
    latent_rows = state.mla == "latent" and "expand_kv" in vars(module)  # key, value: MLA latent rows
    if layer.reach is not None:  # Note [Windowed caches]: the model's window, the same on every rank (a collective)
        k_positions = _own_positions(state, layer.positions, plan.s_max, k_positions, s)

    def blocks():  # every rank's block in ring order, one in flight while the current one is attended
        buf = pack(k_own, v_own)  # [K | V] flat
        for i in range(cp):
            nxt = ring.rotate(buf) if i < cp - 1 else None
            src = ring.src_at(i)
            k_blk, v_blk = unpack(buf, k_own, v_own)
            at = torch.nonzero(plan.src // s == src).flatten()  # kept columns that came from rank src
            if len(at):
                cols = plan.src.index_select(0, at) % s
                kept_k[:, :, at], kept_v[:, :, at] = k_blk.index_select(2, cols), v_blk.index_select(2, cols)
            k_blk, v_blk = k_blk.to(query.dtype), v_blk.to(query.dtype)
            if latent_rows:  # the block's latent rows, expanded on arrival: Note [MLA turns] in hf/latent.py
                k_blk, v_blk = expand_blocks(module, k_blk, v_blk)
            yield k_blk, v_blk, k_positions[:, src * s:(src + 1) * s]
            if nxt is not None:
                buf = ring.wait(nxt)

    out = attend_blocks(query, blocks(), q_positions=step.q_positions, scale=scaling, window_size=window,
                        sinks=sinks, padding=step.q_padding)
    layer.keep_new(kept_k, kept_v, step.positions, step.slots)
    return out.transpose(1, 2).contiguous()
