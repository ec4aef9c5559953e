"""DeepSeek Sparse Attention (DeepSeek-V3.2 ``deepseek_v32``, GLM-MoE-DSA ``glm_moe_dsa``) under context parallelism.

Note [DeepSeek Sparse Attention under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An ``indexed_attention`` layer is MLA whose every query attends to the top-k keys a lightning indexer
picks from the whole causal prefix: index score ``sum_h w_h relu(q_h . k)`` of a small index query
(``index_n_heads`` heads) against one ``index_head_dim`` index key per token, then ``topk(index_topk)``.
A ring would move every rank's expanded K/V through every rank to use ``index_topk`` of them. Under CP
each layer's forward is replaced (the family's own modules do the arithmetic, in its order):

1. **The indexer, exactly as at CP=1.** Each rank computes its tokens' index keys; one all_to_all sends
   each key to the ranks with a query that can see it (``seen_keys``: causal in the global order, not
   padding, in the query's document -- from the global masks every rank holds, so no counts travel;
   ``index_head_dim`` numbers a key -- the indexer runs under ``no_grad`` in transformers, so no
   gradient flows back through them), and each rank lays them out as the global key sequence of length
   N, zeros where no query of its sees the key. The family's own indexer then scores this rank's queries
   against it with the mask of the global positions: the same rows of the same length N as CP=1 scores
   -- a key the rank was not sent is masked in each of its rows, -inf (sdpa) or the eager mask's minimum
   whatever the key -- so ``topk`` picks the same global indices, ties and all (tests/hf/test_hf_dsa.py
   compares the index sets with CP=1's). With one sequence a row the rank holding the last tokens needs
   every other key; packed documents need only their own (scripts/benchmarks/bench_dsa.py).
2. **Only the selected latent rows move.** MLA's latent row of a token (``kv_lora_rank`` normed latent +
   ``qk_rope_head_dim`` rotated key, 576 numbers in DeepSeek-V3.2) is what ``kv_b_proj`` expands into every
   head's key and value. A rank needs the rows its queries selected (within the causal prefix); those it
   does not hold it requests: an all_to_all of the counts, one of the row numbers (8 bytes a row), one of
   the rows. Backward sends the rows' gradients back the same way and adds them to the latent's.
3. **Attention over the selected keys only.** The held and received rows form a table, ``kv_b_proj``
   expands it once, and each query's softmax runs over its ``index_topk`` gathered keys, the picks outside
   the causal prefix (only when fewer than ``index_topk`` keys exist) masked, as CP=1's mask does -- in
   query chunks of bounded size whose backward gathers again (Note [DSA attention in query chunks] in
   hf/sparse_attend.py); the indexer of step 1 likewise runs on query tiles where its scores would not
   fit a bound (Note [The DSA indexer in query tiles] in hf/sparse_rows.py).

Steps 1-3 read one thing of the layout: each row's global position at each rank's slots (``row_orders``,
[B, N]) -- a named layout's ``global_order`` for every row, or under ``layout="documents"`` the batch's
plan's own order for each row (``cp_layout=``, Note [One plan per batch in transformers] in hf/documents.py:
short documents whole on one rank, long ones cut). Which keys a rank's queries see, who holds a key or a
latent row and where it lands all follow from it, so the documents layout is served by the same code; its
plan is checked against the batch (``plan_error``, Note [A plan fits its batch]) in the first layer's
agreement, and the rows' masks come from the position ids and padding gathered in the plan's order by the
same rule. A plan under a named layout (``plan_batch`` of a model in a named layout: the layout's order, the
batch's documents) is served the same way. Each query's index row has CP=1's length:
Note [DSA rows of CP=1's length].

GLM-MoE-DSA's ``"shared"`` layers reuse the previous full layer's indices: under CP those are the global
indices step 1 returned, so they reuse them alike. generate() decodes from the sharded cache: Note [DSA
generate() under CP] in hf/sparse_generate.py (under ``layout="documents"`` the prompt, one sequence a row,
is prefilled striped, as for the ring's models). The rows' masks are transformers' sdpa / eager rules on the global batch (hf/attention.py's
derive_documents, one gather of the positions a forward, and one of the padding mask or the document ids):
padding (a 2-D ``attention_mask``, left or right) is masked as keys in every row -- a left-pad query that
sees no key gets a zero attention output, as SDPA gives a fully masked row -- and packed sequences
(position ids that restart, without a mask or a cache) see their own document only. Rows of length N
matter beyond the mask: a row's ties (index scores ReLU makes exactly 0) are broken by ``topk`` over the
whole row, so at CP=1 a document's picks, and its logits, depend on the length of the row it sits in --
which is why each rank scores full rows. Not served: a forward with a KV cache of its own
(``use_cache=True`` outside generate()), the flash-mla kernel's sparse path (refused at the door: load
with ``attn_implementation="sdpa"`` or "eager"), attention dropout. Each raises on every rank before any
row moves.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from .._compat import all_gather_single
from ..core.agreement import agree_on_call
from ..core.plan.layout import global_order
from .documents import documents_of, plan_error
from .pads import sparse_pad_error
from .sparse_attend import attend_picks
from .sparse_rows import by_rows, index_tiles, row_lengths

__all__ = ["FAMILIES", "ddp_error", "dsa_layers", "door_error", "enable_sparse", "exchange_plan", "global_rows", "row_orders",
           "seen_keys"]

FAMILIES = frozenset({"deepseek_v32", "glm_moe_dsa"})
_KERNELS = ("eager", "sdpa")  # the implementations whose masked path is the dense twin of the selection
_SEE = "See Note [DeepSeek Sparse Attention under CP] in cp_dtensor/hf/sparse.py."


def dsa_layers(model: nn.Module) -> list[nn.Module]:
    """The model's DeepSeek Sparse Attention modules (MLA with an ``indexer`` slot)."""
    return [m for m in model.modules() if hasattr(m, "indexer") and hasattr(m, "expand_kv")
            and hasattr(m, "kv_a_proj_with_mqa")]


def door_error(model: nn.Module, layout: str, before: dict) -> str | None:
    """Why the door cannot serve this DSA model as configured (None: it can); reads the model only. Every
    ``layout`` is served: the named ones and "documents" (each row in its plan's order)."""
    name, impl = type(model).__name__, before.get("")
    if impl not in _KERNELS:
        return (f"{name} uses attn_implementation={impl!r}: its sparse kernel (flash-mla's indices) has no context "
                f"parallel path; under CP the selected keys are gathered and attended by cp_dtensor. Load the model "
                f"with attn_implementation='sdpa' (or 'eager'), then apply context parallelism. {_SEE}")
    return None


def ddp_error(model: nn.Module, find_unused: bool, static_graph: bool) -> str | None:
    """Why DDP cannot wrap this DSA model as the Trainer configured it (None: it can). transformers runs the
    indexer without gradients, at CP=1 as under CP, so its parameters never get one; DDP without
    ``find_unused_parameters`` (the Trainer's default with activation checkpointing) then fails at the second step
    ("Expected to have finished reduction in the prior iteration")."""
    frozen = [n for n, p in model.named_parameters() if p.requires_grad and ".indexer." in f".{n}"]
    if not frozen or find_unused or static_graph:
        return None
    return (f"{type(model).__name__}'s DeepSeek Sparse Attention indexers never receive a gradient (transformers runs "
            f"them without gradients, as at CP=1: {len(frozen)} parameters, e.g. {frozen[0]}), and the Trainer's DDP "
            "runs without find_unused_parameters (ddp_find_unused_parameters=False, or its default with activation "
            "checkpointing), so the second step would fail. Set TrainingArguments(ddp_find_unused_parameters=True) "
            "or ddp_static_graph=True, or freeze the indexers (p.requires_grad_(False) for their parameters).")


class _Gathered:
    """The indexer's ``cache`` under CP: ``update_indexer`` hands back the index keys of the global sequence,
    [B, N, D] in global order, each rank's from an all_to_all that sends a key only to the ranks with a query
    that can see it (``seen`` [P, B, N], :func:`seen_keys`); the others stay 0, masked in every row."""

    def __init__(self, group, order: Tensor, rank: int, seen: Tensor):
        self.group, self.order, self.rank, self.seen = group, order, rank, seen

    def update_indexer(self, k: Tensor, layer_idx: int) -> Tensor:  # k: [B, S_local, D]
        world, (b, s, d) = self.seen.shape[0], k.shape
        order = row_orders(self.order, b).to(k.device)  # [B, N]
        at = order.view(b, world, s)  # [B, P, S]: each rank's global positions, row by row
        send = self.seen.gather(2, at[:, self.rank][None].expand(world, -1, -1))  # [P, B, S]: which of this
        # rank's keys each rank sees
        take = self.seen[self.rank].gather(1, order).view(b, world, s).transpose(0, 1).clone()  # [P, B, S]: which
        # of each rank's keys it sees
        send[self.rank], take[self.rank] = False, False
        got = k.new_empty(int(take.sum()), d)
        dist.all_to_all_single(got, k[None].expand(world, -1, -1, -1)[send].contiguous(),
                               take.sum((1, 2)).tolist(), send.sum((1, 2)).tolist(), group=self.group)
        every = k.new_zeros(world, b, s, d)
        every[take] = got
        every[self.rank] = k
        every = every.permute(1, 0, 2, 3).reshape(b, world * s, d)  # rank-major
        return every.gather(1, torch.argsort(order, dim=1)[..., None].expand(-1, -1, d))  # [B, N, D], global order


def row_orders(order: Tensor, bsz: int) -> Tensor:
    """[B, N]: row b's global position at rank-major slot j (rank r holds slots r * S .. r * S + S - 1): a
    plan's ``order`` as it is (layout="documents": each row its own), a named layout's [N] for every row."""
    return order if order.dim() == 2 else order.expand(bsz, -1)


def seen_keys(order: Tensor, world: int, bsz: int, rows) -> Tensor:
    """[P, B, N] bool: the keys (global positions) a query of rank r can see -- causal, and within ``rows``'
    restriction (``global_rows``: not padding, or the query's own document). Every other key is masked in each of
    the rank's index rows (-inf, or the eager mask's minimum, whatever its value), so it need not travel."""
    order = row_orders(order, bsz)  # [B, N]
    n = order.shape[1]
    q = order.view(bsz, world, n // world)  # [B, P, S]: each rank's queries' global positions
    keys = torch.arange(n, device=order.device)
    if rows is None or rows[0] == "real":
        seen = (keys <= q.amax(2)[:, :, None]).transpose(0, 1)  # [P, B, N]
        return seen if rows is None else seen & rows[1][None].to(seen.device)
    doc = torch.unique(rows[1], return_inverse=True)[1].to(order.device)  # [B, N]: documents numbered 0..
    last = torch.full((bsz, world, int(doc.max()) + 1), -1, dtype=torch.long, device=order.device)
    last = last.scatter_reduce(2, doc.gather(1, order).view(bsz, world, -1), q, "amax")  # [B, P, docs]: last query
    return (keys <= last.gather(2, doc[:, None, :].expand(-1, world, -1))).transpose(0, 1)  # [P, B, N]


class _Rows(torch.autograd.Function):
    """Send ``rows[wanted]`` to the ranks that asked (``give`` rows to each, in rank order) and receive
    ``take`` rows from each; backward sends the received rows' gradients back and adds them up."""

    @staticmethod
    def forward(ctx, rows: Tensor, wanted: Tensor, give: list[int], take: list[int], group) -> Tensor:
        ctx.save_for_backward(wanted)
        ctx.n, ctx.give, ctx.take, ctx.group = rows.shape[0], give, take, group
        out = rows.new_empty(sum(take), rows.shape[1])
        dist.all_to_all_single(out, rows.index_select(0, wanted).contiguous(), take, give, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (wanted,) = ctx.saved_tensors
        back = grad.new_empty(sum(ctx.give), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), ctx.give, ctx.take, group=ctx.group)
        full = grad.new_zeros(ctx.n, grad.shape[1]).index_add_(0, wanted, back)
        return full, None, None, None, None


def exchange_plan(picks: Tensor, valid: Tensor, order: Tensor, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """(the global rows ``b * N + t`` this rank requests, owner-major; their owners) for the selected keys
    ``picks`` [B, S_local, K] (global positions) where ``valid``; ``order``: global_order(layout, P, N) [N],
    or a plan's [B, N] (:func:`row_orders`)."""
    bsz, dev = picks.shape[0], picks.device
    order = row_orders(order, bsz).to(dev)
    n = order.shape[1]
    s = n // world
    ranks = torch.arange(world, device=dev).repeat_interleave(s).expand(bsz, -1)
    owner = torch.empty(bsz, n, dtype=torch.long, device=dev).scatter_(1, order, ranks).view(-1)  # [B * N]
    b = torch.arange(bsz, device=dev).view(-1, 1, 1).expand_as(picks)
    rows = b * n + picks.long()
    rows = rows[valid & (owner[rows] != rank)].unique()
    by = owner[rows]
    ranked = torch.argsort(by * (bsz * n) + rows)
    return rows[ranked], by[ranked]


_NO_CACHE = ("DeepSeek Sparse Attention under context parallelism runs forwards without a KV cache: call the model "
             "with use_cache=False; to decode, call model.generate(...) with the full prompt on every rank (it "
             f"decodes from a sequence-sharded cache). {_SEE}")


def _call_error(module: nn.Module, state, attention_mask, cache, position_ids, kwargs) -> str | None:
    if state.pending is not None:
        return state.pending
    if cache is not None:
        return _NO_CACHE
    if module.training and module.attention_dropout:
        return (f"attention dropout is not supported under context parallelism; got attention_dropout="
                f"{module.attention_dropout}. Set config.attention_dropout = 0 (or call model.eval()).")
    if attention_mask is not None and not (isinstance(attention_mask, Tensor) and attention_mask.dim() == 2):
        return ("DeepSeek Sparse Attention under CP takes a 2-D padding attention_mask [B, N] sharded like the tokens, "
                "or none; got "
                f"{type(attention_mask).__name__}. {_SEE}")
    if kwargs.get("document_ids") is not None:
        return (f"DeepSeek Sparse Attention under CP takes no document_ids=: its documents are the position ids' "
                f"(restarting at 0), as at CP=1. {_SEE}")
    if position_ids is None or position_ids.dim() != 2:
        return ("context parallel attention needs position_ids [B, S_local] (the global positions, sharded like the "
                "tokens by cp_dtensor.shard_batch).")
    return None


def gather_rows(group, world: int, local: Tensor, order: Tensor) -> Tensor:
    """Every rank's [B, S_local] shard as the global [B, N] in global order (one all-gather); ``order``: [N] or
    [B, N] (:func:`row_orders`)."""
    bsz, s = local.shape
    every = funcol.wait_tensor(all_gather_single(local.to(torch.int64).contiguous(), 0, group)).view(world, bsz, s)
    inv = torch.argsort(row_orders(order, bsz).to(local.device), dim=1)  # [B, N]: global position -> slot
    return every.permute(1, 0, 2).reshape(bsz, -1).gather(1, inv)


def real_mask(group, world: int, attention_mask, order: Tensor, bsz: int, s: int, dev) -> Tensor:
    """[B, N] bool in global order: the tokens that are not padding, from every rank's shard of the 2-D mask."""
    if attention_mask is None:
        return torch.ones(bsz, order.shape[-1], dtype=torch.bool, device=dev)
    return gather_rows(group, world, attention_mask[:, -s:], order).bool()


def global_rows(state, derive, position_ids, attention_mask, probe, order: Tensor, b: int, s: int, *, planned: bool,
                use_cache: bool = False) -> tuple[str, Tensor] | None:
    """What restricts the keys beyond causality, by transformers' rules on the global batch (the same on every
    rank; a bad batch raises on every rank): ("real", [B, N] not padding) with padding in the 2-D mask,
    ("documents", [B, N] document ids) for packed sequences (position ids that restart, no mask, no cache),
    None for one sequence a row. ``order`` [B, N]: the named layout's, or the batch's plan's (``planned``);
    ``probe``: this rank's activations (B x S tokens). DeepSeek Sparse Attention and the MLA latent path
    (hf/latent.py) read the same rows."""
    mask = None if attention_mask is None else attention_mask[:, -s:]
    group, world = state.mesh.get_group(), state.mesh.size()
    if planned:  # the positions and padding put in global order by the plan, the one rule
        real = None if mask is None else gather_rows(group, world, mask, order).bool()
        packed = not (use_cache and state.documents is None)
        full, err = documents_of(gather_rows(group, world, position_ids.expand(b, -1), order), real, packed=packed)
    else:  # a named layout: hf/attention.py's gather and rule
        full, err = derive(state, position_ids, mask, use_cache, b, probe=probe)
        real = None
    if err is not None:
        raise ValueError(err)
    if full is None:
        return None
    if mask is not None:
        return "real", real if real is not None else real_mask(group, world, mask, order, b, s, probe.device)
    return "documents", full if planned else gather_rows(group, world, full, order)


@torch.compiler.disable(reason="DeepSeek Sparse Attention under CP runs eagerly (Note [Compiled HF models] in "
                                "cp_dtensor/hf/attention.py)")
def _forward(module: nn.Module, state, derive, generating, hidden_states: Tensor, position_embeddings, attention_mask=None,
             cache=None, position_ids: Tensor | None = None, prev_topk_indices: Tensor | None = None, **kwargs):
    """The layer's forward under CP (Note [DeepSeek Sparse Attention under CP]): the family's modules, the
    global indexer, the selected rows exchanged, attention over them. Returns what the family's forward does."""
    if state.generating is not None:  # Note [DSA generate() under CP] in hf/sparse_generate.py
        return generating(module, state, hidden_states, position_embeddings, attention_mask, cache, position_ids,
                          prev_topk_indices)
    err = _call_error(module, state, attention_mask, cache, position_ids, kwargs)
    mesh, group = state.mesh, state.mesh.get_group()
    rank, world = mesh.get_local_rank(), mesh.size()
    bsz, s = hidden_states.shape[:2]
    n = s * world
    planned = state.layout == "documents" or state.plan is not None  # the batch's plan (cp_layout=), checked below
    if state.last is None:  # the forward's first layer (a recomputation finds it set): every rank raises the same
        # error before anything moves, then the rows' masks from the global batch (gathers of positions and masks)
        if err is None and planned:  # the batch's plan, and that it fits the batch: Note [A plan fits its batch]
            err = plan_error(state, state.plan, hidden_states[:, None], position_ids, attention_mask)
        agree_on_call(err, {"batch": bsz, "tokens": s, "hidden": hidden_states.shape[-1],
                            "plan key": state.plan.key if planned and err is None else 0}, group,
                      what="cp_dtensor.hf (DeepSeek Sparse Attention)")
        order = _order(state, world, n, bsz, hidden_states.device)
        state.last = (("dsa",), global_rows(state, derive, position_ids, attention_mask, hidden_states, order, bsz, s,
                                            planned=planned),
                      row_lengths(state, order, planned, bsz, s, gather_rows))
        if state.uniform_pads and state.last[1] is not None and state.last[1][0] == "real":  # Note [Scored pads]
            err = sparse_pad_error(state, state.last[1][1], order[:, rank * s:(rank + 1) * s], group)
            if err is not None:  # the same on every rank
                raise ValueError(err)
    elif err is not None:  # a later layer's: from the model and the call, the same on every rank
        raise ValueError(err)
    order = _order(state, world, n, bsz, hidden_states.device)  # [B, N]
    mine = order[:, rank * s:(rank + 1) * s]  # [B, S]: this rank's global positions
    keys = torch.arange(n, device=hidden_states.device)[None, None, :]
    allowed = keys <= mine[:, :, None]  # [B, S, N]: causal in the global order
    rows = state.last[1]
    if rows is not None and rows[0] == "real":  # padding: masked as keys in every row (CP=1's mask); a left-pad
        allowed = allowed & rows[1][:, None, :]  # query sees no key
    elif rows is not None:  # packed sequences: a query sees its own document's keys (CP=1's packed mask)
        allowed = allowed & (rows[1][:, None, :] == rows[1].gather(1, mine)[:, :, None])
    scored = allowed  # the indexer's mask as CP=1's implementation builds it: bool (sdpa), or additive (eager)
    if state.attn_implementation.get("") == "eager":
        scored = torch.zeros(allowed.shape, dtype=hidden_states.dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(hidden_states.dtype).min)
    q_resid, query, k_pass, k_rot = project(module, hidden_states, position_embeddings)
    if module.indexer is not None:  # 1. the global top-k (GLM's "shared" layers reuse the previous one's)
        cache = _Gathered(group, order, rank, seen_keys(order, world, bsz, rows))
        seg, lens = state.last[2]
        if seg < n or bool((lens < seg).any()):  # rows end to end, or CP's padding: Note [DSA rows of CP=1's length]
            picks = by_rows(module.indexer, seg, lens, mine, hidden_states, q_resid, position_embeddings, scored,
                            position_ids, cache)
        else:
            picks = index_tiles(module.indexer, hidden_states, q_resid, position_embeddings, scored, position_ids,
                                cache)  # [B, S, K] global positions (Note [The DSA indexer in query tiles])
    else:
        if prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        picks = prev_topk_indices
    valid = allowed.gather(-1, picks.long())  # [B, S, K]: inside the causal prefix
    out = attend_selected(module, state, query, k_pass, k_rot, picks.long(), valid, order)
    return (out, None, picks) if hasattr(module, "skip_topk") else (out, None)


def _order(state, world: int, n: int, bsz: int, dev) -> Tensor:
    """[B, N] (:func:`row_orders`): the batch's plan's order (layout="documents", or a named layout's plan: that
    layout's order), else the named layout's."""
    if state.plan is not None or state.layout == "documents":
        return state.plan.order.to(dev)
    return global_order(state.layout, world, n).to(dev).expand(bsz, -1)


def project(module: nn.Module, hidden_states: Tensor, position_embeddings) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The family's projections, in its order: (q_resid [B, S, q_lora_rank], query [B, H, S, Dqk], the normed
    latent [B, 1, S, R], the rotated key [B, 1, S, r])."""
    bsz, s = hidden_states.shape[:2]
    modeling = sys.modules[type(module).__module__]
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    q_states = module.q_b_proj(q_resid).view(bsz, s, -1, module.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q_states, [module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(module.kv_a_proj_with_mqa(hidden_states),
                                 [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    k_pass = module.kv_a_layernorm(kv_pass).view(bsz, 1, s, module.kv_lora_rank)
    k_rot = k_rot.view(bsz, 1, s, module.qk_rope_head_dim)
    cos, sin = position_embeddings
    q_rot, k_rot = modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
    return q_resid, torch.cat((q_pass, q_rot), dim=-1), k_pass, k_rot


def attend_selected(module: nn.Module, state, query: Tensor, k_pass: Tensor, k_rot: Tensor, picks: Tensor,
                    valid: Tensor, order: Tensor, *, compact: bool = False) -> Tensor:
    """Steps 2 and 3 of Note [DeepSeek Sparse Attention under CP]: this rank's queries [B, H, T, Dqk] over the
    keys ``picks`` [B, T, K] (int64 global columns, indices of ``order``) where ``valid``, its latents
    ``k_pass`` / ``k_rot`` [B, 1, S, R / r] at columns ``order[:, rank * S:(rank + 1) * S]`` (``order``: [N]
    or [B, N], :func:`row_orders`; S = T but in a sharded DSA turn, where the cached share comes first).
    ``compact``: expand only the table rows some valid pick reads (a turn's long cached share). The attention runs
    in query chunks of bounded size, forward and backward (Note [DSA attention in query chunks]). Returns the layer's output [B, T, hidden] (o_proj
    applied)."""
    group, rank, world = state.mesh.get_group(), state.mesh.get_local_rank(), state.mesh.size()
    bsz, s, t, dev = query.shape[0], k_pass.shape[2], query.shape[2], query.device
    order = row_orders(order, bsz).to(dev)
    n = order.shape[1]
    held = (torch.arange(bsz, device=dev)[:, None] * n + order[:, rank * s:(rank + 1) * s]).reshape(-1)  # [B*S]:
    # the global rows b * N + t this rank holds, in its latent's order
    latent = torch.cat((k_pass[:, 0], k_rot[:, 0]), dim=-1).reshape(bsz * s, -1)  # [B*S, R + r], this rank's
    rows, owners = exchange_plan(picks, valid, order, rank, world)
    take = torch.bincount(owners, minlength=world)
    give = torch.empty_like(take)
    dist.all_to_all_single(give, take, group=group)
    asked = torch.empty(int(give.sum()), dtype=torch.long, device=dev)
    dist.all_to_all_single(asked, rows, give.tolist(), take.tolist(), group=group)  # global rows others want
    where = torch.zeros(bsz * n, dtype=torch.long, device=dev)  # global row -> row of the table below
    where[held] = torch.arange(bsz * s, device=dev)
    got = _Rows.apply(latent, where[asked], give.tolist(), take.tolist(), group)  # asked: rows of this rank's latent
    table = torch.cat((latent, got))  # [T, R + r]
    where[rows] = bsz * s + torch.arange(rows.numel(), device=dev)
    slot = where[torch.arange(bsz, device=dev).view(-1, 1, 1) * n + picks]  # [B, T, K] (0 where not valid: masked)
    if compact:  # only the rows a valid pick reads (row 0 stays: the masked picks point there)
        used = torch.zeros(table.shape[0], dtype=torch.bool, device=dev)
        used[slot[valid]] = True
        used[0] = True
        table, slot = table[used], (torch.cumsum(used, 0) - 1)[slot]

    kp, kr = torch.split(table, [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    keys, values = module.expand_kv(kp[None, None], kr[None, None])  # [1, H, U, D]: the table expanded once
    keys, values = keys[0], values[0]
    out = attend_picks(query, keys, values, slot, valid, module.scaling)  # [B, T, H, Dv]: Note [DSA attention in
    # query chunks] in hf/sparse_attend.py
    return module.o_proj(out.reshape(bsz, t, -1).contiguous())


class _Restore:
    """A handle that puts a layer's own forward back (remove_context_parallel)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def enable_sparse(model: nn.Module, state, layers: list[nn.Module], derive, generating) -> None:
    """Run ``layers`` (dsa_layers(model)) as Note [DeepSeek Sparse Attention under CP] describes; ``derive``:
    hf/attention.py's derive_documents (the global positions' check); ``generating``: the layer's forward
    inside generate() (hf/sparse_generate.py's generating_forward)."""
    for m in layers:
        m.forward = partial(_forward, m, state, derive, generating)
        state.handles.append(_Restore(m))
