"""The ``cfrun peer``'s flush thread: protected checkpoints from RAM to level 2, job by job.

ACUTE (§V): the flush thread writes each complete checkpoint of the circular buffer to level-2
storage, then clears the slot's dirty bit. Here the bytes are written exactly as received
(Check-Pack, §IV-C: the ranks' parts, in order, as the job dir's own files, manifest last;
:mod:`cfrun.storage.tiers`), each file's checksum checked against the sender's first.

**Per-job queues, round robin** (issue 32, finding 5). ACUTE's single FIFO lets one checkpoint
whose flush fails (level 2 refuses that job's writes: a full quota, a link planted at its
directory, a permission) stay at the head and hold back every other job, until every slot is
dirty and the peer refuses all PUTs. Here the protected checkpoints of every ring (one per
tenant, :mod:`cfrun.peer.tenants`) are grouped per job (tenant + job: the ring's key) and the
jobs are served in turn, one checkpoint each, oldest first within a job. A job whose flush fails
is retried with backoff (:data:`RETRY_AFTER_S` doubling up to :data:`MAX_RETRY_AFTER_S`) and
not served meanwhile, so it waits behind the others; its own later checkpoints wait behind its
oldest (level 2 gets each job's steps in order). One log line when a job's outage starts, one
when its flush works again, none per retry.

Level-2 safety: retention (:func:`cfrun.storage.tiers.apply_retention`) runs after each flush and
never deletes the step just flushed, any step above it, nor a step of another job (by the job id
its manifest carries) under the same name; a flush never replaces another job's step; and a
checkpoint is reported durable only once its step is listed at level 2 after retention ran.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import xxhash

from cfrun.contract.errors import CfrunError
from cfrun.peer.buffer import Checkpoint, RamBuffer
from cfrun.peer.tenants import split_key
from cfrun.storage.tiers import Storage, apply_retention, checkpoint_job_id, same_job_steps

logger = logging.getLogger("cfrun.peer.server")

RETRY_AFTER_S = 2.0
"""A job's flush that failed is retried after this long, doubled per failure..."""
MAX_RETRY_AFTER_S = 60.0
"""... up to this."""
IDLE_WAIT_S = 0.5
"""The longest the thread sleeps without a nudge (:meth:`Flusher.notify`)."""


@dataclass(frozen=True)
class Lane:
    """One tenant's RAM ring and its level 2 (the flusher's source and destination)."""

    tenant: str
    buffer: RamBuffer
    storage: Storage


@dataclass
class _Outage:
    """A job whose flushes fail: since when, how often, when to try again."""

    since: float
    why: str
    failures: int = 0
    retry_at: float = 0.0


class Flusher:
    """The flush thread of one peer: takes protected checkpoints from each lane's ring, job by
    job in turn, and writes them to that lane's level 2, keeping ``keep`` flushed checkpoints
    per job there.

    Args:
        lanes: one per tenant (a ring and its level 2); a ring's keys are
            :meth:`cfrun.peer.tenants.Tenant.key`, so :func:`~cfrun.peer.tenants.split_key`
            gives a checkpoint's tenant and job name.
        keep: flushed checkpoints kept per job at level 2 (older ones are deleted).
        stopping: set when the peer stops; the thread then flushes what is ready and returns
            (a job in its backoff is not waited for).
    """

    def __init__(self, lanes: list[Lane], keep: int, stopping: threading.Event) -> None:
        self.lanes = {lane.tenant: lane for lane in lanes}
        self.keep = keep
        self.stopping = stopping
        self.nudge = threading.Event()
        self.served: dict[str, int] = {}
        """Ring key -> when its job was last served (a count of flushes begun), for the jobs
        with checkpoints to flush: the least recently served goes next (round robin)."""
        self.ticks = itertools.count()
        self.failing: dict[str, _Outage] = {}
        """Ring key -> its outage (said once; dropped when a flush of the job works)."""
        self.thread = threading.Thread(target=self.run, name="cfrun-peer-flush", daemon=True)

    def start(self) -> None:
        """Start the flush thread."""
        self.thread.start()

    def join(self) -> None:
        """Wait for the thread (it returns once the peer stops and nothing is ready)."""
        self.notify()
        self.thread.join()

    def notify(self) -> None:
        """A checkpoint became protected, or the peer stops: look at the queues now (called by
        the server's connection threads; without it the thread looks every
        :data:`IDLE_WAIT_S`)."""
        self.nudge.set()

    def run(self) -> None:
        """Flush until the peer stops: :meth:`next` picks, :meth:`flush` writes; a failure
        starts or extends the job's backoff."""
        while True:
            picked = self.next()
            if picked is None:
                return
            lane, ck = picked
            try:
                self.flush(ck)
            except Exception as e:
                why = str(e) if isinstance(e, (CfrunError, OSError, RuntimeError)) and str(e) \
                    else repr(e)
                self._failed(ck, why)
                lane.buffer.flush_failed(ck, why)
            else:
                lane.buffer.flushed(ck)
                outage = self.failing.pop(ck.job, None)
                if outage is not None:
                    logger.warning("flush of %s works again (step %d durable) after %d failed "
                                   "tries in %.0f s", ck.job, ck.step, outage.failures,
                                   time.monotonic() - outage.since)

    def next(self) -> tuple[Lane, Checkpoint] | None:
        """The next checkpoint to flush, FLUSHING and pinned (its ring's
        :meth:`~cfrun.peer.buffer.RamBuffer.next_to_flush`): the oldest of the first job in
        turn that is not in its backoff. Blocks until there is one; None once the peer stops
        and no job is ready."""
        while True:
            self.nudge.clear()
            now = time.monotonic()
            heads = self._heads()
            for key in [k for k in self.served if k not in heads]:
                del self.served[key]
            ready = [k for k in heads if k not in self.failing or self.failing[k].retry_at <= now]
            if ready:  # the least recently served; never served first, then in queue order
                key = min(ready, key=lambda k: self.served.get(k, -1))
                self.served[key] = next(self.ticks)
                lane, ck = heads[key]
                got = self._take(lane, ck)
                if got is not None:
                    return lane, got
                continue
            if self.stopping.is_set():
                if heads:
                    logger.warning("stopping with checkpoints of %d jobs not flushed (their "
                                   "flushes fail): %s", len(heads), ", ".join(sorted(heads)))
                return None
            wake_at = min((self.failing[k].retry_at for k in heads), default=now + IDLE_WAIT_S)
            self.nudge.wait(max(0.01, min(IDLE_WAIT_S, wake_at - now)))

    def _heads(self) -> dict[str, tuple[Lane, Checkpoint]]:
        """Ring key -> its oldest protected checkpoint not yet flushed, over every lane."""
        heads: dict[str, tuple[Lane, Checkpoint]] = {}
        for lane in self.lanes.values():
            with lane.buffer.lock:
                for ck in lane.buffer.flush_queue:
                    heads.setdefault(ck.job, (lane, ck))
        return heads

    @staticmethod
    def _take(lane: Lane, ck: Checkpoint) -> Checkpoint | None:
        """Mark ``ck`` FLUSHING and pinned through its ring's own
        :meth:`~cfrun.peer.buffer.RamBuffer.next_to_flush`, which takes the head of the ring's
        flush queue: ``ck`` is moved there first. Only this thread removes or reorders that
        queue (the connection threads append), so the head is still ``ck`` then."""
        with lane.buffer.cond:
            queue = lane.buffer.flush_queue
            at = next((i for i, c in enumerate(queue) if c is ck), None)
            if at is None:
                return None
            queue.insert(0, queue.pop(at))
        return lane.buffer.next_to_flush()

    def _failed(self, ck: Checkpoint, why: str) -> None:
        """Start or extend the backoff of ``ck``'s job; say it once per outage."""
        now = time.monotonic()
        outage = self.failing.get(ck.job)
        if outage is None:
            outage = self.failing[ck.job] = _Outage(now, why)
            logger.warning("flush of %s step %d failed: %s; retried with backoff (%g s doubling "
                           "up to %g s) while other jobs' checkpoints go first; said again "
                           "when it works", ck.job, ck.step, why, RETRY_AFTER_S,
                           MAX_RETRY_AFTER_S)
        outage.failures += 1
        outage.why = why
        outage.retry_at = now + min(MAX_RETRY_AFTER_S,
                                    RETRY_AFTER_S * 2 ** min(outage.failures - 1, 16))

    def flush(self, ck: Checkpoint) -> None:
        """Write ``ck`` to its tenant's level 2 (parts as received, manifest last), then apply
        retention.

        Raises:
            RuntimeError: a file's bytes differ from the checksum its sender sealed; level 2
                holds this step of another job under the same name; or the step is not listed
                at level 2 once written (it is then not durable).
            Exception: whatever level 2 raises (the flush is retried).
        """
        t0 = time.monotonic()
        tenant, job = split_key(ck.job)
        storage = self.lanes[tenant].storage
        manifest = ck.manifest()
        job_id = checkpoint_job_id(manifest)
        if ck.step in storage.list_steps(job) \
                and not same_job_steps(storage, job, job_id, [ck.step]):
            raise RuntimeError(f"level 2 holds step {ck.step} of another job named {job!r} "
                               "(another job id): give this job another name")
        writer = storage.begin(job, ck.step)
        from cfrun.contract import faults

        slow_s = float(faults.value("peer.flush_delay_s") or 0)
        try:
            for i, entry in enumerate(manifest["files"]):
                parts = ck.files[entry["name"]].ordered()
                h = xxhash.xxh3_64()
                for p in parts:
                    h.update(p)
                if h.hexdigest() != entry["xxh3_64"]:
                    raise RuntimeError(f"{entry['name']}: checksum differs from the sender's")
                writer.write_file(entry["name"], parts)
                if i == 0 and slow_s:
                    logger.info("flushing %s step %d (slowed by %s s)", ck.job, ck.step, slow_s)
                    time.sleep(slow_s)
            writer.commit(manifest)
        except BaseException:
            writer.abort()
            raise
        deleted = apply_retention(storage, job, self.keep, flushed_step=ck.step, job_id=job_id)
        if ck.step not in storage.list_steps(job):
            raise RuntimeError(f"step {ck.step} of {ck.job} is not listed at "
                               f"{storage.shown} after its flush")
        nbytes = sum(f["nbytes"] for f in manifest["files"])
        logger.info("durable %s step %d: %d bytes flushed to %s in %.3f s%s", ck.job, ck.step,
                    nbytes, storage.shown, time.monotonic() - t0,
                    f" (retention deleted steps {deleted})" if deleted else "")
