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
* **RAM accounting is of bytes held**, not of slots: :attr:`RamBuffer.held_bytes` counts every
  part stored and every receive buffer of a transfer in progress (reserved before the receiver
  allocates it, given back only when the bytes are dropped), and never exceeds ``slots x
  max_checkpoint_bytes``. A checkpoint leaves its slot only with its bytes: one with a transfer
  in progress (or being read or flushed) is never evicted nor dropped; its sender either
  completes the part or its connection ends and the bytes are given back, then the slot frees.

The buffer keeps no socket and writes no file: the server's connection threads
(:mod:`cfrun.peer.server`) call it with parsed requests and bytes received, the flusher thread
(:mod:`cfrun.peer.flusher`) takes protected checkpoints from it in FIFO order. One lock (and its
condition) guards everything here; every public method takes it.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cfrun.contract.manifest import FileEntry, Manifest

logger = logging.getLogger("cfrun.peer.server")

STALE_PARTIAL_S = 60.0
"""A partial checkpoint with no transfer for this long may be evicted (its sender died)."""
MAX_EVICTED_REMEMBERED = 4096
"""Flushed-then-evicted checkpoints remembered so that a late AWAIT still hears ``durable``
(a few dozen bytes each)."""


class SlotState(str, enum.Enum):
    """A checkpoint in peer RAM: FILLING -> PROTECTED -> FLUSHING -> DURABLE (evictable);
    FLUSHING -> PROTECTED again when a flush fails (retried); FILLING -> evicted if abandoned."""

    FILLING = "filling"
    PROTECTED = "protected"
    FLUSHING = "flushing"
    DURABLE = "durable"


ORDER = {SlotState.FILLING: 0, SlotState.PROTECTED: 1, SlotState.FLUSHING: 1,
         SlotState.DURABLE: 2}
"""How far along each state is (an AWAIT for ``protected`` is answered by FLUSHING too)."""


@dataclass
class PartFile:
    """One file of one rank as received: its parts, each stored as its bytes arrived."""

    nbytes: int
    nparts: int
    parts: dict[int, tuple[int, bytearray]] = field(default_factory=dict)
    """part index -> (offset, bytes as received)."""

    def ordered(self) -> list[bytearray]:
        """The parts in file order (Check-Pack: written as they are, never joined)."""
        return [b for _, b in sorted(self.parts.values(), key=lambda ob: ob[0])]

    def is_complete(self) -> bool:
        """Every part is here and the parts cover ``nbytes`` without a gap or an overlap."""
        if len(self.parts) != self.nparts:
            return False
        pos = 0
        for off, buf in sorted(self.parts.values(), key=lambda ob: ob[0]):
            if off != pos:
                return False
            pos += len(buf)
        return pos == self.nbytes


@dataclass
class Checkpoint:
    """One step of one job in a slot."""

    job: str
    step: int
    world_size: int
    state: SlotState = SlotState.FILLING
    files: dict[str, PartFile] = field(default_factory=dict)
    sealed: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    seal_tags: dict[int, str] = field(default_factory=dict)
    """rank -> its agent's tag over its files (:func:`cfrun.peer.protocol.seal_tag`)."""
    job_tags: dict[int, str] = field(default_factory=dict)
    """rank -> its job's own seal (:func:`cfrun.peer.protocol.job_seal_tag`), kept unchecked:
    the peer does not hold the job's key."""
    job_sha256: dict[int, list[str]] = field(default_factory=dict)
    """rank -> the SHA-256 (hex) of its files that its job seal covers, in its files' order:
    kept beside the seal so that a fetching agent checks the seal before reading a file."""
    meta: dict[str, Any] = field(default_factory=dict)
    reserved_bytes: int = 0
    """Bytes held for this checkpoint: parts stored plus buffers of transfers in progress."""
    transfers: int = 0
    """Transfers in progress into it (a reservation made, the part not yet stored nor given
    back): while > 0 it is never evicted nor dropped."""
    pins: int = 0
    """Readers (a GET, the flusher): while > 0 its files are not dropped."""
    superseded: bool = False
    """Partial, and a newer step of its job is protected: dropped once its transfers end."""
    t_first: float = field(default_factory=time.time)
    t_activity: float = field(default_factory=time.monotonic)
    t_protected: float | None = None
    flush_error: str | None = None

    def manifest(self) -> dict[str, Any]:
        """The manifest of the job dir's format, from the ranks' seals (checksums as sent),
        with the agents' seal tags (``seals``) that let a fetching agent verify it."""
        files = [f for r in sorted(self.sealed) for f in self.sealed[r]]
        return Manifest.build(self.step, self.world_size,
                              [FileEntry(f["name"], f["nbytes"], f["xxh3_64"]) for f in files],
                              self.meta, committed_unix_s=self.t_protected or time.time(),
                              seals=[{"rank": r, "tag": self.seal_tags[r],
                                      **({"job_tag": self.job_tags[r]}
                                         if r in self.job_tags else {}),
                                      **({"sha256": self.job_sha256[r]}
                                         if r in self.job_sha256 else {})}
                                     for r in sorted(self.seal_tags)]).to_json()


class Refused(Exception):
    """A request the buffer refuses (the server replies with the message; the connection stays
    usable)."""


class RamBuffer:
    """ACUTE's level-1 circular buffer: slots, byte reservations, dirty bits, eviction.

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
        self.limit_bytes = slots * max_checkpoint_bytes
        self.held_bytes = 0
        """Bytes held in RAM: every checkpoint's ``reserved_bytes`` (parts stored and buffers
        of transfers in progress); <= ``limit_bytes`` at all times."""
        self.checkpoints: dict[tuple[str, int], Checkpoint] = {}
        self.flush_queue: list[Checkpoint] = []
        self.evicted_durable: collections.OrderedDict[tuple[str, int], None] = \
            collections.OrderedDict()
        """Checkpoints evicted from RAM after their flush (newest last, at most
        :data:`MAX_EVICTED_REMEMBERED`): an AWAIT that comes late still hears ``durable``."""

    def ram_bytes(self) -> int:
        """Bytes held in RAM now, receive buffers of transfers in progress included
        (<= slots x max_checkpoint_bytes)."""
        with self.lock:
            return self.held_bytes

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
                ck = self.checkpoints.get((job, step))
                if ck is not None:
                    if ck.world_size != world_size:
                        raise Refused(f"step {step} was started with world_size "
                                      f"{ck.world_size}")
                    if ck.state is not SlotState.FILLING:
                        return None
                    if ck.reserved_bytes + nbytes > self.max_checkpoint_bytes:
                        raise Refused(f"checkpoint exceeds --max-checkpoint-bytes "
                                      f"{self.max_checkpoint_bytes}")
                    if self.held_bytes + nbytes <= self.limit_bytes:
                        self._hold(ck, nbytes)
                        return ck
                else:
                    if nbytes > self.max_checkpoint_bytes:
                        raise Refused(f"checkpoint exceeds --max-checkpoint-bytes "
                                      f"{self.max_checkpoint_bytes}")
                    if len(self.checkpoints) >= self.slots:
                        self._evict_one(job, step)
                    if len(self.checkpoints) < self.slots \
                            and self.held_bytes + nbytes <= self.limit_bytes:
                        ck = Checkpoint(job, step, world_size)
                        self.checkpoints[(job, step)] = ck
                        self._hold(ck, nbytes)
                        logger.info("receiving %s step %d (%d ranks)", job, step, world_size)
                        return ck
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    raise Refused(f"all {self.slots} slots hold unflushed checkpoints or "
                                  "transfers in progress")
                self.cond.wait(min(left, 1.0))

    def _hold(self, ck: Checkpoint, nbytes: int) -> None:
        """Reserve ``nbytes`` for a transfer into ``ck`` (lock held)."""
        ck.reserved_bytes += nbytes
        ck.transfers += 1
        ck.t_activity = time.monotonic()
        self.held_bytes += nbytes

    def receive(self, ck: Checkpoint, name: str, *, part: int, nparts: int, offset: int,
                file_bytes: int, buf: bytearray, checksum_ok: bool) -> bool:
        """End a transfer: store the part received under a reservation of ``len(buf)`` bytes
        (or give the reservation back when it cannot be kept). Returns whether it was stored."""
        with self.cond:
            ck.transfers -= 1
            ck.t_activity = time.monotonic()
            f = ck.files.get(name)
            ok = checksum_ok
            if (not ok or ck.state is not SlotState.FILLING
                    or self.checkpoints.get((ck.job, ck.step)) is not ck
                    or (f is not None and (f.nbytes != file_bytes or f.nparts != nparts))):
                ok = False
                self._release(ck, len(buf))
            else:
                f = ck.files.setdefault(name, PartFile(file_bytes, nparts))
                old = f.parts.get(part)
                f.parts[part] = (offset, buf)
                if old is not None:  # a resent part replaces the first copy
                    self._release(ck, len(old[1]))
            self._drop_if_superseded(ck)
            self.cond.notify_all()
            return ok

    def abandon(self, ck: Checkpoint, nbytes: int) -> None:
        """End a transfer under a reservation of ``nbytes`` that brought no bytes (the sender
        vanished mid-transfer, or the reply could not be sent): give them back."""
        with self.cond:
            ck.transfers -= 1
            self._release(ck, nbytes)
            self._drop_if_superseded(ck)
            self.cond.notify_all()

    def _release(self, ck: Checkpoint, nbytes: int) -> None:
        """Give back ``nbytes`` held for ``ck`` (lock held); an empty partial checkpoint with no
        transfer in progress frees its slot."""
        ck.reserved_bytes -= nbytes
        self.held_bytes -= nbytes
        if ck.state is SlotState.FILLING and not ck.files and not ck.transfers \
                and self.checkpoints.get((ck.job, ck.step)) is ck:
            del self.checkpoints[(ck.job, ck.step)]

    def _drop(self, ck: Checkpoint) -> None:
        """Free ``ck``'s slot and its bytes (lock held; it has no transfer and no reader)."""
        assert not ck.transfers and not ck.pins
        del self.checkpoints[(ck.job, ck.step)]
        self.held_bytes -= ck.reserved_bytes
        ck.reserved_bytes = 0
        ck.files.clear()

    def _drop_if_superseded(self, ck: Checkpoint) -> None:
        """Drop a superseded partial checkpoint once nobody uses it (lock held)."""
        if ck.superseded and ck.state is SlotState.FILLING and self._idle(ck) \
                and self.checkpoints.get((ck.job, ck.step)) is ck:
            logger.info("dropped partial %s step %d (step superseded)", ck.job, ck.step)
            self._drop(ck)

    @staticmethod
    def _idle(ck: Checkpoint) -> bool:
        """Nobody sends into ``ck`` nor reads it: it may be dropped."""
        return not ck.transfers and not ck.pins

    def _evict_one(self, job: str, step: int) -> None:
        """Free one slot: the oldest durable checkpoint, else an abandoned partial one (an older
        step of the same job, or idle for :data:`STALE_PARTIAL_S`). Never one with a transfer in
        progress or a reader."""
        now = time.monotonic()
        durable = [c for c in self.checkpoints.values()
                   if c.state is SlotState.DURABLE and self._idle(c)]
        if durable:
            victim = min(durable, key=lambda c: c.t_protected or 0.0)
        else:
            partial = [c for c in self.checkpoints.values()
                       if c.state is SlotState.FILLING and self._idle(c)
                       and ((c.job == job and c.step < step)
                            or now - c.t_activity > STALE_PARTIAL_S)]
            if not partial:
                return
            victim = min(partial, key=lambda c: c.t_activity)
            logger.info("dropped partial %s step %d (a sender died mid-transfer)", victim.job,
                        victim.step)
        self._drop(victim)
        if victim.state is SlotState.DURABLE:
            self.evicted_durable[(victim.job, victim.step)] = None
            while len(self.evicted_durable) > MAX_EVICTED_REMEMBERED:
                self.evicted_durable.popitem(last=False)

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
            ck = self.checkpoints.get((job, step))
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
                for other in list(self.checkpoints.values()):  # older partial steps are dead
                    if other.job == job and other.step < step \
                            and other.state is SlotState.FILLING:
                        other.superseded = True  # dropped now, or when its transfers end
                        self._drop_if_superseded(other)
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
                ck = self.checkpoints.get((job, step))
                if ck is None and (job, step) in self.evicted_durable:  # flushed, then evicted
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
                   for c in self.checkpoints.values() if c.job == job]
        return sorted(cks, key=lambda c: -c["step"])

    def pin(self, job: str, step: int) -> Checkpoint:
        """A complete checkpoint, pinned (never evicted) until :meth:`unpin`; its files do not
        change while pinned, so they may be read without the lock.

        Raises:
            Refused: not in RAM or not complete.
        """
        with self.lock:
            ck = self.checkpoints.get((job, step))
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
