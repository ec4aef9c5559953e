"""The CP collator of the Trainer integration (trainer.py): the user's collator on a replica's examples, then
this rank's shard of every [B, N] tensor, labels shifted on the full row. See Note [The Trainer under CP] in
trainer.py (point 1).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .._deprecated import old_keywords
from ..core.batch import shard_batch
from ..core.plan.documents import DocumentLayout
from ..core.plan.layout import layout_unit, local_positions
from .attention import shift_labels
from .documents import full_plan

__all__ = ["META", "CollatedBatch", "ShardingCollator"]

META = "_cp_dtensor_batch"  # the private batch key (a CollatedBatch), popped by the trainer's step hooks
_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")  # dropped: see the Note
_PAD = {"labels": -100, "shift_labels": -100}  # the pad value per key (else 0; position_ids continue)


class CollatedBatch(NamedTuple):
    """What the collator tells the step hooks about the full batch."""

    length: int  #: N, the rows' length before the layout's padding
    fingerprint: int  #: a digest of the full batch, compared across the CP ranks
    added: tuple[str, ...]  #: the keys the CP collator added (position_ids, shift_labels)
    real: Tensor | None = None  #: [S_local] bool ([B, S_local] for a plan), this rank's positions of the user's row (None: no CP padding)
    plan: DocumentLayout | None = None  #: layout="documents": the batch's plan, for the model call (cp_layout=)
    error: str | None = None  #: dynamic: this rank's batch error, agreed over the grid before any token moves


def _fingerprint(batch: Mapping) -> int:
    """A 64-bit digest of every tensor in the full batch (identical batches, identical digests)."""
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(batch):
        value = batch[key]
        h.update(key.encode())
        if isinstance(value, Tensor):
            h.update(str((tuple(value.shape), value.dtype)).encode())
            h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


class ShardingCollator:
    """Wraps a collator: the user's collator on the replica's examples, then this rank's shard of every
    [B, N] tensor, labels shifted on the full row. See Note [The Trainer under CP] in trainer.py."""

    @old_keywords("cp_dtensor.hf.ShardingCollator", positional=("layout",), npos=3, cp_mesh="mesh")
    def __init__(self, collator, mesh: DeviceMesh, *, layout: str, windows=None, dynamic: bool = False):
        self.collator, self.mesh, self.layout, self.windows = collator, mesh, layout, windows
        self.dynamic = dynamic  # the full rows, padded: the trainer plans the global batch (hf/dynamic.py)

    def __call__(self, features):
        batch = self.collator(features)
        if not isinstance(batch, Mapping):
            raise ValueError(f"context parallelism needs the collator to return a dict of tensors; got "
                             f"{type(batch).__name__}.")
        batch = {k: v for k, v in batch.items() if k not in _VARLEN}
        ids = batch.get("input_ids")
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            raise ValueError("context parallelism shards batches by their input_ids [B, N]; the collator returned "
                             f"input_ids={getattr(ids, 'shape', ids)!r} (inputs_embeds and multi-axis inputs are not "
                             "served). Collate token ids.")
        b, n = ids.shape
        fingerprint = _fingerprint(batch)
        added = tuple(k for k in ("position_ids", "shift_labels") if batch.get(k) is None)
        if batch.get("position_ids") is None:  # what transformers uses without them: arange per row
            batch["position_ids"] = torch.arange(n).expand(b, n)
        if isinstance(batch["position_ids"], Tensor) and batch["position_ids"].shape == (1, n):
            batch["position_ids"] = batch["position_ids"].expand(b, n)
        if batch.get("labels") is not None and batch.get("shift_labels") is None:
            batch["shift_labels"] = shift_labels(batch["labels"])  # on the full row: Note [The Trainer under CP]
        keys = [k for k, v in batch.items() if isinstance(v, Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (b, n)]
        if any(k in batch and k not in keys for k in ("position_ids", "attention_mask", "labels")):
            bad = {k: tuple(batch[k].shape) for k in ("position_ids", "attention_mask", "labels")
                   if isinstance(batch.get(k), Tensor) and k not in keys}
            raise ValueError(f"context parallelism shards every [B, N] = [{b}, {n}] tensor alike; the collator returned "
                             f"{bad} (multi-axis positions and 4-D masks are not served).")
        if self.dynamic:  # the trainer pads the replicas' rows to one length, plans and moves them
            return _full_rows(batch, n, fingerprint, added)
        cp = self.mesh.size()
        pad = -n % (cp if self.layout == "documents" else layout_unit(self.layout, cp))
        if pad:
            for k in keys:
                batch[k] = _pad(batch[k], k, pad)
        layout = self.layout
        if layout == "documents":  # the plan of the full batch: Note [One plan per batch in transformers]
            mask = batch.get("attention_mask")
            layout = full_plan("documents", cp, position_ids=batch["position_ids"], windows=self.windows,
                               attention_mask=mask if isinstance(mask, Tensor) and mask.dim() == 2 else None,
                               where="cp_dtensor.hf.ShardingCollator")
        out = shard_batch({k: batch[k] for k in keys}, self.mesh, layout=layout)
        out.update({k: v for k, v in batch.items() if k not in out})
        real = None  # the layout's padding is CP's own: the token counts leave it out (Note [The Trainer under CP] 3)
        if pad:
            real = local_positions(layout=layout, rank=self.mesh.get_local_rank(), cp_size=cp, seq_len=n + pad) < n
        out[META] = CollatedBatch(n, fingerprint, added, real, None if isinstance(layout, str) else layout)
        return out


def _full_rows(batch: dict, n: int, fingerprint: int, added: tuple) -> dict:
    """dynamic=True: the replica's full rows, the padding mask checked and dropped (the documents come from the
    position ids), and which tokens are the user's (``real`` [B, N], all True: the trainer's padding is not)."""
    mask, error = batch.get("attention_mask"), None
    if isinstance(mask, Tensor) and not bool((mask[:, :n] != 0).all()):
        error = ("with_context_parallel(dynamic=True) takes packed rows without padding inside them (the documents "
                 "come from position_ids restarting at 0); the collator returned an attention_mask with zeros. Pack "
                 "the rows (DataCollatorWithFlattening, TRL's padding_free) or drop dynamic=True.")
    out = {k: v for k, v in batch.items() if k != "attention_mask"}
    real = torch.ones(batch["input_ids"].shape, dtype=torch.bool)
    out[META] = CollatedBatch(n, fingerprint, added, real, None, error)
    return out


def _pad(x: Tensor, key: str, pad: int) -> Tensor:
    """[B, N, ...] -> [B, N + pad, ...]: labels -100, positions continuing each row, the rest 0."""
    if key == "position_ids":
        return torch.cat([x, x[:, -1:] + torch.arange(1, pad + 1, dtype=x.dtype)], dim=1)
    tail = torch.full((x.shape[0], pad, *x.shape[2:]), _PAD.get(key, 0), dtype=x.dtype, device=x.device)
    return torch.cat([x, tail], dim=1)
