"""Linear attention under CP: the gated delta rule (Gated DeltaNet, Kimi Delta Attention) and its short
causal conv on sequence shards, exact, by passing affine state summaries between ranks.

The attention kernel itself is the caller's (transformers' torch kernels, or fla's on CUDA); this
module cuts each rank's tokens into its contiguous runs, calls the kernel on each, all-gathers one
small affine summary per run and folds them in global order. See Note [Linear attention under CP].

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

import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .._deprecated import old_keywords
from .agreement import Rules, agree
from .comm import all_gather, all_gather_host, host_group, reduce_scatter, wait
from .layout import LAYOUTS
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
from .linear_steps import causal_conv1d_step, delta_rule_step  # noqa: F401 -- re-exported: their old home

__all__ = [
    "LINEAR_LAYOUTS", "causal_conv1d_step", "check_bytes", "check_linear_layout", "conv_halo_bytes", "delta_rule_step",
    "linear_state_bytes", "run_owner", "run_starts", "sharded_causal_conv1d", "sharded_delta_rule",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_OWNED = ("initial_state", "output_final_state", "cu_seqlens")
_ACTIVATIONS = (None, "silu", "swish")



# -- the group, the runs and the agreement --------------------------------------------------------------


def _group(group) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group, rank, world); None: no process group, one rank."""
    if group is not None and hasattr(group, "get_group"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(f"linear attention needs a 1-D CP mesh; got a {group.ndim}-D mesh {group.mesh_dim_names}.")
        group = group.get_group()
    if group is None:
        if not dist.is_initialized():
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def run_starts(layout: str, rank: int, world: int, s_local: int) -> list[tuple[int, int]]:
    """(local start, global run index) of each of this rank's runs, each s_local // runs long."""
    if layout == "contiguous":
        return [(0, rank)]
    return [(0, rank), (s_local // 2, 2 * world - 1 - rank)]


def run_owner(layout: str, world: int, j: int) -> tuple[int, int]:
    """(rank, local run) holding global run ``j``."""
    if layout == "contiguous" or j < world:
        return j, 0
    return 2 * world - 1 - j, 1


_run_starts, _owner = run_starts, run_owner  # this module's own short names


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _describe(field: str, value: int):
    """A fingerprint entry as the caller wrote it."""
    if value < 0:
        return "invalid"
    if field == "layout":
        return repr(LAYOUTS[value])
    if field in ("dtype", "weight_dtype"):
        return _FLOATS[value]
    if field == "activation":
        return repr(_ACTIVATIONS[value])
    if field in ("kernel", "kernel_kwargs"):
        return f"#{value & 0xFFFF:04x}"
    return value


# one all-gather of every rank's fingerprint, the same ValueError on every rank when any rank's local checks
# failed or the ranks differ: Note [One agreement] in agreement.py (run eagerly, between the compiled parts)
_DELTA_RULES = Rules("sharded_delta_rule", _DELTA_FIELDS, describe=_describe)
_CONV_RULES = Rules("sharded_causal_conv1d", _CONV_FIELDS, describe=_describe)


def _layout_error(what: str, layout, s_local: int) -> str | None:
    try:
        check_linear_layout(layout)
    except ValueError as e:
        return f"{what}: {e}"
    if layout == "headtail" and s_local % 2:
        return (f"{what}: the headtail layout holds two equal runs per rank; got S_local = {s_local} (odd). Pad the "
                "sequence to a multiple of 2 * P.")
    if s_local < 1:
        return f"{what}: empty shard (S_local = 0)."
    return None


def _ids_error(what: str, ids, batch: int, s_local: int) -> str | None:
    if ids is None:
        return None
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        return f"{what}: document_ids must be an integer tensor [B, S_local]; got {got}."
    if tuple(ids.shape) != (batch, s_local):
        return (f"{what}: document_ids must be this rank's shard [B, S_local] = [{batch}, {s_local}], sharded like "
                f"the tokens; got shape {tuple(ids.shape)}.")
    return None


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


@torch.compiler.disable
def _check_delta(kernel, q, k, v, g, beta, layout, ids, l2norm, kernel_kwargs, group, world: int) -> None:
    """Local checks, then the agreement: the same ValueError on every rank, or none."""
    err = _delta_error(kernel, q, k, v, g, beta, layout, ids, kernel_kwargs)
    fp = [-1] * len(_DELTA_FIELDS)
    if err is None:
        fp = [*q.shape, *v.shape[2:], g.dim(), _FLOATS.index(q.dtype), LAYOUTS.index(layout), int(ids is not None),
              int(bool(l2norm)),
              _crc(f"{getattr(kernel, '__module__', '')}.{getattr(kernel, '__qualname__', type(kernel).__name__)}"),
              _crc(repr(sorted(kernel_kwargs.items())))]
    agree(_DELTA_RULES, fp, err, group)


def _gather_last_ids(ids: Tensor, starts, run_len: int, group, world: int) -> Tensor:
    """The id of every run's last token, on the host: [P, B, runs] (int64)."""
    last = ids[:, [s0 + run_len - 1 for s0, _ in starts]].to("cpu", torch.int64)
    if world == 1:
        return last.unsqueeze(0)
    return all_gather_host(last.contiguous(), host_group(group))


class _AllGather(torch.autograd.Function):
    """Differentiable all-gather of a flat buffer: [n] -> [P * n]; backward: the sum-reduce-scatter of the
    gradient (each rank's copy feeds that rank's loss). See Note [Linear attention under CP]."""

    @staticmethod
    def forward(ctx, buf: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return wait(all_gather(buf, group), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return wait(reduce_scatter(grad.contiguous(), ctx.group), ctx.group), None


class _Tie(torch.autograd.Function):
    """``out`` unchanged, whose backward also hands ``dep`` a zero gradient: a rank whose output does not read
    the gathered buffer (rank 0 of the contiguous layout, runs that all start documents) still runs the
    all-gather's backward, the reduce-scatter every other rank waits in."""

    @staticmethod
    def forward(ctx, out: Tensor, dep: Tensor) -> Tensor:
        ctx.dep = (dep.shape, dep.dtype)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype = ctx.dep
        return grad, grad.new_zeros(shape, dtype=dtype)


def _gather(buf: Tensor, group, world: int) -> Tensor:
    return buf if world == 1 else _AllGather.apply(buf.contiguous(), group)


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
    _check_delta(kernel, q, k, v, g, beta, layout, document_ids, use_qk_l2norm_in_kernel, kernel_kwargs, group, world)
    b, s, hk, dk = q.shape
    hv, dv = v.shape[2:]

    starts = _run_starts(layout, rank, world, s)
    run_len = s // len(starts)
    state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    kw = dict(kernel_kwargs, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if document_ids is not None:
        last = _gather_last_ids(document_ids, starts, run_len, group, world)  # [P, B, runs]
        ids = document_ids.to("cpu", torch.int64)
    outs = []
    for s0, j in starts:
        xs = [x[:, s0:s0 + run_len] for x in (q, k, v, g, beta)]
        fresh, cuts = [j == 0] * b, [[] for _ in range(b)]
        if document_ids is not None:
            row = ids[:, s0:s0 + run_len]
            if j > 0:
                prev = last[_owner(layout, world, j - 1)[0], :, _owner(layout, world, j - 1)[1]]
                fresh = (row[:, 0] != prev).tolist()
            cuts = [(torch.nonzero(r[1:] != r[:-1]).flatten() + 1).tolist() for r in row]
        outs.append(_run(kernel, xs, fresh, cuts, state_dtype, kw))

    # the summaries [runs, B, Hv, dk, dk + dv] of every rank, in global order, folded (fp32)
    summaries = torch.stack([torch.cat([a if a is not None else bst.new_zeros(b, hv, dk, dk), bst], -1)
                             for _, _, a, bst in outs])
    every = _gather(summaries.flatten(), group, world).view(world, len(starts), b, hv, dk, dk + dv)
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


@torch.compiler.disable
def _check_conv(x, weight, bias, activation, layout, ids, group, world: int) -> None:
    err = _conv_error(x, weight, bias, activation, layout, ids)
    fp = [-1] * len(_CONV_FIELDS)
    if err is None:
        fp = [*x.shape, weight.shape[1], _FLOATS.index(x.dtype), _FLOATS.index(weight.dtype), int(bias is not None),
              _ACTIVATIONS.index(activation), LAYOUTS.index(layout), int(ids is not None)]
    agree(_CONV_RULES, fp, err, group)


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
    _check_conv(x, weight, bias, activation, layout, document_ids, group, world)

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
        tails = torch.stack([r[..., run_len - tg:] for r in runs])
        every = _gather(tails.flatten(), group, world).view(world, len(starts), b, c, tg)
        halo_src = torch.cat([every[r, i, ..., tg - t:] for r, i in order], -1)
    if document_ids is not None:
        ids = document_ids.to("cpu", torch.int64)
    if document_ids is not None and t:
        id_tails = ids[:, [s0 + run_len - t + i for s0, _ in starts for i in range(t)]].view(b, len(starts), t).transpose(0, 1)
        every_ids = (id_tails.unsqueeze(0) if world == 1 else
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
    if not output_final_state:
        return out
    # the last K inputs: the last run's tail when it holds K, else every run whole (tg = run_len)
    need = -(-kk // tg)  # ceil(K / tg) runs hold the last K inputs
    last = torch.cat([every[r, i] for r, i in order[-need:]], -1)[..., -kk:]
    return out, F.pad(last, (kk - last.shape[-1], 0))
