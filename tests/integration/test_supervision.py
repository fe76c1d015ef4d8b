"""Preemption (SIGTERM to cfrun), hangs, crash loops, and cfrun as PID 1 in a PID namespace."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from conftest import SCRIPTS, Run, assert_bit_identical, clean_env, run_cfrun

pytestmark = pytest.mark.timeout(300)
SLOW = str(SCRIPTS / "slow_steps.py")
DDP_SLOW = str(SCRIPTS / "train_ddp_slow.py")
DEFAULT_GRACE_S = 25.0


def _start(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cfrun", *args], cwd=cwd,
                            env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_step(cwd: Path, job: str, step: int, proc: subprocess.Popen, timeout_s=90) -> None:
    hb = cwd / job / "heartbeat-rank-00000"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            if int(hb.read_text().strip() or 0) >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


def _descendants_gone(pid: int, before: set[int]) -> None:
    alive = [p for p in before if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes survived cfrun: {alive}"


def _grace_s(extra: list[str]) -> float:
    return float(extra[extra.index("--grace") + 1]) if "--grace" in extra else DEFAULT_GRACE_S


def _sigterm_run(cwd: Path, job: str, extra: list[str], at_step: int,
                 env: dict[str, str] | None = None, *, sig: int = signal.SIGTERM,
                 script: list[str] | None = None, second_after_s: float | None = None,
                 ) -> tuple[Run, set[int], float]:
    """Start cfrun, send ``sig`` once rank 0 is past ``at_step`` (and the same signal again
    ``second_after_s`` later); returns the run, the pids of its process tree at the signal,
    and the seconds from the (first) signal to cfrun's exit."""
    script = script or [SLOW, "60", f"{job}.pt", "0.05"]
    proc = _start(["--interval", "5", "--job-dir", job, *extra, *script], cwd, env)
    _wait_for_step(cwd, job, at_step, proc)
    tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    t0 = time.monotonic()
    proc.send_signal(sig)
    if second_after_s is not None:
        time.sleep(second_after_s)
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    elapsed_s = time.monotonic() - t0
    assert elapsed_s <= _grace_s(extra) + 3.0, (elapsed_s, err[-2000:])
    return Run(proc.returncode, out, err, cwd / job), tree, elapsed_s


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ref")
    run = run_cfrun(["--interval", "5", "--job-dir", "ref", SLOW, "60", "ref.pt", "0"], cwd=cwd)
    assert run.returncode == 0, run.stderr[-2000:]
    return torch.load(cwd / "ref.pt", weights_only=True)


def _resume_and_compare(cwd: Path, job: str, reference, preempted_at: int | None,
                        nranks: int = 1) -> None:
    run = run_cfrun(["resume", job], cwd=cwd)
    run.job_dir = cwd / job
    assert run.returncode == 0, run.stderr[-2000:]
    resumed = [e["step"] for e in run.events("resumed")]
    if preempted_at is not None:  # nothing recomputed: the final checkpoint is the stop step
        assert resumed == [preempted_at] * nranks
    assert_bit_identical(reference, torch.load(cwd / f"{job}.pt", weights_only=True))


def test_sigterm_takes_final_checkpoint_exits_75_and_resumes_exactly(reference, tmp_path):
    run, tree, _ = _sigterm_run(tmp_path, "j", [], at_step=12)
    assert run.returncode == 75, run.stderr[-2000:]
    [pre] = run.events("preempted")
    assert pre["final_checkpoint"] == pre["step"] >= 12
    assert "resume with: cfrun resume" in run.stderr
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, pre["step"])


def test_sigterm_during_a_persist_waits_for_it_then_checkpoints(reference, tmp_path):
    run, tree, _ = _sigterm_run(tmp_path, "j", ["--grace", "20"], at_step=11,
                             env={"CFRUN_TEST_AGENT_SLOW_S": "0.6"})
    assert run.returncode == 75, run.stderr[-2000:]
    [pre] = run.events("preempted")
    assert pre["final_checkpoint"] == pre["step"]
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, pre["step"])


def test_grace_too_short_keeps_last_committed_and_says_so(reference, tmp_path):
    run, tree, _ = _sigterm_run(tmp_path, "j", ["--grace", "0.3"], at_step=12,
                             env={"CFRUN_TEST_AGENT_SLOW_S": "1.0"})
    assert run.returncode == 75, run.stderr[-2000:]
    pre = run.events("preempted")
    if pre:  # the ranks got to say it before the deadline
        assert pre[0]["final_checkpoint"] is None
        assert "no time for a final checkpoint" in run.stderr
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, None)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ddpref")
    run = run_cfrun(["--nproc-per-node", "2", "--interval", "5", "--job-dir", "ref", DDP_SLOW,
                     "ref.pt", "0"], cwd=cwd)
    assert run.returncode == 0, run.stderr[-2000:]
    return torch.load(cwd / "ref.pt", weights_only=True)


def test_sigterm_with_two_ranks_one_stop_step_and_one_final_checkpoint(ddp_reference, tmp_path):
    """Both ranks stop at the same step and the final checkpoint holds both shards; no rank is
    killed by torchrun because another one exited first (persists slowed: the signal may land
    during one)."""
    run, tree, _ = _sigterm_run(tmp_path, "j", ["--nproc-per-node", "2"], at_step=12,
                                env={"CFRUN_TEST_AGENT_SLOW_S": "0.6"},
                                script=[DDP_SLOW, "j.pt", "0.1"])
    assert run.returncode == 75, run.stderr[-3000:]
    [pre] = run.events("preempted")
    assert pre["final_checkpoint"] == pre["step"] >= 12, pre
    assert pre["ranks_stopped"] == 2
    step_dir = tmp_path / "j" / "checkpoints" / f"step-{pre['step']:06d}"
    assert {p.name for p in step_dir.glob("rank-*.bin")} == {"rank-00000.bin", "rank-00001.bin"}
    assert "FINAL done" not in run.stdout  # the script's code after the loop did not run
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", ddp_reference, pre["step"], nranks=2)


def test_hung_rank_is_killed_and_the_job_restarts(reference, tmp_path):
    run = run_cfrun(["--interval", "5", "--hang-timeout", "2", "--job-dir", "j", SLOW, "60",
                     "j.pt", "0.03", "17"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.events("hang")) == 1
    [resumed] = [e["step"] for e in run.events("resumed")]
    assert 15 <= resumed <= 17  # the checkpoint due at 15, or deferred while 10 persisted
    assert_bit_identical(reference, torch.load(tmp_path / "j.pt", weights_only=True))


def test_crash_loop_stops_with_fatal_code_and_the_error(tmp_path):
    run = run_cfrun(["--interval", "5", "--max-restarts", "10", "--crash-loop", "3",
                     "--job-dir", "j", str(SCRIPTS / "fail_at_step.py"), "12"], cwd=tmp_path)
    assert run.returncode == 5
    assert "crash loop" in run.stderr and "ValueError: bad batch at step 12" in run.stderr
    assert len(run.events("attempt_start")) == 3


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_as_pid_1_reaps_orphans_and_forwards_sigterm(tmp_path):
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no permission for PID namespaces here")
    base = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "cfrun"]
    done = subprocess.run([*base, "--job-dir", "o", str(SCRIPTS / "orphans.py")], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "zombies: []" in done.stdout
    proc = subprocess.Popen([*base, "--interval", "5", "--job-dir", "j", SLOW, "60", "j.pt",
                             "0.05"], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_step(tmp_path, "j", 8, proc)
    [cfrun_pid1] = psutil.Process(proc.pid).children()  # PID 1 inside the namespace
    cfrun_pid1.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert Run(0, "", "", tmp_path / "j").events("preempted")[0]["final_checkpoint"] is not None


def test_a_rank_dying_in_teardown_after_the_script_finished_is_not_restarted(tmp_path):
    """torch 2.13 + gloo sometimes SIGABRTs in C++ destructors after the script is done
    ("terminate called without an active exception"): the job is done, not restarted."""
    run = run_cfrun(["--interval", "10", "--job-dir", "j", str(SCRIPTS / "end_then_die.py"),
                     "abort", "out.pt"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == 1
    [td] = run.events("teardown_failure")
    assert td["returncode"] != 0
    assert run.stdout.count("FINAL done") == 1


def test_a_script_exiting_nonzero_after_training_is_still_a_failure(tmp_path):
    run = run_cfrun(["--interval", "10", "--max-restarts", "0", "--job-dir", "j",
                     str(SCRIPTS / "end_then_die.py"), "exit3", "out.pt"], cwd=tmp_path)
    assert run.returncode == 4, run.stderr[-3000:]
    assert not run.events("teardown_failure")
