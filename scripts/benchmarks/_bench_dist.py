"""The scripts' name for the one rank launcher, tests/_dist.py: forked CPU/gloo ranks, one intra-op
thread each, file rendezvous in a fresh temp dir, a timeout on every collective; the first failing
rank's traceback is raised here. Benchmarks wait longer than tests (``timeout_s``, default 30 min)."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from _dist import RankFailure  # noqa: E402
from _dist import run_ranks as _run_ranks

__all__ = ["RankFailure", "run_ranks"]


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 1800.0,
              start_method: str = "fork") -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; the per-rank results in rank order.
    The caller must be single-threaded (``torch.set_num_threads(1)``) so no OpenMP pool crosses the fork."""
    return _run_ranks(world, fn, *args, timeout=timeout_s, collective_timeout=timedelta(seconds=timeout_s),
                      start_method=start_method)
