"""The cost model behind ``cp-dtensor plan``: bytes, FLOPs, memory and overlap of ring attention.

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
What ring attention itself holds on a rank, in the compute dtype unless stated:

* saved for backward, every layer: q, k, v, out, and lse (fp32);
* one layer's ring working set, the larger of
  forward:  2 K/V step buffers (in use + arriving), the fp32 out and lse accumulators, and the
            block's own output before it is merged;
  backward: 2 K/V step buffers, 2 dK/dV accumulators in flight (leaving + arriving), this step's
            dK/dV share, the owner's fp32 dK/dV, fp32 dQ, dO, and the kernel's fresh dQ, dK, dV of
            one block. On CPU the ring calls the backward kernel per group of KV heads (Note
            [Backward in head chunks] in blocks.py), so there the last term is smaller than modelled.

Weights, optimizer state, MLP/norm activations, kernel workspace and allocator slack are not
modelled: pass them as ``reserved_gib``.

Note [Plan exchanges]
~~~~~~~~~~~~~~~~~~~~~
``compare_exchanges`` costs the three ways the K/V can move (``ring_attention(kv_exchange=...,
group=...)``) on P ranks in islands of G fast-linked ranks (a node's NVLink), ``intra_gbps`` inside an
island and ``inter_gbps`` per rank between islands:

* ring: P - 1 steps, each hiding one K/V block's transfer under one block's compute; a ring that
  leaves the island moves at the inter-island speed (every step waits for its slowest hop).
* allgather: one gather per chunk of K/V heads (2 when Hkv is even), each chunk's transfer under the
  previous chunk's compute, the first exposed; the backward gathers again and reduce-scatters dK/dV
  (Note [All-gather K/V] in allgather.py). Same bytes as the ring in far fewer, larger transfers, but
  the whole sequence's K/V (and in the backward its dK/dV) is held at once.
* U x R: heads all-to-all over U ranks inside an island, the ring over R = P / U ranks between
  islands, on blocks of U * S tokens and lcm(Hkv, U) / U K/V heads (Note [Ulysses x ring] in
  ulysses.py). Each ring step carries the 1-D ring's bytes but U times its compute, so transfers hide
  U times more easily; the all-to-alls (q, k, v in, out back, and their gradients) are exposed.
  Build the mesh so the Ulysses dim is inside the island: mesh[u, r] = rank r * U + u, i.e.
  ``DeviceMesh(device, torch.arange(P).view(R, U).T)``.

Bytes are ``wire.py``'s (what the tests count on the wire). Times are the slowest rank's, from the
FLOPs of Note [Plan FLOPs] at ``tflops`` and the bytes at the link speeds; memory as Note [Plan
memory], with the gathered K/V (allgather) or the all-to-all buffers (U x R) added. The recommendation
is the fastest exchange that fits ``mem_budget_gib`` (ties: less memory). A model, not a measurement:
it ignores latency per message (which favours allgather and U x R at small blocks) and NCCL's
hierarchical all-gather across islands (the model charges it the inter-island speed).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

from ..core import masks
from ..core.layout import check_layout, check_seq_len, layout_unit, payload_bytes, step_pairs
from ..core.wire import ulysses_a2a_bytes

__all__ = [
    "DTYPE_BYTES",
    "BWD_FLOP_FACTOR",
    "PlanInput",
    "StepWork",
    "Plan",
    "parse_tokens",
    "step_pairs",
    "kv_step_bytes",
    "dkv_step_bytes",
    "memory_bytes",
    "make_plan",
    "smallest_cp",
    "Exchange",
    "compare_exchanges",
    "recommend",
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


def memory_bytes(inp: PlanInput) -> dict[str, int]:
    """Per-rank memory of ring attention; see Note [Plan memory]."""
    b, s, d, e = inp.batch, inp.s_local, inp.head_dim, DTYPE_BYTES[inp.dtype]
    q = b * s * inp.q_heads * d  # elements of q (and of out, dQ, dO)
    kv = 2 * b * s * inp.kv_heads * d  # elements of k and v together
    lse = b * inp.q_heads * s * 4
    saved = (2 * q + kv) * e + lse
    kv_buf = kv_step_bytes(inp)
    fwd_work = 2 * kv_buf + q * 4 + lse + q * e
    kernel_grads = (q + kv) * e
    bwd_work = 2 * kv_buf + 3 * dkv_step_bytes(inp) + kv * 4 + q * 4 + q * e + kernel_grads
    work = max(fwd_work, bwd_work)
    reserved = int(inp.reserved_gib * GIB)
    return {
        "saved_per_layer": saved,
        "saved_all_layers": saved * inp.layers,
        "forward_working_set": fwd_work,
        "backward_working_set": bwd_work,
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


@dataclass(frozen=True)
class Exchange:
    """One way to move K/V for ``inp`` (Note [Plan exchanges]); per rank per attention layer."""

    name: str
    ulysses: int
    ring: int
    kv_exchange: str
    fwd_bytes: int
    bwd_bytes: int
    memory_total: int
    compute_over_comm: float | None
    """Per-transfer compute / transfer time (> 1: the transfers hide); None without transfers."""
    fwd_s: float
    bwd_s: float
    exposed_s: float
    """fwd_s + bwd_s minus the compute: the communication left exposed."""

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def _link(span: int, island: int, intra_gbps: float, inter_gbps: float) -> float:
    """Bytes/s of a collective over ``span`` consecutive ranks: the inter-island speed once it leaves one."""
    return (intra_gbps if span <= island else inter_gbps) * 1e9


def _ring_exchange(inp: PlanInput, name: str, u: int, link: float, a2a_bytes: int, a2a_link: float) -> Exchange:
    """The ring over ``inp.cp`` ranks (the inner ring of U x R when ``u`` > 1), plus exposed all-to-alls."""
    run = replace(inp, link_gbps=link / 1e9)
    kv, dkv = kv_step_bytes(run), dkv_step_bytes(run)
    fpp = 4 * run.batch * run.q_heads * run.head_dim
    steps = _step_work(run)
    t = _timing(run, steps, fpp, kv, dkv)
    n = ring_steps(run)
    compute = sum(w.max_pairs for w in steps) * fpp * (1 + BWD_FLOP_FACTOR) / (run.tflops * 1e12)
    a2a_t = a2a_bytes / a2a_link if a2a_bytes else 0.0
    fwd, bwd = t["fwd_s"] + a2a_t, t["bwd_s"] + a2a_t
    return Exchange(
        name=name, ulysses=u, ring=inp.cp, kv_exchange="ring",
        fwd_bytes=(n - 1) * kv + a2a_bytes, bwd_bytes=(n - 1) * (kv + dkv) + a2a_bytes,
        memory_total=0, compute_over_comm=t["compute_over_comm"] if n > 1 else None,
        fwd_s=fwd, bwd_s=bwd, exposed_s=fwd + bwd - compute,
    )


def _allgather_exchange(inp: PlanInput, name: str, u: int, link: float, a2a_bytes: int, a2a_link: float) -> Exchange:
    """One gather per chunk of K/V heads over ``inp.cp`` ranks; see Note [All-gather K/V] in allgather.py."""
    p, n = inp.cp, 2 if inp.kv_heads % 2 == 0 else 1
    kv, dkv = kv_step_bytes(inp), dkv_step_bytes(inp)
    fpp = 4 * inp.batch * inp.q_heads * inp.head_dim
    c_f = max(_rank_pairs(inp)) * fpp / (inp.tflops * 1e12) / n  # one chunk's forward compute
    c_b = c_f * BWD_FLOP_FACTOR
    g, rs = (p - 1) * kv / n / link, (p - 1) * dkv / n / link  # one chunk's gather, reduce-scatter
    if p == 1:
        g = rs = 0.0
    a2a_t = a2a_bytes / a2a_link if a2a_bytes else 0.0
    fwd = g + (n - 1) * max(c_f, g) + c_f + a2a_t
    bwd = g + (n - 1) * max(c_b, g + rs) + c_b + rs + a2a_t
    return Exchange(
        name=name, ulysses=u, ring=p, kv_exchange="allgather",
        fwd_bytes=(p - 1) * kv + a2a_bytes, bwd_bytes=(p - 1) * (kv + dkv) + a2a_bytes,
        memory_total=0, compute_over_comm=(c_f / g) if g else None,
        fwd_s=fwd, bwd_s=bwd, exposed_s=fwd + bwd - n * (c_f + c_b),
    )


def _allgather_memory(inp: PlanInput) -> int:
    """The ring's memory with its two K/V step buffers (and in the backward its dK/dV hops) replaced by
    the whole sequence's K/V (and the [P, K/V] dK/dV buffers)."""
    m = memory_bytes(inp)
    kv, dkv, p = kv_step_bytes(inp), dkv_step_bytes(inp), inp.cp
    fwd = m["forward_working_set"] - 2 * kv + p * kv
    bwd = m["backward_working_set"] - 2 * kv - 3 * dkv + p * kv + p * dkv
    return m["saved_all_layers"] + max(fwd, bwd) + m["reserved"]


def compare_exchanges(
    inp: PlanInput, *, island: int, intra_gbps: float, inter_gbps: float, ulysses: list[int] | None = None,
) -> list[Exchange]:
    """Ring, allgather and every U x R (U > 1 dividing P, U <= ``island``, Hq % U == 0, or ``ulysses``)
    for ``inp`` (its ``tflops`` required); see Note [Plan exchanges]."""
    if inp.tflops is None:
        raise ValueError("comparing K/V exchanges needs --tflops (sustained attention TFLOP/s).")
    for name, x in (("island", island), ("intra_gbps", intra_gbps), ("inter_gbps", inter_gbps)):
        if x is None or x <= 0:
            raise ValueError(f"{name} must be positive; got {x}.")
    p = inp.cp
    link = _link(p, island, intra_gbps, inter_gbps)
    out = [_ring_exchange(inp, "ring", 1, link, 0, 1.0), _allgather_exchange(inp, "allgather", 1, link, 0, 1.0)]
    out = [replace(out[0], memory_total=memory_bytes(inp)["total"]), replace(out[1], memory_total=_allgather_memory(inp))]
    us = [u for u in range(2, p + 1) if p % u == 0 and u <= island and inp.q_heads % u == 0] if ulysses is None else ulysses
    for u in us:
        if p % u or inp.q_heads % u:
            raise ValueError(f"Ulysses degree {u} must divide the CP degree ({p}) and the query heads ({inp.q_heads}).")
        r = p // u
        hkv_rep = math.lcm(inp.kv_heads, u)
        inner = replace(inp, cp=r, q_heads=inp.q_heads // u, kv_heads=hkv_rep // u)
        e = DTYPE_BYTES[inp.dtype]
        s = inp.s_local
        d = inp.head_dim
        a2a = ulysses_a2a_bytes(u=u, b=inp.batch, s_local=s, hq=inp.q_heads, hkv=inp.kv_heads, dqk=d, dv=d, itemsize=e)
        a2a_link = _link(u, island, intra_gbps, inter_gbps)
        ring_link = link if r > 1 else a2a_link
        # the received q, k, v are the inner ring's own (counted by memory_bytes(inner)); on top, one
        # all-to-all's staging buffer at a time, at most q-sized
        a2a_mem = inp.batch * s * inp.q_heads * d * e
        for x in ("ring", "allgather"):
            if x == "allgather" and r == 1:
                continue  # Ulysses alone: no K/V exchange left
            make = _ring_exchange if x == "ring" else _allgather_exchange
            ex = make(inner, f"{u}x{r} {x}" if r > 1 else f"{u}x1 (Ulysses)", u, ring_link, a2a, a2a_link)
            mem = (memory_bytes(inner)["total"] if x == "ring" else _allgather_memory(inner)) + a2a_mem
            out.append(replace(ex, ring=r, kv_exchange=x, memory_total=mem))
    return out


def recommend(exchanges: list[Exchange], *, mem_budget_gib: float | None = None) -> Exchange | None:
    """The fastest exchange within ``mem_budget_gib`` per rank (ties: less memory); None if none fits."""
    fits = [x for x in exchanges if mem_budget_gib is None or x.memory_total <= mem_budget_gib * GIB]
    return min(fits, key=lambda x: (round(x.total_s, 9), x.memory_total), default=None)
