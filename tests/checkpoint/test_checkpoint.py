"""Checkpoints across CP sizes and layouts, crash safety, integrity (missing, extra, stale, truncated and
corrupted files; concurrent saves), and HF safetensors export -- checked against index formulas written
out here, the original tensors, hashlib, and a CP=1 model, never against checkpoint/dcp.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import signal
import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cp_dtensor.checkpoint.dcp import (
    CheckpointError,
    CheckpointExistsError,
    export_hf_safetensors,
    latest_checkpoint,
    load_hf_safetensors,
    load_sequence_sharded,
    relayout,
    save_checkpoint,
    save_sequence_sharded,
)
from cp_dtensor.dtensor.placements import HeadTail, sequence_placement
from cp_dtensor.dtensor.sharding import shard_sequence
from _dist import RankFailure, run_ranks
from _titan_run import titan_version

LAYOUTS = ("striped", "headtail", "contiguous")
SHAPE, SEQ_DIM = (2, 2, 32, 4), 2  # a KV cache: [B, Hkv, N, D], sharded along N


def data(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def expected_local(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = SEQ_DIM) -> torch.Tensor:
    """The layouts of Note [Sequence layouts], spelled out independently."""
    n = x.shape[dim]
    s = n // world
    if layout == "contiguous":
        pos = list(range(rank * s, rank * s + s))
    elif layout == "striped":
        pos = list(range(rank, n, world))
    else:
        c = s // 2
        pos = list(range(rank * c, rank * c + c)) + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c))
    return x.index_select(dim, torch.tensor(pos))


def like(mesh, layout: str, dim: int = SEQ_DIM) -> DTensor:
    """A meta-device DTensor that only describes the target: mesh, layout, shape, dtype."""
    p = sequence_placement(dim, layout=layout, seq_len=SHAPE[dim], cp_size=mesh.size())
    local = expected_local(torch.empty(SHAPE, device="meta"), "contiguous", 0, mesh.size())
    return DTensor.from_local(local, mesh, [p], run_check=False, shape=torch.Size(SHAPE),
                              stride=torch.empty(SHAPE, device="meta").stride())


class PeakLocalNumel(TorchDispatchMode):
    """The largest tensor (a DTensor counts its local shard) any op produces while active. Byte
    tensors (DCP's pickled plans, not tensor data) and meta tensors (no memory) are skipped."""

    def __init__(self):
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype != torch.uint8 and not t.is_meta:
                self.peak = max(self.peak, (t._local_tensor if isinstance(t, DTensor) else t).numel())
        return out


def _save_at_4(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    state = {f"kv.{layout}": shard_sequence(data(i), mesh, seq_dim=SEQ_DIM, layout=layout)
             for i, layout in enumerate(LAYOUTS)}
    state["bias"] = torch.arange(8.0)  # a plain tensor, replicated
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    striped2d = sequence_placement(SEQ_DIM, layout="striped", seq_len=SHAPE[SEQ_DIM], cp_size=2)
    local2d = expected_local(expected_local(data(9), "contiguous", mesh2d.get_local_rank("dp"), 2, dim=0),
                             "striped", mesh2d.get_local_rank("cp"), 2)
    state["kv.2d"] = DTensor.from_local(local2d, mesh2d, [Shard(0), striped2d], run_check=False,
                                        shape=torch.Size(SHAPE), stride=data(9).stride())

    # every layout to every other on the same mesh, against the formulas
    for i, src in enumerate(LAYOUTS):
        for dst in LAYOUTS:
            moved = relayout(state[f"kv.{src}"], [sequence_placement(SEQ_DIM, layout=dst, seq_len=32, cp_size=world)])
            assert torch.equal(moved.to_local(), expected_local(data(i), dst, rank, world)), (src, dst)
    with pytest.raises(ValueError, match="changes sequence layouts only"):
        relayout(state["kv.striped"], [Shard(1)])
    short = DTensor.from_local(torch.zeros(2, 2, 3, 4), mesh, [Shard(2)], shape=torch.Size((2, 2, 12, 4)),
                               stride=(96, 48, 4, 1))
    with pytest.raises(ValueError, match="headtail layout on 4 ranks needs the sequence length divisible by 8"):
        relayout(short, [HeadTail(2)])
    with pytest.raises(ValueError, match="tensors only"):
        save_sequence_sharded({"step": 3}, path)

    # O(shard): nothing the save or the load creates is larger than one shard...
    shard = state["kv.striped"].to_local().numel()
    with PeakLocalNumel() as meter:
        save_sequence_sharded(state, path)
    assert 0 < meter.peak <= shard, (meter.peak, shard)
    targets = {f"kv.{layout}": like(mesh, layout) for layout in LAYOUTS}
    with PeakLocalNumel() as meter:
        got = load_sequence_sharded(path, targets)
    assert 0 < meter.peak <= shard, (meter.peak, shard)
    for i, layout in enumerate(LAYOUTS):
        assert torch.equal(got[f"kv.{layout}"].to_local(), expected_local(data(i), layout, rank, world))
    # ...while DTensor's own striped -> Shard redistribute gathers the full tensor: the meter can fail
    with PeakLocalNumel() as meter:
        state["kv.striped"].redistribute(mesh, [Shard(SEQ_DIM)])
    assert meter.peak >= shard * world


def _load_at_2(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for i, saved in enumerate(LAYOUTS):
        for layout in LAYOUTS:  # the saved layout, and a layout change on load
            got = load_sequence_sharded(path, {f"kv.{saved}": like(mesh, layout)})[f"kv.{saved}"]
            assert got.placements == (sequence_placement(SEQ_DIM, layout=layout, seq_len=32, cp_size=world),)
            assert torch.equal(got.to_local(), expected_local(data(i), layout, rank, world)), (saved, layout)
    got = load_sequence_sharded(path, {"kv.2d": like(mesh, "headtail"), "bias": torch.empty(8)})
    assert torch.equal(got["kv.2d"].to_local(), expected_local(data(9), "headtail", rank, world))
    assert torch.equal(got["bias"], torch.arange(8.0))


def _load_at_1(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    want = {f"kv.{layout}": data(i) for i, layout in enumerate(LAYOUTS)} | {"kv.2d": data(9)}
    got = load_sequence_sharded(path, {k: like(mesh, "striped") for k in want})
    plain = load_sequence_sharded(path, {k: torch.empty(SHAPE) for k in want})  # plain DCP boxes, full tensors
    for k, x in want.items():
        assert torch.equal(got[k].full_tensor(), x) and torch.equal(plain[k], x), k


def test_reshard_across_cp_sizes_and_layouts(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(4, _save_at_4, path)
    files = sorted(os.listdir(path))
    assert files == ["manifest.json"] + [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in range(1, 5)]
    files = files[1:]
    shard = SHAPE[0] * SHAPE[1] * SHAPE[3] * SHAPE[SEQ_DIM] // 4
    for name in files:  # what reached storage: one box of at most one shard per tensor per rank
        with safe_open(os.path.join(path, name), framework="pt") as f:
            assert all(f.get_slice(k).get_shape() and torch.Size(f.get_slice(k).get_shape()).numel() <= shard
                       for k in f.keys())
    run_ranks(2, _load_at_2, path)
    run_ranks(1, _load_at_1, path)


# ---- crash safety: kill -9 of one rank during a save ----

def _save_step(rank: int, world: int, root: str, step: int, seed: int, victim: int | None, marker: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    if rank == victim:
        def stall(fd):  # the victim stalls after writing its file, before it is synced and committed
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(60)
        os.fsync = stall  # forked rank: patches this process only
    save_checkpoint({"kv": shard_sequence(data(seed), mesh, seq_dim=SEQ_DIM, layout="striped")}, root, step=step)


def _resume(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    assert latest_checkpoint(root) == os.path.join(root, "step-1")
    got = load_sequence_sharded(latest_checkpoint(root), {"kv": like(mesh, "headtail")})["kv"]
    assert torch.equal(got.to_local(), expected_local(data(1), "headtail", rank, world))
    # the next save of step 2 replaces the partial one and commits
    save_checkpoint({"kv": shard_sequence(data(2), mesh, seq_dim=SEQ_DIM, layout="headtail")}, root, step=2)
    assert latest_checkpoint(root) == os.path.join(root, "step-2")
    got = load_sequence_sharded(latest_checkpoint(root), {"kv": like(mesh, "striped")})["kv"]
    assert torch.equal(got.to_local(), expected_local(data(2), "striped", rank, world))


def test_save_killed_mid_write_leaves_previous_checkpoint(tmp_path):
    root, marker = str(tmp_path / "run"), str(tmp_path / "victim.pid")
    run_ranks(2, _save_step, root, 1, 1, None, marker)
    assert latest_checkpoint(root) == os.path.join(root, "step-1")

    killed = []

    def kill_victim():  # kill -9 from outside, once the victim is inside its write
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if os.path.exists(marker) and open(marker).read():
                pid = int(open(marker).read())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_victim)
    watcher.start()
    with pytest.raises(RankFailure) as failure:
        run_ranks(2, _save_step, root, 2, 2, 0, marker, timeout=60)  # rank 0: no survivor cleans up
    watcher.join()
    assert "rank 1 of 2 failed" in str(failure.value)  # the survivor errors out: its peer is gone
    assert killed, "the victim never reached its write"
    left = sorted(os.listdir(root))
    assert left[0] == "step-1" and len(left) == 2 and left[1].startswith("step-2.tmp-"), left
    assert latest_checkpoint(root) == os.path.join(root, "step-1")
    run_ranks(2, _resume, root)  # resumes at another layout, then saves step 2 for real
    assert sorted(os.listdir(root)) == ["step-1", "step-2"]


# ---- integrity: damaged checkpoints raise on every rank, naming the file ----

SHARDS = [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]


def _replica(base: str, dst: str, rank: int, damage=None) -> str:
    """Rank 0 copies checkpoint ``base`` to ``dst`` and damages the copy; every rank then sees it."""
    if rank == 0:
        shutil.copytree(base, dst)
        if damage:
            damage(dst)
    dist.barrier()
    return dst


def _flip(name: str):
    def damage(root: str) -> None:  # 8 bytes of tensor data (the end of the file), each bit inverted
        with open(os.path.join(root, name), "r+b") as f:
            f.seek(-8, os.SEEK_END)
            tail = f.read(8)
            f.seek(-8, os.SEEK_END)
            f.write(bytes(b ^ 0xFF for b in tail))
    return damage


def _raises_everywhere(match: str, path: str, target: dict, **kw) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        load_sequence_sharded(path, target, **kw)
    assert isinstance(e.value, RuntimeError)
    return str(e.value)


def _damage_cases(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for beside in (False, True):  # the striped tensor alone, and with a replicated one beside it
        base = os.path.join(root, f"base{int(beside)}")
        state = {"x": shard_sequence(data(0), mesh, seq_dim=SEQ_DIM, layout="striped")}
        target = {"x": like(mesh, "headtail")}
        if beside:
            state["w"], target["w"] = torch.arange(8.0), torch.empty(8)
        save_sequence_sharded(state, base)
        got = load_sequence_sharded(base, target)  # the intact checkpoint loads
        assert torch.equal(got["x"].to_local(), expected_local(data(0), "headtail", rank, world))
        assert not beside or torch.equal(got["w"], torch.arange(8.0))
        assert sorted(os.listdir(base)) == ["manifest.json", *SHARDS]
        manifest = json.load(open(os.path.join(base, "manifest.json")))
        assert manifest["world_size"] == 2 and manifest["tensors"]["x"]["shape"] == list(SHAPE)
        for name in SHARDS:  # sizes and digests against hashlib, not against the code under test
            raw = open(os.path.join(base, name), "rb").read()
            assert manifest["files"][name] == {"bytes": len(raw), "digest": hashlib.sha256(raw).hexdigest()}

        for name in ["manifest.json", *SHARDS]:  # each file missing in turn
            case = _replica(base, os.path.join(root, f"missing{int(beside)}-{name}"), rank,
                            lambda d, n=name: os.remove(os.path.join(d, n)))
            what = "has no manifest.json" if name == "manifest.json" else f"is missing {re.escape(name)}"
            _raises_everywhere(what, case, target)
            if name == SHARDS[0] and not beside:  # the guard can fail: DCP alone loads the gap silently
                full = {"x": torch.full(SHAPE, float("nan"))}
                dcp.load(full, storage_reader=HuggingFaceStorageReader(case))
                assert full["x"].isnan().any() and not full["x"].isnan().all()

        for name in SHARDS:  # 8 flipped bytes: found by the rank that hashes the file, raised by both
            case = _replica(base, os.path.join(root, f"flipped{int(beside)}-{name}"), rank, _flip(name))
            _raises_everywhere(f"{re.escape(name)} in checkpoint .* fails its sha256 check", case, target)
            got = load_sequence_sharded(case, target, checksums=False)  # what the checksum catches
            assert not torch.equal(got["x"].full_tensor(), data(0))

        def truncate(d):  # the last 8 bytes of the second shard lost
            os.truncate(os.path.join(d, SHARDS[1]), os.path.getsize(os.path.join(d, SHARDS[1])) - 8)
        case = _replica(base, os.path.join(root, f"truncated{int(beside)}"), rank, truncate)
        _raises_everywhere(f"{re.escape(SHARDS[1])} in checkpoint .* is \\d+ bytes; the save wrote", case, target)
        extra = "shard-00003-model-00001-of-00001.safetensors"
        case = _replica(base, os.path.join(root, f"extra{int(beside)}"), rank,
                        lambda d: shutil.copy(os.path.join(d, SHARDS[0]), os.path.join(d, extra)))
        _raises_everywhere(f"holds {extra}, which its manifest.json does not list", case, target)

    # two shards swapped (same sizes): the headers disagree with the manifest even without checksums
    def swap(d):
        a, b = (os.path.join(d, n) for n in SHARDS)
        os.rename(a, a + ".x"), os.rename(b, a), os.rename(a + ".x", b)
    case = _replica(os.path.join(root, "base0"), os.path.join(root, "swapped"), rank, swap)
    _raises_everywhere("holds other tensor pieces than its manifest.json records", case, {"x": like(mesh, "striped")},
                       checksums=False)
    # the same checks with the faster crc32
    base = os.path.join(root, "crc32")
    save_sequence_sharded({"x": shard_sequence(data(0), mesh, seq_dim=SEQ_DIM, layout="striped")}, base, checksum="crc32")
    case = _replica(base, os.path.join(root, "crc32-flipped"), rank, _flip(SHARDS[0]))
    _raises_everywhere("fails its crc32 check", case, {"x": like(mesh, "striped")})
    # a shape that does not match the save, and a key it does not hold: ValueError, also on every rank
    with pytest.raises(ValueError, match=r"'x' was saved with global shape \[2, 2, 32, 4\]; the target has \[2, 2, 16"):
        load_sequence_sharded(base, {"x": torch.empty(2, 2, 16, 4)})
    with pytest.raises(ValueError, match=r"has no tensor 'y'; it holds \['x'\]"):
        load_sequence_sharded(base, {"y": torch.empty(SHAPE)})


def test_damaged_checkpoints_raise_on_every_rank(tmp_path):
    run_ranks(2, _damage_cases, str(tmp_path))


def _save_seed(rank: int, world: int, path: str, seed: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    x = shard_sequence(data(seed), mesh, seq_dim=SEQ_DIM, layout="striped")
    if world == 1:  # the stale-directory case: a P=1 save onto a P=2 one
        with pytest.raises(CheckpointExistsError, match="already holds files; pass overwrite=True") as e:
            save_sequence_sharded({"x": x}, path)
        assert isinstance(e.value, RuntimeError)
        assert torch.equal(load_sequence_sharded(path, {"x": like(mesh, "striped")})["x"].full_tensor(), data(0))
        save_sequence_sharded({"x": x}, path, overwrite=True)
    else:
        save_sequence_sharded({"x": x}, path)


def _load_seed(rank: int, world: int, path: str, seed: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    got = load_sequence_sharded(path, {"x": like(mesh, "striped")})["x"]
    assert torch.equal(got.to_local(), expected_local(data(seed), "striped", rank, world))


def test_save_into_a_used_directory_refuses_or_replaces(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_seed, path, 0)
    run_ranks(1, _save_seed, path, 7)  # refused, then overwrite=True
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing left beside it
    assert sorted(os.listdir(path)) == ["manifest.json", SHARDS[0]]  # the old rank-2 file is gone
    run_ranks(2, _load_seed, path, 7)  # every element from the second save


def _failing_rank(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    x = shard_sequence(data(0), mesh, seq_dim=SEQ_DIM, layout="striped")
    # a bad argument on one rank only: both raise ValueError, neither waits in a collective
    with pytest.raises(ValueError, match="saves tensors only"):
        save_sequence_sharded({"x": x, "step": 3 if rank == 1 else torch.ones(1)}, os.path.join(root, "a"))
    # a write that fails inside DCP on rank 1: CheckpointError with the cause first, on both ranks
    path = os.path.join(root, "b")
    with mock.patch.object(HuggingFaceStorageWriter, "write_data", side_effect=OSError(28, "No space left on device")) \
            if rank == 1 else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match=r"^OSError: \[Errno 28\] No space left on device \(in dcp.save"):
            save_sequence_sharded({"x": x}, path)
    dist.barrier()
    assert os.listdir(root) == []  # the partial save is removed
    save_sequence_sharded({"x": x}, path)
    with mock.patch.object(HuggingFaceStorageReader, "read_data", side_effect=OSError(5, "Input/output error")) \
            if rank == 0 else contextlib.nullcontext():
        with pytest.raises(CheckpointError, match=r"^OSError: \[Errno 5\] Input/output error \(in dcp.load"):
            load_sequence_sharded(path, {"x": like(mesh, "headtail")})


def test_failures_raise_on_every_rank_cause_first(tmp_path):
    run_ranks(2, _failing_rank, str(tmp_path))


def _racing_save(rank: int, world: int, root: str, seed: int, go: str) -> str:
    mesh = init_device_mesh("cpu", (world,))
    x = shard_sequence(data(seed), mesh, seq_dim=SEQ_DIM, layout="striped")
    open(f"{go}.{seed}.{rank}", "w").close()  # start together with the other job's ranks
    while len([n for n in os.listdir(os.path.dirname(go)) if n.startswith(os.path.basename(go) + ".")]) < 4:
        time.sleep(0.005)
    try:
        save_checkpoint({"x": x}, root, step=3)
        return "saved"
    except CheckpointError as e:
        return str(e)


def test_concurrent_saves_of_one_step(tmp_path):
    root, go = str(tmp_path / "run"), str(tmp_path / "go")
    results = {}
    other = threading.Thread(target=lambda: results.update({1: run_ranks(2, _racing_save, root, 1, go)}))
    other.start()
    results[2] = run_ranks(2, _racing_save, root, 2, go)
    other.join()
    winners = [seed for seed, per_rank in results.items() if per_rank == ["saved", "saved"]]
    assert len(winners) == 1, results
    loser = results[3 - winners[0]]
    assert all(re.search(r"another save committed .*step-3 while this one was writing|step-3 already holds files",
                         msg) for msg in loser), loser  # a clear message on both of the loser's ranks
    assert sorted(os.listdir(root)) == ["step-3"]
    run_ranks(2, _load_seed, os.path.join(root, "step-3"), winners[0])  # one save, whole


def test_latest_checkpoint_skips_malformed_steps(tmp_path):
    root = str(tmp_path / "run")  # no process group: one process saves plain tensors
    for step in (1, 2):
        save_checkpoint({"w": torch.full((4,), float(step))}, root, step=step)
    os.mkdir(os.path.join(root, "step-5"))  # emptied, or a save that never committed
    shutil.copytree(os.path.join(root, "step-1"), os.path.join(root, "step-007"))  # not a name we write
    os.mkdir(os.path.join(root, "step-4"))
    open(os.path.join(root, "step-4", "manifest.json"), "w").write("{")  # malformed
    os.mkdir(os.path.join(root, "step-9.tmp-0123"))  # a save in progress: skipped without a word
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(root) == os.path.join(root, "step-2")
    said = " ".join(str(w.message) for w in caught)
    assert all(f"skips {os.path.join(root, s)}" in said for s in ("step-5", "step-007", "step-4")), said
    assert "step-9" not in said
    with pytest.raises(CheckpointExistsError, match="step-2 already holds files; pick a new step, or pass overwrite"):
        save_checkpoint({"w": torch.zeros(4)}, root, step=2)
    with pytest.raises(ValueError, match="step must be an int >= 0; got -1"):
        save_checkpoint({"w": torch.zeros(4)}, root, step=-1)
    save_checkpoint({"w": torch.zeros(4)}, root, step=2, overwrite=True)
    assert torch.equal(load_sequence_sharded(os.path.join(root, "step-2"), {"w": torch.empty(4)})["w"], torch.zeros(4))


# ---- HF safetensors export of llama3 weights, loaded back at CP=1 and through the ring at CP=2 ----

def _llama(seed: int):
    # isort: off
    import cp_dtensor.titan  # noqa: F401  first: torchtitan without triton (Note [torchtitan on CPU])
    from torchtitan.models.llama3.model.args import TransformerModelArgs
    from torchtitan.models.llama3.model.model import Transformer
    from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
    # isort: on

    args = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64,
                                rope_theta=500000)
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model.eval(), Llama3StateDictAdapter(args, None)


def hf_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's rotary layout -> HF's (rotate-half) layout of a q/k projection, written out here."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _forbid(*args, **kwargs):
    raise RuntimeError("a checkpoint load unpickled something")


@contextlib.contextmanager
def no_unpickling():
    """Every way to unpickle a file raises while active (pickle.load/loads/Unpickler, torch.load)."""
    with mock.patch.multiple(pickle, load=_forbid, loads=_forbid, Unpickler=_forbid), \
            mock.patch.object(torch, "load", _forbid):
        yield


def _export_and_ring(rank: int, world: int, path: str) -> None:
    import cp_dtensor

    mesh = init_device_mesh("cpu", (world,))
    source, adapter = _llama(0)
    with torch.no_grad():
        want = source(TOKENS)
    export_hf_safetensors(source.state_dict(), path, adapter=adapter)  # every rank holds the same weights

    target, _ = _llama(1)
    with no_unpickling():
        load_hf_safetensors(target, path, adapter=adapter)
    for k, v in source.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k

    positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
    tokens, pos = cp_dtensor.shard_batch((TOKENS, positions), mesh, layout="headtail")
    logits = []
    for model in (source, target):
        cp_dtensor.apply_context_parallel(model, mesh, layout="headtail")
        with torch.no_grad():
            logits.append(cp_dtensor.unshard_batch(model(tokens, positions=pos), mesh, layout="headtail"))
    assert torch.equal(logits[0], logits[1])  # identical weights, identical ring
    torch.testing.assert_close(logits[1], want, rtol=1e-5, atol=1e-5)  # and the ring is the model


@pytest.mark.skipif(titan_version() is None or titan_version()[:2] != (0, 2),
                    reason="uses torchtitan 0.2.2's llama3 Transformer (0.3 rebuilt its models)")
def test_hf_safetensors_export_load_llama3(tmp_path):
    path = str(tmp_path / "hf")
    source, adapter = _llama(0)  # imports torchtitan once, before the ranks fork
    with torch.no_grad():
        want = source(TOKENS)
    run_ranks(2, _export_and_ring, path)  # (tensors do not travel back: the ranks exit first)
    assert sorted(os.listdir(path)) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    with safe_open(os.path.join(path, "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert "model.layers.1.self_attn.k_proj.weight" in f.keys() and "lm_head.weight" in f.keys()
        assert torch.equal(f.get_tensor("model.layers.1.self_attn.k_proj.weight"),
                           hf_permute(source.layers["1"].attention.wk.weight, 2))

    # CP=1, no process group: bitwise the same logits
    target, _ = _llama(2)
    with torch.no_grad():
        assert not torch.equal(target(TOKENS), want)
    with no_unpickling():
        load_hf_safetensors(target, path, adapter=adapter)
    with torch.no_grad():
        assert torch.equal(target(TOKENS), want)

    # the guard can fail: DCP's default reader unpickles its .metadata file
    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "pickled"))
    with no_unpickling(), pytest.raises(BaseException, match="a checkpoint load unpickled"):  # DCP wraps it
        dcp.load({"w": torch.zeros(3)}, checkpoint_id=str(tmp_path / "pickled"))
