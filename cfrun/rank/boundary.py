"""Phase 3: steps, the trigger, and the boundary where a checkpoint is taken.

The optimizer step hooks (installed by :mod:`cfrun.rank.install`) count steps. Every
``interval`` steps (the tuner decides), at a preemption's stop step, or at an injected crash,
the step *triggers* (:mod:`cfrun.rank.trigger`); the checkpoint is then taken at the next
*boundary*: the first ``next()`` on the training DataLoader after a step (loader loops,
:mod:`cfrun.rank.loader_boundary`; a later one of the same step may follow a backward whose
gradients are in no checkpoint, issue 36) or the next arrival at the head of the loop around
``optimizer.step()`` (step loops, found with a line tracer: :mod:`cfrun.rank.loop_boundary`).
At the boundary the iteration's remaining code (``scheduler.step()``, ``running_loss += ...``)
has run and the next forward has not, so model, optimizer, scheduler, RNG, data position and
script variables all describe the same moment: right after step s (CheckFreq §4.3's
consistency point, extended to the script's own state). There the boundary captures
(:mod:`cfrun.rank.capture`) and starts the snapshot (:mod:`cfrun.rank.snapshot`), whose copy
the next ``optimizer.step()`` waits for. At the script's normal end the final checkpoint is
taken (:mod:`cfrun.rank.final`).
"""

from __future__ import annotations

import os
import sys
import time
import types
from typing import Any

import torch

from cfrun.contract import faults
from cfrun.contract import settings as E
from cfrun.contract.jobdir import JobDir
from cfrun.rank import cuda, liveness
from cfrun.rank import frames as F
from cfrun.rank.capture import Capture
from cfrun.rank.final import FinalCheckpoint
from cfrun.rank.loader_boundary import LoaderBoundary
from cfrun.rank.log import NotExact, kill_self, say
from cfrun.rank.loop_boundary import LoopBoundary
from cfrun.rank.preemption import Marks, Preemption
from cfrun.rank.resume import Resume
from cfrun.rank.settings import RankSettings
from cfrun.rank.slot_warmup import SlotWarmup
from cfrun.rank.snapshot import SnapshotHandle, Snapshotter
from cfrun.rank.trigger import Trigger
from cfrun.rank.tuner import Tuner
from cfrun.rank.unprotected import Unprotected, Wrap
from cfrun.rank.verify import Verify

__all__ = ["HANDOFF_WAIT_S", "Boundary", "Wrap"]

HANDOFF_WAIT_S = 2.0
"""The longest an optimizer step waits for the previous checkpoint's hand-off to the persist
agent (a message on a local socket: microseconds, unless the agent is being reconnected)."""


class Boundary:
    """Counts steps and takes checkpoints at the boundary: the step hooks, the checkpoint
    itself, its results; holds the step count and the boundary's mode. The trigger and its
    deferral, the loader and loop boundaries, the slot's warm-up, the final checkpoint and
    whether checkpoints are taken at all keep their own. Training thread, except
    :meth:`on_persisted` and :meth:`on_lost` (the snapshot's background thread).

    Args:
        wrap: guards the boundary (it also runs from a line tracer, outside every other hook).
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir, capture: Capture,
                 snap: Snapshotter, tuner: Tuner, resume: Resume, preemption: Preemption,
                 marks: Marks, not_exact: NotExact, wrap: Wrap,
                 verify: Verify | None = None) -> None:
        self.s = settings
        self.jobdir = jobdir
        self._capture = capture
        self._snap = snap
        self._tuner = tuner
        self._resume = resume
        self._preemption = preemption
        self._marks = marks
        self._not_exact = not_exact
        self._verify = verify  # cfrun verify's digests, stop step and kills (None: no verify)
        self.step = 0
        """Optimizer steps completed (the checkpoint's name); restored on resume."""
        self.mode: str | None = None
        """``loader``: the boundary is the training loader's ``next()``; ``loop``: the head of
        the loop around ``optimizer.step()``; None before the first step."""
        self._trigger = Trigger(settings, jobdir, snap, tuner, preemption, verify)
        self._loader = LoaderBoundary(settings.script, capture.found, not_exact.flag)
        self._loop = LoopBoundary(settings.script, not_exact.flag)
        self._warmup = SlotWarmup(settings, snap, capture)
        self._final = FinalCheckpoint(settings, jobdir, snap, capture.found)
        self._unprotected = Unprotected(settings, jobdir, lambda: self.step, wrap)
        self._restored_step: int | None = None
        """Step of the checkpoint this process resumed from (committed already)."""
        self._off = False
        """cfrun turned itself off in this process (:meth:`cancel`)."""
        self._first_step_said = False
        self._waited_for: int | None = None
        """Checkpoint whose hand-off a step waited for (:meth:`on_before_step`)."""
        self._step_t0 = 0.0
        self._checked_bytes = False
        self._cuda: bool | None = None
        """CUDA in use (decided at the first optimizer step)."""
        self._boundary = wrap("the checkpoint boundary", self._at_boundary)
        # fault points (cfrun.contract.faults), read once: None in every real run
        kill_after = faults.value("rank.kill_after_snapshot")
        self._hold_from = (int(kill_after) if kill_after is not None and settings.attempt == 0
                           else None)
        self._stall = _parse_stall(faults.value("rank.checkpoint_stall_s"))

    # ---------------------------------------------------------------- steps

    def on_before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: the step waits until the snapshot copy is done, and
        (at most :data:`HANDOFF_WAIT_S`) until the agent has the checkpoint: a rank killed
        after the checkpoint's boundary then loses it only before the next step, so a kill
        recomputes at most K+1 iterations (the snapshot thread sends the hand-off; with tiny
        steps on a loaded machine it could otherwise still be unsent several steps later)."""
        if self._unprotected.why is not None or (self._cuda and cuda.is_capturing()):
            return  # no checkpoints (no copy to wait for), or no CUDA call of cfrun's allowed
        self._snap.gate()
        if not self._snap.handed_off.is_set() and self._snap.inflight_step != self._waited_for:
            self._waited_for = self._snap.inflight_step  # once per checkpoint
            self._snap.handed_off.wait(HANDOFF_WAIT_S)
        self._step_t0 = time.perf_counter()

    def on_optimizer_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step post-hook (``register_optimizer_step_post_hook``)."""
        if self._preemption.preempted:
            self._preemption.end_now()
        self._unprotected.stepped()
        if not self._check_step(opt):
            return
        count = opt.__dict__.get("_cfrun_steps", 0) + 1
        opt.__dict__["_cfrun_steps"] = count
        tuner = self._tuner
        if tuner.phase == "profiling" and self._step_t0:
            tuner.opt_step_s.append(time.perf_counter() - self._step_t0)
        if count <= self.step or self._resume.fast_forwarding:
            return  # a second optimizer in the same iteration (GAN), or a replayed epoch's step
        if self._unprotected.why is not None:  # no checkpoints; a preemption still stops
            self.step = count
            self._marks.beat(self.step)
            if self._preemption.stop_due(self.step):
                self._preemption.stop_now(self.step, lambda: None)
            return
        if self._resume.awaiting_loader:
            # the epoch was jumped to, yet training goes on without the checkpoint's loader
            self._resume.loader_missing()
        self.step = count
        caller = sys._getframe(1)
        self.mode = self._loader.after_step(self.mode, caller)
        self._marks.beat(self.step)
        self._after_counted_step(opt, caller)
        tuner.on_step(self.step, self._snap.inflight_step)
        if self.s.profile_only and tuner.profile_done(self.step):
            say("profiling done; stopping the script (cfrun profile)")
            raise SystemExit(0)
        if self._trigger.after_step(self.step) and self.mode == "loop":
            self._loop.arm(caller, self._boundary, self._loader.held_position)

    def _check_step(self, opt: torch.optim.Optimizer) -> bool:
        """At each optimizer step, before it counts: CUDA in use? A step captured in a CUDA
        graph, or FSDP1 state, leave the job unprotected (:meth:`Unprotected.check_step`).
        False: this step is not counted (captured in a graph)."""
        if self._cuda is None:
            self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        capturing = bool(self._cuda) and cuda.is_capturing()  # a whole step in a CUDA graph
        if self._unprotected.check_step(capturing, self._capture.found):
            self._trigger.pending = None  # no checkpoints from now on
        if capturing:
            return False
        if self._cuda:
            self._snap.after_step(opt)
        return True

    def _after_counted_step(self, opt: torch.optim.Optimizer, caller: types.FrameType) -> None:
        """After a counted step (``caller``: its caller's frame): the first one's work (the
        ``first_step`` event, the slot's warm-up, the liveness probe), the agreed idle step,
        cfrun verify's kills and stop."""
        if not self._first_step_said:
            self._first_step_said = True
            if self.s.rank == 0:  # goodput: the attempt's start-up ends here
                self.jobdir.emit_event("first_step", attempt=self.s.attempt, step=self.step)
        if not self._warmup.prepared:
            self._warmup.at_first_step()
            liveness.warm(F.script_frames(caller, self.s.script))
            self._tuner.cuda_state = bool(self._cuda) and any(
                isinstance(p, torch.Tensor) and p.is_cuda
                for g in opt.param_groups for p in g["params"])
        self._warmup.after_step()
        self._trigger.note_idle(self.step)
        if self._verify is not None:  # may SIGKILL this rank, as cfrun verify chose
            self._verify.on_step(opt, self.step, self._loader.train_iter, self.mode)
            if self._verify.stop_step is not None:
                self._preemption.stop_for_verify(self._verify.stop_step)

    def restore(self, step: int, mode: str) -> None:
        """Resume: the checkpoint of ``step``, taken in ``mode``, was restored; count on."""
        self.step = step
        self.mode = mode
        self._restored_step = step

    def cancel(self) -> None:
        """Forget a trigger waiting for its boundary (cfrun turned itself off): no checkpoint
        from now on, the final one included."""
        self._trigger.pending = None
        self._off = True

    def on_optimizer_created(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer was constructed: the slot's warm-up may start
        (:meth:`SlotWarmup.on_optimizer_created`). Never raises."""
        if self._unprotected.why is None:
            self._warmup.on_optimizer_created(opt)

    # ---------------------------------------------------------------- the loader boundary

    def on_loader_next(self, it: Any, caller: types.FrameType) -> None:
        """Called before every ``next()`` on a tracked DataLoader iterator: at the training
        loader's first since a step, with a trigger pending in a loader loop, the boundary."""
        if self._preemption.preempted:
            self._preemption.end_now()
        if self._resume.fixing_enumerate:
            self._resume.on_next(it, caller)
        self._loader.on_next(it, caller)
        if (self._trigger.pending is not None and self.mode == "loader"
                and self._loader.first_after_step):
            self._boundary(caller, self._loader.position(it, caller))

    # ---------------------------------------------------------------- at the boundary

    def _at_boundary(self, frame: types.FrameType, data: dict[str, Any] | None) -> None:
        trigger = self._trigger
        if trigger.pending is None:
            return
        if self._cuda and cuda.is_capturing():  # no CUDA call of cfrun's may join a capture
            return  # the trigger waits for the next boundary
        step, due, kill = trigger.pending
        trigger.pending = None
        persist_kill = self._verify is not None and self._verify.kill_in_persist(step)
        if due and not trigger.stopping:
            hold = self._hold_from is not None and step >= self._hold_from
            # cfrun verify judges every kill by K+1 recomputed steps: it defers one boundary
            # at most (then waits), as before issue 23 (the same on every rank)
            strict = self._verify is not None and trigger.deferred is not None
            try:
                if trigger.in_flight(self.step) and not (persist_kill or hold or strict):
                    trigger.defer(step)  # costs this step nothing; retried at the next one
                else:
                    self.checkpoint(self.step, frame, data)
            except Exception as e:  # never break the user's job
                trigger.deferred = None
                say(f"WARNING: checkpoint at step {step} failed: {e!r}")
                self.jobdir.emit_event("checkpoint_failed", step=step, error=repr(e),
                                       rank=self.s.rank)
        if trigger.stopping:
            trigger.pending = None
            self._preemption.stop_now(self.step, lambda: self.checkpoint(self.step, frame, data))
        if persist_kill and self._verify is not None:
            self._snap.give_verdict()  # the rank waits from here on: it writes nothing
            self._verify.kill_after_handoff(self._snap.handed_off, step)
        if kill:
            self._marks.flush_beat()  # the supervisor's failure event names this step
            kill_self(f"injected crash: SIGKILL after step {step} (attempt {self.s.attempt})")

    def final_checkpoint(self) -> None:
        """At the script's normal end (the rank's atexit, every rank): a checkpoint of the last
        step (:meth:`FinalCheckpoint.take`). Not taken before any step, without checkpoints
        (FSDP, a CUDA graph), in ``cfrun profile`` or ``cfrun verify`` runs (they stop at a
        chosen step, checkpointed there), or after cfrun turned itself off. Never raises."""
        step = self.step
        if (step <= 0 or self._off or self._unprotected.why is not None or self.s.profile_only
                or self._verify is not None or self._resume.fast_forwarding):
            return
        self._final.take(step, last_taken=self._trigger.last_taken,
                         restored_step=self._restored_step, checkpoint=self._final_now)

    def finish_profile(self) -> None:
        """``cfrun profile``, at the script's normal end (the rank's atexit, every rank): a
        decision the script's last steps came too early for (:meth:`Tuner.finish_profile`)."""
        if self.s.profile_only and not self._off and self._tuner.phase == "profiling":
            self._tuner.finish_profile(self.step, self._snap.wait_idle)

    def _final_now(self, step: int) -> SnapshotHandle:
        """The final checkpoint of ``step`` (no trigger waits any more)."""
        self._trigger.pending = None
        return self.checkpoint(step, sys._getframe(), None, final=True)

    def checkpoint(self, step: int, frame: types.FrameType, data: dict[str, Any] | None,
                   *, final: bool = False) -> SnapshotHandle:
        """Take a checkpoint of step ``step``. Every rank calls it at the same boundary.

        Capture, snapshot into shared memory, hand off to the node's persist agent (two-phase;
        :mod:`cfrun.rank.snapshot`). The caller defers a checkpoint while the previous one is
        in flight (:meth:`Trigger.in_flight`); if this rank's is still in flight all the same
        (its commit reply is on the way, a preemption's final checkpoint, a fault point), it
        waits for it: at most one checkpoint is in flight. Returns the snapshot's handle.
        Raises what capture or the snapshot's start raise.
        """
        t0 = time.perf_counter()
        hold = self._hold_from is not None and step >= self._hold_from
        if self._snap.busy():
            self._snap.wait_idle()
        t_trigger = time.time()
        tree, tensors, async_ids = self._capture.capture(frame, data, final=final)
        capture_s = time.perf_counter() - t0
        meta = {
            "step": step,
            "mode": self.mode,
            **self._loop.meta(),
            "epoch": data["iter_index"] if data else None,
            "batches": data["batches"] if data else None,
            "not_exact": list(self._not_exact.reasons),
            "world_size": self.s.world_size,
        }
        if final:
            meta["final"] = True
        if not self._checked_bytes:
            self._checked_bytes = True
            self._tuner.check_state_bytes(int(tree["model_bytes"]))
        self._snap.use_mode(self._tuner.mode_for(step))  # also records the step for the tuner
        handle = self._snap.start(step, tree, tensors, async_ids, meta, t_trigger, t0,
                                  capture_s=capture_s)
        self._trigger.taken(step, self._loop.progress(frame, step) if self.mode == "loop"
                            else self._loader.progress)
        if self._stall is not None and self._stall[1] <= step < self._stall[2]:
            time.sleep(self._stall[0])
        if hold:  # the snapshot thread SIGKILLs the rank right after the hand-off
            self._snap.wait_idle()
        return handle

    # ---------------------------------------------------------------- results (snapshot thread)

    def on_persisted(self, fields: dict[str, Any]) -> None:
        """A checkpoint committed: its figures go to the tuner (at the next step, on the
        training thread) and, from rank 0, to a ``checkpoint`` event; the final checkpoint's
        go to neither (training is over: its ``final_checkpoint`` event says how it went)."""
        if fields.get("step") == self._final.step:
            return
        self._tuner.done.append(fields)  # for the tuner, on the training thread
        if self.s.rank == 0:
            extra = self._trigger.event_fields(int(fields["step"]))
            self.jobdir.emit_event("checkpoint", attempt=self.s.attempt, mode=self.mode,
                                   persist="agent", **fields, **extra)
        elif os.environ.get(E.EVENTS_ALL_RANKS) == "1":  # per-rank figures (benchmarks)
            self.jobdir.emit_event("checkpoint_rank", rank=self.s.rank, attempt=self.s.attempt,
                                   **fields)

    def on_lost(self, step: int, error: str) -> None:
        """A checkpoint's copy or hand-off failed (the agent was unreachable or died)."""
        if self._snap.last_dropped_step == step:  # Snapshotter.give_verdict dropped it
            say(f"cfrun: checkpoint step {step} not taken: {error}")
        else:
            say(f"WARNING: checkpoint step {step} was lost ({error}); the next one reconnects")
        self.jobdir.emit_event("persist_lost", step=step, rank=self.s.rank, error=error)


def _parse_stall(spec: Any) -> tuple[float, int, int] | None:
    """Fault point ``rank.checkpoint_stall_s``: ``"SECONDS@FIRST-LAST"`` -> its three numbers."""
    if not spec:
        return None
    seconds, _, span = str(spec).partition("@")
    first, _, last = span.partition("-")
    return float(seconds), int(first), int(last)
