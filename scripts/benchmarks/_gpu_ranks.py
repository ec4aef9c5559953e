"""gpu_check's launcher and verdicts: P processes sharing one device in one gloo group, every rank's results
kept, a stall told apart from slowness by every rank's Python stacks; NaN-aware errors.

The stall watchdog.
A rank that stops making progress -- a collective its peer never joins, a kernel that does not return,
or a step that is merely very slow -- looks the same from outside: no result. So every rank of a group
(1) appends each result to its own JSON-lines file the moment a case ends, (2) logs "start <case>" before
each case, and (3) arms ``faulthandler``: ``dump_traceback_later(stall_s, repeat=True)`` writes every
thread's Python stack to its own file every ``stall_s`` seconds, and SIGUSR1 writes one at once
(``faulthandler.register``). When a group's deadline passes, the launcher sends SIGUSR1 to every live
rank, waits a moment, reads each rank's file and only then kills the ranks. The report holds every
finished case, the case each rank was in, and its stacks: the same frame in successive dumps on every
rank is a hang (which collective or kernel says where); frames that move are slowness. ``faulthandler``
writes from its C signal handler, so a rank blocked inside C++ (gloo, a CUDA call) still dumps.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

_GROUP_FILES: dict[str, object] = {}  # this rank's open files: "stacks", "results"


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """``err``: max |got - want| / max(max |want|, 1) (relative to the largest magnitude, absolute near
    zero); ``nonfinite``: NaN/inf entries of ``got`` (and ``ref_nonfinite`` of ``want``). Any non-finite
    entry makes ``err`` inf: a NaN never reads as a small error."""
    a, b = got.detach().double(), want.detach().double().to(got.device)
    bad, bad_ref = int((~torch.isfinite(a)).sum()), int((~torch.isfinite(b)).sum())
    if bad or bad_ref:
        return dict(err=math.inf, nonfinite=bad, ref_nonfinite=bad_ref)
    return dict(err=((a - b).abs().max() / max(b.abs().max().item(), 1.0)).item() if a.numel() else 0.0, nonfinite=0)


def worst(values) -> float:
    """max of ``values`` with NaN read as inf (``max`` over a NaN depends on the order); inf for none."""
    vals = [math.inf if (v is None or math.isnan(v)) else float(v) for v in values]
    return max(vals) if vals else math.inf


def last_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1][:300] if text else ''}"


def progress(what: str) -> None:
    """Log ``what`` to this rank's stack file (the launcher shows the last line of a stalled rank)."""
    f = _GROUP_FILES.get("stacks")
    if f is not None:
        f.write(f"[{time.strftime('%H:%M:%S')}] {what}\n")
        f.flush()


def record(section: str, row: dict) -> dict:
    """Append one finished result of ``section`` to this rank's results file; returns ``row``."""
    f = _GROUP_FILES["results"]
    f.write(json.dumps(dict(row, section=section), default=str) + "\n")
    f.flush()
    return row


def _rank_main(rank, world, init, cfg, target, files):
    code = 0
    stacks, results = open(files[rank][0], "w"), open(files[rank][1], "w")
    _GROUP_FILES.update(stacks=stacks, results=results)
    faulthandler.enable(file=stacks, all_threads=True)  # a fatal signal (an abort in a CUDA call) dumps too
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.dump_traceback_later(cfg["stall_s"], repeat=True, file=stacks)
    try:
        device = torch.device(cfg["device"])
        torch.set_num_threads(cfg["threads"])
        if device.type == "cuda":
            torch.cuda.set_device(device)  # every rank on the one GPU
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                timeout=timedelta(seconds=cfg["collective_timeout"]))
        target(cfg, rank, world, device)
        record("_done", {})
    except BaseException as e:  # noqa: BLE001 -- reported by the launcher, which stops every rank
        record("_crash", dict(error=last_line(e), trace=traceback.format_exc()))
        code = 1
    finally:
        faulthandler.cancel_dump_traceback_later()
        faulthandler.unregister(signal.SIGUSR1)
        faulthandler.disable()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        stacks.close()
        results.close()
        os._exit(code)


def _read(path: str) -> list[dict]:
    rows = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by the kill
                rows.append(json.loads(line))
    return rows


def run_group(name: str, target, cfg: dict, world: int, *, timeout: float, start_method: str = "spawn") -> dict:
    """``target(cfg, rank, world, device)`` on ``world`` processes (one gloo group; spawn: CUDA cannot cross
    a fork), each recording its results (:func:`record`). Returns ``status`` ("ok", "crashed": a rank raised
    or died of a signal, or "stalled": ranks still running at the deadline),
    ``ranks``: every rank's recorded rows, ``stacks``: the stack files of the ranks that did not finish
    (stalled) or crashed, and ``seconds``. See the stall watchdog in the module docstring."""
    ctx = mp.get_context(start_method)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        files = [(os.path.join(tmp, f"stacks.{r}.txt"), os.path.join(tmp, f"results.{r}.jsonl")) for r in range(world)]
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_rank_main, args=(r, world, init, cfg, target, files)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = t0 + timeout
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):  # one crashed: its peers would wait for it
                time.sleep(2)
                break
            time.sleep(0.2)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in alive:  # a stall: every live rank's stacks now (the stall watchdog, above)
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, signal.SIGUSR1)
        if alive:
            time.sleep(2)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        ranks = [_read(files[r][1]) for r in range(world)]
        died = [r for r in range(world) if r not in alive and procs[r].exitcode != 0]  # an exception or a signal
        crashed = [r for r in range(world) if r in died or any(x["section"] == "_crash" for x in ranks[r])]
        unfinished = [r for r in alive if not any(x["section"] in ("_done", "_crash") for x in ranks[r])]
        stacks = {}
        for r in sorted(set(crashed) | set(unfinished)):
            with open(files[r][0]) as f:
                stacks[r] = f.read()
    status = "crashed" if crashed else "stalled" if unfinished else "ok"
    return dict(name=name, status=status, ranks=ranks, stacks=stacks, stalled=unfinished, crashed=crashed,
                seconds=time.monotonic() - t0, timeout=timeout)


def rows_of(group: dict, section: str) -> list[list[dict]]:
    """Per rank, the rows recorded for ``section``."""
    return [[x for x in rank if x["section"] == section] for rank in group["ranks"]]


def merge_rows(per_rank: list[list[dict]], key: str) -> list[dict]:
    """One row per case (matched by ``key``), every rank's verdict kept: ``per_rank`` worst errors and
    non-finite counts, ``ok`` only when every rank has the case and passed it."""
    order, by_case = [], {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            k = row[key] if isinstance(key, str) else tuple(row[x] for x in key)
            if k not in by_case:
                order.append(k)
                by_case[k] = {}
            by_case[k][rank] = row
    merged = []
    for k in order:
        got = by_case[k]
        first = got[min(got)]
        row = dict(first)
        row["per_rank_worst"] = [got[r].get("worst") if r in got else None for r in range(len(per_rank))]
        row["per_rank_nonfinite"] = [got[r].get("nonfinite_total", 0) if r in got else None for r in range(len(per_rank))]
        row["worst"] = worst(x for x in row["per_rank_worst"] if x is not None) if "worst" in first else None
        row["ok"] = len(got) == len(per_rank) and all(got[r].get("ok", False) for r in got)
        merged.append(row)
    return merged


def stall_summary(group: dict) -> list[str]:
    """Markdown lines: what each unfinished or crashed rank was doing, with its last stack dump."""
    lines = []
    for r, text in group["stacks"].items():
        starts = [ln for ln in text.splitlines() if "] start " in ln]
        doing = starts[-1].split("] start ", 1)[1] if starts else "(before its first case)"
        dumps = text.count("most recent call first")
        crash = [x for x in group["ranks"][r] if x["section"] == "_crash"]
        lines += [f"- rank {r}: {'crashed' if r in group['crashed'] else 'stalled'} in `{doing}`; {dumps} stack "
                  "dump(s) (identical innermost frames across dumps: a hang; moving frames: slowness)"
                  + (f"; {crash[0]['error']}" if crash else ""), "",
                  "```", *(crash[0]["trace"].splitlines()[-30:] if crash else []), *text.splitlines()[-60:], "```", ""]
    return lines
