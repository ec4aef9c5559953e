"""Replicated queries against a sequence-sharded KV cache (inference): local partial attention, one
all-gather of the partial outputs and log-sum-exps, the stable merge on every rank.

Note [Decoding from a sharded cache]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
After a ring prefill every rank holds its share of the prompt's K/V; each decoded token's K/V are
kept by one rank only (column mod P, continuing the striped layout). The new queries are the same on
every rank (the layers run replicated on the T new tokens). So attention needs no K/V to move:

1. each rank attends its queries [B, Hq, T, Dqk] to its own keys under the mask by *global position*
   (0 <= j <= i, the window (left, right), empty slots j = -1 never) -> a partial output [B, Hq, T, Dv]
   and its log-sum-exp (-inf where the rank holds no visible key), in fp32 (fp64 for fp64 inputs);
2. one all-gather of ``[out | lse]`` (P * B * Hq * T * (Dv + 1) values; each rank sends its own
   B * Hq * T * (Dv + 1) * 4 bytes to each of the P - 1 others, independent of the cache length);
3. every rank merges the P partials in rank order by the stable log-sum-exp rule
   ``out = sum_p exp(lse_p - M) out_p / sum_p exp(lse_p - M)``, ``M = max_p lse_p``; the same inputs in
   the same order give bit-identical outputs on every rank, so replicated sampling / EOS decisions stay
   in step. Sinks join the merged softmax once: ``out * sigmoid(lse - sink)``.

A query that sees no key on any rank is decided from the merged lse, which every rank holds alike: every
rank raises (without sinks; with sinks its output is 0, as sinks define). Arguments are checked before
the gather by the agreement of Note [One agreement] in agreement.py: a bad call raises on every rank
instead of leaving one waiting.
"""

from __future__ import annotations

import math
import struct

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .._deprecated import old_keywords
from .agreement import Rules, agree, agree_compiled, compiled_rules, digest
from .compute.ordering import tie
from .exchange.comm import all_gather, wait

__all__ = ["sharded_cache_attention"]

_NAME = "sharded_cache_attention"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FIELDS = ("batch", "q_heads", "kv_heads", "new_tokens", "head_dim", "value_head_dim", "dtype", "scale",
           "window_left", "window_right", "sinks", "q_values", "q_positions")
_CHUNK = 1 << 24  # score elements per local chunk of keys (64 MiB in fp32)


def local_error(q, k, v, q_positions, k_positions, scale, window_size, sinks) -> str | None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            return f"{_NAME}: {name} must be a Tensor; got {type(x).__name__}."
        if type(x) is not Tensor and x.__class__.__name__ == "DTensor":
            return f"{_NAME}: {name} is a DTensor; pass this rank's local tensor (.to_local())."
        if x.dim() != 4:
            return f"{_NAME}: {name} must be 4-D [B, H, S, D]; got shape {tuple(x.shape)}."
        if x.dtype not in _DTYPES:
            return f"{_NAME}: {name} has dtype {x.dtype}; supported: float32, bfloat16, float16, float64. Cast it."
    if not (q.dtype == k.dtype == v.dtype):
        return f"{_NAME}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}."
    if not (q.device == k.device == v.device):
        return f"{_NAME}: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}."
    (b, hq, t, d), (bk, hkv, s, dk) = q.shape, k.shape
    if k.shape[:3] != v.shape[:3]:
        return (f"{_NAME}: k [B, Hkv, S_r, Dqk] and v [B, Hkv, S_r, Dv] must agree on B, Hkv and S_r; got "
                f"{tuple(k.shape)} and {tuple(v.shape)}.")
    if bk != b or dk != d:
        return (f"{_NAME}: q [B, Hq, T, Dqk] and k [B, Hkv, S_r, Dqk] must agree on B and Dqk; got q {tuple(q.shape)}, "
                f"k {tuple(k.shape)}.")
    if hkv == 0 or hq % hkv != 0:
        return f"{_NAME}: q heads ({hq}) must be a multiple of k/v heads ({hkv}) (GQA/MQA)."
    if b == 0 or t == 0 or d == 0 or v.shape[-1] == 0:
        return f"{_NAME}: empty queries, q {tuple(q.shape)}, v {tuple(v.shape)}; pass at least one new token."
    for name, pos, n in (("q_positions", q_positions, t), ("k_positions", k_positions, s)):
        if not isinstance(pos, Tensor) or pos.dtype != torch.int64 or tuple(pos.shape) != (b, n):
            got = f"{pos.dtype} {tuple(pos.shape)}" if isinstance(pos, Tensor) else type(pos).__name__
            return f"{_NAME}: {name} must be an int64 tensor [B, {'T' if n == t else 'S_r'}] = [{b}, {n}]; got {got}."
        if pos.device not in (q.device, torch.device("cpu")):
            return f"{_NAME}: {name} must be on q's device {q.device} or the CPU; got {pos.device}."
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and scale > 0):
        return f"{_NAME}: scale must be a positive finite number or None; got {scale!r}."
    if window_size is not None:
        ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2
        if not ok or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size):
            return (f"{_NAME}: window_size must be None or (left, right), each -1 (unbounded) or >= 0 "
                    f"(flash-attn's convention, as in ring_attention); got {window_size!r}.")
    if sinks is not None:
        if not isinstance(sinks, Tensor) or tuple(sinks.shape) != (hq,):
            got = tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__
            return f"{_NAME}: sinks must be a [Hq] = [{hq}] tensor of per-head logits; got {got}."
        if sinks.dtype not in (torch.float32, q.dtype) or sinks.device != q.device:
            return f"{_NAME}: sinks must be float32 or q's dtype on q's device; got {sinks.dtype} on {sinks.device}."
    if torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in (q, k, v, sinks)):
        return (f"{_NAME} is forward only (inference); an input requires grad. Call it under torch.no_grad() "
                "or torch.inference_mode(), or .detach() the inputs.")
    return None


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _fingerprint(q, k, v, q_positions, scale, window_size, sinks, ok: bool, *, values: bool = True) -> list[int]:
    """The agreement's ints; ``values=False``: without the last three (the digests of sinks, q and
    q_positions), which the compiled agreement reads at run time."""
    def dim(x, i):
        return int(x.shape[i]) if isinstance(x, Tensor) and x.dim() == 4 else -1

    window = tuple(window_size) if ok and window_size is not None else (-2, -2)
    return [
        dim(q, 0), dim(q, 1), dim(k, 1), dim(q, 2), dim(q, 3), dim(v, 3),
        _DTYPES.index(q.dtype) if isinstance(q, Tensor) and q.dtype in _DTYPES else -1,
        _bits(scale) if isinstance(scale, (int, float)) else -1, int(window[0]), int(window[1]),
    ] + ([digest(sinks) if ok else -3, digest(q) if ok else -3, digest(q_positions) if ok else -3]
         if values or not ok else [])


# Note [One agreement] (agreement.py) for this op, by digest: one int64 a rank over the group's host (gloo)
# twin, so the check adds 8 * (P - 1) bytes to the call's wire; the fields travel only when ranks differ
_RULES = compiled_rules(Rules(
    _NAME, _FIELDS, digest=True,
    advice="The new tokens' q and q_positions and every option must be replicated; only k, v, k_positions are this "
           "rank's share (sinks, q and positions are compared exactly where they live on the CPU).",
))


def _partial(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float, window, dtype,
             select: Tensor | None = None):
    """This rank's attention and its lse over its own keys, masked by global position (and ``select`` [B, T, S_r],
    where given: the keys each query may see at all, a sparse selection).
    q: [B, Hq, T, D]; k: [B, Hkv, S_r, D]; v: [B, Hkv, S_r, Dv] -> out [B, Hq, T, Dv], lse [B, Hq, T] (-inf:
    no visible key here)."""
    b, hq, t, _ = q.shape
    hkv, s, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    # GQA without expanding K/V: query head h = kv * g + i reads kv head h // g (repeat_interleave's order)
    qg = q.to(dtype).reshape(b, hkv, g * t, q.shape[-1])  # [B, Hkv, G*T, D]
    if s == 0:
        return q.new_zeros(b, hq, t, dv, dtype=dtype), q.new_full((b, hq, t), float("-inf"), dtype=dtype)
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]  # [B, T, 1], [B, 1, S_r]
    keep = (kp >= 0) & (kp <= qp)  # causal by global position; -1 slots never
    if window is not None:
        left, right = window
        if left >= 0:
            keep &= kp >= qp - left
        if right >= 0:
            keep &= kp <= qp + right
    if select is not None:
        keep = keep & select.to(keep.device)
    step = max(1, _CHUNK // max(1, b * hq * t))
    outs, lses = [], []
    for j in range(0, s, step):  # chunks of keys, merged below like ranks
        kc, vc = k[:, :, j:j + step].to(dtype), v[:, :, j:j + step].to(dtype)
        scores = (qg @ kc.transpose(-1, -2)).mul_(scale).view(b, hkv, g, t, -1)  # [B, Hkv, G, T, S_c]
        scores.masked_fill_(~keep[:, None, None, :, j:j + step], float("-inf"))
        m = scores.amax(-1)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows with no key: exp(-inf - 0) = 0
        p = torch.exp(scores.sub_(m[..., None]))
        den = p.sum(-1)  # [B, Hkv, G, T]
        out = (p.view(b, hkv, g * t, -1) @ vc).view(b, hkv, g, t, dv)
        out = out / torch.where(den > 0, den, torch.ones_like(den))[..., None]
        outs.append(out.reshape(b, hq, t, dv))
        lses.append((m + torch.log(den)).reshape(b, hq, t))
    if len(outs) == 1:
        return outs[0], lses[0]
    return _merge(torch.stack(outs), torch.stack(lses))


def _merge(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """The stable log-sum-exp merge of stacked partials, in order. outs: [P, B, Hq, T, Dv]; lses: [P, B, Hq, T]."""
    m = lses.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m)  # [P, B, Hq, T]; 0 for a partial with no key
    den = w.sum(0)
    out = (w[..., None] * outs).sum(0) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
    return out, m + torch.log(den)


@old_keywords("cp_dtensor.sharded_cache_attention", group="mesh")
def sharded_cache_attention(
    q: Tensor, k: Tensor, v: Tensor, *, q_positions: Tensor, k_positions: Tensor,
    mesh: DeviceMesh | dist.ProcessGroup | None = None, scale: float | None = None,
    window_size: tuple[int, int] | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """Attention of replicated new queries to a KV cache sharded over ``mesh`` (the CP group: a 1-D
    DeviceMesh or a ProcessGroup; default: the world) by sequence position.

    q: [B, Hq, T, Dqk], the same on every rank, at global positions ``q_positions`` int64 [B, T];
    k: [B, Hkv, S_r, Dqk], v: [B, Hkv, S_r, Dv]: this rank's share of the cache, at ``k_positions`` int64
    [B, S_r] (-1: an empty slot, never attended; S_r may differ between ranks and be 0). A query at i
    sees the keys at 0 <= j <= i, within ``window_size`` (left, right) (-1 unbounded, as
    ``ring_attention``); ``sinks`` [Hq] join its softmax. Returns [B, Hq, T, Dv] in q's dtype, the same
    (bit-identical) on every rank: one all-gather of B * Hq * T * (Dv + 1) fp32 values per rank. Forward
    only. See Note [Decoding from a sharded cache].
    """
    group = mesh.get_group() if isinstance(mesh, DeviceMesh) else mesh
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    world = dist.get_world_size(group) if group is not None else 1
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"{_NAME} was called on a rank outside its CP group (global rank {dist.get_rank()}); "
                         "call it on the group's ranks only, or pass their group.")
    err = local_error(q, k, v, q_positions, k_positions, scale, window_size, sinks)
    ready = None
    if torch.compiler.is_compiling() and world > 1:  # Note [Compiled agreement of the other ops] in agreement.py
        fp = _fingerprint(q, k, v, q_positions, scale, window_size, sinks, err is None, values=False)
        values = [] if err is not None else [q_positions] if sinks is None else [sinks, q, q_positions]
        if err is None and sinks is None:
            fp.append(-1)  # digest(None): the sinks' field
            values.insert(0, q)
        ready = agree_compiled(_RULES, fp, err, group, values=values)
        if err is not None:  # the op raises at run time, on every rank: a placeholder here
            if not all(isinstance(x, Tensor) and x.dim() == 4 for x in (q, v)):
                raise ValueError(err)
            return tie(q.new_zeros(*q.shape[:3], v.shape[3]), ready)
    else:
        fp = _fingerprint(q, k, v, q_positions, scale, window_size, sinks, err is None) if world > 1 else []
        agree(_RULES, fp, err, group)
    return attend(q, k, v, q_positions=q_positions, k_positions=k_positions, group=group, world=world, scale=scale,
                  window_size=window_size, sinks=sinks, ready=ready)


def attend(q, k, v, *, q_positions, k_positions, group, world: int, scale, window_size, sinks,
           padding: Tensor | None = None, ready: Tensor | None = None, select: Tensor | None = None) -> Tensor:
    """:func:`sharded_cache_attention` after its checks: for callers whose replicated inputs agree by
    construction (generate() under CP, where every rank computes the new tokens' q alike). ``padding`` [B, T]
    bool: queries of padding columns, which may see no key (their output is then 0) instead of raising;
    ``select`` [B, T, S_r] bool: the keys each query may see beyond the positions' rule (a sparse selection);
    ``ready``: the compiled agreement's result, which the all-gather's payload waits for."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    b, hq, t, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    with torch.no_grad():
        out, lse = _partial(q, k, v, q_positions.to(q.device), k_positions.to(q.device), scale,
                            None if window_size is None else tuple(window_size), dtype, select)
        if world > 1:
            mine = tie(torch.cat([out, lse[..., None]], -1).reshape(-1), ready)  # [B*Hq*T*(Dv+1)]: [out | lse]
            every = wait(all_gather(mine, group), group).view(world, b, hq, t, dv + 1)
            out, lse = _merge(every[..., :dv], every[..., dv])
        return _finish(q, out, lse, q_positions, window_size, sinks, padding, dtype)


def attend_blocks(q: Tensor, blocks, *, q_positions: Tensor, scale, window_size, sinks,
                  padding: Tensor | None = None) -> Tensor:
    """q [B, Hq, T, Dqk] against K/V blocks that arrive one at a time -- ``blocks`` yields (k [B, Hkv, S_i, Dqk],
    v [B, Hkv, S_i, Dv], k_positions [B, S_i]), e.g. from a ring -- each attended by global position as in
    :func:`attend`, the partials merged by the stable log-sum-exp rule in the order they came. No
    communication of its own. Returns [B, Hq, T, Dv] in q's dtype."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    window = None if window_size is None else tuple(window_size)
    outs, lses = [], []
    with torch.no_grad():
        for k, v, k_positions in blocks:
            out, lse = _partial(q, k, v, q_positions.to(q.device), k_positions.to(q.device), scale, window, dtype)
            outs.append(out)
            lses.append(lse)
        out, lse = _merge(torch.stack(outs), torch.stack(lses))
        return _finish(q, out, lse, q_positions, window_size, sinks, padding, dtype)


def _finish(q, out, lse, q_positions, window_size, sinks, padding, dtype) -> Tensor:
    """The merged output: a query that sees no key raises (unless padding); sinks join once."""
    if sinks is None:
        blind = torch.isinf(lse[:, 0])  # [B, T]; the masks do not depend on the head
        if padding is not None:
            blind &= ~padding.to(blind.device)
        if torch.compiler.is_compiling():  # See Note [Compiled agreement of the other ops]: the check is an op
            out = seen_or_raise(out, blind, q_positions, str(window_size))
        else:
            _raise_blind(blind, q_positions, window_size)
    else:  # sinks join the softmax once: out * sigmoid(lse - sink)
        out = out * torch.sigmoid(lse - sinks.to(dtype)[None, :, None])[..., None]
    return out.to(q.dtype)


def _raise_blind(blind: Tensor, q_positions: Tensor, window_size) -> None:
    if bool(blind.any()):  # every rank holds the same merged lse: every rank raises
        row, col = torch.nonzero(blind)[0].tolist()
        raise ValueError(
            f"{_NAME}: the query at q_positions[{row}, {col}] = {int(q_positions[row, col])} sees no key on "
            f"any rank (causal 0 <= j <= i, window {window_size}, empty slots -1). Give it a key (its own "
            "K/V in the cache) or pass sinks."
        )


@torch.library.custom_op("cp_dtensor::seen_or_raise", mutates_args=())
def seen_or_raise(out: Tensor, blind: Tensor, q_positions: Tensor, window: str) -> Tensor:
    """``out`` (a copy) once no query is ``blind`` (sees no key on any rank); else the ValueError, on every
    rank alike (every rank holds the same merged lse). A compiled graph's check: Note [Compiled agreement of
    the other ops] in agreement.py."""
    _raise_blind(blind, q_positions, window)
    return out.clone()


@seen_or_raise.register_fake
def _(out, blind, q_positions, window):
    return torch.empty_like(out)
