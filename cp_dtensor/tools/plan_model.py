"""The whole-model memory of a training rank under CP, with and without sequence tiling; the longest
sequence a rank holds within a budget (``cp-dtensor longest``). Pure arithmetic.

Note [Plan model memory]
~~~~~~~~~~~~~~~~~~~~~~~~
Per rank, one forward + backward of a Llama-shaped decoder (H hidden, I the SwiGLU width, L layers, V the
vocabulary) on S = N / P tokens, in the compute dtype (e bytes) unless stated:

* attention: Note [Plan memory] in plan_ring.py (q, k, v, out, lse saved per layer; one layer's ring working set);
* each layer's other saved activations: 4 H e a token (the two norms' outputs, the two residual inputs)
  and the SwiGLU's 4 I e (gate, up, silu(gate), their product). Tiled (``sequence_tiling``): the MLP
  saves nothing of its own (each tile is recomputed), and one tile of T tokens holds ~6 I e a token
  while it runs (forward, or recompute + its gradients);
* activation checkpointing (``checkpointing="full"``): each layer keeps only its input (H e a token, H e / tp
  under TP's sequence parallelism);
  the layer being recomputed holds its full set (the terms above for one layer);
* the LM head + loss: untiled, the [S, V] logits (e), their fp32 copy, the fp32 softmax / gradient and
  its cast back (e): S V (2e + 8) bytes; tiled, one [T, V] tile of the same, and the hidden gradient.

Pipeline parallelism (``pp`` stages, ``microbatches`` M of one row each): a stage holds ceil(L / pp) layers,
and the saved activations of every microbatch it has run forward but not yet backward -- under 1F1B the
first stage min(pp, M), the last one; under GPipe every stage all M. The head + loss lives on the last
stage (its saved terms once per microbatch in flight there); one layer's ring working set and (with
checkpointing) one layer's recomputation at a time. The rank's figure is its worst stage, first or last.

Tensor parallelism (``tp`` ranks, torchtitan's plan with sequence parallelism) beside CP: each TP rank runs
Hq / tp query and Hkv / tp key/value heads of attention on the same S tokens, and I / tp of the SwiGLU width
(its saved 4 I e, its tile's 6 I e, divided by tp); the residual inputs are sequence-sharded (2 H e / tp a
token), while the two norms' outputs are saved as the column-parallel linears see them, all-gathered
(2 H e a token, not divided); the LM head's logits and loss are vocabulary-sharded (loss parallel: V / tp
columns). ``params_per_rank`` counts the parameters a rank holds: the linears, the embedding and the head
divided by tp, the norms whole, ceil(L / pp) layers and (on its stage) the embedding or the head.

Weights, gradients, optimizer state and allocator slack are ``reserved_gib``. Calibration (CPU, fp32,
vocab 32768, H = 128, I = 512, L = 2, CP = 2, S_local 1024 -> 3072; scripts/benchmarks/bench_tiling.py): the model
says 545.5 KiB a token untiled and 17.5 KiB tiled; measured 540.7 and 5.3 KiB. It is conservative where the
head no longer dominates: it charges attention's whole ring working set, which the measured peak does not
reach at the same moment as the saved activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import DTYPE_BYTES, GIB, PlanInput, memory_bytes

__all__ = ["MODELS", "ModelShape", "longest_s_local", "model_memory", "params_per_rank"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder's sizes (the memory model's inputs)."""

    hidden: int  #: H
    intermediate: int  #: I, the SwiGLU width
    layers: int  #: L
    vocab: int  #: V
    q_heads: int  #: Hq
    kv_heads: int  #: Hkv
    head_dim: int  #: D

    @property
    def params(self) -> int:
        """Parameters (untied embeddings and head)."""
        h, i = self.hidden, self.intermediate
        attn = h * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * h * i + 2 * h) + 2 * self.vocab * h + h


MODELS = {
    "llama3-8b": ModelShape(4096, 14336, 32, 128256, 32, 8, 128),
    "llama3-70b": ModelShape(8192, 28672, 80, 128256, 64, 8, 128),
    "qwen3-8b": ModelShape(4096, 12288, 36, 151936, 32, 8, 128),
    "bench-tiny": ModelShape(128, 512, 2, 32768, 4, 4, 32),  # scripts/benchmarks/bench_tiling.py's model
}


def _check_tp(shape: ModelShape, tp: int) -> None:
    if tp < 1 or shape.q_heads % tp or shape.kv_heads % tp:
        raise ValueError(f"tp ({tp!r}) must be a positive int that divides the query heads ({shape.q_heads}) and the "
                         f"key/value heads ({shape.kv_heads}): each TP rank runs whole heads. Use a divisor of "
                         f"{shape.kv_heads}.")


def params_per_rank(shape: ModelShape, *, tp: int = 1, pp: int = 1) -> int:
    """Parameters one rank holds at ``tp`` x ``pp`` (its worst stage; untied embedding and head). See Note [Plan
    model memory]."""
    _check_tp(shape, tp)
    h, i, v = shape.hidden, -(-shape.intermediate // tp), -(-shape.vocab // tp)
    attn = h * shape.head_dim * (2 * shape.q_heads + 2 * shape.kv_heads) // tp
    layer = attn + 3 * h * i + 2 * h  # q, k, v, o; w1, w2, w3 (I / tp wide); two norms (whole)
    n_layers = -(-shape.layers // pp)
    # the embedding (first stage), the head + final norm (last stage): the last stage is the worst one
    return n_layers * layer + (2 * v * h + h if pp == 1 else v * h + h)


def model_memory(shape: ModelShape, s_local: int, *, cp: int, dtype: str = "bf16", tile: int | None = None,
                 checkpointing: str = "none", reserved_gib: float = 0.0, pp: int = 1, schedule: str = "1F1B",
                 microbatches: int | None = None, tp: int = 1) -> dict[str, int]:
    """Per-rank bytes of one fwd+bwd; ``tile``: sequence tiling's tokens per tile (None: untiled); ``pp``
    pipeline stages running ``schedule`` ("1F1B" or "GPipe") over ``microbatches`` (default ``pp``): the
    worst stage's terms; ``tp``: tensor-parallel ranks beside CP. See Note [Plan model memory]."""
    _check_tp(shape, tp)
    if checkpointing not in ("none", "full"):
        raise ValueError(f"checkpointing must be 'none' or 'full'; got {checkpointing!r}.")
    if tile is not None and tile < 1:
        raise ValueError(f"tile must be a positive int or None; got {tile!r}.")
    m = pp if microbatches is None else microbatches
    if pp < 1 or m < 1 or schedule not in ("1F1B", "GPipe"):
        raise ValueError(f"pipeline: pp and microbatches are positive ints and schedule is '1F1B' or 'GPipe'; got "
                         f"pp={pp!r}, microbatches={microbatches!r}, schedule={schedule!r}.")
    if pp > shape.layers:
        raise ValueError(f"pipeline: pp ({pp}) exceeds the model's {shape.layers} layers; every stage holds at least "
                         f"one layer. Use pp <= {shape.layers}.")
    # a TP rank's share: I / tp of the SwiGLU, V / tp of the head's columns, Hq / tp and Hkv / tp heads
    e, s, h, i, v = DTYPE_BYTES[dtype], s_local, shape.hidden, -(-shape.intermediate // tp), -(-shape.vocab // tp)
    ckpt = checkpointing == "full"
    n_layers = -(-shape.layers // pp)  # the most layers one stage holds
    attn1 = memory_bytes(PlanInput(seq_len=s * cp, cp=cp, head_dim=shape.head_dim, q_heads=shape.q_heads // tp,
                                   kv_heads=shape.kv_heads // tp, dtype=dtype, layers=1, layout="contiguous"))
    attn_layer, attn_work = attn1["saved_all_layers"], max(attn1["forward_working_set"], attn1["backward_working_set"])
    t = s if tile is None else min(tile, s)
    mlp_saved = 0 if tile is not None else 4 * i * e * s  # one layer's SwiGLU, saved for backward
    mlp_tile = 6 * i * e * t if tile is not None else 0  # one tile while it runs
    layer = 2 * h * e * s + 2 * h * e * s // tp + mlp_saved  # norms' outputs (gathered), residuals (sequence-sharded)
    # one microbatch's saved bytes on a stage, and what one recomputed layer adds once (checkpointing)
    mb_layers, mb_attn = (h * e * s // tp * n_layers, 0) if ckpt else (layer * n_layers, attn_layer * n_layers)
    once_layers, once_attn = (layer, attn_layer) if ckpt else (0, 0)
    head = (2 * e + 8) * v * t + 2 * h * e * s  # untiled: t = s
    first = m if schedule == "GPipe" else min(pp, m)  # microbatches in flight on the first stage
    last = m if schedule == "GPipe" else 1
    stages = [(last, head)] if pp == 1 else [(first, 0), (last, head)]
    worst = None
    for k, head_bytes in stages:
        out = {"attention": k * mb_attn + once_attn + attn_work, "layers": k * mb_layers + once_layers,
               "mlp_tile": mlp_tile, "head_loss": k * head_bytes, "reserved": int(reserved_gib * GIB)}
        out["total"] = sum(out.values())
        worst = out if worst is None or out["total"] > worst["total"] else worst
    return worst


def longest_s_local(shape: ModelShape, budget_gib: float, *, cp: int, unit: int = 256, **kw) -> int:
    """The longest S_local (a multiple of ``unit``) whose ``model_memory`` total fits ``budget_gib``; 0 if none."""
    fits = lambda s: model_memory(shape, s, cp=cp, **kw)["total"] <= budget_gib * GIB  # noqa: E731
    if not fits(unit):
        return 0
    lo, hi = unit, 2 * unit
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > unit:
        mid = (lo + hi) // 2 // unit * unit
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
