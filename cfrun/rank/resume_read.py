"""The resume's read: choosing the newest usable checkpoint at install and reading this rank's
shard of it on a background thread, judged where the plan is first used (:mod:`cfrun.rank.resume`).

At install the rank chooses the newest verified checkpoint and starts reading its own shard on
a background thread (:meth:`PlanRead.load`, :class:`cfrun.codec.checkpoint.ShardRead`); the
script then runs from its first line, importing and building its model while the read goes on,
and waits for it where the plan is first used (:meth:`PlanRead.await_read`). A checkpoint that
cannot be read, decoded or applied is unusable: at install every rank judges the newest ones
alike (:func:`cfrun.codec.checkpoint.check_usable`, with
:func:`cfrun.rank.resume_plan.check_state`), moves the bad ones aside and falls back to the same
older one. Its own shard's bytes, which only this rank reads, are judged by the background
read: found corrupt, the checkpoint is moved aside before anything of it reached the script,
and the rank falls back as at install (:meth:`PlanRead._fall_back`). A failure only this rank
sees later moves the checkpoint aside and restarts the attempt (:func:`unusable`), so that
every rank falls back together.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from cfrun.codec import reshard as RS
from cfrun.codec.checkpoint import (
    CORRUPT,
    INCOMPATIBLE,
    RankLoadError,
    ShardRead,
    WorldSizeChangedError,
    open_newest,
    quarantine,
    skip_checkpoint,
)
from cfrun.contract.config import reshard_refusal
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.jobdir import JobDir, step_dir_name
from cfrun.contract.manifest import ManifestKeys
from cfrun.rank.log import say
from cfrun.rank.resume_plan import ResumePlan, arming, check_state
from cfrun.rank.settings import RankSettings


class PlanRead:
    """The plan (:attr:`plan`), this rank's read of its shard until the plan is first used, and
    the read's timing for the ``resumed`` event. Training thread.

    Args:
        fatal: stops the job for good (a checkpoint of another world size without
            ``--reshard``).
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir,
                 fatal: Callable[[str], NoReturn]) -> None:
        self.s = settings
        self.jobdir = jobdir
        self._fatal = fatal
        self.plan: ResumePlan | None = None
        """The checkpoint to resume from (None: none, or none left after a fall-back)."""
        self._reading: ShardRead | None = None
        """This rank's read of the plan's shard until :meth:`await_read` took it."""
        self._on_skip: Callable[[int, Exception], None] | None = None
        self._refused_said: set[int] = set()
        """Steps refused as not the job's (:func:`open_newest`'s ``on_refused``) already said."""
        self._read_timing: tuple[float, float] | None = None
        """(unix time the checkpoint read began, its seconds to the end of the background
        read): the ``resumed`` event's."""
        self._read_sync_s = 0.0
        """Seconds the read held the script at install (choosing the checkpoint, its JSON)."""
        self._read_wait_s = 0.0
        """Seconds the script waited for the background read where the plan is first used."""

    @property
    def reading(self) -> bool:
        """True while this rank's read of the plan's shard was not waited for yet."""
        return self._reading is not None

    def load(self) -> ResumePlan | None:
        """At install: find the newest usable checkpoint and start reading this rank's tensors
        on a background thread, while the script imports its libraries and builds its model
        (:meth:`await_read` takes them where the plan is first used). Unusable ones are moved
        aside on the way (rank 0 says so, once each). Returns the plan, or None."""
        read_start = time.time()
        got = self._open(None)
        if got is None:
            return None
        step, read = got
        self._reading = read
        self._read_sync_s = time.time() - read_start
        return ResumePlan(step, read.state, read.meta)

    def _open(self, below: int | None) -> tuple[int, ShardRead] | None:
        """:func:`open_newest` for this rank (steps below ``below``), its errors handled."""
        def skipped(step: int, error: Exception) -> None:  # one rank: the one that moved it
            reason = INCOMPATIBLE if isinstance(error, IncompatibleFormatError) else CORRUPT
            say(f"WARNING: checkpoint step {step} failed verification ({error}); moved aside "
                f"as {reason}-{step_dir_name(step)}-*, falling back to the previous one")
            self.jobdir.emit_event("checkpoint_corrupt", step=step, error=str(error))

        def refused(items: list[tuple[int, str]]) -> None:  # rank 0 says it, once per step
            new = [(step, why) for step, why in items if step not in self._refused_said]
            self._refused_said.update(step for step, _ in new)
            if not new or self.s.rank != 0:
                return
            more = f" (and {len(new) - 1} more such step dirs)" if len(new) > 1 else ""
            say(f"WARNING: {new[0][1]}{more}; resuming from the newest checkpoint of this job")
            self.jobdir.emit_event("checkpoint_refused", steps=[s for s, _ in new][:32],
                                   count=len(new), error=new[0][1])

        self._on_skip = skipped
        try:
            return open_newest(self.jobdir.checkpoints, self.s.rank, on_skip=skipped,
                               world_size=self.s.world_size, check_state=check_state,
                               below=below,
                               reshard=RS.ReshardRead if self.s.reshard else None,
                               keys=ManifestKeys.from_hex(self.s.manifest_keys),
                               on_refused=refused)
        except WorldSizeChangedError as e:
            self._fatal(f"checkpoint step {e.step}: "
                        + reshard_refusal(self.jobdir.root, e.saved, e.now))
        except RankLoadError as e:
            unusable(self.jobdir, e.step, e)

    def await_read(self) -> bool:
        """Where the plan is first used (before anything of it reaches the script): wait for
        this rank's background read. A shard found corrupt falls back as the synchronous read
        at install did (:func:`skip_checkpoint`, then the next older usable checkpoint, read
        here: :meth:`_fall_back`). False: no checkpoint is left, and the script runs from its
        start, as it is doing. Training thread.

        Raises:
            SystemExit: through :func:`unusable` (the read failed other than by its bytes)
                or :func:`restart`.
        """
        t0 = time.monotonic()
        try:
            while self._reading is not None and self.plan is not None:
                read, plan = self._reading, self.plan
                self._reading = None
                try:
                    read.wait()
                except (CheckpointCorruptError, IncompatibleFormatError) as e:
                    skip_checkpoint(self.jobdir.checkpoints, plan.step, self.s.rank, e,
                                    self._on_skip)
                    self._fall_back(plan)
                    continue
                except Exception as e:  # not a verdict on the files: this rank failed
                    unusable(self.jobdir, plan.step, RankLoadError(plan.step, e))
                if read.read_s is not None:
                    self._read_timing = (read.start_unix_s, read.read_s)
        finally:
            self._read_wait_s += time.monotonic() - t0
        return self.plan is not None

    def _fall_back(self, bad: ResumePlan) -> None:
        """This rank's shard of ``bad`` failed its read (moved aside already): open the next
        older usable checkpoint, to resume from here if the script arrives at it the way it
        arrives at ``bad`` (the same loops, :func:`arming`), else restart the attempt, which
        resumes from it at install."""
        self.plan = None
        got = self._open(bad.step)
        if got is None:
            say("no usable checkpoint is left; the script runs from its start")
            return
        step, read = got
        older = ResumePlan(step, read.state, read.meta)
        if arming(older) != arming(bad):
            restart(f"checkpoint step {step}, the one to fall back to, resumes at another "
                    f"place in the script than step {bad.step}")
        say(f"resuming from checkpoint step {step}")
        self.plan, self._reading = older, read

    def timing(self) -> dict[str, float]:
        """The read's part of the ``resumed`` event: when the checkpoint read began and how long
        it took (verify and load, ``read_s``; in the background from ``read_sync_s`` on, the
        seconds it held the script at install, to the resume point, which waited
        ``read_wait_s`` for it). Empty when no background read finished."""
        if self._read_timing is None:
            return {}
        return {"read_start_unix_s": round(self._read_timing[0], 4),
                "read_s": round(self._read_timing[1], 4),
                "read_sync_s": round(self._read_sync_s, 4),
                "read_wait_s": round(self._read_wait_s, 4)}


def unusable(jobdir: JobDir, step: int, error: BaseException) -> NoReturn:
    """This rank could not read or apply checkpoint ``step`` after every rank's checks
    passed (the others may have loaded it, and this rank's objects may hold part of it):
    move it aside (``corrupt-step-…``), say why once, and end this rank so that the
    supervisor restarts the attempt, in which every rank falls back to the previous good
    checkpoint. Training thread."""
    sys.settrace(None)
    moved = quarantine(jobdir.checkpoints, step, CORRUPT)
    where = moved.name if moved is not None else "already moved aside"
    detail = "".join(traceback.format_exception_only(type(error), error)).strip()
    say(f"WARNING: checkpoint step {step} could not be restored ({detail[:300]}); "
        f"moved aside ({where}); restarting the attempt to resume from the previous one")
    try:
        jobdir.emit_event("checkpoint_corrupt", step=step, error=detail[:300])
    finally:
        _exit_rank()


def restart(why: str) -> NoReturn:
    """End this rank so that the supervisor restarts the attempt (``why``: said once)."""
    sys.settrace(None)
    say(f"{why}; restarting the attempt to resume from it")
    _exit_rank()


def _exit_rank() -> NoReturn:
    """End this rank now (exit 1: the supervisor restarts the attempt), output flushed."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(1)
