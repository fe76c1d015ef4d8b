"""Phase 6: resume. Bring a restarted script to the moment right after the checkpoint's step.

At install the rank loads the newest verified checkpoint (:meth:`Resume.load_plan`); the script
then runs from its first line, and cfrun fast-forwards it to the checkpoint's boundary
(README, "Resume semantics"):

* **step loops** (the checkpoint was taken at the head of the loop around
  ``optimizer.step()``): a tracer waits for the script to reach that loop head, restores
  everything there and cuts the loop's ``range()`` to the remaining iterations;
* **loader loops, jump** (the epoch loop is a ``for ... in range()`` or a ``while``): the epoch
  loop's head is reached the same way and jumps to the checkpoint's epoch; the training
  loader's next ``iter()`` restores the state and skips the consumed batches without loading
  them;
* **loader loops, replay** (any other epoch loop): completed epochs run without loading data and
  with the script's output suppressed, until the training loader's ``iter()`` of the
  checkpoint's epoch.

Restoring (:meth:`Resume._apply`) first checks that the checkpoint fits the live job
(:func:`cfrun.codec.checkpoint.check_fits`: a mismatch stops the job with exit 5, nothing
changed), then loads models, optimizers, schedulers, scalers, RNG and the script's variables into
the live objects and frames, and hands the step count back to the boundary phase.

A checkpoint that cannot be read, decoded or applied is unusable: at install every rank judges
the newest ones alike (:func:`cfrun.codec.checkpoint.check_usable`, with :func:`check_state`),
moves the bad ones aside and falls back to the same older one; a failure only this rank sees
later (its own shard, or applying it) moves the checkpoint aside and restarts the attempt
(:meth:`Resume._unusable`), so that every rank falls back together.
"""

from __future__ import annotations

import io
import itertools
import os
import sys
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from cfrun.codec.checkpoint import (
    CORRUPT,
    INCOMPATIBLE,
    JobMismatchError,
    RankLoadError,
    WorldSizeChangedError,
    check_fits,
    load_newest,
    quarantine,
)
from cfrun.contract.errors import IncompatibleFormatError
from cfrun.contract.jobdir import JobDir, step_dir_name
from cfrun.rank import frames as F
from cfrun.rank import frameworks as FW
from cfrun.rank.data import loader_fingerprint, set_epoch_rng
from cfrun.rank.discovery import Discovery
from cfrun.rank.log import say
from cfrun.rank.rng import set_global_rng
from cfrun.rank.settings import RankSettings


@dataclass
class ResumePlan:
    """The newest verified checkpoint and where the script must arrive to restore it."""

    step: int
    state: dict[str, Any]
    meta: dict[str, Any]

    @property
    def mode(self) -> str:
        return str(self.meta.get("mode", "loader"))


def check_state(state: Any, meta: dict[str, Any]) -> None:
    """What the resume will look up in a rank's decoded state is there, with its type.

    Called by every rank for every rank's tree of a checkpoint before any rank loads it
    (:func:`cfrun.codec.checkpoint.check_usable`, tensors on the ``meta`` device), so that a
    tree that would fail later (a missing key, a list where a dict belongs, a loop position that
    does not parse) is judged corrupt by all ranks alike, and all fall back together.

    Raises:
        ValueError, KeyError, TypeError: the first thing missing or of another type.
    """
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"the checkpoint's {what}")

    need(isinstance(state, dict), "state is not an object")
    for key in ("modules", "optimizers", "opt_steps", "schedulers", "scalers", "script"):
        need(isinstance(state.get(key), list), f"{key} is not a list")
    need(all(isinstance(m, dict) for m in state["modules"]), "model states are not objects")
    for o in state["optimizers"]:
        need(isinstance(o, dict) and isinstance(o.get("state"), dict)
             and isinstance(o.get("param_groups"), list)
             and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                     for g in o["param_groups"]), "optimizer state is not a state_dict")
    need(len(state["opt_steps"]) == len(state["optimizers"])
         and all(type(n) is int for n in state["opt_steps"]), "optimizer step counts")
    rng = state.get("rng")
    need(isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor)
         and rng["torch"].dtype == torch.uint8 and isinstance(rng.get("random"), (list, tuple))
         and len(rng["random"]) == 3, "RNG state is not one cfrun writes")
    for rec in state["script"]:
        need(isinstance(rec, dict) and isinstance(rec.get("code"), list)
             and isinstance(rec.get("values"), dict)
             and all(isinstance(v, dict) and "kind" in v and "v" in v
                     for v in rec["values"].values()), "script variables")
    if str(meta.get("mode", "loader")) == "loop":
        if meta.get("loop"):
            F.LoopInfo.from_json(meta["loop"])
        if state.get("data") is None:  # else a held iterator's position (cfrun.rank.frameworks)
            return
    data = state.get("data")
    need(isinstance(data, dict), "data loader position is missing")
    need(isinstance(data.get("fingerprint"), dict), "loader fingerprint is missing")
    for key in ("loader", "iter_index", "batches"):
        need(type(data.get(key)) is int, f"loader position has no integer {key}")
    need(isinstance(data.get("epoch_rng"), dict) and isinstance(data["epoch_rng"].get("global"),
                                                                dict), "epoch RNG state")
    if data.get("epoch_loop"):
        F.LoopInfo.from_json(data["epoch_loop"])


class _NullWriter(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


class Resume:
    """Loads the plan at install and restores it when the script arrives. Training thread.

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
        self.plan: ResumePlan | None = None
        self.resumed = False
        """True once the plan was restored into the live objects."""
        self.fast_forwarding = False
        """True while completed epochs run without data (output suppressed)."""
        self.awaiting_loader = False
        """True between the jump to the checkpoint's epoch and the restore at its loader: an
        optimizer step then means the training loader is gone (:meth:`loader_missing`)."""
        self.fixing_enumerate = False
        """True until the first ``next()`` on the restored loader iterator (:meth:`on_next`)."""
        self._enum_fix: tuple[weakref.ref[Any], int] | None = None
        self._kind = "replay"
        self._jumped = False
        self._saved_stdout: Any = None
        self._warn_filters: Any = None
        self._ff_fallback_path = self.jobdir.root / "ff_eval_run"
        self.ff_eval = "run" if self._ff_fallback_path.exists() else settings.ff_eval

    # ---------------------------------------------------------------- at install

    def load_plan(self) -> None:
        """Find the newest usable checkpoint and prepare to fast-forward to it.

        Unusable ones are moved aside on the way (rank 0 says so, once each); a failure of this
        rank's own shard, or while preparing the plan, goes to :meth:`_unusable`.
        """
        def skipped(step: int, error: Exception) -> None:  # one rank: the one that moved it
            reason = INCOMPATIBLE if isinstance(error, IncompatibleFormatError) else CORRUPT
            say(f"WARNING: checkpoint step {step} failed verification ({error}); moved aside "
                f"as {reason}-{step_dir_name(step)}-*, falling back to the previous one")
            self.jobdir.emit_event("checkpoint_corrupt", step=step, error=str(error))

        try:
            got = load_newest(self.jobdir.checkpoints, self.s.rank, on_skip=skipped,
                              world_size=self.s.world_size, check_state=check_state)
        except WorldSizeChangedError as e:
            self._fatal(f"{e}; run with the same --nnodes x --nproc-per-node ({e.saved} ranks), "
                        "or start a new --job-dir (the checkpoints are kept)")
        except RankLoadError as e:
            self._unusable(e.step, e)
        if got is None:
            return
        step, state, meta = got
        try:
            self._prepare(ResumePlan(step, state, meta))
        except Exception as e:
            self._unusable(step, e)

    def _prepare(self, plan: ResumePlan) -> None:
        """Arm the arrival at the plan's boundary (step loop head, epoch loop head or the
        training loader's ``iter()``)."""
        self.plan = plan
        state, meta = plan.state, plan.meta
        say(f"resuming from checkpoint step {plan.step}")
        if self.plan.mode == "loop":
            loop = F.LoopInfo.from_json(meta["loop"]) if meta.get("loop") else None
            if loop is None or sys.gettrace() is not None:
                self._flag("the checkpoint has no loop position (or a tracer is active); "
                           "the step loop restarts")
                return
            self._arm_loop_resume(loop, self._arrive_step_loop)
            return
        data = state["data"]
        epoch_loop = F.LoopInfo.from_json(data["epoch_loop"]) if data.get("epoch_loop") else None
        if epoch_loop is not None and epoch_loop.kind in ("for_range", "while") \
                and sys.gettrace() is None:
            self._kind = "jump"
            self._arm_loop_resume(epoch_loop, self._arrive_epoch_loop)
        else:
            self._kind = "replay"

    def _unusable(self, step: int, error: BaseException) -> NoReturn:
        """This rank could not read or apply checkpoint ``step`` after every rank's checks
        passed (the others may have loaded it, and this rank's objects may hold part of it):
        move it aside (``corrupt-step-…``), say why once, and end this rank so that the
        supervisor restarts the attempt, in which every rank falls back to the previous good
        checkpoint. Training thread."""
        sys.settrace(None)
        moved = quarantine(self.jobdir.checkpoints, step, CORRUPT)
        where = moved.name if moved is not None else "already moved aside"
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        say(f"WARNING: checkpoint step {step} could not be restored ({detail[:300]}); "
            f"moved aside ({where}); restarting the attempt to resume from the previous one")
        try:
            self.jobdir.emit_event("checkpoint_corrupt", step=step, error=detail[:300])
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(1)

    # ---------------------------------------------------------------- DataLoader hooks

    def on_loader_iter(self, loader: Any, n: int, start: Callable[[], Any]) -> Any:
        """Called for ``iter(loader)``; ``n`` counts earlier ``iter()`` calls on this loader;
        ``start()`` starts the epoch as without cfrun (:mod:`cfrun.rank.data`)."""
        plan = self.plan
        if plan is not None and not self.resumed and plan.mode == "loader" \
                and self._kind == "jump":
            saved = plan.state["data"]["fingerprint"]
            got = loader_fingerprint(loader)
            if self._jumped and got == saved:
                return self._resume_at_loader(loader, n, sys._getframe(2), start)
            if self._jumped and loader._cfrun_ordinal == plan.state["data"]["loader"] and (
                    got["dataset_len"] == saved["dataset_len"]
                    or got["batch_size"] == saved["batch_size"]):
                self._loader_changed(saved, got)
        elif plan is not None and not self.resumed and plan.mode == "loader":
            data = plan.state["data"]
            if loader._cfrun_ordinal == data["loader"]:
                if loader_fingerprint(loader) != data["fingerprint"]:
                    self._loader_changed(data["fingerprint"], loader_fingerprint(loader))
                if n < data["iter_index"]:
                    self.enter_fast_forward(data["iter_index"])
                    return iter(())
                if n == data["iter_index"]:
                    return self._resume_at_loader(loader, n, sys._getframe(2), start)
            elif self.fast_forwarding and self.ff_eval == "one":
                it = start()  # one batch: cheap, and no division by an empty count
                it._cfrun_iter_index = n
                return itertools.islice(it, 1)
        it = start()
        it._cfrun_iter_index = n
        return it

    def on_next(self, it: Any) -> None:
        """Before a ``next()`` while :attr:`fixing_enumerate`: the first one on the restored
        iterator moves the script's ``enumerate()`` counter to the batches already consumed."""
        if self._enum_fix is not None and self._enum_fix[0]() is it:
            consumed = self._enum_fix[1]
            self._enum_fix = None
            self.fixing_enumerate = False
            if consumed:  # False when no enumerate() wraps the loader: nothing to fix
                F.fix_enumerate(it, consumed)

    def loader_missing(self) -> NoReturn:
        """An optimizer step after the jump to the checkpoint's epoch, before the training
        loader's ``iter()``: the checkpoint's loader is not in this run. Stops the job."""
        assert self.plan is not None
        self._loader_changed(self.plan.state["data"]["fingerprint"], None)

    def _loader_changed(self, saved: dict[str, Any] | None,
                        got: dict[str, Any] | None) -> NoReturn:
        """Stop (exit 5): the checkpoint's training DataLoader is not in this run."""
        if got is None:
            what = "was not iterated in the checkpoint's epoch before an optimizer step"
        else:
            what = "changed: " + ", ".join(
                f"{k} {saved.get(k)} -> {v}" for k, v in got.items()
                if saved is not None and saved.get(k) != v)
        step = self.plan.step if self.plan is not None else "?"
        self._fatal(f"the training DataLoader of checkpoint step {step} {what}; resume with the "
                    "same script and arguments, or a new --job-dir")

    def _resume_at_loader(self, loader: Any, n: int, caller: types.FrameType,
                          start: Callable[[], Any]) -> Any:
        plan = self.plan
        assert plan is not None
        data = plan.state["data"]
        set_epoch_rng(loader, data["epoch_rng"])
        n = data["iter_index"]  # epochs keep their numbers after a jump
        object.__setattr__(loader, "_cfrun_iter_calls", n + 1)
        loader.__dict__["_cfrun_skip"] = data["batches"]
        loader.__dict__["_cfrun_skip_done"] = data["batches"]
        it = start()
        it._cfrun_iter_index = n
        self._apply(plan, caller, in_tracer=False)
        self._enum_fix = (weakref.ref(it), data["batches"])
        self.fixing_enumerate = True
        return it

    # ---------------------------------------------------------------- arrival at a loop head

    def _arm_loop_resume(self, loop: F.LoopInfo,
                         arrive: Callable[[types.FrameType, F.LoopInfo], None]) -> None:
        """Call ``arrive(frame, loop)`` when the script first reaches the head of ``loop``.

        Uses ``sys.settrace`` until then: the global tracer only looks at the code object of
        new frames and hands line events of the one matching function to a local tracer.
        """
        key = tuple(loop.code)
        targets = (loop.header_line, loop.body_line)

        def local(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno in targets:
                sys.settrace(None)
                frame.f_trace = None
                try:
                    arrive(frame, loop)
                except Exception as e:
                    assert self.plan is not None
                    self._unusable(self.plan.step, e)
                return None
            return local

        def global_tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
            code = frame.f_code
            if event == "call" and code.co_name == key[1] and code.co_firstlineno == key[2] \
                    and os.path.realpath(code.co_filename) == key[0]:
                return local
            return None

        sys.settrace(global_tracer)
        f: types.FrameType | None = sys._getframe()
        while f is not None:  # a loop at module level: its frame is already running
            code = f.f_code
            if code.co_name == key[1] and code.co_firstlineno == key[2] \
                    and os.path.realpath(code.co_filename) == key[0]:
                f.f_trace = local
                f.f_trace_lines = True
            f = f.f_back

    def _arrive_step_loop(self, frame: types.FrameType, loop: F.LoopInfo) -> None:
        assert self.plan is not None
        self._resume_held_iterator(self.plan, frame)
        self._apply(self.plan, frame, in_tracer=True)
        if loop.kind == "for_range":
            done = self._saved_value(loop)
            self._install_range_shim(frame, lambda r: r[r.index(done) + 1:]
                                     if done in r else None)
        elif loop.kind == "for_other":
            self._flag("the loop around optimizer.step() is a for loop over something "
                       "other than range(); its position restarts")

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
        assert self.plan is not None
        data = self.plan.state["data"]
        records = [r for r in self.plan.state["script"] if r["code"] == loop.code]
        F.restore_frames(records, records, [frame], in_tracer=True)
        if loop.kind == "for_range":
            epoch = data["epoch_value"]
            self._install_range_shim(frame, lambda r: r[r.index(epoch):] if epoch in r else None)
        self._jumped = True
        self.awaiting_loader = not self.resumed
        say(f"jumped to epoch index {data.get('epoch_value')} of the epoch loop "
            f"(line {loop.header_line}); completed epochs are not run again")

    def _saved_value(self, loop: F.LoopInfo) -> Any:
        assert self.plan is not None
        for rec in self.plan.state["script"]:
            if rec["code"] == loop.code and loop.target in rec["values"]:
                return rec["values"][loop.target]["v"]
        return None

    def _install_range_shim(self, frame: types.FrameType,
                            cut: Callable[[range], range | None]) -> None:
        """Make the next ``range(...)`` call in ``frame``'s module return ``cut(range(...))``.

        Installed at the loop head before its ``range(...)`` is evaluated; removes itself on
        first use. If ``cut`` returns ``None`` (the saved value is not in the range), the loop
        runs unchanged and the resume is flagged.
        """
        import builtins

        g = frame.f_globals
        if "range" in g:
            self._flag("the script defines its own range(); the loop position restarts")
            return

        def range_shim(*args: int) -> range:
            g.pop("range", None)
            r = builtins.range(*args)
            got = cut(r)
            if got is None:
                self._flag("the loop's range() changed since the checkpoint")
                return r
            return got

        g["range"] = range_shim

    # ---------------------------------------------------------------- restore

    def _apply(self, plan: ResumePlan, frame: types.FrameType, *, in_tracer: bool) -> None:
        """Load the checkpoint into the live objects, RNG and script frames."""
        st = plan.state
        roots = self.found.model_roots()
        opts = self.found.optimizers()
        schedulers, scalers = self.found.schedulers(), self.found.scalers()
        try:  # before anything is applied: a checksum cannot tell a changed layer width
            check_fits(st, roots, opts, schedulers, scalers)
        except JobMismatchError as e:
            self._fatal(f"checkpoint step {plan.step} does not fit this job: {e}; to go on, "
                        "start a new --job-dir (the checkpoints are kept), or restore the "
                        "script and model the checkpoint was written with and resume")
        try:
            restored = self._load(plan, frame, roots, opts, schedulers, scalers,
                                  in_tracer=in_tracer)
        except Exception as e:  # part of it may be in the live objects: restart
            self._unusable(plan.step, e)
        self._restored(plan.step, plan.mode)
        self.resumed = True
        self.awaiting_loader = False
        self.exit_fast_forward()
        say(f"resumed at step {plan.step} ({len(restored)} script variables restored)")
        self.jobdir.emit_event("resumed", step=plan.step, attempt=self.s.attempt,
                               rank=self.s.rank, variables=sorted(restored))

    def _load(self, plan: ResumePlan, frame: types.FrameType, roots: list[Any],
              opts: list[Any], schedulers: list[Any], scalers: list[Any], *,
              in_tracer: bool) -> list[str]:
        """Put the checked state into the live objects, RNG and frames; returns the script
        variables restored."""
        st = plan.state
        with torch.no_grad():
            for m, sd in zip(roots, st["modules"]):
                m.load_state_dict(sd)
        for o, sd, count in zip(opts, st["optimizers"], st["opt_steps"]):
            o.load_state_dict(sd)
            o.__dict__["_cfrun_steps"] = count
        for objs, sds in ((schedulers, st["schedulers"]), (scalers, st["scalers"])):
            for obj, sd in zip(objs, sds):
                if sd is not None:
                    obj.load_state_dict(sd)
        set_global_rng(st["rng"])
        return F.restore_frames(st["script"], st["script"],
                                F.script_frames(frame, self.s.script), in_tracer=in_tracer)

    # ---------------------------------------------------------------- fast-forward

    def enter_fast_forward(self, epochs: int) -> None:
        """Suppress the script's output while ``epochs`` completed epochs run without data."""
        if self.fast_forwarding:
            return
        self.fast_forwarding = True
        say(f"fast-forwarding {epochs} completed epoch(s) without loading data "
            "(script output suppressed until the resume point)")
        self._saved_stdout = sys.stdout
        sys.stdout = _NullWriter()
        self._warn_filters = warnings.filters[:]
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")

    def exit_fast_forward(self) -> None:
        """Give the script its stdout and warnings back (idempotent)."""
        if self.fast_forwarding:
            self.fast_forwarding = False
            if self._saved_stdout is not None:
                sys.stdout = self._saved_stdout
                self._saved_stdout = None
                warnings.filters[:] = self._warn_filters  # type: ignore[index]

    def on_script_failed(self) -> None:
        """The excepthook: a script that breaks while fast-forwarding with evaluation loaders cut
        to one batch gets them in full in the next attempt (the ``ff_eval_run`` file)."""
        if self.fast_forwarding and self.ff_eval == "one":
            self.exit_fast_forward()
            say("the script failed while fast-forwarding with evaluation loaders cut to one "
                "batch; the next attempt runs them in full (fallback)")
            self._ff_fallback_path.touch()

    def warn_if_not_restored(self) -> None:
        """At exit: say so if the script ended before it reached the checkpoint."""
        if self.plan is not None and not self.resumed:
            say(f"WARNING: the script ended before reaching checkpoint step {self.plan.step}; "
                "it was not restored")
