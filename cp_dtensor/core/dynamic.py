"""Dynamic CP: one document plan over the whole dp x cp grid, per global batch (``shard_batch(...,
dynamic=True)``), and the plan's balance report.

Note [One plan over the grid]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With a fixed mesh every dp rank shards its own packed rows over its cp group: the ``documents`` layout
balances the work inside a row, but the step waits for the dp rank that drew the longest documents
(attention work grows with the square of a document's length). A dynamic batch plans the *global* batch
instead: the dp ranks' rows (each row's documents its own; rows never attend each other) laid end to end
as one row of ``dp * B * N`` tokens, placed by ``document_layout`` over all ``P = dp * cp`` ranks of the
flattened group. A short document stays whole on one rank (data parallelism: no exchange), a long one is
cut over as many ranks as its work needs; every rank holds ``B * N / cp`` tokens, as with the static grid.

Before anything moves, the ranks agree (one all-gather of small objects over the flattened group): every
rank's local checks, its batch's shapes, and its rows' document lengths (run lengths of the ids, not the
tokens). A 2-D mesh's cp ranks of one dp rank must hold the same rows; its cp rank 0's lengths stand for
them. Every rank then builds the same plan, and the batch's tensors (token ids, labels, positions: never
activations) move in one all-to-all-v each: a token a rank of its own dp group holds is taken from that
rank itself (no bytes), another dp group's token from cp rank ``g mod cp`` of that group (spreading the
sends). The receiver orders what arrives by the plan (a stable sort by sender: each sender sends in the
receiver's order). Positions stay the original ones (RoPE is unchanged); the attention runs over the
flattened group with the plan (the document exchange sends only the K/V rows the masks need).

The result equals the static documents run: the same tokens, the same documents, the same masks, only
placed elsewhere. Each rank's loss is its tokens' summed loss over the *global* count of valid tokens
(``DynamicBatch.valid_tokens``), and the gradients are summed over the flattened group once (FSDP over
dp x cp, or ``reduce_gradients(model, dyn.mesh)``): both sum every token's loss over the global count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .._compat import mesh_flatten
from .agreement import Rules, agree_objects
from .plan.documents import DocumentLayout, document_layout, full_document_ids

__all__ = ["DynamicBatch", "plan_report", "shard_dynamic", "shard_on_grid"]


class DynamicBatch(NamedTuple):
    """``shard_batch(..., dynamic=True)``'s result: ``batch, plan, mesh = shard_batch(...)``."""

    batch: Any  #: this rank's tokens, same structure as given: each tensor [1, B * N / cp, ...]
    plan: DocumentLayout  #: the global batch's plan over every rank of ``mesh`` (one row of dp * B * N)
    mesh: DeviceMesh  #: the flattened dp x cp mesh: the attention's, the loss count's, the gradients'

    def valid_tokens(self, labels: Tensor, *, ignore_index: int = -100) -> int:
        """The global batch's count of labels that are not ``ignore_index`` (one all-reduce over ``mesh``):
        what each rank divides its summed loss by, so that the ranks' losses add up to the global mean."""
        n = (labels != ignore_index).sum().reshape(1).to(torch.int64)
        dist.all_reduce(n, group=self.mesh.get_group())
        return int(n.item())


def _local_error(leaves: list[tuple[str, Tensor]], ids: Tensor | None, layout, seq_dim: int, cp: int,
                 given: str | None) -> str | None:
    """This rank's input errors (no communication), or None."""
    where = "shard_batch(dynamic=True)"
    if layout != "documents":
        return (f"{where} plans packed documents over the dp x cp grid: it needs layout='documents'; got "
                f"layout={layout!r}. Pass layout='documents' (or drop dynamic=True for a fixed layout).")
    if given is not None:
        return given
    if ids is None:
        return (f"{where} needs the batch's documents: pass document_ids= or position_ids= (restarting at 0 for "
                "every document).")
    if seq_dim != 1:
        return f"{where} shards tensors [B, N, ...] (seq_dim=1); got seq_dim={seq_dim}."
    b, n = ids.shape
    for key, t in leaves:
        if t.dim() < 2 or tuple(t.shape[:2]) != (b, n):
            return (f"{where}: every tensor of the batch must follow the document ids [B, N] = [{b}, {n}] in its first "
                    f"two dims; batch{key} has shape {tuple(t.shape)}. Pass labels and positions of the same rows "
                    "and length as the ids.")
    if n == 0 or (b * n) % cp:
        return (f"{where}: each rank holds B * N / cp tokens; B * N = {b} * {n} is not divisible by cp = {cp}. "
                f"Pad the rows to a multiple of {cp}.")
    bad = torch.nonzero(ids[:, 1:] < ids[:, :-1])
    if bad.numel():
        row, pos = bad[0].tolist()
        return (f"{where}: document_ids must not decrease along a row; row {row} drops at position {pos + 1}. Pass "
                "ids that only grow (e.g. a cumulative count of document starts).")
    return None


def _grid(mesh: DeviceMesh) -> tuple[DeviceMesh, int]:
    """(the flattened mesh, cp) of a 1-D mesh (every rank its own rows: cp 1) or a named (dp, cp) mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"shard_batch(dynamic=True) takes a DeviceMesh; got {type(mesh).__name__}.")
    if mesh.ndim == 1:
        return mesh, 1
    if mesh.ndim != 2 or not mesh.mesh_dim_names:
        raise ValueError(f"shard_batch(dynamic=True) takes the (dp, cp) mesh (2-D, named dims, e.g. "
                         f"world_mesh['dp', 'cp']) or its flattened 1-D group; got a {mesh.ndim}-D mesh "
                         f"{mesh.mesh_dim_names}.")
    return mesh_flatten(mesh), mesh.size(1)


def shard_dynamic(batch, mesh: DeviceMesh, *, leaves: list[tuple[str, Tensor]], rebuild: Callable, seq_dim: int = 1,
                  layout: Any = "documents", document_ids=None, position_ids=None, windows: Any = None) -> DynamicBatch:
    """``shard_batch(batch, mesh, dynamic=True, ...)``: see Note [One plan over the grid].

    ``batch``: this dp rank's full rows, each tensor [B, N, ...] (the same on the cp ranks of one dp rank);
    ``document_ids`` ([B, N], never decreasing along a row) or ``position_ids`` ([B, N], restarting at 0 for
    every document): the rows' documents. ``mesh``: the named (dp, cp) mesh, or a 1-D mesh whose every rank
    brings its own rows. Every rank raises alike on bad input before any token moves. ``leaves``: the batch's
    (key, tensor) entries; ``rebuild(batch, fn)``: the batch with ``fn`` applied to each (core/batch.py's)."""
    flat, cp = _grid(mesh)
    return shard_on_grid(batch, flat, cp, leaves=leaves, rebuild=rebuild, seq_dim=seq_dim, layout=layout,
                         document_ids=document_ids, position_ids=position_ids, windows=windows)


def shard_on_grid(batch, flat: DeviceMesh, cp: int, *, leaves: list[tuple[str, Tensor]] | None = None,
                  rebuild: Callable | None = None, seq_dim: int = 1, layout: Any = "documents", document_ids=None,
                  position_ids=None, windows: Any = None) -> DynamicBatch:
    """:func:`shard_dynamic` on the flattened grid ``flat`` (1-D, flat rank ``d * cp + c``: a torchtitan job's
    "loss" mesh) whose runs of ``cp`` ranks share one dp rank's rows. ``batch``: a tuple of tensors unless
    ``leaves`` / ``rebuild`` say otherwise."""
    if leaves is None:
        leaves = [(f"[{i}]", t) for i, t in enumerate(batch)]
        rebuild = lambda b, fn: tuple(fn(t) for t in b)  # noqa: E731
    world, rank = flat.size(), flat.get_local_rank()
    given, ids, where = None, None, "shard_batch(dynamic=True)"
    try:
        ids = full_document_ids(document_ids=document_ids, position_ids=position_ids, where=where)
        if ids is not None:
            name, src = ("document_ids", document_ids) if document_ids is not None else ("position_ids", position_ids)
            if src.dim() != 2:
                given = f"{where} takes the rows' {name} as [B, N]; got shape {tuple(src.shape)}."
            ids = ids.detach().to("cpu", torch.int64)
    except (TypeError, ValueError) as e:
        given = str(e)
    error = _local_error(leaves, ids, layout, seq_dim, cp, given)
    shapes = "?" if error else ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                                         for _, t in leaves)
    lengths = None if error else [torch.unique_consecutive(r, return_counts=True)[1].tolist() for r in ids]
    rules = Rules(where, ("batch shapes", "windows"),
                  advice="Every rank passes its rows of one global batch: equal shapes on every rank (pad the rows).")
    every = agree_objects(rules, (shapes, repr(windows)), error, flat.get_group(), extra=lengths)
    for d in range(world // cp):  # the cp ranks of one dp rank hold the same rows
        for c in range(1, cp):
            if every[d * cp + c] != every[d * cp]:
                raise ValueError(f"{where}: ranks {d * cp} and {d * cp + c} (cp ranks of dp rank {d}) hold rows "
                                 "with other documents; the cp ranks of a dp rank must pass the same rows (load "
                                 "the batch per dp rank, not per rank).")
    b, n = ids.shape
    glob = torch.tensor([x for d in range(0, world, cp) for row in every[d] for x in row], dtype=torch.int64)
    gids = torch.repeat_interleave(torch.arange(glob.numel()), glob)[None]  # [1, dp * B * N]
    plan = replace(document_layout(gids, world, windows=windows), row_len=n)  # n: the rows' length (DSA reads it)
    return DynamicBatch(rebuild(batch, _mover(plan, flat, rank, world, cp, b * n)), plan, flat)


def _mover(plan: DocumentLayout, flat: DeviceMesh, rank: int, world: int, cp: int,
           m: int) -> Callable[[Tensor], Tensor]:
    """A tensor [B, N, ...] of this dp rank's rows -> this rank's planned tokens [1, S, ...]: one all-to-all-v
    (Note [One plan over the grid])."""
    s = plan.s_local
    order = plan.order[0].view(world, s)  # [P, S]: the global tokens each rank holds, in its order
    dest = torch.arange(world)[:, None]
    group_of, local = order // m, order % m  # the dp rank whose rows hold each token, and its flat index there
    src = torch.where(group_of == dest // cp, dest, group_of * cp + local % cp)  # [P, S]: who sends it
    mine = src == rank
    send_idx = local[mine]  # dest-major, in each dest's order
    send_splits = mine.sum(1).tolist()
    by_sender = torch.sort(src[rank], stable=True).indices  # the receive buffer's slots, sender-major
    recv_splits = torch.bincount(src[rank], minlength=world).tolist()
    group = flat.get_group()

    def move(x: Tensor) -> Tensor:
        flat_x = x.reshape(m, *x.shape[2:])
        send = flat_x[send_idx.to(x.device)].contiguous()
        got = funcol.wait_tensor(funcol.all_to_all_single(send, recv_splits, send_splits, group))  # [S, ...]
        out = torch.empty_like(got)
        out[by_sender.to(x.device)] = got
        return out.unsqueeze(0)

    return move


def plan_report(plan: DocumentLayout, *, linear: int = 0, dp: int = 1) -> dict:
    """The plan's balance, from the plan alone (no communication): ``work``: max / mean over ranks of the kept
    causal query-key pairs of its layers (plus ``linear`` pair-equivalents a token for the other layers),
    ``rows``: K/V rows each rank receives a layer under the causal mask (max over ranks; the document
    exchange sends exactly these), ``tokens``: tokens a rank (equal on every rank); with ``dp`` > 1 also
    ``dp_rows``: max / mean of the same work over the ``dp`` rank's own rows (each 1 / dp of the plan's row):
    a lower bound of the static grid's max / mean, which waits for the busiest dp rank."""
    world, s, (b, n) = plan.cp_size, plan.s_local, plan.ids.shape
    new = torch.ones((b, n), dtype=torch.bool)
    new[:, 1:] = plan.ids[:, 1:] != plan.ids[:, :-1]
    pos = torch.arange(n).expand(b, n)
    off = pos - torch.where(new, pos, 0).cummax(1).values  # [B, N]: each token's offset in its document
    pairs = torch.zeros_like(off)
    for left in plan.windows:  # kept causal keys of each query, every layer
        pairs += off + 1 if left is None else torch.clamp(off + 1, max=left + 1)
    work = pairs.gather(1, plan.order).view(b, world, s).sum((0, 2)) + linear * s * b
    owner = torch.empty_like(plan.order)  # [B, N]: the rank holding each token
    owner.scatter_(1, plan.order, (torch.arange(n) // s).expand(b, n))
    doc = new.long().cumsum(1) - 1  # [B, N]: each token's document 0, 1, ... along its row
    docs = int(doc[:, -1].max()) + 1
    slot = ((torch.arange(b)[:, None] * world + owner) * docs + doc).view(-1)  # (row, holder, document) of each token
    last = torch.full((b * world * docs,), -1, dtype=torch.int64)  # each rank's last query of each document
    last.scatter_reduce_(0, slot, pos.reshape(-1), "amax")
    held = torch.bincount(slot, minlength=b * world * docs)  # the tokens each rank holds of each document
    first = torch.zeros(b * docs, dtype=torch.int64)  # each document's first position
    first.scatter_reduce_(0, (torch.arange(b)[:, None] * docs + doc).view(-1), pos.reshape(-1), "amin", include_self=False)
    first = first.view(b, 1, docs).expand(b, world, docs).reshape(-1)
    # causal: a rank's queries of a document need its keys from the start to the rank's last query; it holds its own
    need = torch.where(last >= 0, last - first + 1 - held, 0)
    rows = need.view(b, world, docs).sum((0, 2))
    out = {"work": int(work.max()) * world / int(work.sum()), "rows": int(rows.max()), "tokens": s * plan.batch}
    if dp > 1:
        per_dp = (pairs.view(b, dp, n // dp).sum((0, 2)) + linear * n // dp * b).tolist()
        out["dp_rows"] = max(per_dp) * dp / sum(per_dp)
    return out
