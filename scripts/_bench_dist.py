"""Start P CPU/gloo ranks for bench_ring.py: forked, one intra-op thread each, file rendezvous in a
fresh temp dir, a timeout on every collective; the first failing rank's traceback is raised here."""

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


def _worker(rank: int, world: int, init: str, timeout_s: float, fn: Callable, args: tuple, results) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        results.close()
        results.join_thread()
        os._exit(code)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 1800.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` forked gloo ranks; the per-rank results in rank order.
    The caller must be single-threaded (``torch.set_num_threads(1)``) so no OpenMP pool crosses the fork."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, world, init, timeout_s, fn, args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            while len(out) < world:
                try:
                    rank, ok, payload = results.get(timeout=timeout_s)
                except queue.Empty:
                    raise RuntimeError(f"bench ranks {sorted(set(range(world)) - set(out))} of {world} "
                                       f"did not finish within {timeout_s:.0f}s") from None
                if not ok:
                    raise RuntimeError(f"bench rank {rank} of {world} failed:\n{payload}")
                out[rank] = payload
        finally:
            for p in procs:
                p.join(timeout=5 if len(out) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world)]
