"""What checksums cost a sequence-sharded checkpoint: save and load time of one striped KV-cache-like
tensor, x: [1, 8, N, 128] fp32 of --mib MiB, on P CPU/gloo ranks, with checksum "sha256" (the
default), "crc32" and none, each median (min) of --reps runs. A load verifies digests when the save
recorded them. The files are read back from the page cache (just written; caches are not dropped), so
the numbers are the CPU cost of hashing plus whatever the disk adds to the save.

    .venv/bin/python scripts/benchmarks/bench_checkpoint.py --mib 1024 --ranks 2 --reps 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cp_dtensor.checkpoint.dcp import load_sequence_sharded, save_sequence_sharded  # noqa: E402
from cp_dtensor.dtensor.placements import sequence_placement  # noqa: E402
from _bench_dist import run_ranks  # noqa: E402

H, D = 8, 128


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _bench(rank: int, world: int, root: str, n: int, reps: int, modes: list[str | None]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    shape = torch.Size((1, H, n, D))
    stride = torch.empty(shape, device="meta").stride()
    placement = sequence_placement(2, layout="striped", seq_len=n, cp_size=world)
    local = torch.randn(1, H, n // world, D, generator=torch.Generator().manual_seed(rank))
    x = DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride)
    like = {"x": DTensor.from_local(torch.empty(1, H, n // world, D, device="meta"), mesh, [placement],
                                    run_check=False, shape=shape, stride=stride)}
    times: dict[str, dict[str, list[float]]] = {}
    for rep in range(-1, reps):  # rep -1 warms up (first DCP calls, allocator); modes rotate per rep
        for mode in modes[rep % len(modes):] + modes[:rep % len(modes)]:
            path = os.path.join(root, f"ckpt-{mode}")
            save = _timed(lambda: save_sequence_sharded({"x": x}, path, checksum=mode))
            load = _timed(lambda: load_sequence_sharded(path, like))
            if rep >= 0:
                t = times.setdefault(str(mode), {"save": [], "load": []})
                t["save"].append(save)
                t["load"].append(load)
            if rank == 0:
                shutil.rmtree(path)
            dist.barrier()
    return times


def _hash_rate(mib: int) -> dict[str, float]:
    """One core's hashing speed on an in-memory buffer, GiB/s: the floor of what a digest costs."""
    buf = os.urandom(mib << 20)
    out = {}
    for name, fn in (("sha256", lambda: hashlib.sha256(buf).digest()), ("crc32", lambda: zlib.crc32(buf))):
        t0 = time.perf_counter()
        fn()
        out[name] = mib / 1024 / (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="size of the tensor, MiB")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = (args.mib << 20) // (4 * H * D)
    unit = 2 * args.ranks
    n -= n % unit
    modes = ["sha256", "crc32", None]
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        per_rank = run_ranks(args.ranks, _bench, root, n, args.reps, modes)
    times = per_rank[0]  # barriers around each call: every rank measures the same wall time
    gib = n * H * D * 4 / 2**30
    print(f"x: [1, {H}, {n}, {D}] fp32 = {gib:.3f} GiB, striped over P = {args.ranks} ranks, "
          f"{args.reps} reps, 1 thread per rank")
    print("hashing one core, GiB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in _hash_rate(256).items()))
    base = {op: statistics.median(times["None"][op]) for op in ("save", "load")}
    print(f"{'checksum':<8} | {'save s median (min)':>20} | {'load s median (min)':>20} | save / none | load / none")
    for mode, t in sorted(times.items(), key=lambda kv: kv[0] != "sha256"):
        cells = [f"{statistics.median(t[op]):.3f} ({min(t[op]):.3f})" for op in ("save", "load")]
        ratios = [statistics.median(t[op]) / base[op] for op in ("save", "load")]
        print(f"{mode:<8} | {cells[0]:>20} | {cells[1]:>20} | {ratios[0]:>11.2f} | {ratios[1]:>11.2f}")


if __name__ == "__main__":
    main()
