"""The interval policy's arithmetic (CheckFreq §4.3.2/§4.4, Young/Daly) and its parsers."""

from __future__ import annotations

import math

import pytest

from cfrun.contract.errors import BadInputError
from cfrun.policy import (
    ADAPT_MAX_GROW,
    AIM_FRACTION,
    NEAR_STEPS,
    Costs,
    adapt_interval,
    choose_interval,
    learned_mtbf_s,
    measure_overhead,
    parse_duration,
    predicted_overhead,
    young_daly_interval_s,
)


def costs(**kw) -> Costs:
    base = dict(iter_s=0.1, stall_s=0.01, interference_s=0.005, persist_s=0.05,
                state_bytes=100)
    base.update(kw)
    return Costs(**base)  # type: ignore[arg-type]


def test_smallest_interval_meeting_the_budget():
    c = costs()  # 15 ms per checkpoint, 100 ms iterations
    d = choose_interval(c, 0.035)
    aim = AIM_FRACTION * 0.035  # a margin under the budget for measurement noise
    assert d.interval == math.ceil(0.015 / (aim * 0.1)) == 6
    assert predicted_overhead(c, d.interval) <= aim < predicted_overhead(c, d.interval - 1)
    assert d.reason.startswith("budget")
    assert d.predicted_recovery_s == pytest.approx(10.0 + 0.5 * 6 * 0.1)


def test_in_flight_floor_when_persist_is_slow():
    d = choose_interval(costs(persist_s=1.25), 0.035)
    assert d.interval == 13 and d.k_in_flight == 13 and d.k_budget == 6
    assert d.reason.startswith("one checkpoint in flight")


@pytest.mark.parametrize("budget", [0.01, 0.035, 0.2])
@pytest.mark.parametrize("mtbf_s", [None, 3600.0, 5.0])
def test_the_plan_never_picks_an_interval_whose_persist_outlasts_it(budget, mtbf_s):
    """Issue 23: at the chosen interval one checkpoint's copy, persist and commit
    (``Costs.persist_s``) end before the next one is due, whatever the budget and the MTBF ask
    for (a checkpoint due earlier would be deferred: the plan would not be what runs)."""
    for iter_s in (0.004, 0.1, 0.37, 2.0):
        for persist_s in (0.0, 0.001, 0.3, 2.7, 5.7, 40.0):
            d = choose_interval(costs(iter_s=iter_s, persist_s=persist_s), budget, mtbf_s)
            assert d.interval * iter_s >= persist_s - 1e-9, (iter_s, persist_s, d)
            assert d.k_in_flight * iter_s >= persist_s - 1e-9


def test_young_daly_floor_with_known_mtbf():
    c = costs()
    mtbf = 3600.0
    d = choose_interval(c, 0.5, mtbf_s=mtbf)
    expect = math.floor(young_daly_interval_s(0.015, mtbf) / 0.1)
    assert d.k_daly == expect and d.interval == max(d.k_budget, d.k_in_flight, expect)
    assert d.reason.startswith("Young/Daly")


def test_bigger_budget_never_gives_a_larger_interval():
    ks = [choose_interval(costs(), b).interval for b in (0.01, 0.02, 0.05, 0.2, 0.9)]
    assert ks == sorted(ks, reverse=True)


@pytest.mark.parametrize("bad", [dict(iter_s=0.0), dict(iter_s=-1.0)])
def test_invalid_costs_raise(bad):
    with pytest.raises(ValueError):
        choose_interval(costs(**bad), 0.035)


def test_adapt_raises_over_budget_in_proportion():
    k, why = adapt_interval(10, measured=0.07, budget=0.035, k_min=2)
    assert k == math.ceil(10 * 0.07 / (AIM_FRACTION * 0.035)) == 27 and why.startswith("over")
    assert adapt_interval(10, 0.036, 0.035, 2)[0] == 14
    assert adapt_interval(100, 0.0351, 0.035, 2)[0] == 134


def test_adapt_lowers_well_under_budget_but_not_below_the_floor():
    k, why = adapt_interval(40, measured=0.005, budget=0.035, k_min=3)
    assert 20 <= k < 40 and why.startswith("well under")
    # a noisy window that measured nothing halves k at most (bench/adaptive.py saw 30 -> 1)
    assert adapt_interval(30, 0.0, 0.035, 1)[0] == 15
    assert adapt_interval(15, 0.0, 0.035, 1)[0] == 8
    assert adapt_interval(4, 0.0, 0.035, 3)[0] == 3
    assert adapt_interval(3, 0.0, 0.035, 3)[0] == 3


def test_adapt_does_not_lower_k_on_a_window_the_noise_hides():
    """Under noise the policy errs towards fewer checkpoints (issue 16, item 4): a window that
    measured 0% with +-1% of noise is not proof of spare budget; bench/budget_noise.py saw
    k halved to the floor eleven times in two runs on noise alone."""
    k, why = adapt_interval(30, 0.0, 0.035, 1, noise=0.01)
    assert k == 30 and "noise" in why
    k, why = adapt_interval(30, 0.0, 0.035, 1, noise=0.05)
    assert k == 30 and "larger than the budget" in why
    assert adapt_interval(30, 0.0, 0.035, 1, noise=0.002)[0] == 15  # a quiet machine: as before
    assert adapt_interval(10, 0.07, 0.035, 1, noise=0.05)[0] > 10  # over budget still raises


def test_measure_overhead_says_how_noisy_its_window_was():
    quiet = [(s, 0.100, False) for s in range(60)]
    noisy = [(s, 0.100 + (0.03 if s % 2 else -0.03), False) for s in range(60)]
    w_quiet = measure_overhead(quiet, [20, 40], 0, 60)
    w_noisy = measure_overhead(noisy, [20, 40], 0, 60)
    assert w_quiet is not None and w_noisy is not None
    assert w_quiet.noise == 0.0 and w_quiet.iter_spread_s == 0.0
    assert w_noisy.iter_spread_s == pytest.approx(1.4826 * 0.03)
    assert 0.002 < w_noisy.noise < 0.05


def test_adapt_growth_is_capped_and_the_in_flight_floor_holds():
    # a window read during a burst of a second job's writes: 40x the budget
    assert adapt_interval(16, 1.4, 0.035, 1)[0] == math.ceil(16 * ADAPT_MAX_GROW)
    # persists now take 30 iterations (a saturated disk): k goes to that floor at once
    assert adapt_interval(16, 0.02, 0.035, 30)[0] == 30
    assert adapt_interval(16, 0.0, 0.035, 30)[0] == 30
    assert adapt_interval(16, 0.05, 0.035, 120)[0] == 120


def test_adapt_pays_back_a_run_over_budget_so_far():
    # the window is within budget, the run so far (profiling's probes) is not: k grows
    k, why = adapt_interval(20, 0.03, 0.035, 2, run_overhead=0.05)
    assert k == math.ceil(20 * 0.05 / (AIM_FRACTION * 0.035)) and "so far" in why
    # a window well under budget does not lower k while the run is over budget
    assert adapt_interval(20, 0.005, 0.035, 2, run_overhead=0.04)[0] > 20
    # and lowers it once the run is back within budget
    assert adapt_interval(20, 0.005, 0.035, 2, run_overhead=0.03)[0] < 20


def iters_with(ckpts, n, base=0.1, cost=(0.013, 0.032, 0.008), drift=None, busy=()):
    """Iterations 1..n of ``base`` s (times ``drift(step)``), each checkpoint at step p adding
    ``cost`` to iterations p+1, p+2, ..."""
    out = []
    for s in range(1, n + 1):
        dt = base * (drift(s) if drift else 1.0)
        for p in ckpts:
            if 0 < s - p <= len(cost):
                dt += cost[s - p - 1]
        out.append((s, dt, s in busy))
    return out


def test_measure_overhead_finds_the_cost_against_the_clean_iterations():
    ckpts = list(range(20, 200, 20))
    w = measure_overhead(iters_with(ckpts, 220), ckpts, 10, 200)
    assert w is not None and w.base_s == pytest.approx(0.1)
    assert set(w.excess_s) == set(ckpts)
    assert all(e == pytest.approx(0.053) for e in w.excess_s.values())
    # every checkpoint's near iterations counted, also those after the window's end
    assert w.overhead == pytest.approx(9 * 0.053 / (190 * 0.1))
    assert w.mean_iter_s == pytest.approx(0.1 + 9 * 0.053 / 190)


def test_measure_overhead_is_not_fooled_by_a_slow_phase():
    """The machine runs 50% slower for the first half of the window: a baseline taken before
    the checkpoints (or the whole window's mean) would read that as overhead or hide the
    checkpoints; a local baseline sees each checkpoint's own cost."""
    ckpts = list(range(20, 200, 20))
    slow = lambda s: 1.5 if s < 100 else 1.0  # noqa: E731
    w = measure_overhead(iters_with(ckpts, 220, drift=slow), ckpts, 10, 200, radius_steps=15)
    away = {p: e for p, e in w.excess_s.items() if abs(p - 100) > 15}  # not at the change
    assert len(away) == 8 and all(e == pytest.approx(0.053) for e in away.values()), w.excess_s
    # without the local baseline the slow checkpoints' excess reads 0.15 - 0.1 per iteration
    flat = measure_overhead(iters_with(ckpts, 220, drift=slow), ckpts, 10, 200)
    assert max(flat.excess_s.values()) > 0.2


def test_measure_overhead_leaves_the_previous_windows_checkpoint_out():
    ckpts = [8, 30, 50]
    w = measure_overhead(iters_with(ckpts, 70), ckpts, 10, 60)
    assert set(w.excess_s) == {30, 50}
    # iterations 9..12 belong to checkpoint 8 (the previous window): neither base nor counted
    assert w.iters == 60 - 10 - (8 + NEAR_STEPS + 1 - 10) + 0
    assert w.overhead == pytest.approx(2 * 0.053 / (w.iters * 0.1))


def test_measure_overhead_counts_iterations_a_slow_persist_kept_busy():
    ckpts = [20, 40]
    busy = set(range(21, 33))  # the persist of checkpoint 20 in flight for 12 steps
    its = iters_with(ckpts, 60, cost=(0.02, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01), busy=busy)
    w = measure_overhead(its, ckpts, 10, 60)
    assert w.excess_s[20] == pytest.approx(0.09)  # all 8 slowed iterations, not just NEAR_STEPS
    assert w.base_s == pytest.approx(0.1)


def test_measure_overhead_needs_clean_iterations():
    ckpts = list(range(10, 60, 2))
    assert measure_overhead(iters_with(ckpts, 60), ckpts, 10, 60) is None


def test_adapt_keeps_interval_within_budget():
    assert adapt_interval(10, 0.03, 0.035, 1) == (10, "within budget")


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("30m", 1800),
                                           ("6h", 21600), ("1.5d", 129600)])
def test_parse_duration(text, seconds):
    assert parse_duration("--mtbf", text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "soon", "6y"])
def test_parse_duration_rejects(text):
    with pytest.raises(BadInputError, match="--mtbf"):
        parse_duration("--mtbf", text)


def test_learned_mtbf():
    assert learned_mtbf_s(3600.0, 0) is None
    assert learned_mtbf_s(3600.0, 4) == 900.0
