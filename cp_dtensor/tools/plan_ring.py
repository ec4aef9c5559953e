"""The ring's cost model behind ``cp-dtensor plan``: bytes, FLOPs, memory and overlap of one ring-attention
configuration (re-exported by plan.py, the planner's one import).

Pure arithmetic. The facts it costs are stated once elsewhere: the divisibility rule and the pairs
each ring step keeps and the bytes of a K/V message, all in layout.py. All figures are per rank and per
attention layer unless a name says otherwise; S = N / P is the local sequence length, D the head
dim, B the batch, Hq / Hkv the query / key-value heads.

Note [Plan communication]
~~~~~~~~~~~~~~~~~~~~~~~~~
Only K and V travel (never Q), so one ring step sends, per rank, one K/V message of
``layout.payload_bytes`` (B * S * Hkv rows of K and of V in ``comm_dtype``; fp8 adds one exponent
byte a row, see Note [float8 ring payload] in payload.py). The forward makes P-1 sends (step 0 uses
the local block). The backward rotates K/V again (P-1 sends) and moves the dK/dV accumulators, which
start on the first rank after the owner and end at the owner: P-1 sends of ``dkv_step``, a message
shaped like K/V in the compute dtype (ring.py sends the accumulators in the input dtype). The
backward therefore sends 2x the forward, forward+backward 3x, unless an fp8 payload is chosen.

Note [Plan FLOPs]
~~~~~~~~~~~~~~~~~
A step costs 4 * B * Hq * D FLOPs per (query, key) pair the causal mask keeps (QK^T and PV, one
multiply-add = 2 FLOPs each). Pairs are counted exactly from the layout (see Note [Causal ring
steps] in layout.py); a tiled kernel does a little more along diagonals. The backward is taken as
2.5x the forward (five matmuls instead of two: QK^T recomputed, dV, dP, dQ, dK), so
forward+backward is 3.5x the forward. A ring step lasts as long as its slowest rank, so overlap is
judged with the maximum over ranks of each step's work.

Note [Plan memory]
~~~~~~~~~~~~~~~~~~
What ring attention itself holds on a rank, counted from ring.py / blocks.py / kernels.py, in the compute
dtype (e bytes) unless stated; Q = B S Hq D and KV = 2 B S Hkv D elements, L = 4 B Hq S bytes (lse):

* saved for backward, every layer: q, k, v, out, and lse (fp32);
* one layer's ring working set, the larger of
  forward:  the K/V block in use and the one arriving (P > 1), the fp32 out and lse accumulators, the
            block's own out and lse before the merge and, below fp32, the merge's fp32 copy of that out;
  backward: dO, the fp32 dQ and the fp32 [dK | dV] of the own block, the ring's messages (below), and
            the kernel's transient while one block's backward runs (below).
* the backward's messages (Note [One message per backward step] in ring.py), at the worst step: P = 2,
  the K/V block in use and the one arriving and this step's dK/dV share (2 kv + 1 dkv); P = 3, the block
  in use and three dK/dV buffers (leaving, arriving, this step's); P >= 4, step 2's block in use, the
  [dK/dV | K/V] message leaving and the one arriving, and this step's share (3 kv + 3 dkv).
* the kernel's transient, per ``device``:
  cuda, flash (bf16/fp16, D <= 256): the fresh dq, dk, dv; the contiguous [B, S, H, D] copies torch's
            flash backward makes of dO and out (the ring hands them [B, H, S, D]); flash's fp32 dq
            accumulator; with GQA its dK and dV expanded to Hq heads before the sum; its fp32 rowsum
            (L). That is (Q + KV) e + 2 Q e + 4 Q + (2 Q e with GQA) + L -- the largest single term.
  cuda, memory-efficient (fp32): one call per KV group, every group's grads kept for the concatenation:
            2 (Q + KV) e, and one group's g-fold K/V copies and expanded dK/dV, 4 Q e / Hkv. (Not yet
            measured on a GPU.)
  cpu:      the backward runs per KV head (Note [Backward in head chunks] in blocks.py): one head's
            fresh grads and the kernel's contiguous copy of its dO, ((Q + KV) e + Q e) / Hkv.

Calibration (docs/planner.md, scripts/benchmarks/bench_planner_memory.py and gpu_check.py's section (d)):
within 8% of the measured peak of one striped fwd+bwd on an H200 (N = 32768, P = 4, Hq 32, Hkv 8,
D 128, bf16: 1091 MiB measured) and on CPU at two shapes. Weights, optimizer state, MLP/norm activations,
allocator slack and whatever else a model holds are not modelled: pass them as ``reserved_gib``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from ..core.plan import masks
from ..core.plan.layout import check_layout, check_seq_len, layout_unit, payload_bytes, step_pairs

__all__ = [
    "BWD_FLOP_FACTOR",
    "COMPUTE_DTYPES",
    "DTYPE_BYTES",
    "GIB",
    "Plan",
    "PlanInput",
    "StepWork",
    "dkv_step_bytes",
    "doc_factor",
    "kv_step_bytes",
    "make_plan",
    "memory_bytes",
    "parse_tokens",
    "ring_steps",
    "smallest_cp",
    "step_pairs",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")  # what q, k, v (and so the dK/dV accumulators) can be
BWD_FLOP_FACTOR = 2.5  # backward FLOPs / forward FLOPs; see Note [Plan FLOPs]
GIB = 1 << 30
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_tokens(text: str | int) -> int:
    """Token counts with binary suffixes: ``128k`` = 131072, ``1M`` = 1048576, ``4096`` = 4096."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if m is None:
        raise ValueError(
            f"cannot read a token count from {text!r}; write an integer with an optional binary "
            "suffix k (1024), M (1024**2) or G (1024**3), e.g. 128k or 1M."
        )
    return int(m.group(1)) * _SUFFIX[m.group(2).lower()]


@dataclass(frozen=True)
class PlanInput:
    """One ring-attention configuration to cost. Fields mirror the ``cp-dtensor plan`` flags."""

    seq_len: int
    """Global sequence length N in tokens."""
    cp: int
    """Context-parallel degree P (ranks in the ring)."""
    head_dim: int
    """Head dimension D."""
    q_heads: int
    """Query heads Hq."""
    kv_heads: int
    """Key/value heads Hkv (GQA/MQA when smaller than Hq)."""
    dtype: str = "bf16"
    """Compute and activation dtype of q, k, v, out."""
    comm_dtype: str | None = None
    """Dtype of the K/V ring payload; None means ``dtype``."""
    layout: str = "striped"
    """Sequence layout: striped, headtail or contiguous."""
    batch: int = 1
    """Sequences per rank B."""
    layers: int = 1
    """Attention layers (memory saved for backward scales with this)."""
    causal: bool = True
    """Causal attention mask."""
    window: int | None = None
    """Sliding window: each query attends to the ``window`` tokens before it and itself (flash-attn's
    ``(window, 0)``, causal); None: unbounded. Steps no rank needs are neither computed nor sent."""
    mean_doc_len: int | None = None
    """Packed documents of this mean length (block-causal): fewer kept pairs, the same K/V bytes."""
    link_gbps: float | None = None
    """Per-rank ring link bandwidth in GB/s (1e9 bytes/s), one direction."""
    tflops: float | None = None
    """Sustained attention throughput in TFLOP/s (1e12 FLOP/s)."""
    reserved_gib: float = 0.0
    """Memory per rank taken by everything not modelled (weights, optimizer, other activations)."""
    device: str = "cuda"
    """Where the kernels run, "cuda" or "cpu": their transient memory differs (Note [Plan memory])."""

    def __post_init__(self) -> None:
        if self.comm_dtype is None:
            object.__setattr__(self, "comm_dtype", self.dtype)
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}; got {self.dtype!r}. "
                             "For a float8 K/V payload set comm_dtype fp8.")
        if self.comm_dtype not in DTYPE_BYTES:
            raise ValueError(f"comm_dtype must be one of {', '.join(DTYPE_BYTES)}; got {self.comm_dtype!r}.")
        check_layout(self.layout)
        for name in ("seq_len", "cp", "head_dim", "q_heads", "kv_heads", "batch", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer; got {getattr(self, name)}.")
        if self.q_heads % self.kv_heads != 0:
            raise ValueError(
                f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads}) for GQA."
            )
        check_seq_len(self.layout, self.cp, self.seq_len)
        for name in ("link_gbps", "tflops"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}.")
        for name in ("window", "mean_doc_len"):
            if getattr(self, name) is not None and getattr(self, name) < (0 if name == "window" else 1):
                raise ValueError(f"{name} must be {'>= 0' if name == 'window' else '>= 1'} or None; got {getattr(self, name)}.")
        if self.window is not None and not self.causal:
            raise ValueError("window models a causal sliding window (flash-attn's (window, 0)); drop --no-causal.")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu'; got {self.device!r}.")
        if self.reserved_gib < 0:
            raise ValueError(f"reserved_gib must be >= 0; got {self.reserved_gib}.")

    @property
    def s_local(self) -> int:
        return self.seq_len // self.cp


def kv_step_bytes(inp: PlanInput) -> int:
    """Bytes one rank sends in one forward ring step: its K and V block. See Note [Plan communication]."""
    rows = inp.batch * inp.s_local * inp.kv_heads  # of K and of V: one per (batch, token, kv head)
    return payload_bytes(rows=rows, head_dim=inp.head_dim, itemsize=DTYPE_BYTES[inp.comm_dtype],
                         fp8=inp.comm_dtype == "fp8")


def dkv_step_bytes(inp: PlanInput) -> int:
    """Bytes of one dK/dV accumulator hop in the backward: K/V-shaped, in the compute dtype."""
    rows = inp.batch * inp.s_local * inp.kv_heads
    return payload_bytes(rows=rows, head_dim=inp.head_dim, itemsize=DTYPE_BYTES[inp.dtype])


def _message_bytes(inp: PlanInput) -> tuple[int, int]:
    """(forward, backward) bytes of the ring's messages at their worst step; see Note [Plan memory]."""
    kv, dkv, p = kv_step_bytes(inp), dkv_step_bytes(inp), ring_steps(inp)
    if p == 1:
        return 0, 0
    bwd = {2: 2 * kv + dkv, 3: kv + 3 * dkv}.get(p, 3 * kv + 3 * dkv)
    return 2 * kv, bwd


def _kernel_bytes(inp: PlanInput, q: int, kv: int, lse: int) -> int:
    """The kernel's transient in one block's backward (q, kv: elements); see Note [Plan memory]."""
    e = DTYPE_BYTES[inp.dtype]
    if inp.device == "cpu":
        return ((q + kv) * e + q * e) // inp.kv_heads
    if inp.dtype in ("bf16", "fp16") and inp.head_dim <= 256 and inp.head_dim % 8 == 0:  # flash
        expanded = 2 * q * e if inp.q_heads != inp.kv_heads else 0
        return (q + kv) * e + 2 * q * e + 4 * q + expanded + lse
    return 2 * (q + kv) * e + 4 * q * e // inp.kv_heads  # memory-efficient, per KV group


def memory_bytes(inp: PlanInput) -> dict[str, int]:
    """Per-rank memory of ring attention; see Note [Plan memory]."""
    b, s, d, e = inp.batch, inp.s_local, inp.head_dim, DTYPE_BYTES[inp.dtype]
    q = b * s * inp.q_heads * d  # elements of q (and of out, dQ, dO)
    kv = 2 * b * s * inp.kv_heads * d  # elements of k and v together
    lse = b * inp.q_heads * s * 4
    saved = (2 * q + kv) * e + lse
    fwd_msgs, bwd_msgs = _message_bytes(inp)
    upcast = q * 4 if e < 4 else 0  # the merge's fp32 copy of the block's out
    fwd_work = fwd_msgs + q * 4 + lse + q * e + lse + upcast
    bwd_work = q * e + q * 4 + kv * 4 + bwd_msgs + _kernel_bytes(inp, q, kv, lse)
    work = max(fwd_work, bwd_work)
    reserved = int(inp.reserved_gib * GIB)
    return {
        "saved_per_layer": saved,
        "saved_all_layers": saved * inp.layers,
        "forward_working_set": fwd_work,
        "backward_working_set": bwd_work,
        "forward_messages": fwd_msgs,
        "backward_messages": bwd_msgs,
        "reserved": reserved,
        "total": saved * inp.layers + work + reserved,
    }


@dataclass(frozen=True)
class StepWork:
    """Forward (query, key) pairs of one ring step: the slowest and the lightest rank."""

    step: int
    max_pairs: int
    min_pairs: int


@dataclass(frozen=True)
class Plan:
    """Everything ``cp-dtensor plan`` reports; per rank and per attention layer unless named."""

    input: PlanInput
    kv_step_bytes: int
    dkv_step_bytes: int
    fwd_bytes: int
    bwd_bytes: int
    fwd_bwd_bytes: int
    flops_per_pair: int
    steps: list[StepWork]
    rank_fwd_pairs_max: int
    rank_fwd_pairs_mean: float
    fwd_flops_max_rank: int
    fwd_bwd_flops_max_rank: float
    memory: dict[str, int]
    timing: dict[str, float | bool | None] | None = None
    smallest_cp: dict[str, int | float | None] | None = field(default=None)

    def to_dict(self) -> dict:
        return asdict(self)


def ring_steps(inp: PlanInput) -> int:
    """Ring steps that run (the local one included): all P, fewer under a window. See Note [Masked ring
    steps] in masks.py."""
    if inp.window is None:
        return inp.cp
    return masks.steps_needed(inp.layout, inp.cp, inp.s_local, *masks.mask_bounds(True, (inp.window, 0)))


def doc_factor(inp: PlanInput) -> float:
    """Kept pairs with packed documents of ``mean_doc_len`` tokens / kept pairs without, per query on
    average (documents of exactly that length; a query at offset i of its document keeps i + 1 keys,
    or at most window + 1)."""
    n, length = inp.seq_len, inp.mean_doc_len
    if length is None or length >= n:
        return 1.0
    if not inp.causal:
        return length / n
    w = n if inp.window is None else inp.window + 1
    with_docs = sum(min(i + 1, w) for i in range(length)) / length
    without = sum(min(i + 1, w) for i in range(n)) / n
    return with_docs / without


def _window_pairs(inp: PlanInput) -> list[list[int]]:
    """[rank][step] kept pairs under the window, exactly (masks.block_rects)."""
    p, s = inp.cp, inp.s_local
    lo, hi = masks.mask_bounds(True, (inp.window, 0))
    out = []
    for r in range(p):
        q = masks.runs(inp.layout, r, p, s)
        out.append([masks.kept_pairs(masks.block_rects(q, masks.runs(inp.layout, (r - t) % p, p, s), lo, hi))
                    for t in range(ring_steps(inp))])
    return out


def _pairs_table(inp: PlanInput) -> list[list[float]]:
    """[rank][step] forward pairs, documents counted on average (doc_factor)."""
    f = doc_factor(inp)
    if inp.window is not None:
        return [[x * f for x in row] for row in _window_pairs(inp)]
    kw = dict(s_local=inp.s_local, causal=inp.causal)
    return [[f * step_pairs(inp.layout, rank=r, src=(r - t) % inp.cp, **kw) for t in range(inp.cp)]
            for r in range(inp.cp)]


def _step_work(inp: PlanInput) -> list[StepWork]:
    if inp.window is not None or inp.mean_doc_len is not None:
        table = _pairs_table(inp)
        return [StepWork(t, round(max(row[t] for row in table)), round(min(row[t] for row in table)))
                for t in range(len(table[0]))]
    # At step t rank r holds the block of src = (r - t) mod P: ranks r >= t see an earlier block
    # (src < r), the t ranks r < t a later one (src > r). Work depends only on that relation.
    p, s = inp.cp, inp.s_local
    kw = dict(s_local=s, causal=inp.causal)
    diag = step_pairs(inp.layout, rank=0, src=0, **kw)
    below = step_pairs(inp.layout, rank=1, src=0, **kw)
    above = step_pairs(inp.layout, rank=0, src=1, **kw)
    steps = [StepWork(0, diag, diag)]
    steps += [StepWork(t, max(below, above), min(below, above)) for t in range(1, p)]
    return steps


def _rank_pairs(inp: PlanInput) -> list[int]:
    """Forward pairs of every rank over the whole ring: rank r has r earlier and P-1-r later blocks."""
    if inp.window is not None or inp.mean_doc_len is not None:
        return [round(sum(row)) for row in _pairs_table(inp)]
    kw = dict(s_local=inp.s_local, causal=inp.causal)
    diag = step_pairs(inp.layout, rank=0, src=0, **kw)
    below = step_pairs(inp.layout, rank=1, src=0, **kw)
    above = step_pairs(inp.layout, rank=0, src=1, **kw)
    return [diag + r * below + (inp.cp - 1 - r) * above for r in range(inp.cp)]


def _timing(inp: PlanInput, steps: list[StepWork], fpp: int, kv: int, dkv: int) -> dict[str, float | bool | None]:
    """Ring-step timeline with the transfer of the next block overlapping the current step."""
    flops_per_s, bytes_per_s = inp.tflops * 1e12, inp.link_gbps * 1e9
    fwd_c = [w.max_pairs * fpp / flops_per_s for w in steps]
    bwd_c = [c * BWD_FLOP_FACTOR for c in fwd_c]
    kv_t, dkv_t, p = kv / bytes_per_s, dkv / bytes_per_s, len(steps)
    # forward: step t (< P-1) hides the send of block t+1; the last step sends nothing
    fwd = sum(max(c, kv_t) for c in fwd_c[:-1]) + fwd_c[-1]
    # backward: step 0 sends K/V; steps 1..P-2 send K/V and a dK/dV hop; step P-1's hop (the
    # return to the owner) comes after the last compute and is exposed
    if p == 1:
        bwd = bwd_c[0]
    else:
        bwd = max(bwd_c[0], kv_t) + sum(max(c, kv_t + dkv_t) for c in bwd_c[1:-1]) + bwd_c[-1] + dkv_t
    fwd_hidden = all(c >= kv_t for c in fwd_c[:-1])
    bwd_hidden = (p == 1 or bwd_c[0] >= kv_t) and all(c >= kv_t + dkv_t for c in bwd_c[1:-1])
    overlapped = fwd_c[:-1]  # min over steps of compute/comm: > 1 means the forward hides the ring
    return {
        "kv_step_s": kv_t,
        "dkv_step_s": dkv_t,
        "min_step_compute_s": min(overlapped) if overlapped else fwd_c[0],
        "compute_over_comm": (min(overlapped) / kv_t) if overlapped else None,
        "fwd_hidden": fwd_hidden,
        "bwd_hidden": bwd_hidden,
        "fwd_s": fwd,
        "fwd_exposed_comm_s": fwd - sum(fwd_c),
        "bwd_s": bwd,
        "bwd_exposed_comm_s": bwd - sum(bwd_c),
    }


def make_plan(inp: PlanInput, *, mem_budget_gib: float | None = None, max_cp: int = 4096) -> Plan:
    """Cost ``inp``; with ``mem_budget_gib`` also search the smallest CP whose memory fits."""
    p = ring_steps(inp)  # sends: p - 1 per direction (P - 1 without a window)
    kv, dkv = kv_step_bytes(inp), dkv_step_bytes(inp)
    fpp = 4 * inp.batch * inp.q_heads * inp.head_dim
    steps = _step_work(inp)
    ranks = _rank_pairs(inp)
    timing = None
    if inp.link_gbps is not None and inp.tflops is not None:
        timing = _timing(inp, steps, fpp, kv, dkv)
    search = None
    if mem_budget_gib is not None:
        best = smallest_cp(inp, mem_budget_gib=mem_budget_gib, max_cp=max_cp)
        search = {
            "mem_budget_gib": mem_budget_gib,
            "cp": best,
            "total_bytes": None if best is None else memory_bytes(_with_cp(inp, best))["total"],
            "max_cp_searched": max_cp,
        }
    return Plan(
        input=inp,
        kv_step_bytes=kv,
        dkv_step_bytes=dkv,
        fwd_bytes=(p - 1) * kv,
        bwd_bytes=(p - 1) * (kv + dkv),
        fwd_bwd_bytes=(p - 1) * (2 * kv + dkv),
        flops_per_pair=fpp,
        steps=steps,
        rank_fwd_pairs_max=max(ranks),
        rank_fwd_pairs_mean=sum(ranks) / inp.cp,
        fwd_flops_max_rank=max(ranks) * fpp,
        fwd_bwd_flops_max_rank=max(ranks) * fpp * (1 + BWD_FLOP_FACTOR),
        memory=memory_bytes(inp),
        timing=timing,
        smallest_cp=search,
    )


def _with_cp(inp: PlanInput, cp: int) -> PlanInput:
    return PlanInput(**{**asdict(inp), "cp": cp})


def smallest_cp(inp: PlanInput, *, mem_budget_gib: float, max_cp: int = 4096) -> int | None:
    """Smallest P in 1..max_cp that the layout allows for ``inp.seq_len`` and whose per-rank memory
    (Note [Plan memory]) is at most ``mem_budget_gib``; None if none does."""
    budget = mem_budget_gib * GIB
    for p in range(1, max_cp + 1):
        if inp.seq_len % layout_unit(inp.layout, p) == 0 and memory_bytes(_with_cp(inp, p))["total"] <= budget:
            return p
    return None
