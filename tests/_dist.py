"""The one launcher for CPU/gloo ranks: every multi-rank test and script (scripts/ via _bench_dist.py).

Ranks are forked (no re-import of torch), rendezvous through a file in a fresh temp dir (never a fixed
port), run with one intra-op thread each, and give every collective a timeout. One call runs one
function on every rank; put many cases inside that function rather than spawning per case. When any
rank fails or the deadline passes, every rank is killed and the failing rank's traceback is raised.
Return plain Python values or numpy arrays from ``fn``: a tensor's storage would travel as a file
descriptor that dies with the rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _worker(rank: int, world: int, init_method: str, timeout: timedelta, fn: Callable, args: tuple,
            results: Any) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:  # report everything, including SystemExit from a test helper
        results.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        # Flush the queue's feeder thread, then skip pytest's atexit machinery inherited through fork.
        results.close()
        results.join_thread()
        os._exit(code)


class RankFailure(AssertionError):
    pass


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
              collective_timeout: timedelta = COLLECTIVE_TIMEOUT, start_method: str = "fork") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results in rank order.
    ``timeout``: seconds to wait for the next rank's result; ``collective_timeout``: each collective's;
    ``start_method="spawn"`` for a fresh interpreter per rank (then ``fn`` must be importable)."""
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, world, init, collective_timeout, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            while len(out) < world:
                try:
                    rank, ok, payload = results.get(timeout=timeout)
                except queue.Empty:
                    raise RankFailure(
                        f"ranks {sorted(set(range(world)) - set(out))} of {world} did not finish "
                        f"within {timeout:.0f}s"
                    ) from None
                if not ok:
                    raise RankFailure(f"rank {rank} of {world} failed:\n{payload}")
                out[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=5 if len(out) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world)]
