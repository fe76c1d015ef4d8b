"""The overhead policy with real runs: profiling, `cfrun profile`, the cache, re-profiling."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import SCRIPTS, assert_bit_identical, run_cfrun

pytestmark = pytest.mark.timeout(300)
TINY = [str(SCRIPTS / "train_tiny.py"), "--epochs", "2", "--out", "x.pt"]


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
    assert not list((job / "checkpoints").iterdir())  # profiling leaves no job checkpoints
    assert not (tmp_path / "x.pt").exists()  # the script was stopped before its end

    again = run_cfrun(["profile", "--job-dir", "p", *TINY], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(again.events("profile")) == 1  # the same fingerprint: cached, not re-profiled
    assert again.events("decision")[-1]["source"] == "cache"

    other = run_cfrun(["profile", "--job-dir", "p", str(SCRIPTS / "train_tiny.py"), "--epochs",
                       "3", "--out", "x.pt"], cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-3000:]
    assert len(other.events("profile")) == 2  # new arguments, new fingerprint: profiled again
    assert len(list((job / "profiles").glob("*.json"))) == 2


def test_budget_run_profiles_once_resumes_from_cache_exactly(tmp_path):
    ref = run_cfrun(["--interval", "10", "--job-dir", "ref", str(SCRIPTS / "train_tiny.py"),
                     "--epochs", "4", "--out", "ref.pt"], cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    # profiling takes the first ~20 steps (persists may be deferred); the crash comes after
    run = run_cfrun(["--overhead", "20%", "--inject-crash", "80", "--job-dir", "j",
                     str(SCRIPTS / "train_tiny.py"), "--epochs", "4", "--out", "got.pt"],
                    cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("profile")) == 1
    sources = [e["source"] for e in run.events("decision")]
    assert sources == ["profile", "cache"]  # the restart skipped profiling
    assert len(run.events("resumed")) == 1
    assert_bit_identical(torch.load(tmp_path / "ref.pt", weights_only=True),
                         torch.load(tmp_path / "got.pt", weights_only=True))


def test_profile_refuses_a_job_dir_with_checkpoints(tmp_path):
    run = run_cfrun(["--interval", "5", "--job-dir", "j", *TINY], cwd=tmp_path)
    assert run.returncode == 0
    before = sorted(p.name for p in (tmp_path / "j" / "checkpoints").iterdir())
    prof = run_cfrun(["profile", "--job-dir", "j", *TINY], cwd=tmp_path)
    assert prof.returncode == 2 and "already has checkpoints" in prof.stderr
    assert sorted(p.name for p in (tmp_path / "j" / "checkpoints").iterdir()) == before
