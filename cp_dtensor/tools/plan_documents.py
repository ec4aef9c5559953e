"""The planner's packed documents (``cp-dtensor plan --doc-lengths ...``): for one batch of document lengths,
the K/V rows each placement puts on the wire, its balance of kept causal pairs and its exchange steps --
striped, head-tail and contiguous (the ring) against the document layout (one all-to-all-v). Torch-free.

Note [Plan documents]
~~~~~~~~~~~~~~~~~~~~~
The batch: ``B`` rows of ``N`` tokens, from a file of document lengths (packed in order, a document that
crosses a row's end continuing at the next row's start, as packing does) or from a distribution
(``lognormal:median=1000,sigma=1.2``: row b drawn with seed ``seed + b``, the last document cut at the
row's end). Per placement, per attention layer, per rank:

* wire rows: positions whose K and V (every K/V head) a rank receives in the forward. The ring (striped,
  head-tail, contiguous) sends every block whatever the documents: ``(steps - 1) * B * S`` (steps: P, or
  fewer under ``--window``; Note [Masked ring steps] in masks.py). The document layout's exchange sends
  exactly the rows the masks need (``documents.needed_rows``; Note [Document exchange bytes]), once, in the
  payload's format (``comm_dtype``, as the ring); the backward returns as many dK/dV rows (in the input
  dtype), where the ring sends K/V again plus the dK/dV hops (Note [Plan communication] in plan_ring.py).
* needed rows: what the masks need under that placement -- what a zero-redundancy exchange would send.
* balance: max / mean over ranks of the kept causal pairs, summed over the batch's rows and over the
  model's layers (``windows``: each layer's left reach, None global), ``documents.rank_work``.
* steps: the ring's steps (the local one included; ``steps - 1`` sends each way), or 1 all-to-all-v.

Bytes are wire rows x Hkv x (D + D) x itemsize (``layout.payload_bytes``), plus the agreement.
"""

from __future__ import annotations

import math
import pathlib
import random
from dataclasses import dataclass

from ..core.plan import masks
from ..core.plan.documents import needed_rows, plan_row, rank_work
from ..core.plan.layout import layout_unit, payload_bytes
from .plan_ring import DTYPE_BYTES, PlanInput, ring_steps

__all__ = ["DOC_PLACEMENTS", "DocPlacement", "compare_placements", "doc_rows", "lognormal_lengths", "parse_doc_lengths",
           "placement_positions"]

DOC_PLACEMENTS = ("striped", "headtail", "contiguous", "documents")
_DISTRIBUTIONS = {"lognormal": ("median", "sigma", "seed", "cap"), "fixed": ("length",)}


def lognormal_lengths(seed: int, n: int, median: float, sigma: float = 1.2, cap: int | None = None) -> list[int]:
    """One row of ``n`` tokens of log-normal document lengths (``median``, ``sigma``; at most ``cap``), the
    last one cut at the row's end; ``random.Random(seed)``."""
    rng, out, total = random.Random(seed), [], 0
    while total < n:
        length = min(n - total, cap or n, max(1, int(rng.lognormvariate(math.log(median), sigma))))
        out.append(length)
        total += length
    return out


def parse_doc_lengths(spec: str) -> list[int] | tuple[str, dict[str, float]]:
    """``--doc-lengths``: a distribution ``NAME:key=value,...`` -> (name, params), or a file of positive
    integer lengths (one a line, or whitespace separated) -> the lengths."""
    name, sep, rest = spec.partition(":")
    if sep and name in _DISTRIBUTIONS:
        params: dict[str, float] = {}
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or key not in _DISTRIBUTIONS[name]:
                raise ValueError(f"--doc-lengths {spec!r}: {name} takes {', '.join(_DISTRIBUTIONS[name])} as key=value; "
                                 f"got {item!r}. E.g. lognormal:median=1000,sigma=1.2 or fixed:length=512.")
            try:
                params[key] = float(value)
            except ValueError:
                raise ValueError(f"--doc-lengths {spec!r}: {key} must be a number; got {value!r}.") from None
        need = "median" if name == "lognormal" else "length"
        if params.get(need, 0) < 1 or params.get("cap", 1) < 1 or params.get("sigma", 1.0) < 0:
            raise ValueError(f"--doc-lengths {spec!r}: {name} needs {need} >= 1 (and cap >= 1, sigma >= 0). "
                             "E.g. lognormal:median=1000,sigma=1.2.")
        return name, params
    path = pathlib.Path(spec)
    if not path.is_file():
        raise ValueError(f"--doc-lengths {spec!r} is neither a file of document lengths nor a distribution "
                         f"({', '.join(f'{d}:...' for d in _DISTRIBUTIONS)}, e.g. lognormal:median=1000,sigma=1.2).")
    words = path.read_text().split()
    try:
        lengths = [int(w) for w in words]
    except ValueError:
        raise ValueError(f"--doc-lengths {spec}: every entry must be an integer document length; got "
                         f"{next(w for w in words if not w.lstrip('-').isdigit())!r}.") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--doc-lengths {spec}: the lengths must be positive integers (one a line, or separated "
                         f"by spaces); got {'none' if not lengths else min(lengths)}.")
    return lengths


def doc_rows(source: list[int] | tuple[str, dict[str, float]], seq_len: int, batch: int) -> list[list[int]]:
    """``batch`` rows of document lengths, each summing to ``seq_len`` (Note [Plan documents])."""
    if isinstance(source, tuple):
        name, p = source
        if name == "fixed":
            length = int(p["length"])
            return [[length] * (seq_len // length) + ([seq_len % length] if seq_len % length else [])] * batch
        cap = int(p["cap"]) if "cap" in p else None
        return [lognormal_lengths(int(p.get("seed", 0)) + b, seq_len, p["median"], p.get("sigma", 1.2), cap)
                for b in range(batch)]
    if sum(source) < seq_len * batch:
        raise ValueError(f"--doc-lengths: the file's documents hold {sum(source)} tokens, fewer than the batch's "
                         f"{batch} x {seq_len}. Give more lengths, or a smaller --seq-len / --batch.")
    rows, row, room, it = [], [], seq_len, iter(source)
    carry = 0
    while len(rows) < batch:
        length = carry or next(it)
        take = min(length, room)
        row.append(take)
        carry, room = length - take, room - take
        if room == 0:
            rows.append(row)
            row, room = [], seq_len
    return rows


def placement_positions(placement: str, lengths: list[int], world: int, *, windows=None) -> list[list[int]]:
    """Each rank's global positions of one row under ``placement`` (a layout name, or "documents")."""
    if placement == "documents":
        return plan_row(lengths, world, windows=windows)
    s = sum(lengths) // world
    return [[r.base + r.stride * i for r in masks.runs(placement, rank, world, s) for i in range(r.count)]
            for rank in range(world)]


@dataclass(frozen=True)
class DocPlacement:
    """One placement's costs on the batch (Note [Plan documents]); per rank and per attention layer."""

    placement: str
    exchange: str  #: "ring" or "all-to-all-v"
    steps: int  #: the ring's steps (the local one included), or 1 exchange (0: nothing travels)
    wire_rows_max: int  #: positions received in the forward, the busiest rank
    wire_rows_mean: float
    needed_rows_max: int  #: positions the masks need from other ranks under this placement
    needed_rows_mean: float
    ring_rows: int  #: the striped ring's wire rows (every rank alike): the reference
    fwd_bytes_max: int  #: the busiest rank's forward bytes
    balance: float  #: max / mean over ranks of the kept causal pairs (all rows, all layers)
    rank_pairs: tuple[int, ...]

    @property
    def vs_ring(self) -> float:
        """Wire rows summed over ranks / the striped ring's."""
        return self.wire_rows_mean / self.ring_rows if self.ring_rows else 0.0


def compare_placements(inp: PlanInput, rows: list[list[int]], *, windows=None) -> list[DocPlacement]:
    """Every placement of :data:`DOC_PLACEMENTS` whose divisibility rule ``inp.seq_len`` meets, on the batch
    ``rows`` (each summing to ``inp.seq_len``); the mask is ``inp``'s (causal, ``window``); ``windows``
    the model's layers for the balance and the document placement (default: the one layer of ``inp.window``);
    the bytes are those of ``inp.window``'s layer. ``len(rows)`` rows: the batch (``inp.batch`` per rank)."""
    p, n = inp.cp, inp.seq_len
    if not inp.causal:
        raise ValueError("--doc-lengths costs causal attention (its balance counts kept causal pairs); drop --no-causal.")
    if any(sum(r) != n for r in rows):
        raise ValueError(f"every row of document lengths must sum to --seq-len ({n}); got {[sum(r) for r in rows]}.")
    lefts = [inp.window] if windows is None else windows
    window = None if inp.window is None else (inp.window, 0)
    steps = ring_steps(PlanInput(**{**inp.__dict__, "layout": "striped", "mean_doc_len": None}))
    ring_rows = (steps - 1) * len(rows) * inp.s_local
    out = []
    for name in DOC_PLACEMENTS:
        if n % (p if name == "documents" else layout_unit(name, p)):
            continue
        need, work = [0] * p, [0] * p
        for lengths in rows:
            pos = placement_positions(name, lengths, p, windows=lefts)
            need = [a + b for a, b in zip(need, needed_rows(pos, lengths, is_causal=inp.causal, window=window))]
            work = [a + b for a, b in zip(work, rank_work(pos, lengths, windows=lefts))]
        if name == "documents":
            wire = need
            exchange, n_steps = "all-to-all-v", 1 if max(wire) else 0
        else:
            n_steps = ring_steps(PlanInput(**{**inp.__dict__, "layout": name, "mean_doc_len": None}))
            wire = [(n_steps - 1) * len(rows) * inp.s_local] * p
            exchange = "ring"
        fwd = payload_bytes(rows=max(wire) * inp.kv_heads, head_dim=inp.head_dim, itemsize=DTYPE_BYTES[inp.comm_dtype],
                            fp8=inp.comm_dtype == "fp8")  # the ring's and the exchange's payload alike
        out.append(DocPlacement(
            placement=name, exchange=exchange, steps=n_steps, wire_rows_max=max(wire), wire_rows_mean=sum(wire) / p,
            needed_rows_max=max(need), needed_rows_mean=sum(need) / p, ring_rows=ring_rows, fwd_bytes_max=fwd,
            balance=max(work) * p / sum(work) if sum(work) else 1.0, rank_pairs=tuple(work)))
    return out
