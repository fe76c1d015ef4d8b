"""Issue 33: a persist longer than the profile's probe gap (a 4.4 GB state on an H100: 3.4 s
persists of 71 ms steps, 49 steps, where probes are 40 steps apart) left no clean iteration
between the probes. The profile then took 1 s as the iteration and 0 s as the interference,
chose k = 4 for a 49-step persist, and the adaptation, finding no clean iteration in its
windows either, never moved past k = 19: a persist in flight all the time, +15.9% for a 3.5%
budget. Real :class:`Tuner` objects fed the iterations such a run makes."""

from __future__ import annotations

import math

from cfrun.contract.jobdir import JobDir
from cfrun.rank.tuner import Tuner

CLEAN_S, BUSY_S, PERSIST_STEPS = 0.071, 0.080, 49


def _tuner(tmp_path) -> Tuner:
    jd = JobDir(tmp_path / "job")
    jd.create()
    return Tuner(jd, rank=0, world_size=1, budget=0.035, fixed_interval=None, mtbf_s=None,
                 key="0123456789abcdef")


def _profiled(t: Tuner) -> Tuner:
    """The profile's record: probes at 31 (warm-up), 71, 111; every iteration from the
    warm-up probe on has a persist in flight."""
    t.profile.taken = {31: "warmup", 71: "thread", 111: "thread"}
    t.profile.gap = 40
    record = {"stall_s": 0.026, "snapshot_s": 0.08, "persist_s": 3.4, "bytes": 4_426_938_223,
              "pgt_s": 3.48}
    t.profile.records = {71: dict(record), 111: dict(record)}
    t.log.pgt_s = {31: 3.48, 71: 3.48, 111: 3.48}
    t.log.iters = [(s, CLEAN_S if s <= 31 else BUSY_S, s > 31) for s in range(4, 152)]
    return t


def test_the_profile_measures_against_the_clean_iterations_before_its_probes(tmp_path):
    costs = _profiled(_tuner(tmp_path)).probe_costs()["thread"]
    assert math.isclose(costs.iter_s, CLEAN_S), costs
    # each probe's busy iterations are its cost: ~40 of them, 9 ms each
    assert 0.25 < costs.stall_s + costs.interference_s < 0.6, costs


def test_the_policy_then_picks_an_interval_that_holds_the_budget(tmp_path):
    t = _profiled(_tuner(tmp_path))
    t._decide(151)
    # the checkpoint costs ~0.36 s; 3.5% of 71 ms steps pays for one every ~145 steps
    assert t.interval >= 100, (t.interval, t.k_min)
    assert t.k_min >= PERSIST_STEPS, t.k_min


def test_a_window_with_a_persist_always_in_flight_raises_the_interval(tmp_path):
    t = _tuner(tmp_path)
    t.phase, t.done_profiling, t.interval, t.k_min, t.iter_s = "tuned", True, 19, 4, CLEAN_S
    t.windows.lo = 100
    t.log.pgt_s = {p: 3.48 for p in range(100, 170, 19)}
    t.log.ckpts = sorted(t.log.pgt_s)
    t.log.iters = [(s, BUSY_S, True) for s in range(100, 200)]
    t._adapt(199)
    assert t.interval >= PERSIST_STEPS + 1 and t.k_min >= PERSIST_STEPS, (t.interval, t.k_min)
    adapt = [e for e in t.jobdir.read_events() if e["event"] == "adapt"]
    assert adapt and "in flight during every iteration" in adapt[-1]["reason"]
