"""Phase 6: resume. Bring a restarted script to the moment right after the checkpoint's step.

At install the rank chooses the newest verified checkpoint and starts reading its own shard on
a background thread (:meth:`Resume.load_plan`, :class:`cfrun.codec.checkpoint.ShardRead`); the
script then runs from its first line, importing and building its model while the read goes on,
and cfrun fast-forwards it to the checkpoint's boundary, where it waits for the read
(:meth:`Resume._await_read`; README, "Resume semantics"):

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
  (:func:`cfrun.rank.data.sampler_state`);
* **loader loops, replay** (any other epoch loop, e.g. ``for epoch in epochs_list``): completed
  epochs run without loading data and with the script's output and ``torch.save`` suppressed,
  until the training loader's ``iter()`` of the checkpoint's epoch; the script's other
  epoch-end code (validation, its own saving and logging by other means) runs again, and cfrun
  says so. A training loader the script reads through a wrapper (a generator, a prefetcher
  that assumes one batch at least) yields one batch per replayed epoch instead of none; the
  steps taken on it are not counted.

Restoring (:meth:`Resume._apply`) first checks that the checkpoint fits the live job
(:func:`cfrun.codec.checkpoint.check_fits`: a mismatch stops the job with exit 5, nothing
changed), then loads models, optimizers, schedulers, scalers, RNG and the script's variables into
the live objects and frames, and hands the step count back to the boundary phase.

A checkpoint that cannot be read, decoded or applied is unusable: at install every rank judges
the newest ones alike (:func:`cfrun.codec.checkpoint.check_usable`, with :func:`check_state`),
moves the bad ones aside and falls back to the same older one. Its own shard's bytes, which only
this rank reads, are judged by the background read: found corrupt, the checkpoint is moved aside
where the plan is first used, before anything of it reached the script, and the rank falls back
as at install (:meth:`Resume._fall_back`), the other ranks having judged the same file at
install. A failure only this rank sees later (an I/O error, applying it) moves the checkpoint
aside and restarts the attempt (:meth:`Resume._unusable`), so that every rank falls back
together.
"""

from __future__ import annotations

import io
import itertools
import os
import sys
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from cfrun.codec import reshard as RS
from cfrun.codec.checkpoint import (
    CORRUPT,
    INCOMPATIBLE,
    JobMismatchError,
    RankLoadError,
    ShardRead,
    WorldSizeChangedError,
    check_fits,
    check_free_params,
    open_newest,
    quarantine,
    skip_checkpoint,
)
from cfrun.codec.dtensor import (
    MeshMismatchError,
    dtensor_class,
    has_shards,
    live_meshes,
    to_dtensors,
)
from cfrun.contract.config import reshard_refusal
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.jobdir import JobDir, step_dir_name
from cfrun.contract.manifest import ManifestKeys
from cfrun.rank import frames as F
from cfrun.rank import frameworks as FW
from cfrun.rank.adapters import hf as HF
from cfrun.rank.adapters import lightning as PL
from cfrun.rank.aliases import AliasIndex
from cfrun.rank.capture import free_params, scaler_numbers
from cfrun.rank.data import (
    loader_fingerprint,
    sampler_state,
    set_carried_state,
    set_epoch_rng,
    set_sampler_state,
)
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

    @property
    def resharded(self) -> bool:
        """Read from a checkpoint of another world size (``--reshard``)."""
        return isinstance(self.meta.get("resharded"), dict)


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
    free = state.get("free_params", [])  # absent in checkpoints of an older cfrun
    need(isinstance(free, list) and all(
        isinstance(per, list) and all(isinstance(i, dict) and type(i.get("index")) is int
                                      and isinstance(i.get("value"), torch.Tensor) for i in per)
        for per in free), "free parameters (master weights) are not a list of index/value")
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
        need(isinstance(meta.get("outer_loops") or [], list), "outer loops are not a list")
        for d in meta.get("outer_loops") or []:
            F.LoopInfo.from_json(d)
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
    wrappers = data.get("wrappers") or []  # absent in checkpoints of an older cfrun
    need(isinstance(wrappers, list) and all(
        isinstance(w, dict) and isinstance(w.get("code"), list)
        and isinstance(w.get("values"), dict) and isinstance(w.get("attrs", {}), dict)
        and all(isinstance(v, dict) and "kind" in v and "v" in v for v in w["values"].values())
        for w in wrappers), "loader wrapper state")
    sampler = data.get("sampler") or []
    need(isinstance(sampler, list) and all(isinstance(d, dict) for d in sampler),
         "sampler state")


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
        self._enum_fix: tuple[weakref.ref[Any], int | None, int] | None = None
        """(restored loader iterator, the enumerate count at the checkpoint, batches consumed)"""
        self._kind = "replay"
        self._jumped = False
        self._wrapper_caller: types.FrameType | None = None
        """The frame that called the training DataLoader's ``iter()`` of the resumed epoch (a
        library wrapper's, whose state :meth:`_load` puts back), between that call and
        :meth:`_apply`."""
        self._saved_stdout: Any = None
        self._warn_filters: Any = None
        self._ff_fallback_path = self.jobdir.root / "ff_eval_run"
        self.ff_eval = "run" if self._ff_fallback_path.exists() else settings.ff_eval
        self._read_timing: tuple[float, float] | None = None
        """(unix time the checkpoint read began, its seconds to the end of the background
        read): the ``resumed`` event's."""
        self._read_sync_s = 0.0
        """Seconds the read held the script at install (choosing the checkpoint, its JSON)."""
        self._read_wait_s = 0.0
        """Seconds the script waited for the background read where the plan is first used."""
        self._reading: ShardRead | None = None
        """This rank's read of the plan's shard until :meth:`_await_read` took it."""
        self._on_skip: Callable[[int, Exception], None] | None = None
        self._refused_said: set[int] = set()
        """Steps refused as not the job's (:func:`open_newest`'s ``on_refused``) already said."""
        self.agent_wait_s: float | None = None
        """Seconds the rank waited at start for the agent's earlier hand-off (the runtime's)."""

    # ---------------------------------------------------------------- at install

    def load_plan(self) -> None:
        """Find the newest usable checkpoint and prepare to fast-forward to it; this rank's
        tensors are read on a background thread meanwhile (:class:`ShardRead`), while the
        script imports its libraries and builds its model, and :meth:`_await_read` takes them
        where the plan is first used.

        Unusable ones are moved aside on the way (rank 0 says so, once each); this rank's own
        shard is judged by its read (:meth:`_await_read`); a failure while preparing the plan
        goes to :meth:`_unusable`.
        """
        read_start = time.time()
        got = self._open(None)
        if got is None:
            return
        step, read = got
        self._reading = read
        self._read_sync_s = time.time() - read_start
        try:
            self._prepare(ResumePlan(step, read.state, read.meta))
        except Exception as e:
            self._unusable(step, e)

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
            self._unusable(e.step, e)

    def _await_read(self) -> bool:
        """Where the plan is first used (before anything of it reaches the script): wait for
        this rank's background read. A shard found corrupt falls back as the synchronous read
        at install did (:func:`skip_checkpoint`, then the next older usable checkpoint, read
        here: :meth:`_fall_back`). False: no checkpoint is left, and the script runs from its
        start, as it is doing. Training thread.

        Raises:
            SystemExit: through :meth:`_unusable` (the read failed other than by its bytes)
                or :meth:`_restart`.
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
                    self._unusable(plan.step, RankLoadError(plan.step, e))
                if read.read_s is not None:
                    self._read_timing = (read.start_unix_s, read.read_s)
        finally:
            self._read_wait_s += time.monotonic() - t0
        return self.plan is not None

    def _fall_back(self, bad: ResumePlan) -> None:
        """This rank's shard of ``bad`` failed its read (moved aside already): open the next
        older usable checkpoint, to resume from here if the script arrives at it the way it
        arrives at ``bad`` (the same loops, :func:`_arming`), else restart the attempt, which
        resumes from it at install."""
        self.plan = None
        got = self._open(bad.step)
        if got is None:
            say("no usable checkpoint is left; the script runs from its start")
            return
        step, read = got
        older = ResumePlan(step, read.state, read.meta)
        if _arming(older) != _arming(bad):
            self._restart(f"checkpoint step {step}, the one to fall back to, resumes at another "
                          f"place in the script than step {bad.step}")
        say(f"resuming from checkpoint step {step}")
        self.plan, self._reading = older, read

    def _prepare(self, plan: ResumePlan) -> None:
        """Arm the arrival at the plan's boundary (step loop head, epoch loop head or the
        training loader's ``iter()``)."""
        self.plan = plan
        state, meta = plan.state, plan.meta
        say(f"resuming from checkpoint step {plan.step}")
        if plan.resharded:
            self._say_resharded(plan)
        if self.plan.mode == "loop":
            loop = F.LoopInfo.from_json(meta["loop"]) if meta.get("loop") else None
            if loop is None or sys.gettrace() is not None:
                self._flag("the checkpoint has no loop position (or a tracer is active); "
                           "the step loop restarts")
                return
            outer = [F.LoopInfo.from_json(d) for d in meta.get("outer_loops") or []]
            self._arm_chain(outer + [loop])
            return
        data = state["data"]
        if isinstance(data.get("hf"), dict):  # transformers.Trainer's own loop resumes itself
            self._kind = "hf"
            HF.arm(data["hf"], lambda frame: self._apply(plan, frame, in_tracer=False),
                   lambda: set_global_rng(plan.state["rng"]))
            return
        if isinstance(data.get("lightning"), dict):  # Lightning's fit loop: its own resume path
            PL.arm(data["lightning"])  # restores the loops; the training loader's iter() the rest
            self._kind, self._jumped = "jump", True
            return
        epoch_loop = F.LoopInfo.from_json(data["epoch_loop"]) if data.get("epoch_loop") else None
        if epoch_loop is not None and epoch_loop.kind in ("for_range", "for_iter", "while") \
                and sys.gettrace() is None:
            self._kind = "jump"
            self._arm_loop_resume(epoch_loop, self._arrive_epoch_loop)
        else:
            self._kind = "replay"

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
            _exit_rank()

    def _restart(self, why: str) -> NoReturn:
        """End this rank so that the supervisor restarts the attempt (``why``: said once)."""
        sys.settrace(None)
        say(f"{why}; restarting the attempt to resume from it")
        _exit_rank()

    # ---------------------------------------------------------------- DataLoader hooks

    def on_loader_iter(self, loader: Any, n: int, start: Callable[[], Any]) -> Any:
        """Called for ``iter(loader)``; ``n`` counts earlier ``iter()`` calls on this loader;
        ``start()`` starts the epoch as without cfrun (:mod:`cfrun.rank.data`)."""
        if self._kind == "hf":  # the Trainer skips to its position itself
            it = start()
            it._cfrun_iter_index = n
            return it
        if self._reading is not None and self.plan is not None and self.plan.mode == "loader" \
                and self._kind == "replay":
            self._await_read()  # before any epoch is skipped
        plan = self.plan
        if plan is not None and not self.resumed and plan.mode == "loader" \
                and self._kind == "jump":
            saved = plan.state["data"]["fingerprint"]
            got = loader_fingerprint(loader)
            if plan.resharded:  # the batch size may follow the world (a global batch kept)
                saved = {**saved, "batch_size": got["batch_size"]}
            if self._jumped and got == saved:
                return self._resume_at_loader(loader, n, sys._getframe(2), start)
            if self._jumped and loader._cfrun_ordinal == plan.state["data"]["loader"] and (
                    got["dataset_len"] == saved["dataset_len"]
                    or got["batch_size"] == saved["batch_size"]):
                self._loader_changed(saved, got)
        elif plan is not None and not self.resumed and plan.mode == "loader":
            data = plan.state["data"]
            if loader._cfrun_ordinal == data["loader"]:
                got = loader_fingerprint(loader)
                if got != data["fingerprint"] and not (
                        plan.resharded and {**data["fingerprint"],
                                            "batch_size": got["batch_size"]} == got):
                    self._loader_changed(data["fingerprint"], got)
                if n < data["iter_index"]:
                    self.enter_fast_forward(data["iter_index"], one_batch=bool(data.get("wrapped")))
                    if data.get("wrapped"):
                        # a wrapper (a prefetcher) may assume one batch at least: give it one;
                        # the step it takes is not counted and the state is restored anyway
                        it = start()
                        it._cfrun_iter_index = n
                        return itertools.islice(it, 1)
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

    def on_next(self, it: Any, caller: types.FrameType) -> None:
        """Before a ``next()`` while :attr:`fixing_enumerate`: the first one on the restored
        iterator gives the script's ``enumerate()`` (around the loader or around a wrapper of
        it, :func:`F.find_enumerate`) the count it had at the checkpoint's boundary, which was
        in the middle of that enumerate's ``next()`` as this one is."""
        if self._enum_fix is not None and self._enum_fix[0]() is it:
            saved, consumed = self._enum_fix[1], self._enum_fix[2]
            self._enum_fix = None
            self.fixing_enumerate = False
            if saved is not None:
                en = F.find_enumerate(it, caller, F.consumer_frame(caller))
                if en is not None and F.enumerate_index(en) != saved:
                    F.set_enumerate_index(en, saved)
            elif consumed and "enumerate" not in self.plan.state["data"]:  # type: ignore[union-attr]
                F.fix_enumerate(it, consumed)  # a checkpoint without the count

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
        if plan.resharded and not data.get("mapped"):
            self._map_position(data, loader)
        set_epoch_rng(loader, data["epoch_rng"])
        set_sampler_state(loader, data.get("sampler") or [])  # before the order is drawn
        self._wrapper_caller = _outside_cfrun(caller)
        n = data["iter_index"]  # epochs keep their numbers after a jump
        object.__setattr__(loader, "_cfrun_iter_calls", n + 1)
        loader.__dict__["_cfrun_skip"] = data["batches"]
        loader.__dict__["_cfrun_skip_done"] = data["batches"]
        loader.__dict__["_cfrun_worker_rng"] = data.get("worker_rng")
        loader.__dict__["_cfrun_saved_base_seed"] = data.get("base_seed")
        if loader.num_workers > 0 and not isinstance(data.get("worker_rng"), dict):
            self._flag("the checkpoint has no DataLoader worker RNG states (written by an older "
                       "cfrun): the workers' random augmentation restarts from their seeds")
        it = start()
        it._cfrun_iter_index = n
        self._restore_other_loaders(loader, data.get("loaders") or {})
        self._apply(plan, caller, in_tracer=False)
        saved_count = data.get("enumerate")
        self._enum_fix = (weakref.ref(it), saved_count if type(saved_count) is int else None,
                          data["batches"])
        self.fixing_enumerate = True
        return it

    def _restore_other_loaders(self, train: Any, saved: dict[str, Any]) -> None:
        """The loaders other than the training one (an eval loader) get what they carried
        into their next epoch at the checkpoint (:func:`cfrun.rank.data.set_carried_state`:
        generators, persistent workers' seed and streams), matched by creation ordinal."""
        for loader in self.found.loaders():
            state = saved.get(str(loader.__dict__.get("_cfrun_ordinal")))
            if loader is not train and state is not None:
                why = set_carried_state(loader, state)
                if why is not None:
                    self._flag(why)

    def _map_position(self, data: dict[str, Any], loader: Any) -> None:
        """A resharded resume: the checkpoint's position in its epoch, counted in global
        samples, as batches of this world's loader (:func:`cfrun.codec.reshard.map_position`);
        the sampler's world-dependent attributes keep the live values."""
        saved_sampler = data.get("sampler") or []
        new_sampler = sampler_state(loader)
        skip, again = RS.map_position(
            int(data["batches"]), int(data["fingerprint"].get("batch_size") or 1),
            RS.replicas_of(saved_sampler), int(loader.batch_size or 1),
            RS.replicas_of(new_sampler))
        if type(data.get("enumerate")) is int:
            data["enumerate"] = data["enumerate"] - data["batches"] + skip
        data["batches"] = skip
        data["sampler"] = RS.sampler_state_for_new_world(saved_sampler)
        data["mapped"] = True
        data["worker_rng"] = {}  # the old world's workers' streams: each new one seeds itself
        data["base_seed"] = None
        data["loaders"] = {}
        if again and self.s.rank == 0:
            say(f"the resharded epoch goes on at batch {skip} of each rank: {again} samples "
                "consumed before the checkpoint do not fill a global batch of this world and "
                "are seen again")

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
                if not self._await_read():
                    return None
                try:
                    arrive(frame, loop)
                except Exception as e:
                    assert self.plan is not None
                    self._unusable(self.plan.step, e)
                return frame.f_trace  # the next loop of a chain in this frame, if armed
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

    def _arm_chain(self, chain: list[F.LoopInfo]) -> None:
        """Step loops: arrive at each loop of ``chain`` in turn, outermost first. An outer loop
        (the epoch loop around a per-epoch ``train()``, or around the step loop in the same
        function) gets its frame's variables back and jumps to the checkpoint's iteration; the
        last one, the loop around ``optimizer.step()``, restores everything and goes on after
        the checkpoint's iteration."""
        if len(chain) == 1:
            self._arm_loop_resume(chain[0], self._arrive_step_loop)
            return

        def arrive_outer(frame: types.FrameType, loop: F.LoopInfo) -> None:
            assert self.plan is not None
            records = [r for r in self.plan.state["script"] if r["code"] == loop.code]
            F.restore_frames(records, records, [frame], in_tracer=True,
                             keep_invariants=self.plan.resharded)
            if loop.kind == "for_other":
                self._flag("a loop around the step loop is a for loop over something other "
                           "than range(); its position restarts")
            else:
                self._jump(frame, loop, inclusive=True)
            self._arm_chain(chain[1:])

        self._arm_loop_resume(chain[0], arrive_outer)

    def _arrive_step_loop(self, frame: types.FrameType, loop: F.LoopInfo) -> None:
        assert self.plan is not None
        self._resume_held_iterator(self.plan, frame)
        self._apply(self.plan, frame, in_tracer=True)
        if loop.kind == "for_other":
            self._flag("the loop around optimizer.step() is a for loop over something "
                       "other than range(); its position restarts")
        else:
            self._jump(frame, loop, inclusive=False)

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
        F.restore_frames(records, records, [frame], in_tracer=True,
                             keep_invariants=self.plan.resharded)
        self._jump(frame, loop, inclusive=True, value=data.get("epoch_value"))
        self._jumped = True
        self.awaiting_loader = not self.resumed
        say(f"jumped to epoch index {data.get('epoch_value')} of the epoch loop "
            f"(line {loop.header_line}); completed epochs are not run again")

    def _jump(self, frame: types.FrameType, loop: F.LoopInfo, *, inclusive: bool,
              value: Any = None) -> None:
        """Make ``loop`` (whose head ``frame`` is at) start at the checkpoint's iteration
        (``inclusive``: an outer loop, whose iteration was in progress) or right after it (the
        step loop, whose iteration was complete). ``for_range``: the loop's ``range()`` is cut
        (``value``, else the loop variable's saved value, is the checkpoint's); ``for_iter``:
        the loop's iterable skips its elements up to the one that unpacks to the saved loop
        variables; ``while``: the restored variables are the position."""
        if loop.kind == "for_range":
            done = value if value is not None else self._saved_value(loop)
            drop = 0 if inclusive else 1

            def cut(r: Any) -> Any:
                return r[r.index(done) + drop:] if done in r else None

            self._install_shim(frame, "range", cut)
        elif loop.kind == "for_iter":
            assert loop.outer is not None
            saved = self._saved_values(loop)
            if not saved:
                self._flag("the step loop's variables were not stored; its position restarts")
                return

            def skip(obj: Any) -> Any:
                got, found = _skip_to(obj, loop.names, saved, inclusive)
                if not found:
                    self._flag(f"the loop's {loop.outer}() no longer holds the checkpoint's "
                               "position; the loop restarts")
                return got

            self._install_shim(frame, loop.outer, skip)

    def _saved_value(self, loop: F.LoopInfo) -> Any:
        assert self.plan is not None
        for rec in self.plan.state["script"]:
            if rec["code"] == loop.code and loop.target in rec["values"]:
                return rec["values"][loop.target]["v"]
        return None

    def _saved_values(self, loop: F.LoopInfo) -> dict[str, Any]:
        """The saved scalar values of ``loop``'s target names (what identifies the element)."""
        assert self.plan is not None
        names = set(_flat_names(loop.names))
        out: dict[str, Any] = {}
        for rec in self.plan.state["script"]:
            if rec["code"] == loop.code:
                for name in names:
                    item = rec["values"].get(name)
                    if item and item["kind"] == "value" and type(item["v"]) in (int, float,
                                                                               str, bool):
                        out[name] = item["v"]
        return out

    def _install_shim(self, frame: types.FrameType, name: str,
                      cut: Callable[[Any], Any]) -> None:
        """Make the next call of the builtin ``name`` (``range``, ``enumerate``, ``zip``) in
        ``frame``'s module return ``cut(builtin(...))``.

        Installed at the loop head before its iterable is evaluated; removes itself on first
        use. If ``cut`` returns ``None`` (the saved position is not in the iterable), the loop
        runs unchanged and the resume is flagged.
        """
        import builtins

        g = frame.f_globals
        if name in g:
            self._flag(f"the script defines its own {name}(); the loop position restarts")
            return
        make = getattr(builtins, name)

        def shim(*args: Any, **kwargs: Any) -> Any:
            g.pop(name, None)
            got = cut(make(*args, **kwargs))
            if got is None:
                self._flag(f"the loop's {name}() changed since the checkpoint")
                return make(*args, **kwargs)
            return got

        g[name] = shim

    # ---------------------------------------------------------------- restore

    def _apply(self, plan: ResumePlan, frame: types.FrameType, *, in_tracer: bool) -> None:
        """Load the checkpoint into the live objects, RNG and script frames."""
        self._await_read()  # done where the plan was first used: nothing to wait for here
        restore_start = time.monotonic()
        st = plan.state
        roots = self.found.model_roots()
        opts = self.found.optimizers()
        schedulers, scalers = self.found.schedulers(), self.found.scalers()
        try:  # before anything is applied: a checksum cannot tell a changed layer width
            _place_shards(st, roots, opts)
            check_fits(st, roots, opts, schedulers, scalers)
            check_free_params(st.get("free_params"), free_params(opts, roots))
        except (JobMismatchError, MeshMismatchError) as e:
            self._fatal(f"checkpoint step {plan.step} does not fit this job: {e}; to go on, "
                        "start a new --job-dir (the checkpoints are kept), or restore the "
                        "script and model the checkpoint was written with and resume")
        try:
            restored = self._load(plan, frame, roots, opts, schedulers, scalers,
                                  in_tracer=in_tracer)
        except Exception as e:  # part of it may be in the live objects: restart
            self._unusable(plan.step, e)
        for key in ("modules", "optimizers", "free_params"):  # loaded: free their tensors
            st[key] = []  # (held for the whole run otherwise: a second copy of the state)
        self._wrapper_caller = None
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
        process started (unix s), when its checkpoint read began and how long it took (verify
        and load, ``read_s``; in the background from ``read_sync_s`` on, the seconds it held
        the script at install, to the resume point, which waited ``read_wait_s`` for it), the
        seconds it waited for the agent at start (``agent_wait_s``), and
        ``restore_s``, the seconds spent putting the state into the live objects."""
        out = {"restore_s": round(restore_s, 4)}
        try:
            import psutil

            out["process_start_unix_s"] = round(psutil.Process().create_time(), 3)
        except Exception:  # psutil missing or /proc unreadable: the breakdown lacks one line
            pass
        spare = sys.modules.get("cfrun.rank.spare")
        go_unix_s = getattr(spare, "go_unix_s", None)
        if go_unix_s is not None:  # a warm spare: this process became the rank at its go
            out["process_start_unix_s"] = round(go_unix_s, 3)
            out["warm"] = True
        if self.agent_wait_s is not None:
            out["agent_wait_s"] = round(self.agent_wait_s, 4)
        if self._read_timing is not None:
            out["read_start_unix_s"] = round(self._read_timing[0], 4)
            out["read_s"] = round(self._read_timing[1], 4)
            out["read_sync_s"] = round(self._read_sync_s, 4)
            out["read_wait_s"] = round(self._read_wait_s, 4)
        return out

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
        with torch.no_grad():  # fp32 master weights no module owns (check_fits matched them)
            for live, saved in zip(free_params(opts, roots), st.get("free_params") or []):
                flat = dict(live)
                for item in saved:
                    flat[item["index"]].copy_(item["value"])
        for objs, sds in ((schedulers, st["schedulers"]),
                          (scalers, [scaler_numbers(sd) for sd in st["scalers"]])):
            for obj, sd in zip(objs, sds):
                if sd is not None:
                    obj.load_state_dict(sd)
        set_global_rng(st["rng"])
        index = AliasIndex(roots, opts)  # the loaded tensors script variables may alias
        restored = F.restore_frames(st["script"], st["script"],
                                    F.script_frames(frame, self.s.script), in_tracer=in_tracer,
                                    keep_invariants=plan.resharded, aliases=index.place)
        data, caller = st.get("data"), self._wrapper_caller
        if isinstance(data, dict) and data.get("wrappers") and caller is not None:
            restored += F.restore_wrapper_state(data["wrappers"], caller, self.s.script)
        return restored

    # ---------------------------------------------------------------- fast-forward

    def enter_fast_forward(self, epochs: int, *, one_batch: bool = False) -> None:
        """Suppress the script's output while ``epochs`` completed epochs run without data
        (``one_batch``: with one training batch each, for a wrapped training loader)."""
        if self.fast_forwarding:
            return
        self.fast_forwarding = True
        how = ("with one training batch each (the training loader is read through a wrapper)"
               if one_batch else "without loading data")
        say(f"fast-forwarding {epochs} completed epoch(s) {how} "
            "(script output suppressed until the resume point); the epoch loop is not a "
            "for ... in range() or while loop, so its end-of-epoch code (validation, saving, "
            "logging) runs again, with stdout and torch.save suppressed")
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


def _place_shards(st: dict[str, Any], roots: list[Any], opts: list[Any]) -> None:
    """Make the checkpoint's DTensor local shards (:class:`cfrun.codec.dtensor.LocalShard`)
    DTensors again on the live job's device meshes, in place in ``st``, before it is checked
    and applied (issue 25). Nothing to do in a job without DTensors.

    Raises:
        MeshMismatchError: a shard's mesh is not the live job's.
    """
    if dtensor_class() is None:
        return
    meshes = live_meshes([*roots, *opts])
    for key in ("modules", "optimizers", "free_params", "script"):
        if key in st and has_shards(st[key]):
            st[key] = to_dtensors(st[key], meshes)


def _exit_rank() -> NoReturn:
    """End this rank now (exit 1: the supervisor restarts the attempt), output flushed."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(1)


def _arming(plan: ResumePlan) -> tuple[Any, ...]:
    """What :meth:`Resume._prepare` arms for ``plan``: the loops (or loader) the script must
    arrive at. Two plans alike here are restored at the same place."""
    if plan.mode == "loop":
        return ("loop", plan.meta.get("loop"), plan.meta.get("outer_loops") or [])
    data = plan.state.get("data") if isinstance(plan.state, dict) else None
    return ("loader", data.get("epoch_loop") if isinstance(data, dict) else None)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _outside_cfrun(frame: types.FrameType | None) -> types.FrameType | None:
    """``frame`` or the first frame outwards whose code is not cfrun's (the caller of a patched
    DataLoader method)."""
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(
            _PACKAGE_DIR + os.sep):
        frame = frame.f_back
    return frame


MAX_SKIP_ELEMENTS = 10_000_000
"""A ``for_iter`` loop's iterable is searched this far for the checkpoint's element."""


def _flat_names(names: Any) -> list[str]:
    if isinstance(names, str):
        return [names]
    return [n for part in names or [] for n in _flat_names(part)]


def _skip_to(obj: Any, names: Any, saved: dict[str, Any], inclusive: bool) -> tuple[Any, bool]:
    """``obj`` (an ``enumerate``/``zip`` of ranges and counts) advanced past the first element
    that unpacks into ``names`` with the ``saved`` values (to that element if ``inclusive``),
    and True; ``obj``'s elements from the first, and False, if none within
    :data:`MAX_SKIP_ELEMENTS` does. An ``enumerate``'s count goes on from the element."""
    probe, rest = itertools.tee(obj)
    for k, element in enumerate(itertools.islice(probe, MAX_SKIP_ELEMENTS)):
        bound = F.bind_names(names, element)
        if bound is not None and all(bound.get(n) == v and type(bound.get(n)) is type(v)
                                     for n, v in saved.items()):
            del probe
            return itertools.islice(rest, k if inclusive else k + 1, None), True
    return rest, False
