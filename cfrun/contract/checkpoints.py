"""A job dir's ``checkpoints/``: write files, commit, list, verify, quarantine, retention.

Torch-free: the persist agent, the supervisor, ``cfrun ls``/``status`` and the ranks share it;
only :mod:`cfrun.codec.checkpoint` (what touches tensors) needs torch.

Crash safety (DESIGN.md §3, "Persist"): every checkpoint is written into a fresh staging
directory (never over old files); each file is fsynced; ``manifest.json`` is written last, with
every file's size and xxh3-64 checksum; then the staging directory is renamed to ``step-NNNNNN``
and ``checkpoints/`` is fsynced. A reader looks only at ``step-*`` directories whose manifest
parses and matches the files (size, checksum), so a crash at any point leaves either the old
newest checkpoint or the new one, never a torn one. CheckFreq's prototype wrote straight to the
final file name; torchsnapshot never fsyncs.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.fsio import fsync_dir, write_atomic
from cfrun.contract.jobdir import STAGING_PREFIX, parse_step_dir_name, step_dir_name
from cfrun.contract.manifest import (
    MANIFEST,
    FileEntry,
    Manifest,
    ManifestKeys,
    mac_required,
    read_manifest,
    shard_names,
)
from cfrun.contract.shard import check_docs

__all__ = ["CORRUPT", "INCOMPATIBLE", "MANIFEST", "FileEntry", "Manifest", "ManifestKeys",
           "apply_retention",
           "check_complete", "check_good", "commit", "committed_steps", "good_steps", "is_final",
           "quarantine", "read_manifest", "remove_staging", "shard_names", "staging_dir",
           "verify", "write_file"]

CORRUPT = "corrupt"
"""Reason of a checkpoint moved aside because its files or contents are bad
(``corrupt-step-NNNNNN-<ms>``)."""
INCOMPATIBLE = "incompatible"
"""Reason of a checkpoint moved aside because this cfrun cannot read its format
(``incompatible-step-NNNNNN-<ms>``)."""


def staging_dir(checkpoints: Path, step: int) -> Path:
    """Where all ranks write step ``step`` before it is committed."""
    return checkpoints / f"{STAGING_PREFIX}{step_dir_name(step)}"


def write_file(path: Path, parts: Iterable[bytes | bytearray | memoryview], *,
               before_chunk: Callable[[int], None] | None = None) -> FileEntry:
    """Write one new checkpoint file durably (:func:`cfrun.contract.fsio.write_atomic`, the
    directory is fsynced by :func:`commit`) and return its manifest entry.

    Raises:
        FileExistsError: ``path`` exists (a checkpoint file is never overwritten).
        OSError: the disk refused.
    """
    nbytes, digest = write_atomic(path, parts, sync_dir=False, exclusive=True,
                                  before_chunk=before_chunk)
    return FileEntry(path.name, nbytes, digest)


def commit(checkpoints: Path, step: int, files: list[FileEntry], *, world_size: int,
           meta: dict[str, Any], keep: int | None, keys: ManifestKeys | None = None) -> Path:
    """Make step ``step`` visible: manifest last, atomic rename, directory fsync, retention
    (``keep`` newest; ``None``: the caller applies :func:`apply_retention` later, e.g. after
    answering the ranks, so that deleting old files is not part of the PGT). With ``keys``
    (the job's :class:`ManifestKeys`) the manifest carries its MAC, and a directory of the
    same step already there counts only if its MAC is the job's.

    Called once per checkpoint (by rank 0, or by the persist agent) after every rank's files
    are durable in the staging directory.

    Returns:
        The committed ``step-NNNNNN`` directory.

    Raises:
        OSError: the rename or a write failed; the previous newest checkpoint stays newest.
        ValueError: ``files``/``meta`` cannot form a valid manifest.
    """
    staging = staging_dir(checkpoints, step)
    manifest = Manifest.build(step, world_size, files, meta)
    if keys is not None:
        manifest = manifest.signed(keys.sign)
    fsync_dir(staging)
    write_atomic(staging / MANIFEST, [manifest.dumps()])
    final = checkpoints / step_dir_name(step)
    if final.exists():  # an older attempt committed the same step: keep it if it verifies
        try:
            old = verify(final)
            if keys is not None:
                old.check_mac(keys, require=True)
            shutil.rmtree(staging, ignore_errors=True)
            return final
        except CheckpointCorruptError:
            quarantine(checkpoints, step, CORRUPT)
        except IncompatibleFormatError:
            quarantine(checkpoints, step, INCOMPATIBLE)
    os.rename(staging, final)
    fsync_dir(checkpoints)
    if keep is not None:
        apply_retention(checkpoints, keep, keys=keys)
    return final


def verify(step_dir: Path) -> Manifest:
    """Check a committed checkpoint without loading it; return its manifest.

    Every file the manifest lists is a regular file of the recorded size and checksum
    (streamed: memory bounded by one chunk), and every rank's tensor table is one the writer
    makes (:func:`cfrun.contract.shard.check_docs`). What ``cfrun ls`` shows as ``ok``.

    Raises:
        CheckpointCorruptError, IncompatibleFormatError.
    """
    manifest = read_manifest(step_dir)
    manifest.verify_dir(step_dir)
    check_docs(step_dir, manifest)
    return manifest


def is_final(step_dir: Path) -> bool:
    """Whether the committed checkpoint in ``step_dir`` is the one taken at the script's end
    (its manifest's ``meta.final``; :meth:`cfrun.rank.boundary.Boundary.final_checkpoint`):
    its models, optimizers and RNGs are the script's last step, but no script variable nor
    data position, so a resume never starts from it. False when the manifest cannot be read
    (that verdict is the resume's own)."""
    try:
        return read_manifest(step_dir).meta.get("final") is True
    except (CheckpointCorruptError, IncompatibleFormatError, OSError):
        return False


def check_good(step_dir: Path) -> Manifest:
    """The cheap half of "good": the manifest parses in a ``format_version`` this cfrun reads,
    and every rank's files are listed and present as regular files of their recorded sizes
    (:func:`check_complete`). Reads the manifest and ``lstat``s; no checksum (a resume
    checks those, :func:`cfrun.codec.checkpoint.load_newest`). Called by retention after every
    commit (persist agent, ranks' synchronous path).

    Raises:
        CheckpointCorruptError, IncompatibleFormatError: the checkpoint is not good.
    """
    return check_complete(step_dir)


def _good(checkpoints: Path) -> list[tuple[int, Manifest]]:
    """Committed steps that pass :func:`check_good` with their manifests, newest first."""
    good: list[tuple[int, Manifest]] = []
    for step in committed_steps(checkpoints):
        try:
            good.append((step, check_good(checkpoints / step_dir_name(step))))
        except (CheckpointCorruptError, IncompatibleFormatError):
            continue
    return good


def _ours(good: list[tuple[int, Manifest]], keys: ManifestKeys) -> list[int]:
    """The steps of ``good`` whose manifest is the job's (:meth:`Manifest.check_mac`; a
    MAC-less one only where none carries a MAC: :func:`mac_required`)."""
    require = mac_required([m for _, m in good])
    ours = []
    for step, m in good:
        try:
            m.check_mac(keys, require=require)
        except CheckpointCorruptError:
            continue
        ours.append(step)
    return ours


def good_steps(checkpoints: Path, *, keys: ManifestKeys | None = None) -> list[int]:
    """Committed steps that pass :func:`check_good`, newest first; with ``keys``, only those
    whose manifest is the job's (:func:`_ours`): a planted step neither counts toward
    ``keep`` nor is deleted."""
    good = _good(checkpoints)
    return _ours(good, keys) if keys is not None else [step for step, _ in good]


def apply_retention(checkpoints: Path, keep: int, *, keys: ManifestKeys | None = None
                    ) -> list[int]:
    """Delete good checkpoints beyond the newest ``keep`` good ones; returns the deleted steps.

    Only good checkpoints (:func:`check_good`) count toward ``keep``, and the newest good one
    is never deleted (``keep`` below 1 counts as 1): checkpoints of another ``format_version``
    or with a missing file, even higher-numbered ones, neither count nor get deleted here (a
    resume moves them aside with their reason, :func:`quarantine`). With ``keys`` only the
    job's own count (:func:`good_steps`): a step planted through a link or a swapped
    directory makes retention delete nothing of the job's (issue 32, finding 1). A step
    without a MAC older than the oldest one kept goes too once the job's own are MAC'd (the
    job's checkpoints from before issue 32); a step with another key's MAC is never deleted.
    Called by the persist agent after each commit (:mod:`cfrun.agent.commit`) and by
    :func:`commit`.
    """
    keep = max(keep, 1)
    good = _good(checkpoints)
    ours = _ours(good, keys) if keys is not None else [step for step, _ in good]
    doomed = ours[keep:]
    if keys is not None and len(ours) >= keep:
        oldest_kept = ours[keep - 1]
        doomed += [step for step, m in good if not m.mac and step < oldest_kept
                   and step not in doomed]
    deleted = []
    for step in sorted(doomed, reverse=True):
        shutil.rmtree(checkpoints / step_dir_name(step), ignore_errors=True)
        deleted.append(step)
    return deleted


def quarantine(checkpoints: Path, step: int, reason: str = CORRUPT) -> Path | None:
    """Move a committed checkpoint that cannot be used aside, with its reason in the name:
    ``corrupt-step-NNNNNN-<ms>`` (:data:`CORRUPT`: bad files or contents) or
    ``incompatible-step-NNNNNN-<ms>`` (:data:`INCOMPATIBLE`: a format this cfrun cannot
    read).

    It no longer counts as committed (:func:`committed_steps`), for retention, ``cfrun ls`` or
    a later resume, and stays for inspection. Several ranks may call this for the same step:
    one rename wins, the others return ``None``.
    """
    if reason not in (CORRUPT, INCOMPATIBLE):
        raise ValueError(f"quarantine reason {reason!r} is not {CORRUPT!r} or {INCOMPATIBLE!r}")
    src = checkpoints / step_dir_name(step)
    dst = checkpoints / f"{reason}-{step_dir_name(step)}-{int(time.time() * 1000)}"
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
    """Steps of ``step-NNNNNN`` directories (real directories, not links) that have a
    ``manifest.json`` entry, newest first (not parsed nor verified: see :func:`verify`)."""
    steps = []
    if checkpoints.is_dir():
        for p in checkpoints.iterdir():
            step = parse_step_dir_name(p.name)
            if step is None:
                continue
            try:
                if not stat.S_ISDIR(p.lstat().st_mode):
                    continue
                os.lstat(p / MANIFEST)
            except OSError:
                continue
            steps.append(step)
    return sorted(steps, reverse=True)


def check_complete(step_dir: Path, manifest: Manifest | None = None) -> Manifest:
    """Every rank's shard is listed in the manifest and present at its recorded size.

    Each rank checks this for the whole checkpoint before loading its own shard, so that all
    ranks skip the same incomplete checkpoint (a rank whose shard is missing must not fall back
    to an older step while the others load this one). Reads only the manifest (none when
    ``manifest`` is given: the one the caller authenticated) and ``lstat``s.

    Raises:
        CheckpointCorruptError: a rank's shard is missing from the manifest or the directory,
            is not a regular file, or has another size.
        IncompatibleFormatError: written by an incompatible cfrun.
    """
    if manifest is None:
        manifest = read_manifest(step_dir)
    names = {f.name: f.nbytes for f in manifest.files}
    for r in range(manifest.world_size):
        for name in shard_names(r):
            if name not in names:
                raise CheckpointCorruptError(f"{step_dir.name}: rank {r}'s {name} is not in "
                                             "the manifest")
            try:
                st = (step_dir / name).lstat()
            except OSError:
                raise CheckpointCorruptError(f"{step_dir.name}: rank {r}'s {name} is "
                                             "missing") from None
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointCorruptError(f"{step_dir.name}: rank {r}'s {name} is not a "
                                             "regular file")
            if st.st_size != names[name]:
                raise CheckpointCorruptError(f"{step_dir.name}: rank {r}'s {name} has "
                                             f"{st.st_size} bytes, the manifest says "
                                             f"{names[name]}")
    return manifest
