"""The Runtime: what cfrun does inside each rank process.

One ``Runtime`` per rank, created by :func:`cfrun.rank.install` when the script imports torch.
It sees the script's optimizers (torch's global optimizer step hooks), LR schedulers and AMP
GradScalers (their ``__init__``), DataLoaders (:mod:`cfrun.rank.data`) and its variables
(:mod:`cfrun.rank.frames`), and

* counts steps and, every ``interval`` steps, takes a checkpoint at the next *boundary*: the next
  ``next()`` on the training DataLoader (loader loops) or the next arrival at the head of the loop
  around ``optimizer.step()`` (step loops). At the boundary the iteration's remaining code
  (``scheduler.step()``, ``running_loss += ...``) has run and the next forward has not, so model,
  optimizer, scheduler, RNG, data position and script variables all describe the same moment:
  right after step s (CheckFreq §4.3's consistency point, extended to the script's own state);
* on resume, fast-forwards the script to that moment (README, "Resume semantics").
"""

from __future__ import annotations

import gc
import io
import itertools
import json
import logging
import os
import signal
import sys
import time
import types
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cfrun.contract import settings as E
from cfrun.codec.checkpoint import (
    WorldSizeChangedError,
    commit,
    load_newest,
    staging_dir,
    write_shard,
)
from cfrun.contract.config import parse_inject_crash
from cfrun.codec.format import UnsupportedValueError, encode
from cfrun.contract.jobdir import JobDir, atomic_write_json
from cfrun.rank import frames as F
from cfrun.rank.data import loader_fingerprint, set_epoch_rng
from cfrun.rank.rng import get_global_rng, set_global_rng
from cfrun.rank.tuner import Tuner, fingerprint
from cfrun.codec.sharding import shard_replicated
from cfrun.rank.snapshot import Snapshotter

logger = logging.getLogger("cfrun.rank")


def say(msg: str) -> None:
    """A cfrun line on the rank's stderr, prefixed so it is told apart from the script's."""
    rank = os.environ.get("RANK", "?")
    try:
        sys.__stderr__.write(f"[cfrun rank {rank}] {msg}\n")  # type: ignore[union-attr]
        sys.__stderr__.flush()  # type: ignore[union-attr]
    except Exception:
        pass


@dataclass(frozen=True)
class RankSettings:
    """What the launcher told this rank, from ``CFRUN_RANK_*`` and torchrun's variables."""

    job_dir: Path
    script: str
    """Realpath of the training script."""
    rank: int
    world_size: int
    local_rank: int
    attempt: int
    """cfrun's attempt number (0 = first start), across restarts."""
    interval: int | None
    """Fixed steps between checkpoints, or None: the overhead policy chooses."""
    overhead: float
    mtbf_s: float | None
    profile_only: bool
    keep: int
    inject_crash: list[tuple[int, int]]
    ff_eval: str
    """``one``: other loaders yield one batch while fast-forwarding; ``run``: all of them."""

    @classmethod
    def from_env(cls) -> RankSettings:
        env = os.environ
        return cls(
            job_dir=Path(env[E.RANK_JOB_DIR]),
            script=os.path.realpath(env[E.RANK_SCRIPT]),
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            attempt=int(env.get(E.RANK_ATTEMPT, "0")),
            interval=int(env[E.RANK_INTERVAL]) if env.get(E.RANK_INTERVAL) else None,
            overhead=float(env.get(E.RANK_OVERHEAD, "0.035")),
            mtbf_s=float(env[E.RANK_MTBF_S]) if env.get(E.RANK_MTBF_S) else None,
            profile_only=env.get(E.RANK_PROFILE_ONLY) == "1",
            keep=max(1, int(env.get(E.RANK_KEEP, "2"))),
            inject_crash=parse_inject_crash(env.get(E.RANK_INJECT_CRASH, "")),
            ff_eval=env.get(E.RANK_FF_EVAL, "one"),
        )


@dataclass
class ResumePlan:
    """The newest verified checkpoint and where the script must arrive to restore it."""

    step: int
    state: dict[str, Any]
    meta: dict[str, Any]

    @property
    def mode(self) -> str:
        return str(self.meta.get("mode", "loader"))


class _NullWriter(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


class Runtime:
    """Per-rank checkpoint/resume machinery. Lives on the training thread; not thread-safe."""

    def __init__(self, settings: RankSettings) -> None:
        self.s = settings
        self.jobdir = JobDir(settings.job_dir)
        self.step = 0
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.schedulers: list[weakref.ref[Any]] = []
        self.scalers: list[weakref.ref[Any]] = []
        self.loaders: list[weakref.ref[Any]] = []
        self.mode: str | None = None
        self._last_next_iter: weakref.ref[Any] | None = None
        self._next_since_step = False
        self._train_iter: weakref.ref[Any] | None = None
        self._pending: tuple[int, bool, bool] | None = None
        self._loop: F.LoopInfo | None = None
        self._roots: list[torch.nn.Module] = []
        self._roots_key: int = -1
        self._warned: set[str] = set()
        self.not_exact: list[str] = []
        self.plan: ResumePlan | None = None
        self.resumed = False
        self.fast_forwarding = False
        self._saved_stdout: Any = None
        self._enum_fix: tuple[weakref.ref[Any], int] | None = None
        self._start_epoch: Callable[..., Any]
        self._orig_loader_iter: Callable[..., Any]
        self._resume_kind = "replay"
        self._jumped = False
        self._deferred = 0
        self._deferred_from: int | None = None
        """Step whose due checkpoint was deferred (previous persist in flight), if any."""
        self.snap: Snapshotter | None = None
        self._hb_fd: int | None = None
        self._stop_step: int | None = None
        self._stop_deadline: float | None = None
        self._stopping = False
        self._preempted = False
        self._sync_cost_s = 0.0
        self._done_records: list[dict[str, Any]] = []
        self._step_t0 = 0.0
        self._checked_bytes = False
        self.tuner = Tuner(self.jobdir, rank=settings.rank, world_size=settings.world_size,
                           budget=settings.overhead, fixed_interval=settings.interval,
                           mtbf_s=settings.mtbf_s, profile_only=settings.profile_only,
                           key=fingerprint(settings.script, sys.argv[1:], settings.world_size))
        self._ff_fallback_path = self.jobdir.root / "ff_eval_run"
        self.ff_eval = "run" if self._ff_fallback_path.exists() else settings.ff_eval

    # ---------------------------------------------------------------- discovery

    def register_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.optimizers.append(weakref.ref(opt))

    def register_scheduler(self, sched: Any) -> None:
        self.schedulers.append(weakref.ref(sched))

    def register_scaler(self, scaler: Any) -> None:
        self.scalers.append(weakref.ref(scaler))

    def register_loader(self, loader: Any) -> int:
        self.loaders.append(weakref.ref(loader))
        return len(self.loaders) - 1

    @staticmethod
    def _alive(refs: list[weakref.ref[Any]]) -> list[Any]:
        return [o for o in (r() for r in refs) if o is not None]

    def model_roots(self) -> list[torch.nn.Module]:
        """Modules that own the optimizers' parameters, outermost only, unwrapped from DDP.

        Ordered by the position of their first parameter in the optimizers' param groups, which
        is the same in every run of the same script. Found once by a scan of live objects
        (``gc.get_objects``) and cached until the optimizers' parameters change.
        """
        order: dict[int, int] = {}
        for opt in self._alive(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    order.setdefault(id(p), len(order))
        key = hash(tuple(order))
        if key == self._roots_key:
            return self._roots
        with warnings.catch_warnings():  # isinstance() on deprecated torch proxies warns
            warnings.simplefilter("ignore")
            mods = [o for o in gc.get_objects() if isinstance(o, torch.nn.Module)]
        children = {id(c) for m in mods for c in m._modules.values() if c is not None}
        ranked = []
        for m in mods:
            if id(m) in children:
                continue
            first = min((order[id(p)] for p in m.parameters() if id(p) in order), default=None)
            if first is not None:
                ranked.append((first, m))
        ranked.sort(key=lambda x: x[0])
        # data-parallel replicas: every rank holds these parameters identically (DeepFreeze 1/N)
        self._replicated_params = {id(p) for _, m in ranked
                                   if type(m).__name__ == "DistributedDataParallel"
                                   for p in m.parameters()}
        for _, m in ranked:
            if type(m).__name__ == "FullyShardedDataParallel" or any(
                    type(p).__name__ == "DTensor" for p in m.parameters()):
                self._flag("FSDP / DTensor parameters: each rank's state_dict() is saved as it "
                           "is; a resume needs the same world size and sharding (README)")
        self._wrappers = {id(m) for _, m in ranked}  # DDP / torch.compile wrappers as well
        self._roots = [_unwrap(m) for _, m in ranked]
        self._roots_key = key
        return self._roots

    # ---------------------------------------------------------------- steps and boundaries

    def on_optimizer_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step post-hook (``register_optimizer_step_post_hook``)."""
        self._preempted_guard()
        count = opt.__dict__.get("_cfrun_steps", 0) + 1
        opt.__dict__["_cfrun_steps"] = count
        if self.tuner.phase == "profiling" and self._step_t0:
            self.tuner.opt_step_s.append(time.perf_counter() - self._step_t0)
        if count <= self.step:  # a second optimizer in the same iteration (GAN)
            return
        if self._jumped and not self.resumed and self.plan is not None:
            # the epoch was jumped to, yet training goes on without the checkpoint's loader
            self._loader_changed(self.plan.state["data"]["fingerprint"], None)
        self.step = count
        if self._next_since_step and self._last_next_iter is not None:
            self._train_iter = self._last_next_iter
            self.mode = "loader"
        elif self.mode is None:
            self.mode = "loop"
        self._next_since_step = False
        self._beat()
        while self._done_records:  # checkpoint results from the snapshot thread
            rec = self._done_records.pop(0)
            self.tuner.on_checkpoint_done(int(rec["step"]), rec)
        self.tuner.on_step(self.step, self.snap.inflight_step if self.snap else None)
        if self.s.profile_only and self.tuner.done_profiling:
            say("profiling done; stopping the script (cfrun profile)")
            raise SystemExit(0)
        due = self.tuner.due(self.step) or (self._pending is not None and self._pending[1])
        kill = self.s.rank == 0 and (self.step, self.s.attempt) in self.s.inject_crash
        stop = self._stop_due()
        if not (due or kill or stop):
            return
        self._pending = (self.step, due, kill or (self._pending is not None and self._pending[2]))
        self._stopping = stop
        if self.mode == "loop":
            self._arm_loop_boundary()

    # ---------------------------------------------------------------- supervision

    def _beat(self) -> None:
        """Heartbeat for the supervisor's hang detection: the step count, rewritten each step."""
        try:
            if self._hb_fd is None:
                path = self.jobdir.root / f"heartbeat-rank-{self.s.rank:05d}"
                self._hb_fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.pwrite(self._hb_fd, f"{self.step:>14}\n".encode(), 0)
        except OSError:
            pass

    def _stop_due(self) -> bool:
        """True at the step where every rank stops for a preemption (SIGTERM to cfrun).

        The supervisor writes ``stop_request.json`` (with the grace deadline). Rank 0 picks the
        stop step, a little ahead so that ranks one step behind reach it too, and writes it to
        ``stop_step.json``; the other ranks read it. Checked once per step (one ``stat``).
        """
        if self._stop_step is None:
            req_path = self.jobdir.root / "stop_request.json"
            if not req_path.exists():
                return False
            if self._stop_deadline is None:
                try:
                    self._stop_deadline = float(json.loads(req_path.read_text())["deadline_unix_s"])
                except (OSError, ValueError, KeyError):
                    return False
            step_path = self.jobdir.root / "stop_step.json"
            if self.s.world_size == 1:
                self._stop_step = self.step
            elif self.s.rank == 0:
                self._stop_step = self.step + 2
                atomic_write_json(step_path, {"step": self._stop_step})
            else:
                try:
                    self._stop_step = int(json.loads(step_path.read_text())["step"])
                except (OSError, ValueError, KeyError):
                    return False
            say(f"preemption: stopping at step {self._stop_step}")
        return self.step >= self._stop_step

    def _stop_now(self, frame: types.FrameType, data: dict[str, Any] | None) -> None:
        """Every rank, at the stop step's boundary: the final checkpoint (all ranks or none),
        a ``preempted`` mark, then the end of the script with exit code 0.

        Rank 0 decides once whether a final checkpoint can be durable before the grace
        deadline (:meth:`_stop_decision`, shared through ``stop_decision.json``); every rank
        follows it, so either all ranks hand their shard to the agent or none does (the agent
        commits a step only with every rank's shard). Exit code 0, not 75: torchrun SIGTERMs
        the remaining ranks as soon as one rank exits non-zero, which would kill a rank still
        waiting for the final commit. The supervisor turns the marks into exit code 75 and the
        one ``preempted`` event. ``SystemExit`` unwinds the script, so its code after the
        training loop does not run (its ``finally`` blocks do); a script that swallows it is
        ended at its next optimizer step or batch (:meth:`_preempted_guard`).
        """
        deadline = self._stop_deadline or time.time()
        if self.snap is not None:  # an in-flight persist first: it may be the stop step's
            self.snap.persist_done.wait(max(0.0, deadline - time.time() - 0.5))
        decision = self._stop_decision(deadline)
        committed = self.step if decision == "have" else None
        if decision == "take":
            try:
                if self.snap is not None and self.snap.busy():
                    self.snap.persist_done.wait(max(0.0, deadline - time.time() - 0.2))
                if self.snap is None or not self.snap.busy():
                    self.checkpoint(self.step, frame, data)
                    if self.snap is not None:
                        self.snap.persist_done.wait(max(0.0, deadline - time.time() - 0.2))
                        if not self.snap.busy() and self.snap.last_committed == self.step:
                            committed = self.step
                    else:
                        committed = self.step
            except Exception as e:
                say(f"WARNING: final checkpoint failed: {e!r}")
        last = self._last_committed_step()
        if committed is not None:
            say(f"preempted: final checkpoint at step {committed} is durable")
        else:
            say(f"preempted: no time for a final checkpoint within the grace period "
                f"(needs ~{self._need_s():.1f}s); the newest committed checkpoint is step {last}")
        self._mark_preempted(committed)
        self.note_exit(0)
        raise SystemExit(0)

    def _need_s(self) -> float:
        """Seconds a final checkpoint needs to be durable (margin over the last one's cost)."""
        return 1.5 * self._last_cost_s() + 0.5

    def _stop_decision(self, deadline: float) -> str:
        """``"have"`` (the stop step is already committed), ``"take"`` (a final checkpoint
        fits before ``deadline``, unix seconds) or ``"none"``. Rank 0 decides and writes
        ``stop_decision.json``; the other ranks wait for it until the deadline (``"none"``
        then: rank 0's checkpoint alone can never commit)."""
        path = self.jobdir.root / "stop_decision.json"
        if self.s.rank == 0:
            if self._last_committed_step() == self.step:
                decision = "have"
            elif (time.time() + self._need_s() < deadline
                  and not (self.snap is not None and self.snap.busy())):
                decision = "take"
            else:
                decision = "none"
            atomic_write_json(path, {"step": self.step, "decision": decision,
                                     "need_s": round(self._need_s(), 3)})
            return decision
        while True:
            try:
                doc = json.loads(path.read_text())
                if int(doc["step"]) == self.step:
                    return str(doc["decision"])
            except (OSError, ValueError, KeyError):
                pass
            if time.time() >= deadline:
                return "none"
            time.sleep(0.01)

    def _mark_preempted(self, committed: int | None) -> None:
        """``preempted/node-N-attempt-A-rank-R.json``: this rank stopped for a preemption
        (the supervisor's evidence that exit code 0 means "preempted", not "done")."""
        from cfrun.contract.settings import node_rank

        self._preempted = True
        try:
            marks = self.jobdir.root / "preempted"
            marks.mkdir(exist_ok=True)
            atomic_write_json(marks / f"node-{node_rank()}-attempt-{self.s.attempt}-rank-"
                                      f"{self.s.rank}.json",
                              {"step": self.step, "final_checkpoint": committed})
        except OSError:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass

    def _preempted_guard(self) -> None:
        """The script swallowed the stop's ``SystemExit`` and trains on: end it now."""
        if self._preempted:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(0)

    def _last_cost_s(self) -> float:
        return self.snap.last_cost_s if self.snap is not None else self._sync_cost_s

    def _last_committed_step(self) -> int | None:
        from cfrun.codec.checkpoint import committed_steps

        steps = committed_steps(self.jobdir.checkpoints)
        return steps[0] if steps else None

    def on_loader_next(self, it: Any, caller: types.FrameType) -> None:
        """Called before every ``next()`` on a tracked DataLoader iterator."""
        self._preempted_guard()
        if self._enum_fix is not None and self._enum_fix[0]() is it:
            consumed = self._enum_fix[1]
            self._enum_fix = None
            if consumed:  # False when no enumerate() wraps the loader: nothing to fix
                F.fix_enumerate(it, consumed)
        self._last_next_iter = weakref.ref(it)
        self._next_since_step = True
        if (self._pending is not None and self.mode == "loader" and self._train_iter is not None
                and self._train_iter() is it):
            loader = it._cfrun_loader
            if not _is_for_header(caller):
                self._flag("the training DataLoader is advanced with next() outside a for "
                           "statement; its position resumes, the loop around it may not")
            epoch_loop, epoch_value = self._epoch_loop(caller)
            data = {
                "loader": loader._cfrun_ordinal,
                "fingerprint": loader_fingerprint(loader),
                "iter_index": it._cfrun_iter_index,
                "batches": it._cfrun_consumed,
                "epoch_rng": loader._cfrun_epoch_rng,
                "epoch_loop": epoch_loop.to_json() if epoch_loop else None,
                "epoch_value": epoch_value,
            }
            if loader._dataset_kind != 0:  # _DatasetKind.Iterable
                self._flag("the training DataLoader reads an IterableDataset; cfrun cannot skip "
                           "to the batch position inside an epoch")
            self._boundary(caller, data)

    def _epoch_loop(self, caller: types.FrameType) -> tuple[F.LoopInfo | None, int | None]:
        """The loop around the training loader's ``for`` (the epoch loop) and its variable."""
        frames = F.script_frames(caller, self.s.script)
        loop, frame = None, None
        if frames and frames[0] is caller:
            loop, frame = F.find_loop(caller, outside=True), caller
        if loop is None:
            for f in frames[1:] if frames and frames[0] is caller else frames:
                loop, frame = F.find_loop(f), f
                if loop is not None:
                    break
        if loop is None or frame is None:
            return None, None
        value = frame.f_locals.get(loop.target) if loop.target else None
        if loop.kind == "for_range" and type(value) is not int:
            return F.LoopInfo(loop.code, loop.header_line, loop.body_line, "for_other",
                              loop.target), None
        return loop, value

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
        targets = (loop.header_line, loop.body_line)

        def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno in targets:
                sys.settrace(None)
                frame.f_trace = None
                self._boundary(frame, None)
                return None
            return tracer

        sys.settrace(_ignore_calls)
        loop_frame.f_trace = tracer
        loop_frame.f_trace_lines = True

    def _boundary(self, frame: types.FrameType, data: dict[str, Any] | None) -> None:
        if self._pending is None:
            return
        step, due, kill = self._pending
        self._pending = None
        if due and not self._stopping:
            try:
                # one rank defers a due checkpoint by one boundary at most (then waits for the
                # previous persist), so no more than K+1 iterations separate two checkpoints
                may_defer = self._deferred_from is None or self.tuner.phase == "profiling"
                if not self.checkpoint(self.step, frame, data, may_defer=may_defer):
                    self._pending = (step, True, False)  # previous one in flight: next boundary
                    self._deferred += 1
                    if self._deferred_from is None:
                        self._deferred_from = step
                else:
                    self._deferred_from = None
            except Exception as e:  # never break the user's job
                say(f"WARNING: checkpoint at step {step} failed: {e!r}")
                self.jobdir.emit_event("checkpoint_failed", step=step, error=repr(e),
                                       rank=self.s.rank)
        if self._stopping:
            self._pending = None
            self._stop_now(frame, data)
        if kill:
            say(f"injected crash: SIGKILL after step {step} (attempt {self.s.attempt})")
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os.kill(os.getpid(), signal.SIGKILL)

    def _flag(self, reason: str) -> None:
        """Record and loudly report (once) that the resume of this run may not be exact."""
        if reason not in self._warned:
            self._warned.add(reason)
            self.not_exact.append(reason)
            say(f"WARNING: resume may not be exact: {reason}")
            if self.s.rank == 0:
                self.jobdir.emit_event("not_exact", reason=reason, step=self.step)

    # ---------------------------------------------------------------- checkpoint

    def capture(self, frame: types.FrameType, data: dict[str, Any] | None
                ) -> tuple[Any, list[torch.Tensor], set[int]]:
        """The rank's state right after the current step: a JSON tree, its tensors (live, not
        copied), and the ids of those only ``optimizer.step()`` mutates (parameters, optimizer
        state)."""
        roots = self.model_roots()
        opts = self._alive(self.optimizers)
        tensors: list[torch.Tensor] = []
        # only optimizer.step() changes these: they may be copied after the boundary
        async_ids = {id(p) for m in roots for p in m.parameters()}
        async_ids |= {id(v) for o in opts for st in o.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor)}
        tree: dict[str, Any] = {
            "modules": encode([m.state_dict(keep_vars=True) for m in roots], tensors),
            "optimizers": encode([o.state_dict() for o in opts], tensors),
            "model_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "opt_steps": [o.__dict__.get("_cfrun_steps", 0) for o in self._alive(self.optimizers)],
            "rng": encode(get_global_rng(), tensors),
            "data": encode(data, tensors),
        }
        for kind, refs in (("schedulers", self.schedulers), ("scalers", self.scalers)):
            items = []
            for obj in self._alive(refs):
                try:
                    items.append(encode(obj.state_dict(), tensors))
                except UnsupportedValueError as e:
                    self._flag(f"{type(obj).__name__} state cannot be stored ({e})")
                    items.append(None)
            tree[kind] = items
        frames = F.script_frames(frame, self.s.script)
        saved = {id(m) for m in roots} | {id(m) for r in roots for m in r.modules()}
        saved |= getattr(self, "_wrappers", set())  # the script's `model = DDP(net)` is saved
        cap = F.capture_frames(frames, tensors, saved)
        for name in cap.skipped:
            self._flag(f"script variable {name} cannot be stored")
        tree["script"] = cap.records
        return tree, tensors, async_ids

    def _shard(self, tensors: list[torch.Tensor], async_ids: set[int]) -> list[dict[str, Any]]:
        """DeepFreeze 1/N (cfrun.codec.sharding): with DDP, keep only this rank's slice of each large
        parameter and of its optimizer state. ``CFRUN_SHARD=0`` turns it off (every rank then
        persists everything; ``rank0``: rank 0 persists the replicated tensors alone; both for
        bench/sharded_persist.py)."""
        replicated = getattr(self, "_replicated_params", set())
        how = os.environ.get(E.SHARD, "1")
        if self.s.world_size < 2 or not replicated or how == "0":
            return []
        ids = set(replicated)
        for o in self._alive(self.optimizers):
            for p, st in o.state.items():
                if id(p) in replicated:
                    ids |= {id(v) for v in st.values() if isinstance(v, torch.Tensor)}
        layout, views = shard_replicated(tensors, ids, self.s.rank, self.s.world_size,
                                         rank0_only=how == "rank0")
        async_ids |= {v for v, orig in views.items() if orig in async_ids}
        return layout

    def checkpoint(self, step: int, frame: types.FrameType, data: dict[str, Any] | None,
                   *, may_defer: bool = True) -> bool:
        """Take a checkpoint of step ``step``. Every rank calls it at the same boundary.

        With the persist agent (the normal case): capture, snapshot into shared memory, hand
        off (two-phase; :mod:`cfrun.rank.snapshot`). With one rank and ``may_defer``, returns False,
        taking nothing, while the previous checkpoint is still in flight (the caller retries
        at the next boundary); otherwise waits for it (several ranks must checkpoint the same
        steps). Without an agent: capture and write synchronously.
        """
        t0 = time.perf_counter()
        hold = _kill_after_snapshot_armed(step, self.s.attempt)
        if self.snap is not None and self.snap.busy():
            if self.s.world_size == 1 and may_defer and not hold:
                return False
            self.snap.persist_done.wait()
        t_trigger = time.time()
        tree, tensors, async_ids = self.capture(frame, data)
        layout = self._shard(tensors, async_ids)
        if layout:
            tree["sharded"] = layout
        meta = {
            "step": step,
            "mode": self.mode,
            "loop": self._loop.to_json() if self._loop else None,
            "epoch": data["iter_index"] if data else None,
            "batches": data["batches"] if data else None,
            "not_exact": list(self.not_exact),
            "world_size": self.s.world_size,
        }
        if not self._checked_bytes:
            self._checked_bytes = True
            self.tuner.check_state_bytes(int(tree["model_bytes"]))
        if self.snap is not None:
            mode = self.tuner.mode_for(step)  # also records the step for the tuner
            if not self.snap.mode_is_forced:
                self.snap.mode = mode
            self.snap.start(step, tree, tensors, async_ids, meta, t_trigger, t0)
            _injected_stall(step)
            if hold:  # the snapshot thread SIGKILLs the rank right after the hand-off
                self.snap.persist_done.wait()
            return True
        self.tuner.mode_for(step)
        t1 = time.perf_counter()
        staging = staging_dir(self.jobdir.checkpoints, step)
        files = write_shard(staging, self.s.rank, tree, tensors, meta)
        nbytes = sum(f.nbytes for f in files)
        if os.environ.get(E.TEST_KILL_BEFORE_COMMIT) == str(step) and self.s.attempt == 0:
            say(f"injected crash: SIGKILL while writing checkpoint step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.s.world_size > 1:
            atomic_write_json(staging / f"rank-{self.s.rank:05d}.ok",
                              {"files": [vars(f) for f in files]})
        if self.s.rank == 0:
            if self.s.world_size > 1:
                files = self._gather_rank_files(staging)
                nbytes = sum(f.nbytes for f in files)
            commit(self.jobdir.checkpoints, step, files, world_size=self.s.world_size,
                   meta={k: meta[k] for k in ("step", "mode", "epoch", "batches", "not_exact")},
                   keep=self.s.keep)
            t2 = time.perf_counter()
            self._sync_cost_s = t2 - t0
            self.jobdir.emit_event(
                "checkpoint", step=step, bytes=nbytes, stall_s=round(t2 - t0, 6),
                snapshot_s=round(t1 - t0, 6), persist_s=round(t2 - t1, 6),
                pgt_s=round(t2 - t0, 6), bandwidth_bytes_per_s=round(nbytes / max(t2 - t1, 1e-9)),
                attempt=self.s.attempt, mode=self.mode, persist="sync")
            self._done_records.append({"step": step, "bytes": nbytes, "stall_s": t2 - t0,
                                       "snapshot_s": t1 - t0, "persist_s": t2 - t1})
        return True

    def _emit_checkpoint(self, fields: dict[str, Any]) -> None:
        self._done_records.append(fields)  # for the tuner, on the training thread
        if self.s.rank == 0:
            self.jobdir.emit_event("checkpoint", attempt=self.s.attempt, mode=self.mode,
                                   persist="agent", **fields)
        elif os.environ.get(E.EVENTS_ALL_RANKS) == "1":  # per-rank figures (benchmarks)
            self.jobdir.emit_event("checkpoint_rank", rank=self.s.rank, attempt=self.s.attempt,
                                   **fields)

    def _persist_lost(self, step: int, error: str) -> None:
        say(f"WARNING: checkpoint step {step} was lost ({error}); the next one reconnects")
        self.jobdir.emit_event("persist_lost", step=step, rank=self.s.rank, error=error)

    def on_before_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Global optimizer step pre-hook: the step waits until the snapshot copy is done."""
        if self.snap is not None:
            self.snap.gate()
        self._step_t0 = time.perf_counter()

    def _gather_rank_files(self, staging: Path) -> list[Any]:
        from cfrun.codec.checkpoint import FileEntry
        import json

        deadline = time.monotonic() + 600.0
        files: list[FileEntry] = []
        for r in range(self.s.world_size):
            marker = staging / f"rank-{r:05d}.ok"
            while not marker.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} did not write its shard")
                time.sleep(0.01)
            files += [FileEntry(**f) for f in json.loads(marker.read_text())["files"]]
            marker.unlink()
        return files

    # ---------------------------------------------------------------- resume

    def connect_agent(self) -> None:
        """Use the node's persist agent if the launcher started one (else write synchronously).

        Waits until the agent has committed what an earlier attempt of this rank handed it.
        """
        if os.environ.get(E.RANK_AGENT) != "1":
            return
        snap = Snapshotter(self.s.job_dir, self.s.rank, self.s.world_size, self.s.attempt,
                           self._emit_checkpoint, self._persist_lost)
        if snap.ready():
            self.snap = snap
        else:
            say("WARNING: the persist agent does not answer; checkpoints are written "
                "synchronously by the training process")

    def load_plan(self) -> None:
        """Find the newest verified checkpoint and prepare to fast-forward to it."""
        def skipped(step: int, error: Exception) -> None:
            say(f"checkpoint step {step} failed verification ({error}); "
                "falling back to the previous one")
            if self.s.rank == 0:
                self.jobdir.emit_event("checkpoint_corrupt", step=step, error=str(error))

        try:
            got = load_newest(self.jobdir.checkpoints, self.s.rank, on_skip=skipped,
                              world_size=self.s.world_size)
        except WorldSizeChangedError as e:
            self.fatal(f"{e}; run with the same --nnodes x --nproc-per-node ({e.saved} ranks), "
                       "or start a new --job-dir (the checkpoints are kept)")
        if got is None:
            return
        step, state, meta = got
        self.plan = ResumePlan(step, state, meta)
        say(f"resuming from checkpoint step {step}")
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
            self._resume_kind = "jump"
            self._arm_loop_resume(epoch_loop, self._arrive_epoch_loop)
        else:
            self._resume_kind = "replay"

    def on_loader_iter(self, loader: Any, n: int, start: Callable[[], Any]) -> Any:
        """Called for ``iter(loader)``; ``n`` counts earlier ``iter()`` calls on this loader."""
        plan = self.plan
        if plan is not None and not self.resumed and plan.mode == "loader" \
                and self._resume_kind == "jump":
            saved = plan.state["data"]["fingerprint"]
            got = loader_fingerprint(loader)
            if self._jumped and got == saved:
                return self._resume_at_loader(loader, n, sys._getframe(2))
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
                    self._enter_fast_forward(data["iter_index"])
                    return iter(())
                if n == data["iter_index"]:
                    return self._resume_at_loader(loader, n, sys._getframe(2))
            elif self.fast_forwarding and self.ff_eval == "one":
                it = start()  # one batch: cheap, and no division by an empty count
                it._cfrun_iter_index = n
                return itertools.islice(it, 1)
        it = start()
        it._cfrun_iter_index = n
        return it

    def _loader_changed(self, saved: dict[str, Any] | None, got: dict[str, Any] | None) -> None:
        """Stop (exit 5): the checkpoint's training DataLoader is not in this run."""
        if got is None:
            what = "was not iterated in the checkpoint's epoch before an optimizer step"
        else:
            what = "changed: " + ", ".join(
                f"{k} {saved.get(k)} -> {v}" for k, v in got.items()
                if saved is not None and saved.get(k) != v)
        step = self.plan.step if self.plan is not None else "?"
        self.fatal(f"the training DataLoader of checkpoint step {step} {what}; resume with the "
                   "same script and arguments, or a new --job-dir")

    def _resume_at_loader(self, loader: Any, n: int, caller: types.FrameType) -> Any:
        plan = self.plan
        assert plan is not None
        data = plan.state["data"]
        set_epoch_rng(loader, data["epoch_rng"])
        n = data["iter_index"]  # epochs keep their numbers after a jump
        object.__setattr__(loader, "_cfrun_iter_calls", n + 1)
        loader.__dict__["_cfrun_skip"] = data["batches"]
        loader.__dict__["_cfrun_skip_done"] = data["batches"]
        it = self._start_epoch(loader, self._orig_loader_iter)
        it._cfrun_iter_index = n
        self._apply(plan, caller, in_tracer=False)
        self._enum_fix = (weakref.ref(it), data["batches"])
        return it

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
                    say(f"WARNING: resume failed at the loop head: {e!r}")
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
        self._apply(self.plan, frame, in_tracer=True)
        if loop.kind == "for_range":
            done = self._saved_value(loop)
            self._install_range_shim(frame, lambda r: r[r.index(done) + 1:]
                                     if done in r else None)
        elif loop.kind == "for_other":
            self._flag("the loop around optimizer.step() is a for loop over something "
                       "other than range(); its position restarts")

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

    def _apply(self, plan: ResumePlan, frame: types.FrameType, *, in_tracer: bool) -> None:
        """Load the checkpoint into the live objects, RNG and script frames."""
        st = plan.state
        roots = self.model_roots()
        opts = self._alive(self.optimizers)
        if len(roots) != len(st["modules"]) or len(opts) != len(st["optimizers"]):
            self.fatal(f"the script built {len(roots)} models / {len(opts)} optimizers, the "
                       f"checkpoint holds {len(st['modules'])} / {len(st['optimizers'])}; resume "
                       "with the same script and arguments, or a new --job-dir")
        with torch.no_grad():
            for m, sd in zip(roots, st["modules"]):
                m.load_state_dict(sd)
        for o, sd, count in zip(opts, st["optimizers"], st["opt_steps"]):
            o.load_state_dict(sd)
            o.__dict__["_cfrun_steps"] = count
        for kind, refs in (("schedulers", self.schedulers), ("scalers", self.scalers)):
            for obj, sd in zip(self._alive(refs), st[kind]):
                if sd is not None:
                    obj.load_state_dict(sd)
        set_global_rng(st["rng"])
        restored = F.restore_frames(st["script"], st["script"],
                                    F.script_frames(frame, self.s.script), in_tracer=in_tracer)
        self.step = plan.step
        self.mode = plan.mode
        self.resumed = True
        self._exit_fast_forward()
        say(f"resumed at step {plan.step} ({len(restored)} script variables restored)")
        self.jobdir.emit_event("resumed", step=plan.step, attempt=self.s.attempt,
                               rank=self.s.rank, variables=sorted(restored))

    def _enter_fast_forward(self, epochs: int) -> None:
        if self.fast_forwarding:
            return
        self.fast_forwarding = True
        say(f"fast-forwarding {epochs} completed epoch(s) without loading data "
            "(script output suppressed until the resume point)")
        self._saved_stdout = sys.stdout
        sys.stdout = _NullWriter()
        self._warn_filters = warnings.filters[:]
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")

    def _exit_fast_forward(self) -> None:
        if self.fast_forwarding:
            self.fast_forwarding = False
            if self._saved_stdout is not None:
                sys.stdout = self._saved_stdout
                self._saved_stdout = None
                warnings.filters[:] = self._warn_filters

    # ---------------------------------------------------------------- failures

    def fatal(self, message: str) -> None:
        """Stop the job: the resume would be wrong. The supervisor exits with code 5."""
        say(f"FATAL: {message}")
        try:
            atomic_write_json(self.jobdir.root / "fatal.json",
                              {"message": message, "attempt": self.s.attempt, "rank": self.s.rank})
        finally:
            os._exit(1)

    def on_uncaught(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """sys.excepthook: record the error for the supervisor (crash-loop detection, report);
        a script that breaks while fast-forwarding gets a fallback."""
        import traceback

        if exc_type is not SystemExit:
            self._uncaught = True
            errors = self.jobdir.root / "errors"
            try:
                errors.mkdir(exist_ok=True)
                atomic_write_json(errors / f"attempt-{self.s.attempt}-rank-{self.s.rank}.json", {
                    "type": exc_type.__name__, "message": str(exc)[:2000], "step": self.step,
                    "t_unix_s": time.time(),  # the supervisor reports the earliest failure
                    "traceback": traceback.format_exception(exc_type, exc, tb)[-12:]})
            except OSError:
                pass
        if self.fast_forwarding and self.ff_eval == "one":
            self._exit_fast_forward()
            say("the script failed while fast-forwarding with evaluation loaders cut to one "
                "batch; the next attempt runs them in full (fallback)")
            self._ff_fallback_path.touch()

    def note_exit(self, status: Any) -> None:
        """``sys.exit(status)`` was called: remember the exit code for :meth:`_mark_end`."""
        self._exit_code = 0 if status is None else status if isinstance(status, int) else 1

    def _mark_end(self) -> None:
        """The script's end on this rank, written before interpreter teardown: ``clean`` when
        it returned (or called ``sys.exit(0)``) with no uncaught exception. The supervisor
        counts an attempt whose ranks all ended clean as a success even if a rank then died
        in teardown: torch 2.13 with gloo aborts in C++ destructors at exit now and then
        ("terminate called without an active exception", SIGABRT), and restarting a finished
        job would only run its tail again."""
        from cfrun.contract.settings import node_rank

        preempted = self._preempted
        clean = (not getattr(self, "_uncaught", False) and getattr(self, "_exit_code", 0) == 0
                 and not preempted)
        try:
            ended = self.jobdir.root / "ended"
            ended.mkdir(exist_ok=True)
            atomic_write_json(ended / f"node-{node_rank()}-attempt-{self.s.attempt}-rank-"
                                      f"{self.s.rank}.json", {"clean": clean, "step": self.step,
                                       "preempted": preempted})
        except OSError:
            pass

    def at_exit(self) -> None:
        self._mark_end()
        self._exit_fast_forward()
        if self.snap is not None:
            timeout_s = 60.0
            if self._preempted and self._stop_deadline:  # the supervisor kills us then anyway
                timeout_s = max(0.0, self._stop_deadline - time.time())
            self.snap.close(timeout_s)
            if self.snap.last_error:
                say(f"WARNING: last checkpoint problem: {self.snap.last_error}")
        if self.plan is not None and not self.resumed:
            say(f"WARNING: the script ended before reaching checkpoint step {self.plan.step}; "
                "it was not restored")


def _injected_stall(step: int) -> None:
    """``CFRUN_TEST_CKPT_STALL=SECONDS@FIRST-LAST`` (testing aid, cfrun.contract.settings)."""
    spec = os.environ.get(E.TEST_CKPT_STALL)
    if spec:
        seconds, _, span = spec.partition("@")
        first, _, last = span.partition("-")
        if int(first) <= step < int(last):
            time.sleep(float(seconds))


def _kill_after_snapshot_armed(step: int, attempt: int) -> bool:
    """``CFRUN_TEST_KILL_AFTER_SNAPSHOT=STEP`` (testing aid, :mod:`cfrun.rank.snapshot`): the
    checkpoint of this step is the one after whose hand-off the rank is SIGKILLed. The training
    thread then takes it without deferring and waits there, so the kill lands right after step
    ``step``'s hand-off and before the next iteration, not at a racy point."""
    from cfrun.rank.snapshot import ENV_TEST_KILL_AFTER_SNAPSHOT

    at = os.environ.get(ENV_TEST_KILL_AFTER_SNAPSHOT)
    return attempt == 0 and bool(at) and step >= int(at or 0)


def _ignore_calls(frame: types.FrameType, event: str, arg: Any) -> None:
    return None


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while True:
        inner = getattr(m, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, torch.nn.Module):
            m = inner
            continue
        if type(m).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
                getattr(m, "module", None), torch.nn.Module):
            m = m.module  # type: ignore[assignment]
            continue
        return m


def _is_for_header(frame: types.FrameType) -> bool:
    import ast

    tree = F._parse(os.path.realpath(frame.f_code.co_filename))
    if tree is None:
        return True
    return any(isinstance(n, ast.For) and n.lineno == frame.f_lineno for n in ast.walk(tree))
