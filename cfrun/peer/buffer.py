"""Level 1 of the ``cfrun peer``: checkpoints in RAM, ACUTE's circular buffer with dirty bits.

ACUTE (IEEE Access'24, §V) keeps the checkpoints it receives in a circular buffer of RAM slots;
a slot's *dirty bit* is set when data is stored in it and cleared once the flush thread wrote it
to level 2, and a receiver waits while every slot is dirty. :class:`RamBuffer` is that buffer:

* **Slots**: at most ``slots`` checkpoints at once (one step of one job each), each at most
  ``max_checkpoint_bytes``. A new step takes a free slot, else the oldest one already flushed
  (FIFO), else a partial one its sender abandoned; when every slot holds unflushed data the
  sender waits for the flusher, up to a bound, then is refused (and persists elsewhere).
* **States**: :class:`SlotState` FILLING -> PROTECTED (every rank sealed) -> FLUSHING ->
  DURABLE; a failed flush goes back to PROTECTED and is retried. Only DURABLE is clean.
* **RAM accounting is of bytes held**, not of slots: :attr:`RamSlots.held_bytes` counts every
  part stored and every receive buffer of a transfer in progress (reserved before the receiver
  allocates it, given back only when the bytes are dropped), and never exceeds ``slots x
  max_checkpoint_bytes``. A checkpoint leaves its slot only with its bytes: one with a transfer
  in progress (or being read or flushed) is never evicted nor dropped; its sender either
  completes the part or its connection ends and the bytes are given back, then the slot frees.

The slots' admission and eviction, with the bytes they hold, are :class:`RamSlots`
(:mod:`cfrun.peer.ramslots`, with the :class:`Checkpoint` records); :class:`RamBuffer` keeps the
lock, the parts received, the seals, the readers and the flush queue.

The buffer keeps no socket and writes no file: the server's connection threads
(:mod:`cfrun.peer.server`) call it with parsed requests and bytes received, the flusher thread
(:mod:`cfrun.peer.flusher`) takes protected checkpoints from it in FIFO order. One lock (and its
condition) guards everything here; every public method takes it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from cfrun.peer.ramslots import (  # noqa: F401  (re-exported: older imports of the buffer)
    MAX_EVICTED_REMEMBERED,
    ORDER,
    STALE_PARTIAL_S,
    Checkpoint,
    PartFile,
    RamSlots,
    Refused,
    SlotState,
)

logger = logging.getLogger("cfrun.peer.server")


class RamBuffer:
    """ACUTE's level-1 circular buffer: parts received, seals, readers, dirty bits; its slots
    and their bytes are :attr:`ram` (:class:`~cfrun.peer.ramslots.RamSlots`).

    Args:
        slots: checkpoints held in RAM at most.
        max_checkpoint_bytes: bytes one checkpoint (all ranks) may hold.
        stopping: set when the peer stops (waiters return at once).
    """

    def __init__(self, slots: int, max_checkpoint_bytes: int, stopping: threading.Event) -> None:
        self.slots = slots
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.stopping = stopping
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.ram = RamSlots(slots, max_checkpoint_bytes)
        """The slots and the bytes they hold (every access under :attr:`lock`)."""
        self.flush_queue: list[Checkpoint] = []

    def ram_bytes(self) -> int:
        """Bytes held in RAM now, receive buffers of transfers in progress included
        (<= slots x max_checkpoint_bytes)."""
        with self.lock:
            return self.ram.held_bytes

    def wake(self) -> None:
        """Wake every waiter (the peer is stopping)."""
        with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------------ receiving

    def reserve(self, job: str, step: int, world_size: int, nbytes: int, wait_s: float
                ) -> Checkpoint | None:
        """Account ``nbytes`` of a transfer to (job, step), taking a slot if needed, waiting up
        to ``wait_s`` for one; nothing is allocated here.

        The caller then owns one transfer into the checkpoint and must end it with exactly one
        :meth:`receive` or :meth:`abandon`.

        Returns:
            The checkpoint to receive into, or None when it is complete already (a retried
            transfer: nothing to send).

        Raises:
            Refused: another world size, over ``max_checkpoint_bytes``, or no slot in time.
        """
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                admitted, ck = self.ram.admit(job, step, world_size, nbytes)
                if admitted:
                    return ck
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    raise Refused(f"all {self.slots} slots hold unflushed checkpoints or "
                                  "transfers in progress")
                self.cond.wait(min(left, 1.0))

    def receive(self, ck: Checkpoint, name: str, *, part: int, nparts: int, offset: int,
                file_bytes: int, buf: bytearray, checksum_ok: bool) -> bool:
        """End a transfer: store the part received under a reservation of ``len(buf)`` bytes
        (or give the reservation back when it cannot be kept). Returns whether it was stored."""
        with self.cond:
            ck.transfers -= 1
            ck.t_activity = time.monotonic()
            f = ck.files.get(name)
            ok = checksum_ok
            if (not ok or ck.state is not SlotState.FILLING or not self.ram.holds(ck)
                    or (f is not None and (f.nbytes != file_bytes or f.nparts != nparts))):
                ok = False
                self.ram.release(ck, len(buf))
            else:
                f = ck.files.setdefault(name, PartFile(file_bytes, nparts))
                old = f.parts.get(part)
                f.parts[part] = (offset, buf)
                if old is not None:  # a resent part replaces the first copy
                    self.ram.release(ck, len(old[1]))
            self.ram.drop_if_superseded(ck)
            self.cond.notify_all()
            return ok

    def abandon(self, ck: Checkpoint, nbytes: int) -> None:
        """End a transfer under a reservation of ``nbytes`` that brought no bytes (the sender
        vanished mid-transfer, or the reply could not be sent): give them back."""
        with self.cond:
            ck.transfers -= 1
            self.ram.release(ck, nbytes)
            self.ram.drop_if_superseded(ck)
            self.cond.notify_all()

    # ------------------------------------------------------------------ sealing, reading

    def seal(self, job: str, step: int, rank: int, entries: list[dict[str, Any]],
             meta: dict[str, Any], tag: str, *, tag_ok: bool,
             job_tag: str | None = None, sha256: list[str] | None = None) -> SlotState:
        """Record rank ``rank``'s seal over its files ``entries`` (``tag_ok``: its tag matched
        them); once every rank sealed, the checkpoint is PROTECTED and queued for the flusher.

        Returns:
            The checkpoint's state after the seal.

        Raises:
            Refused: the step is not in RAM, a file is incomplete, or the tag did not match.
        """
        with self.cond:
            ck = self.ram.get(job, step)
            if ck is None:
                raise Refused(f"step {step} is not in peer RAM")
            if ck.state is not SlotState.FILLING:
                return ck.state
            for e in entries:
                f = ck.files.get(e["name"])
                if f is None or f.nbytes != e["nbytes"] or not f.is_complete():
                    raise Refused(f"{e['name']} of step {step} is incomplete in peer RAM")
            if not tag_ok:
                raise Refused(f"the seal of rank {rank} of step {step} does not match its "
                              "files (an agent of another job or token?)")
            ck.sealed[rank] = entries
            ck.seal_tags[rank] = tag
            if job_tag is not None:
                ck.job_tags[rank] = job_tag
            if sha256 is not None:
                ck.job_sha256[rank] = list(sha256)
            if rank == 0:
                ck.meta = meta
            ck.t_activity = time.monotonic()
            if len(ck.sealed) == ck.world_size:
                ck.state = SlotState.PROTECTED
                ck.t_protected = time.time()
                self.flush_queue.append(ck)
                self.ram.supersede_older(job, step)  # older partial steps are dead
                logger.info("protected %s step %d: %d bytes from %d ranks in %.3f s", job, step,
                            ck.reserved_bytes, ck.world_size, ck.t_protected - ck.t_first)
            self.cond.notify_all()
            return ck.state

    def await_state(self, job: str, step: int, want: SlotState, timeout_s: float
                    ) -> tuple[str, str | None]:
        """Block until (job, step) reaches ``want`` (or ``timeout_s`` passes, or the peer
        stops). Returns ``(state, flush_error)``; state ``missing`` when it is not in RAM (and
        was not flushed then evicted)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                ck = self.ram.get(job, step)
                if ck is None and (job, step) in self.ram.evicted_durable:  # flushed, evicted
                    return SlotState.DURABLE.value, None
                if ck is None:
                    return "missing", None
                left = deadline - time.monotonic()
                if ORDER[ck.state] >= ORDER[want] or left <= 0 or self.stopping.is_set():
                    return ck.state.value, ck.flush_error
                self.cond.wait(min(left, 1.0))

    def listing(self, job: str) -> list[dict[str, Any]]:
        """``[{step, world_size, state, bytes}]`` of ``job`` in RAM, newest first."""
        with self.lock:
            cks = [{"step": c.step, "world_size": c.world_size, "state": c.state.value,
                    "bytes": c.reserved_bytes}
                   for c in self.ram.checkpoints.values() if c.job == job]
        return sorted(cks, key=lambda c: -c["step"])

    def pin(self, job: str, step: int) -> Checkpoint:
        """A complete checkpoint, pinned (never evicted) until :meth:`unpin`; its files do not
        change while pinned, so they may be read without the lock.

        Raises:
            Refused: not in RAM or not complete.
        """
        with self.lock:
            ck = self.ram.get(job, step)
            if ck is None or ck.state is SlotState.FILLING:
                raise Refused(f"step {step} of {job} is not complete in peer RAM")
            ck.pins += 1
            return ck

    def unpin(self, ck: Checkpoint) -> None:
        """Undo one :meth:`pin`."""
        with self.lock:
            ck.pins -= 1

    # ------------------------------------------------------------------ flushing

    def next_to_flush(self) -> Checkpoint | None:
        """The oldest protected checkpoint, now FLUSHING and pinned (block until there is
        one); None once the peer stops with nothing left to flush."""
        with self.cond:
            while not self.flush_queue:
                if self.stopping.is_set():
                    return None
                self.cond.wait(0.5)
            ck = self.flush_queue[0]
            ck.state = SlotState.FLUSHING
            ck.pins += 1
            return ck

    def flushed(self, ck: Checkpoint) -> None:
        """``ck`` is at level 2: DURABLE (its slot is clean), unpinned."""
        with self.cond:
            self.flush_queue.pop(0)
            ck.state = SlotState.DURABLE
            ck.flush_error = None
            ck.pins -= 1
            self.cond.notify_all()

    def flush_failed(self, ck: Checkpoint, error: str) -> bool:
        """The flush of ``ck`` failed: PROTECTED again, unpinned. Its job's queued checkpoints
        (``ck`` first, in their order) go behind every other job's, so one job whose flush
        fails (a link planted at its level-2 directory, a full quota) does not hold back the
        others. Returns True when another job's checkpoint is now first in the queue."""
        with self.cond:
            ck.state = SlotState.PROTECTED
            ck.flush_error = error
            ck.pins -= 1
            others = [c for c in self.flush_queue if c.job != ck.job]
            self.flush_queue[:] = others + [c for c in self.flush_queue if c.job == ck.job]
            self.cond.notify_all()
            return bool(others)
