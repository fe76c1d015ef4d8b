"""What is due after each optimizer step, and whether it may be taken now
(:mod:`cfrun.rank.boundary`).

Every ``interval`` steps (the tuner decides), at a preemption's stop step, or at an injected
crash, the step *triggers*: the trigger waits for the next boundary (:attr:`Trigger.pending`).
There, a checkpoint due while the previous one still counts as in flight is *deferred* to the
next boundary (:meth:`Trigger.in_flight`, :meth:`Trigger.defer`): at most one checkpoint in
flight (CheckFreq §4.3), and no step waits. With several ranks the rule must give every rank
the same answer for the same step; rank 0 publishes from which step the last checkpoint counts
as over (``checkpoint_gate.json``, :meth:`Trigger.note_idle`).
"""

from __future__ import annotations

from typing import Any

from cfrun.contract import coordination as co
from cfrun.contract import faults
from cfrun.contract.jobdir import JobDir
from cfrun.rank.log import say
from cfrun.rank.preemption import Preemption
from cfrun.rank.settings import RankSettings
from cfrun.rank.snapshot import Snapshotter
from cfrun.rank.tuner import Tuner
from cfrun.rank.verify import Verify

AGREE_LEAD_STEPS = 2
"""With several ranks, rank 0 publishes the step from which its in-flight checkpoint counts
as over this many steps ahead of the step it saw it end at (:meth:`Trigger.note_idle`), so
every rank has read it before that step comes (``strategy.json`` uses the same lead)."""


class Trigger:
    """The trigger waiting for its boundary, the deferral of a checkpoint due while another is
    in flight, and which checkpoint counts as in flight (the same on every rank). Training
    thread, except :meth:`event_fields` (the snapshot thread, at a commit).
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir, snap: Snapshotter, tuner: Tuner,
                 preemption: Preemption, verify: Verify | None) -> None:
        self.s = settings
        self.jobdir = jobdir
        self._snap = snap
        self._tuner = tuner
        self._preemption = preemption
        self._verify = verify
        self.pending: tuple[int, bool, bool] | None = None
        """(step, due, kill) of the trigger waiting for its boundary."""
        self.stopping = False
        """The pending trigger is a preemption's (or cfrun verify's) stop step."""
        self.last_taken: int | None = None
        """Step of the last checkpoint this process took (the same on every rank)."""
        self.deferred: tuple[int, int] | None = None
        """(due step, step in flight) of the checkpoint being deferred, if any."""
        self._due_passed = 0
        """Further due steps the deferred checkpoint stands for (skipped)."""
        self._idle_from: int | None = None
        """The agreed step from which :attr:`last_taken` no longer counts as in flight
        (several ranks: rank 0's :class:`~cfrun.contract.coordination.CheckpointGate`)."""
        self._stale_gate = co.read(co.checkpoint_gate_path(jobdir.root), co.CheckpointGate) \
            if settings.world_size > 1 and settings.rank != 0 else None
        """A follower: the gate record an earlier attempt left (never followed). Attempt
        numbers are each node's own, so on another node than rank 0's the record's attempt
        cannot tell this attempt's gate from an earlier one's; rank 0's attempt number grows
        with each restart, so a record of this attempt always differs from the stale one."""
        in_flight_at = faults.value("rank.in_flight_at_step")
        self._in_flight_at = int(in_flight_at) if in_flight_at is not None \
            and settings.attempt == 0 else None
        """Fault point ``rank.in_flight_at_step``: the step whose first due boundary finds the
        previous checkpoint in flight (None in every real run)."""
        self._fields: dict[int, dict[str, Any]] = {}
        """Rank 0: step -> the fields its ``checkpoint`` event adds at its commit, as they were
        at its boundary: the deferral's, and the loader's ``progress`` (read at the commit,
        the boundary's own was sometimes a later one's: step 80 said 92 batches done)."""

    def after_step(self, step: int) -> bool:
        """After optimizer step ``step``: is a checkpoint due (the tuner's interval, a deferred
        one, cfrun verify's kill in a persist), an injected crash, or a preemption's stop?
        Then that waits for the next boundary (:attr:`pending`) and True is returned."""
        fresh = self._tuner.due(step)
        if fresh and self.deferred is not None and self._tuner.phase != "profiling":
            self._due_passed += 1  # merged into the deferred one: skipped
        due = fresh or (self.pending is not None and self.pending[1]) or (
            self._verify is not None and self._verify.kill_in_persist(step))
        kill = self.s.rank == 0 and (step, self.s.attempt) in self.s.inject_crash
        stop = self._preemption.stop_due(step)
        if not (due or kill or stop):
            return False
        self.pending = (step, due, kill or (self.pending is not None and self.pending[2]))
        self.stopping = stop
        return True

    def in_flight(self, step: int) -> bool:
        """Whether the checkpoint due at the boundary after ``step`` is deferred because the
        previous one still counts as in flight (issue 23: waiting for it stalled the step,
        a median 2.0 s per checkpoint at ``--interval 20`` with 2.7-5.7 s persists on an H100).

        The rule must give every rank the same answer for the same step: ranks that checkpoint
        different steps leave each step incomplete, and the agent commits none of them. A
        rank's own "is my persist done" differs between ranks by when the agent's reply
        arrives (and it arrives at the commit, for every rank of the step). So with several
        ranks only rank 0 looks at its own: at the first step it sees the checkpoint over it
        publishes that step plus :data:`AGREE_LEAD_STEPS` (``checkpoint_gate.json``,
        :meth:`note_idle`), and every rank, rank 0 too, counts the checkpoint as in flight
        before that step and as over from it. Ranks of a data-parallel job run within a step
        of each other (each step's gradient all-reduce), so all have read it by then; a rank
        whose own reply is not in yet at that step waits for it
        (:meth:`cfrun.rank.boundary.Boundary.checkpoint`). With one rank there is nothing to
        agree on: in flight while its persist runs, and while the snapshot slot is still being
        page-locked ahead of the first checkpoint (CUDA state:
        :meth:`cfrun.rank.slot.SnapshotSlot.prepare`, 1-2 s for a 4.4 GB state on an H200,
        which the first checkpoint, the policy's warm-up probe at step 4, waited for).
        """
        if step == self._in_flight_at:  # the fault point: once
            self._in_flight_at = None
            return True
        if self.s.world_size == 1 and self._snap.slot.locking():
            return True  # the slot is being page-locked: a checkpoint now would wait for it
        if self.last_taken is None:
            return False
        if self.s.world_size == 1:
            return self._snap.busy()
        return self._idle_from is None or step < self._idle_from

    def note_idle(self, step: int) -> None:
        """Several ranks, after each step (``step``) while the last checkpoint counts as in
        flight: rank 0, once it sees it over, publishes from which step every rank counts it
        so (:meth:`in_flight`; a failed write is retried at the next step); the other ranks
        read that record at every step until they have it (a read costs tens of
        microseconds), so each has it a step after rank 0 wrote it, before rank 0 takes the
        next checkpoint and removes it."""
        if self.last_taken is None or self._idle_from is not None or self.s.world_size == 1:
            return
        path = co.checkpoint_gate_path(self.jobdir.root)
        if self.s.rank != 0:
            rec = co.read(path, co.CheckpointGate)
            if rec is not None and rec != self._stale_gate \
                    and rec.after_step == self.last_taken:
                self._idle_from = rec.idle_from_step
            return
        if self._snap.busy():
            return
        idle_from = step + AGREE_LEAD_STEPS
        try:
            co.write(path, co.CheckpointGate(
                attempt=self.s.attempt, after_step=self.last_taken, idle_from_step=idle_from))
        except OSError as e:
            say(f"WARNING: cannot write {co.CHECKPOINT_GATE} ({e}); checkpoints wait")
            return
        self._idle_from = idle_from

    def defer(self, step: int) -> None:
        """The checkpoint due at ``step`` waits for the next boundary (the previous one is in
        flight): at most one checkpoint in flight (CheckFreq §4.3), and no step waits. Rank 0
        says so once, in a ``checkpoint_deferred`` event (a kill before it is taken then
        recomputes more than the interval: the event says why)."""
        if self.deferred is None:
            previous = self.last_taken if self.last_taken is not None else -1
            self.deferred = (step, previous)
            if self.s.rank == 0:
                self.jobdir.emit_event(
                    "checkpoint_deferred", due_step=step, in_flight_step=previous,
                    attempt=self.s.attempt,
                    waits_for="slot" if self._snap.slot.locking() else "persist")
        self.pending = (step, True, False)

    def taken(self, step: int, progress: dict[str, int] | None) -> None:
        """A checkpoint of ``step`` started: it is the one in flight now. When it was due
        earlier, its ``checkpoint`` event will say since when (``deferred_from``) and how many
        further due steps it stands for (``due_passed``); ``progress``: the loader's, for
        ``cfrun status``'s ETA."""
        if self.s.rank == 0:
            fields: dict[str, Any] = {"progress": progress} if progress else {}
            if self.deferred is not None:
                fields.update(deferred_from=self.deferred[0], due_passed=self._due_passed)
            for older in list(self._fields):  # list(): the snapshot thread pops too
                if older < step:  # a checkpoint that failed or was lost
                    self._fields.pop(older, None)
            if fields:
                self._fields[step] = fields
        self.deferred, self._due_passed = None, 0
        self.last_taken, self._idle_from = step, None
        if self.s.rank == 0 and self.s.world_size > 1:  # no record of an earlier run counts
            try:
                co.checkpoint_gate_path(self.jobdir.root).unlink(missing_ok=True)
            except OSError:
                pass  # its after_step is older than this checkpoint: no rank follows it

    def event_fields(self, step: int) -> dict[str, Any]:
        """Rank 0, at the commit of ``step`` (snapshot thread): the fields :meth:`taken` kept
        for its ``checkpoint`` event (none: ``{}``)."""
        return self._fields.pop(step, {})
