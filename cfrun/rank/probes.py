"""The profile's probes: the checkpoints the tuner takes at its first steps to measure what each
snapshot mode costs (CheckFreq §4.3.2: profile, then decide; :mod:`cfrun.rank.tuner`).

After ``WARMUP_STEPS`` the probes are taken every ``gap`` steps: a warm-up one that pays the
one-time costs (model discovery, slot allocation, the agent's first connection), then two per
snapshot mode, alternating (with the state on a GPU two of the background copy only). A probe's
cost is what the ``NEAR_STEPS`` iterations after it took beyond the clean iterations near it
(:func:`cfrun.policy.measure_overhead`). Every rank derives the probes from the steps rank 0
planned (``strategy.json``); only rank 0 measures. Training thread only.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from cfrun.policy import NEAR_STEPS, Costs, measure_overhead

WARMUP_STEPS = 3
PROBE_MODES = ("warmup", "thread", "inline", "thread", "inline")
"""Profiling checkpoints in order: one that pays one-time costs (model discovery, slot
allocation), then two per snapshot mode, alternating (a drift of the machine hits both). Each
probe checkpoints far more often than the chosen interval will: on a 2-core machine the five
cost ~0.4 s, 0.5% of a 1000-step job (seven cost up to 0.8 s)."""
PROBE_MODES_CUDA = ("warmup", "thread", "thread")
"""The probes when the state is on a GPU: there ``inline`` is never chosen (its stall is the
whole device-to-host copy, the background mode's only the part the next forward and backward
do not hide, and their interference is pooled: :meth:`Tuner.probe_costs`), so its probes
would only cost the run (on an H200, 4.4 GB: inline probes stalled 102-104 ms, background ones
13-27 ms, and each probe cost 100-160 ms of step time)."""


def probe_modes(probes: int) -> tuple[str, ...]:
    """The snapshot mode of each of ``probes`` profiling checkpoints (every rank derives them
    from the number of probe steps rank 0 planned): :data:`PROBE_MODES_CUDA` for 3,
    :data:`PROBE_MODES` otherwise."""
    return PROBE_MODES_CUDA if probes == len(PROBE_MODES_CUDA) else PROBE_MODES


PROFILE_MAX_STEPS = 50
"""Steps the profile takes at most from its start (the probes and the iterations after them)."""


class Probes:
    """One profile's probes: their steps, the modes taken, rank 0's records of them."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        """The probes' planned steps (empty: none planned yet)."""
        self.gap = 0
        """Steps between two probes."""
        self.profile_steps = PROFILE_MAX_STEPS
        """The step the profile ends at."""
        self.taken: dict[int, str] = {}
        """Probes taken: step -> snapshot mode (``warmup`` for the first)."""
        self.records: dict[int, dict[str, Any]] = {}
        """Rank 0: the committed probes' checkpoint records, the warm-up's left out."""
        self.summary: list[dict[str, Any]] = []
        """Per probe: step, mode, excess_s, stall_s (for the ``profile`` event)."""

    def plan(self, start: int, cuda_state: bool) -> None:
        """Probe steps from ``start``, the same on every rank (steps alone): after
        ``WARMUP_STEPS``, one probe every ``gap`` steps, each followed by at least 2 clean
        iterations; three probes when the state is on a GPU (:data:`PROBE_MODES_CUDA`), five
        otherwise."""
        first = start + WARMUP_STEPS + 1
        modes = PROBE_MODES_CUDA if cuda_state else PROBE_MODES
        self.gap = max(NEAR_STEPS + 2, (start + PROFILE_MAX_STEPS - first) // len(modes))
        self.steps = [first + i * self.gap for i in range(len(modes))]
        self.profile_steps = self.steps[-1] + self.gap
        self.taken = {}  # a re-profile's checkpoint at its state-size check is no probe

    def adopt(self, steps: list[int], gap: int, profile_steps: int) -> None:
        """A follower: rank 0's probe plan (a new one starts its probes afresh)."""
        self.steps, self.taken = steps, {}
        self.gap, self.profile_steps = gap, profile_steps

    def reset(self) -> None:
        """A re-profile (the state's size changed): no probe planned, taken or recorded."""
        self.records, self.steps, self.taken = {}, [], {}
        self.profile_steps = 0  # set from the step the new plan starts at

    def due(self, step: int) -> bool:
        """The next probe at its planned step, or later when a probe was deferred (one rank,
        the previous persist still in flight), but always ``gap`` steps after the last."""
        n = len(self.taken)
        if not self.steps or n >= len(self.steps) or step < self.steps[n]:
            return False
        return not self.taken or step >= max(self.taken) + self.gap

    def take(self, step: int) -> str:
        """The probe at ``step`` is taken: its snapshot mode (the warm-up's is ``thread``)."""
        modes = probe_modes(len(self.steps))
        mode = modes[min(len(self.taken), len(modes) - 1)]
        self.taken[step] = mode
        return "thread" if mode == "warmup" else mode

    def done(self, step: int, record: dict[str, Any]) -> None:
        """Rank 0: the checkpoint of ``step`` committed; a probe's record is kept (not the
        warm-up's: it pays one-time set-up costs)."""
        if step in self.taken and self.taken[step] != "warmup":
            self.records[step] = record

    def complete(self, step: int) -> bool:
        """Rank 0: every probe is taken and measured at ``step`` (``gap`` steps after the last;
        or ``10 gap`` steps after it when a probe's record never came: it failed)."""
        probes = len(self.steps)
        return bool(self.records) and len(self.taken) == probes \
            and step >= max(self.taken) + self.gap \
            and (len(self.records) == probes - 1 or step >= max(self.taken) + 10 * self.gap)

    def measured(self, step: int) -> bool:
        """Rank 0, at the script's end after ``step``: every probe is taken, at least one
        probe's record came, and ``NEAR_STEPS`` iterations followed the last probe (its cost
        is measured), though fewer than the ``gap`` :meth:`complete` waits for."""
        return bool(self.records) and bool(self.steps) and len(self.taken) == len(self.steps) \
            and step >= max(self.taken) + NEAR_STEPS

    def costs(self, iters: list[tuple[int, float, bool]]) -> tuple[dict[str, Costs], float]:
        """Per snapshot mode, the measured :class:`cfrun.policy.Costs`, and the clean
        iteration (seconds), from rank 0's ``iters`` (:class:`cfrun.rank.iterlog.IterationLog`).

        ``iter_s`` is the median clean iteration of the profile (after the warm-up probe's
        iterations); a probe's cost is its excess over the clean iterations near it. A mode's
        cost is its median stall plus ``interference_s``, the median over all probes of their
        excess beyond their stall (pooled: per-probe noise exceeds the modes' difference in
        it, which is in the stall)."""
        taken = sorted(self.taken)
        warm = [p for p in taken if self.taken[p] == "warmup"]
        lo = (warm[0] + NEAR_STEPS + 1) if warm else 0
        hi = (max(taken) + self.gap) if taken else 0
        window = measure_overhead(iters, taken, lo, hi, radius_steps=2 * self.gap)
        if window is None:
            # no clean iteration between the probes: each persist outlasted the gap (issue 33:
            # 3.4 s persists of 71 ms steps on an H100, gap 40), so every iteration there had
            # one in flight. The clean iterations before the first probe are the baseline, and
            # every later iteration is a probe's cost (before this, iter_s fell back to 1 s,
            # the interference to 0, and the policy chose k = 4 for a 49-step persist: +16%)
            window = measure_overhead(iters, taken, 0, hi, radius_steps=None)
        excess: dict[str, list[float]] = {}
        records: dict[str, list[dict[str, Any]]] = {}
        for p in taken:
            if p not in self.records:
                continue
            mode = self.taken[p]
            excess.setdefault(mode, []).append(window.excess_s.get(p, 0.0) if window else 0.0)
            records.setdefault(mode, []).append(self.records[p])
        iter_s = window.base_s if window else (
            statistics.median(dt for _, dt, _ in iters) if iters else 1.0)
        self.summary = [{"step": p, "mode": self.taken[p],
                        "excess_s": round(window.excess_s[p], 6) if window and p in
                        window.excess_s else None,
                        "stall_s": self.records[p]["stall_s"] if p in self.records else None}
                       for p in taken]
        # the interference (excess beyond the stall) pooled over every probe: one probe's
        # excess varies 30-250 ms on a shared machine, more than the modes differ in it
        pooled = [e - float(r["stall_s"]) for m in records
                  for e, r in zip(excess[m], records[m])]
        interference_s = max(0.0, statistics.median(pooled)) if pooled else 0.0
        if window is not None and pooled:  # a cost the machine's noise hides is not 0: take
            # the standard error of the pooled median (NEAR_STEPS noisy iterations per probe)
            # as its least value, so noise buys fewer checkpoints, never more (issue 16)
            noise_s = window.iter_spread_s * math.sqrt(NEAR_STEPS) * 1.2533 / math.sqrt(
                len(pooled))
            interference_s = max(interference_s, noise_s)
        out = {}
        for mode, recs in records.items():
            stall_s = statistics.median(float(r["stall_s"]) for r in recs)
            out[mode] = Costs(
                iter_s=iter_s, stall_s=stall_s, interference_s=interference_s,
                persist_s=max(float(r["snapshot_s"]) + float(r["persist_s"]) for r in recs),
                state_bytes=int(recs[-1]["bytes"]))
        return out, iter_s
