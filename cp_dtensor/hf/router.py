"""The MoE router's load-balancing loss under CP (``output_router_logits=True``), from the global means.

Note [Router loss under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' MoE causal LMs (Mixtral, Qwen3-MoE, gpt-oss, Qwen2-MoE, MiniMax-M2, ERNIE 4.5 MoE:
``ROUTER_LOSS``) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, E, k, attention_mask)`` to the loss: over
every layer's router logits, ``f_e`` the share of top-k assignments that went to expert e and ``p_e`` the
mean router probability of e, both means over the (unpadded) tokens, and the loss ``E * sum_e f_e p_e``.
A product of two means is not a sum over tokens: a rank's loss over its shard, summed over the ranks, is
not the sequence's. But both means are sums over tokens divided by a count, so each rank computes its
shard's three sums -- the top-k counts per expert [E], the probabilities per expert [E] (the padding
mask's rules: with a 2-D ``attention_mask`` only its 1 tokens count; without one, every row), and the
number of rows -- exactly as transformers does (the Trainer's own padding to a multiple of the layout's unit
left out: ``HFState.real``), and one all-reduce (sum) over the CP group of the
[2E + 1] buffer gives every rank the sequence's sums, from which the loss is CP=1's formula.

The ranks' losses are their shares of the replica's loss (they sum to CP=1's: Note [compute_loss under
CP] in trainer.py), so each rank returns ``loss / P``: the ranks' ``aux_loss`` too sum to CP=1's. The
all-reduce is differentiable (:class:`_AllReduce`: backward, the all-reduce of the gradient), so rank r's
share ``L(X) / P`` of the summed ``X`` hands its probabilities ``sum_r' L'(X) / P = L'(X)``: the gradient
of the sequence's loss, which the ranks' parameter gradients then sum as every other term's.

``enable_router_loss`` swaps the family module's ``load_balancing_loss_func`` for a dispatcher (once a
process) that passes every call through unless a CP model's forward is running (a context variable the
top-level model's hooks set and reset): a model without CP, in the same process, is unaffected -- the
pattern of hf/linear.py's dispatchers. Every rank of the CP group runs the same forward, so the
all-reduce is issued alike on every rank (the router logits' shapes follow the shards', equal by the
attention's agreement that ran before).

A served family outside ``ROUTER_LOSS`` whose modeling module has a ``load_balancing_loss_func`` would
compute it over each rank's shard, silently off: a call with ``output_router_logits`` on (the call's
keyword, else the config's) is refused at the top-level call (``router_loss_error``: raised by the first
attention call on every rank, before the ring), except under generate(), which drops the router loss. A
family joins ``ROUTER_LOSS`` when its causal LM calls the same function with the same arguments and a test
shows its Trainer losses equal CP=1's.
"""

from __future__ import annotations

import contextvars
import importlib

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.exchange.comm import all_reduce_sum
from .state import ATTR, HFState

__all__ = ["ROUTER_LOSS", "enable_router_loss", "router_loss_error", "router_loss_home"]

#: model_type: the transformers module whose ``load_balancing_loss_func`` the causal LM's forward calls
ROUTER_LOSS = {
    "ernie4_5_moe": "transformers.models.ernie4_5_moe.modeling_ernie4_5_moe",
    "minimax_m2": "transformers.models.minimax_m2.modeling_minimax_m2",
    "mixtral": "transformers.models.mixtral.modeling_mixtral",
    "qwen2_moe": "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "qwen3_moe": "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "gpt_oss": "transformers.models.gpt_oss.modeling_gpt_oss",
}
_NAME = "load_balancing_loss_func"
_RUNNING: contextvars.ContextVar[HFState | None] = contextvars.ContextVar("cp_dtensor_router", default=None)


def router_loss_home(model: nn.Module):
    """The module whose router loss ``model``'s forward calls (None: not an MoE family served here)."""
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    path = ROUTER_LOSS.get(getattr(text, "model_type", None))
    return None if path is None else importlib.import_module(path)


def router_loss_error(model: nn.Module, requested) -> str | None:
    """Why ``model``'s router loss cannot be served under CP (None: it can, or it is off). ``requested``: the
    call's ``output_router_logits`` (None: the config's). A served family whose modeling module has a
    ``load_balancing_loss_func`` but no entry in ROUTER_LOSS would compute it over each rank's shard:
    refused, as the door refuses what it has not proven (Note [Router loss under CP])."""
    text = getattr(model.config, "get_text_config", lambda: model.config)()
    if not (getattr(text, "output_router_logits", False) if requested is None else requested):
        return None
    kind = getattr(text, "model_type", None)
    homes = {c.__module__ for c in type(model).__mro__ if c.__module__.startswith("transformers.models.")}
    if kind in ROUTER_LOSS or not any(hasattr(importlib.import_module(m), _NAME) for m in homes):
        return None
    return (f"{type(model).__name__}'s router load-balancing loss (output_router_logits=True) is a product of "
            f"means over the whole sequence, which context parallelism computes from the global sums for "
            f"{', '.join(sorted(ROUTER_LOSS))} only; model_type {kind!r} is not one of them. Set "
            "config.output_router_logits = False (and pass no output_router_logits=True), or run it without CP.")


class _AllReduce(torch.autograd.Function):
    """Sum over the CP group, differentiable: backward is the sum of every rank's gradient (each rank's
    copy of the sum feeds that rank's loss). See Note [Router loss under CP]."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return all_reduce_sum(grad.contiguous(), ctx.group), None


def _sums(gate_logits: tuple, num_experts: int, top_k: int, attention_mask: Tensor | None) -> Tensor:
    """This rank's [2E + 1] float32: top-k counts per expert, probabilities per expert, rows -- transformers'
    ``load_balancing_loss_func`` before its division, with its padding-mask rules."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in gate_logits:  # [B * S_local, E]
        weights = torch.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        ones = torch.ones(chosen.numel(), dtype=torch.float32, device=device) if mask is None else \
            mask.repeat_interleave(top_k)
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), ones)
        probs = probs + (weights.float() if mask is None else weights.float() * mask[:, None]).sum(0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    return torch.cat([counts, probs, rows])


def _mask(attention_mask: Tensor | None, real: Tensor | None, rows: int) -> Tensor | None:
    """The tokens the sums count: the model's 2-D padding mask (transformers' rule), and of those only the
    user's (``real``: the Trainer's CP padding left out, so the counts are CP=1's). [B, S_local] or None."""
    if real is None or real.numel() == 0 or rows % real.shape[-1]:
        return attention_mask
    real = real.reshape(-1, real.shape[-1]).expand(rows // real.shape[-1], -1)
    if attention_mask is None:
        return real
    return attention_mask.to(real.device).bool() & real.to(attention_mask.device)


def _dispatcher(original):
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        state = _RUNNING.get()
        if state is None or not isinstance(gate_logits, tuple) or not gate_logits:
            return original(gate_logits, num_experts, top_k, attention_mask)
        group, world = state.mesh.get_group(), state.mesh.size()
        mask = _mask(attention_mask, state.real, gate_logits[0].shape[0])
        total = _AllReduce.apply(_sums(gate_logits, num_experts, top_k, mask), group)
        counts, probs, rows = total[:num_experts], total[num_experts:-1], total[-1]
        return (counts / rows * (probs / rows)).sum() * num_experts / world  # this rank's share

    load_balancing_loss_func._cp_dtensor_original = original
    return load_balancing_loss_func


def _starts(model: nn.Module, args):
    model._cp_dtensor_router_token = _RUNNING.set(getattr(model, ATTR))


def _ends(model: nn.Module, args, output):
    token = getattr(model, "_cp_dtensor_router_token", None)
    if token is not None:
        model._cp_dtensor_router_token = None
        _RUNNING.reset(token)
    return output


def enable_router_loss(model: nn.Module, state: HFState) -> None:
    """Serve ``model``'s router loss under CP when it is an MoE family of ``ROUTER_LOSS`` (the hooks' handles
    go to ``state``): Note [Router loss under CP]."""
    home = router_loss_home(model)
    if home is None:
        return
    current = getattr(home, _NAME)
    if getattr(current, "_cp_dtensor_original", None) is None:
        setattr(home, _NAME, _dispatcher(current))
    model._cp_dtensor_router_token = None
    state.handles += [model.register_forward_pre_hook(_starts),
                      model.register_forward_hook(_ends, always_call=True)]
