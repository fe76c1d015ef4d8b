"""Checkpoint interval policy: how often to checkpoint under an overhead budget (pure functions).

CheckFreq §4.3.2 and §4.4, done as DESIGN.md §4 asks:

* **Initial choice** (:func:`choose_interval`): a checkpoint costs the training loop its stall
  (the boundary copy plus the wait at the next step) plus its interference (the background copy
  and the persist agent slow the iterations they overlap). With iteration time ``t`` and budget
  ``p``, checkpointing every ``k`` steps costs ``(stall + interference) / (k * t)``; the smallest
  ``k`` that keeps this under ``AIM_FRACTION * p`` is chosen (a margin for measurement noise),
  but never below ``ceil(persist / t)`` (one
  checkpoint in flight: the next one would only be deferred) nor, when the MTBF is known, more
  often than the Young/Daly optimum ``sqrt(2 * C * MTBF)`` needs. CheckFreq's prototype
  ignores the budget in its first choice; this does not.
* **Adaptation** (:func:`adapt_interval`): per window, the measured overhead against a fresh
  baseline; over budget → ``k`` grows in proportion (to ``AIM_FRACTION`` of it), well under
  (below half the budget) → ``k``
  shrinks towards the smallest allowed, at most halving per window. CheckFreq only ever raises
  the interval.

Units: seconds, steps, fractions (0.035 = 3.5%).
"""

from __future__ import annotations

import math
import re
import statistics
from bisect import bisect_left
from dataclasses import asdict, dataclass
from typing import Any

from cfrun.contract.errors import BadInputError

AIM_FRACTION = 0.75
"""The interval is chosen (and re-chosen when a window is over budget) for this fraction of the
budget: an overhead measured on a shared machine carries a noise of a percent or two, the size
of a typical budget, and aiming at the budget itself puts every other window over it."""
ADAPT_UNDER_FRACTION = 0.5
"""Lower ``k`` only when the measured overhead is below this fraction of the budget."""
ADAPT_MAX_SHRINK = 2.0
"""One window lowers ``k`` by at most this factor."""
ADAPT_MAX_GROW = 8.0
"""One window raises ``k`` by at most this factor: a window measured during a burst (a second
job's first writes) would otherwise set ``k`` for a load that is already easing, and a period
(``3k + 10`` steps) so long that no window ends before the load does."""
NEAR_STEPS = 4
"""Iterations after a checkpoint's step that carry its cost: the boundary (stall, snapshot
start), then the background copy and the persist agent competing for cores and memory bandwidth
(bench/adaptive.py measured +13, +32, +8, ~0 ms in those iterations on a 2-core machine)."""
MAX_INTERVAL = 100_000


@dataclass(frozen=True)
class Costs:
    """What profiling measured (per checkpoint unless said otherwise)."""

    iter_s: float
    """Baseline iteration time without checkpoint activity."""
    stall_s: float
    """Training-loop wait per checkpoint (boundary copy + gate)."""
    interference_s: float
    """Extra iteration time per checkpoint from the background copy and the persist."""
    persist_s: float
    """Snapshot copy + persist + commit, i.e. how long one checkpoint stays in flight."""
    state_bytes: int
    restart_s: float = 10.0
    """Time from a failure to the first resumed step (process start, imports, load)."""


@dataclass(frozen=True)
class Decision:
    """A chosen interval and why."""

    interval: int
    reason: str
    predicted_overhead: float
    """Fraction of iteration time spent on checkpoints at this interval."""
    predicted_recovery_s: float
    """Restart time plus the expected lost work (half an interval)."""
    k_budget: int
    k_in_flight: int
    k_daly: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def per_checkpoint_cost_s(c: Costs) -> float:
    """Seconds one checkpoint adds to the training loop."""
    return max(0.0, c.stall_s) + max(0.0, c.interference_s)


def predicted_overhead(c: Costs, k: int) -> float:
    """Overhead fraction of checkpointing every ``k`` steps."""
    return per_checkpoint_cost_s(c) / (k * c.iter_s)


def choose_interval(c: Costs, budget: float, mtbf_s: float | None = None) -> Decision:
    """The smallest interval whose predicted overhead is within ``AIM_FRACTION * budget``,
    and no smaller than the in-flight and Young/Daly limits.

    Raises:
        ValueError: non-positive iteration time or budget.
    """
    if c.iter_s <= 0 or not 0 < budget < 1:
        raise ValueError(f"iter_s {c.iter_s} and budget {budget} must be positive")
    cost = per_checkpoint_cost_s(c)
    k_budget = max(1, math.ceil(cost / (AIM_FRACTION * budget * c.iter_s) - 1e-9))
    k_in_flight = max(1, math.ceil(c.persist_s / c.iter_s - 1e-9))
    k_daly = None
    if mtbf_s:
        k_daly = max(1, math.floor(math.sqrt(2.0 * max(cost, 1e-6) * mtbf_s) / c.iter_s))
    k = min(MAX_INTERVAL, max(k_budget, k_in_flight, k_daly or 1))
    if k == k_budget:
        reason = f"budget: {cost * 1e3:.1f} ms per checkpoint within " \
                 f"{AIM_FRACTION * budget:.2%} (3/4 of the {budget:.2%} budget) of " \
                 f"{c.iter_s * 1e3:.1f} ms iterations"
    elif k == k_in_flight:
        reason = f"one checkpoint in flight: persist takes {c.persist_s * 1e3:.0f} ms"
    else:
        reason = f"Young/Daly: MTBF {mtbf_s:.0f} s needs no more than every {k} steps"
    return Decision(k, reason, predicted_overhead(c, k),
                    c.restart_s + 0.5 * k * c.iter_s, k_budget, k_in_flight, k_daly)


def adapt_interval(k: int, measured: float, budget: float, k_min: int,
                   run_overhead: float | None = None, noise: float = 0.0) -> tuple[int, str]:
    """The next interval after a window whose measured overhead was ``measured``.

    Over budget: grow ``k`` by the ratio to ``AIM_FRACTION`` of the budget (at least +1, at
    most ``ADAPT_MAX_GROW`` times): the per-checkpoint cost the window measured, spread so that
    it fits with a margin. ``run_overhead``, the overhead of the run so far (profiling
    included: its probes checkpoint every few steps), counts as well: a run over budget so far
    grows ``k`` by its ratio, so that the next windows pay the excess back, and is never
    lowered (a 600-step job spends about 1% of its time profiling). ``k_min`` (one checkpoint in
    flight, from the persist times the window saw) is a floor in every case. Below half the
    budget: shrink it towards ``k_min`` by the ratio (aiming at 3/4 of the budget), by at
    least 1 and at most by half per window: one window's measurement is noisy (a window whose
    mean came out below its baseline measures 0%), and a halving that overshoots costs one
    window over budget, where jumping from k to ``k_min`` on noise costs many checkpoints.
    ``noise`` (:attr:`WindowOverhead.noise`, one standard error of ``measured``): ``k`` is
    lowered only when ``measured`` is under half the budget by two of them, so a window
    whose checkpoints the machine's noise hides never buys more checkpoints; where the noise
    alone is larger than the budget the reason says so (issue 16: err towards fewer).
    """
    run = run_overhead if run_overhead is not None else 0.0
    if measured > budget or run > budget:
        new = max(k + 1, math.ceil(k * max(measured, run) / (AIM_FRACTION * budget)))
        new = max(k_min, min(new, math.ceil(k * ADAPT_MAX_GROW)))
        why = (f"over budget in the last window (its steps {measured:.2%} slower than clean "
               f"ones > {budget:.2%})" if measured > budget else
               f"over budget so far ({run:.2%} of the run > {budget:.2%})")
        return min(MAX_INTERVAL, new), why
    if k < k_min:
        return k_min, f"one checkpoint in flight needs k >= {k_min}"
    if measured < ADAPT_UNDER_FRACTION * budget and k > k_min:
        if measured + 2 * noise >= ADAPT_UNDER_FRACTION * budget:
            if noise > budget:
                return k, (f"kept: the machine's noise (+-{noise:.2%} per window) is larger "
                           f"than the budget {budget:.2%}; fewer checkpoints, not more")
            return k, f"within budget ({measured:.2%} +- {noise:.2%} of noise)"
        target = math.ceil(k * max(measured, 1e-9) / (AIM_FRACTION * budget))
        new = max(k_min, math.ceil(k / ADAPT_MAX_SHRINK), min(k - 1, target))
        return new, (f"well under budget ({measured:.2%} < {ADAPT_UNDER_FRACTION:.0%} of "
                     f"{budget:.2%})")
    return k, "within budget"


@dataclass(frozen=True)
class WindowOverhead:
    """What :func:`measure_overhead` found in one window of iterations."""

    overhead: float
    """Extra time of the checkpoint-affected iterations over the clean baseline, as a fraction
    of the window's baseline time (0.035 = 3.5%); may be slightly negative (noise)."""
    base_s: float
    """Median of the window's clean iterations, seconds."""
    excess_s: dict[int, float]
    """Checkpoint step -> seconds its ``NEAR_STEPS`` iterations (and any later ones it kept in
    flight) took beyond the baseline."""
    iters: int
    clean_iters: int
    iter_spread_s: float = 0.0
    """Robust spread of one clean iteration: 1.4826 x the median absolute deviation of the
    window's clean iterations from their median (the standard deviation for Gaussian noise)."""
    noise: float = 0.0
    """One standard error of :attr:`overhead` from the spread of the clean iterations (robust:
    1.4826 x their median absolute deviation per iteration, times the square root of the
    checkpoint-affected iterations, over the window's baseline time); a fraction like it."""

    @property
    def mean_iter_s(self) -> float:
        return self.base_s * (1.0 + self.overhead)

    @property
    def base_total_s(self) -> float:
        """The window's time without checkpoints: iterations x baseline, seconds."""
        return self.iters * self.base_s

    @property
    def excess_total_s(self) -> float:
        """Seconds the window's checkpoints cost in all."""
        return self.overhead * self.base_total_s


def measure_overhead(iters: list[tuple[int, float, bool]], ckpt_steps: list[int], lo: int,
                     hi: int, near_steps: int = NEAR_STEPS,
                     radius_steps: int | None = None) -> WindowOverhead | None:
    """Overhead of the checkpoints taken at steps ``[lo, hi)`` against a baseline made of the
    same window's clean iterations (not within ``near_steps`` after a checkpoint, nothing in
    flight): a slow phase of a shared machine slows baseline and checkpoints alike, where a
    baseline taken before (or after) the checkpoints reads the drift as overhead or hides it.

    Args:
        iters: ``(step, seconds, busy)`` per iteration, the iteration that ended with optimizer
            step ``step``; ``busy``: a checkpoint was in flight during it. A checkpoint at step
            ``p`` (taken at the boundary after step ``p``) costs iterations ``p + 1 ...``.
        ckpt_steps: every checkpoint step, also those before ``lo`` (their tails are neither
            baseline nor counted).
        lo, hi: the window. Counted: iterations with ``lo <= step < hi``, and those after
            ``hi`` that are near a checkpoint of the window (its cost, paid after the window);
            not counted: those near a checkpoint before ``lo`` (the previous window paid them).
        radius_steps: per checkpoint, the baseline is the median of the clean iterations
            within this many steps of it (when at least 3 are), else the window's median.

    Returns: ``None`` with fewer than 3 clean iterations.
    The idea of measuring a window against a fresh, checkpoint-free baseline is CheckFreq
    §4.4's; measuring it inside the window is ours (DESIGN.md §4).
    """
    ckpts = sorted(ckpt_steps)
    counted: list[tuple[int, float, int | None]] = []  # (step, seconds, owner; -1: unknown)
    for step, dt, busy in iters:
        i = bisect_left(ckpts, step) - 1  # the latest checkpoint before this iteration
        prev = ckpts[i] if i >= 0 else None
        if prev is not None and (step - prev <= near_steps or busy):
            p: int | None = prev  # its near iterations, or one it kept in flight
        else:
            p = -1 if busy else None
        if p is not None and 0 <= p < lo:
            continue  # the previous window's checkpoint
        if step < lo or (step >= hi and (p is None or not lo <= p < hi)):
            continue
        counted.append((step, dt, p))
    clean = [(s, dt) for s, dt, p in counted if p is None]
    if len(clean) < 3:
        return None
    base = statistics.median(dt for _, dt in clean)

    def local_base(p: int) -> float:
        if radius_steps is None or p < 0:
            return base
        near = [dt for s, dt in clean if abs(s - p) <= radius_steps]
        return statistics.median(near) if len(near) >= 3 else base

    excess: dict[int, float] = {p: 0.0 for p in ckpts if lo <= p < hi}
    extra = 0.0
    for _, dt, p in counted:
        if p is None:
            continue
        d = dt - local_base(p)
        extra += d
        if p in excess:
            excess[p] += d
    spread_s = 1.4826 * statistics.median(abs(dt - base) for _, dt in clean)
    affected = len(counted) - len(clean)
    noise = spread_s * math.sqrt(max(affected, 1)) / (len(counted) * base)
    return WindowOverhead(extra / (len(counted) * base), base, excess, len(counted), len(clean),
                          spread_s, noise)


def young_daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly optimal checkpoint period ``sqrt(2 C M)`` in seconds."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*$")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(name: str, text: str) -> float:
    """``90``, ``90s``, ``30m``, ``6h``, ``2d`` -> seconds (> 0).

    Raises:
        BadInputError: malformed or not positive.
    """
    m = _DURATION_RE.match(text)
    if m is None or float(m.group(1)) <= 0:
        raise BadInputError(f"{name} {text!r} is not a duration; give e.g. {name} 6h "
                            "(s, m, h, d; plain numbers are seconds)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def learned_mtbf_s(wall_s: float, failures: int) -> float | None:
    """MTBF from this job's own history: wall time per failure (None before any failure)."""
    return wall_s / failures if failures > 0 and wall_s > 0 else None
