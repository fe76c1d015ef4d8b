"""The overhead policy with real runs: profiling, `cfrun profile`, the cache, re-profiling."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SCRIPTS, assert_bit_identical, run_cfrun, tiny_reference

from cfrun.contract import faults

pytestmark = pytest.mark.timeout(300)
# long enough that the profile, which stops the script once measured, ends well before the
# script would (CI's slow disk once let the last probe's persist outlast 3 epochs)
TINY = [str(SCRIPTS / "train_tiny.py"), "--epochs", "20", "--out", "x.pt"]


@pytest.mark.slow
def test_profile_command_table_strategy_and_cache(tmp_path):
    run = run_cfrun(["profile", "--job-dir", "p", *TINY], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for needle in ("iteration time", "stall per checkpoint (thread)",
                   "stall per checkpoint (inline)", "chosen snapshot mode", "chosen interval",
                   "predicted overhead", "predicted recovery time", " ms", " MB"):
        assert needle in run.stdout, needle
    job = tmp_path / "p"
    strategy = json.loads((job / "strategy.json").read_text())
    assert strategy["interval"] >= 1 and strategy["source"] == "profile"
    assert strategy["mode"] in ("thread", "inline")
    cache = json.loads((job / "profiles" / f"{strategy['fingerprint']}.json").read_text())
    assert cache["decision"]["interval"] == strategy["interval"]
    assert cache["costs"]["iter_s"] > 0 and cache["model_bytes"] > 0
    [prof] = run.events("profile")
    # every probe, its step and mode and what it cost against the clean iterations between them
    assert [p["mode"] for p in prof["probes"]] == ["warmup", "thread", "inline", "thread",
                                                  "inline"]
    assert all(p["excess_s"] is not None and p["stall_s"] > 0 for p in prof["probes"][1:])
    gaps = {b["step"] - a["step"] for a, b in zip(prof["probes"], prof["probes"][1:])}
    assert min(gaps) >= 6  # room for a probe's 4 costly iterations and clean ones
    assert not list((job / "checkpoints").iterdir())  # profiling leaves no job checkpoints
    assert not (tmp_path / "x.pt").exists()  # the script was stopped before its end

    again = run_cfrun(["profile", "--job-dir", "p", *TINY], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(again.events("profile")) == 1  # the same fingerprint: cached, not re-profiled
    assert again.events("decision")[-1]["source"] == "cache"

    other = run_cfrun(["profile", "--job-dir", "p", str(SCRIPTS / "train_tiny.py"), "--epochs",
                       "21", "--out", "x.pt"], cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-3000:]
    assert len(other.events("profile")) == 2  # new arguments, new fingerprint: profiled again
    assert len(list((job / "profiles").glob("*.json"))) == 2


def test_budget_run_profiles_once_resumes_from_cache_exactly(tmp_path, tmp_path_factory):
    _, ref_state = tiny_reference(tmp_path_factory)  # --epochs 4, --interval 10, uninterrupted
    # profiling takes the first ~20 steps (persists may be deferred); the crash comes after
    run = run_cfrun(["--overhead", "20%", "--inject-crash", "80", "--job-dir", "j",
                     str(SCRIPTS / "train_tiny.py"), "--epochs", "4", "--out", "got.pt"],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("profile")) == 1
    sources = [e["source"] for e in run.events("decision")]
    assert sources == ["profile", "cache"]  # the restart skipped profiling
    assert len(run.events("resumed")) == 1
    assert_bit_identical(ref_state, torch.load(tmp_path / "got.pt", weights_only=True))


@pytest.mark.slow
def test_profile_of_a_script_too_short_to_profile_says_so(tmp_path):
    run = run_cfrun(["profile", "--job-dir", "p", str(SCRIPTS / "train_tiny.py"), "--epochs",
                     "1", "--out", "x.pt"], cwd=tmp_path)
    assert run.returncode == 4, run.stderr[-2000:]
    [line] = [l for l in run.stderr.splitlines() if l.startswith("cfrun: error:")]
    assert "ended before profiling finished" in line
    assert not (tmp_path / "p" / "strategy.json").exists()


@pytest.mark.slow
def test_a_script_that_ends_while_its_last_probe_persists_is_still_profiled(tmp_path):
    """CI on a loaded machine: a script of short steps took its fifth probe, then ended before
    the probe's commit and the ``gap`` steps the tuner waits after it; ``cfrun profile`` said
    "5 of 5 profiling checkpoints taken; nothing was decided". The probes of a 46-step script
    are at steps 5, 14, 23, 32 and 41 (gap 9): it ends 5 steps after the last one, enough
    iterations to measure it, fewer than the gap. The rank's exit now waits for the probe's
    commit and decides."""
    env = faults.arm({}, rank__step_delay_s=0.1)  # a probe's persist is no deferral
    run = run_cfrun(["profile", "--job-dir", "p", str(SCRIPTS / "train_argv.py"), "--steps",
                     "46"], cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    [prof] = run.events("profile")
    assert [p["step"] for p in prof["probes"]] == [5, 14, 23, 32, 41], prof["probes"]
    [decision] = [e for e in run.events("decision") if e["source"] == "profile"]
    assert decision["interval"] >= 1 and "chosen interval" in run.stdout
    strategy = json.loads((tmp_path / "p" / "strategy.json").read_text())
    assert strategy["phase"] == "tuned" and strategy["source"] == "profile"


def test_profile_refuses_a_job_dir_with_checkpoints(tmp_path, tmp_path_factory):
    import shutil

    ref, _ = tiny_reference(tmp_path_factory)  # a finished job of the same script
    shutil.copytree(ref.job_dir, tmp_path / "j", symlinks=True)
    before = sorted(p.name for p in (tmp_path / "j" / "checkpoints").iterdir())
    prof = run_cfrun(["profile", "--job-dir", "j", *TINY], cwd=tmp_path)
    assert prof.returncode == 2 and "already has checkpoints" in prof.stderr
    assert sorted(p.name for p in (tmp_path / "j" / "checkpoints").iterdir()) == before


@pytest.mark.timing
def test_adaptation_raises_k_under_pressure_and_lowers_it_after(tmp_path):
    """Checkpoints made 0.1 s dearer between steps 60 and 260 (fault point
    rank.checkpoint_stall_s, as a saturated disk would): the tuner must raise k while they are,
    and bring it down after."""
    run = run_cfrun(["--overhead", "20%", "--job-dir", "j", str(SCRIPTS / "slow_steps.py"),
                     "640", "out.pt", "0.02"], cwd=tmp_path,
                    env=faults.arm({}, **{"rank.checkpoint_stall_s": "0.1@60-260"}))
    assert run.returncode == 0, run.stderr[-3000:]
    [decision] = run.events("decision")
    adapts = run.events("adapt")
    assert adapts, run.stderr[-2000:]
    for e in adapts:  # every decision is logged with its inputs
        assert {"measured_overhead", "mean_iter_s", "clean_iter_s", "old_interval", "interval",
                "reason", "budget"} <= set(e)
    during = [e for e in adapts if e["step"] <= 270]
    k_max = max(e["interval"] for e in during)
    # 0.1 s per checkpoint on ~20 ms iterations needs k >= 25 for 20%; the first over-budget
    # window must raise k at once, in proportion
    assert k_max >= 15 and k_max > decision["interval"], adapts
    assert any(e["reason"].startswith("over budget") for e in during)
    after = [e for e in adapts if e["step"] > 300]
    assert after and min(e["interval"] for e in after) <= k_max // 2, adapts
    assert any(e["reason"].startswith("well under") for e in after)
    # back within budget within 3 windows of the first over-budget one (not 450% as at k=1;
    # one window raises k 8x at most), each window measured against its own clean iterations
    first_over = next(i for i, e in enumerate(adapts) if e["reason"].startswith("over budget"))
    assert min(e["measured_overhead"] for e in adapts[first_over + 1:first_over + 4]) <= 0.2, \
        adapts
    assert all(e["baseline_iters"] >= 3 and e["checkpoints"] >= 1 for e in adapts), adapts
