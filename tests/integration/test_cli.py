"""The command line: bad input in-process (typer's CliRunner), pass-through, env vars, lock,
give-up and kill -9 with real processes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, cfrun_in_process, clean_env, run_cfrun, slow_reference, tiny_reference

pytestmark = pytest.mark.timeout(240)


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def existing_job(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A copy, for this test alone, of a job dir with committed checkpoints made by a real run
    (the session's shared train_tiny reference)."""
    ref, _ = tiny_reference(tmp_path_factory)
    assert list((ref.job_dir / "checkpoints").glob("step-*/manifest.json"))
    shutil.copytree(ref.job_dir, tmp_path / "job", symlinks=True)
    return tmp_path / "job"


BAD = [
    (["missing.py"], "'missing.py'"),
    (["{dir}"], "is a directory"),
    (["--interval", "0", "{script}"], "--interval '0'"),
    (["--interval", "abc", "{script}"], "--interval 'abc'"),
    (["--overhead", "150%", "{script}"], "--overhead '150%'"),
    (["--overhead", "fast", "{script}"], "--overhead 'fast'"),
    (["--overhead", "-1", "{script}"], "--overhead '-1'"),
    (["--overhead", "0", "{script}"], "--overhead '0'"),
    (["--overhead", "200%", "{script}"], "--overhead '200%'"),
    (["--mtbf", "soon", "{script}"], "--mtbf 'soon'"),
    (["--bogus", "{script}"], "--bogus"),
    (["--nproc-per-node", "0", "{script}"], "--nproc-per-node '0'"),
]


@pytest.mark.parametrize("args, needle", BAD)
def test_bad_input_is_one_line_and_changes_nothing(existing_job, tmp_path, args, needle):
    before = _tree_digest(existing_job)
    script = str(SCRIPTS / "print_argv.py")
    argv = [a.format(dir=str(SCRIPTS), script=script) for a in args]
    run = cfrun_in_process(["--job-dir", str(existing_job), *argv], cwd=tmp_path)
    assert run.returncode == 2
    lines = [l for l in run.stderr.splitlines() if l.strip()]
    assert lines[0].startswith("cfrun: error:") and needle in lines[0], run.stderr
    assert len(lines) <= 2 and "Traceback" not in run.stderr
    assert _tree_digest(existing_job) == before
    assert not (tmp_path / "cfrun-jobs").exists()


def test_bad_value_from_environment_is_named(tmp_path):
    """A real process (the one bad-input case not run in-process): the real environment."""
    run = run_cfrun([str(SCRIPTS / "print_argv.py")], cwd=tmp_path,
                    env={"CFRUN_INTERVAL": "abc"})
    assert run.returncode == 2 and "--interval 'abc'" in run.stderr
    assert not (tmp_path / "cfrun-jobs").exists()


def test_foreign_directory_is_not_used_as_job_dir(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    run = cfrun_in_process(["--job-dir", "photos", str(SCRIPTS / "print_argv.py")],
                           cwd=tmp_path)
    assert run.returncode == 2 and "not a cfrun job dir" in run.stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["cat.jpg"]


def test_script_args_pass_through_untouched_and_env_sets_options(tmp_path):
    passthrough = ["--interval", "5", "--job-dir", "elsewhere", "-x", "--", "plain"]
    env = {"CFRUN_INTERVAL": "3", "CFRUN_MAX_RESTARTS": "2"}
    run = run_cfrun([str(SCRIPTS / "print_argv.py"), *passthrough], cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr
    assert f"ARGV {json.dumps(passthrough)}" in run.stdout.splitlines()
    # it trained nothing: its default job dir is gone again (issue 37, item 4); the same
    # command's --dry-run shows what it ran with
    assert not (tmp_path / "cfrun-jobs").exists()
    dry = run_cfrun(["--dry-run", str(SCRIPTS / "print_argv.py"), *passthrough], cwd=tmp_path,
                    env=env)
    config = json.loads(dry.stdout)["config"]
    assert config["job_dir"].startswith(str(tmp_path / "cfrun-jobs" / "print_argv-"))
    assert config["interval"] == 3 and config["max_restarts"] == 2
    assert config["script_args"] == passthrough
    assert not (tmp_path / "elsewhere").exists()


def test_restarts_run_out_exit_4_with_cause(tmp_path):
    # the script fails before any step: without the option the second such failure stops the
    # job with code 5 (tests/integration/test_launch_failures.py)
    run = run_cfrun(["--max-restarts", "1", "--retry-before-first-step", "--job-dir", "j",
                     str(SCRIPTS / "fail_always.py")], cwd=tmp_path)
    assert run.returncode == 4
    assert "exit code" in run.stderr and "--max-restarts 1" in run.stderr
    assert run.stdout.count("about to fail") == 2
    assert [e["attempt"] for e in run.events("attempt_start")] == [0, 1]


def test_second_cfrun_on_live_job_dir_is_refused(tmp_path):
    release, started = tmp_path / "release", tmp_path / "started"
    args = [sys.executable, "-m", "cfrun", "--job-dir", "j", str(SCRIPTS / "wait_for_file.py"),
            str(release), str(started)]
    first = subprocess.Popen(args, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not started.exists():
            assert time.time() < deadline and first.poll() is None, "first cfrun did not start"
            time.sleep(0.05)
        second = run_cfrun(["--job-dir", "j", str(SCRIPTS / "wait_for_file.py"), str(release),
                            str(tmp_path / "started2")], cwd=tmp_path)
        assert second.returncode == 3 and "in use by another cfrun" in second.stderr
        assert not (tmp_path / "started2").exists()
        release.touch()
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert "done waiting" in out
    # the lock died with its owner: a new run of the job on the same job dir is accepted
    again = run_cfrun(["--job-dir", "j", str(SCRIPTS / "wait_for_file.py"), str(release),
                       str(started)], cwd=tmp_path)
    assert again.returncode == 0, again.stderr


def _alive(pids: set[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
def test_sigkilled_cfrun_leaves_no_process_and_the_same_command_resumes(tmp_path,
                                                                        tmp_path_factory):
    """kill -9 of cfrun alone: its agent, torchrun and ranks die with it (they would go on
    training into the job dir and hold the agent socket); the same command then resumes."""
    import signal

    import psutil
    import torch
    from conftest import assert_bit_identical

    slow = str(SCRIPTS / "slow_steps.py")
    _, ref_state = slow_reference(tmp_path_factory)  # the same 60 steps, uninterrupted
    args = ["--interval", "5", "--job-dir", "j", slow, "60", "out.pt", "0.05"]
    proc = subprocess.Popen([sys.executable, "-m", "cfrun", *args], cwd=tmp_path,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.time() + 90
        while not list((tmp_path / "j" / "checkpoints").glob("step-*/manifest.json")):
            assert time.time() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(tree) >= 3  # at least the agent, torchrun and the rank
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)  # not communicate(): survivors would hold its pipes open
        deadline = time.time() + 5
        while _alive(tree) and time.time() < deadline:
            time.sleep(0.1)
        assert not _alive(tree), [psutil.Process(p).cmdline() for p in _alive(tree)]
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _alive(tree):  # without the fix: do not leave them running
            psutil.Process(p).kill()
        proc.stdout.close()
        proc.stderr.close()
    again = run_cfrun(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(again.events("resumed")) == 1
    assert_bit_identical(ref_state, torch.load(tmp_path / "out.pt", weights_only=True))


@pytest.mark.slow
def test_crash_loop_names_the_first_failing_rank_not_a_peer_transport_error(tmp_path):
    """Only rank 1 raises; rank 0 then fails in gloo with 'Connection closed by peer
    [127.0.0.1]:<a new port each attempt>'. The crash loop is still detected (exit 5) and
    reported with rank 1's ValueError (--crash-loop 2 keeps it short)."""
    run = run_cfrun(["--interval", "5", "--max-restarts", "3", "--crash-loop", "2",
                     "--nproc-per-node", "2", "--job-dir", "j",
                     str(SCRIPTS / "fail_rank_at_step.py"), "12", "1"], cwd=tmp_path)
    assert run.returncode == 5, run.stderr[-3000:]
    last = [l for l in run.stderr.splitlines() if l.startswith("cfrun: error:")]
    assert last and "crash loop" in last[-1], run.stderr[-3000:]
    assert "ValueError: bad batch at step 12 on rank 1" in last[-1]
    assert len(run.events("attempt_start")) == 2
    failures = run.events("failure")
    assert [f["error"]["rank"] for f in failures] == [1, 1]
    # rank 0's gloo error is one line per attempt, its traceback kept in errors/ (issue 27,
    # item 5); rank 1's own traceback (the user's error) is printed as Python prints it
    notes = [l for l in run.stderr.splitlines() if "a consequence of another rank's failure" in l]
    assert len(notes) == 2 and all(l.startswith("[cfrun rank 0] ") for l in notes), run.stderr
    assert "[rank0]: Traceback" not in run.stderr and "[rank1]: Traceback" in run.stderr
    kept = json.loads((run.job_dir / "errors" / "attempt-0-rank-0.json").read_text())
    assert "Connection closed by peer" in "".join(kept["traceback"])


@pytest.mark.slow
def test_resume_from_elsewhere_uses_the_recorded_cwd_and_env(tmp_path):
    """`cfrun resume /abs/job` from another directory with a cleared environment runs the
    script in the recorded cwd with the recorded OMP_NUM_THREADS."""
    import os

    origin, elsewhere = tmp_path / "origin", tmp_path / "elsewhere"
    origin.mkdir()
    elsewhere.mkdir()
    first = run_cfrun(["--interval", "5", "--max-restarts", "0", "--job-dir", "job",
                       str(SCRIPTS / "cwd_env_probe.py"), "probe.jsonl"], cwd=origin,
                      env={"OMP_NUM_THREADS": "3"})
    assert first.returncode == 4, first.stderr[-2000:]
    bare = {k: os.environ[k] for k in ("PATH", "PYTHONPATH", "HOME") if k in os.environ}
    p = subprocess.run([sys.executable, "-m", "cfrun", "resume", str(origin / "job")],
                       cwd=elsewhere, env=bare, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "FINAL done" in p.stdout
    assert not (elsewhere / "probe.jsonl").exists()
    probes = [json.loads(l) for l in (origin / "probe.jsonl").read_text().splitlines()]
    assert probes == [{"cwd": str(origin), "omp": "3", "attempt": "0"},
                      {"cwd": str(origin), "omp": "3", "attempt": "1"}]


@pytest.mark.skipif(__import__("shutil").which("unshare") is None,
                    reason="needs util-linux unshare")
def test_as_pid_1_hup_quit_usr1_usr2_reach_the_script(tmp_path):
    """The kernel drops signals that PID 1 has no handler for; cfrun as PID 1 passes SIGHUP,
    SIGQUIT, SIGUSR1 and SIGUSR2 on to the ranks, whose own handlers get them."""
    import signal

    import psutil

    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no permission for PID namespaces here")
    names = ["SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"]
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m",
                             "cfrun", "--interval", "5", "--job-dir", "j",
                             str(SCRIPTS / "signal_probe.py"), "got.txt", *names],
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        hb = tmp_path / "j" / "heartbeat-rank-00000"
        deadline = time.time() + 60
        while not (hb.exists() and hb.read_text().strip() not in ("", "0")):
            assert time.time() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        [pid1] = psutil.Process(proc.pid).children()  # cfrun, PID 1 inside the namespace
        for name in names:
            pid1.send_signal(getattr(signal, name))
            time.sleep(0.3)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert sorted((tmp_path / "got.txt").read_text().split()) == sorted(names)
    assert "FINAL got" in out
