"""``with_context_parallel(..., layout="documents", dynamic=True)``: each step's global batch planned over every
rank of the dp x cp grid (the Trainer side of ``shard_batch(..., dynamic=True)``).

Note [Dynamic CP in the Trainer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The collator (``ShardingCollator(dynamic=True)``) hands each rank its replica's *full* rows, padded to a
multiple of cp (labels shifted on the full row, the padding's labels -100), with a ``real`` mask of the
user's tokens; it plans nothing and moves nothing, so it may run in a dataloader worker. The trainer's
``get_batch_samples`` -- the one place that holds every micro-batch of a step before the first forward --
then, for the whole step:

1. agrees over the world (one all-gather of small objects): the number of micro-batches, each one's
   fingerprint (the cp ranks of one replica must hold the same rows, as in Note [The Trainer under CP]) and
   each rank's batch error (padding inside a row). Every rank raises the same error before any token moves;
2. moves each micro-batch with ``core.dynamic.shard_on_grid`` over the flattened (dp, cp) mesh (Note [One
   plan over the grid]): one plan of the global batch over all dp * cp ranks, then one all-to-all of each
   [B, N] tensor (token ids, positions, labels, shift_labels, the ``real`` mask: never activations). The
   plan rides in the batch's ``CollatedBatch`` to the model call (``cp_layout=``), as the static documents
   layout's does; the model's ring runs over the flattened mesh (``apply_context_parallel`` was given it);
3. counts the step's valid labels on the moved shards: the Trainer's own ``_get_num_items_in_batch``
   gathers them over the world, so ``num_items_in_batch`` is the global count, every token once.

Each rank's loss is then the Trainer's own: its tokens' summed loss over the global count, times the
number of processes (the world: every rank is a process of the data-parallel average); DDP or FSDP2 over the
world averages it once, so the gradient is the global batch's mean, the static run's. Token counts leave the
layout's padding out through the moved ``real`` mask.

Evaluation (``evaluate()``, ``predict()``, ``eval_strategy`` during training) does not plan over the grid: it
runs the static documents path the trainer runs without ``dynamic=True``. The eval and test dataloaders get
the static collator (:func:`static_collator`: each replica's rows planned over its own CP group and sharded
there, Note [One plan per batch in transformers]), and for the evaluation loop :func:`replica_ring` points the
model's ring at the replica's CP mesh and ``compute_loss`` counts over the replica, as without ``dynamic``
(Note [The Trainer under CP] 4). So ``eval_loss``, the logits and the labels the loop gathers are the static
documents trainer's -- the same code on the same shards, in each replica's own row order -- not merely equal to
rounding. Why not plan evaluation over the grid and move the logits back with the inverse of the plan's
all-to-all: the plan moves token ids (a few bytes a token); its inverse would move [tokens, vocab] logits,
thousands of times more bytes, for metrics that the per-replica path gets exactly with no move at all.
What the grid buys in training is balance across the gradient all-reduce each step waits for; an evaluation
step has no backward and no gradient reduction, and a rank holds its replica's rows over P -- no more tokens
than in training on rows as long (training pads every replica's rows to the longest), so memory stays within
training's. The price is evaluation's imbalance across replicas (the static grid's), paid in evaluation time only.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from ..core.dynamic import shard_on_grid
from ..core.exchange.comm import all_gather_objects, host_group
from .collator import META, CollatedBatch, ShardingCollator
from .state import state_of

__all__ = ["dynamic_refusal", "move_batches", "replica_ring", "static_collator"]

WHERE = "with_context_parallel(dynamic=True)"


def dynamic_refusal(args, cp: int) -> str | None:
    """What a dynamic trainer cannot run (configuration only: every rank alike, before any collective)."""
    world = args.world_size
    if world // cp < 2:
        return (f"{WHERE} plans each step's global batch over the data-parallel replicas and their CP ranks; "
                f"with one replica (world size {world} = cp_size {cp}) there is no data-parallel dimension to "
                "balance over. Drop dynamic=True (layout='documents' alone), or launch a multiple of cp_size "
                "processes with 2 or more replicas.")
    return None


def static_collator(collator: ShardingCollator) -> ShardingCollator:
    """The dynamic collator's static twin (the same user collator, CP mesh, windows): evaluation's, which shards
    each replica's rows over its own CP group. See Note [Dynamic CP in the Trainer]."""
    return ShardingCollator(collator.collator, collator.mesh, layout=collator.layout, windows=collator.windows)


@contextlib.contextmanager
def replica_ring(model, mesh: DeviceMesh):
    """The model's ring over ``mesh`` (the replica's CP group) inside the block, the grid's again after it (even
    when the block raises). See Note [Dynamic CP in the Trainer]."""
    state = state_of(model)
    grid, state.mesh = state.mesh, mesh
    try:
        yield
    finally:
        state.mesh = grid


def move_batches(batches: list, flat: DeviceMesh, cp: int, windows) -> list:
    """A step's micro-batches (each a replica's full rows from the dynamic collator) -> this rank's planned
    tokens of each: see Note [Dynamic CP in the Trainer]. Every rank raises alike before any token moves."""
    metas = [b.get(META) if isinstance(b, dict) else None for b in batches]
    local = None
    if any(not isinstance(m, CollatedBatch) or m.plan is not None or m.real is None for m in metas):
        local = (f"{WHERE}: a batch did not come through the trainer's dynamic collator (ShardingCollator(dynamic="
                 "True)); a custom get_train_dataloader must use self.data_collator.")
    else:
        local = next((m.error for m in metas if m.error is not None), None)
    mine = (len(batches), [getattr(m, "fingerprint", None) for m in metas], local,
            [None if m is None or m.real is None else m.real.shape[-1] for m in metas])
    every = all_gather_objects(mine, host_group(flat.get_group()))  # flat rank d * cp + c
    error = next((f"rank {r}: {e[2]}" for r, e in enumerate(every) if e[2] is not None), None)
    counts = {e[0] for e in every}
    if error is None and len(counts) > 1:
        error = (f"{WHERE}: the ranks hold different numbers of micro-batches this step ({[e[0] for e in every]}); "
                 "every replica must draw the same number of batches (keep accelerate's even_batches).")
    bad = [r // cp for r in range(0, len(every), cp) if any(every[r + c][1] != every[r][1] for c in range(cp))]
    if error is None and bad:
        error = (f"{WHERE}: the CP ranks of data-parallel replica(s) {bad} were handed different batches: a sampler "
                 "that counts ranks instead of replicas, or a collator that draws random numbers. Every CP rank "
                 "must collate the same examples alike.")
    if error is not None:
        raise ValueError(error)
    # one length for every replica's rows: the longest, up to a multiple of cp
    length = [-(-max(e[3][i] for e in every) // cp) * cp for i in range(len(batches))]
    return [_move(b, m, flat, cp, windows, n) for b, m, n in zip(batches, metas, length)]


def _move(batch: dict, meta: CollatedBatch, flat: DeviceMesh, cp: int, windows, length: int) -> dict:
    shape = tuple(meta.real.shape)
    keys = [k for k, v in batch.items() if isinstance(v, Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == shape]
    real = meta.real.to(batch["input_ids"].device, torch.int64)
    tensors = tuple(_pad(x, k, length - shape[1]) for k, x in (*((k, batch[k]) for k in keys), ("real", real)))
    batch = {**batch, "position_ids": tensors[keys.index("position_ids")]}
    dyn = shard_on_grid(tensors, flat, cp, position_ids=batch["position_ids"], windows=windows)
    out = {k: v for k, v in batch.items() if k not in keys and k != META}
    out.update(zip(keys, dyn.batch[:-1]))
    moved = dyn.batch[-1].bool().cpu()
    out[META] = meta._replace(real=None if bool(moved.all()) else moved, plan=dyn.plan)  # [1, S]: a plan's
    return out


def _pad(x: Tensor, key: str, pad: int) -> Tensor:
    """[B, N, ...] -> [B, N + pad, ...]: the padding a document of its own (positions from 0: no real token attends
    to it, nor it to them), labels -100, the rest 0 (``real`` False)."""
    if pad == 0:
        return x
    if key == "position_ids":
        tail = torch.arange(pad, dtype=x.dtype, device=x.device).expand(x.shape[0], pad)
    else:
        tail = torch.full((x.shape[0], pad, *x.shape[2:]), -100 if key in ("labels", "shift_labels") else 0,
                          dtype=x.dtype, device=x.device)
    return torch.cat([x, tail], dim=1)


def world_count(labels: Tensor, flat: DeviceMesh) -> Tensor:
    """The global batch's valid labels (one all-reduce over the grid)."""
    n = (labels != -100).sum()
    dist.all_reduce(n, group=flat.get_group())
    return n
