"""Issue 22: every rank checkpoints at rank 0's steps, in every attempt (:mod:`cfrun.rank.tuner`).

Two real :class:`Tuner` objects, rank 0 and rank 1 of one job dir, stepped as DDP ranks step:
within a step either may run first, but rank 1's hook of step ``s + 1`` always comes after rank
0's hook of step ``s`` (the gradient all-reduce). The job dir holds what a previous attempt left
(its ``strategy.json``, the cached profile). At every step both must agree on whether a
checkpoint is due: through the first plan of the attempt, a re-profile on a changed state size
and an adaptation of the interval.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cfrun.contract.fsio import atomic_write_json
from cfrun.contract.jobdir import JobDir
from cfrun.rank import probes
from cfrun.rank import windows as W
from cfrun.rank.tuner import PLAN_AHEAD_STEPS, Tuner

KEY = "0123456789abcdef"
RECORD = {"stall_s": 0.01, "snapshot_s": 0.01, "persist_s": 0.02, "bytes": 1000, "pgt_s": 0.03}
"""A committed checkpoint's figures (what rank 0's snapshot thread hands the tuner)."""


def _job(tmp_path: Path, *, interval: int = 9, state_bytes: int = 1000) -> JobDir:
    """A job dir after an attempt 0 that profiled (cache: ``interval``) and adapted from step
    52 on (its strategy.json, the file the follower used to read after a restart)."""
    jd = JobDir(tmp_path / "job")
    jd.create()
    jd.profile_path(KEY).parent.mkdir(exist_ok=True)
    atomic_write_json(jd.profile_path(KEY), {
        "decision": {"interval": interval, "k_in_flight": 1, "reason": "budget"},
        "mode": "thread", "model_bytes": state_bytes})
    atomic_write_json(jd.strategy_path, {
        "interval": interval + 4, "mode": "thread", "fingerprint": KEY, "source": "adapt",
        "reason": "over budget", "effective_step": 52, "predicted_overhead": None,
        "budget": 0.2})
    return jd


def _ranks(jd: JobDir, attempt: int) -> list[Tuner]:
    return [Tuner(jd, rank=r, world_size=2, budget=0.2, fixed_interval=None, mtbf_s=None,
                  key=KEY, attempt=attempt) for r in (0, 1)]


def _run(ranks: list[Tuner], first: int, last: int, state_bytes: int,
         follower_first: bool) -> list[int]:
    """Step both ranks from ``first`` to ``last``; at every step they must agree. Returns the
    checkpoint steps."""
    taken = []
    for step in range(first, last + 1):
        order = ranks[::-1] if follower_first else ranks
        for t in order:
            t.on_step(step, None)
        due = [t.due(step) for t in ranks]
        assert due[0] == due[1], (step, [(t.phase, t.interval, t.base_step) for t in ranks])
        if due[0]:
            taken.append(step)
            for t in ranks:
                if len(taken) == 1:
                    t.check_state_bytes(state_bytes)
                t.mode_for(step)
            ranks[0].on_checkpoint_done(step, RECORD)
    return taken


@pytest.mark.parametrize("follower_first", [True, False])
def test_after_a_restart_both_ranks_follow_rank_0s_plan_of_this_attempt(tmp_path, monkeypatch,
                                                                         follower_first):
    """Attempt 1 resumes at step 41 from the cached profile: rank 1 ignores attempt 0's
    strategy.json (and the cache) and follows rank 0's plan, published at step 42 for steps
    from 44 on; both checkpoint at the same steps, every ``interval`` steps outside quiet."""
    monkeypatch.setattr(W, "adapt_interval", lambda k, *a, **kw: (k, "kept"))
    jd = _job(tmp_path)
    ranks = _ranks(jd, attempt=1)
    taken = _run(ranks, 42, 160, 1000, follower_first)
    assert len(taken) >= 6 and min(taken) >= 42 + PLAN_AHEAD_STEPS, taken
    plan = json.loads(jd.strategy_path.read_text())
    assert (plan["attempt"], plan["source"], plan["interval"]) == (1, "cache", 9), plan
    assert all(t.phase == "tuned" for t in ranks)


def test_a_follower_never_follows_an_earlier_attempts_plan(tmp_path):
    """Attempt 2's rank 1 finds attempt 1's plan (rank 0 of attempt 2 has not written yet):
    it takes no checkpoint until attempt 2's plan comes, then follows it."""
    jd = _job(tmp_path)
    _run(_ranks(jd, attempt=1), 42, 60, 1000, True)  # attempt 1 publishes its plan
    old = json.loads(jd.strategy_path.read_text())
    leader, follower = _ranks(jd, attempt=2)
    follower.on_step(61, None)
    assert follower.phase == "profiling" and not follower.due(old["base_step"] + 18)
    _run([leader, follower], 62, 120, 1000, True)
    assert json.loads(jd.strategy_path.read_text())["attempt"] == 2


@pytest.mark.parametrize("follower_first", [True, False])
def test_a_reprofile_on_rank_0_is_followed_probe_for_probe(tmp_path, follower_first):
    """The state size changed since the cached profile: rank 0 profiles again from its first
    checkpoint on (the follower cannot see the size change); the follower takes the same
    probes and then the new interval."""
    jd = _job(tmp_path, state_bytes=1000)
    ranks = _ranks(jd, attempt=1)
    taken = _run(ranks, 42, 200, 5000, follower_first)
    assert [e["event"] for e in jd.read_events() if e["event"] == "reprofile"] == ["reprofile"]
    assert ranks[0].done_profiling and ranks[1].done_profiling, taken
    assert len(taken) >= 1 + len(probes.PROBE_MODES), taken  # the cached one, the probes


@pytest.mark.parametrize("interval", [2, 3, 4, 5])
def test_an_adapted_interval_switches_every_rank_at_its_effective_step(tmp_path, monkeypatch,
                                                                       interval):
    """Rank 0 adapts the interval at the end of each window (here: always to k + 1): before
    the new plan's effective step every rank checkpoints by the old one (which may call for one
    at the very step rank 0 decides), from it by the new one."""
    monkeypatch.setattr(W, "adapt_interval", lambda k, *a, **kw: (k + 1, "test"))
    jd = _job(tmp_path, interval=interval)
    ranks = _ranks(jd, attempt=1)
    taken = _run(ranks, 62, 400, 1000, True)  # windows from 62: not the plan's quiet steps
    assert taken
    adapts = [e for e in jd.read_events() if e["event"] == "adapt"]
    assert len(adapts) >= 2 and ranks[1].interval == ranks[0].interval > interval, adapts


def test_a_fixed_interval_has_no_quiet_steps(tmp_path) -> None:
    """``--interval 10`` checkpoints at every 10th step: the adaptation windows' quiet steps
    belong to the policy (a merge made step 40, 80... quiet for fixed intervals too, and a
    job resumed at 30 took no checkpoint until 50)."""
    from cfrun.contract.jobdir import JobDir
    from cfrun.rank.tuner import Tuner

    jd = JobDir(tmp_path / "j")
    jd.create()
    t = Tuner(jd, rank=0, world_size=1, budget=0.035, fixed_interval=10, mtbf_s=None, key="k")
    assert [s for s in range(1, 101) if t.due(s)] == list(range(10, 101, 10))


@pytest.mark.parametrize("cuda_state, modes", [
    (True, ["warmup", "thread", "thread"]),
    (False, ["warmup", "thread", "inline", "thread", "inline"]),
], ids=["gpu", "cpu"])
def test_profiling_probes_no_inline_copy_when_the_state_is_on_a_gpu(tmp_path, cuda_state,
                                                                     modes):
    """Issue 23: on a GPU the inline mode is never the cheaper one (its stall is the whole
    device-to-host copy, 102-104 ms for 4.4 GB on an H200 against 13-27 ms in the
    background), so its two probes only cost the run: rank 0 with its state on a GPU plans
    three probes, the follower takes the same three in the same modes (it knows them by their
    number), and both decide alike. On a CPU the five probes stay."""
    jd = JobDir(tmp_path / "job")
    jd.create()
    ranks = _ranks(jd, attempt=0)
    ranks[0].cuda_state = cuda_state
    seen: list[tuple[int, str, str]] = []
    for step in range(1, 200):
        for t in ranks:
            t.on_step(step, None)
        due = [t.due(step) for t in ranks]
        assert due[0] == due[1], step
        if due[0]:
            got = [t.mode_for(step) for t in ranks]
            seen.append((step, ranks[0].profile.taken[step], ranks[1].profile.taken[step]))
            assert got[0] == got[1], (step, got)
            if step == seen[0][0]:
                for t in ranks:
                    t.check_state_bytes(1000)
            ranks[0].on_checkpoint_done(step, RECORD)
        if ranks[0].phase == "tuned" and ranks[1].phase == "tuned":
            break
    assert [m0 for _, m0, _ in seen] == [m1 for _, _, m1 in seen] == modes, seen
    assert ranks[0].done_profiling and ranks[1].done_profiling, seen
    assert ranks[0].mode == ranks[1].mode == "thread"
    profile = [e for e in jd.read_events() if e["event"] == "profile"]
    assert [p["mode"] for p in profile[0]["probes"]] == modes
