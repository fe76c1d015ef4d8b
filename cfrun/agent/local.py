"""The agent's local persist pipeline: one rank's slot -> O_DIRECT write -> fsync -> FileEntry.

Runs in the persist agent (``cfrun.agent.server``), on its writer thread (or a peer thread that
falls back to the job dir). For one :class:`~cfrun.contract.messages.PersistRequest` it writes
the slot's bytes to ``rank-NNNNN.bin`` in the step's staging directory straight from the shared
mapping (no unpickling, no re-serialization: ACUTE's Check-Pack), computes the xxh3-64 checksum
on the way, fsyncs, and writes the shard's JSON document next to it; the two
:class:`FileEntry` go to the commit (:mod:`cfrun.agent.commit`). Writes are large and 4 KiB
aligned, with ``O_DIRECT`` where the file system allows it, so the page cache is not filled with
checkpoint bytes.
"""

from __future__ import annotations

import mmap
import os
import signal
from collections.abc import Iterable
from pathlib import Path

import xxhash

from cfrun.contract import faults, slots
from cfrun.contract.checkpoints import FileEntry, shard_names, staging_dir
from cfrun.contract.fsio import open_new, write_atomic
from cfrun.contract.jobdir import JobDir
from cfrun.contract.manifest import dumps_json
from cfrun.contract.messages import PersistRequest
from cfrun.storage.tiers import throttle

WRITE_CHUNK_BYTES = 16 << 20
"""Bytes per ``write()``: large and 4 KiB-aligned (a multiple of any O_DIRECT block size)."""


class LocalWriter:
    """Writes ranks' shards into the job dir's staging directories. Not thread-safe: the agent
    holds its local lock around :meth:`write_shard`.

    Args:
        jobdir: the job dir.
        slot_dirs: where a slot may be (:func:`cfrun.contract.slots.open_slot`).
        use_odirect: try ``O_DIRECT`` (``--no-odirect`` turns it off).
    """

    def __init__(self, jobdir: JobDir, slot_dirs: Iterable[Path], *, use_odirect: bool) -> None:
        self.jobdir = jobdir
        self.slot_dirs = list(slot_dirs)
        self.use_odirect = use_odirect

    def write_shard(self, req: PersistRequest) -> list[FileEntry]:
        """Write ``req``'s slot bytes and document into the staging directory of its step,
        fsynced; returns ``[bin entry, json entry]``.

        Raises:
            SlotRefused, OSError: the slot cannot be read or the file not written.
        """
        staging = staging_dir(self.jobdir.checkpoints, req.step)
        staging.mkdir(parents=True, exist_ok=True)
        bin_name, json_name = shard_names(req.rank)
        for stale in (bin_name, json_name):  # from an attempt that died before this step committed
            (staging / stale).unlink(missing_ok=True)
        bin_entry = self.write_slot(staging / bin_name, Path(req.slot), req.nbytes, req.step)
        json_entry = self.write_bytes(staging / json_name, dumps_json(req.doc))
        return [bin_entry, json_entry]

    def _open(self, path: Path) -> tuple[int, bool]:
        if self.use_odirect and hasattr(os, "O_DIRECT"):
            try:
                return open_new(path, direct=True), True
            except OSError:
                pass
        return open_new(path), False

    def write_slot(self, path: Path, slot: Path, nbytes: int, step: int) -> FileEntry:
        """Write ``nbytes`` of the shared-memory slot to ``path``, fsynced, with its checksum."""
        kill_at = faults.value("agent.kill_at_step")
        marker = self.jobdir.root / ".agent-kill-done"
        kill = kill_at is not None and step >= int(kill_at) and not marker.exists()
        th = throttle()  # testing aid: simulated network storage
        with os.fdopen(slots.open_slot(str(slot), self.slot_dirs, nbytes), "rb") as f, \
                mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            piece: memoryview | None = None
            try:
                digest = xxhash.xxh3_64_hexdigest(view)
                fd, direct = self._open(path)
                try:
                    chunk = WRITE_CHUNK_BYTES
                    if kill:
                        chunk = max(4096, nbytes // 2 // 4096 * 4096)  # die half-way through
                    for start in range(0, nbytes, chunk):
                        if kill and start > 0:
                            marker.touch()
                            os.kill(os.getpid(), signal.SIGKILL)
                        piece = view[start:start + chunk]
                        if th is not None:
                            th.take(len(piece))
                        if direct and len(piece) % 4096:
                            os.close(fd)  # the unaligned tail goes through the page cache
                            fd, direct = os.open(path, os.O_WRONLY | os.O_NOFOLLOW), False
                            os.lseek(fd, start, os.SEEK_SET)
                        while piece:
                            piece = piece[os.write(fd, piece):]
                        piece.release()
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                piece = None
                view.release()
        return FileEntry(path.name, nbytes, digest)

    @staticmethod
    def write_bytes(path: Path, data: bytes) -> FileEntry:
        """Write ``data`` to ``path`` (fsynced, the directory not), with its checksum."""
        th = throttle()
        nbytes, digest = write_atomic(path, [data], sync_dir=False,
                                      before_chunk=None if th is None else th.take)
        return FileEntry(path.name, nbytes, digest)
