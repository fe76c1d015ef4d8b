"""Writing, committing, verifying and loading checkpoints in a job dir's ``checkpoints/``.

Crash safety (DESIGN.md §3, "Persist"): every checkpoint is written into a fresh staging
directory (never over old files); each file is fsynced; ``manifest.json`` is written last, with
every file's size and xxh3-64 checksum; then the staging directory is renamed to ``step-NNNNNN``
and ``checkpoints/`` is fsynced. A reader looks only at ``step-*`` directories whose manifest
parses and matches the files (size, checksum), so a crash at any point leaves either the old
newest checkpoint or the new one, never a torn one. CheckFreq's prototype wrote straight to the
final file name; torchsnapshot never fsyncs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from cfrun import __version__
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.codec.format import (
    FORMAT_VERSION,
    TensorEntry,
    decode,
    dumps_json,
    plan_layout,
    tensor_bytes,
    tensor_from_buffer,
)
from cfrun.contract.jobdir import STAGING_PREFIX, STEP_PREFIX, atomic_write_json, fsync_dir, step_dir_name

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_WRITE_CHUNK_BYTES = 8 << 20


def shard_names(rank: int) -> tuple[str, str]:
    """``(rank-NNNNN.bin, rank-NNNNN.json)``: one rank's tensor bytes and its tree."""
    return f"rank-{rank:05d}.bin", f"rank-{rank:05d}.json"


def staging_dir(checkpoints: Path, step: int) -> Path:
    """Where all ranks write step ``step`` before it is committed."""
    return checkpoints / f"{STAGING_PREFIX}{step_dir_name(step)}"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as the manifest records it."""

    name: str
    nbytes: int
    xxh3_64: str


def _fsync_write(path: Path, chunks: list[memoryview | bytes]) -> FileEntry:
    """Write ``chunks`` to a new file, fsync it, return its size and checksum."""
    h = xxhash.xxh3_64()
    nbytes = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            h.update(view)
            for start in range(0, len(view), _WRITE_CHUNK_BYTES):
                piece = view[start:start + _WRITE_CHUNK_BYTES]
                while piece:
                    written = os.write(fd, piece)
                    piece = piece[written:]
            nbytes += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)
    return FileEntry(path.name, nbytes, h.hexdigest())


def write_shard(staging: Path, rank: int, tree: Any, tensors: list[torch.Tensor],
                meta: dict[str, Any]) -> list[FileEntry]:
    """Write one rank's state into ``staging`` (phase 2, synchronous form).

    Called by each rank for the same step. Creates ``staging`` if needed. Files are new
    (``O_EXCL``) and fsynced.

    Args:
        tree: JSON tree from :func:`cfrun.codec.format.encode`.
        tensors: the tensors ``tree`` refers to, any device.
        meta: extra JSON-able fields stored in the shard's JSON (step, data position...).

    Returns:
        The two files written, for the manifest.

    Raises:
        OSError: the disk refused the write (full, read-only...).
    """
    staging.mkdir(parents=True, exist_ok=True)
    entries, total = plan_layout(tensors)
    bin_name, json_name = shard_names(rank)
    chunks: list[memoryview | bytes] = []
    pos = 0
    for entry, t in zip(entries, tensors):
        if entry.offset > pos:
            chunks.append(bytes(entry.offset - pos))
        chunks.append(tensor_bytes(t).numpy().data)
        pos = entry.offset + entry.nbytes
    if total > pos:
        chunks.append(bytes(total - pos))
    bin_entry = _fsync_write(staging / bin_name, chunks)
    doc = {"format_version": FORMAT_VERSION, "rank": rank, "tree": tree,
           "tensors": [e.to_json() for e in entries], "meta": meta}
    json_entry = _fsync_write(staging / json_name, [dumps_json(doc)])
    return [bin_entry, json_entry]


def commit(checkpoints: Path, step: int, files: list[FileEntry], *, world_size: int,
           meta: dict[str, Any], keep: int | None) -> Path:
    """Make step ``step`` visible: manifest last, atomic rename, directory fsync, retention
    (``keep`` newest; ``None``: the caller applies :func:`apply_retention` later, e.g. after
    answering the ranks, so that deleting old files is not part of the PGT).

    Called once per checkpoint (by rank 0, or by the persist agent) after every rank's files
    are durable in the staging directory.

    Returns:
        The committed ``step-NNNNNN`` directory.

    Raises:
        OSError: the rename or a write failed; the previous newest checkpoint stays newest.
    """
    staging = staging_dir(checkpoints, step)
    manifest = {
        "format_version": FORMAT_VERSION,
        "cfrun_version": __version__,
        "step": step,
        "world_size": world_size,
        "committed_unix_s": time.time(),
        "files": [{"name": f.name, "nbytes": f.nbytes, "xxh3_64": f.xxh3_64} for f in files],
        "meta": meta,
    }
    fsync_dir(staging)
    atomic_write_json(staging / MANIFEST, manifest)
    final = checkpoints / step_dir_name(step)
    if final.exists():  # an older attempt committed the same step: keep it if it verifies
        try:
            verify(final)
            shutil.rmtree(staging, ignore_errors=True)
            return final
        except (CheckpointCorruptError, IncompatibleFormatError):
            quarantine(checkpoints, step)
    os.rename(staging, final)
    fsync_dir(checkpoints)
    if keep is not None:
        apply_retention(checkpoints, keep)
    return final


def apply_retention(checkpoints: Path, keep: int) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep``. Returns the deleted steps."""
    steps = committed_steps(checkpoints)
    deleted = []
    for step in steps[keep:]:
        shutil.rmtree(checkpoints / step_dir_name(step), ignore_errors=True)
        deleted.append(step)
    return deleted


def quarantine(checkpoints: Path, step: int) -> Path | None:
    """Move a committed checkpoint that failed verification aside (``corrupt-step-N-<t>``).

    It no longer counts as committed (nor for retention), and stays for inspection.
    """
    src = checkpoints / step_dir_name(step)
    dst = checkpoints / f"corrupt-{step_dir_name(step)}-{int(time.time() * 1000)}"
    try:
        os.rename(src, dst)
    except OSError:
        return None
    fsync_dir(checkpoints)
    return dst


def remove_staging(checkpoints: Path) -> int:
    """Remove staging directories of writers that died. Call only when no writer runs."""
    n = 0
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            if p.name.startswith(STAGING_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
                n += 1
    return n


def committed_steps(checkpoints: Path) -> list[int]:
    """Steps of directories that have a manifest, newest first (not yet verified)."""
    steps = []
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            if p.name.startswith(STEP_PREFIX) and (p / MANIFEST).is_file():
                try:
                    steps.append(int(p.name[len(STEP_PREFIX):]))
                except ValueError:
                    continue
    return sorted(steps, reverse=True)


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """Parse and check a manifest.

    Raises:
        CheckpointCorruptError: missing or malformed.
        IncompatibleFormatError: written by an incompatible cfrun.
    """
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointCorruptError(f"{step_dir.name}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict) or "files" not in manifest:
        raise CheckpointCorruptError(f"{step_dir.name}: malformed manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise IncompatibleFormatError(
            f"{step_dir.name}: format_version {manifest.get('format_version')!r}, "
            f"this cfrun reads {FORMAT_VERSION}")
    return manifest


def _read_verified(step_dir: Path, manifest: dict[str, Any], name: str) -> bytearray:
    entry = next((f for f in manifest["files"] if f["name"] == name), None)
    if entry is None:
        raise CheckpointCorruptError(f"{step_dir.name}: manifest lists no {name}")
    try:
        data = bytearray((step_dir / name).read_bytes())
    except OSError as e:
        raise CheckpointCorruptError(f"{step_dir.name}/{name}: unreadable ({e})") from None
    if len(data) != entry["nbytes"]:
        raise CheckpointCorruptError(
            f"{step_dir.name}/{name}: {len(data)} bytes, manifest says {entry['nbytes']}")
    if xxhash.xxh3_64_hexdigest(data) != entry["xxh3_64"]:
        raise CheckpointCorruptError(f"{step_dir.name}/{name}: checksum mismatch")
    return data


def verify(step_dir: Path) -> dict[str, Any]:
    """Check every file of a committed checkpoint against its manifest; return the manifest.

    Raises:
        CheckpointCorruptError, IncompatibleFormatError.
    """
    manifest = read_manifest(step_dir)
    for f in manifest["files"]:
        _read_verified(step_dir, manifest, f["name"])
    return manifest


def load_shard(step_dir: Path, rank: int) -> tuple[Any, dict[str, Any]]:
    """Load and verify one rank's state from a committed checkpoint.

    Returns:
        ``(state, meta)``: the decoded tree (tensors on CPU) and the shard's meta dict.

    Raises:
        CheckpointCorruptError: a file is missing, truncated or fails its checksum.
        IncompatibleFormatError: written by an incompatible cfrun.
    """
    manifest = read_manifest(step_dir)
    doc, tensors = _read_rank(step_dir, manifest, rank)
    layout = doc["tree"].get("sharded") if isinstance(doc["tree"], dict) else None
    if layout:  # DeepFreeze 1/N: every rank's slices of the replicated tensors
        from cfrun.codec.sharding import reassemble

        others = {}
        for q in range(int(manifest.get("world_size", 1))):
            if q != rank:
                q_doc, q_tensors = _read_rank(step_dir, manifest, q)
                others[q] = (q_tensors, q_doc["tree"].get("sharded") or [])
        try:
            reassemble(rank, tensors, layout, others)
        except ValueError as e:
            raise CheckpointCorruptError(f"{step_dir.name}: {e}") from None
    return decode(doc["tree"], tensors), doc.get("meta", {})


def _read_rank(step_dir: Path, manifest: dict[str, Any], rank: int
               ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One rank's verified JSON doc and its tensors (CPU)."""
    bin_name, json_name = shard_names(rank)
    doc = json.loads(_read_verified(step_dir, manifest, json_name))
    data = _read_verified(step_dir, manifest, bin_name)
    try:
        tensors = [tensor_from_buffer(data, TensorEntry.from_json(e)) for e in doc["tensors"]]
    except ValueError as e:
        raise CheckpointCorruptError(f"{step_dir.name}/{bin_name}: {e}") from None
    return doc, tensors


def check_complete(step_dir: Path) -> dict[str, Any]:
    """Every rank's shard is listed in the manifest and present at its recorded size.

    Each rank checks this for the whole checkpoint before loading its own shard, so that all
    ranks skip the same incomplete checkpoint (a rank whose shard is missing must not fall back
    to an older step while the others load this one). Reads only the manifest and ``stat``s.

    Raises:
        CheckpointCorruptError: a rank's shard is missing from the manifest or the directory,
            or has another size.
    """
    manifest = read_manifest(step_dir)
    names = {f["name"]: int(f["nbytes"]) for f in manifest["files"]}
    for r in range(int(manifest.get("world_size", 1))):
        for name in shard_names(r):
            if name not in names:
                raise CheckpointCorruptError(f"{step_dir.name}: rank {r}'s {name} is not in "
                                             "the manifest")
            try:
                size = (step_dir / name).stat().st_size
            except OSError:
                raise CheckpointCorruptError(f"{step_dir.name}: rank {r}'s {name} is "
                                             "missing") from None
            if size != names[name]:
                raise CheckpointCorruptError(f"{step_dir.name}: rank {r}'s {name} has {size} "
                                             f"bytes, the manifest says {names[name]}")
    return manifest


class WorldSizeChangedError(Exception):
    """The newest checkpoint was written by another number of ranks (nothing is skipped or
    quarantined: the checkpoint is fine, the run is not)."""

    def __init__(self, step: int, saved: int, now: int) -> None:
        super().__init__(f"checkpoint step {step} was written by {saved} ranks, this run has "
                         f"{now}")
        self.step, self.saved, self.now = step, saved, now


def load_newest(checkpoints: Path, rank: int, *, on_skip: Any = None,
                world_size: int | None = None) -> tuple[int, Any, dict[str, Any]] | None:
    """The newest checkpoint that verifies, falling back to older ones.

    A checkpoint that fails verification is quarantined (:func:`quarantine`) so that neither
    retention nor a later commit of the same step counts it; ``on_skip(step, error)`` is called
    for each (the runtime logs it loudly).

    Returns:
        ``(step, state, meta)``, or ``None`` when no committed checkpoint verifies.

    Raises:
        WorldSizeChangedError: ``world_size`` is given and the newest readable manifest was
            written by another number of ranks (before any rank loads or quarantines anything).
    """
    for step in committed_steps(checkpoints):
        step_dir = checkpoints / step_dir_name(step)
        try:
            manifest = check_complete(step_dir)
            saved = int(manifest.get("world_size", 1))
            if world_size is not None and saved != world_size:
                raise WorldSizeChangedError(step, saved, world_size)
            state, meta = load_shard(step_dir, rank)
        except (CheckpointCorruptError, IncompatibleFormatError) as e:
            logger.warning("cfrun: skipping checkpoint %s: %s; trying the previous one",
                           step_dir.name, e)
            if on_skip is not None:
                on_skip(step, e)
            if isinstance(e, CheckpointCorruptError):
                quarantine(checkpoints, step)
            continue
        return step, state, meta
    return None
