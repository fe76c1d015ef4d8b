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
from conftest import (
    SCRIPTS,
    Run,
    assert_bit_identical,
    clean_env,
    over_recompute_bound,
    run_cfrun,
    slow_reference,
)

from cfrun.codec.checkpoint import committed_steps
from cfrun.contract import faults
from cfrun.contract.jobdir import JobDir

pytestmark = [pytest.mark.timeout(300), pytest.mark.launched]  # as users launch
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


def _wait_for_persist(cwd: Path, job: str, proc: subprocess.Popen, timeout_s=90) -> None:
    """A checkpoint is committed and the next one is being persisted (its staging dir)."""
    ckpts = cwd / job / "checkpoints"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if committed_steps(ckpts) and any(ckpts.glob(".staging-*")):
            return
        time.sleep(0.01)
    raise AssertionError("no persist in flight after a commit")


def _descendants_gone(pid: int, before: set[int]) -> None:
    alive = [p for p in before if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes survived cfrun: {alive}"


def _grace_s(extra: list[str]) -> float:
    return float(extra[extra.index("--grace") + 1]) if "--grace" in extra else DEFAULT_GRACE_S


def _sigterm_run(cwd: Path, job: str, extra: list[str], at_step: int,
                 env: dict[str, str] | None = None, *, sig: int = signal.SIGTERM,
                 script: list[str] | None = None, second_after_s: float | None = None,
                 during_persist: bool = False) -> tuple[Run, set[int], float]:
    """Start cfrun, send ``sig`` once rank 0 is past ``at_step`` (and the same signal again
    ``second_after_s`` later); returns the run, the pids of its process tree at the signal,
    and the seconds from the (first) signal to the supervisor's final ``preempted`` state
    (its own interpreter exit, ~1 s with torch imported on a loaded machine, comes after)."""
    script = script or [SLOW, "60", f"{job}.pt", "0.05"]
    proc = _start(["--interval", "5", "--job-dir", job, *extra, *script], cwd, env)
    _wait_for_step(cwd, job, at_step, proc)
    if during_persist:
        _wait_for_persist(cwd, job, proc)
    tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    t0 = time.monotonic()
    t0_unix_s = time.time()
    proc.send_signal(sig)
    if second_after_s is not None:
        time.sleep(second_after_s)
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    exit_s = time.monotonic() - t0
    assert exit_s <= _grace_s(extra) + 3.0, (exit_s, err[-2000:])
    run = Run(proc.returncode, out, err, cwd / job)
    states = [e for e in run.events("state") if e["state"] == "preempted"]
    stopped_s = states[-1]["t_unix_s"] - t0_unix_s if states else exit_s
    return run, tree, stopped_s


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """slow_steps.py, 60 steps, uninterrupted: the final state (shared with other modules)."""
    return slow_reference(tmp_path_factory)[1]


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


@pytest.mark.slow
def test_sigterm_during_a_persist_waits_for_it_then_checkpoints(reference, tmp_path):
    run, tree, _ = _sigterm_run(tmp_path, "j", ["--grace", "20"], at_step=11,
                             env=faults.arm({}, **{"agent.commit_delay_s": 0.6}))
    assert run.returncode == 75, run.stderr[-2000:]
    [pre] = run.events("preempted")
    assert pre["final_checkpoint"] == pre["step"]
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, pre["step"])


@pytest.mark.timing
@pytest.mark.slow
def test_grace_too_short_keeps_last_committed_and_says_so(reference, tmp_path):
    run, tree, _ = _sigterm_run(tmp_path, "j", ["--grace", "0.3"], at_step=12,
                                env=faults.arm({}, **{"agent.commit_delay_s": 1.0}),
                                during_persist=True)
    assert run.returncode == 75, run.stderr[-2000:]
    [pre] = run.events("preempted")
    newest = committed_steps(tmp_path / "j" / "checkpoints")[0]
    assert pre["final_checkpoint"] is None and pre["newest_committed"] == newest
    assert f"no final checkpoint; newest committed is step {newest}" in run.stderr
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, newest)


@pytest.mark.slow
def test_sigint_takes_final_checkpoint_exits_75(reference, tmp_path):
    run, tree, _ = _sigterm_run(tmp_path, "j", [], at_step=12, sig=signal.SIGINT)
    assert run.returncode == 75, run.stderr[-2000:]
    [pre] = run.events("preempted")
    assert pre["final_checkpoint"] == pre["step"] >= 12 and pre["signal"] == "SIGINT"
    assert "FINAL done" not in run.stdout  # the script's code after the loop did not run
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, pre["step"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_a_stop_while_cfrun_starts_exits_75_and_the_job_resumes_exactly(reference, tmp_path, sig):
    """A scheduler's SIGTERM in the second cfrun spends importing and checking the job dir,
    before the supervisor's handlers exist (the start made slow by a fault point), is held from
    cfrun's first line and reported as a preemption: exit 75, no rank started, then the job
    runs from the start to the same bits (it was -15 and no word before)."""
    env = faults.arm({}, **{"supervisor.start_delay_s": 3.0})
    proc = _start(["--interval", "5", "--job-dir", "j", SLOW, "60", "j.pt", "0.05"], tmp_path,
                  env)
    # the signal lands in the slow start: once the job dir is locked (cfrun's first line has
    # run long before), not after a fixed second (a loaded machine took longer to get there)
    deadline = time.time() + 60
    while not JobDir(tmp_path / "j").lock_path.exists() and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    run = Run(proc.returncode, out, err, tmp_path / "j")
    assert run.returncode == 75, (run.returncode, err[-2000:])
    assert not run.events("attempt_start")
    [pre] = run.events("preempted")
    assert pre["signal"] == sig.name and pre["final_checkpoint"] is None
    assert "none committed before (the job starts over)" in err
    assert f"stopped by {sig.name}; resume with: cfrun resume" in err
    _resume_and_compare(tmp_path, "j", reference, None)


@pytest.mark.slow
def test_a_sigterm_python_drops_in_a_finalizer_still_stops_the_job(reference, tmp_path):
    """A signal handler's exception raised inside a finalizer (a ``__del__``) is printed and
    dropped by Python: a fault storm in CI SIGTERMed cfrun 3 s after its start, and the ranks
    then trained 22 s to their end (exit 0, no final checkpoint). The supervisor now keeps the
    stop and raises it again within 0.1 s. The SIGTERM lands in a 5 s ``__del__`` the
    supervisor runs right after it started the attempt (a fault point)."""
    env = faults.arm({}, **{"supervisor.finalizer_delay_s": 5.0})
    proc = _start(["--interval", "5", "--job-dir", "j", SLOW, "60", "j.pt", "0.2"], tmp_path,
                  env)
    events = tmp_path / "j" / "events.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (
            events.exists() and '"attempt_start"' in events.read_text()):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    time.sleep(1.0)  # the attempt's spawn has returned: the supervisor is in the finalizer
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    run = Run(proc.returncode, out, err, tmp_path / "j")
    assert run.returncode == 75, (run.returncode, err[-2000:])
    assert "Exception ignored" in err  # the fault point did put the signal in a finalizer
    assert "FINAL done" not in out  # the script was stopped, not run to its end
    [pre] = run.events("preempted")
    assert pre["signal"] == "SIGTERM"
    _resume_and_compare(tmp_path, "j", reference, pre["final_checkpoint"])


@pytest.mark.slow
def test_a_command_that_runs_no_job_still_ends_on_sigterm(tmp_path):
    """``cfrun status --watch`` runs no supervisor: the SIGTERM held while cfrun starts is let
    go at once, so it ends the watch as it would any program (it was ignored for good)."""
    env = faults.arm({}, **{"supervisor.start_delay_s": 8.0})
    job = _start(["--job-dir", "j", SLOW, "60", "j.pt", "0.05"], tmp_path, env)
    deadline = time.time() + 30  # a live supervisor, held in its slow start: a job to watch
    while not (tmp_path / "j" / "config.json").exists() and time.time() < deadline:
        time.sleep(0.1)
    watch_out = tmp_path / "watch.out"
    with open(watch_out, "w") as out_f:
        proc = subprocess.Popen([sys.executable, "-m", "cfrun", "status", "--watch", "j"],
                                cwd=tmp_path, env=clean_env(), stdout=out_f,
                                stderr=subprocess.PIPE, text=True)
    try:
        # watching: its first refresh is out (on a busy machine the start alone takes seconds)
        deadline = time.time() + 60
        while watch_out.stat().st_size == 0 and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)  # the watch would go on as long as the job
        assert proc.returncode == -signal.SIGTERM, (proc.returncode, watch_out.read_text()[-500:],
                                                    err[-1000:])
    finally:
        proc.kill()
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=300) == 75


@pytest.mark.timing
@pytest.mark.slow
def test_grace_1s_with_a_slow_persist_exits_in_time_and_keeps_the_newest(reference, tmp_path):
    """The agent is still persisting at the deadline: it is killed, cfrun exits 75 within
    a few seconds after the grace, and the newest committed checkpoint stays the resume point."""
    # 0.4 s steps: a due checkpoint no longer waits for the 8 s persist (it is deferred), so
    # the job must outlast the first commit for a persist to be in flight after it
    run, tree, elapsed_s = _sigterm_run(tmp_path, "j", ["--grace", "1"], at_step=12,
                                        env=faults.arm({}, **{"agent.commit_delay_s": 8}),
                                        script=[SLOW, "60", "j.pt", "0.4"], during_persist=True)
    assert run.returncode == 75, run.stderr[-2000:]
    # killed at the 1 s deadline (plus teardown on a loaded machine), not when the 8 s persist ends
    assert elapsed_s < 4.0, elapsed_s
    [pre] = run.events("preempted")
    newest = committed_steps(tmp_path / "j" / "checkpoints")[0]
    assert pre["final_checkpoint"] is None and pre["newest_committed"] == newest
    assert f"no final checkpoint; newest committed is step {newest}" in run.stderr
    _descendants_gone(0, tree)  # the agent included
    _resume_and_compare(tmp_path, "j", reference, newest)


@pytest.mark.timing
@pytest.mark.slow
def test_second_signal_during_a_slow_persist_ends_at_once(reference, tmp_path):
    run, tree, elapsed_s = _sigterm_run(tmp_path, "j", ["--grace", "20"], at_step=12,
                                        env=faults.arm({}, **{"agent.commit_delay_s": 3}),
                                        script=[SLOW, "60", "j.pt", "0.3"], during_persist=True,
                                        second_after_s=0.3)
    assert run.returncode == 75, run.stderr[-2000:]
    assert elapsed_s < 0.3 + 2.5, elapsed_s  # at once, not at the 20 s deadline
    assert "second signal" in run.stderr
    [pre] = run.events("preempted")
    newest = committed_steps(tmp_path / "j" / "checkpoints")[0]
    assert pre["final_checkpoint"] is None and pre["newest_committed"] == newest
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, newest)


@pytest.mark.timing
@pytest.mark.slow
def test_step_longer_than_the_grace_ranks_killed_and_it_says_so(reference, tmp_path):
    """The rank is inside a long step (it sleeps at step 12) when the grace runs out."""
    proc = _start(["--interval", "5", "--grace", "1", "--job-dir", "j", SLOW, "60", "j.pt",
                   "0.05", "12"], tmp_path)
    _wait_for_step(tmp_path, "j", 12, proc)
    while 10 not in committed_steps(tmp_path / "j" / "checkpoints"):
        assert proc.poll() is None
        time.sleep(0.05)
    tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert time.monotonic() - t0 <= 1 + 3.0
    assert proc.returncode == 75, err[-2000:]
    assert "did not stop within --grace" in err
    assert "no final checkpoint; newest committed is step 10" in err
    [pre] = Run(75, out, err, tmp_path / "j").events("preempted")
    assert pre["step"] == 12 and pre["final_checkpoint"] is None
    assert pre["newest_committed"] == 10 and pre["ranks_stopped"] == 0
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", reference, 10)


@pytest.mark.parametrize("case", ["during_spawn", "during_stop_agent"])
def test_signal_races_leave_no_process(tmp_path, case):
    """A signal between torchrun's start and its Popen being recorded; a signal while a
    finished job stops the agent (it must neither escape as a traceback nor leave the agent)."""
    import json

    done = subprocess.run([sys.executable, str(SCRIPTS / "signal_races.py"), "j", case],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pids = [result[k] for k in ("child", "agent") if result.get(k)]
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        psutil.Process(p).kill()
    assert result["rc"] == (75 if case == "during_spawn" else 0), done.stderr[-2000:]
    assert not alive, done.stderr[-2000:]


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ddpref")
    run = run_cfrun(["--nproc-per-node", "2", "--interval", "5", "--job-dir", "ref", DDP_SLOW,
                     "ref.pt", "0"], cwd=cwd)
    assert run.returncode == 0, run.stderr[-2000:]
    return torch.load(cwd / "ref.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [pytest.param("torchrun", marks=pytest.mark.extended),
                                      "python"])
def test_sigterm_with_two_ranks_one_stop_step_and_one_final_checkpoint(ddp_reference, tmp_path,
                                                                        launcher):
    """Both ranks stop at the same step and the final checkpoint holds both shards; no rank is
    killed by torchrun (or by cfrun, which starts them itself with ``--launcher python``)
    because another one exited first (persists slowed: the signal may land during one)."""
    run, tree, _ = _sigterm_run(tmp_path, "j", ["--launcher", launcher, "--nproc-per-node", "2"],
                                at_step=12,
                                env=faults.arm({}, **{"agent.commit_delay_s": 0.6}),
                                script=[DDP_SLOW, "j.pt", "0.1"])
    assert run.returncode == 75, run.stderr[-3000:]
    [pre] = run.events("preempted")
    assert "ChildFailedError" not in run.stderr  # torchrun saw no failed rank
    assert "FINAL done" not in run.stdout  # the script's code after the loop did not run
    assert pre["final_checkpoint"] == pre["step"] >= 12, pre
    step_dir = tmp_path / "j" / "checkpoints" / f"step-{pre['step']:06d}"
    assert {p.name for p in step_dir.glob("rank-*.bin")} == {"rank-00000.bin", "rank-00001.bin"}
    assert pre["ranks_stopped"] == 2  # both ranks reached the stop step and said so
    _descendants_gone(0, tree)
    _resume_and_compare(tmp_path, "j", ddp_reference, pre["step"], nranks=2)


def test_hung_rank_is_killed_and_the_job_restarts(reference, tmp_path):
    # 8 s: with 4 s, a quick-tier run on 2 loaded cores once went 4 s without a step in the
    # resumed attempt too, and killed it as hung a second time
    run = run_cfrun(["--interval", "5", "--hang-timeout", "8", "--job-dir", "j", SLOW, "60",
                     "j.pt", "0.03", "17"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(run.events("hang")) == 1
    [resumed] = [e["step"] for e in run.events("resumed")]
    # the checkpoint due at 15, or deferred while 10 persisted (then 10 if past the hang)
    assert 15 <= resumed <= 17 or not over_recompute_bound(run, [17], [resumed], 5), resumed
    assert_bit_identical(reference, torch.load(tmp_path / "j.pt", weights_only=True))


@pytest.mark.slow
def test_crash_loop_stops_with_fatal_code_and_the_error(tmp_path):
    run = run_cfrun(["--interval", "5", "--max-restarts", "10", "--crash-loop", "3",
                     "--job-dir", "j", str(SCRIPTS / "fail_at_step.py"), "12"], cwd=tmp_path)
    assert run.returncode == 5
    assert "crash loop" in run.stderr and "ValueError: bad batch at step 12" in run.stderr
    assert len(run.events("attempt_start")) == 3


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
@pytest.mark.slow
def test_as_pid_1_reaps_orphans_and_forwards_sigterm(tmp_path):
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no permission for PID namespaces here")
    base = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "cfrun"]
    done = subprocess.run([*base, "--job-dir", "o", str(SCRIPTS / "orphans.py")], cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "zombies: []" in done.stdout
    proc = subprocess.Popen([*base, "--interval", "5", "--job-dir", "j", SLOW, "60", "j.pt",
                             "0.05"], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_step(tmp_path, "j", 8, proc)
    [cfrun_pid1] = psutil.Process(proc.pid).children()  # PID 1 inside the namespace
    cfrun_pid1.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    assert Run(0, "", "", tmp_path / "j").events("preempted")[0]["final_checkpoint"] is not None


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_script_exiting_nonzero_after_training_is_still_a_failure(tmp_path):
    run = run_cfrun(["--interval", "10", "--max-restarts", "0", "--job-dir", "j",
                     str(SCRIPTS / "end_then_die.py"), "exit3", "out.pt"], cwd=tmp_path)
    assert run.returncode == 4, run.stderr[-3000:]
    assert not run.events("teardown_failure")
