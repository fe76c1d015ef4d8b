"""The agent's local persist pipeline: one rank's slot -> O_DIRECT write -> fsync -> FileEntry.

Runs in the persist agent (``cfrun.agent.server``), on its writer thread (or a peer thread that
falls back to the job dir). For one :class:`~cfrun.contract.messages.PersistRequest` it writes
the slot's bytes to ``rank-NNNNN.bin`` in the step's staging directory straight from the shared
mapping (no unpickling, no re-serialization: ACUTE's Check-Pack), computes the xxh3-64 checksum
on the way, fsyncs, and writes the shard's JSON document next to it; the two
:class:`FileEntry` go to the commit (:mod:`cfrun.agent.commit`). Writes are large and 4 KiB
aligned, with ``O_DIRECT`` where the file system allows it, so the page cache is not filled with
checkpoint bytes.

Before the first shard of a step is written, :class:`SpaceGuard` checks the job dir's free space
against the checkpoint's size (issue 13, "a full disk"): when it is short, committed checkpoints
older than the newest loadable one are pruned, oldest first, and if that is not enough the
checkpoint is skipped (a failure reply, one warning per outage, a ``checkpoint_skipped`` event);
the first checkpoint that fits again ends the outage (``disk_space_back``).
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

from cfrun.contract import faults, slots
from cfrun.contract.checkpoints import (
    FileEntry,
    committed_steps,
    good_steps,
    shard_names,
    staging_dir,
)
from cfrun.contract.fsio import open_new, tree_bytes, write_atomic
from cfrun.contract.jobdir import JobDir, step_dir_name
from cfrun.contract.manifest import dumps_json
from cfrun.contract.messages import PersistRequest
from cfrun.storage.tiers import throttle

logger = logging.getLogger("cfrun.agent")

WRITE_CHUNK_BYTES = 16 << 20
"""Bytes per ``write()``: large and 4 KiB-aligned (a multiple of any O_DIRECT block size)."""
SHARD_DOC_ALLOWANCE_BYTES = 64 << 10
"""Room counted for each rank's JSON document besides its slot bytes (a guess on the high side:
the tensor table of a large model is a few KiB)."""
SPACE_MARGIN_BYTES = 1 << 20
"""Free space kept beyond a checkpoint's size (its manifest, the events, the heartbeats)."""


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s file system (``statvfs``
    ``f_bavail * f_frsize``: what ``df`` shows as available)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class SpaceGuard:
    """Decides, before a step's first shard is written, whether the checkpoint fits in the job
    dir; prunes older checkpoints to make room. The agent's writer thread (under its local
    lock); not thread-safe.

    Args:
        jobdir: the job dir.
        free: bytes free on the job dir's file system (:func:`free_bytes`; tests replace it).
    """

    def __init__(self, jobdir: JobDir, free: Callable[[Path], int] = free_bytes) -> None:
        self.jobdir = jobdir
        self.free = free
        self.skipped = 0
        """Checkpoints skipped for lack of space since the agent started."""
        self.outage_skipped = 0
        """Checkpoints skipped in the current outage (0: none now)."""

    @staticmethod
    def need_bytes(req: PersistRequest) -> int:
        """What step ``req.step`` needs free: every rank's slot (assumed the size of this
        rank's), their documents, and :data:`SPACE_MARGIN_BYTES`."""
        return req.world_size * (req.nbytes + SHARD_DOC_ALLOWANCE_BYTES) + SPACE_MARGIN_BYTES

    def admit(self, req: PersistRequest) -> str | None:
        """None when step ``req.step`` may be written (pruning older checkpoints first if
        needed), else why it is skipped (the failure reply's text). Never raises for a disk
        that cannot be asked (then it is written and its failure, if any, reported)."""
        need = self.need_bytes(req)
        checkpoints = self.jobdir.checkpoints
        try:
            free = self.free(checkpoints)
            if free < need:
                free = self._prune(req.step, need, free)
        except OSError as e:
            logger.warning("cfrun agent: could not check the free space of %s: %r",
                           checkpoints, e)
            return None
        if free < need:
            self.skipped += 1
            self.outage_skipped += 1
            if self.outage_skipped == 1:
                logger.warning(
                    "cfrun agent: the job dir has %.1f MiB free, a checkpoint needs %.1f MiB: "
                    "skipping checkpoints (from step %d) until space comes back; free space "
                    "in %s", free / 2**20, need / 2**20, req.step, self.jobdir.root)
            self.jobdir.emit_event("checkpoint_skipped", step=req.step, need_bytes=need,
                                   free_bytes=free)
            return (f"skipped: the job dir has {free} bytes free, step {req.step}'s checkpoint "
                    f"needs {need}")
        if self.outage_skipped:
            logger.warning("cfrun agent: space is back (%.1f MiB free): checkpoints resume at "
                           "step %d after %d skipped", free / 2**20, req.step,
                           self.outage_skipped)
            self.jobdir.emit_event("disk_space_back", step=req.step,
                                   skipped=self.outage_skipped, free_bytes=free)
            self.outage_skipped = 0
        return None

    def _prune(self, step: int, need: int, free: int) -> int:
        """Delete committed checkpoints older than the newest good one
        (:func:`cfrun.contract.checkpoints.good_steps`; never that one), oldest first, until
        ``need`` bytes are free; returns the bytes free then."""
        checkpoints = self.jobdir.checkpoints
        steps = committed_steps(checkpoints)  # newest first
        good = good_steps(checkpoints)
        if not good:
            return free
        for old in reversed([s for s in steps if s < good[0]]):
            path = checkpoints / step_dir_name(old)
            nbytes = tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            free = self.free(checkpoints)
            logger.warning("cfrun agent: pruned checkpoint step %d (%.1f MiB) to make room for "
                           "step %d", old, nbytes / 2**20, step)
            self.jobdir.emit_event("checkpoint_pruned", step=old, bytes=nbytes,
                                   need_bytes=need, free_bytes=free)
            if free >= need:
                break
        return free


class SlotMaps:
    """The agent's read-only mappings of the ranks' slots, kept from one persist to the next.

    A slot is allocated once per rank and reused for every checkpoint; mapping it anew for each
    persist paid a page fault per 4 KiB page on the first read: 0.2 s per 0.5 GB on a loaded
    2-core machine, more than half of the write's own time at 1.4 GB/s (bench/scaling.py). A
    mapping is dropped as soon as its file is gone or replaced (another inode at that name: a
    new attempt's slot), so it never holds an old slot's memory past the next persist. The
    agent's writer thread (under its local lock); not thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int, int], mmap.mmap]] = {}

    def get(self, fd: int, slot: str, nbytes: int) -> mmap.mmap:
        """A read-only mapping of the first ``nbytes`` of the open slot ``fd`` (named ``slot``):
        the cached one when it maps this very file (device, inode) at this size, else a new one.

        Raises:
            OSError: the file cannot be mapped.
        """
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, nbytes)
        self.drop_stale()
        got = self._maps.get(slot)
        if got is not None and got[0] == key:
            return got[1]
        if got is not None:
            del self._maps[slot]
            got[1].close()
        mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        self._maps[slot] = (key, mm)
        return mm

    def drop_stale(self) -> None:
        """Unmap every slot whose file is gone or is another file now."""
        for slot, (key, mm) in list(self._maps.items()):
            try:
                st = os.stat(slot, follow_symlinks=False)
                same = (st.st_dev, st.st_ino) == key[:2] and st.st_size >= key[2]
            except OSError:
                same = False
            if not same:
                del self._maps[slot]
                mm.close()

    def __len__(self) -> int:
        return len(self._maps)


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
        self.maps = SlotMaps()

    def write_shard(self, req: PersistRequest) -> list[FileEntry]:
        """Write ``req``'s slot bytes and document into the staging directory of its step,
        fsynced; returns ``[bin entry, json entry]``.

        Raises:
            SlotRefused, OSError: the slot cannot be read or the file not written.
        """
        staging = staging_dir(self.jobdir.checkpoints, req.step)
        staging.mkdir(mode=0o700, parents=True, exist_ok=True)
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
        fd = slots.open_slot(str(slot), self.slot_dirs, nbytes)
        try:
            mm = self.maps.get(fd, str(slot), nbytes)
        finally:
            os.close(fd)  # the mapping stays, for the next persist of this slot
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
