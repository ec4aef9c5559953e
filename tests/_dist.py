"""The one launcher for CPU/gloo ranks: every multi-rank test and script (scripts/ via _bench_dist.py).

Ranks are forked (no re-import of torch), rendezvous through a file in a fresh temp dir (never a fixed
port), run with one intra-op thread each, and give every collective a timeout. One call runs one
function on every rank; put many cases inside that function rather than spawning per case. When any
rank fails or the deadline passes, every rank is killed and the failing rank's traceback is raised.
Return plain Python values or numpy arrays from ``fn``: a tensor's storage would travel as a file
descriptor that dies with the rank.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def _worker(rank: int, world: int, init_method: str, timeout: timedelta, fn: Callable, args: tuple,
            results: Any) -> None:
    code = 0
    faulthandler.enable()  # a crash prints this rank's Python stack to stderr (pytest shows it with the failure)
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


# A rank's failure closes its sockets, so its peers fail next with one of these: an echo, not the cause.
_ECHOES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Timed out waiting")


def _failure_report(world: int, failed: dict[int, str], results: Any, procs: list, grace: float = 10.0) -> str:
    """Every failing rank's traceback, the cause first: the first to arrive may be a peer's echo of it (a
    rank puts its traceback through the queue's feeder thread while its sockets already close), and a rank
    killed by a signal (a crash, the OOM killer) sends none, so wait ``grace`` seconds for the others and
    name the ranks that died silent by their exit codes."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and len(failed) < world:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        if not ok:
            failed[rank] = payload
    silent = {r: p.exitcode for r, p in enumerate(procs) if r not in failed and not p.is_alive() and p.exitcode}
    order = sorted(failed, key=lambda r: (any(e in failed[r] for e in _ECHOES), r))
    parts = [f"rank {r} of {world} exited with code {code} without a traceback (a signal if negative)"
             for r, code in sorted(silent.items())]
    parts += [f"rank {r} of {world} failed:\n{failed[r]}" for r in order]
    return "\n".join(parts)


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
                    raise RankFailure(_failure_report(world, {rank: payload}, results, procs))
                out[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=5 if len(out) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world)]
