"""The slots of the ``cfrun peer``'s RAM buffer: what each holds, and who gets one.

Level 1 of the peer (:mod:`cfrun.peer.buffer`, ACUTE's circular buffer with dirty bits) keeps at
most ``slots`` checkpoints (one step of one job each) of at most ``max_checkpoint_bytes``.
:class:`RamSlots` is the admission and eviction side of it, the bytes accounted as they come
and go:

* **Admission** (:meth:`RamSlots.admit`): a transfer's bytes are reserved before the receiver
  allocates its buffer, in the step's slot or in a new one; a new step takes a free slot, else
  the oldest one already flushed (FIFO), else a partial one its sender abandoned.
* **Accounting of bytes held**, not of slots: :attr:`RamSlots.held_bytes` counts every part
  stored and every receive buffer of a transfer in progress, given back only when the bytes are
  dropped (:meth:`RamSlots.release`), and never exceeds ``slots x max_checkpoint_bytes``.
* **Eviction**: a checkpoint leaves its slot only with its bytes, and never while a transfer
  into it is in progress or a reader pins it (:meth:`RamSlots.idle`).

Also here, the records both sides share: :class:`Checkpoint` (one step of one job in a slot)
with its :class:`PartFile` files, its :class:`SlotState`, and :class:`Refused`. Holds no lock:
the buffer calls every method of :class:`RamSlots` under its own.
"""

from __future__ import annotations

import collections
import enum
import logging
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


class RamSlots:
    """The buffer's slots and the bytes they hold: admission, release, eviction.

    Not thread-safe: :class:`cfrun.peer.buffer.RamBuffer` calls every method with its lock
    held (the server's connection threads and the flush thread of ``cfrun peer``).

    Args:
        slots: checkpoints held in RAM at most.
        max_checkpoint_bytes: bytes one checkpoint (all ranks) may hold.
    """

    def __init__(self, slots: int, max_checkpoint_bytes: int) -> None:
        self.slots = slots
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.limit_bytes = slots * max_checkpoint_bytes
        self.held_bytes = 0
        """Bytes held in RAM: every checkpoint's ``reserved_bytes`` (parts stored and buffers
        of transfers in progress); <= ``limit_bytes`` at all times."""
        self.checkpoints: dict[tuple[str, int], Checkpoint] = {}
        self.evicted_durable: collections.OrderedDict[tuple[str, int], None] = \
            collections.OrderedDict()
        """Checkpoints evicted from RAM after their flush (newest last, at most
        :data:`MAX_EVICTED_REMEMBERED`): an AWAIT that comes late still hears ``durable``."""

    def get(self, job: str, step: int) -> Checkpoint | None:
        """The checkpoint of (job, step) holding a slot, or None."""
        return self.checkpoints.get((job, step))

    def holds(self, ck: Checkpoint) -> bool:
        """``ck`` still holds its slot (not dropped nor evicted)."""
        return self.checkpoints.get((ck.job, ck.step)) is ck

    def admit(self, job: str, step: int, world_size: int, nbytes: int
              ) -> tuple[bool, Checkpoint | None]:
        """Reserve ``nbytes`` for one transfer into (job, step), taking a slot for a new step
        (evicting one if every slot is taken and one may go).

        Returns:
            ``(True, ck)``: reserved, one transfer into ``ck`` begun; ``(True, None)``: the
            step is complete already (nothing to send); ``(False, None)``: no room now.

        Raises:
            Refused: another world size, or over ``max_checkpoint_bytes``.
        """
        ck = self.checkpoints.get((job, step))
        if ck is not None:
            if ck.world_size != world_size:
                raise Refused(f"step {step} was started with world_size "
                              f"{ck.world_size}")
            if ck.state is not SlotState.FILLING:
                return True, None
            if ck.reserved_bytes + nbytes > self.max_checkpoint_bytes:
                raise Refused(f"checkpoint exceeds --max-checkpoint-bytes "
                              f"{self.max_checkpoint_bytes}")
            if self.held_bytes + nbytes <= self.limit_bytes:
                self._hold(ck, nbytes)
                return True, ck
            return False, None
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
            return True, ck
        return False, None

    def _hold(self, ck: Checkpoint, nbytes: int) -> None:
        """Reserve ``nbytes`` for a transfer into ``ck``."""
        ck.reserved_bytes += nbytes
        ck.transfers += 1
        ck.t_activity = time.monotonic()
        self.held_bytes += nbytes

    def release(self, ck: Checkpoint, nbytes: int) -> None:
        """Give back ``nbytes`` held for ``ck``; an empty partial checkpoint with no transfer
        in progress frees its slot."""
        ck.reserved_bytes -= nbytes
        self.held_bytes -= nbytes
        if ck.state is SlotState.FILLING and not ck.files and not ck.transfers \
                and self.checkpoints.get((ck.job, ck.step)) is ck:
            del self.checkpoints[(ck.job, ck.step)]

    def _drop(self, ck: Checkpoint) -> None:
        """Free ``ck``'s slot and its bytes (it has no transfer and no reader)."""
        assert not ck.transfers and not ck.pins
        del self.checkpoints[(ck.job, ck.step)]
        self.held_bytes -= ck.reserved_bytes
        ck.reserved_bytes = 0
        ck.files.clear()

    def drop_if_superseded(self, ck: Checkpoint) -> None:
        """Drop a superseded partial checkpoint once nobody uses it."""
        if ck.superseded and ck.state is SlotState.FILLING and self.idle(ck) \
                and self.checkpoints.get((ck.job, ck.step)) is ck:
            logger.info("dropped partial %s step %d (step superseded)", ck.job, ck.step)
            self._drop(ck)

    def supersede_older(self, job: str, step: int) -> None:
        """``step`` of ``job`` is protected: its older partial steps are dead, dropped now or
        when their transfers end."""
        for other in list(self.checkpoints.values()):
            if other.job == job and other.step < step \
                    and other.state is SlotState.FILLING:
                other.superseded = True  # dropped now, or when its transfers end
                self.drop_if_superseded(other)

    @staticmethod
    def idle(ck: Checkpoint) -> bool:
        """Nobody sends into ``ck`` nor reads it: it may be dropped."""
        return not ck.transfers and not ck.pins

    def _evict_one(self, job: str, step: int) -> None:
        """Free one slot: the oldest durable checkpoint, else an abandoned partial one (an older
        step of the same job, or idle for :data:`STALE_PARTIAL_S`). Never one with a transfer in
        progress or a reader."""
        now = time.monotonic()
        durable = [c for c in self.checkpoints.values()
                   if c.state is SlotState.DURABLE and self.idle(c)]
        if durable:
            victim = min(durable, key=lambda c: c.t_protected or 0.0)
        else:
            partial = [c for c in self.checkpoints.values()
                       if c.state is SlotState.FILLING and self.idle(c)
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
