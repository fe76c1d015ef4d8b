"""``cfrun status`` finds the job (issue 27, item 4) and tells one overhead (item 3).

Two tiny real jobs in their default job dirs under ``./cfrun-jobs``: one that succeeds, one
that fails (``--max-restarts 0``). ``status`` with no argument or with ``cfrun-jobs`` lists
them, one line each; with a script path it shows that script's job; a failed job shows the
command that resumes it."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import SCRIPTS, cfrun_in_process, resumable_steps, run_cfrun, shared_run

# one xdist worker runs the module, so its module-scoped run is made once, not once per
# worker (issue 27, item 9)
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("status_find")]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The working directory of the two jobs (read-only: tests copy it to change it)."""

    def make(cwd):
        shutil.copy(SCRIPTS / "train_tiny.py", cwd / "train.py")
        shutil.copy(SCRIPTS / "digits.py", cwd / "digits.py")
        # fails after its first steps: a job dir stays only for a run that trained (issue 37)
        shutil.copy(SCRIPTS / "fail_at_step.py", cwd / "fail.py")
        ok = run_cfrun(["--interval", "10", "train.py", "--epochs", "1", "--out", "final.pt"],
                       cwd=cwd)
        assert ok.returncode == 0, ok.stderr[-2000:]
        return run_cfrun(["--max-restarts", "0", "fail.py", "2"], cwd=cwd)

    run = shared_run(tmp_path_factory, "status-find-jobs", make)
    assert run.returncode != 0, run.stderr[-2000:]
    return run.cwd


def _job_dirs(cwd):
    return {p.name.split("-")[0]: p for p in (cwd / "cfrun-jobs").iterdir()}


@pytest.mark.parametrize("args", [[], ["cfrun-jobs"]])
@pytest.mark.slow
def test_status_lists_the_jobs(jobs, args):
    run = cfrun_in_process(["status", *args], cwd=jobs)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2, run.stdout
    dirs = _job_dirs(jobs)
    train = next(line for line in lines if line.startswith(f"cfrun-jobs/{dirs['train'].name}"))
    # the newest checkpoint is the final one, at the script's end (issue 27, item 2)
    assert "succeeded" in train and "step 23" in train and "newest checkpoint 23" in train
    fail = next(line for line in lines if line.startswith(f"cfrun-jobs/{dirs['fail'].name}"))
    assert "failed" in fail and "newest checkpoint none yet" in fail
    listed = json.loads(cfrun_in_process(["status", *args, "--json"], cwd=jobs).stdout)
    assert sorted(r["state"] for r in listed) == ["failed", "succeeded"]


def test_status_of_a_script_shows_its_job(jobs):
    run = cfrun_in_process(["status", "train.py", "--json"], cwd=jobs)
    assert run.returncode == 0, run.stderr
    st = json.loads(run.stdout)
    assert st["job_dir"] == str(_job_dirs(jobs)["train"])
    assert st["state"] == "succeeded" and st["resume_command"] is None


def test_a_failed_job_shows_the_command_that_resumes_it(jobs):
    run = cfrun_in_process(["status", "fail.py"], cwd=jobs, env={"COLUMNS": "400"})
    assert run.returncode == 0, run.stderr
    assert "resume with" in run.stdout
    assert f"cfrun resume {_job_dirs(jobs)['fail']}" in run.stdout


def test_status_names_what_it_cannot_find(jobs, tmp_path):
    run = cfrun_in_process(["status", "print_argv.py"], cwd=jobs)
    assert run.returncode == 2 and "does not exist" in run.stderr
    (tmp_path / "other.py").write_text("pass\n")
    run = cfrun_in_process(["status", str(tmp_path / "other.py")], cwd=jobs)
    assert run.returncode == 2 and "no job of" in run.stderr, run.stderr
    run = cfrun_in_process(["status"], cwd=tmp_path)
    assert run.returncode == 2 and "no ./cfrun-jobs here" in run.stderr, run.stderr


def _status_json(cwd, job_dir):
    run = cfrun_in_process(["status", str(job_dir), "--json"], cwd=cwd)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def _metric_ratio(cwd, job_dir):
    run = cfrun_in_process(["status", str(job_dir), "--metrics"], cwd=cwd)
    line = next(x for x in run.stdout.splitlines() if x.startswith("cfrun_overhead_ratio "))
    return float(line.split()[1])


def test_one_overhead_live_and_after_a_sigterm(tmp_path):
    """Item 3: the overhead is measured while the first attempt runs (not "not measured yet"
    until one ends), after a SIGTERM (whose attempt has no ``attempt_end``), and status and
    the metric give the same figure."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import clean_env

    job = tmp_path / "j"
    proc = subprocess.Popen([sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir",
                             str(job), str(SCRIPTS / "train_until_file.py"),
                             str(tmp_path / "never"), "1000000", str(tmp_path / "out.pt")],
                            cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while '"event": "commit"' not in ((job / "events.jsonl").read_text()
                                          if (job / "events.jsonl").exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        live = _status_json(tmp_path, job)
        assert live["is_running"] and live["overhead"]["stall_pct"] is not None, live
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 75, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    st = _status_json(tmp_path, job)
    assert st["state"] == "preempted", st
    pct = st["overhead"]["stall_pct"]
    assert pct is not None and 0 < pct < 100, st["overhead"]
    assert _metric_ratio(tmp_path, job) == pytest.approx(pct / 100, abs=1e-4)
    assert st["resume_command"] == f"cfrun resume {job}"


def test_status_and_metric_agree_on_a_finished_job(jobs):
    job = _job_dirs(jobs)["train"]
    pct = _status_json(jobs, job)["overhead"]["stall_pct"]
    assert pct is not None and _metric_ratio(jobs, job) == pytest.approx(pct / 100, abs=1e-4)


def test_dry_run_says_what_the_job_dir_would_do(jobs, tmp_path):
    """Item 8: ``--dry-run`` tells finished, started over (a finished job's changed command;
    issue 37, item 2) and new apart (refused: test_job_identity.py)."""
    def outcome(args, cwd=jobs):
        run = cfrun_in_process(["--dry-run", *args], cwd=cwd)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)["job_dir"]

    train = _job_dirs(jobs)["train"]
    assert outcome(["train.py", "--epochs", "1", "--out", "final.pt"]).startswith("finished")
    # the newest checkpoint a resume may start from: the final one (taken at the script's end,
    # issue 27 item 2) never is, and whether step 20 is final depends on the loop's length
    newest = resumable_steps(train / "checkpoints")[0]
    assert newest >= 10
    assert outcome(["--rerun", "train.py", "--epochs", "1", "--out", "final.pt"]) \
        .startswith(f"resume from the checkpoint of step {newest}")
    assert outcome(["--job-dir", str(train), "train.py", "--epochs", "2", "--out",
                    "final.pt"]).startswith("start at step 0: the job finished at step ")
    assert outcome(["--job-dir", str(train), "--accept-changed-command", "train.py", "--epochs",
                    "2", "--out", "final.pt"]).startswith(
                        f"resume from the checkpoint of step {newest} (changed command")
    assert outcome(["--job-dir", "new", "train.py"]).startswith("new")
    assert not (jobs / "new").exists()


def test_help_lists_cfrun_run(tmp_path):
    run = cfrun_in_process(["-h"], cwd=tmp_path)
    assert any(line.split()[:1] == ["run"] for line in run.stdout.splitlines()), run.stdout
