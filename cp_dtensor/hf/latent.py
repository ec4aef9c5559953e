"""Multi-head latent attention (DeepSeek-V2 / V3 and the families built on them) under CP with the latents on the wire.

Note [MLA latents on the wire]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An MLA layer's state a token is its latent row: the normed latent (``kv_lora_rank``, 512 in DeepSeek-V3)
and the rotated rope key (``qk_rope_head_dim``, 64): 576 numbers. transformers expands it with
``kv_b_proj`` into every head's key and value before calling the attention function -- 128 heads x (192 +
128) numbers a token at DeepSeek-V3 sizes, 71x more -- so a ring over transformers' K/V moves the
expanded rows. Under CP the door swaps the layer's ``expand_kv`` (the family's own method, called by its
forward after the rotary embedding) for one that keeps the latent rows for the attention function and
hands transformers stride-0 zero K/V of the right shape, which the attention function ignores. The
attention function then:

1. sends each latent row to the ranks with a query that can see it (one all_to_all, :class:`SeenRows`;
   which rows, from the global masks every rank holds: hf/sparse.py's ``seen_keys``, as DeepSeek Sparse
   Attention sends its index keys) and lays them out in global order, zeros where none of its queries
   looks (each row its own order under ``layout="documents"``); backward sends the rows' gradients back
   to their holders, which add them up;
2. attends this rank's queries to them in key chunks, each expanded by the layer's own ``expand_kv`` and
   folded into an online softmax, recomputed in backward: Note [Latent attention in chunks] in
   hf/latent_attend.py;
3. masks by transformers' sdpa / eager rules on the global batch, as DeepSeek Sparse Attention does
   (hf/sparse.py's rows): causal in global order, padding keys masked in every row (a left pad sees no
   key: a zero output, SDPA's fully masked row; a right pad sees the row's tokens, as at CP=1), packed
   documents (position ids that restart, without a mask or a cache) each their own.

Bytes a layer (bf16, P ranks, N tokens): a rank receives 1152 bytes for each row it sees and does not
hold -- at most (P - 1) / P x N rows (the rank holding the sequence's last tokens sees them all; packed
documents far fewer) -- and sends as many gradient rows back; the ring moves (P - 1) / P x N x 81920 (K and
V) through every rank forward and twice that backward (K/V and their gradients):
scripts/benchmarks/bench_mla.py. Opt-in, ``kv_exchange="latent"`` at the door: the attention runs the fused
kernels one masked (query tile, key chunk) rectangle and batch row at a time (Note [Latent attention in
chunks]), slower than the ring's calls (on CUDA the efficient kernel in fp32, not flash), so it pays where the
interconnect or memory is the bottleneck, not where the ring's K/V traffic hides behind its compute. Served
for the families whose latent path is proven against CP=1 (``PROVEN``) loaded with the sdpa or eager kernel,
without ``comm_dtype`` (the ring's option); any other model asked for it is refused at the door
(:func:`latent_error`), and the default ``kv_exchange="ring"`` runs the ring on the expanded K/V (the door
says so, :func:`mla_path`). A hybrid's other attention layers run the ring either way. A forward with a plan
in a named layout runs the ring.

Note [MLA turns]
~~~~~~~~~~~~~~~~
generate()'s prefill runs the latent path (each rank's shard of the prompt, striped under
``layout="documents"``, as the ring's prefill), into a sharded cache of the latent rows the family's cache
update keeps. Pass-KV (Note [Pass-KV turns] in hf/pass_kv.py) is
served only where the attention takes the very tensors the cache handed back; an MLA layer expands them
first, so the prefill notes the latent rows its ``expand_kv`` was given instead of the expansion
(:func:`take_handed`): those are the cache's tensors. In a pass-KV forward ``expand_kv`` keeps the new
shard's latent rows for the attention call (as in training); pass-KV then sends each rank's block of latent
rows -- cache share and new shard, [B, 1, S', R] and [B, 1, S', r] -- round the ring, expands each block on
arrival with the layer's ``expand_kv`` (:func:`expand_blocks`; one block's K/V at a time) and keeps its new
columns as latent rows. The bytes rule (hf/pass_kv.py's ``turn_mode``) counts (R + r) x e bytes a cached
token (1152 in bf16 at DeepSeek-V3 sizes, each sent to P - 1 ranks) against pass-Q's [out | lse] of
H x (Dv + 1) x 4 bytes a new token (66048, from P - 1 ranks), so pass-KV wins once a turn is more than about
1 / (57 P) of the conversation (with the expanded K/V: 1.24 / P of it). Decode steps and short
turns run pass-Q over the cached latent rows, expanded per step, as before; a hybrid's turns run pass-Q.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.agreement import agree_on_call
from ..core.plan.layout import global_order
from .documents import plan_error, ring_layout
from .latent_attend import Masks, latent_attention
from .pads import latent_pad_error, planned_pad_error
from .sparse import _order, global_rows, seen_keys

__all__ = ["EXCHANGES", "PROVEN", "enable_latent", "expand_blocks", "latent_error", "mla_layers", "mla_path", "report", "ring_exchange",
           "take_handed", "take_latents"]

#: the families whose latent path is checked against CP=1 (tests/hf/test_hf_dsa.py's MLA cases; the conformance
#: sweep runs them too)
PROVEN = frozenset({"deepseek_v2", "deepseek_v3", "axk1", "bailing_hybrid", "glm4_moe_lite", "kimi_linear",
                    "longcat_flash", "minicpm3", "sarvam_mla", "youtu"})
_KERNELS = ("eager", "sdpa")
logger = logging.getLogger(__name__)
_KEPT = "_cp_dtensor_latents"  # the layer's latent rows, from its expand_kv to its attention call
_HANDED = "_cp_dtensor_handed"  # a prefill's: the latent rows its expand_kv expanded (ShardedCache.note_inputs)
_SEE = "See Note [MLA latents on the wire] in cp_dtensor/hf/latent.py."


def mla_layers(model: nn.Module) -> list[nn.Module]:
    """The model's dense MLA layers (``expand_kv`` and ``kv_b_proj``; DeepSeek Sparse Attention's have an indexer)."""
    return [m for m in model.modules() if hasattr(m, "expand_kv") and hasattr(m, "kv_b_proj")
            and hasattr(m, "kv_lora_rank") and not hasattr(m, "indexer")]


EXCHANGES = ("ring", "allgather", "latent")  # the transformers door's kv_exchange values


def ring_exchange(kv_exchange: str) -> str:
    """The ring's ``kv_exchange`` for a door's: "latent" is the door's own (the MLA layers'); the model's ring
    calls then run the ring. Another value raises, naming the door's values (the same arguments on every rank:
    every rank raises alike, before any communication)."""
    if not isinstance(kv_exchange, str) or kv_exchange not in EXCHANGES:
        raise ValueError(f"kv_exchange must be one of {', '.join(map(repr, EXCHANGES))} at the transformers door "
                         f"('latent': multi-head latent attention sends its latent rows, opt-in); got {kv_exchange!r}. "
                         f"{_SEE}")
    return "ring" if kv_exchange == "latent" else kv_exchange


def mla_path(model: nn.Module, before: dict, comm_dtype=None, kv_exchange: str = "ring") -> str | None:
    """Why this model's MLA layers run the ring on the expanded K/V ("latent": they send latents; None: no
    dense MLA layer). Opt-in: ``kv_exchange="latent"``. Reads the model only: the same on every rank."""
    if not mla_layers(model):
        return None
    if kv_exchange != "latent":
        return f"kv_exchange={kv_exchange!r} (kv_exchange='latent' sends the latent rows)"
    kind, impl = getattr(model.config, "model_type", "?"), before.get("")
    if kind not in PROVEN:
        return f"the latent path is proven for {sorted(PROVEN)}, not model_type={kind!r}"
    if impl not in _KERNELS:
        return f"attn_implementation={impl!r} (the latent path serves 'sdpa' and 'eager')"
    if comm_dtype is not None:
        return f"comm_dtype={comm_dtype} (the ring's option: the latent rows travel in the model's dtype)"
    return "latent"


def latent_error(model: nn.Module, before: dict, comm_dtype=None) -> str | None:
    """``kv_exchange="latent"``'s refusal at the door (None: served): a model with no dense MLA layer, an
    unproven family, another kernel, comm_dtype. Reads the model only: every rank raises alike, before any
    communication."""
    path = mla_path(model, before, comm_dtype, "latent")
    if path == "latent":
        return None
    why = path or "it has no dense multi-head latent attention layer"
    return (f"kv_exchange='latent' sends multi-head latent attention's latent rows instead of the expanded K/V; "
            f"{type(model).__name__}: {why}. It serves the dense MLA layers of model_type in {sorted(PROVEN)} "
            "loaded with attn_implementation='sdpa' or 'eager', without comm_dtype. Use kv_exchange='ring' (the "
            f"default) for this model. {_SEE}")


def report(model: nn.Module, path: str | None) -> None:
    """The door says which path the model's MLA layers take (logging, INFO), and why not the latent one."""
    if path == "latent":
        logger.info("cp_dtensor: %s's multi-head latent attention sends latent rows under CP", type(model).__name__)
    elif path is not None:
        logger.info("cp_dtensor: %s's multi-head latent attention runs the ring on the expanded K/V: %s. %s",
                    type(model).__name__, path, _SEE)


def _latent_call(state) -> bool:
    """Whether this forward's MLA layers take the latent path (the same on every rank: the call's kind)."""
    return state.generating is None and (state.plan is None or state.layout == "documents")


def _step(state) -> str | None:
    """generate()'s forward kind ("prefill", "pass-kv", "decode"), or None outside generate()."""
    step = getattr(state.generating, "step", None)
    return None if step is None else step.kind


@torch.compiler.disable(reason="the MLA layer's latent rows are kept for cp_dtensor's attention function, which runs "
                                "eagerly (Note [Compiled HF models] in cp_dtensor/hf/attention.py)")
def _keep_latents(module: nn.Module, state, kv_nope: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's ``expand_kv`` under CP: see Note [MLA latents on the wire]."""
    kind = _step(state)
    if kind == "prefill":  # the attention takes what the cache handed back (ShardedCache.note_inputs)
        module.__dict__[_HANDED] = (kv_nope, k_rot)
    if state.generating is not None and kind not in ("prefill", "pass-kv"):  # pass-Q: the expansion of the share
        return type(module).expand_kv(module, kv_nope, k_rot)
    if state.generating is None and not _latent_call(state):
        return type(module).expand_kv(module, kv_nope, k_rot)
    module.__dict__[_KEPT] = (kv_nope, k_rot)
    with torch.no_grad():  # the shapes of one token's expansion
        k1, v1 = type(module).expand_kv(module, kv_nope[:, :, :1], k_rot[:, :, :1])
    b, s = kv_nope.shape[0], kv_nope.shape[2]
    return (k1.new_zeros(()).expand(b, k1.shape[1], s, k1.shape[-1]),
            v1.new_zeros(()).expand(b, v1.shape[1], s, v1.shape[-1]))


def take_latents(module: nn.Module):
    """The latent rows the layer's ``expand_kv`` kept for this attention call (None: the ring's K/V)."""
    return module.__dict__.pop(_KEPT, None)


def take_handed(module: nn.Module):
    """In a prefill: the latent rows the layer expanded for this attention call (None: not an MLA layer here)."""
    return module.__dict__.pop(_HANDED, None)


def expand_blocks(module: nn.Module, kv_nope: Tensor, k_rot: Tensor) -> tuple[Tensor, Tensor]:
    """A pass-KV turn's block of latent rows ([B, 1, S', R], [B, 1, S', r]) expanded by the layer's own
    ``expand_kv``: keys [B, H, S', Dqk], values [B, H, S', Dv] (Note [MLA turns])."""
    return type(module).expand_kv(module, kv_nope, k_rot.to(kv_nope.dtype))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y if isinstance(x, Tensor) or isinstance(y, Tensor) else x == y
                                    for x, y in zip(a, b))


def attend(module: nn.Module, state, query: Tensor, latents, attention_mask, err, scaling: float, kwargs,
           derive, version) -> Tensor:
    """The attention function's latent path: query [B, H, S, Dqk] -> [B, S, H, Dv] (Note [MLA latents on the
    wire]). ``err``: this rank's error for the call (raised on every rank before anything moves)."""
    group, rank, world = state.mesh.get_group(), state.mesh.get_local_rank(), state.mesh.size()
    kv_nope, k_rot = latents
    bsz, s = query.shape[0], query.shape[2]
    n = s * world
    pos, use_cache = kwargs.get("position_ids"), bool(kwargs.get("use_cache"))
    if err is None and not (getattr(module, "is_causal", True) and kwargs.get("sliding_window") is None):
        err = f"the latent path runs causal MLA without a window; {type(module).__name__} is not. {_SEE}"
    key = ("mla", pos, -2 if pos is None else version(pos), attention_mask, use_cache, bsz)
    if state.last is None or not _same(state.last[0], key):  # the forward's first layer (or a new call)
        planned = state.layout == "documents" and state.generating is None  # a prefill: striped (ring_layout)
        if err is None and planned:  # Note [A plan fits its batch] in hf/documents.py
            err = plan_error(state, state.plan, query, pos, attention_mask) or planned_pad_error(state, attention_mask)
        agree_on_call(err, {"batch": bsz, "tokens": s, "heads": query.shape[1], "latent": kv_nope.shape[-1],
                            "plan key": state.plan.key if planned and err is None else 0}, group,
                      what="cp_dtensor.hf (multi-head latent attention)")
        order = (_order(state, world, n, bsz, query.device) if planned or state.layout != "documents"
                 else global_order(ring_layout(state), world, n).to(query.device).expand(bsz, -1))  # [B, N]
        rows = global_rows(state, derive, pos, attention_mask, query, order, bsz, s, planned=planned, use_cache=use_cache)
        state.last = (key, (order, rows))
        err = None if planned else latent_pad_error(state)  # global facts: every rank alike (Note [Scored pads])
        if err is not None:
            raise ValueError(err)
    elif err is not None:  # a later layer's own error: from the model and the call, the same on every rank
        raise ValueError(err)
    order, rows = state.last[1]
    local = torch.cat((kv_nope[:, 0], k_rot[:, 0].to(kv_nope.dtype)), dim=-1)  # [B, S, R + r]
    f = local.shape[-1]
    seen = seen_keys(order, world, bsz, rows)  # [P, B, N]: the rows each rank's queries can see
    every = SeenRows.apply(local.contiguous(), seen, order, rank, group)  # [P, B, S, R + r], unseen rows 0
    every = every.transpose(0, 1).reshape(bsz, n, f)  # rank-major slots
    glob = every.gather(1, torch.argsort(order, dim=1)[..., None].expand(-1, -1, f))  # [B, N, R + r] global order
    masks = Masks(order[:, rank * s:(rank + 1) * s], rows)
    out = latent_attention(module, masks, scaling, query, glob)  # [B, H, S, Dv]
    return out.transpose(1, 2).contiguous()


class SeenRows(torch.autograd.Function):
    """Every rank's latent rows [B, S, F] -> [P, B, S, F] (rank-major), holding the rows of the other ranks that
    ``seen`` [P, B, N] says this rank's queries can see (hf/sparse.py's seen_keys), zeros elsewhere: one
    all_to_all sends each row only to the ranks that see it. Backward sends the rows' gradients back to their
    holders (one all_to_all) and adds them up there."""

    @staticmethod
    def forward(ctx, local: Tensor, seen: Tensor, order: Tensor, rank: int, group) -> Tensor:
        world, (b, s, f) = seen.shape[0], local.shape
        at = order.view(b, world, s)  # [B, P, S]: each rank's global positions, row by row
        send = seen.gather(2, at[:, rank][None].expand(world, -1, -1))  # [P, B, S]: which of mine rank p sees
        take = seen[rank].gather(1, order).view(b, world, s).transpose(0, 1).clone()  # [P, B, S]: which of
        # rank q's rows this rank sees
        send[rank], take[rank] = False, False
        sends, takes = send.sum((1, 2)).tolist(), take.sum((1, 2)).tolist()
        got = local.new_empty(sum(takes), f)
        dist.all_to_all_single(got, local[None].expand(world, -1, -1, -1)[send].contiguous(), takes, sends,
                               group=group)
        every = local.new_zeros(world, b, s, f)
        every[take] = got
        every[rank] = local
        ctx.save_for_backward(send, take)
        ctx.rank, ctx.group, ctx.sends, ctx.takes = rank, group, sends, takes
        return every

    @staticmethod
    def backward(ctx, grad: Tensor):  # grad: [P, B, S, F]
        send, take = ctx.saved_tensors
        back = grad.new_empty(sum(ctx.sends), grad.shape[-1])
        dist.all_to_all_single(back, grad[take].contiguous(), ctx.sends, ctx.takes, group=ctx.group)
        spread = grad.new_zeros(grad.shape)
        spread[send] = back
        return spread.sum(0) + grad[ctx.rank], None, None, None, None


class _Restore:
    """Puts a layer's own ``expand_kv`` back (remove_context_parallel)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        for name in ("expand_kv", _KEPT, _HANDED):
            self.module.__dict__.pop(name, None)


def enable_latent(model: nn.Module, state) -> None:
    """Swap each dense MLA layer's ``expand_kv`` (Note [MLA latents on the wire]); call after :func:`mla_path`
    said "latent"."""
    for m in mla_layers(model):
        m.expand_kv = partial(_keep_latents, m, state)
        state.handles.append(_Restore(m))
