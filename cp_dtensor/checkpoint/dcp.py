"""Checkpoints that reshard between CP sizes and layouts, crash-safe step directories, and safetensors
export of model weights -- all through torch.distributed.checkpoint (DCP), all in safetensors.

Note [Checkpointing layout shards]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP describes every saved piece of a tensor as one box (per-dim offsets and sizes) of the global
tensor, and reshards on load by intersecting boxes. A contiguous shard is a box; a striped shard
(positions r, r+P, ...) or a head-tail shard (chunks r and 2P-1-r) is not. DCP asks the DTensor for
its box (``compute_local_shape_and_global_offset``), which for a ``_StridedShard`` answers "first
position, local length": rank 0 and rank 1 of a striped tensor then claim overlapping boxes and
``dcp.save`` refuses ("Failed to validate global plan: ... overlapping chunks").

Ways out, and why we take the first:

* Convert before saving (taken). One all-to-all on the CP group turns each layout shard into the
  contiguous ``Shard(dim)`` shard of the same mesh -- a box -- and one turns it back after loading.
  Rank r sends each of its positions to the rank that holds it in the target layout; split sizes and
  orders come from layout.py's index maps, computed locally on S_local positions, so every buffer is
  one shard: per-rank memory and traffic are O(shard) and no rank ever holds the full tensor (DTensor's
  own ``redistribute`` between a strided placement and ``Shard`` gathers the full tensor first). The
  checkpoint then holds the tensor in natural order, one box per rank: it is the same checkpoint
  whatever layout or CP size saved it, any DCP reader loads it (into Shard, Replicate, plain tensors,
  or -- through us -- any layout at any CP size), and each rank writes exactly one box per tensor,
  which is what DCP's sharded safetensors files can hold (one entry per key per file).
* Several boxes per rank: head-tail is two boxes, but striped is S_local boxes of one position each
  -- O(N) metadata and reads -- and a safetensors file cannot hold two entries of one key.
* Layout coordinates (striped at P as box [:, r] of x.view(N/P, P, ...)): the stored shape depends on
  P and the layout, so a load at another P or layout still needs a strided read plus a local
  permutation, and the files are no longer the tensor other tools expect.
* Making plain ``dcp.save(state)`` work through DCP's hooks (``__create_write_items__``,
  ``__create_chunk_list__``, ``__get_tensor_shard__``): DTensor already implements them with the
  box above; changing that means patching DTensor's methods for everyone or wrapping every local
  shard in a tensor subclass. And the hooks cannot host the conversion: it is a collective, while
  DCP plans each rank locally and has no hook after the reads of a load. So conversion happens in
  ``save_sequence_sharded`` / ``load_sequence_sharded``, around ``dcp.save`` / ``dcp.load``.

Storage: DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` -- every rank writes its boxes to
its own safetensors file with the box offsets in the file's header, and ``HuggingFaceStorageReader``
rebuilds the global metadata from those headers. So loading reads safetensors only; DCP's default
``FileSystemReader`` unpickles a ``.metadata`` file. We do not enable its consolidation for sequence
state: consolidation has one rank rewrite every byte of every tensor.

Note [Crash-safe checkpoint directories]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A save never writes into its target. ``save_sequence_sharded(state, path)`` (and ``save_checkpoint``,
whose target is ``root/step-N``) writes into ``path.tmp-<token>``, a fresh directory per save (rank 0
draws the token and every rank learns it in the first agreement round). When every rank has written
(DCP's save ends with a collective over all ranks' write results) and rank 0 has written the manifest
(Note [Checkpoint manifest] in checkpoint/manifest.py), rank 0 renames the directory to ``path`` and fsyncs the
parent. A rename within one file system is atomic and fails when the target holds files, so:

* a directory with a manifest is one complete save; a save killed at any point leaves at worst a
  ``.tmp-<token>`` directory, which ``latest_checkpoint`` ignores and the next successful save of that
  path removes (a save that fails on a live rank removes its own);
* a target that already holds files is refused up front (``CheckpointExistsError``) unless
  ``overwrite=True``, which moves the old directory aside, renames the new one in and then deletes the
  old one: a crash between the two renames leaves ``path`` absent (and ``path.old-<token>``), never a
  mix of two saves;
* of two concurrent saves of one path, each writes its own directory; the first to commit wins, the
  other's rename fails (or its temporary directory is removed under it by the winner's clean-up) and it
  raises ``CheckpointError`` saying so. Nothing is ever mixed.
Assumes every rank sees the same file system (as DCP itself does). Errors: Note [Agreeing on checkpoint
errors] in core/agreement.py.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate

from .._compat import compute_local_shape_and_global_offset
from ..core.agreement import agreed as _agreed_on_every_rank
from ..core.agreement import rank_world
from ..dtensor.placements import as_layout_placements, placement_layout
from ..dtensor.sharding import box_placements, layout_moves, relayout
from . import manifest as _manifest
from .manifest import STEP_DIR, CheckpointError, CheckpointExistsError

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "relayout",
    "save_sequence_sharded",
    "load_sequence_sharded",
    "save_checkpoint",
    "latest_checkpoint",
    "export_hf_safetensors",
    "load_hf_safetensors",
]


# ---- save / load of sequence-sharded state ----


def _api_error(e: Exception, doing: str) -> Exception:
    if isinstance(e, (ValueError, CheckpointError)):
        return e
    return CheckpointError(f"{type(e).__name__}: {e} (while {doing}).")


def agreed(fn, doing: str, payload=lambda _: "") -> list[str]:
    """``core.agreement.agreed`` with the checkpoints' errors: see Note [Agreeing on checkpoint errors]."""
    return _agreed_on_every_rank(fn, doing, payload, wrap=_api_error,
                                 kinds={"CheckpointExistsError": CheckpointExistsError, "": CheckpointError})


def dcp_call(op: str, fn: Callable[[], Any], path: str) -> Any:
    """``fn`` (a dcp.save / dcp.load), with DCP's CheckpointException re-raised as CheckpointError."""
    try:
        return fn()
    except CheckpointException as e:
        first, (exc, _) = min(e.failures.items(), key=lambda kv: kv[0])
        raise CheckpointError(f"{type(exc).__name__}: {exc} (in dcp.{op} of {path}, rank(s) "
                              f"{sorted(e.failures)}; rank {first}'s traceback is above).") from e


def _sorted_items(state: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return sorted(state.items())  # one collective order on every rank, whatever the dict order


def _saved_from(value: Tensor) -> str:
    """'striped(2) on mesh (2,)': how a tensor was placed when saved (the files hold natural order)."""
    if not isinstance(value, DTensor):
        return "tensor"
    mesh = value.device_mesh
    names = []
    for md, p in enumerate(as_layout_placements(value.placements)):
        layout = None if isinstance(p, Replicate) else placement_layout(p, seq_len=value.shape[p.dim], cp=mesh.size(md))
        names.append(f"{layout}({p.dim})" if layout else str(p).lower())
    return f"{', '.join(names)} on mesh {tuple(mesh.shape)}"


def _occupied(path: str) -> bool:
    return os.path.lexists(path) and (not os.path.isdir(path) or bool(os.listdir(path)))


def _commit(tmp: str, path: str, *, overwrite: bool, token: str) -> None:
    """Rank 0: rename the written directory into place; see Note [Crash-safe checkpoint directories]."""
    if overwrite and _occupied(path):
        old = f"{path}.old-{token}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        try:
            os.rename(tmp, path)  # replaces an empty directory; fails if another save filled it meanwhile
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise _lost_race(path) from None
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)
    for suffix in (".tmp-*", ".old-*"):  # saves of this path that died (or lost), replacements cut short
        for left in glob.glob(glob.escape(path) + suffix):
            shutil.rmtree(left, ignore_errors=True)


def _lost_race(path: str) -> CheckpointError:
    return CheckpointError(f"another save committed {path} while this one was writing (two concurrent saves "
                           "of one path or step); this save was discarded and the directory holds the "
                           "other one. Save each step from one job, or to distinct paths.")


def _write(state: Mapping[str, Tensor], tmp: str, *, thread_count: int, path: str) -> None:
    """Every rank's boxes into ``tmp`` (one safetensors file per rank that holds any)."""
    boxes = {key: relayout(v, box_placements(v.placements)) if isinstance(v, DTensor) else v
             for key, v in _sorted_items(state)}
    writer = HuggingFaceStorageWriter(tmp, save_distributed=True, thread_count=thread_count)
    dcp_call("save", lambda: dcp.save(boxes, storage_writer=writer), path)


def _save(state: Mapping[str, Tensor], path: str, *, overwrite: bool, checksum: str | None, thread_count: int,
          exists_fix: str, check: Callable[[], None] = lambda: None) -> None:
    rank, world = rank_world()
    path = os.path.normpath(os.fspath(path))
    saved_from: dict[str, str] = {}

    def validate() -> str:
        check()
        if checksum not in (*_manifest.CHECKSUMS, None):
            raise ValueError(f"checksum must be one of {_manifest.CHECKSUMS} or None; got {checksum!r}.")
        for key, value in _sorted_items(state):
            if not isinstance(value, Tensor):
                raise ValueError(f"save_sequence_sharded saves tensors only (safetensors); {key!r} is a "
                                 f"{type(value).__name__}. Save other state separately.")
            if isinstance(value, DTensor):
                layout_moves(value, box_placements(value.placements))
            saved_from[key] = _saved_from(value)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise ValueError(f"{path} is a file, not a checkpoint directory; save to another path.")
        if _occupied(path) and not overwrite:
            raise CheckpointExistsError(f"{path} already holds files; {exists_fix}")
        return f"{os.urandom(6).hex()}\0{path}"

    payloads = agreed(validate, f"checking the save to {path}", payload=lambda p: p)
    token, paths = payloads[0].split("\0")[0], {p.split("\0")[1] for p in payloads}
    if len(paths) > 1:
        raise ValueError(f"the ranks save to different paths {sorted(paths)}; every rank must pass the same path.")
    tmp = f"{path}.tmp-{token}"
    agreed(lambda: rank == 0 and os.makedirs(tmp), f"creating {tmp}")
    try:
        _write(state, tmp, thread_count=thread_count, path=path)
        # each rank describes (sizes, digests, headers) every world-th file; see Note [Checkpoint manifest]
        files = agreed(lambda: _manifest.describe_files(tmp, sorted(os.listdir(tmp))[rank::world], checksum),
                        f"checksumming the files in {tmp}", payload=json.dumps)

        def commit() -> None:
            if rank != 0:
                return
            described = {n: f for text in files for n, f in json.loads(text).items()}
            manifest = _manifest.build(described, world_size=world, checksum=checksum, saved_from=saved_from)
            with open(os.path.join(tmp, _manifest.MANIFEST), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _commit(tmp, path, overwrite=overwrite, token=token)

        agreed(commit, f"committing {path}")
    except BaseException as e:
        lost = isinstance(e, CheckpointError) and not overwrite and _occupied(path)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if lost and "another save committed" not in str(e):
            raise _lost_race(path) from e
        raise


def save_sequence_sharded(state: Mapping[str, Tensor], path: str | os.PathLike, *, overwrite: bool = False,
                          checksum: str | None = "sha256", thread_count: int = 1) -> None:
    """Save ``state`` (DTensors in any layout, plain or replicated tensors) as sharded safetensors plus a
    ``manifest.json`` under ``path``, loadable at any CP size and layout by ``load_sequence_sharded``.
    Every rank calls it. Per-rank memory O(shard); see Note [Checkpointing layout shards].

    ``path`` must be empty or absent unless ``overwrite=True``, which replaces it atomically: the save
    is written beside and renamed into place (Note [Crash-safe checkpoint directories]). ``checksum``:
    "sha256" (default), "crc32" (faster, accidents only) or None, one digest per file, verified on load.
    Raises ValueError (arguments) or CheckpointError (files, DCP) on every rank."""
    _save(state, path, overwrite=overwrite, checksum=checksum, thread_count=thread_count,
          exists_fix="pass overwrite=True to replace it atomically, or save to an empty or new directory.")


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= n
    return tuple(reversed(stride))


def _empty_box(like: DTensor) -> DTensor:
    placements = box_placements(as_layout_placements(like.placements))
    local_shape, _ = compute_local_shape_and_global_offset(like.shape, like.device_mesh, placements)
    device = like.device_mesh.device_type if like.is_meta else like.to_local().device
    local = torch.empty(local_shape, dtype=like.dtype, device=device)
    return DTensor.from_local(local, like.device_mesh, placements, run_check=False, shape=like.shape,
                              stride=_contiguous_stride(like.shape))


def load_sequence_sharded(path: str | os.PathLike, like: Mapping[str, Tensor], *,
                          checksums: bool = True) -> dict[str, Tensor]:
    """New tensors for every key of ``like``, with its mesh, placements (any layout), shape and dtype,
    read from a checkpoint of ``save_sequence_sharded`` saved at any CP size and layout. Every rank
    calls it; ``like`` may live on the meta device.

    Before reading any tensor data it checks the checkpoint against its manifest (Note [Checkpoint
    manifest]): every file present, of its size, with its digest (``checksums=False`` skips only the
    digests) and header, no extra file, every requested tensor covered exactly once at the requested
    shape; any failure raises on every rank, naming the file. Reads JSON and safetensors only: nothing
    from ``path`` is unpickled."""
    root = os.path.normpath(os.fspath(path))
    rank, world = rank_world()

    def verify() -> None:
        for value in like.values():
            if isinstance(value, DTensor):
                layout_moves(value, box_placements(value.placements))
        manifest = _manifest.read(root)
        _manifest.check_listing(root, manifest)
        _manifest.check_request(root, manifest, {k: v.shape for k, v in like.items()})
        needed = sorted({p["file"] for k in like for p in manifest["tensors"][k]["pieces"]})
        _manifest.check_files(root, manifest, needed[rank::world], checksums=checksums)

    agreed(verify, f"checking checkpoint {root}")
    buffers: dict[str, Tensor] = {}
    for key, value in _sorted_items(like):
        if isinstance(value, DTensor):
            buffers[key] = _empty_box(value)
        else:
            buffers[key] = torch.empty(value.shape, dtype=value.dtype, device="cpu" if value.is_meta else value.device)
    dcp_call("load", lambda: dcp.load(buffers, storage_reader=HuggingFaceStorageReader(root)), root)
    out = {}
    for key, value in _sorted_items(like):
        box = buffers.pop(key)  # dropped as we go: one extra shard at a time
        out[key] = relayout(box, value.placements) if isinstance(value, DTensor) else box
    return out


# ---- step directories; see Note [Crash-safe checkpoint directories] ----



def save_checkpoint(state: Mapping[str, Tensor], root: str | os.PathLike, *, step: int, overwrite: bool = False,
                    checksum: str | None = "sha256") -> str:
    """``save_sequence_sharded`` into ``root/step-{step}``, committed atomically after every rank wrote.
    Every rank calls it; returns the committed directory."""
    final = os.path.join(os.fspath(root), f"step-{step}")

    def check() -> None:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0; got {step!r}.")

    _save(state, final, overwrite=overwrite, checksum=checksum, thread_count=1, check=check,
          exists_fix="pick a new step, or pass overwrite=True to replace it atomically.")
    return final


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The complete ``step-N`` directory under ``root`` with the largest N, or None. ``.tmp-*``
    directories (saves in progress or killed) never count; a ``step-N`` without a valid manifest
    (emptied, or written by something else) or with a non-canonical name (``step-007``) is skipped with
    a warning."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    best: tuple[int, str] | None = None
    for name in sorted(os.listdir(root)):
        if not (m := STEP_DIR.fullmatch(name)):
            continue
        path, step = os.path.join(root, name), int(m.group(1))
        if name != f"step-{step}":
            warnings.warn(f"latest_checkpoint skips {path}: save_checkpoint names step {step} 'step-{step}'. "
                          f"Rename it to step-{step} to resume from it.", stacklevel=2)
            continue
        try:
            _manifest.read(path)
        except CheckpointError as e:
            warnings.warn(f"latest_checkpoint skips {path}: {e}", stacklevel=2)
            continue
        if best is None or step > best[0]:
            best = (step, path)
    return best[1] if best else None


# ---- model weights as Hugging Face safetensors ----

def export_hf_safetensors(model_state: Mapping[str, Tensor], path: str | os.PathLike, *, adapter: Any = None) -> None:
    """Write a model state dict (plain, replicated or sharded tensors) as one Hugging Face safetensors
    checkpoint of full tensors under ``path``. ``adapter`` renames to HF names: anything with
    ``to_hf(state) -> state`` (and optionally ``fqn_to_index_mapping``), e.g. torchtitan's
    ``Llama3StateDictAdapter``. Every rank calls it."""
    state = adapter.to_hf(dict(model_state)) if adapter is not None else dict(model_state)
    mapping = getattr(adapter, "fqn_to_index_mapping", None)
    # each rank writes its share into path/sharded, then DCP consolidates full tensors into path
    writer = HuggingFaceStorageWriter(str(path), fqn_to_index_mapping=mapping, save_distributed=True,
                                      enable_consolidation=True)
    dcp_call("save", lambda: dcp.save(state, storage_writer=writer), os.fspath(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(os.path.join(path, "sharded"), ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()


def load_hf_safetensors(model: torch.nn.Module, path: str | os.PathLike, *, adapter: Any = None) -> None:
    """Load an HF safetensors checkpoint into ``model`` (weights replicated over CP, or DTensors): each
    rank reads what it holds, with no collectives, and nothing is unpickled. ``adapter`` as in
    ``export_hf_safetensors``, plus ``from_hf``."""
    state = model.state_dict()
    hf_state = adapter.to_hf(state) if adapter is not None else state
    dcp_call("load", lambda: dcp.load(hf_state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True),
             os.fspath(path))
    if adapter is not None:
        model.load_state_dict(adapter.from_hf(hf_state), strict=True)
