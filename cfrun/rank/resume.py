"""Phase 6: resume. Bring a restarted script to the moment right after the checkpoint's step.

At install the rank chooses the newest verified checkpoint and starts reading its own shard on
a background thread (:mod:`cfrun.rank.resume_read`); the
script then runs from its first line, importing and building its model while the read goes on,
and cfrun fast-forwards it to the checkpoint's boundary, where it waits for the read
(README, "Resume semantics"):

* **step loops** (the checkpoint was taken at the head of the loop around
  ``optimizer.step()``): a tracer waits for the script to reach that loop head, restores
  everything there and cuts the loop's ``range()`` to the remaining iterations;
* **loader loops, jump** (the epoch loop is a ``for ... in range()`` or a ``while``): the epoch
  loop's head is reached the same way and jumps to the checkpoint's epoch; the training
  loader's next ``iter()`` restores the state and skips the consumed batches without loading
  them. Completed epochs never run again: no validation, saving or logging of theirs. A
  wrapper the loader is read through, the script's or a library's (timm's PrefetchLoader,
  Lightning Fabric's ``_FabricDataLoader``), gets its state back at that ``iter()``, which
  its ``__iter__`` makes: its prefetched batch, its own counters
  (:func:`cfrun.rank.frames.wrapper_state`), and the sampler's epoch
  (:func:`cfrun.rank.loader_epoch.sampler_state`);
* **loader loops, replay** (any other epoch loop, e.g. ``for epoch in epochs_list``): completed
  epochs run without loading data and with the script's output and ``torch.save`` suppressed,
  until the training loader's ``iter()`` of the checkpoint's epoch; the script's other
  epoch-end code (validation, its own saving and logging by other means) runs again, and cfrun
  says so. A training loader the script reads through a wrapper (a generator, a prefetcher
  that assumes one batch at least) yields one batch per replayed epoch instead of none; the
  steps taken on it are not counted.

The loop heads are reached in :mod:`cfrun.rank.resume_loops`, the training loader's ``iter()``
in :mod:`cfrun.rank.resume_loader`, the replayed epochs' output is held back in
:mod:`cfrun.rank.fast_forward`. Restoring (:mod:`cfrun.rank.restore`) first checks that the
checkpoint fits the live job (:func:`cfrun.codec.checkpoint.check_fits`: a mismatch stops the
job with exit 5, nothing changed), then loads models, optimizers, schedulers, scalers, RNG and
the script's variables into the live objects and frames, and hands the step count back to the
boundary phase.

A checkpoint that cannot be read, decoded or applied is unusable: at install every rank judges
the newest ones alike (:func:`cfrun.codec.checkpoint.check_usable`, with :func:`check_state`),
moves the bad ones aside and falls back to the same older one. Its own shard's bytes, which only
this rank reads, are judged by the background read: found corrupt, the checkpoint is moved aside
where the plan is first used, before anything of it reached the script, and the rank falls back
as at install, the other ranks having judged the same file at install. A failure only this
rank sees later (an I/O error, applying it) moves the checkpoint aside and restarts the attempt,
so that every rank falls back together (:mod:`cfrun.rank.resume_read`).
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable
from typing import Any, NoReturn

from cfrun.contract.jobdir import JobDir
from cfrun.rank import frames as F
from cfrun.rank import frameworks as FW
from cfrun.rank.adapters import hf as HF
from cfrun.rank.adapters import lightning as PL
from cfrun.rank.discovery import Discovery
from cfrun.rank.fast_forward import FastForward
from cfrun.rank.log import say
from cfrun.rank.restore import Restore, process_timing
from cfrun.rank.resume_loader import LoaderArrival
from cfrun.rank.resume_loops import LoopArrival
from cfrun.rank.resume_plan import ResumePlan, check_state
from cfrun.rank.resume_read import PlanRead, unusable
from cfrun.rank.rng import set_global_rng
from cfrun.rank.settings import RankSettings

__all__ = ["Resume", "ResumePlan", "check_state"]


class Resume:
    """Loads the plan at install and restores it when the script arrives: arms the arrival
    (:meth:`_prepare`), restores there (:meth:`_apply`) and hands the step count back. The
    read (:class:`PlanRead`), the arrival at loop heads (:class:`LoopArrival`) and at the
    training loader (:class:`LoaderArrival`), the restore (:class:`Restore`) and the
    fast-forward (:class:`FastForward`) keep their own. Training thread.

    Args:
        flag: reports a reason the resume may not be exact (:meth:`cfrun.rank.log.NotExact.flag`).
        fatal: stops the job for good (:meth:`cfrun.rank.preemption.Marks.fatal`).
        restored: called with the checkpoint's step and mode once the state is restored (the
            boundary phase counts on from there).
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir, found: Discovery,
                 flag: Callable[[str], None], fatal: Callable[[str], NoReturn],
                 restored: Callable[[int, str], None]) -> None:
        self.s = settings
        self.jobdir = jobdir
        self.found = found
        self._flag = flag
        self._fatal = fatal
        self._restored = restored
        self.resumed = False
        """True once the plan was restored into the live objects."""
        self.awaiting_loader = False
        """True between the jump to the checkpoint's epoch and the restore at its loader: an
        optimizer step then means the training loader is gone (:meth:`loader_missing`)."""
        self.agent_wait_s: float | None = None
        """Seconds the rank waited at start for the agent's earlier hand-off (the runtime's)."""
        self._read = PlanRead(settings, jobdir, fatal)
        self._ff = FastForward(jobdir.root / "ff_eval_run", settings.ff_eval)
        self._restore = Restore(jobdir, settings.script, found, fatal)
        self._loops = LoopArrival(settings.script, self._read, flag)
        self._loader = LoaderArrival(settings, found, self._read, self._ff, self._apply,
                                     lambda: self.resumed, flag, fatal)
        self.on_loader_iter = self._loader.on_loader_iter
        """The DataLoader ``iter()`` hook (:meth:`LoaderArrival.on_loader_iter`; bound here
        without a frame in between: it finds the caller of ``iter()`` by its depth)."""

    @property
    def plan(self) -> ResumePlan | None:
        """The checkpoint to resume from, if any (:attr:`PlanRead.plan`)."""
        return self._read.plan

    @property
    def fast_forwarding(self) -> bool:
        """True while completed epochs run without data (output suppressed)."""
        return self._ff.active

    @property
    def ff_eval(self) -> str:
        """How evaluation loaders run while fast-forwarding (:attr:`FastForward.ff_eval`)."""
        return self._ff.ff_eval

    @property
    def fixing_enumerate(self) -> bool:
        """True until the first ``next()`` on the restored loader iterator (:meth:`on_next`)."""
        return self._loader.fixing_enumerate

    # ---------------------------------------------------------------- at install

    def load_plan(self) -> None:
        """Find the newest usable checkpoint and prepare to fast-forward to it; this rank's
        tensors are read on a background thread meanwhile (:meth:`PlanRead.load`), and taken
        where the plan is first used. A failure while preparing the plan makes the
        checkpoint unusable (:func:`cfrun.rank.resume_read.unusable`)."""
        plan = self._read.load()
        if plan is None:
            return
        try:
            self._prepare(plan)
        except Exception as e:
            unusable(self.jobdir, plan.step, e)

    def _prepare(self, plan: ResumePlan) -> None:
        """Arm the arrival at the plan's boundary (step loop head, epoch loop head or the
        training loader's ``iter()``)."""
        self._read.plan = plan
        state, meta = plan.state, plan.meta
        say(f"resuming from checkpoint step {plan.step}")
        if plan.resharded:
            self._say_resharded(plan)
        if plan.mode == "loop":
            loop = F.LoopInfo.from_json(meta["loop"]) if meta.get("loop") else None
            if loop is None or sys.gettrace() is not None:
                self._flag("the checkpoint has no loop position (or a tracer is active); "
                           "the step loop restarts")
                return
            outer = [F.LoopInfo.from_json(d) for d in meta.get("outer_loops") or []]
            self._loops.arm_chain(outer + [loop], self._arrive_step_loop)
            return
        data = state["data"]
        if isinstance(data.get("hf"), dict):  # transformers.Trainer's own loop resumes itself
            self._loader.kind = "hf"
            HF.arm(data["hf"], lambda frame: self._apply(plan, frame, in_tracer=False),
                   lambda: set_global_rng(plan.state["rng"]))
            return
        if isinstance(data.get("lightning"), dict):  # Lightning's fit loop: its own resume path
            PL.arm(data["lightning"])  # restores the loops; the training loader's iter() the rest
            self._loader.kind, self._loader.jumped = "jump", True
            return
        epoch_loop = F.LoopInfo.from_json(data["epoch_loop"]) if data.get("epoch_loop") else None
        if epoch_loop is not None and epoch_loop.kind in ("for_range", "for_iter", "while") \
                and sys.gettrace() is None:
            self._loader.kind = "jump"
            self._loops.arm(epoch_loop, self._arrive_epoch_loop)
        else:
            self._loader.kind = "replay"

    def _say_resharded(self, plan: ResumePlan) -> None:
        """The one line and the ``resharded`` event (rank 0) of a resume on another world size
        (``--reshard``, :mod:`cfrun.codec.reshard`)."""
        info = plan.meta["resharded"]
        if self.s.rank == 0:
            say(f"WARNING: resharding checkpoint step {plan.step} from {info['from']} to "
                f"{info['to']} ranks (--reshard): not bit-exact; replicated state from old "
                f"rank r % {info['from']}, sharded state cut to the new mesh, the data position "
                "mapped by global samples")
            self.jobdir.emit_event("resharded", step=plan.step, attempt=self.s.attempt,
                                   from_world_size=info["from"], to_world_size=info["to"])
        self._flag(f"resharded from {info['from']} to {info['to']} ranks (--reshard)")

    # ---------------------------------------------------------------- DataLoader hooks

    def on_next(self, it: Any, caller: types.FrameType) -> None:
        """Before a ``next()`` while :attr:`fixing_enumerate` (:meth:`LoaderArrival.on_next`)."""
        self._loader.on_next(it, caller)

    def loader_missing(self) -> NoReturn:
        """An optimizer step after the jump to the checkpoint's epoch, before the training
        loader's ``iter()``: the checkpoint's loader is not in this run. Stops the job."""
        self._loader.loader_missing()

    # ---------------------------------------------------------------- arrival at a loop head

    def _arrive_step_loop(self, frame: types.FrameType, loop: F.LoopInfo) -> None:
        plan = self._read.plan
        assert plan is not None
        self._resume_held_iterator(plan, frame)
        self._apply(plan, frame, in_tracer=True)
        if loop.kind == "for_other":
            self._flag("the loop around optimizer.step() is a for loop over something "
                       "other than range(); its position restarts")
        else:
            self._loops.jump(frame, loop, inclusive=False)

    def _resume_held_iterator(self, plan: ResumePlan, frame: types.FrameType) -> None:
        """A step loop drawing with next() from a held iterator: put the iterator of the
        checkpoint's epoch and position into the script's variable (before the RNG is
        restored; :func:`cfrun.rank.frameworks.resume_held_iterator`), or stop (exit 5)."""
        data = plan.state.get("data")
        if isinstance(data, dict) and data.get("held"):
            why = FW.resume_held_iterator(data, frame, self.s.script)
            if why is not None:
                self._fatal(f"the training DataLoader iterator of checkpoint step {plan.step} "
                            f"{why}; resume with the same script and arguments, or a new "
                            "--job-dir")

    def _arrive_epoch_loop(self, frame: types.FrameType, loop: F.LoopInfo) -> None:
        """Jump the epoch loop to the checkpoint's epoch; skipped epochs never run."""
        plan = self._read.plan
        assert plan is not None
        data = plan.state["data"]
        records = [r for r in plan.state["script"] if r["code"] == loop.code]
        F.restore_frames(records, records, [frame], in_tracer=True,
                         keep_invariants=plan.resharded)
        self._loops.jump(frame, loop, inclusive=True, value=data.get("epoch_value"))
        self._loader.jumped = True
        self.awaiting_loader = not self.resumed
        say(f"jumped to epoch index {data.get('epoch_value')} of the epoch loop "
            f"(line {loop.header_line}); completed epochs are not run again")

    # ---------------------------------------------------------------- restore

    def _apply(self, plan: ResumePlan, frame: types.FrameType, *, in_tracer: bool,
               wrapper_caller: types.FrameType | None = None) -> None:
        """Load the checkpoint into the live objects, RNG and script frames
        (:meth:`Restore.apply`), count on from its step and say so (the ``resumed`` event)."""
        self._read.await_read()  # done where the plan was first used: nothing to wait for here
        restore_start = time.monotonic()
        restored = self._restore.apply(plan, frame, in_tracer=in_tracer,
                                       wrapper_caller=wrapper_caller)
        self._restored(plan.step, plan.mode)
        self.resumed = True
        self.awaiting_loader = False
        self.exit_fast_forward()
        say(f"resumed at step {plan.step} ({len(restored)} script variables restored)")
        self.jobdir.emit_event("resumed", step=plan.step, attempt=self.s.attempt,
                               rank=self.s.rank, variables=sorted(restored),
                               **self._timing(time.monotonic() - restore_start))

    def _timing(self, restore_s: float) -> dict[str, float]:
        """The ``resumed`` event's breakdown (bench/recovery.py, ``cfrun status``): when this
        process started (unix s), the seconds it waited for the agent at start
        (``agent_wait_s``), the read's (:meth:`PlanRead.timing`), and ``restore_s``, the
        seconds spent putting the state into the live objects."""
        out = {"restore_s": round(restore_s, 4), **process_timing()}
        if self.agent_wait_s is not None:
            out["agent_wait_s"] = round(self.agent_wait_s, 4)
        out.update(self._read.timing())
        return out

    # ---------------------------------------------------------------- fast-forward

    def enter_fast_forward(self, epochs: int, *, one_batch: bool = False) -> None:
        """Suppress the script's output while ``epochs`` completed epochs run without data
        (:meth:`FastForward.enter`)."""
        self._ff.enter(epochs, one_batch=one_batch)

    def exit_fast_forward(self) -> None:
        """Give the script its stdout and warnings back (idempotent)."""
        self._ff.exit()

    def on_script_failed(self) -> None:
        """The excepthook (:meth:`FastForward.on_script_failed`)."""
        self._ff.on_script_failed()

    def warn_if_not_restored(self) -> None:
        """At exit: say so if the script ended before it reached the checkpoint."""
        if self._read.plan is not None and not self.resumed:
            say(f"WARNING: the script ended before reaching checkpoint step "
                f"{self._read.plan.step}; it was not restored")
