"""The one launcher for CPU/gloo ranks: every multi-rank test and script (scripts/ via _bench_dist.py).

Ranks are forked (no re-import of torch), rendezvous through a file in a fresh temp dir (never a fixed
port), run with one intra-op thread each, and give every collective a timeout. One call runs one
function on every rank; put many cases inside that function rather than spawning per case. When any
rank fails or the deadline passes, every rank is killed and a report is raised: every failing rank's
traceback, a crashed rank's signal and Python stack, and the Python stack of every rank still running
(``_report``).
Return plain Python values or numpy arrays from ``fn``: a tensor's storage would travel as a file
descriptor that dies with the rank.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=60)
GRACE = 10.0  # seconds a failure report waits for the other ranks' tracebacks before it asks for their stacks


def _worker(rank: int, world: int, init_method: str, timeout: timedelta, fn: Callable, args: tuple,
            results: Any, stacks: str, launched: float) -> None:
    code = 0
    # this rank's stderr (a C++ abort's message) and, on a crash or the launcher's SIGUSR1, its Python stack (_report)
    log = open(os.path.join(stacks, f"rank{rank}"), "a")  # noqa: SIM115 -- open until os._exit
    os.dup2(log.fileno(), 2)
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:  # report everything, including SystemExit from a test helper
        # when: of two ranks' tracebacks, the earlier is the cause (a peer's echo follows within milliseconds)
        results.put((rank, False, f"{traceback.format_exc()}(raised {time.time() - launched:.3f} s after the launch)"))
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

# What every rank was doing. A peer's "Connection reset/closed by peer" or "Timed out waiting" says only
# that another rank stopped answering. So each rank sends its stderr and faulthandler to a file of its own
# in the run's temp dir: a C++ abort says why there (gloo's "Received data size doesn't match expected
# size": two ranks in different collectives), a crash (SIGSEGV, SIGABRT, SIGBUS, ...) writes its Python
# stack there, and so does SIGUSR1, which the launcher sends to every rank still alive when it gives up on
# them (a failure elsewhere, or the deadline) before it kills them. A rank that dies silently fails the
# call at once. The report then holds, per rank: its traceback if it raised; its signal, stderr and stack
# if it died (SIGKILL leaves none: the kernel's OOM killer or another process, dmesg says which); its
# stack if it was still running (hung in a collective its peers never joined, or still computing).

_KILLED = " (killed from outside: the kernel's OOM killer -- see dmesg -- or another process)"


_MISMATCH = ("\n(the ranks ran different collectives: rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL, and torch names "
             "each rank's collective and where it was called)")


def _exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
    return f"died of {name}" + (_KILLED if -code == signal.SIGKILL else "")


def _read(stacks: str, rank: int) -> str:
    path = os.path.join(stacks, f"rank{rank}")
    return open(path, errors="replace").read().rstrip() if os.path.exists(path) else ""


def _stacks(stacks: str, procs: list, ranks: list[int], wait: float = 3.0) -> dict[int, str]:
    """The Python stacks of ``ranks`` (alive: asked by SIGUSR1; dead: what a crash wrote), by rank."""
    asked = [r for r in ranks if procs[r].is_alive()]
    for r in asked:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    read = lambda r: _read(stacks, r)  # noqa: E731
    deadline = time.monotonic() + wait
    while any(not read(r) for r in asked) and time.monotonic() < deadline:
        time.sleep(0.05)  # faulthandler writes from the signal handler, without the rank's Python
    time.sleep(0.1 if asked else 0)  # the last lines of a long stack
    return {r: read(r) for r in ranks}


def _failure_report(world: int, failed: dict[int, str], results: Any, procs: list, stacks: str, done) -> str:
    """Every failing rank's traceback, the cause first: the first to arrive may be a peer's echo of it (a
    rank puts its traceback through the queue's feeder thread while its sockets already close), and a rank
    killed by a signal (a crash, the OOM killer) sends none, so wait ``GRACE`` seconds for the others and
    name the ranks that died silent by their signals; then every other rank's stack (:func:`_report`)."""
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline and len(failed) < world:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                break
            continue
        if not ok:
            failed[rank] = payload
    return _report(world, failed, procs, stacks, done)


def _report(world: int, failed: dict[int, str], procs: list, stacks: str, done) -> str:
    """Every rank's part in a failure (see "What every rank was doing" above); ``done``: the ranks that
    returned their result."""
    silent = [r for r in range(world) if r not in failed and r not in done]
    stack = _stacks(stacks, procs, silent)
    order = sorted(failed, key=lambda r: (any(e in failed[r] for e in _ECHOES), r))
    dead = [r for r in silent if not procs[r].is_alive() and procs[r].exitcode]
    parts = [f"rank {r} of {world} {_exit(procs[r].exitcode)} without a traceback; its stderr and stack:\n"
             f"{stack[r] or '(none written)'}" + (_MISMATCH if "doesn't match expected size" in stack[r] else "")
             for r in dead]
    parts += [f"rank {r} of {world} failed:\n{failed[r]}" + (f"\nits stderr:\n{err}" if (err := _read(stacks, r)) else "")
              for r in order]
    parts += [f"rank {r} of {world} was still running; its stderr and stack:\n{stack[r] or '(none written)'}"
              for r in silent if procs[r].is_alive()]
    return "\n".join(parts)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
              collective_timeout: timedelta = COLLECTIVE_TIMEOUT, start_method: str = "fork") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results in rank order.
    ``timeout``: seconds to wait for the next rank's result (a rank that dies silently fails the call at
    once); ``collective_timeout``: each collective's;
    ``start_method="spawn"`` for a fresh interpreter per rank (then ``fn`` must be importable)."""
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        launched = time.time()
        procs = [ctx.Process(target=_worker, args=(r, world, init, collective_timeout, fn, args, results, tmp,
                                                  launched)) for r in range(world)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + timeout
            while len(out) < world:
                try:  # in short waits: a rank that dies without a word (a signal) fails the call at once
                    rank, ok, payload = results.get(timeout=1.0)
                except queue.Empty:
                    if any(p.exitcode for r, p in enumerate(procs) if r not in out):  # its queued words came first
                        raise RankFailure(_failure_report(world, {}, results, procs, tmp, out)) from None
                    if time.monotonic() < deadline:
                        continue
                    late = sorted(set(range(world)) - set(out))
                    raise RankFailure(f"ranks {late} of {world} did not finish within {timeout:.0f}s\n"
                                      + _report(world, {}, procs, tmp, out)) from None
                deadline = time.monotonic() + timeout
                if not ok:
                    raise RankFailure(_failure_report(world, {rank: payload}, results, procs, tmp, out))
                out[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.join(timeout=5 if len(out) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join()
        for r in range(world):  # a run that passed: its ranks' stderr where it went before (warnings, progress)
            if text := _read(tmp, r):
                print(f"[rank {r} stderr]\n{text}", file=sys.stderr)
    return [out[r] for r in range(world)]
