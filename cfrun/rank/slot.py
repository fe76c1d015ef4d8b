"""The snapshot slot: one rank's shared-memory byte buffer that a checkpoint is copied into and
the persist agent reads (phase 1's destination; :mod:`cfrun.rank.snapshot`).

A file in the job's private slot directory in shared memory (``/dev/shm``, or
``CFRUN_SHM_DIR``; 0700, a random name, mode 0600: :mod:`cfrun.contract.slots`), mapped into the
rank as a ``uint8`` tensor (``torch.from_file(shared=True)``) and read by the persist agent
through ``mmap`` without any copy or unpickling. Allocated once, grown only if the state grows
(never while the agent still reads it); on CUDA it is page-locked (``cudaHostRegister``, only on
tmpfs/hugetlbfs: a disk file's mapping cannot be) so device to host copies run asynchronously at
full bandwidth. Allocation, a first write of every page and the page-locking happen on a
background thread from the first optimizer step of each process (:meth:`SnapshotSlot.prepare`),
not in the first checkpoint (issue 23). A copy into a reused buffer runs ~2.5x faster than into
fresh memory on this class of machine (DCP stages into fresh memory each time).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from cfrun.contract import faults, ipc, slots
from cfrun.rank import cuda

logger = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 4096
"""Slot sizes are multiples of this, so the agent can write them with O_DIRECT."""
PIN_PAUSE_S = 0.005
"""Seconds the preparing thread sleeps between two pieces it page-locks
(:data:`cfrun.rank.cuda.PIN_CHUNK_BYTES`): the training thread's CUDA calls, waiting on the
driver meanwhile, get through (issue 23)."""
ENV_SHM_DIR = slots.ENV_SHM_DIR


def shm_dir(job_dir: Path, nbytes: int) -> Path:
    """Where this rank's slot goes: the job's private slot directory in shared memory (made by
    the supervisor, published by the agent in ``agent.json``) when it has room for the node
    (:func:`node_room_bytes`: every local rank's slot of about ``nbytes``, twice),
    ``$CFRUN_SHM_DIR``: always; else ``<job_dir>/.slots`` (private too, backed by the disk)."""
    try:
        private = ipc.read_agent_record(job_dir).slot_dir
    except OSError:
        private = None
    if private and slots.is_private_dir(Path(private)):
        if os.environ.get(ENV_SHM_DIR):
            return Path(private)
        st = os.statvfs(private)
        if st.f_bavail * st.f_frsize >= node_room_bytes(Path(private), nbytes):
            return Path(private)
    return slots.fallback_dir(job_dir)


def node_room_bytes(directory: Path, nbytes: int) -> int:
    """Free bytes ``directory`` must have before a rank puts a slot of ``nbytes`` there: twice
    the slots of every rank of this node (``LOCAL_WORLD_SIZE``, torchrun's; ranks of a data
    parallel job hold states of about one size), less what the slot files already there
    occupy (those pages are already out of the free count). A per-rank check let eight ranks
    each see room for their own slot in a /dev/shm that holds two (issue 18, item 11); the
    first rank to run out then fails in the middle of a copy (SIGBUS on a full tmpfs)."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    written = 0
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if entry.is_file(follow_symlinks=False):
                    written += entry.stat(follow_symlinks=False).st_blocks * 512
    except OSError:
        pass
    return max(2 * nbytes, 2 * nbytes * local - written)


def slot_prefix(job_dir: Path) -> str:
    """Name prefix of a job's slot directories on this node (``<prefix>_<random>``)."""
    return slots.dir_prefix(job_dir)


class SnapshotSlot:
    """A shared-memory byte buffer that grows but is otherwise allocated once.

    Its file ``rank<R>-<pid>-<random>.slot`` is created exclusively, 0600, in the job's private
    slot directory (:mod:`cfrun.contract.slots`). A restarted rank does not
    reuse its predecessor's file (the agent might still read a snapshot the predecessor handed
    off); :meth:`remove_stale` deletes it once the agent has drained that work. The slot can be
    made ready ahead of the first checkpoint, off the training thread (:meth:`prepare`).
    """

    def __init__(self, job_dir: Path, rank: int) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.path: Path | None = None
        self.buf: torch.Tensor | None = None
        self.generation = 0
        self.pinned = False
        self.pin_error: str | None = None
        """Why the slot could not be page-locked (a CUDA error's name, or the file system the
        slot is on), if it could not."""
        self._pin_tried = 0
        """The :attr:`generation` whose page-locking failed (not tried again for it)."""
        self._preparing: threading.Thread | None = None
        self.prepare_error: str | None = None
        """Why the last :meth:`prepare` failed (the first checkpoint then allocates)."""
        self.prepared_bytes = 0
        """The size the last :meth:`prepare` asked for (0: none yet)."""
        self.preparing_pin = False
        """Whether the last :meth:`prepare` page-locks the slot (CUDA state)."""
        self.hold = threading.Event()
        """Set: the preparing thread may go on (only the fault point
        ``rank.slot_ready_after_steps`` makes it wait for this)."""

    def prepare(self, nbytes: int, *, pin: bool, device: torch.device | None = None) -> None:
        """Allocate (or grow to) ``nbytes``, write every page once and, with ``pin``, page-lock
        the slot, all on a background thread (issue 23: on the training thread this cost the
        first checkpoint of every process 2.3-2.8 s on an H100 with a 4.46 GB state). Any
        thread, only while no checkpoint is in flight; :meth:`ensure` waits for it. An error
        is kept in :attr:`prepare_error`, never raised (the first checkpoint then tries
        again)."""
        self.wait_prepared()
        self.prepared_bytes = nbytes
        self.hold = threading.Event()
        self.preparing_pin = pin or faults.value("rank.slot_ready_after_steps") is not None
        self._preparing = threading.Thread(target=self._prepare, args=(nbytes, pin, device),
                                           name="cfrun-slot", daemon=True)
        self._preparing.start()

    def _prepare(self, nbytes: int, pin: bool, device: torch.device | None) -> None:
        if faults.value("rank.slot_ready_after_steps") is not None:
            self.hold.wait(120)  # set by the step hook (the fault's step) or wait_prepared()
        try:
            if device is not None:
                torch.cuda.set_device(device)  # no context on device 0 (issue 18, item 4)
                cuda.relax_capture_mode()  # the script may be capturing a CUDA graph meanwhile
            fresh = self.buf is None or self.buf.numel() < nbytes
            buf = self._ensure(nbytes, False, device)
            if fresh:
                with torch.no_grad():
                    buf.fill_(0)  # the pages exist now: neither the page-locking nor the
                    # first copy allocates them (inside cudaHostRegister it held the step)
            if pin:  # in pieces, pausing between them: a step waits for one piece at most
                self._ensure(nbytes, True, device, pause_s=PIN_PAUSE_S)
            self.prepare_error = None
        except Exception as e:  # the first checkpoint allocates instead
            self.prepare_error = repr(e)
            logger.warning("cfrun: preparing the snapshot slot failed: %r", e)

    def preparing(self) -> bool:
        """True while :meth:`prepare`'s thread runs."""
        return self._preparing is not None and self._preparing.is_alive()

    def locking(self) -> bool:
        """True while :meth:`prepare`'s thread page-locks the slot (or may: CUDA state), the
        wait a one-rank job defers a checkpoint for (:meth:`Boundary._in_flight`)."""
        return self.preparing_pin and self.preparing()

    def wait_prepared(self) -> None:
        """Wait for :meth:`prepare`'s thread, if one runs."""
        self.hold.set()  # a thread held by the fault point rank.slot_ready_after_steps goes on
        thread, self._preparing = self._preparing, None
        if thread is not None:
            thread.join()

    def ensure(self, nbytes: int, *, pin: bool, device: torch.device | None = None
               ) -> torch.Tensor:
        """A ``uint8`` tensor over the first ``nbytes`` of the slot, (re)allocating if needed
        (after waiting for :meth:`prepare`'s thread).

        With ``pin`` (the state has CUDA tensors, the first on ``device``), the slot is
        page-locked the first time it is needed, even if it was created earlier for CPU
        tensors, and only when it lies on tmpfs or hugetlbfs
        (:data:`cfrun.contract.slots.MEMORY_FS_TYPES`); :attr:`pinned` tells whether that
        worked and :attr:`pin_error` why not (a failed ``cudaHostRegister``'s error is
        cleared: :func:`cfrun.rank.cuda.host_register`; it is not tried again for the same
        file). Call only when the agent is not reading the slot (no persist in flight).
        """
        self.wait_prepared()
        return self._ensure(nbytes, pin, device)

    def _ensure(self, nbytes: int, pin: bool, device: torch.device | None, *,
                pause_s: float = 0.0) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < nbytes:
            self.release()
            directory = shm_dir(self.job_dir, nbytes)
            slots.ensure_private(directory)
            self.generation += 1
            self.path = slots.create_slot(directory, self.rank, nbytes)
            self.buf = torch.from_file(str(self.path), shared=True, size=nbytes,
                                       dtype=torch.uint8)
        if pin and not self.pinned and self._pin_tried != self.generation \
                and torch.cuda.is_available():
            self._pin_tried = self.generation
            self.pin_error = self._pin(device or torch.device("cuda",
                                                              torch.cuda.current_device()),
                                       pause_s)
            self.pinned = self.pin_error is None
        return self.buf[:nbytes]

    def _pin(self, device: torch.device, pause_s: float = 0.0) -> str | None:
        """Page-lock the slot, in pieces of :data:`cfrun.rank.cuda.PIN_CHUNK_BYTES` with
        ``pause_s`` between them; None when it worked, else why not. A slot that is not on a
        memory file system is not tried: ``cudaHostRegister`` of such a file mapping fails
        (issue 23)."""
        assert self.buf is not None and self.path is not None
        kind = slots.fs_type(self.path)
        if kind not in slots.MEMORY_FS_TYPES:
            return (f"the slot {self.path} is on {kind or 'an unknown file system'}, not "
                    "tmpfs/hugetlbfs (give /dev/shm room, e.g. docker --shm-size, or set "
                    "CFRUN_SHM_DIR)")
        return cuda.host_register(self.buf, device, pause_s=pause_s)

    def release(self) -> None:
        """Unpin, unmap and delete the slot file (the agent must not be reading it)."""
        if self.buf is not None and self.pinned:
            cuda.host_unregister(self.buf)
        self.pinned = False
        self.pin_error = None
        self.buf = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def remove_stale(self) -> int:
        """Delete this node's slot files whose process is gone (ranks of earlier attempts).

        Call right after the agent answered ``ready`` to a ``hello``: it has then persisted
        everything those ranks handed off before it, so nothing reads their slots any more (a
        mapping the agent still holds stays valid after the unlink anyway). Keeps /dev/shm at
        one slot per live rank across restarts. Links and files of other users are left
        alone. Returns the number of files deleted.
        """
        return slots.remove_dead_slots({shm_dir(self.job_dir, 0),
                                        slots.fallback_dir(self.job_dir)})


def remove_slots(job_dir: Path) -> int:
    """Delete this node's slot directories of ``job_dir`` and our slot files in them (the
    supervisor, at the start and the end of a job); never follows a link or deletes a file of
    another user (:func:`cfrun.contract.slots.remove_dirs`). Returns the files deleted."""
    return slots.remove_dirs(job_dir)
