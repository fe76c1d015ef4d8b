"""Writing and loading one rank's tensors in a checkpoint (the part of checkpointing that
touches torch).

The directory operations (commit, verify, retention, quarantine, listing) are torch-free and
live in :mod:`cfrun.contract.checkpoints`, re-exported here for the ranks. This module adds
what needs tensors: :func:`write_shard` (the ranks' synchronous path), :func:`load_shard` and
:func:`load_newest` (resume, ``cfrun export``).

The loader checks what a checksum cannot (a checksum only says the bytes are the ones the
manifest's writer meant): file names, file types and sizes before reading, bounded JSON, every
tensor's dtype from an allow-list, ``nbytes`` equal to elements times item size, offsets where
the writer puts them and inside the file. Any check failing, or any error while decoding,
makes the checkpoint corrupt (:class:`CheckpointCorruptError`): :func:`load_newest` then skips
it and falls back to an older one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from cfrun.codec.format import (
    FORMAT_VERSION,
    decode,
    dumps_json,
    plan_layout,
    tensor_bytes,
    tensor_from_buffer,
)
from cfrun.contract.checkpoints import (  # noqa: F401  (re-exported for the ranks)
    MANIFEST,
    FileEntry,
    Manifest,
    apply_retention,
    check_complete,
    commit,
    committed_steps,
    quarantine,
    read_manifest,
    remove_staging,
    shard_names,
    staging_dir,
    verify,
    write_file,
)
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.jobdir import step_dir_name
from cfrun.contract.shard import read_doc

logger = logging.getLogger(__name__)

_fsync_write = write_file
"""Old name of :func:`cfrun.contract.checkpoints.write_file` (callers move to that)."""

_DECODE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                  RuntimeError, RecursionError, MemoryError)
"""What decoding a crafted shard can raise; each means a corrupt checkpoint."""


def write_shard(staging: Path, rank: int, tree: Any, tensors: list[torch.Tensor],
                meta: dict[str, Any]) -> list[FileEntry]:
    """Write one rank's state into ``staging`` (phase 2, synchronous form).

    Called by each rank for the same step. Creates ``staging`` if needed. Files are written
    with :func:`cfrun.contract.fsio.write_atomic` (new, 0600, fsynced, renamed into place).

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
    bin_entry = write_file(staging / bin_name, chunks)
    doc = {"format_version": FORMAT_VERSION, "rank": rank, "tree": tree,
           "tensors": [e.to_json() for e in entries], "meta": meta}
    json_entry = write_file(staging / json_name, [dumps_json(doc)])
    return [bin_entry, json_entry]


def load_shard(step_dir: Path, rank: int) -> tuple[Any, dict[str, Any]]:
    """Load and verify one rank's state from a committed checkpoint.

    Called by each rank on resume, and by ``cfrun export`` (rank 0).

    Returns:
        ``(state, meta)``: the decoded tree (tensors on CPU) and the shard's meta dict.

    Raises:
        CheckpointCorruptError: a file is missing, not a regular file, truncated, fails its
            checksum, or holds metadata the writer does not write (see the module doc).
        IncompatibleFormatError: written by an incompatible cfrun.
    """
    manifest = read_manifest(step_dir)
    if not 0 <= rank < manifest.world_size:
        raise CheckpointCorruptError(f"{step_dir.name}: no rank {rank} in a checkpoint of "
                                     f"{manifest.world_size} ranks")
    doc, tensors = _read_rank(step_dir, manifest, rank)
    try:
        layout = doc["tree"].get("sharded") if isinstance(doc["tree"], dict) else None
        if layout:  # DeepFreeze 1/N: every rank's slices of the replicated tensors
            from cfrun.codec.sharding import reassemble

            others = {}
            for q in range(manifest.world_size):
                if q != rank:
                    q_doc, q_tensors = _read_rank(step_dir, manifest, q)
                    q_tree = q_doc["tree"]
                    others[q] = (q_tensors, (q_tree.get("sharded") if isinstance(q_tree, dict)
                                             else None) or [])
            reassemble(rank, tensors, layout, others)
        meta = doc.get("meta", {})
        return decode(doc["tree"], tensors), meta
    except _DECODE_ERRORS as e:
        raise CheckpointCorruptError(f"{step_dir.name}: rank {rank}'s shard does not decode "
                                     f"({type(e).__name__}: {str(e)[:200]})") from None


def _read_rank(step_dir: Path, manifest: Manifest, rank: int
               ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One rank's verified JSON doc and its tensors (CPU), every entry checked.

    Raises:
        CheckpointCorruptError: see :func:`load_shard`.
    """
    bin_name, _ = shard_names(rank)
    doc, entries = read_doc(step_dir, manifest, rank)
    data = manifest.read_file(step_dir, bin_name)
    try:
        tensors = [tensor_from_buffer(data, e) for e in entries]
    except _DECODE_ERRORS as e:
        raise CheckpointCorruptError(f"{step_dir.name}/{bin_name}: {e}") from None
    return doc, tensors


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
            saved = manifest.world_size
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


def check_like(loaded: Any, live: Any, where: str) -> None:
    """The tensors of a loaded ``state_dict`` have the dtype and shape of the live object's.

    A checksum shows the bytes are the ones the manifest's writer meant, not that the
    metadata tells the truth: ``int32`` written over ``float32`` bytes has the right size and
    loads (and ``load_state_dict`` would convert it silently). The rank calls this before
    ``load_state_dict`` for each model and optimizer, which catches it. Nested dicts and lists
    are compared key by key; keys only on one side are left to ``load_state_dict``.

    Raises:
        CheckpointCorruptError: a tensor differs in dtype or shape, naming it.
    """
    stack: list[tuple[str, Any, Any]] = [(where, loaded, live)]
    while stack:
        path, a, b = stack.pop()
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape:
                raise CheckpointCorruptError(
                    f"{path} is {str(a.dtype).removeprefix('torch.')} {list(a.shape)} in the "
                    f"checkpoint, {str(b.dtype).removeprefix('torch.')} {list(b.shape)} live")
        elif isinstance(a, dict) and isinstance(b, dict):
            stack.extend((f"{path}.{k}", a[k], b[k]) for k in a if k in b)
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            stack.extend((f"{path}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b)))
