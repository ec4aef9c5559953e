"""The short causal conv of linear-attention layers under CP (``sharded_causal_conv1d``): each run takes
a halo of the K - 1 tokens before it in global order from one all-gather. See Note [Linear attention under
CP] (*The conv*) and Note [Prefill for decoding] in linear_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._deprecated import old_keywords
from ..agreement import Rules, agree, agree_compiled, compiled_rules
from ..compute.ordering import tie
from ..exchange.comm import all_gather_host, host_group
from ..plan.layout import LAYOUTS
from .linear_plan import _CONV_FIELDS
from .linear_runs import _ACTIVATIONS, _FLOATS, _describe, _gather, _group, _ids_error, _layout_error, _Tie
from .linear_runs import run_owner as _owner
from .linear_runs import run_starts as _run_starts

__all__ = ["sharded_causal_conv1d"]

# one all-gather of every rank's fingerprint: Note [One agreement] in agreement.py
_CONV_RULES = compiled_rules(Rules("sharded_causal_conv1d", _CONV_FIELDS, describe=_describe))


# -- the short causal conv -----------------------------------------------------------------------------


def _conv_error(x, weight, bias, activation, layout, ids) -> str | None:
    what = "sharded_causal_conv1d"
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, Tensor) or t.dtype not in _FLOATS:
            return f"{what}: {name} must be a floating tensor; got {getattr(t, 'dtype', type(t).__name__)}."
    if x.dim() != 3:
        return f"{what}: x must be [B, C, S_local] (transformers' causal_conv1d_fn layout); got {tuple(x.shape)}."
    b, c, s = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 1:
        return f"{what}: weight must be [C, K] = [{c}, K]; got {tuple(weight.shape)}."
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (c,)):
        return f"{what}: bias must be None or [C] = [{c}]; got {getattr(bias, 'shape', type(bias).__name__)}."
    if activation not in _ACTIVATIONS:
        return f"{what}: activation must be None, 'silu' or 'swish'; got {activation!r}."
    return _layout_error(what, layout, s) or _ids_error(what, ids, b, s)


def _check_conv(x, weight, bias, activation, layout, ids, group, world: int, gather=None):
    """Local checks, then the agreement: the same ValueError on every rank, or none. Compiled (Note [Compiled
    agreement of the other ops] in agreement.py): (the agreement's result, this rank's error or None); the
    result is ``gather`` of every rank ([P, ...]) when given, else a value to tie the first payload to."""
    err = _conv_error(x, weight, bias, activation, layout, ids)
    fp = [-1] * len(_CONV_FIELDS)
    if err is None:
        fp = [*x.shape, weight.shape[1], _FLOATS.index(x.dtype), _FLOATS.index(weight.dtype), int(bias is not None),
              _ACTIVATIONS.index(activation), LAYOUTS.index(layout), int(ids is not None)]
    if torch.compiler.is_compiling() and world > 1:
        return agree_compiled(_CONV_RULES, fp, err, group, gather=None if err is not None else gather), err
    agree(_CONV_RULES, fp, err, group)
    return None, None


def _id_tails(x, weight, layout, ids, rank: int, world: int):
    """[runs, B, t]: the document ids of this rank's runs' last t = min(run, K - 1) tokens (on the host), the
    halo's ids every rank gathers; None without ids, with t = 0 or inputs the checks refuse."""
    if ids is None or _conv_error(x, weight, None, None, layout, ids) is not None:
        return None
    b, _, s = x.shape
    starts = _run_starts(layout, rank, world, s)
    run_len = s // len(starts)
    t = min(run_len, weight.shape[1] - 1)
    if not t:
        return None
    ids = ids.to("cpu", torch.int64)
    return ids[:, [s0 + run_len - t + i for s0, _ in starts for i in range(t)]].view(b, len(starts), t).transpose(0, 1)


@old_keywords("cp_dtensor.sharded_causal_conv1d", group="mesh")
def sharded_causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None, *, mesh, layout: str,
    document_ids: Tensor | None = None, output_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The depthwise causal conv (then ``activation``) over the global sequence, on this rank's shard
    x [B, C, S_local]; weight [C, K]; bias [C] or None. Each run takes a halo of the K - 1 tokens before
    it in global order (zeros at the sequence start); with ``document_ids`` no tap crosses a document
    boundary. Computes in weight's dtype, returns x's (as transformers' causal_conv1d_fn). See Note
    [Linear attention under CP].

    ``output_final_state=True`` also returns the conv state decoding continues from: the sequence's last K
    inputs x [B, C, K] in x's dtype (zeros before the sequence start; raw, as transformers' cache and fla keep
    them), the same on every rank -- from the halo's all-gather, one column more per run (Note [Prefill for
    decoding])."""
    group, rank, world = _group(mesh)
    id_tails = _id_tails(x, weight, layout, document_ids, rank, world)
    ready, failed = _check_conv(x, weight, bias, activation, layout, document_ids, group, world, gather=id_tails)
    if failed is not None:  # compiled: the agreement raises at run time, on every rank (placeholders here)
        out = tie(x.new_zeros(x.shape), ready)
        return (out, x.new_zeros(*x.shape[:2], weight.shape[1])) if output_final_state else out

    b, c, s = x.shape
    kk = weight.shape[1]
    starts = _run_starts(layout, rank, world, s)
    run_len = s // len(starts)
    t = min(run_len, kk - 1)  # the halo's width
    tg = min(run_len, kk) if output_final_state else t  # the gathered tails' width
    runs = [x[..., s0:s0 + run_len] for s0, _ in starts]
    n = world * len(starts)
    order = [_owner(layout, world, j) for j in range(n)]
    if tg:  # every run's last tg tokens, in global order: [B, C, n * t] (the halo) and [B, C, n * tg]
        tails = tie(torch.stack([r[..., run_len - tg:] for r in runs]), ready)
        every = _gather(tails.flatten(), group, world).view(world, len(starts), b, c, tg)
        halo_src = torch.cat([every[r, i, ..., tg - t:] for r, i in order], -1)
    if document_ids is not None:
        ids = document_ids.to("cpu", torch.int64)
    if document_ids is not None and t:
        every_ids = (id_tails.unsqueeze(0) if world == 1 else ready if ready is not None else
                     all_gather_host(id_tails.contiguous(), host_group(group))).view(world, len(starts), b, t)
        halo_ids = torch.cat([every_ids[r, i] for r, i in order], -1)  # [B, n * t]
    w = weight
    outs = []
    for (s0, j), run in zip(starts, runs):
        lo = max(0, j * t - (kk - 1))
        halo = halo_src[..., lo:j * t] if t else run[..., :0]
        pad = kk - 1 - halo.shape[-1]  # zeros before the sequence start
        xe = F.pad(torch.cat([halo, run], -1).to(weight.dtype), (pad, 0))  # [B, C, K - 1 + L]
        if document_ids is None:
            out = F.conv1d(xe, w.unsqueeze(1), bias, groups=c)
        else:
            # tap i of output p reads xe[p + i]: kept iff that token is in p's document (never before the start)
            ide = torch.cat([torch.full((b, pad), -1, dtype=torch.int64),
                             halo_ids[:, lo:j * t] if t else ids[:, :0], ids[:, s0:s0 + run_len]], -1)
            real = torch.arange(ide.shape[1]) >= pad
            keep = [((ide[:, i:i + run_len] == ide[:, kk - 1:]) & real[i:i + run_len]).to(x.device) for i in range(kk)]
            out = sum(xe[..., i:i + run_len] * w[:, i, None] * keep[i][:, None, :].to(xe.dtype) for i in range(kk))
            if bias is not None:
                out = out + bias[:, None]
        if activation is not None:
            out = F.silu(out)
        outs.append(out.to(x.dtype))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
    if tg and world > 1 and (not t or all(j == 0 for _, j in starts)):  # the output reads no halo: see _Tie
        out = _Tie.apply(out, every)
    elif ready is not None and not tg:  # no collective to tie: the output carries the agreement
        out = tie(out.clone(), ready)
    if not output_final_state:
        return out
    # the last K inputs: the last run's tail when it holds K, else every run whole (tg = run_len)
    need = -(-kk // tg)  # ceil(K / tg) runs hold the last K inputs
    last = torch.cat([every[r, i] for r, i in order[-need:]], -1)[..., -kk:]
    return out, F.pad(last, (kk - last.shape[-1], 0))
