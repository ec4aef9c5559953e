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
