"""The ``cfrun peer``'s flush thread: protected checkpoints from RAM to level 2, in FIFO order.

ACUTE (§V): the flush thread writes each complete checkpoint of the circular buffer to level-2
storage, oldest first, then clears the slot's dirty bit. Here the bytes are written exactly as
received (Check-Pack, §IV-C: the ranks' parts, in order, as the job dir's own files, manifest
last; :mod:`cfrun.storage.tiers`), each file's checksum checked against the sender's first.
A failed flush leaves the checkpoint protected in RAM and is retried after the other jobs'
checkpoints (one job's failing level 2 does not hold back the others).

Level-2 safety: retention (:func:`cfrun.storage.tiers.apply_retention`) runs after each flush and
never deletes the step just flushed, any step above it, nor a step of another job (by the job id
its manifest carries) under the same name; a flush never replaces another job's step; and a
checkpoint is reported durable only once its step is listed at level 2 after retention ran.
"""

from __future__ import annotations

import logging
import threading
import time

import xxhash

from cfrun.contract.errors import CfrunError
from cfrun.peer.buffer import Checkpoint, RamBuffer
from cfrun.storage.tiers import Storage, apply_retention, checkpoint_job_id, same_job_steps

logger = logging.getLogger("cfrun.peer.server")

RETRY_AFTER_S = 2.0
"""A failed flush is retried after this long."""


class Flusher:
    """The flush thread of one peer: takes checkpoints from ``buffer`` and writes them to
    ``storage``, keeping ``keep`` flushed checkpoints per job there.

    Args:
        buffer: the peer's RAM buffer (:meth:`RamBuffer.next_to_flush` gives the work).
        storage: level 2 (:func:`cfrun.storage.tiers.open_storage`).
        keep: flushed checkpoints kept per job at level 2 (older ones are deleted).
        stopping: set when the peer stops; the thread ends once the queue is empty.
    """

    def __init__(self, buffer: RamBuffer, storage: Storage, keep: int,
                 stopping: threading.Event) -> None:
        self.buffer = buffer
        self.storage = storage
        self.keep = keep
        self.stopping = stopping
        self.failing: dict[str, str] = {}
        """job -> why its last flush failed (said once per outage)."""
        self.thread = threading.Thread(target=self.run, name="cfrun-peer-flush", daemon=True)

    def start(self) -> None:
        """Start the flush thread."""
        self.thread.start()

    def join(self) -> None:
        """Wait for the thread (it returns once the peer stops and the queue is empty)."""
        self.thread.join()

    def run(self) -> None:
        """FIFO: write each protected checkpoint to level 2; a failed one is retried after
        the other jobs' checkpoints (its job's later ones wait behind it), every
        :data:`RETRY_AFTER_S` at most when nothing else waits. One line per job per outage
        (and per new reason), one when it flushes again."""
        while True:
            ck = self.buffer.next_to_flush()
            if ck is None:
                return
            try:
                self.flush(ck)
            except Exception as e:
                why = str(e) if isinstance(e, (CfrunError, OSError, RuntimeError)) and str(e) \
                    else repr(e)
                if self.failing.get(ck.job) != why:
                    logger.warning("flush of %s step %d failed: %s; retrying (other jobs' "
                                   "checkpoints go first)", ck.job, ck.step, why)
                    self.failing[ck.job] = why
                if not self.buffer.flush_failed(ck, why) and self.stopping.wait(RETRY_AFTER_S):
                    return
            else:
                self.buffer.flushed(ck)
                if self.failing.pop(ck.job, None) is not None:
                    logger.warning("flush of %s works again (step %d durable)", ck.job,
                                   ck.step)

    def flush(self, ck: Checkpoint) -> None:
        """Write ``ck`` to level 2 (parts as received, manifest last), then apply retention.

        Raises:
            RuntimeError: a file's bytes differ from the checksum its sender sealed; level 2
                holds this step of another job under the same name; or the step is not listed
                at level 2 once written (it is then not durable).
            Exception: whatever level 2 raises (the flush is retried).
        """
        t0 = time.monotonic()
        manifest = ck.manifest()
        job_id = checkpoint_job_id(manifest)
        if ck.step in self.storage.list_steps(ck.job) \
                and not same_job_steps(self.storage, ck.job, job_id, [ck.step]):
            raise RuntimeError(f"level 2 holds step {ck.step} of another job named {ck.job!r} "
                               "(another job id): give this job another name")
        writer = self.storage.begin(ck.job, ck.step)
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
        deleted = apply_retention(self.storage, ck.job, self.keep, flushed_step=ck.step,
                                  job_id=job_id)
        if ck.step not in self.storage.list_steps(ck.job):
            raise RuntimeError(f"step {ck.step} of {ck.job} is not listed at "
                               f"{self.storage.url} after its flush")
        nbytes = sum(f["nbytes"] for f in manifest["files"])
        logger.info("durable %s step %d: %d bytes flushed to %s in %.3f s%s", ck.job, ck.step,
                    nbytes, self.storage.url, time.monotonic() - t0,
                    f" (retention deleted steps {deleted})" if deleted else "")
