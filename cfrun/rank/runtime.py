"""The Runtime: what cfrun does inside each rank process, as one object holding the phases.

One ``Runtime`` per rank, created by :func:`cfrun.rank.install.install` when the script imports
torch. It builds the phase objects and wires them together; the hooks call the phases directly.
In the order a step meets them:

* :class:`~cfrun.rank.discovery.Discovery`: the script's optimizers, schedulers, scalers,
  loaders and models;
* :class:`~cfrun.rank.boundary.Boundary`: step counting, the trigger, the boundary;
* :class:`~cfrun.rank.capture.Capture`: what a checkpoint holds;
* :class:`~cfrun.rank.snapshot.Snapshotter`: the copy into shared memory and the hand-off to
  the node's persist agent, which commits;
* :class:`~cfrun.rank.resume.Resume`: on a restart, back to the checkpoint's moment;
* :class:`~cfrun.rank.preemption.Preemption` and :class:`~cfrun.rank.preemption.Marks`: the
  supervisor's side: stop requests, heartbeats, end and error marks;
* :class:`~cfrun.rank.tuner.Tuner`: the interval and the copy mode.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from cfrun.contract import coordination as co
from cfrun.contract.errors import FatalJobError
from cfrun.contract.jobdir import JobDir
from cfrun.rank.boundary import Boundary, Wrap
from cfrun.rank.capture import Capture
from cfrun.rank.discovery import Discovery
from cfrun.rank.log import NotExact, say
from cfrun.rank.preemption import Marks, Preemption
from cfrun.rank.resume import Resume
from cfrun.rank.settings import RankSettings
from cfrun.rank.snapshot import Snapshotter
from cfrun.rank.tuner import Tuner, fingerprint


class Runtime:
    """Per-rank checkpoint/resume machinery: the phases of one rank, wired together.

    Lives on the training thread; not thread-safe (the snapshot's background thread only
    reaches :meth:`Boundary.on_persisted` and :meth:`Boundary.on_lost`).

    Args:
        wrap: ``Guard.wrap`` of :mod:`cfrun.rank.install` (guards the boundary's tracer calls).
    """

    def __init__(self, settings: RankSettings, wrap: Wrap) -> None:
        self.s = settings
        self.jobdir = JobDir(settings.job_dir)
        self.not_exact = NotExact(self.jobdir, settings.rank, lambda: self.boundary.step,
                                  verifying=bool(settings.verify))
        self.found = Discovery(self.not_exact.flag)
        self.capture = Capture(settings, self.found, self.not_exact.flag)
        self.snap = Snapshotter(settings.job_dir, settings.rank, settings.world_size,
                                settings.attempt,
                                lambda fields: self.boundary.on_persisted(fields),
                                lambda step, error: self.boundary.on_lost(step, error))
        self.marks = Marks(settings, self.jobdir)
        self.preemption = Preemption(settings, self.jobdir, self.snap, self.marks)
        self.resume = Resume(settings, self.jobdir, self.found, self.not_exact.flag,
                             self.marks.fatal,
                             lambda step, mode: self.boundary.restore(step, mode))
        self.tuner = Tuner(self.jobdir, rank=settings.rank, world_size=settings.world_size,
                           budget=settings.overhead, fixed_interval=settings.interval,
                           mtbf_s=settings.mtbf_s, profile_only=settings.profile_only,
                           attempt=settings.attempt, node_rank=settings.node_rank,
                           key=fingerprint(settings.script, sys.argv[1:], settings.world_size))
        verify = None
        if settings.verify:
            from cfrun.rank.verify import Verify

            verify = Verify(settings, self.jobdir)
        self.boundary = Boundary(settings, self.jobdir, self.capture, self.snap, self.tuner,
                                 self.resume, self.preemption, self.marks, self.not_exact, wrap,
                                 verify)

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.boundary.step

    # ---------------------------------------------------------------- at install

    def check_job_dir(self) -> None:
        """Stop this rank before it reads anything of the job dir (the agent's address, a
        checkpoint) unless the job dir is the directory the supervisor locked: the same
        ``(st_dev, st_ino)`` (:attr:`RankSettings.job_dir_id`). A directory swapped in between
        (by whoever can write an ancestor: issue 32, finding 2) would otherwise feed the rank
        its checkpoint. The rank exits at once (nothing loaded, nothing written there); the
        supervisor, re-identifying the job dir before the next attempt, stops the job with
        exit 5."""
        if self.s.job_dir_id is None:
            return
        try:
            self.jobdir.check_same(self.s.job_dir_id)
        except FatalJobError as e:
            say(f"FATAL: {e}")
            os._exit(1)

    def connect_agent(self) -> None:
        """Connect to the node's persist agent (the supervisor started it) and wait until it has
        committed what an earlier attempt of this rank handed it. If it does not answer, each
        checkpoint tries again (and is reported lost if it still cannot). If the agent wrote
        ``fatal.json`` meanwhile (it refused to let the job start over beside checkpoints sealed
        under another key, :meth:`cfrun.agent.peerpath.PeerPath.install_newest`), stops the
        job with that message (exit 5)."""
        t0 = time.monotonic()
        if not self.snap.ready():
            say("WARNING: the persist agent does not answer; each checkpoint tries again")
        self.resume.agent_wait_s = time.monotonic() - t0
        refusal = co.read(co.fatal_path(self.jobdir.root), co.Fatal)
        if refusal is not None:  # the agent refused to let the job start over
            self.marks.fatal(refusal.message)

    def load_plan(self) -> None:
        """Find the newest verified checkpoint and prepare to fast-forward to it."""
        self.resume.load_plan()

    # ---------------------------------------------------------------- the process's end

    def on_uncaught(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """sys.excepthook: record the error for the supervisor (crash-loop detection, report);
        a script that breaks while fast-forwarding gets a fallback."""
        self.marks.record_error(exc_type, exc, tb, self.boundary.step)
        self.resume.on_script_failed()

    def at_exit(self) -> None:
        """atexit: the end mark, the script's stdout back, the final checkpoint of a script that
        ended normally (:meth:`Boundary.final_checkpoint`), the last hand-off and persist."""
        preempted = self.preemption.preempted and not self.preemption.for_verify
        self.marks.mark_end(self.boundary.step, preempted)
        if self.marks.ended_clean(preempted) and not self.preemption.preempted:
            self.boundary.finish_profile()
            self.boundary.final_checkpoint()
        self.resume.exit_fast_forward()
        timeout_s = 60.0
        deadline = self.preemption.deadline_unix_s
        if self.preemption.preempted and deadline:  # the supervisor kills us then anyway
            timeout_s = max(0.0, deadline - time.time())
        self.snap.close(timeout_s)
        if self.snap.last_error:
            say(f"WARNING: last checkpoint problem: {self.snap.last_error}")
        self.resume.warn_if_not_restored()

    def on_disabled(self) -> None:
        """cfrun failed inside a hook and turns itself off (``Guard.disable``): stop cfrun's
        tracers, drop a pending trigger, give the script its stdout back, and let a copy in
        flight finish, its CUDA copies included, or drop it (the step gate is off from now on:
        :meth:`Snapshotter.quiesce`)."""
        tracer = sys.gettrace()
        if getattr(tracer, "__module__", None) in ("cfrun.rank.loop_boundary",
                                                   "cfrun.rank.resume_loops"):
            sys.settrace(None)  # a boundary or resume tracer of cfrun's
        if getattr(threading.gettrace(), "__module__", None) == "cfrun.rank.resume_loops":
            threading.settrace(None)  # the resume's, for threads the script starts
        self.boundary.cancel()
        self.resume.exit_fast_forward()
        self.snap.quiesce(60.0)
