"""Errors that every rank raises alike: one all-gather of a short string per phase. Used by the
checkpoints (checkpoint/dcp.py, which re-raises DCP's failures as ``CheckpointError``).

Note [Agreeing on checkpoint errors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A check that fails on one rank only (its share of the checksums, a file it could not read, a bad
argument) must not leave the others waiting in the next collective. Each phase of a save or load runs
its local work, then one all-gather of a short UTF-8 string per rank (an error, or a payload such as
the save token; raw bytes, nothing pickled): if any rank failed, every rank raises the error of the
lowest failing rank, as ``ValueError`` (a bad argument) or ``CheckpointError`` (a ``RuntimeError``:
the files), cause first. DCP's own failures arrive on every rank as its ``CheckpointException`` (a
``BaseException``, missed by ``except Exception``); they are re-raised as ``CheckpointError`` with the
first failing rank's exception first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .comm import all_gather_host, all_gather_objects, host_group


def rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_gather_strings(text: str) -> list[str]:
    """Every rank's ``text`` (UTF-8 over the default group; two all-gathers, no pickling)."""
    if not dist.is_initialized():
        return [text]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = text.encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    width = max(1, max(int(s) for s in sizes))
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.empty(width, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(bufs, mine.to(device))
    return [b[: int(s)].cpu().numpy().tobytes().decode() for b, s in zip(bufs, sizes)]


def agreed(fn: Callable[[], Any], doing: str, payload: Callable[[Any], str] = lambda _: "", *,
           wrap: Callable[[Exception, str], Exception] = lambda e, doing: e,
           kinds: dict[str, type[Exception]] | None = None) -> list[str]:
    """Run ``fn`` here; raise on every rank if it raised on any; else every rank's ``payload(fn())``.
    ``wrap(e, doing)``: the exception this rank raises for ``e``; ``kinds``: exception class names the
    other ranks re-create (by the failing rank's class name; default ``RuntimeError``)."""
    err, text = None, ""
    kinds = {"ValueError": ValueError, **(kinds or {})}
    try:
        text = "P" + payload(fn())
    except Exception as e:  # noqa: BLE001 -- handed to every rank below
        err = wrap(e, doing)
        text = f"E{type(err).__name__}\0{err}"
    texts = _all_gather_strings(text)
    rank, world = rank_world()
    for r, t in enumerate(texts):
        if t.startswith("E"):
            if r == rank:
                raise err
            kind, msg = t[1:].split("\0", 1)
            cls = kinds.get(kind, kinds.get("", RuntimeError))
            raise cls(f"{msg} [rank {r} of {world}]")
    return [t[1:] for t in texts]


def agree_on_call(error: str | None, fingerprint: dict[str, int], group: dist.ProcessGroup, *, what: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` -- before the caller's first collective --
    when any rank's local checks failed (``error``: this rank's text, or None) or the ranks' ``fingerprint``
    (host ints, the same keys on every rank: lengths, options) differ. One all-gather of P small int64
    vectors over the group's host twin (``comm.host_group``: no device sync); the error texts travel
    only when some rank failed. The entry checks of ``torch_api.context_parallel`` and
    ``context_parallel_unshard``; the ring's own check is Note [Agreeing before the ring] in checks.py."""
    hosts = host_group(group)
    world = dist.get_world_size(hosts)
    if world > 1:
        mine = torch.tensor([int(error is None), *fingerprint.values()], dtype=torch.int64)
        every = all_gather_host(mine, hosts)  # [P, 1 + len(fingerprint)]
        if not bool((every[:, 0] == 1).all()):
            bad = [(r, e) for r, e in enumerate(all_gather_objects(error, hosts)) if e is not None]
            raise ValueError(f"{what} rejected the arguments of rank(s) {', '.join(str(r) for r, _ in bad)}: {bad[0][1]}")
        differ = [name for i, name in enumerate(fingerprint, 1) if bool((every[:, i] != every[0, i]).any())]
        if differ:
            table = "; ".join(f"rank {r}: " + ", ".join(f"{n}={every[r, 1 + list(fingerprint).index(n)].item()}"
                                                        for n in differ) for r in range(world))
            raise ValueError(f"{what} needs the same {', '.join(differ)} on every rank of the CP group; got {table}. "
                             "Every rank must pass the same arguments, with tensors of the same shapes.")
    if error is not None:
        raise ValueError(error)
