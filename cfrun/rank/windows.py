"""The tuned phase's adaptation windows (CheckFreq §4.4, adaptive rate tuning; issue 33).

After the profile, rank 0 measures what checkpoints cost in windows of one adaptation period,
``max(3k + 10, 40)`` steps (:func:`period_steps`), each starting with :data:`QUIET_STEPS` steps
without checkpoints. When the ``NEAR_STEPS`` iterations after a window's end are in, its
overhead is measured against the window's own clean iterations
(:func:`cfrun.policy.measure_overhead`) and ``k`` adapts both ways
(:func:`cfrun.policy.adapt_interval`), together with the overhead of the run so far (the
profile's included). A window without any clean iteration, a persist in flight during every
one of them, raises ``k`` past the persist's length in steps (:meth:`Windows._always_in_flight`).

:class:`Windows` holds what the windows measured (the open window's first step, the cost and
base time so far); :class:`cfrun.rank.tuner.Tuner` holds the plan and publishes a change.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple

from cfrun.contract.jobdir import JobDir
from cfrun.policy import NEAR_STEPS, adapt_interval, measure_overhead
from cfrun.rank.iterlog import IterationLog

QUIET_STEPS = 10
"""Steps at the start of each adaptation period without checkpoints: clean iterations for the
window's baseline even when ``k`` is smaller than ``NEAR_STEPS``."""
PLAN_AHEAD_STEPS = 2
"""A plan rank 0 publishes in its hook of step ``s`` applies from step ``s + 2``: followers read
it in their hook of step ``s + 1`` at the latest (lock-step DDP ranks)."""


def period_steps(interval: int) -> int:
    """Steps per adaptation window at ``interval``: the quiet steps and 3 checkpoints, at least
    40."""
    return max(3 * interval + QUIET_STEPS, 40)


class Change(NamedTuple):
    """A new interval ``interval`` (steps), its new floor ``k_min`` (steps a persist takes;
    None: unchanged), and why (the ``adapt`` event's reason)."""

    interval: int
    k_min: int | None
    reason: str


class Windows:
    """Rank 0's adaptation windows of the tuned phase, on the training thread.

    Args:
        jobdir: where the ``adapt`` events go.
        budget: the overhead budget (a fraction: 0.035 for 3.5%).
    """

    def __init__(self, jobdir: JobDir, budget: float) -> None:
        self.jobdir = jobdir
        self.budget = budget
        self.lo: int | None = None
        """First step of the window being measured (None: none open yet)."""
        self.spent_s = 0.0
        self.base_total_s = 0.0
        """This attempt's checkpoint cost so far and its time without checkpoints (seconds),
        profiling and the windows within budget: the run's overhead so far."""

    def after_step(self, step: int, *, interval: int, k_min: int, base_step: int,
                   iter_s: float | None, log: IterationLog) -> Change | None:
        """After ``step`` (tuned phase): open the first window at ``base_step``, or close the
        open one when the ``NEAR_STEPS`` iterations after its end are in. Returns the new
        interval when ``k`` changes (the next window then opens where the new plan applies)."""
        if self.lo is None:
            self.lo = max(step, base_step)
            return None
        if step < self.lo + period_steps(interval) + NEAR_STEPS:
            return None
        return self.adapt(step, interval=interval, k_min=k_min, iter_s=iter_s, log=log)

    def adapt(self, step: int, *, interval: int, k_min: int, iter_s: float | None,
              log: IterationLog) -> Change | None:
        """The window ``[lo, lo + period)`` is complete (with the ``NEAR_STEPS`` iterations
        after it): measure its overhead against its own clean iterations and adapt ``k``;
        event ``adapt`` with the inputs."""
        lo = self.lo
        if lo is None:  # no window open (the caller opens one first)
            return None
        hi = lo + period_steps(interval)
        window = measure_overhead(log.iters, log.ckpts, lo, hi,
                                  radius_steps=max(2 * interval, 20))
        self.lo = hi
        if window is None:
            change = self._always_in_flight(step, lo, hi, interval, k_min, iter_s, log)
            log.prune(hi)
            return change
        pgts = [log.pgt_s[p] for p in log.ckpts if lo <= p < hi and p in log.pgt_s]
        if pgts:  # one checkpoint in flight at the persist times this window saw
            k_min = max(1, math.ceil(statistics.median(pgts) / window.base_s - 1e-9))
        measured = max(0.0, window.overhead)
        if measured <= self.budget:  # an over-budget window raises k by itself; a second
            # job's burst is no debt to pay back with fewer checkpoints once it has gone
            self.spent_s += window.excess_total_s
            self.base_total_s += window.base_total_s
        run_overhead = self.spent_s / max(self.base_total_s, 1e-9)
        new, reason = adapt_interval(interval, measured, self.budget, k_min, run_overhead,
                                     noise=window.noise)
        self.jobdir.emit_event("adapt", step=step, window=[lo, hi],
                               measured_overhead=round(measured, 5), budget=self.budget,
                               noise=round(window.noise, 5),
                               mean_iter_s=round(window.mean_iter_s, 6),
                               clean_iter_s=round(window.base_s, 6),
                               baseline_iters=window.clean_iters, iters=window.iters,
                               checkpoints=len(window.excess_s),
                               pgt_s=round(statistics.median(pgts), 6) if pgts else None,
                               k_in_flight=k_min, run_overhead=round(run_overhead, 5),
                               old_interval=interval, interval=new, reason=reason)
        change = None
        if new != interval:
            self.lo = step + PLAN_AHEAD_STEPS
            change = Change(new, None, reason)  # the window's k_min is its own
        log.prune(self.lo)
        return change

    def _always_in_flight(self, step: int, lo: int, hi: int, interval: int, k_min: int,
                          iter_s: float | None, log: IterationLog) -> Change | None:
        """A window without clean iterations: if a checkpoint was in flight during every one
        of them, the persist outlasts the interval (issue 33: k = 19 for 49-step persists on
        an H100 kept one in flight all the time, every checkpoint deferred, +16%). Raise ``k``
        to the persist's length in steps, then at least double it, so that the next window
        has clean iterations to measure against."""
        seen = [busy for s, _, busy in log.iters if lo <= s < hi]
        if len(seen) < 3 or not all(seen):
            return None
        base_s = iter_s or statistics.median(dt for s, dt, _ in log.iters if lo <= s < hi)
        pgts = [t for t in log.pgt_s.values() if t > 0]
        k_min = max(k_min, math.ceil(max(pgts) / base_s) if pgts else 1)
        new = max(k_min + 1, 2 * interval)
        reason = (f"a checkpoint was in flight during every iteration of the last window: "
                  f"the persist ({max(pgts) if pgts else 0:.2f} s) outlasts {interval} "
                  f"steps of {base_s * 1e3:.1f} ms")
        self.jobdir.emit_event("adapt", step=step, window=[lo, hi], measured_overhead=None,
                               budget=self.budget, clean_iter_s=round(base_s, 6),
                               baseline_iters=0, iters=len(seen), k_in_flight=k_min,
                               old_interval=interval, interval=new, reason=reason)
        self.lo = step + PLAN_AHEAD_STEPS
        return Change(new, k_min, reason)
