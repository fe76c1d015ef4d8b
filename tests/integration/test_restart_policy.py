"""Issue 22: the overhead policy keeps protecting a 2-rank job after every restart.

A real 2-rank DDP job (gloo, train_ddp_slow.py, 6 epochs of 32 steps) under the policy (no
``--interval``; a 30% budget so that the chosen interval is a few steps and several checkpoints
fall after each restart; the default 3.5% chooses the same way, with larger intervals), long
enough that profiling ends and rank 0 decides (~step 55). After the decision rank 1 is
SIGKILLed (from outside, as a kill by the OOM killer); once the restarted attempt has committed
a checkpoint, cfrun gets a SIGTERM and the job goes on with ``cfrun resume`` (one job for both
cases: three process starts instead of four on a loaded machine).

Before the fix every rank loaded the cached profile, but only rank 1 took its starting step
from the previous attempt's ``strategy.json``: the ranks checkpointed at different steps and
every checkpoint waited 600 s for the other rank's shard. Now each restarted attempt commits
checkpoints with both ranks' shards after its resume step, no step is failed for a
disagreement, no rank waits for a reply, and the job ends bit-identical to an uninterrupted
run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import (
    SCRIPTS,
    Run,
    assert_bit_identical,
    clean_env,
    rank_pids,
    run_cfrun,
    shared_run,
)

from cfrun.codec.checkpoint import committed_steps

pytestmark = pytest.mark.timeout(600)
DDP_SLOW = str(SCRIPTS / "train_ddp_slow.py")
POLICY = ["--nproc-per-node", "2", "--overhead", "30%"]
SLEEP_S, EPOCHS = "0.02", "6"
AFTER_DECISION_STEPS = 12
"""Steps past rank 0's decision at which the job is interrupted (a tuned checkpoint or two)."""
RESTARTED_TIMEOUT_S = 200
"""Bound on a restarted attempt's first commit and on the resumed run: far below the 600 s that
each checkpoint of a restarted attempt waited before the fix, far above a loaded machine's
process starts."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job, uninterrupted (its bits do not depend on the interval; no sleep)."""
    def make(cwd: Path) -> Run:
        run = run_cfrun(["--nproc-per-node", "2", "--interval", "20", "--job-dir", "ref",
                         DDP_SLOW, "ref.pt", "0", EPOCHS], cwd=cwd)
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    run = shared_run(tmp_path_factory, "ddp_slow6", make)
    return torch.load(run.cwd / "ref.pt", weights_only=True)


def _start(cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cfrun", *POLICY, "--job-dir", "j", DDP_SLOW,
                             "j.pt", SLEEP_S, EPOCHS], cwd=cwd, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_past_decision(cwd: Path, proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """Wait until rank 0 is ``AFTER_DECISION_STEPS`` past the policy's decision; its step."""
    job = cwd / "j"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        decided = [e for e in Run(0, "", "", job).events("decision")]
        try:
            step = int((job / "heartbeat-rank-00000").read_text().strip() or 0)
        except (OSError, ValueError):
            step = 0
        if decided and step >= json.loads((job / "strategy.json").read_text())[
                "effective_step"] + AFTER_DECISION_STEPS:
            return step
        time.sleep(0.02)
    raise AssertionError("the policy did not decide in time")


def _rank_process(job: Path, rank: int) -> psutil.Process:
    """The training process of ``rank`` in the newest attempt (one node: local rank = rank)."""
    pids = rank_pids(job)
    assert len(pids) > rank, f"rank {rank} not found"
    return psutil.Process(pids[rank])


def _wait_for_commit_after(job: Path, step: int, proc: subprocess.Popen,
                           timeout_s: float = RESTARTED_TIMEOUT_S) -> int:
    """Wait for a checkpoint committed after ``step``; its step. Fails when none comes (the
    bug: each checkpoint of the restarted attempt waited 600 s for a shard)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        later = [e["step"] for e in Run(0, "", "", job).events("commit") if e["step"] > step]
        if later:
            return later[0]
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint committed after step {step} in {timeout_s} s")


def _assert_clean(run: Run) -> None:
    """No step failed for a disagreement or waited for a reply; the plan of the last attempt;
    rank 0 decided once and loaded its decision at each restart."""
    assert not run.events("step_superseded"), run.events("step_superseded")
    assert not run.events("persist_lost") and not run.events("persist_failed")
    assert "no reply from the persist agent" not in run.stderr
    strategy = json.loads((run.job_dir / "strategy.json").read_text())
    assert strategy["attempt"] == run.events("attempt_start")[-1]["attempt"] == 2, strategy
    assert [e["source"] for e in run.events("decision")] == ["profile", "cache", "cache"]


def test_sigkill_of_a_rank_then_sigterm_and_resume_keep_checkpoints_committing(reference,
                                                                               tmp_path):
    """Attempt 0 decides, then rank 1 is SIGKILLed; attempt 1 commits checkpoints after its
    resume step, then cfrun gets a SIGTERM (exit 75); ``cfrun resume`` (attempt 2) commits
    checkpoints after its resume step with both ranks' shards and ends bit-identical."""
    job = tmp_path / "j"
    proc = _start(tmp_path)
    try:
        _wait_past_decision(tmp_path, proc)
        _rank_process(job, 1).kill()
        while len([e for e in Run(0, "", "", job).events("resumed")]) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        [resumed] = {e["step"] for e in Run(0, "", "", job).events("resumed")}
        _wait_for_commit_after(job, resumed, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, err[-3000:]
    [pre] = Run(75, "", err, job).events("preempted")
    assert pre["final_checkpoint"] == pre["step"], pre
    run = run_cfrun(["resume", "j"], cwd=tmp_path, timeout=RESTARTED_TIMEOUT_S)
    run.job_dir = job
    assert run.returncode == 0, run.stderr[-3000:]
    assert [e["step"] for e in run.events("resumed")][-2:] == [pre["step"]] * 2
    after = [e["step"] for e in run.events("commit") if e["step"] > pre["step"]]
    assert len(after) >= 2, (pre["step"], [e["step"] for e in run.events("commit")])
    newest = committed_steps(job / "checkpoints")[0]
    assert {p.name for p in (job / "checkpoints" / f"step-{newest:06d}").glob("rank-*.bin")} \
        == {"rank-00000.bin", "rank-00001.bin"}
    _assert_clean(run)
    assert_bit_identical(reference, torch.load(tmp_path / "j.pt", weights_only=True))
