"""Rank-side interval control: profile, decide, adapt (CheckFreq §4.3.2, §4.4; cfrun.policy).

Phases:

* ``fixed``: ``--interval K`` given; checkpoint every K steps, measure nothing extra.
* ``profiling``: the first ``profile_steps`` (50) steps, whatever the epoch's length (a probe
  needs its ``NEAR_STEPS`` iterations and clean ones before the next). After
  ``WARMUP_STEPS``, profiling checkpoints ("probes") are taken every ``gap`` steps: a warm-up
  one that pays the one-time costs (model discovery, slot allocation, the agent's first
  connection), then two per snapshot mode (background copy, inline copy), alternating (with
  the state on a GPU two of the background copy only: :data:`PROBE_MODES_CUDA`). A
  probe's cost is what the ``NEAR_STEPS`` iterations after it (and any later one it kept in
  flight) took beyond the baseline: the stall, the background copy and the persist agent's
  competition for cores, memory bandwidth and caches. The baseline is the median of the clean
  iterations *between* the probes, near each probe (:func:`cfrun.policy.measure_overhead`):
  a slow phase of a shared machine then slows baseline and probes alike (a baseline taken
  before the probes read 152 ms where the script ran at 100 ms in bench/adaptive.py, and every
  probe looked free). The cheaper mode and the interval follow from
  :func:`cfrun.policy.choose_interval`; both go to ``strategy.json`` and, keyed by the job's
  fingerprint, to ``profiles/<fingerprint>.json``, so a restart skips profiling.
* ``tuned``: windows of one adaptation period, ``max(3k + 10, 40)`` steps, each starting with
  ``QUIET_STEPS`` steps without checkpoints (clean iterations even when ``k`` is small). When
  the ``NEAR_STEPS`` iterations after a window's end are in, its overhead is measured the same
  way, against the window's own clean iterations, and adapts ``k`` both ways
  (:func:`cfrun.policy.adapt_interval`), together with the overhead of the run so far
  (profiling included); the floor ``k_in_flight`` follows the persist times the window saw (a
  saturated disk makes them longer). Every decision goes to events.jsonl with its inputs.

With several ranks only rank 0 decides; the plan every rank follows is one record rank 0
publishes in ``strategy.json`` (:meth:`Tuner.plan`): phase, interval, mode, base and effective
step, the probe steps while profiling, and the attempt it belongs to. Why a single record (issue
22): before it, every rank loaded the cached profile itself but only some took the starting
step from the previous attempt's ``strategy.json``, so after a restart the ranks checkpointed
at different steps and every checkpoint waited 600 s for shards that never came. A follower
must not decide from anything rank 0 may not share: on several nodes the fingerprint includes
per-node NVML UUIDs (another node may not find the cache), and rank 0 re-profiles on a state
size change (:meth:`Tuner.check_state_bytes`) that a follower cannot see.

Timing: rank 0 publishes at its first step of every attempt (and at every later decision), at
step ``s`` in its optimizer-step hook, for steps from ``s + 2`` on. DDP ranks are in lock-step
within one step (the gradient all-reduce of step ``s + 1`` waits for rank 0's hook of step
``s`` to return), so every follower has read the record by its own hook of step ``s + 1``,
before it evaluates :meth:`Tuner.due` there. A follower that has no record of the current
attempt yet takes no checkpoint (never a wait: a plan that is late costs a checkpoint, not a
stall; rank 0's hand-off of that step then fails at once in the agent, which fails a step as
soon as a rank hands off a later one, :meth:`cfrun.agent.commit.Committer.supersede`).

A record belongs to an attempt: it carries rank 0's node and attempt number and a random
``attempt_id``. On rank 0's node the attempt number decides (it grows across restarts and
``cfrun resume``); on other nodes, whose attempt numbers are their own, a follower ignores the
``attempt_id`` the file held when the follower started (rank 0 of this attempt cannot have
written before then: its first step needs every rank's all-reduce).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cfrun import __version__
from cfrun.contract.jobdir import JobDir, atomic_write_json
from cfrun.policy import Costs, choose_interval, measure_overhead
from cfrun.rank.iterlog import IterationLog
from cfrun.rank.log import say
from cfrun.rank.plan import PlanBoard
from cfrun.rank.probes import Probes
from cfrun.rank.windows import PLAN_AHEAD_STEPS, QUIET_STEPS, Change, Windows, period_steps

PLAN_LATE_STEPS = 20
"""Steps into an attempt after which a follower still without rank 0's plan says so (it takes
no checkpoints until the plan comes)."""


def fingerprint(script: str, args: list[str], world_size: int) -> str:
    """Identity of a job for the profile cache: script bytes, args, world size, devices (names
    and NVML UUIDs), cfrun version. (The state size is checked against the cache at the first
    checkpoint.)"""
    import torch

    h = hashlib.sha256()
    try:
        h.update(Path(script).read_bytes())
    except OSError:
        h.update(script.encode())
    from cfrun.contract.gpus import device_uuids

    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else ["cpu"]
    devices += device_uuids()  # NVML: the same model of GPU elsewhere is profiled again
    h.update(json.dumps([args, world_size, devices, __version__]).encode())
    return h.hexdigest()[:16]


class Tuner:
    """Decides at which steps this rank checkpoints. Called on the training thread.

    Rank 0 profiles, reads the cache, decides and publishes the plan (:meth:`plan`); every
    other rank follows it (:meth:`_follow_strategy`) and decides nothing itself.

    Args:
        attempt, node_rank: this rank's attempt number and node (:class:`RankSettings`): the
            plan a follower takes must be rank 0's of the same attempt.
        key: the job's :func:`fingerprint` (the profile cache's name).
    """

    def __init__(self, jobdir: JobDir, *, rank: int, world_size: int, budget: float,
                 fixed_interval: int | None, mtbf_s: float | None, key: str,
                 profile_only: bool = False, attempt: int = 0, node_rank: int = 0) -> None:
        self.jobdir = jobdir
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.node_rank = node_rank
        self.budget = budget
        self.mtbf_s = mtbf_s
        self.key = key
        self.profile_only = profile_only
        self.phase = "fixed" if fixed_interval else "profiling"
        self.interval = fixed_interval or 0
        self.base_step = 0
        self.k_min = 1
        self.iter_s: float | None = None
        """The profile's clean iteration (seconds; None until profiled in this process)."""
        self.mode = "thread"
        self.cuda_state = False
        """Rank 0: the state is on a GPU (set by the boundary before the first step's
        :meth:`on_step`): profiling probes :data:`PROBE_MODES_CUDA`."""
        self.profile = Probes()
        """The profile's probes (:mod:`cfrun.rank.probes`)."""
        self.log = IterationLog()
        """The iterations and checkpoints measured (rank 0; :mod:`cfrun.rank.iterlog`)."""
        self.windows = Windows(jobdir, budget)
        """Rank 0's adaptation windows of the tuned phase (:mod:`cfrun.rank.windows`)."""
        self.cached_state_bytes: int | None = None
        self.opt_step_s: list[float] = []
        """Durations of ``optimizer.step()`` seen while profiling."""
        self.model_bytes = 0
        self._cache_reason = ""
        self.done_profiling = False
        self._first_step: int | None = None
        """This attempt's first step seen by :meth:`on_step`."""
        self.done: list[dict[str, Any]] = []
        """Records of committed checkpoints, appended by the snapshot thread, taken on the
        training thread at the next step (:meth:`on_checkpoint_done`)."""
        self.board = PlanBoard(jobdir, rank=rank, attempt=attempt, node_rank=node_rank,
                               fixed=self.phase == "fixed")
        """The plan record every rank follows (:mod:`cfrun.rank.plan`)."""
        self._done_step: int | None = None
        """``cfrun profile``: the step at which every rank stops (the decision's step + 1)."""
        if self.phase == "profiling" and rank == 0:  # a follower: rank 0's plan only, no
            self._load_cache()  # cache of its own (issue 22)

    # ------------------------------------------------------------------ cache

    @property
    def cache_path(self) -> Path:
        return self.jobdir.profile_path(self.key)

    def _load_cache(self) -> None:
        try:
            cached = json.loads(self.cache_path.read_text())
        except (OSError, ValueError):
            return
        self.phase = "tuned"
        self.interval = int(cached["decision"]["interval"])
        self.k_min = int(cached["decision"]["k_in_flight"])
        self.iter_s = float((cached.get("costs") or {}).get("iter_s") or 0) or None
        self.mode = cached.get("mode", "thread")
        self.cached_state_bytes = int(cached.get("model_bytes") or 0) or None
        self.done_profiling = True
        self._cache_reason = str(cached["decision"].get("reason", "cached profile"))
        if self.rank == 0:
            self.jobdir.emit_event("decision", source="cache", interval=self.interval,
                                   mode=self.mode, fingerprint=self.key)

    def check_state_bytes(self, nbytes: int) -> None:
        """At the first checkpoint: a cached profile for another model + optimizer state size
        is re-made (the script's own variables vary and do not count)."""
        self.model_bytes = nbytes
        cached, self.cached_state_bytes = self.cached_state_bytes, None
        if cached is not None and abs(nbytes - cached) > 0.1 * cached and self.phase == "tuned":
            self.phase, self.done_profiling = "profiling", False
            self.log.clear()
            self.profile.reset()
            self.windows.lo = None
            if self.rank == 0:
                self.jobdir.emit_event("reprofile", reason="state size changed",
                                       cached_bytes=cached, state_bytes=nbytes)

    # ------------------------------------------------------------------ per step

    def on_step(self, step: int, inflight: int | None) -> None:
        """After every optimizer step: record the iteration time and whether a checkpoint was
        in flight during it; rank 0 decides at the end of profiling and of each window."""
        self._take_done()
        if self.phase == "fixed":
            return  # nothing to measure
        self.log.tick(step, inflight is not None, keep=self.rank == 0)
        if self._first_step is None:
            self._first_step = step
        if self.rank != 0:
            self._follow_strategy(step)
        else:
            self._lead(step)

    def _lead(self, step: int) -> None:
        """Rank 0's part of :meth:`on_step`: publish this attempt's plan at its first step (and
        a new probe plan after a re-profile), decide at the end of profiling, adapt."""
        if self.phase == "profiling" and not self.profile.steps:
            self.profile.plan(step, self.cuda_state)
            self._publish(step, "profiling", "profiling: measuring the checkpoint costs", None)
        elif self.board.plan_from is None:  # the cached decision, for this attempt's ranks
            self._publish(step, "cache", self._cache_reason, None)
        if self.phase == "profiling" and self.profile.complete(step):
            self._decide(step)
        elif self.phase == "tuned":
            self._change(step, self.windows.after_step(
                step, interval=self.interval, k_min=self.k_min, base_step=self.base_step,
                iter_s=self.iter_s, log=self.log))

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due right after ``step``: never before this attempt's first
        plan applies (a follower without rank 0's plan takes none), and by the previous plan
        before a new one's effective step. Every rank then decides alike whether it read the
        new plan at its step ``s`` or ``s + 1`` (rank 0 decides at ``s``; the step is 2
        ahead); plans are at least that many steps apart, so none is skipped."""
        if self.board.plan_from is None or step < self.board.plan_from:
            return False
        phase, interval, base = self._plan_at(step)
        if phase == "profiling":
            return self.profile.due(step)
        if interval <= 0 or step < base:
            return False
        if phase == "tuned" and (step - base) % period_steps(interval) < QUIET_STEPS:
            return False  # the first QUIET_STEPS of every adaptation period: none
        return (step - base) % interval == 0  # --interval K: every K-th step, no quiet steps

    def _plan_at(self, step: int) -> tuple[str, int, int]:
        """(phase, interval, base step) of the plan that applies at ``step``."""
        return self.board.at(step, (self.phase, self.interval, self.base_step))

    def mode_for(self, step: int) -> str:
        """Snapshot mode for the checkpoint taken at ``step`` (profiling tries each in turn)."""
        self.log.ckpts.append(step)
        if self._plan_at(step)[0] != "profiling":  # a re-profile's plan not yet in force
            return self.mode
        return self.profile.take(step)

    # ------------------------------------------------------------------ measurements

    def _take_done(self) -> None:
        """The snapshot thread's records of committed checkpoints (:attr:`done`)."""
        while self.done:
            rec = self.done.pop(0)
            self.on_checkpoint_done(int(rec["step"]), rec)

    def on_checkpoint_done(self, step: int, record: dict[str, Any]) -> None:
        """A checkpoint committed (rank 0 gets every record): keep its times."""
        if self.rank != 0:
            return
        self.log.pgt_s[step] = float(record.get("pgt_s") or 0.0)
        if self.phase == "profiling":
            self.profile.done(step, record)

    def finish_profile(self, step: int, wait_idle: Callable[[float], bool]) -> bool:
        """``cfrun profile``, at the script's end after ``step``: a script of short steps ends
        while its last probe is being persisted, and the decision :meth:`on_step` waits for
        never comes. Wait for it (``wait_idle(seconds)``, at most 60 s), take its record, and
        decide (rank 0) when every probe was taken and measured (:meth:`Probes.measured`).
        Returns whether it decided; never raises (the script's end is not cfrun's to break)."""
        try:
            wait_idle(60.0)
            self._take_done()
            if self.rank != 0 or self.phase != "profiling" or not self.profile.measured(step):
                return False
            self._decide(step)
            return True
        except Exception as e:
            say(f"WARNING: could not finish profiling at the script's end: {e!r}")
            return False

    def probe_costs(self) -> dict[str, Costs]:
        """Per snapshot mode, the measured :class:`cfrun.policy.Costs` of the profile's probes
        (rank 0; :meth:`cfrun.rank.probes.Probes.costs`); sets :attr:`iter_s`."""
        costs, self.iter_s = self.profile.costs(self.log.iters)
        return costs

    def _decide(self, step: int) -> None:
        options = self.probe_costs()
        spent = measure_overhead(self.log.iters, sorted(self.profile.taken), 0, step + 1,
                                 radius_steps=2 * self.profile.gap)
        if spent is not None:  # the profile's cost, its warm-up probe included
            self.windows.spent_s, self.windows.base_total_s = \
                spent.excess_total_s, spent.base_total_s
        model_bytes = self.model_bytes
        self.mode = min(options, key=lambda m: options[m].stall_s + options[m].interference_s)
        costs = options[self.mode]
        decision = choose_interval(costs, self.budget, self.mtbf_s)
        self.interval, self.k_min = decision.interval, decision.k_in_flight
        self.phase, self.done_profiling = "tuned", True
        self.base_step = step + PLAN_AHEAD_STEPS
        self.windows.lo = self.base_step
        self.log.prune(self.base_step)
        out = {"fingerprint": self.key, "costs": vars(costs), "mode": self.mode,
               "model_bytes": model_bytes,
               "opt_step_s": statistics.median(self.opt_step_s) if self.opt_step_s else None,
               "memory": _memory(),
               "modes": {m: vars(c) for m, c in options.items()}, "budget": self.budget,
               "mtbf_s": self.mtbf_s, "decision": decision.to_json(),
               "profile_steps": self.profile.profile_steps, "created_unix_s": time.time()}
        self.cache_path.parent.mkdir(exist_ok=True)
        atomic_write_json(self.cache_path, out)
        self._publish(step, "profile", decision.reason, decision.predicted_overhead)
        self.jobdir.emit_event("profile", probes=self.profile.summary,
                               excess_s=round(spent.excess_total_s, 6) if spent else None,
                               **{k: out[k] for k in ("costs", "mode", "modes")})
        self.jobdir.emit_event("decision", source="profile", interval=self.interval,
                               mode=self.mode, reason=decision.reason,
                               predicted_overhead=decision.predicted_overhead,
                               predicted_recovery_s=decision.predicted_recovery_s,
                               k_budget=decision.k_budget, k_in_flight=decision.k_in_flight,
                               k_daly=decision.k_daly)

    def _adapt(self, step: int) -> None:
        """Close the open adaptation window now (:meth:`Windows.adapt`)."""
        self._change(step, self.windows.adapt(step, interval=self.interval, k_min=self.k_min,
                                              iter_s=self.iter_s, log=self.log))

    def _change(self, step: int, change: Change | None) -> None:
        """Publish the windows' new interval, from ``step + PLAN_AHEAD_STEPS`` on."""
        if change is None:
            return
        self.interval = change.interval
        if change.k_min is not None:
            self.k_min = change.k_min
        self.base_step = step + PLAN_AHEAD_STEPS
        self._publish(step, "adapt", change.reason, None)

    def profile_done(self, step: int) -> bool:
        """``cfrun profile``: whether the script stops after ``step``. Every rank stops at the
        same step, the one after rank 0's decision (when every follower has read it)."""
        return self.done_profiling and self._done_step is not None and step >= self._done_step

    def plan(self, step: int, source: str, reason: str, predicted: float | None
             ) -> dict[str, Any]:
        """The record rank 0 publishes at ``step`` (``strategy.json``): everything a follower
        needs to checkpoint at rank 0's steps, from ``effective_step`` on, and the attempt it
        belongs to. ``source``: profiling, cache, profile, adapt."""
        return {
            "phase": self.phase, "interval": self.interval if self.phase == "tuned" else None,
            "mode": self.mode, "base_step": self.base_step,
            "effective_step": step + PLAN_AHEAD_STEPS,
            "probe_steps": self.profile.steps if self.phase == "profiling" else [],
            "probe_gap": self.profile.gap, "profile_steps": self.profile.profile_steps,
            "fingerprint": self.key, "source": source, "reason": reason,
            "predicted_overhead": predicted, "budget": self.budget,
            "attempt": self.attempt, "node_rank": self.node_rank,
            "attempt_id": self.board.attempt_id, "seq": self.board.seq}

    def _publish(self, step: int, source: str, reason: str, predicted: float | None) -> None:
        """Rank 0: publish the plan made at ``step`` (:meth:`plan`), for steps from
        ``step + PLAN_AHEAD_STEPS`` on; rank 0 itself follows it from there too."""
        self.board.seq += 1
        self._done_step = (self._done_step or step + 1) if self.phase == "tuned" else None
        self.board.publish(self.plan(step, source, reason, predicted))

    def _follow_strategy(self, step: int) -> None:
        """Ranks other than 0 adopt rank 0's newest plan of this attempt from ``strategy.json``
        (read when the file changed). Without one, no checkpoint; said once after
        :data:`PLAN_LATE_STEPS` steps."""
        record = self.board.newer()
        if record is not None:
            self._adopt(record)
        first = self._first_step if self._first_step is not None else step
        self.board.warn_if_late(step, first, PLAN_LATE_STEPS)

    def _adopt(self, record: dict[str, Any]) -> None:
        """Follow ``record`` (a follower): its phase, interval, mode and steps. A new probe plan
        starts the follower's probes afresh, as :meth:`_plan_probes` does rank 0's."""
        self.board.seq = int(record["seq"])
        self.phase, self.mode = str(record["phase"]), str(record["mode"])
        self.interval = int(record.get("interval") or 0)
        self.base_step = int(record["base_step"])
        self.board.switch_to(record)
        probes = [int(p) for p in record.get("probe_steps") or []]
        if self.phase == "profiling" and probes != self.profile.steps:
            self.profile.adopt(probes, int(record["probe_gap"]), int(record["profile_steps"]))
        self.done_profiling = self.phase == "tuned"
        self._done_step = (self._done_step or int(record["effective_step"]) - 1) \
            if self.done_profiling else None


def _memory() -> str:
    """Device memory in use / total (CUDA), or host memory (CPU), for the profile."""
    import torch

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return f"cuda: {(total - free) / 1e9:.1f} of {total / 1e9:.1f} GB in use"
    import psutil

    vm = psutil.virtual_memory()
    return f"host: {vm.used / 1e9:.1f} of {vm.total / 1e9:.1f} GB in use"
