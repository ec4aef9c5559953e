"""Linear attention under CP: the gated delta rule (Gated DeltaNet, Kimi Delta Attention) and its short
causal conv on sequence shards, exact, by passing affine state summaries between ranks.

The attention kernel itself is the caller's (transformers' torch kernels, or fla's on CUDA); this
module cuts each rank's tokens into its contiguous runs, calls the kernel on each, all-gathers one
small affine summary per run and folds them in global order. See Note [Linear attention under CP].
This module holds the delta rule and the Notes; the conv is linear_conv.py, the runs, the checks and the
differentiable all-gather both share are linear_runs.py, the torch-free byte formulas linear_plan.py, the
decode steps linear_steps.py (all re-exported here, their old home).

Note [Linear attention under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
*The math.* The gated delta rule keeps per (batch row, value head) a state S [dk, dv]; per token t
    S_t = A_t S_{t-1} + B_t,   A_t = (I - beta_t k_t k_t^T) diag(gate_t),   B_t = beta_t k_t v_t^T,
    o_t = S_t^T q_t (q scaled by dk^-1/2, q and k l2-normalised when asked),
with gate_t = exp(g_t), a scalar per head (GDN, g [B, S, Hv]) or per key channel (KDA, g [B, S, Hv, dk]).
So a contiguous run of tokens is one affine map S_out = A S_in + B (A = A_last ... A_first [dk, dk],
B [dk, dv]), and the output inside the run is affine in the entry state too:
    o_t = o0_t + u_t @ S_in,   u_t = q_t^T A_{<=t}   ([dk] per token; o0_t: the output from a zero state).

*One kernel call per run, no second pass.* The kernel is linear in (v, initial_state) jointly (both of
transformers' torch kernels and fla's are: the state and every output are sums of products in which v
or the initial state appears exactly once). Run it on the widened value v' = [v, 0_dk] (width dv + dk)
from the initial state [0_{dk x dv} | I_dk]: the identity block evolves as S^I_t = A_{<=t}, so the
final state is [B | A] and the output is [o0 | u]. The scale stays the kernel's default dk^-1/2 (fla
and transformers derive it from q's width, not v's).

*Across ranks.* Each rank summarizes each of its runs as (A, B) in fp32 (float64 for float64 inputs),
one all-gather gives every rank every run's summary, and each rank folds those preceding its runs in
global order (S = 0; S = A_j S + B_j) to get each run's entry state; then o = o0 + u @ S_entry. The
all-gather is differentiable (``_AllGather``: all-gather forward, reduce-scatter of the gradient
backward), so autograd carries each entry state's gradient back to the predecessors' summaries and
through their kernels: forward and backward are exact, with no hand-written backward.

*Layouts.* ``contiguous``: one run per rank (global run r). ``headtail``: two runs, global runs r and
2P-1-r of 2P -- the layout of the hybrid's softmax-attention layers, so the model needs no relayout.
``striped`` is refused (``check_linear_layout``): its runs are single tokens, and a [dk, dk + dv]
summary per token is larger than the token itself. The first global run starts from a zero state: it
is run without the identity block (A = 0), so rank 0 does no extra work for it.

*Documents* (``document_ids``): the state restarts wherever the id differs from the previous token's
(the first token of the sequence starts one too). A run's first segment (up to its first internal
boundary) is connected to the entry state unless the run itself starts a document; later segments
start from zero. A run with any boundary has A = 0 (its end state does not depend on its entry), B =
the end state of its last segment. Exactness first: a run that holds a boundary in any batch row is
computed per row and per segment (one kernel call each; only the first segment widened), so many
short documents cost many small calls -- fla's ``cu_seqlens`` could batch them into one (not done).
A run without internal boundaries is one batched call even with documents. The ids are read on the
host (a device sync on CUDA), and only each run's last id travels (the entry test).

*Bytes.* The summaries travel in fp32: each rank sends (P - 1) * runs * B * Hv * dk * (dk + dv) * 4
bytes per layer forward (``linear_state_bytes``; runs = 1 contiguous, 2 headtail) and the same again
backward (the reduce-scatter of their gradients) -- independent of the sequence length. A head-parallel
scheme moves q, k, v, g, beta and o: O(S_local) per rank. At Qwen3-Next's shape (Hv 32, dk = dv = 128,
B 1) a run's summary is 4 MiB: headtail sends 8 MiB per layer at P = 2 against the all-to-alls' 48 MiB
in bf16 at N = 8k (193 MiB at 32k); only at P = 8 and N = 8k does it send more (56 against 21 MiB;
scripts/benchmarks/bench_linear_attention.py prints the table). Plus the agreement (``check_bytes``) and, with
documents, one int64 per run and batch row.

*Precision.* The kernel returns u in its output dtype (q's): for bf16 inputs u is rounded to bf16
before the fp32 product with the entry state, an error of the order of the output's own rounding.

*Cost.* The widened value adds dk columns to the kernel's value side, and u [B, S, Hv, dk] is kept for
the backward; the fold is P small [dk, dk] @ [dk, dv] products per run. An all-gather rather than a
sequential scan: one collective, every rank folds locally.

*The conv* (``sharded_causal_conv1d``): each run takes a halo of the K - 1 tokens preceding it in global
order (zeros before the sequence start) from one all-gather of every run's last min(L, K - 1) tokens
(``conv_halo_bytes``), differentiable like the summaries; with documents, taps whose token belongs to
another document than the output's are dropped (the halo and the run alike), which is the conv of each
document on its own, zero-padded.

*Agreement.* Bad input (striped, shapes, dtypes, ranks disagreeing on shapes, layout, kernel or options,
document ids of the wrong shape) raises the same ``ValueError`` on every rank before any summary moves:
one all-gather of a small int64 fingerprint over the CP group's host twin, then every rank decides alike
(Note [One agreement] in agreement.py).

*torch.compile* (not fullgraph): the checks and the agreement run eagerly (``torch.compiler.disable``:
one graph break per call); the kernels, the differentiable all-gather and the fold are traced
(tests/core/test_linear_attention.py, exhaustive tier: CP_DTENSOR_SLOW=all). Documents read host values: more breaks (not tested compiled).

Note [Prefill for decoding]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Decoding continues a linear layer from two fixed-size summaries of the whole prompt: its recurrent state S
[B, Hv, dk, dv] after the last token, and its conv state, the last K inputs of the conv [B, C, K] (K - 1 of
them feed the next token's taps; the K-th is kept because transformers' cache and fla keep K). Under CP no
rank holds the prompt, but both come out of what the prefill already moves, with no extra collective:

* ``sharded_delta_rule(..., output_final_state=True)``: every rank holds every run's summary (A_j, B_j)
  after the one all-gather, so every rank folds *all* of them in global order (S = A_j S + B_j; 2P small
  products for headtail) instead of stopping at its own runs. The fold reads the same gathered bits in the
  same order on every rank: S is bit-identical across ranks. Per row, documents are respected as in the
  outputs: a run holding a document start has A = 0, so the final state is that of the last document
  alone (a left-padded row: each pad token is a document of its own, the prompt's tokens one).
* ``sharded_causal_conv1d(..., output_final_state=True)``: the halo's all-gather carries each run's last
  min(L, K) tokens instead of min(L, K - 1) (one column more per run, ``conv_halo_bytes(final_state=True)``),
  and every rank cuts the sequence's last K inputs from them (zeros before its start, raw: as transformers
  and fla keep them, whatever the documents).

For the state to be the prompt's, the prompt's last token must be the sequence's last: a caller that pads
the sequence to the layout's unit pads on the *left* (masked; each pad a document of its own), as
transformers' generate() under CP does (Note [generate() under CP] in hf/generate.py).

Decoding then needs no communication for these layers: the new tokens are the same on every rank, so
every rank steps the full state alike (:func:`delta_rule_step`, :func:`causal_conv1d_step`, or the model's
own kernels, e.g. fla's ``fused_recurrent``) and gets the same bits. The alternative -- one rank steps and
broadcasts the layer's output -- puts the step *and* a broadcast on every token's critical path (the other
ranks wait for both), to save only the other ranks' copy of a step of O(B * Hv * dk * dv) work and the
state's memory, which is fixed (Qwen3-Next: 2 MiB fp32 per layer and row, against the attention layers'
shares that grow with the context). scripts/benchmarks/bench_hybrid_generate.py measures both sides: a linear
layer's replicated step and one gloo broadcast of its output and of its state; the replicated step sends 0
bytes, and the full-attention layers alone send their (P - 1) * B * Hq * T * (Dv + 1) * 4 bytes per token
(Note [Decoding from a sharded cache] in decode.py).

*fla's kernels* (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, ``fla.ops.kda.chunk_kda``) take
[B, T, H, D], ``initial_state`` [B, H, dk, dv] and return the final state in fp32: the identity initial
state is built fp32 and contiguous, every input is made contiguous, and no ``chunk_size`` is added (pass
kernel options through ``**kernel_kwargs``; fla's ``scale`` passes through unchanged). The op owns
``initial_state``, ``output_final_state`` (its own keyword: Note [Prefill for decoding]) and ``cu_seqlens``
(documents go through ``document_ids``).

Note [fp32 precision with the checkpoints' decays]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With the decay init of the released checkpoints (transformers' default: A = exp(A_log) up to 16, so
decays g up to ~20 per token) the fp32 torch chunk kernel keeps only ~3-4 digits of the gradients of
A_log and dt_bias, at CP=1 itself: they are differences of large terms (exp(cum_i - cum_j) from
cumulative sums ~1e3 inside a 64-token chunk). Measured against the same model in float64
(scripts/benchmarks/hybrid_precision.py; two float64 kernels agree to 1e-10): CP=1 is off by rel 5e-3 (dt_bias) /
2e-3 (A_log) at N = 48, CP=2 headtail by 1.5e-3 / 6e-4 -- its runs are shorter chunks, so less
cancellation; at N = 256 (the same 64-token chunks) both by 5e-3, and CP differs from CP=1 by 3e-4.

So under CP the sums are rounded differently, not less accurately: this module's summaries and fold
reorder CP=1's sums without making them larger, and against float64 CP's error is 0.2 to 1.6 times
CP=1's on every tensor (P = 2 and 3, headtail and contiguous); the logits stay within 4.4e-7 of float64
either way. Hence the tests: with decays drawn from [0.05, 1] CP=1 is a reference to 1e-4; with the
checkpoints' init (tests/hf/test_hf_linear.py, ``_check_default_init``) the reference is float64 and the
bound is CP's error <= 4 x max(CP=1's error, 1e-5) relative to the largest magnitude -- 4 catches an
error an order of magnitude worse than the measured ratio (<= 1.42 at P = 2, 1.61 at P = 3), and 1e-5
is above fp32's rounding of the tensors without the cancellation (measured <= 4e-6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._deprecated import old_keywords
from ..agreement import Rules, agree, agree_compiled, compiled_rules
from ..compute.ordering import tie
from ..plan.layout import LAYOUTS
from .linear_conv import sharded_causal_conv1d  # noqa: F401 -- re-exported: its old home
from .linear_plan import (  # noqa: F401 -- re-exported: their old home
    _CONV_FIELDS,
    _DELTA_FIELDS,
    LINEAR_LAYOUTS,
    _runs,
    check_bytes,
    check_linear_layout,
    conv_halo_bytes,
    linear_state_bytes,
)
from .linear_runs import (  # noqa: F401 -- run_starts / run_owner re-exported: their old home
    _FLOATS,
    _crc,
    _describe,
    _gather,
    _gather_last_ids,
    _group,
    _ids_error,
    _layout_error,
    _Tie,
    run_owner,
    run_starts,
)
from .linear_steps import causal_conv1d_step, delta_rule_step  # noqa: F401 -- re-exported: their old home

__all__ = [
    "LINEAR_LAYOUTS", "causal_conv1d_step", "check_bytes", "check_linear_layout", "conv_halo_bytes", "delta_rule_step",
    "linear_state_bytes", "run_owner", "run_starts", "sharded_causal_conv1d", "sharded_delta_rule",
]

_OWNED = ("initial_state", "output_final_state", "cu_seqlens")
_run_starts, _owner = run_starts, run_owner  # this module's own short names

# one all-gather of every rank's fingerprint, the same ValueError on every rank when any rank's local checks
# failed or the ranks differ: Note [One agreement] in agreement.py (run eagerly, between the compiled parts)
_DELTA_RULES = compiled_rules(Rules("sharded_delta_rule", _DELTA_FIELDS, describe=_describe))


def _delta_error(kernel, q, k, v, g, beta, layout, ids, kernel_kwargs) -> str | None:
    what = "sharded_delta_rule"
    if not callable(kernel):
        return f"{what}: kernel must be callable (e.g. torch_chunk_gated_delta_rule); got {type(kernel).__name__}."
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, Tensor):
            return f"{what}: {name} must be a Tensor; got {type(x).__name__}."
        if type(x) is not Tensor and x.__class__.__name__ == "DTensor":
            return f"{what} takes this rank's local shards; {name} is a DTensor. Pass .to_local()."
        if x.dtype not in _FLOATS:
            return f"{what}: {name} has dtype {x.dtype}; supported: float32, bfloat16, float16, float64."
    if q.dim() != 4 or k.shape != q.shape:
        return f"{what}: q and k must be [B, S_local, Hk, dk] alike; got {tuple(q.shape)} and {tuple(k.shape)}."
    b, s, hk, dk = q.shape
    if v.dim() != 4 or tuple(v.shape[:2]) != (b, s) or v.shape[2] % hk:
        return f"{what}: v must be [B, S_local, Hv, dv] = [{b}, {s}, a multiple of Hk={hk}, dv]; got {tuple(v.shape)}."
    hv = v.shape[2]
    if tuple(g.shape) not in ((b, s, hv), (b, s, hv, dk)):
        return f"{what}: g must be [B, S_local, Hv] (GDN) or [B, S_local, Hv, dk] (KDA) = [{b}, {s}, {hv}(, {dk})]; got {tuple(g.shape)}."
    if tuple(beta.shape) != (b, s, hv):
        return f"{what}: beta must be [B, S_local, Hv] = [{b}, {s}, {hv}]; got {tuple(beta.shape)}."
    if not (q.dtype == k.dtype == v.dtype):
        return f"{what}: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}."
    if len({x.device for x in (q, k, v, g, beta)}) != 1:
        return f"{what}: q, k, v, g, beta must be on one device."
    owned = [n for n in _OWNED if n in kernel_kwargs]
    if owned:
        return (f"{what} sets {', '.join(owned)} itself (the entry state comes from the other ranks; documents go "
                "through document_ids); remove it from the kernel arguments.")
    return _layout_error(what, layout, s) or _ids_error(what, ids, b, s)


def _check_delta(kernel, q, k, v, g, beta, layout, ids, l2norm, kernel_kwargs, group, world: int, gather=None):
    """Local checks, then the agreement: the same ValueError on every rank, or none. Compiled (Note [Compiled
    agreement of the other ops] in agreement.py): (the agreement's result -- every rank's ``gather`` when
    given -- and this rank's error or None), the first payload tied to the result."""
    err = _delta_error(kernel, q, k, v, g, beta, layout, ids, kernel_kwargs)
    fp, texts = [-1] * len(_DELTA_FIELDS), []
    if err is None:
        fp = [*q.shape, *v.shape[2:], g.dim(), _FLOATS.index(q.dtype), LAYOUTS.index(layout), int(ids is not None),
              int(bool(l2norm))]
        texts = [f"{getattr(kernel, '__module__', '')}.{getattr(kernel, '__qualname__', type(kernel).__name__)}",
                 repr(sorted(kernel_kwargs.items()))]
    if torch.compiler.is_compiling() and world > 1:  # the texts' crc32 at run time (zlib is not traceable)
        return agree_compiled(_DELTA_RULES, fp, err, group, texts=texts,
                              gather=None if err is not None else gather), err
    fp += [_crc(t) for t in texts]
    agree(_DELTA_RULES, fp, err, group)
    return None, None


@torch.compiler.disable
def _document_runs(ids: Tensor, last: Tensor, starts, run_len: int, layout: str, world: int):
    """Per run: (fresh [B] -- whether each row's first token starts a document --, cuts [B] -- the local
    starts of documents inside it), read from the ids' values (on the host; a graph break when compiled:
    the kernel calls follow the documents). ``last``: every run's last id, [P, B, runs]."""
    out = []
    for s0, j in starts:
        row = ids[:, s0:s0 + run_len]
        fresh = [j == 0] * ids.shape[0]
        if j > 0:
            r, i = _owner(layout, world, j - 1)
            fresh = (row[:, 0] != last[r, :, i]).tolist()
        out.append((fresh, [(torch.nonzero(x[1:] != x[:-1]).flatten() + 1).tolist() for x in row]))
    return out


# -- the delta rule ------------------------------------------------------------------------------------


def _segment(kernel, xs, connected: bool, state_dtype, kw):
    """One kernel call on one segment; xs = (q, k, v, g, beta), [b, L, ...]. Returns o0 [b, L, Hv, dv],
    u [b, L, Hv, dk] or None, A [b, Hv, dk, dk] or None (zero), B [b, Hv, dk, dv]."""
    q, k, v, g, beta = (x.contiguous() for x in xs)
    b, _, hv, dv = v.shape
    dk = q.shape[-1]
    if not connected:  # a zero entry state: the plain kernel
        o, s = kernel(q, k, v, g, beta, initial_state=None, output_final_state=True, **kw)
        return o, None, None, s.to(state_dtype)
    # See Note [Linear attention under CP]: v' = [v, 0], initial state [0 | I] -> o' = [o0 | u], final [B | A]
    wide = torch.cat([v, v.new_zeros(b, v.shape[1], hv, dk)], -1)
    eye = torch.eye(dk, dtype=torch.float32 if state_dtype != torch.float64 else state_dtype, device=v.device)
    init = torch.cat([eye.new_zeros(b, hv, dk, dv), eye.expand(b, hv, dk, dk)], -1).contiguous()
    o, s = kernel(q, k, wide, g, beta, initial_state=init, output_final_state=True, **kw)
    s = s.to(state_dtype)
    return o[..., :dv], o[..., dv:], s[..., dv:], s[..., :dv]


def _run(kernel, xs, fresh: list[bool], cuts: list[list[int]], state_dtype, kw):
    """One run (this rank's contiguous tokens), every batch row: ``fresh[b]`` whether its first token starts a
    document, ``cuts[b]`` the local starts of documents inside it. Same returns as :func:`_segment`."""
    if not any(cuts) and len(set(fresh)) == 1:  # one batched call
        return _segment(kernel, xs, not fresh[0], state_dtype, kw)
    # See Note [Linear attention under CP]: per row, per document segment
    rows = []
    for b in range(len(fresh)):
        bounds = [0, *cuts[b], xs[0].shape[1]]
        parts = [_segment(kernel, [x[b:b + 1, lo:hi] for x in xs], i == 0 and not fresh[b], state_dtype, kw)
                 for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
        rows.append((torch.cat([p[0] for p in parts], 1), parts[0][1], bounds[1],
                     parts[0][2] if len(parts) == 1 else None, parts[-1][3]))
    o0 = torch.cat([r[0] for r in rows])
    q, v = xs[0], xs[2]
    shape = (1, q.shape[1], v.shape[2], q.shape[3])
    u = None
    if any(r[1] is not None for r in rows):  # zero past the first segment and on unconnected rows
        u = torch.cat([q.new_zeros(shape, dtype=o0.dtype) if r[1] is None else
                       F.pad(r[1], (0, 0, 0, 0, 0, shape[1] - r[2])) for r in rows])
    a = None
    if any(r[3] is not None for r in rows):
        dk = q.shape[3]
        a = torch.cat([r[3] if r[3] is not None else r[4].new_zeros(1, v.shape[2], dk, dk) for r in rows])
    return o0, u, a, torch.cat([r[4] for r in rows])


@old_keywords("cp_dtensor.sharded_delta_rule", group="mesh")
def sharded_delta_rule(
    kernel, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, mesh, layout: str,
    document_ids: Tensor | None = None, use_qk_l2norm_in_kernel: bool = False, output_final_state: bool = False,
    **kernel_kwargs,
) -> Tensor | tuple[Tensor, Tensor]:
    """The gated delta rule over the global sequence, on this rank's shard: exactly what ``kernel`` gives
    unsharded (forward and backward). See Note [Linear attention under CP].

    q, k: [B, S_local, Hk, dk]; v: [B, S_local, Hv, dv]; g: [B, S_local, Hv] or [B, S_local, Hv, dk];
    beta: [B, S_local, Hv]; ``document_ids``: [B, S_local] global ids, sharded like the tokens. ``kernel``
    has transformers' signature (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, fla's).
    Returns o [B, S_local, Hv, dv] in q's dtype; with ``output_final_state=True`` also the state after the
    sequence's last token, S [B, Hv, dk, dv] in fp32 (fp64 for fp64 inputs), the same on every rank (the fold
    of every run's summary: no extra communication) -- what decoding continues from (Note [Prefill for
    decoding])."""
    group, rank, world = _group(mesh)
    b, s = (q.shape[0], q.shape[1]) if isinstance(q, Tensor) and q.dim() == 4 else (0, 0)
    good_ids = isinstance(document_ids, Tensor) and tuple(document_ids.shape) == (b, s) and s > 0
    starts = _run_starts(layout, rank, world, s) if good_ids and layout in LAYOUTS else []
    run_len = s // max(1, len(starts))
    mine_last = (document_ids[:, [s0 + run_len - 1 for s0, _ in starts]].to("cpu", torch.int64)
                 if good_ids and starts and not document_ids.dtype.is_floating_point else None)
    ready, failed = _check_delta(kernel, q, k, v, g, beta, layout, document_ids, use_qk_l2norm_in_kernel,
                                 kernel_kwargs, group, world, gather=mine_last)
    if failed is not None:  # compiled: the agreement raises at run time, on every rank (placeholders here)
        if not (isinstance(q, Tensor) and isinstance(v, Tensor) and q.dim() == v.dim() == 4):
            raise ValueError(failed)
        out = tie(v.new_zeros(v.shape, dtype=q.dtype), ready)
        state = v.new_zeros(v.shape[0], v.shape[2], q.shape[3], v.shape[3])
        return (out, state) if output_final_state else out
    b, s, hk, dk = q.shape
    hv, dv = v.shape[2:]

    starts = _run_starts(layout, rank, world, s)
    run_len = s // len(starts)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    kw = dict(kernel_kwargs, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    plans = [([j == 0] * b, [[] for _ in range(b)]) for _, j in starts]
    if document_ids is not None:
        last = (ready if ready is not None else
                _gather_last_ids(document_ids, starts, run_len, group, world))  # [P, B, runs]
        plans = _document_runs(document_ids.to("cpu", torch.int64), last, starts, run_len, layout, world)
    outs = []
    for (s0, _), (fresh, cuts) in zip(starts, plans):
        xs = [x[:, s0:s0 + run_len] for x in (q, k, v, g, beta)]
        outs.append(_run(kernel, xs, fresh, cuts, state_dtype, kw))

    # the summaries [runs, B, Hv, dk, dk + dv] of every rank, in global order, folded (fp32)
    summaries = torch.stack([torch.cat([a if a is not None else bst.new_zeros(b, hv, dk, dk), bst], -1)
                             for _, _, a, bst in outs])
    every = _gather(tie(summaries, ready).flatten(), group, world).view(world, len(starts), b, hv, dk, dk + dv)
    entries, state = {}, summaries.new_zeros(b, hv, dk, dv)
    mine = {j for _, j in starts}
    for j in range(world * len(starts) if output_final_state else max(mine) + 1):  # the final state: every run
        if j in mine:
            entries[j] = state
        r, i = _owner(layout, world, j)
        state = every[r, i, ..., :dk] @ state + every[r, i, ..., dk:]
    result = []
    for (_, j), (o0, u, _, _) in zip(starts, outs):
        o = o0 if u is None else o0.to(state_dtype) + torch.einsum("blhk,bhkv->blhv", u.to(state_dtype), entries[j])
        result.append(o.to(q.dtype))
    out = result[0] if len(result) == 1 else torch.cat(result, 1)
    out = _Tie.apply(out, every) if world > 1 and all(u is None for _, u, _, _ in outs) else out
    return (out, state) if output_final_state else out
