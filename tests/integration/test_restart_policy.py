"""Issue 22: the overhead policy keeps protecting a 2-rank job after every restart.

Real 2-rank DDP jobs (gloo, train_ddp_slow.py, 5 epochs of 32 steps) under the policy (no
``--interval``; a 30% budget so that the chosen interval is a few steps and several checkpoints
fall after the restart; the default 3.5% chooses the same way, with larger intervals), long
enough that profiling ends and rank 0 decides (~step 55). After the decision one rank is
SIGKILLed (rank 1, from outside, as the report's OOM kill), or cfrun gets a SIGTERM and the
job goes on with ``cfrun resume``. Before the fix every rank loaded the cached profile, but
only rank 1 took its starting step from the previous attempt's ``strategy.json``: the ranks
checkpointed at different steps and every checkpoint waited 600 s for the other rank's shard.
Now the restarted attempt commits checkpoints with both ranks' shards after its resume step,
no step is failed for a disagreement, no rank waits for a reply, and the job ends bit-identical
to an uninterrupted run.
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
from conftest import SCRIPTS, Run, assert_bit_identical, clean_env, run_cfrun, shared_run

from cfrun.codec.checkpoint import committed_steps

pytestmark = pytest.mark.timeout(300)
DDP_SLOW = str(SCRIPTS / "train_ddp_slow.py")
POLICY = ["--nproc-per-node", "2", "--overhead", "30%"]
SLEEP_S, EPOCHS = "0.02", "5"
AFTER_DECISION_STEPS = 12
"""Steps past rank 0's decision at which the job is interrupted (a tuned checkpoint or two)."""
RESTARTED_TIMEOUT_S = 150
"""The interrupted job's bound: a restarted attempt that waits 600 s for a shard fails it."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job, uninterrupted (its bits do not depend on the interval; no sleep)."""
    def make(cwd: Path) -> Run:
        run = run_cfrun(["--nproc-per-node", "2", "--interval", "20", "--job-dir", "ref",
                         DDP_SLOW, "ref.pt", "0", EPOCHS], cwd=cwd)
        assert run.returncode == 0, run.stderr[-3000:]
        return run

    run = shared_run(tmp_path_factory, "ddp_slow5", make)
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


def _rank_process(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """The training process of ``rank`` among cfrun's descendants."""
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if p.environ().get("RANK") == str(rank) and DDP_SLOW in p.cmdline():
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"rank {rank} not found")


def _assert_protected_after(run: Run, resumed_step: int, reference: dict) -> None:
    """After the restart at ``resumed_step``: checkpoints with both ranks' shards committed, no
    step failed for a disagreement or waited for a reply, the plan of this attempt, the final
    state bit-identical."""
    assert [e["step"] for e in run.events("resumed")] == [resumed_step] * 2, run.stderr[-3000:]
    after = [e["step"] for e in run.events("commit") if e["step"] > resumed_step]
    assert len(after) >= 2, (resumed_step, [e["step"] for e in run.events("commit")])
    for step in after:
        if step in committed_steps(run.job_dir / "checkpoints"):  # retention keeps the newest
            names = {p.name for p in (run.job_dir / "checkpoints" / f"step-{step:06d}").iterdir()}
            assert {"rank-00000.bin", "rank-00001.bin"} <= names, names
    assert not run.events("step_superseded"), run.events("step_superseded")
    assert not run.events("persist_lost") and not run.events("persist_failed")
    assert "no reply from the persist agent" not in run.stderr
    strategy = json.loads((run.job_dir / "strategy.json").read_text())
    assert strategy["attempt"] == run.events("attempt_start")[-1]["attempt"] == 1, strategy
    assert [e["source"] for e in run.events("decision")] == ["profile", "cache"]
    assert_bit_identical(reference, torch.load(run.job_dir.parent / "j.pt", weights_only=True))


def test_sigkill_of_one_rank_after_the_decision_keeps_checkpoints_committing(reference,
                                                                            tmp_path):
    proc = _start(tmp_path)
    try:
        _wait_past_decision(tmp_path, proc)
        _rank_process(proc, 1).kill()
        out, err = proc.communicate(timeout=RESTARTED_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    run = Run(proc.returncode, out, err, tmp_path / "j")
    assert run.returncode == 0, err[-3000:]
    assert len(run.events("attempt_start")) == 2, err[-3000:]
    [resumed] = {e["step"] for e in run.events("resumed")}
    _assert_protected_after(run, resumed, reference)


def test_sigterm_then_resume_keeps_checkpoints_committing(reference, tmp_path):
    proc = _start(tmp_path)
    try:
        _wait_past_decision(tmp_path, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 75, err[-3000:]
    [pre] = Run(75, "", err, tmp_path / "j").events("preempted")
    assert pre["final_checkpoint"] == pre["step"], pre
    run = run_cfrun(["resume", "j"], cwd=tmp_path, timeout=RESTARTED_TIMEOUT_S)
    run.job_dir = tmp_path / "j"
    assert run.returncode == 0, run.stderr[-3000:]
    _assert_protected_after(run, pre["step"], reference)
