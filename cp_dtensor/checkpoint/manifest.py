"""The manifest of a sequence-sharded checkpoint: what a save wrote, and the local checks a load runs
against it before DCP reads a byte. Pure file work, no collectives (checkpoint/dcp.py agrees on the
outcome across ranks).

Note [Checkpoint manifest]
~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP's safetensors reader rebuilds a tensor's global shape from the pieces it finds -- the largest
offset + size over every ``*.safetensors`` file in the directory -- and loads whatever those files hold.
So a deleted shard leaves uninitialised memory where its piece was (the remaining pieces still "fit" a
global shape), a stale file from an earlier save into the same directory supplies old values, and a
flipped byte loads as a wrong value; none of them raises. The files alone cannot tell: what is missing
is a record of the whole save. ``save_sequence_sharded`` writes one, ``manifest.json``, after every rank
has written its file::

    {"format": "cp_dtensor.sequence_sharded", "version": 1, "world_size": P, "checksum": "sha256",
     "tensors": {key: {"shape": [...], "dtype": "F32", "saved_from": "striped(2) on mesh (2,)",
                       "pieces": [{"file": name, "offsets": [...], "shape": [...]}, ...]}},
     "files": {name: {"bytes": n, "digest": hex}}}

The pieces are read back from the safetensors headers just written (not predicted from the
placements: DCP decides which rank writes a replicated tensor). A load then checks, before DCP:

1. the directory holds exactly the manifest's files (a missing one is a lost piece; an extra
   ``.safetensors`` one would be read by DCP), each of its recorded size (a truncated copy);
2. each file's digest (a flipped bit) -- the files are split across the ranks, so the hashing costs
   one read of the checkpoint in all, not one per rank;
3. each file's safetensors header lists exactly the pieces the manifest gives it, and the header's data
   ends where the file ends (checked even with checksums off);
4. the pieces of every requested tensor cover its global shape exactly once, and that shape is the
   one asked for.
The manifest is written last, beside the files in a temporary directory renamed into place (Note
[Crash-safe checkpoint directories]), so a directory with a manifest is a complete save. The digests
catch accidents (disk, copy, truncation), not an attacker who can also rewrite the manifest; nothing
here executes what it reads (JSON only).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"step-(\d+)")  # a step's directory: save_checkpoint's, named as torchtitan names its own
FORMAT, VERSION = "cp_dtensor.sequence_sharded", 1
CHECKSUMS = ("sha256", "crc32")  # crc32: ~3x faster (zlib), catches accidents only
_CHUNK = 8 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked: missing, extra, truncated or corrupted
    files, a save that lost a race, or a failure inside torch.distributed.checkpoint."""


class CheckpointExistsError(CheckpointError):
    """The target of a save already holds files."""


# ---- reading what is on disk ----

def digest(path: str, algorithm: str) -> str:
    """Hex digest of a file's bytes, read in 8 MiB chunks (hashlib releases the GIL on them)."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    h = hashlib.sha256() if algorithm == "sha256" else None
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            if h is not None:
                h.update(view[:n])
            else:
                crc = zlib.crc32(view[:n], crc)
    return h.hexdigest() if h is not None else f"{crc:08x}"


def header_pieces(path: str) -> dict[str, dict[str, Any]]:
    """{key: {"offsets", "shape", "dtype"}} from a DCP safetensors file's header (JSON; the tensor
    bytes are not read). Raises CheckpointError if the header is malformed or the data it describes
    does not end where the file ends."""
    name, size = os.path.basename(path), os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{name} has no valid safetensors header ({size} bytes on disk).")
        try:
            header = json.loads(f.read(n))
            sharding = json.loads(header.pop("__metadata__", {}).get("DCP_SHARDING_INFO", "{}"))
            pieces, end = {}, 0
            for key, entry in header.items():
                offsets = sharding[key]["saved_offsets"] if key in sharding else [0] * len(entry["shape"])
                pieces[key] = {"offsets": list(offsets), "shape": list(entry["shape"]), "dtype": entry["dtype"]}
                end = max(end, entry["data_offsets"][1])
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise CheckpointError(f"{name} has a malformed safetensors header ({type(e).__name__}: {e}).") from None
    if 8 + n + end != size:
        raise CheckpointError(f"{name} is {size} bytes but its header describes {8 + n + end}: the file is "
                              "truncated or was overwritten.")
    return pieces


def describe_files(root: str, names: Iterable[str], checksum: str | None) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", "digest", "pieces"}} for files this rank describes at save time."""
    out = {}
    for name in names:
        path = os.path.join(root, name)
        out[name] = {"bytes": os.path.getsize(path), "digest": digest(path, checksum) if checksum else None,
                     "pieces": header_pieces(path)}
    return out


# ---- building the manifest at save time ----

def build(files: Mapping[str, Mapping[str, Any]], *, world_size: int, checksum: str | None,
          saved_from: Mapping[str, str]) -> dict[str, Any]:
    """The manifest (see Note [Checkpoint manifest]) from every rank's ``describe_files``; raises
    CheckpointError if the pieces do not cover each tensor exactly once."""
    tensors: dict[str, dict[str, Any]] = {}
    for name in sorted(files):
        for key, piece in files[name]["pieces"].items():
            entry = tensors.setdefault(key, {"dtype": piece["dtype"], "saved_from": saved_from.get(key, "?"),
                                             "pieces": []})
            entry["pieces"].append({"file": name, "offsets": piece["offsets"], "shape": piece["shape"]})
    for key, entry in tensors.items():
        ends = [[o + s for o, s in zip(p["offsets"], p["shape"])] for p in entry["pieces"]]
        entry["shape"] = [max(col) for col in zip(*ends)] if ends and ends[0] else []
        if err := cover_error(key, entry["shape"], entry["pieces"]):
            raise CheckpointError(f"the files just written do not hold {key!r} exactly once: {err}. Was another "
                                  "process writing into the same directory?")
    return {"format": FORMAT, "version": VERSION, "world_size": world_size, "checksum": checksum,
            "tensors": dict(sorted(tensors.items())),
            "files": {n: {"bytes": f["bytes"], "digest": f["digest"]} for n, f in sorted(files.items())}}


def cover_error(key: str, shape: Sequence[int], pieces: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the boxes ``pieces`` do not tile ``shape`` exactly once, or None. Exact cover = every box in
    bounds, no two overlap, volumes sum to numel (pairwise test, vectorised: O(pieces^2) booleans)."""
    if not pieces:
        return f"{key!r} has no pieces"
    offs = torch.tensor([p["offsets"] for p in pieces], dtype=torch.int64).view(len(pieces), len(shape))
    ends = offs + torch.tensor([p["shape"] for p in pieces], dtype=torch.int64).view(len(pieces), len(shape))
    lim = torch.tensor(list(shape), dtype=torch.int64)
    if (offs < 0).any() or (ends > lim).any() or (ends < offs).any():
        return f"a piece of {key!r} lies outside its shape {list(shape)}"
    overlap = (torch.maximum(offs[:, None], offs[None]) < torch.minimum(ends[:, None], ends[None])).all(-1)
    overlap.fill_diagonal_(False)
    if overlap.any():
        i, j = overlap.nonzero()[0].tolist()
        return (f"pieces of {key!r} in {pieces[i]['file']} and {pieces[j]['file']} overlap "
                f"(offsets {pieces[i]['offsets']} and {pieces[j]['offsets']})")
    covered, numel = int((ends - offs).prod(-1).sum()), int(lim.prod())
    if covered != numel:
        return f"the pieces of {key!r} cover {covered} of its {numel} elements"
    return None


# ---- checking a checkpoint at load time ----

def read(root: str) -> dict[str, Any]:
    """The manifest of checkpoint ``root``; CheckpointError if absent or malformed."""
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.isdir(root) else f"has no {MANIFEST}"
        raise CheckpointError(f"checkpoint {root} {what}: it is not a complete save_sequence_sharded "
                              "checkpoint (an interrupted save, another tool's files, or a cp_dtensor save "
                              "from before manifests). Load a complete checkpoint, or re-save this one.")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        ok = (manifest["format"] == FORMAT and manifest["version"] == VERSION
              and isinstance(manifest["tensors"], dict) and isinstance(manifest["files"], dict)
              and manifest["checksum"] in (*CHECKSUMS, None))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is malformed ({type(e).__name__}: {e}); the checkpoint cannot be "
                              "verified. Re-save it.") from None
    if not ok:
        raise CheckpointError(f"{path} is not a {FORMAT} version {VERSION} manifest; re-save the checkpoint "
                              "with this version of cp_dtensor.")
    return manifest


def check_listing(root: str, manifest: Mapping[str, Any]) -> None:
    """The directory holds exactly the manifest's files, each of its recorded size."""
    listed = manifest["files"]
    present = set(os.listdir(root)) - {MANIFEST}
    for name in sorted(listed):
        if name not in present:
            raise CheckpointError(f"checkpoint {root} is missing {name} (listed in its {MANIFEST}, "
                                  f"{listed[name]['bytes']} bytes): a piece of the saved tensors is gone. "
                                  "Restore the file from where the checkpoint was copied, or load another checkpoint.")
        size = os.path.getsize(os.path.join(root, name))
        if size != listed[name]["bytes"]:
            raise CheckpointError(f"{name} in checkpoint {root} is {size} bytes; the save wrote "
                                  f"{listed[name]['bytes']}: the file is truncated or was replaced. Restore it "
                                  "from where the checkpoint was copied, or load another checkpoint.")
    if extra := sorted(present - set(listed)):
        raise CheckpointError(f"checkpoint {root} holds {', '.join(extra)}, which its {MANIFEST} does not "
                              "list (left by another save, or copied in); the reader would mix it in. Remove "
                              "it, or re-save into an empty directory.")


def check_files(root: str, manifest: Mapping[str, Any], names: Iterable[str], *, checksums: bool) -> None:
    """Digest (when recorded and ``checksums``) and header of each of ``names`` against the manifest."""
    algorithm = manifest["checksum"]
    want: dict[str, set] = {}
    for key, entry in manifest["tensors"].items():
        for p in entry["pieces"]:
            want.setdefault(p["file"], set()).add((key, tuple(p["offsets"]), tuple(p["shape"]), entry["dtype"]))
    for name in names:
        path = os.path.join(root, name)
        if checksums and algorithm and digest(path, algorithm) != manifest["files"][name]["digest"]:
            raise CheckpointError(f"{name} in checkpoint {root} fails its {algorithm} check: its bytes differ "
                                  "from what the save wrote (corrupted on disk or in a copy). Restore the file "
                                  "from where the checkpoint was copied, or load another checkpoint.")
        got = {(k, tuple(p["offsets"]), tuple(p["shape"]), p["dtype"]) for k, p in header_pieces(path).items()}
        if got != want.get(name, set()):
            raise CheckpointError(f"{name} in checkpoint {root} holds other tensor pieces than its {MANIFEST} "
                                  "records: it was replaced. Restore it, or load another checkpoint.")


def check_request(root: str, manifest: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> None:
    """Every requested key is saved with the requested global shape, and its pieces cover it once."""
    tensors = manifest["tensors"]
    for key, shape in shapes.items():
        if key not in tensors:
            raise ValueError(f"checkpoint {root} has no tensor {key!r}; it holds {sorted(tensors)}. Ask for "
                             "a saved key.")
        saved = tensors[key]["shape"]
        if list(saved) != list(shape):
            raise ValueError(f"{key!r} was saved with global shape {saved}; the target has {list(shape)}. "
                             "Give a target of the saved shape (any mesh, layout or CP size).")
        if err := cover_error(key, saved, tensors[key]["pieces"]):
            raise CheckpointError(f"checkpoint {root} does not hold {key!r} exactly once: {err}. Its "
                                  f"{MANIFEST} was edited or written by another tool; re-save the checkpoint.")
