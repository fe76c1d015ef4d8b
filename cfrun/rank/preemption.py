"""Phase 7: the rank's side of supervision: heartbeats, marks, and stopping for a preemption.

Files a rank writes into the job dir for its supervisor (:class:`Marks`; names and records in
:mod:`cfrun.contract.coordination`):

* ``heartbeat-rank-R``: the step count, rewritten every step (hang detection);
* ``errors/attempt-A-rank-R.json``: an uncaught exception (crash-loop detection, the report);
* ``ended/node-N-attempt-A-rank-R.json``: the script's end (``clean`` or not) before teardown;
* ``preempted/node-N-attempt-A-rank-R.json``: this rank stopped for a preemption;
* ``fatal.json``: resuming would be wrong; the job must stop (exit code 5).

A preemption (SIGTERM to cfrun) is agreed on by the ranks through three files
(:class:`Preemption`): the supervisor writes ``stop_request.json`` with the grace deadline,
rank 0 picks the stop step (``stop_step.json``) and decides whether a final checkpoint fits
(``stop_decision.json``); every rank follows, so either all ranks hand their shard to the agent
or none does.

Every write here is best effort (issue 13, "a full disk"): a write the disk refuses is counted
and said once per outage (:data:`cfrun.contract.jobdir.best_effort`), never raised into the
script; a stop step or decision rank 0 cannot write leaves the other ranks to the grace deadline.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from cfrun.contract import coordination as co
from cfrun.contract.jobdir import JobDir, best_effort
from cfrun.rank import warm_imports
from cfrun.rank.log import say
from cfrun.rank.settings import RankSettings
from cfrun.rank.snapshot import SnapshotHandle, Snapshotter

VERIFY_STOP_S = 120.0
HEARTBEAT_EVERY_S = 0.1
"""Seconds between two heartbeat writes of the heartbeat thread (issue 33: a ``pwrite`` every
step was a third of what cfrun cost a step with no checkpoint due); the supervisor's hang
timeout is seconds, and the script's end, an uncaught error and an injected kill write the last
step at once."""
STOP_CHECK_EVERY_S = 0.02
"""A one-rank job looks for the supervisor's stop request at most this often (one ``stat``;
every step with several ranks, whose stop step rank 0 picks two steps ahead)."""
"""The time a ``cfrun verify`` stop gives its final checkpoint (the deadline's stand-in)."""


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _write_mark(path: Path, record: Any) -> None:
    """Write a mark (:func:`cfrun.contract.coordination.write`, its directory made), best
    effort: a refused write is counted and said once per outage, not raised."""
    try:
        co.write(path, record, make_dir=True)
    except OSError as e:
        best_effort.failure("marks", path, e)
        return
    best_effort.success("marks")


def _write_coordination(path: Path, record: Any) -> None:
    """Write rank 0's stop step or stop decision, best effort (the other ranks then wait for
    it until the grace deadline, and take no final checkpoint)."""
    try:
        co.write(path, record)
    except OSError as e:
        best_effort.failure("coordination", path, e)
        return
    best_effort.success("coordination")


class Marks:
    """Writes the files the supervisor reads about this rank (training thread, excepthook and
    atexit of the rank process). Never raises for a failed write, except :meth:`fatal`, which
    ends the process."""

    def __init__(self, settings: RankSettings, jobdir: JobDir) -> None:
        self.s = settings
        self.jobdir = jobdir
        self._hb_fd: int | None = None
        self._hb_pending: int | None = None
        self._hb_lock = threading.Lock()
        self._hb_thread: threading.Thread | None = None
        self._uncaught = False
        self._exit_code: int = 0

    def beat(self, step: int) -> None:
        """Heartbeat for the supervisor's hang detection and its reports (the step of a
        failure or a preemption): the step count. The first step's is written at once; later
        ones are left for the heartbeat thread, which writes the newest every
        :data:`HEARTBEAT_EVERY_S` seconds (so a step followed by a long pause is written too),
        and for :meth:`flush_beat` (the script's end, an error, an injected kill). Training
        thread; one assignment per step after the first."""
        self._hb_pending = step
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(target=self._beat_loop, name="cfrun-heartbeat",
                                               daemon=True)
            self._hb_thread.start()
            self.flush_beat()

    def _beat_loop(self) -> None:
        if self.s.local_rank == 0:  # once, off the training thread: for the next warm spare
            try:
                warm_imports.record(self.jobdir.root, self.s.node_rank)
            except OSError as e:
                best_effort.failure("warm imports", co.warm_imports_path(
                    self.jobdir.root, self.s.node_rank), e)
        while True:
            time.sleep(HEARTBEAT_EVERY_S)
            self.flush_beat()

    def flush_beat(self) -> None:
        """Write the newest step :meth:`beat` noted and not yet written, if any. Any thread."""
        with self._hb_lock:
            step, self._hb_pending = self._hb_pending, None
            if step is not None:
                self._write_beat(step)

    def _write_beat(self, step: int) -> None:
        try:
            if self._hb_fd is None:
                path = co.heartbeat_path(self.jobdir.root, self.s.rank)
                self._hb_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW
                                      | os.O_CLOEXEC, 0o600)
            os.pwrite(self._hb_fd, co.Heartbeat(step).to_bytes(), 0)
        except OSError as e:
            best_effort.failure("heartbeat", co.heartbeat_path(self.jobdir.root, self.s.rank), e)
            return
        best_effort.success("heartbeat")

    def record_error(self, exc_type: Any, exc: Any, tb: Any, step: int) -> None:
        """sys.excepthook: record the uncaught error for the supervisor (crash-loop detection,
        the report). ``SystemExit`` is not an error."""
        if exc_type is SystemExit:
            return
        self.flush_beat()
        self._uncaught = True
        try:
            record = co.RankError(
                type=exc_type.__name__, message=str(exc)[:co.MAX_MESSAGE_CHARS],
                step=step if step >= 0 else None,
                t_unix_s=time.time(),  # the supervisor reports the earliest failure
                traceback=traceback.format_exception(exc_type, exc, tb)[-co.MAX_TRACEBACK_LINES:])
            _write_mark(co.error_path(self.jobdir.root, self.s.attempt, self.s.rank), record)
        except ValueError:
            pass

    def note_exit(self, status: Any) -> None:
        """``sys.exit(status)`` was called: remember the exit code for :meth:`mark_end`."""
        self._exit_code = 0 if status is None else status if isinstance(status, int) else 1

    def mark_end(self, step: int, preempted: bool) -> None:
        """The script's end on this rank, written before interpreter teardown: ``clean`` when
        it returned (or called ``sys.exit(0)``) with no uncaught exception. The supervisor
        counts an attempt whose ranks all ended clean as a success even if a rank then died
        in teardown: torch 2.13 with gloo aborts in C++ destructors at exit now and then
        ("terminate called without an active exception", SIGABRT), and restarting a finished
        job would only run its tail again."""
        self.flush_beat()
        clean = self.ended_clean(preempted)
        try:
            _write_mark(co.ended_path(self.jobdir.root, self.s.node_rank, self.s.attempt,
                                      self.s.rank),
                        co.EndedMark(clean=clean, step=max(step, 0), preempted=preempted))
        except ValueError:
            pass

    def ended_clean(self, preempted: bool) -> bool:
        """The script returned (or called ``sys.exit(0)``) with no uncaught exception, and
        did not stop for a preemption (``preempted``)."""
        return not self._uncaught and self._exit_code == 0 and not preempted

    def mark_preempted(self, step: int, committed: int | None) -> None:
        """``preempted/node-N-attempt-A-rank-R.json``: this rank stopped for a preemption
        (the supervisor's evidence that exit code 0 means "preempted", not "done")."""
        try:
            _write_mark(co.preempted_path(self.jobdir.root, self.s.node_rank, self.s.attempt,
                                          self.s.rank),
                        co.PreemptedMark(step=max(step, 0), final_checkpoint=committed))
        except ValueError:
            pass
        _flush_std_streams()

    def fatal(self, message: str) -> NoReturn:
        """Stop the job: the resume would be wrong. The supervisor exits with code 5."""
        say(f"FATAL: {message}")
        try:
            co.write(co.fatal_path(self.jobdir.root),
                     co.Fatal(message=message, attempt=self.s.attempt, rank=self.s.rank))
        finally:
            os._exit(1)


class Preemption:
    """The ranks' agreement on where to stop after a SIGTERM, and the stop itself.

    Training thread: :meth:`stop_due` once per step, :meth:`stop_now` at the stop step's
    boundary, :attr:`preempted` checked by every hook afterwards (:meth:`end_now`).
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir, snap: Snapshotter,
                 marks: Marks) -> None:
        self.s = settings
        self.jobdir = jobdir
        self.snap = snap
        self.marks = marks
        self._stop_step: int | None = None
        self._req_path = str(co.stop_request_path(jobdir.root))  # checked at every step
        self._req_next = 0.0
        self._deadline_unix_s: float | None = None
        self.preempted = False
        """True once this rank stopped for a preemption (its hooks then end the process)."""
        self.for_verify = False
        """The stop is ``cfrun verify``'s (:meth:`stop_for_verify`), not a preemption: no
        ``preempted`` mark, the script ends clean (exit 0)."""

    @property
    def deadline_unix_s(self) -> float | None:
        """The grace deadline of a requested stop (unix seconds), None when none was seen."""
        return self._deadline_unix_s

    def stop_for_verify(self, step: int) -> None:
        """``cfrun verify``: stop every rank at ``step`` (:mod:`cfrun.rank.verify`) as a
        preemption would (a final checkpoint, all ranks or none, then the end of the script),
        with no grace deadline to speak of and no ``preempted`` mark, so that the attempt ends
        clean. Called every step once the stop step is known; the first call sets it."""
        if self._stop_step is not None:
            return
        self._stop_step = step
        self._deadline_unix_s = time.time() + VERIFY_STOP_S
        self.for_verify = True
        say(f"cfrun verify: stopping at step {step}")

    def stop_due(self, step: int) -> bool:
        """True at the step where every rank stops for a preemption (SIGTERM to cfrun).

        The supervisor writes ``stop_request.json`` (with the grace deadline). Rank 0 picks the
        stop step, a little ahead so that ranks one step behind reach it too, and writes it to
        ``stop_step.json``; the other ranks read it. Checked once per step (one ``stat``),
        or at most every :data:`STOP_CHECK_EVERY_S` seconds in a one-rank job.
        """
        if self._stop_step is None:
            if self.s.world_size == 1 and self._deadline_unix_s is None:
                now = time.monotonic()
                if now < self._req_next:
                    return False
                self._req_next = now + STOP_CHECK_EVERY_S
            if not os.path.exists(self._req_path):
                return False
            if self._deadline_unix_s is None:
                request = co.read(Path(self._req_path), co.StopRequest)
                if request is None:  # not yet readable, or malformed (never trusted)
                    return False
                self._deadline_unix_s = float(request.deadline_unix_s)
            step_path = co.stop_step_path(self.jobdir.root)
            if self.s.world_size == 1:
                self._stop_step = step
            elif self.s.rank == 0:
                self._stop_step = step + 2
                _write_coordination(step_path, co.StopStep(self._stop_step))
            else:
                chosen = co.read(step_path, co.StopStep)
                if chosen is None:
                    return False
                self._stop_step = chosen.step
            say(f"preemption: stopping at step {self._stop_step}")
        return step >= self._stop_step

    def stop_now(self, step: int, take: Callable[[], SnapshotHandle | None]) -> NoReturn:
        """Every rank, at the stop step's boundary: the final checkpoint (all ranks or none,
        ``take()`` starts it), a ``preempted`` mark, then the end of the script with exit code 0.

        Rank 0 decides once whether a final checkpoint can be durable before the grace
        deadline (:meth:`_decision`, shared through ``stop_decision.json``); every rank
        follows it, so either all ranks hand their shard to the agent or none does (the agent
        commits a step only with every rank's shard). Exit code 0, not 75: torchrun SIGTERMs
        the remaining ranks as soon as one rank exits non-zero, which would kill a rank still
        waiting for the final commit. The supervisor turns the marks into exit code 75 and the
        one ``preempted`` event. ``SystemExit`` unwinds the script, so its code after the
        training loop does not run (its ``finally`` blocks do); a script that swallows it is
        ended at its next optimizer step or batch (:meth:`end_now`).
        """
        deadline = self._deadline_unix_s or time.time()
        # an in-flight persist first: it may be the stop step's
        self.snap.wait_idle(max(0.0, deadline - time.time() - 0.5))
        decision = self._decision(step, deadline)
        committed = step if decision == "have" else None
        if decision == "take":
            try:
                if self.snap.busy():
                    self.snap.wait_idle(max(0.0, deadline - time.time() - 0.2))
                if not self.snap.busy():
                    handle = take()
                    if handle is not None and handle.wait(max(0.0, deadline - time.time() - 0.2)):
                        committed = step
            except Exception as e:
                say(f"WARNING: final checkpoint failed: {e!r}")
        last = self._last_committed_step()
        if self.for_verify:
            say(f"cfrun verify: stopped at step {step}; final checkpoint "
                + ("committed" if committed is not None else "NOT committed"))
            self.preempted = True  # the hooks end a script that swallows the SystemExit
            _flush_std_streams()
            raise SystemExit(0)
        if committed is not None:
            say(f"preempted: final checkpoint at step {committed} is durable")
        else:
            say(f"preempted: no time for a final checkpoint within the grace period "
                f"(needs ~{self._need_s():.1f}s); the newest committed checkpoint is step {last}")
        self.preempted = True
        self.marks.mark_preempted(step, committed)
        self.marks.note_exit(0)
        raise SystemExit(0)

    def end_now(self) -> NoReturn:
        """The script swallowed the stop's ``SystemExit`` and trains on: end it now."""
        _flush_std_streams()
        os._exit(0)

    def _need_s(self) -> float:
        """Seconds a final checkpoint needs to be durable (margin over the last one's cost)."""
        return 1.5 * self.snap.last_cost_s + 0.5

    def _decision(self, step: int, deadline: float) -> str:
        """``"have"`` (the stop step is already committed), ``"take"`` (a final checkpoint
        fits before ``deadline``, unix seconds) or ``"none"``. Rank 0 decides and writes
        ``stop_decision.json``; the other ranks wait for it until the deadline (``"none"``
        then: rank 0's checkpoint alone can never commit)."""
        path = co.stop_decision_path(self.jobdir.root)
        if self.s.rank == 0:
            if self._last_committed_step() == step:
                decision = "have"
            elif time.time() + self._need_s() < deadline and not self.snap.busy():
                decision = "take"
            else:
                decision = "none"
            _write_coordination(path, co.StopDecision(step=step, decision=decision,
                                                      need_s=round(self._need_s(), 3)))
            return decision
        while True:
            doc = co.read(path, co.StopDecision)
            if doc is not None and doc.step == step:
                return doc.decision
            if time.time() >= deadline:
                return "none"
            time.sleep(0.01)

    def _last_committed_step(self) -> int | None:
        from cfrun.codec.checkpoint import committed_steps

        steps = committed_steps(self.jobdir.checkpoints)
        return steps[0] if steps else None
