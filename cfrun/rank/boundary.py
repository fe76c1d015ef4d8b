"""Phase 3: steps, the trigger, and the boundary where a checkpoint is taken.

The optimizer step hooks (installed by :mod:`cfrun.rank.install`) count steps. Every
``interval`` steps (the tuner decides), at a preemption's stop step, or at an injected crash,
the step *triggers*; the checkpoint is then taken at the next *boundary*: the next ``next()`` on
the training DataLoader (loader loops) or the next arrival at the head of the loop around
``optimizer.step()`` (step loops, found with a line tracer). At the boundary the iteration's
remaining code (``scheduler.step()``, ``running_loss += ...``) has run and the next forward has
not, so model, optimizer, scheduler, RNG, data position and script variables all describe the
same moment: right after step s (CheckFreq §4.3's consistency point, extended to the script's
own state). There the boundary captures (:mod:`cfrun.rank.capture`) and starts the snapshot
(:mod:`cfrun.rank.snapshot`), whose copy the next ``optimizer.step()`` waits for.
"""

from __future__ import annotations

import os
import sys
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from cfrun.contract import coordination as co
from cfrun.contract import faults
from cfrun.contract import settings as E
from cfrun.contract.jobdir import JobDir
from cfrun.rank import cuda, liveness
from cfrun.rank import frames as F
from cfrun.rank import frameworks as FW
from cfrun.rank.adapters import accelerate as ACC
from cfrun.rank.adapters import hf as HF
from cfrun.rank.adapters import lightning as PL
from cfrun.rank.capture import Capture
from cfrun.rank.data import (
    carried_state,
    inexact_reasons,
    loader_fingerprint,
    sampler_state,
    worker_rng_of,
)
from cfrun.rank.discovery import uncheckpointable
from cfrun.rank.log import NotExact, kill_self, say
from cfrun.rank.preemption import Marks, Preemption
from cfrun.rank.resume import Resume
from cfrun.rank.settings import RankSettings
from cfrun.rank.snapshot import SnapshotHandle, Snapshotter
from cfrun.rank.tuner import Tuner
from cfrun.rank.verify import Verify

Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
"""``Guard.wrap`` (:mod:`cfrun.rank.install`): a hook made safe for the user's script."""

NO_OPTIMIZER_BACKWARDS = 100
"""``backward()`` calls with no ``torch.optim`` optimizer step in between after which a rank
says that its job is unprotected (a script that updates its parameters by hand: cfrun's steps
and checkpoints are the optimizers' steps). Gradient accumulation rarely spans this many."""


OPT_STATE_COPIES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "SGD": 1,
                    "Adagrad": 1, "RMSprop": 1, "Adadelta": 2}
"""Tensors of a parameter's size that an optimizer of this class keeps per parameter (its
state); 2 for any other (:meth:`Boundary.on_optimizer_created`'s slot size)."""

AGREE_LEAD_STEPS = 2
"""With several ranks, rank 0 publishes the step from which its in-flight checkpoint counts
as over this many steps ahead of the step it saw it end at (:class:`Boundary`), so every
rank has read it before that step comes (``strategy.json`` uses the same lead)."""

FINAL_WAIT_S = 60.0
"""The longest the script's end waits for the final checkpoint's commit
(:meth:`Boundary.final_checkpoint`)."""

HANDOFF_WAIT_S = 2.0
"""The longest an optimizer step waits for the previous checkpoint's hand-off to the persist
agent (a message on a local socket: microseconds, unless the agent is being reconnected)."""


class BackwardWatch:
    """Counts autograd backward passes (``torch.autograd.backward``, which ``Tensor.backward``
    calls) until the first optimizer step; at ``limit`` of them with no step, calls
    ``on_unprotected(count)`` once. Either way it then restores torch's own function, so a
    training step pays for it only until the first optimizer step. Training thread.
    """

    def __init__(self, on_unprotected: Callable[[int], None],
                 limit: int = NO_OPTIMIZER_BACKWARDS) -> None:
        self.count = 0
        self._limit = limit
        self._on_unprotected = on_unprotected
        self._orig = torch.autograd.backward
        watch = self

        def backward(*args: Any, **kwargs: Any) -> Any:
            watch.count += 1
            if watch.count >= watch._limit:
                watch.stop()
                watch._on_unprotected(watch.count)
            return watch._orig(*args, **kwargs)

        self._counting = backward
        torch.autograd.backward = backward

    def stop(self) -> None:
        """Put torch's ``autograd.backward`` back (idempotent; not if someone replaced ours)."""
        if torch.autograd.backward is self._counting:
            torch.autograd.backward = self._orig


class Boundary:
    """Counts steps, triggers checkpoints and takes them at the boundary. Training thread,
    except :meth:`on_persisted` and :meth:`on_lost` (the snapshot's background thread).

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
        self._flag = not_exact.flag
        self._verify = verify
        """``cfrun verify``'s digests, stop step and kills (None in every other run)."""
        self.step = 0
        """Optimizer steps completed (the checkpoint's name); restored on resume."""
        self.mode: str | None = None
        """``loader``: the boundary is the training loader's ``next()``; ``loop``: the head of
        the loop around ``optimizer.step()``; None before the first step."""
        self._last_next_iter: weakref.ref[Any] | None = None
        self._next_since_step = False
        self._train_iter: Callable[[], Any] | None = None  # a weakref.ref
        self._next_outside_for = False
        self._held = False
        self._held_decided = False
        """A step loop that draws batches with next() from an iterator a script variable holds
        (:mod:`cfrun.rank.frameworks`): mode ``loop``, with the iterator's position."""
        self._pending: tuple[int, bool, bool] | None = None
        """(step, due, kill) of the trigger waiting for its boundary."""
        self._loop: F.LoopInfo | None = None
        self._outer_loops: list[F.LoopInfo] = []
        """Step loops: the loops around :attr:`_loop`, outermost first (an epoch loop)."""
        self._progress: dict[str, int] | None = None  # the last loader boundary's estimate
        self._epoch_frame: types.FrameType | None = None
        self._enum_cache: tuple[weakref.ref[Any], Any, weakref.ref[Any], Any] | None = None
        """(training loader iterator, the enumerate around it or its wrapper or None, the
        loader), dropped at the loader's next epoch."""
        self._stopping = False
        self._last_taken: int | None = None
        """Step of the last checkpoint this process took (the same on every rank)."""
        self._restored_step: int | None = None
        """Step of the checkpoint this process resumed from (committed already)."""
        self._final_step: int | None = None
        """Step of the final checkpoint (:meth:`final_checkpoint`), once started."""
        self._off = False
        """cfrun turned itself off in this process (:meth:`cancel`)."""
        self._idle_from: int | None = None
        """The agreed step from which :attr:`_last_taken` no longer counts as in flight
        (several ranks: rank 0's :class:`~cfrun.contract.coordination.CheckpointGate`)."""
        self._stale_gate = co.read(co.checkpoint_gate_path(self.jobdir.root), co.CheckpointGate) \
            if settings.world_size > 1 and settings.rank != 0 else None
        """A follower: the gate record an earlier attempt left (never followed). Attempt
        numbers are each node's own, so on another node than rank 0's the record's attempt
        cannot tell this attempt's gate from an earlier one's; rank 0's attempt number grows
        with each restart, so a record of this attempt always differs from the stale one."""
        self._deferred: tuple[int, int] | None = None
        """(due step, step in flight) of the checkpoint being deferred, if any."""
        self._due_passed = 0
        """Further due steps the deferred checkpoint stands for (skipped)."""
        self._ckpt_fields: dict[int, dict[str, Any]] = {}
        """Rank 0: step -> the fields its ``checkpoint`` event adds at its commit, as they were
        at its boundary: the deferral's, and the loader's ``progress`` (read at the commit,
        the boundary's own was sometimes a later one's: step 80 said 92 batches done)."""
        self._prepared = False
        self._first_step_said = False
        """The snapshot slot was prepared (:meth:`Snapshotter.prepare`)."""
        self._done_records: list[dict[str, Any]] = []
        self._waited_for: int | None = None
        """Checkpoint whose hand-off a step waited for (:meth:`on_before_step`)."""
        self._step_t0 = 0.0
        self._checked_bytes = False
        self._checked_layout = False
        self._uncheckpointable: str | None = None
        """Why this process takes no checkpoints (FSDP1 state, a CUDA graph step)."""
        self._cuda: bool | None = None
        """CUDA in use (decided at the first optimizer step)."""
        self._boundary = wrap("the checkpoint boundary", self._at_boundary)
        # fault points (cfrun.contract.faults), read once: None in every real run
        kill_after = faults.value("rank.kill_after_snapshot")
        self._hold_from = (int(kill_after) if kill_after is not None and settings.attempt == 0
                           else None)
        self._stall = _parse_stall(faults.value("rank.checkpoint_stall_s"))
        ready_after = faults.value("rank.slot_ready_after_steps")
        self._slot_ready_after = int(ready_after) if ready_after is not None else None
        self._steps_here = 0
        self._backward_watch: BackwardWatch | None = BackwardWatch(
            wrap("the backward() counter", self._no_optimizer))

    # ---------------------------------------------------------------- steps

    def on_before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: the step waits until the snapshot copy is done, and
        (at most :data:`HANDOFF_WAIT_S`) until the agent has the checkpoint: a rank killed
        after the checkpoint's boundary then loses it only before the next step, so a kill
        recomputes at most K+1 iterations (the snapshot thread sends the hand-off; with tiny
        steps on a loaded machine it could otherwise still be unsent several steps later)."""
        if self._uncheckpointable is not None or (self._cuda and cuda.is_capturing()):
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
        if self._backward_watch is not None:  # an optimizer steps: the watch is done
            self._backward_watch.stop()
            self._backward_watch = None
        if self._cuda is None:
            self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda and cuda.is_capturing():  # a whole step in a CUDA graph (issue 18)
            self._unprotect("CUDA graph", "the optimizer step is captured in a CUDA graph: its "
                            "replays run no optimizer hooks, so cfrun sees no steps and takes "
                            "no checkpoints; capture the forward and backward only, and step "
                            "the optimizer outside the graph")
            return
        if self._cuda:
            self._snap.after_step(opt)
        if not self._checked_layout:
            self._checked_layout = True
            why = uncheckpointable(self._capture.found)
            if why is not None:
                self._unprotect("FSDP1", why)
        count = opt.__dict__.get("_cfrun_steps", 0) + 1
        opt.__dict__["_cfrun_steps"] = count
        tuner = self._tuner
        if tuner.phase == "profiling" and self._step_t0:
            tuner.opt_step_s.append(time.perf_counter() - self._step_t0)
        if count <= self.step or self._resume.fast_forwarding:
            return  # a second optimizer in the same iteration (GAN), or a replayed epoch's step
        if self._uncheckpointable is not None:  # no checkpoints; a preemption still stops
            self.step = count
            self._marks.beat(self.step)
            if self._preemption.stop_due(self.step):
                self._preemption.stop_now(self.step, lambda: None)
            return
        if self._resume.awaiting_loader:
            # the epoch was jumped to, yet training goes on without the checkpoint's loader
            self._resume.loader_missing()
        self.step = count
        if self._next_since_step and self._last_next_iter is not None:
            self._train_iter = self._last_next_iter
            if not self._held_decided:  # the first step decides (cfrun.rank.frameworks)
                self._held_decided = True
                self._held = self._next_outside_for and FW.held_by_script(
                    self._train_iter(), sys._getframe(1), self.s.script)
            self.mode = "loop" if self._held else "loader"
        elif self.mode is None:
            self.mode = "loop"
        self._next_since_step = False
        self._marks.beat(self.step)
        if not self._first_step_said:
            self._first_step_said = True
            if self.s.rank == 0:  # goodput: the attempt's start-up ends here
                self.jobdir.emit_event("first_step", attempt=self.s.attempt, step=self.step)
        if not self._prepared:
            self._prepare_slot()
            liveness.warm(F.script_frames(sys._getframe(1), self.s.script))
            tuner.cuda_state = bool(self._cuda) and any(
                isinstance(p, torch.Tensor) and p.is_cuda
                for g in opt.param_groups for p in g["params"])
        if self._slot_ready_after is not None:  # a fault point: None in every real run
            self._steps_here += 1
            if self._steps_here >= self._slot_ready_after:
                self._snap.slot.hold.set()
        self._note_idle()
        if self._verify is not None:  # may SIGKILL this rank, as cfrun verify chose
            self._verify.on_step(opt, self.step, self._train_iter, self.mode)
            if self._verify.stop_step is not None:
                self._preemption.stop_for_verify(self._verify.stop_step)
        while self._done_records:  # checkpoint results from the snapshot thread
            rec = self._done_records.pop(0)
            tuner.on_checkpoint_done(int(rec["step"]), rec)
        tuner.on_step(self.step, self._snap.inflight_step)
        if self.s.profile_only and tuner.profile_done(self.step):
            say("profiling done; stopping the script (cfrun profile)")
            raise SystemExit(0)
        fresh = tuner.due(self.step)
        if fresh and self._deferred is not None and tuner.phase != "profiling":
            self._due_passed += 1  # merged into the deferred one: skipped
        due = fresh or (self._pending is not None and self._pending[1]) or (
            self._verify is not None and self._verify.kill_in_persist(self.step))
        kill = self.s.rank == 0 and (self.step, self.s.attempt) in self.s.inject_crash
        stop = self._preemption.stop_due(self.step)
        if not (due or kill or stop):
            return
        self._pending = (self.step, due, kill or (self._pending is not None and self._pending[2]))
        self._stopping = stop
        if self.mode == "loop":
            self._arm_loop_boundary()

    def _unprotect(self, where: str, why: str) -> None:
        """No checkpoints in this process from now on: say ``why`` once, on stderr and (rank 0)
        as an ``unprotected`` event; the script goes on untouched. A state cfrun would save
        wrongly is never claimed to be saved."""
        if self._uncheckpointable is not None:
            return
        self._uncheckpointable = why
        self._pending = None
        self._report_unprotected(
            where, f"{why}; this job is unprotected (no checkpoints, a restart starts over)", why)

    def _report_unprotected(self, where: str, line: str, error: str) -> None:
        """``WARNING: line`` on stderr, and (rank 0) an ``unprotected`` event naming ``where``
        and ``error``."""
        say(f"WARNING: {line}")
        if self.s.rank == 0:
            self.jobdir.emit_event("unprotected", where=where, error=error, step=self.step,
                                   rank=self.s.rank, attempt=self.s.attempt)

    def _no_optimizer(self, backwards: int) -> None:
        """:class:`BackwardWatch`: ``backwards`` backward passes and no optimizer step. Says
        once, on stderr and (rank 0) as an ``unprotected`` event, that no checkpoint will be
        taken; the script goes on untouched."""
        self._backward_watch = None
        self._report_unprotected(
            "no optimizer",
            f"no torch.optim optimizer stepped after {backwards} backward() calls: this job is "
            "unprotected (no checkpoints, a restart starts over). cfrun counts steps and "
            "checkpoints at optimizer.step(); update the parameters with a torch.optim "
            "optimizer (e.g. torch.optim.SGD(params, lr)) instead of by hand",
            f"no torch.optim optimizer stepped after {backwards} backward() calls (parameters "
            "updated by hand?): no checkpoints")

    def restore(self, step: int, mode: str) -> None:
        """Resume: the checkpoint of ``step``, taken in ``mode``, was restored; count on."""
        self.step = step
        self.mode = mode
        self._restored_step = step

    def cancel(self) -> None:
        """Forget a trigger waiting for its boundary (cfrun turned itself off): no checkpoint
        from now on, the final one included."""
        self._pending = None
        self._off = True

    # ---------------------------------------------------------------- the loader boundary

    def on_loader_next(self, it: Any, caller: types.FrameType) -> None:
        """Called before every ``next()`` on a tracked DataLoader iterator."""
        if self._preemption.preempted:
            self._preemption.end_now()
        if self._resume.fixing_enumerate:
            self._resume.on_next(it, caller)
        cached = self._enum_cache
        if cached is not None and cached[2]() is it._cfrun_loader and (
                cached[0]() is not it or cached[3] != getattr(it, "_cfrun_iter_index", None)):
            self._enum_cache = None  # a new epoch: let the last one's wrappers go
        self._last_next_iter = weakref.ref(it)
        self._next_since_step = True
        if not self._held_decided:
            self._next_outside_for = FW.is_script_frame(caller, self.s.script) \
                and not _is_for_header(caller)
        if (self._pending is not None and self.mode == "loader" and self._train_iter is not None
                and self._train_iter() is it):
            loader = it._cfrun_loader
            framework = FW.framework_loop(caller, self.s.script)
            ahead, untested = ACC.read_ahead(caller)  # accelerate's DataLoaderShard
            if untested is not None:
                self._flag(untested)
            hf_loop = HF.capture(caller) if framework is FW.HF_TRAINER else None
            pl_loop = PL.capture(caller) if framework is FW.LIGHTNING_TRAINER else None
            if framework is not None and hf_loop is None and pl_loop is None:  # not the script's
                untested = HF.untested_reason() if framework is FW.HF_TRAINER else \
                    PL.untested_reason() if framework is FW.LIGHTNING_TRAINER else None
                self._flag(framework.reason if untested is None  # (cfrun.rank.frameworks)
                           else f"{untested}: {framework.reason}")
            elif pl_loop is None and not (_is_for_header(caller) or ACC.is_shard_iter(caller)):
                self._flag("the training DataLoader is advanced with next() outside a for "
                           "statement; its position resumes, the loop around it may not")
            consumer = F.consumer_frame(caller)
            epoch_loop, epoch_value = self._epoch_loop(consumer)
            data = {
                "loader": loader._cfrun_ordinal,
                "fingerprint": loader_fingerprint(loader),
                "iter_index": it._cfrun_iter_index,
                "batches": it._cfrun_consumed - ahead,  # the script's position
                "epoch_rng": loader._cfrun_epoch_rng,
                "worker_rng": worker_rng_of(it),
                # persistent workers were seeded from it at the loader's first iter()
                "base_seed": int(it._base_seed) if loader.num_workers > 0 else None,
                "epoch_loop": epoch_loop.to_json() if epoch_loop else None,
                "epoch_value": epoch_value,
                "enumerate": self._enumerate_index(it, caller, consumer),
                "wrapped": consumer is not caller,
                # a library wrapper's state (Fabric's iter() count, timm's prefetched batch)
                # and the sampler's epoch: a resume jumps the epoch loop and puts them back
                "wrappers": F.wrapper_state(caller, self.s.script),
                "sampler": sampler_state(loader),
                # what the other loaders (an eval loader) carry into their next epoch
                "loaders": self._carried(loader),
            }
            if hf_loop is not None:  # transformers.Trainer's loop (cfrun.rank.adapters.hf)
                data["hf"] = hf_loop  # its position: a resumed epoch iterates another loader
                data["iter_index"], data["batches"] = hf_loop["epoch"], hf_loop["batches"]
            if pl_loop is not None:  # Lightning's fit loop (cfrun.rank.adapters.lightning)
                data["lightning"] = pl_loop
            self._progress = _progress(loader, it._cfrun_consumed, epoch_loop, epoch_value,
                                       self._epoch_frame)
            for reason in inexact_reasons(loader):
                self._flag(reason)
            if loader._dataset_kind != 0:  # _DatasetKind.Iterable
                self._flag("the training DataLoader reads an IterableDataset; cfrun cannot skip "
                           "to the batch position inside an epoch")
            self._boundary(caller, data)

    def _carried(self, train: Any) -> dict[str, Any]:
        """:func:`cfrun.rank.data.carried_state` of every live loader but ``train``, by
        creation ordinal (as a string)."""
        out: dict[str, Any] = {}
        for loader in self._capture.found.loaders():
            if loader is not train and "_cfrun_ordinal" in loader.__dict__:
                state = carried_state(loader)
                if state is not None:
                    out[str(loader._cfrun_ordinal)] = state
        return out

    def _enumerate_index(self, it: Any, caller: types.FrameType,
                         consumer: types.FrameType) -> int | None:
        """The count of the ``enumerate()`` around the training loader or its wrapper, as it
        stands in the middle of that enumerate's ``next()`` (None without one). The enumerate
        is looked up once per epoch of a loader iterator (``persistent_workers=True`` reuses one
        iterator for every epoch, each in a new ``enumerate()``)."""
        cached = self._enum_cache
        epoch = getattr(it, "_cfrun_iter_index", None)
        if cached is None or cached[0]() is not it or cached[3] != epoch:
            cached = (weakref.ref(it), F.find_enumerate(it, caller, consumer),
                      weakref.ref(it._cfrun_loader), epoch)
            self._enum_cache = cached
        return F.enumerate_index(cached[1]) if cached[1] is not None else None

    def _epoch_loop(self, consumer: types.FrameType) -> tuple[F.LoopInfo | None, int | None]:
        """The loop around the training loader's ``for`` (the epoch loop) and its variable.

        ``consumer`` is the frame whose loop receives the batches (:func:`F.consumer_frame`:
        past the loader wrappers); the epoch loop encloses that loop in the same function, or
        the call of that function in one of its callers (a per-epoch ``train_one_epoch()``).
        """
        frames = F.script_frames(consumer, self.s.script)
        loop, frame = None, None
        if frames and frames[0] is consumer:
            loop, frame = F.find_loop(consumer, outside=True), consumer
        if loop is None:
            for f in frames[1:] if frames and frames[0] is consumer else frames:
                loop, frame = F.find_loop(f), f
                if loop is not None:
                    break
        self._epoch_frame = frame
        if loop is None or frame is None:
            return None, None
        value = frame.f_locals.get(loop.target) if loop.target else None
        if loop.kind == "for_range" and type(value) is not int:
            return F.LoopInfo(loop.code, loop.header_line, loop.body_line, "for_other",
                              loop.target), None
        return loop, value

    # ---------------------------------------------------------------- the loop boundary

    def _arm_loop_boundary(self) -> None:
        frames = F.script_frames(sys._getframe(2), self.s.script)
        loop_frame, loop = None, None
        for f in frames:
            loop = F.find_loop(f)
            if loop is not None:
                loop_frame = f
                break
        if loop_frame is None or loop is None or sys.gettrace() is not None:
            self._flag("no loop around optimizer.step() was found in the script (or a tracer "
                       "is active); script variables are captured at the step")
            self._loop = None
            self._boundary(frames[0] if frames else sys._getframe(2), None)
            return
        self._loop = loop
        self._outer_loops = F.enclosing_loops(frames[frames.index(loop_frame):], loop)
        targets = (loop.header_line, loop.body_line)

        def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno in targets:
                sys.settrace(None)
                frame.f_trace = None
                self._boundary(frame, self._held_position())
                return None
            return tracer

        sys.settrace(_ignore_calls)
        loop_frame.f_trace = tracer
        loop_frame.f_trace_lines = True

    def _held_position(self) -> dict[str, Any] | None:
        """The held iterator's position at the loop boundary (None when not such a loop)."""
        if not self._held:
            return None
        it = self._train_iter() if self._train_iter is not None else None
        data = FW.held_position(it) if it is not None else None
        if data is None:
            self._flag("the step loop draws batches with next() from a DataLoader iterator that "
                       "is not its loader's newest; the data position restarts")
        return data

    # ---------------------------------------------------------------- at the boundary

    def _at_boundary(self, frame: types.FrameType, data: dict[str, Any] | None) -> None:
        if self._pending is None:
            return
        if self._cuda and cuda.is_capturing():  # no CUDA call of cfrun's may join a capture
            return  # the trigger waits for the next boundary
        step, due, kill = self._pending
        self._pending = None
        persist_kill = self._verify is not None and self._verify.kill_in_persist(step)
        if due and not self._stopping:
            hold = self._hold_from is not None and step >= self._hold_from
            # cfrun verify judges every kill by K+1 recomputed steps: it defers one boundary
            # at most (then waits), as before issue 23 (the same on every rank)
            strict = self._verify is not None and self._deferred is not None
            try:
                if self._in_flight(self.step) and not (persist_kill or hold or strict):
                    self._defer(step)  # costs this step nothing; retried at the next one
                else:
                    self.checkpoint(self.step, frame, data)
            except Exception as e:  # never break the user's job
                self._deferred = None
                say(f"WARNING: checkpoint at step {step} failed: {e!r}")
                self.jobdir.emit_event("checkpoint_failed", step=step, error=repr(e),
                                       rank=self.s.rank)
        if self._stopping:
            self._pending = None
            self._preemption.stop_now(self.step, lambda: self.checkpoint(self.step, frame, data))
        if persist_kill and self._verify is not None:
            self._snap.give_verdict()  # the rank waits from here on: it writes nothing
            self._verify.kill_after_handoff(self._snap.handed_off, step)
        if kill:
            self._marks.flush_beat()  # the supervisor's failure event names this step
            kill_self(f"injected crash: SIGKILL after step {step} (attempt {self.s.attempt})")

    def final_checkpoint(self) -> None:
        """At the script's normal end (the rank's atexit, every rank): a checkpoint of the last
        step, committed like any other before the process ends, so that the job's newest
        checkpoint is where the script ended (``cfrun export`` of a finished job gives its
        final weights; issue 27, item 2). No collective: each rank hands its shard to its
        node's agent, which commits the step once it has every rank's (the ranks end at the
        same step), so it works after ``dist.destroy_process_group()`` too.

        Not taken when the last step's checkpoint was already committed or resumed from (no
        duplicate), before any step, without checkpoints (FSDP, a CUDA graph), in ``cfrun
        profile`` or ``cfrun verify`` runs (they stop at a chosen step, checkpointed there),
        or when no optimizer is alive any more. It holds no script variable (their frames
        have ended) nor data position: it is marked ``final`` in its manifest, and a resume
        (``--rerun``) never starts from it (:func:`cfrun.codec.checkpoint.open_newest`).
        Rank 0 records the outcome in a ``final_checkpoint`` event, which ``cfrun export``
        cites (no ``checkpoint`` event: its wait at exit is no training stall; the agent's
        ``commit`` event is there). Waits at most :data:`FINAL_WAIT_S` for the commit; never
        raises.
        """
        step = self.step
        if (step <= 0 or self._off or self._uncheckpointable is not None or self.s.profile_only
                or self._verify is not None or self._resume.fast_forwarding):
            return
        outcome, error = "committed", None
        if step == self._last_taken:  # taken at the loop's end: let it commit first
            self._snap.wait_idle(FINAL_WAIT_S)
        if step in (self._restored_step, self._snap.last_committed):
            outcome = "already"
        elif not self._capture.found.optimizers():
            outcome, error = "none", "no optimizer was alive at the script's end"
        else:
            self._pending = None
            self._final_step = step
            try:
                handle = self.checkpoint(step, sys._getframe(), None, final=True)
                if not handle.wait(FINAL_WAIT_S):
                    outcome = "failed"
                    error = self._snap.last_error or f"not committed within {FINAL_WAIT_S:.0f} s"
            except Exception as e:
                outcome, error = "failed", repr(e)
            if outcome == "failed":
                say(f"WARNING: the final checkpoint of step {step} failed: {error}")
        self._note_final(step, outcome, error)

    def _note_final(self, step: int, outcome: str, error: str | None) -> None:
        """Rank 0: the ``final_checkpoint`` event (``outcome``: committed, already, none,
        failed, with ``error``)."""
        if self.s.rank == 0:
            extra = {"error": error} if error is not None else {}
            self.jobdir.emit_event("final_checkpoint", step=step, outcome=outcome,
                                   attempt=self.s.attempt, **extra)

    def checkpoint(self, step: int, frame: types.FrameType, data: dict[str, Any] | None,
                   *, final: bool = False) -> SnapshotHandle:
        """Take a checkpoint of step ``step``. Every rank calls it at the same boundary.

        Capture, snapshot into shared memory, hand off to the node's persist agent (two-phase;
        :mod:`cfrun.rank.snapshot`). The caller defers a checkpoint while the previous one is
        in flight (:meth:`_in_flight`); if this rank's is still in flight all the same (its
        commit reply is on the way, a preemption's final checkpoint, a fault point), it waits
        for it: at most one checkpoint is in flight. Returns the snapshot's handle. Raises
        what capture or the snapshot's start raise.
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
            "loop": self._loop.to_json() if self._loop else None,
            "outer_loops": [lp.to_json() for lp in self._outer_loops] if self._loop else [],
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
        self._taken(step)
        if self._stall is not None and self._stall[1] <= step < self._stall[2]:
            time.sleep(self._stall[0])
        if hold:  # the snapshot thread SIGKILLs the rank right after the hand-off
            self._snap.wait_idle()
        return handle

    # ---------------------------------------------------------------- one in flight

    def _in_flight(self, step: int) -> bool:
        """Whether the checkpoint due at the boundary after ``step`` is deferred because the
        previous one still counts as in flight (issue 23: waiting for it stalled the step,
        a median 2.0 s per checkpoint at ``--interval 20`` with 2.7-5.7 s persists on an H100).

        The rule must give every rank the same answer for the same step: ranks that checkpoint
        different steps leave each step incomplete, and the agent commits none of them. A
        rank's own "is my persist done" differs between ranks by when the agent's reply
        arrives (and it arrives at the commit, for every rank of the step). So with several
        ranks only rank 0 looks at its own: at the first step it sees the checkpoint over it
        publishes that step plus :data:`AGREE_LEAD_STEPS` (``checkpoint_gate.json``,
        :meth:`_note_idle`), and every rank, rank 0 too, counts the checkpoint as in flight
        before that step and as over from it. Ranks of a data-parallel job run within a step
        of each other (each step's gradient all-reduce), so all have read it by then; a rank
        whose own reply is not in yet at that step waits for it (:meth:`checkpoint`). With one
        rank there is nothing to agree on: in flight while its persist runs, and while the
        snapshot slot is still being page-locked ahead of the first checkpoint (CUDA state:
        :meth:`cfrun.rank.slot.SnapshotSlot.prepare`, 1-2 s for a 4.4 GB state on an H200,
        which the first checkpoint, the policy's warm-up probe at step 4, waited for).
        """
        if self.s.world_size == 1 and self._snap.slot.locking():
            return True  # the slot is being page-locked: a checkpoint now would wait for it
        if self._last_taken is None:
            return False
        if self.s.world_size == 1:
            return self._snap.busy()
        return self._idle_from is None or step < self._idle_from

    def _note_idle(self) -> None:
        """Several ranks, after each step while the last checkpoint counts as in flight: rank
        0, once it sees it over, publishes from which step every rank counts it so
        (:meth:`_in_flight`; a failed write is retried at the next step); the other ranks
        read that record at every step until they have it (a read costs tens of
        microseconds), so each has it a step after rank 0 wrote it, before rank 0 takes the
        next checkpoint and removes it."""
        if self._last_taken is None or self._idle_from is not None or self.s.world_size == 1:
            return
        path = co.checkpoint_gate_path(self.jobdir.root)
        if self.s.rank != 0:
            rec = co.read(path, co.CheckpointGate)
            if rec is not None and rec != self._stale_gate \
                    and rec.after_step == self._last_taken:
                self._idle_from = rec.idle_from_step
            return
        if self._snap.busy():
            return
        idle_from = self.step + AGREE_LEAD_STEPS
        try:
            co.write(path, co.CheckpointGate(
                attempt=self.s.attempt, after_step=self._last_taken, idle_from_step=idle_from))
        except OSError as e:
            say(f"WARNING: cannot write {co.CHECKPOINT_GATE} ({e}); checkpoints wait")
            return
        self._idle_from = idle_from

    def _defer(self, step: int) -> None:
        """The checkpoint due at ``step`` waits for the next boundary (the previous one is in
        flight): at most one checkpoint in flight (CheckFreq §4.3), and no step waits. Rank 0
        says so once, in a ``checkpoint_deferred`` event (a kill before it is taken then
        recomputes more than the interval: the event says why)."""
        if self._deferred is None:
            previous = self._last_taken if self._last_taken is not None else -1
            self._deferred = (step, previous)
            if self.s.rank == 0:
                self.jobdir.emit_event(
                    "checkpoint_deferred", due_step=step, in_flight_step=previous,
                    attempt=self.s.attempt,
                    waits_for="slot" if self._snap.slot.locking() else "persist")
        self._pending = (step, True, False)

    def _taken(self, step: int) -> None:
        """A checkpoint of ``step`` started: it is the one in flight now. When it was due
        earlier, its ``checkpoint`` event will say since when (``deferred_from``) and how many
        further due steps it stands for (``due_passed``)."""
        if self.s.rank == 0:
            fields: dict[str, Any] = {"progress": self._progress} if self._progress else {}
            if self._deferred is not None:
                fields.update(deferred_from=self._deferred[0], due_passed=self._due_passed)
            for older in list(self._ckpt_fields):  # list(): the snapshot thread pops too
                if older < step:  # a checkpoint that failed or was lost
                    self._ckpt_fields.pop(older, None)
            if fields:
                self._ckpt_fields[step] = fields
        self._deferred, self._due_passed = None, 0
        self._last_taken, self._idle_from = step, None
        if self.s.rank == 0 and self.s.world_size > 1:  # no record of an earlier run counts
            try:
                co.checkpoint_gate_path(self.jobdir.root).unlink(missing_ok=True)
            except OSError:
                pass  # its after_step is older than this checkpoint: no rank follows it

    def on_optimizer_created(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer was constructed (its ``__init__`` hook), one rank alone: start
        preparing the snapshot slot right away, sized from its parameters and the state its
        kind keeps per parameter (:data:`OPT_STATE_COPIES`), so the slot is ready even for a
        checkpoint due at the first step (``--interval 1``; issue 23). With several ranks
        the first step prepares it (DDP's 1/N shards are known then). Never raises."""
        if self._prepared or self.s.world_size != 1 or self._uncheckpointable is not None:
            return
        try:
            params = [p for g in opt.param_groups for p in g["params"]
                      if isinstance(p, torch.Tensor)]
            copies = OPT_STATE_COPIES.get(type(opt).__name__, 2)
            if type(opt).__name__ == "SGD" and not opt.defaults.get("momentum"):
                copies = 0
            nbytes = sum(p.numel() * p.element_size() for p in params) * (1 + copies)
            devices = sorted({p.device for p in params if p.is_cuda}, key=str)
            self._snap.prepare_bytes(nbytes, devices)
        except Exception as e:
            say(f"WARNING: could not prepare the snapshot slot ahead ({e!r})")

    def _prepare_slot(self) -> None:
        """At this process's first counted step (a fresh start or after a resume): prepare
        the snapshot slot for the models' and optimizers' state on a background thread
        (:meth:`Snapshotter.prepare`), so that the first checkpoint does not allocate and
        page-lock it on the training thread (issue 23). A failure only leaves that to the
        first checkpoint."""
        self._prepared = True
        self._capture.found.hold()  # for the final checkpoint (Discovery.hold)
        try:
            self._snap.prepare(self._capture.model_tensors())
        except Exception as e:
            say(f"WARNING: could not prepare the snapshot slot ahead ({e!r}); the first "
                "checkpoint allocates it")

    # ---------------------------------------------------------------- results (snapshot thread)

    def on_persisted(self, fields: dict[str, Any]) -> None:
        """A checkpoint committed: its figures go to the tuner (at the next step, on the
        training thread) and, from rank 0, to a ``checkpoint`` event; the final checkpoint's
        go to neither (training is over: its ``final_checkpoint`` event says how it went)."""
        if fields.get("step") == self._final_step:
            return
        self._done_records.append(fields)  # for the tuner, on the training thread
        if self.s.rank == 0:
            extra = self._ckpt_fields.pop(int(fields["step"]), {})
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


def _progress(loader: Any, batches: int, loop: F.LoopInfo | None, value: Any,
              frame: types.FrameType | None) -> dict[str, int] | None:
    """``{"done_batches", "total_batches"}`` of the training loader over the whole epoch loop,
    for ``cfrun status``'s ETA, when the loader has a length and the epoch loop is a
    ``for ... in range(...)`` cfrun can read (:func:`cfrun.rank.frames.range_of`); else None."""
    try:
        per_epoch = len(loader)
    except TypeError:
        return None
    if loop is None or frame is None or type(value) is not int or per_epoch <= 0:
        return None
    epochs = F.range_of(frame, loop)
    if epochs is None or value not in epochs:
        return None
    index = epochs.index(value)
    return {"done_batches": index * per_epoch + batches,
            "total_batches": len(epochs) * per_epoch}


def _parse_stall(spec: Any) -> tuple[float, int, int] | None:
    """Fault point ``rank.checkpoint_stall_s``: ``"SECONDS@FIRST-LAST"`` -> its three numbers."""
    if not spec:
        return None
    seconds, _, span = str(spec).partition("@")
    first, _, last = span.partition("-")
    return float(seconds), int(first), int(last)


def _ignore_calls(frame: types.FrameType, event: str, arg: Any) -> None:
    return None


def _is_for_header(frame: types.FrameType) -> bool:
    import ast

    tree = F._parse(os.path.realpath(frame.f_code.co_filename))
    if tree is None:
        return True
    return any(isinstance(n, ast.For) and n.lineno == frame.f_lineno for n in ast.walk(tree))
