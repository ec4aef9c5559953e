"""The planner behind ``cp-dtensor plan``, torch-free, in one import: the ring's cost model of one
configuration (plan_ring.py: bytes, FLOPs, memory, overlap; Notes [Plan communication], [Plan FLOPs],
[Plan memory]) the comparison of the K/V exchanges (plan_exchanges.py; Note [Plan exchanges]) and the placements of a
batch of packed documents (plan_documents.py; Note [Plan documents]).
"""

from __future__ import annotations

from .plan_documents import (
    DOC_PLACEMENTS,
    DocPlacement,
    compare_placements,
    doc_rows,
    lognormal_lengths,
    parse_doc_lengths,
    placement_positions,
)
from .plan_exchanges import Exchange, compare_exchanges, recommend
from .plan_ring import (  # noqa: F401 -- _rank_pairs, _step_work, _timing: their old home (tests use them)
    BWD_FLOP_FACTOR,
    COMPUTE_DTYPES,
    DTYPE_BYTES,
    GIB,
    Plan,
    PlanInput,
    StepWork,
    _rank_pairs,
    _step_work,
    _timing,
    dkv_step_bytes,
    doc_factor,
    kv_step_bytes,
    make_plan,
    memory_bytes,
    parse_tokens,
    ring_steps,
    smallest_cp,
    step_pairs,
)

__all__ = [
    "DTYPE_BYTES",
    "BWD_FLOP_FACTOR",
    "COMPUTE_DTYPES",
    "GIB",
    "PlanInput",
    "StepWork",
    "Plan",
    "parse_tokens",
    "step_pairs",
    "kv_step_bytes",
    "dkv_step_bytes",
    "memory_bytes",
    "make_plan",
    "ring_steps",
    "doc_factor",
    "smallest_cp",
    "Exchange",
    "compare_exchanges",
    "recommend",
    "DOC_PLACEMENTS",
    "DocPlacement",
    "compare_placements",
    "doc_rows",
    "parse_doc_lengths",
    "lognormal_lengths",
    "placement_positions",
]
