"""Pre-imported ranks for end-to-end torchtitan jobs: the launcher behind ``tests/_titan_run.py``.

Every job of the plugin's own entry point (``-m cp_dtensor.titan.train``) used to start ``nproc + 1`` fresh
interpreters through torchrun, and each spent ~7 s of CPU importing torch, torchtitan and the plugin before
its first step: on 2 cores that was ~8 s of wall time per job, a third of a typical job. Here one server
process (the zygote) imports exactly what the entry point imports first -- ``cp_dtensor.titan.train``, which
imports the plugin and then torchtitan -- once per test session, and forks the ranks of each job from that
state. A rank is then what torchrun would have started after its imports: the same environment variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), the same ``sys.argv``, the entry
module run as ``__main__``, stdout and stderr of every rank into one output. The zygote runs nothing else:
no test code and no job ever runs in it, so no job inherits another's state.

What still starts fresh processes through torchrun: torchtitan's stock main and hand-written launchers (the
tests that prove the plugin loads from a fresh interpreter through ``custom_import`` or ``--module``), and
every job when ``CP_DTENSOR_TITAN_FORK=0``.

Protocol: one JSON request a line on the zygote's stdin (``nproc``, ``module``, ``argv``, ``cwd``, ``log``,
``timeout``), one JSON reply a line on its stdout (``code``: the first non-zero exit code of a rank, TIMED_OUT for a
timeout). When a rank fails, the others are given a few seconds and then killed, as torchrun does.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENTRY = ("-m", "cp_dtensor.titan.train")  # the only entry the zygote runs
TIMED_OUT = -1000  # the reply's code for a job killed at its deadline


def enabled() -> bool:
    return os.environ.get("CP_DTENSOR_TITAN_FORK", "1") != "0"


# ---- the pytest side ----

_lock = threading.Lock()
_server: subprocess.Popen | None = None


def _start(env: dict[str, str], cwd: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__], cwd=cwd, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)
    ready = proc.stdout.readline()
    if ready.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the torchtitan zygote did not start (said {ready!r}); CP_DTENSOR_TITAN_FORK=0 "
                           "runs every job through torchrun instead")
    return proc


def run_job(nproc: int, module: str, argv: list[str], *, env: dict[str, str], cwd: Path,
            timeout: float | None) -> tuple[int, str]:
    """Run ``python -m module *argv`` on ``nproc`` ranks forked from the zygote; (exit code, all ranks' output)."""
    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            _server = _start(env, cwd)
            atexit.register(stop)
        fd, name = tempfile.mkstemp(prefix="titan-job-", suffix=".log")
        os.close(fd)
        log = Path(name)
        req = {"nproc": nproc, "module": module, "argv": argv, "cwd": str(cwd), "log": str(log),
               "timeout": timeout}
        _server.stdin.write(json.dumps(req) + "\n")
        _server.stdin.flush()
        reply = _server.stdout.readline()
        out = log.read_text(errors="replace")
        log.unlink()
        if not reply:
            _server = None
            return 1, out + "\nthe torchtitan zygote died during this job"
        code = json.loads(reply)["code"]
        if code == TIMED_OUT:  # as subprocess.run(timeout=) under torchrun: the test errors, never passes
            raise subprocess.TimeoutExpired([module, *argv], timeout, output=out)
        return code, out


def stop() -> None:
    global _server
    if _server is not None and _server.poll() is None:
        _server.stdin.close()
        try:
            _server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _server.kill()
    _server = None


# ---- the zygote ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reread_argv() -> None:
    """torchtitan 0.2.2's ``ConfigManager.parse_args(self, args=sys.argv[1:])`` reads the command line when its
    module is imported (a default argument), which here was the zygote's; 0.3 reads it at the call."""
    try:
        from torchtitan.config.manager import ConfigManager
    except ImportError:
        return
    defaults = ConfigManager.parse_args.__defaults__
    if defaults and isinstance(defaults[0], list):
        ConfigManager.parse_args.__defaults__ = (sys.argv[1:], *defaults[1:])


def _rank(rank: int, nproc: int, port: int, req: dict) -> None:
    """In a forked child: become rank ``rank`` of the job and never return."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills what the rank started too
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(req["cwd"])
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        import runpy

        sys.argv = [req["module"], *req["argv"]]
        _reread_argv()
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _job(req: dict) -> int:
    nproc, port = req["nproc"], _free_port()
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(rank, nproc, port, req)
        pids.append(pid)
    deadline = None if req["timeout"] is None else time.monotonic() + req["timeout"]
    codes: dict[int, int] = {}
    failed_at = None
    while len(codes) < nproc:
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
        now = time.monotonic()
        late = deadline is not None and now > deadline
        if late or (failed_at is not None and now > failed_at + 10):
            for pid in pids:
                if pid not in codes:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for pid in pids:
                if pid not in codes:
                    codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            if late:
                return TIMED_OUT
        time.sleep(0.05)
    return next((c for c in (codes[p] for p in pids) if c != 0), 0)


def _serve() -> None:
    sys.path[0] = os.getcwd()  # as `python -m` has it (not this file's folder)
    # what the entry point imports before it runs: the plugin, then torchtitan's trainer and the plugin's glue
    import cp_dtensor.titan  # noqa: F401
    from cp_dtensor._extras import installed_version

    if installed_version("titan") >= (0, 3):
        import cp_dtensor.titan.v03.main  # noqa: F401
    else:
        import torchtitan.train  # noqa: F401

        import cp_dtensor.titan.v02.trainer  # noqa: F401
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # nothing but replies on the protocol channel
    proto.write("ready\n")
    for line in sys.stdin:
        proto.write(json.dumps({"code": _job(json.loads(line))}) + "\n")


if __name__ == "__main__":
    _serve()
