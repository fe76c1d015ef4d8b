"""Job dir reuse and the hints cfrun prints (issue 22, items 2-4), with real processes.

A job dir that never committed a checkpoint has nothing to resume and nothing to protect:
``cfrun profile`` then ``cfrun`` trains, a script's ``-h`` prints its help every time, a command
changed before the first checkpoint runs (and is recorded). The default job dir tells commands
apart, so a learning-rate sweep runs in one directory without flags, side by side or one after
another. Every command line cfrun prints as a hint (``...: cfrun ...``, the tail of its line)
works when pasted: it is run here as printed and must not be refused."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, clean_env, run_cfrun

from cfrun.codec.checkpoint import committed_steps
from cfrun.contract.errors import EXIT_BAD_INPUT, EXIT_FATAL, EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(600)  # several cfrun runs each, on a loaded machine

TRAIN = """\
import argparse
import time
import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--out", default="out.pt")
a = p.parse_args()
torch.manual_seed(0)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=a.lr)
for it in range(a.steps):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(a.sleep)
torch.save(model.state_dict(), a.out)
print("FINAL done")
"""

FAILING = """\
import sys
import torch
import torch.nn as nn

model = nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(12):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if it + 1 == int(sys.argv[1]):
        raise ValueError(f"bad batch at step {it + 1}")
print("FINAL done")
"""


def _script(directory: Path, text: str = TRAIN, name: str = "train.py") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def _events(job: Path, kind: str) -> list[dict]:
    path = job / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == kind]


def _hint(stderr: str, marker: str) -> list[str]:
    """The arguments of the cfrun command line printed at the end of the one line holding
    ``marker`` (``...: cfrun ARGS``), split as a POSIX shell would split the pasted text."""
    [line] = [line for line in stderr.splitlines() if marker in line]
    argv = shlex.split(line[line.index(": cfrun ") + 2:])
    assert argv[0] == "cfrun", line
    return argv[1:]


def _job_dirs(cwd: Path) -> list[Path]:
    return sorted((cwd / "cfrun-jobs").iterdir())


# ---------------------------------------------------------------------- nothing to resume


@pytest.mark.slow
def test_profile_then_run_trains_and_commits(tmp_path):
    """A budget of 30%: the interval the profile chooses fits the run's 92 steps."""
    tiny = [str(SCRIPTS / "train_tiny.py"), "--epochs", "4", "--out", "x.pt"]
    profile = run_cfrun(["profile", "--overhead", "30%", *tiny], cwd=tmp_path)
    assert profile.returncode == 0, profile.stderr[-3000:]
    [job] = _job_dirs(tmp_path)  # the default job dir of this command
    assert (job / "strategy.json").exists()
    run = run_cfrun(["--overhead", "30%", *tiny], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "nothing to do" not in run.stderr
    assert _job_dirs(tmp_path) == [job]  # the profiled job dir: its profile is reused
    assert [e["source"] for e in _events(job, "decision")][-1] == "cache"
    assert committed_steps(job / "checkpoints")
    assert (tmp_path / "x.pt").exists() and "FINAL" in run.stdout


def test_a_scripts_help_prints_every_time(tmp_path):
    script = _script(tmp_path)
    for _ in range(2):
        run = run_cfrun([str(script), "-h"], cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        assert "usage:" in run.stdout and "--lr" in run.stdout, run.stderr[-3000:]
        assert "nothing to do" not in run.stderr


COMMON = ["--interval", "5", "--job-dir", "j"]


@pytest.mark.slow
def test_a_command_changed_before_the_first_checkpoint_runs_and_is_recorded(tmp_path):
    """``-h``, then an argparse typo, then the right command, all in one job dir: each runs."""
    script = _script(tmp_path)
    job = tmp_path / "j"
    assert run_cfrun([*COMMON, str(script), "-h"], cwd=tmp_path).returncode == 0
    typo = run_cfrun([*COMMON, "--max-restarts", "0", str(script), "--lrr", "0.2"], cwd=tmp_path)
    assert typo.returncode != EXIT_BAD_INPUT, typo.stderr[-3000:]  # it ran: argparse refused
    assert "unrecognized arguments: --lrr" in typo.stderr, typo.stderr[-3000:]
    right = run_cfrun([*COMMON, str(script), "--lr", "0.2"], cwd=tmp_path)
    assert right.returncode == 0, right.stderr[-3000:]
    assert "FINAL done" in right.stdout and committed_steps(job / "checkpoints")
    changed = _events(job, "command_changed")
    assert [e["why"] for e in changed] == ["no checkpoint to resume"] * 2
    assert "--lrr" in changed[0]["changed"][0] and "--lr" in changed[1]["changed"][0]
    config = json.loads((job / "config.json").read_text())
    assert config["script_args"] == ["--lr", "0.2"]
    assert [c["why"] for c in config["command_changes"]] == ["no checkpoint to resume"] * 2
    identity = json.loads((job / "identity.json").read_text())
    assert identity["script_args"] == ["--lr", "0.2"]
    assert identity["fingerprints"] == [identity["fingerprint"]]  # the old commands: dropped


@pytest.mark.slow
def test_a_changed_command_with_a_checkpoint_is_refused_and_its_hint_goes_on(tmp_path):
    """Once an unfinished job has a checkpoint a changed command is refused as before (exit 2,
    nothing in the job dir touched), and its hint, pasted, goes on with the change; so does
    the hint of a refused ``cfrun resume`` of an edited script. Attempt 0 stops at step 14 and
    attempt 1 at step 18 (exit 4: unfinished; attempt 1 resumes at 14 at the latest, so its
    step 18 always runs, wherever deferral put the checkpoint), the last has no crash to inject."""
    script = _script(tmp_path)
    job = tmp_path / "j"
    first = run_cfrun([*COMMON, "--inject-crash", "14@0,18@1", "--max-restarts", "0",
                       str(script), "--lr", "0.2", "--steps", "20"], cwd=tmp_path)
    assert first.returncode == 4, first.stderr[-3000:]
    assert committed_steps(job / "checkpoints")
    before = sorted((p.name, p.lstat().st_mtime_ns) for p in job.rglob("*"))
    again = run_cfrun([*COMMON, "--inject-crash", "14@0,18@1", "--max-restarts", "0",
                       str(script), "--lr", "0.3", "--steps", "20"], cwd=tmp_path)
    assert again.returncode == EXIT_BAD_INPUT, again.stderr[-3000:]
    assert "argument --lr: 0.2 -> 0.3" in again.stderr
    assert sorted((p.name, p.lstat().st_mtime_ns) for p in job.rglob("*")) == before
    pasted = run_cfrun(_hint(again.stderr, "hint:"), cwd=tmp_path)
    assert pasted.returncode == 4, pasted.stderr[-3000:]  # went on, then the crash of 18@1
    assert _events(job, "command_changed")[-1]["why"] == "--accept-changed-command"
    assert _events(job, "resumed")

    # an edited script: `cfrun resume` is refused, its hint pasted resumes
    script.write_text(TRAIN.replace("lr=a.lr", "lr=a.lr * 2"))
    resume = run_cfrun(["resume", "j"], cwd=tmp_path)
    assert resume.returncode == EXIT_BAD_INPUT, resume.stderr[-3000:]
    assert "script edited" in resume.stderr
    pasted = run_cfrun(_hint(resume.stderr, "hint:"), cwd=tmp_path)
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert _events(job, "command_changed")[-1]["changed"][0].startswith("script edited")
    assert len(_events(job, "resumed")) == 2


# ---------------------------------------------------------------------- a sweep


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "cfrun", *args], cwd=cwd, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_learning_rate_sweep_in_one_directory_runs_without_flags(tmp_path):
    """Two runs with other --lr side by side, a third after them: each its own default job
    dir, each trains; the first again says it finished, and its hint reruns it."""
    script = _script(tmp_path)

    def argv(lr: str) -> list[str]:
        return ["--interval", "5", str(script), "--lr", lr, "--steps", "30", "--sleep", "0.05",
                "--out", f"lr{lr}.pt"]

    procs = [_start(argv(lr), tmp_path) for lr in ("0.1", "0.2")]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "FINAL done" in out
    later = run_cfrun(argv("0.3"), cwd=tmp_path)
    assert later.returncode == 0, later.stderr[-3000:]
    jobs = _job_dirs(tmp_path)
    assert len(jobs) == 3
    lrs = {json.loads((j / "config.json").read_text())["script_args"][1]: j for j in jobs}
    assert set(lrs) == {"0.1", "0.2", "0.3"}
    assert all(committed_steps(j / "checkpoints") for j in jobs)
    assert all((tmp_path / f"lr{lr}.pt").exists() for lr in lrs)

    same = run_cfrun(argv("0.1"), cwd=tmp_path)  # the same command: the same job dir
    assert same.returncode == 0, same.stderr[-3000:]
    assert "nothing to do" in same.stderr and _job_dirs(tmp_path) == jobs
    rerun = run_cfrun(_hint(same.stderr, "nothing to do"), cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert len(_events(lrs["0.1"], "attempt_start")) == 2


# ---------------------------------------------------------------------- hints after a stop


@pytest.mark.slow
def test_the_crash_loop_hint_resumes_the_fixed_script(tmp_path):
    script = _script(tmp_path, FAILING)
    run = run_cfrun(["--interval", "2", "--crash-loop", "2", "--job-dir", "my job",
                     str(script), "5"], cwd=tmp_path)
    assert run.returncode == EXIT_FATAL, run.stderr[-3000:]
    job = tmp_path / "my job"
    assert committed_steps(job / "checkpoints")
    script.write_text(FAILING.replace("int(sys.argv[1])", "-1"))  # the fix
    pasted = run_cfrun(_hint(run.stderr, "fix the script, then:"), cwd=tmp_path)
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    assert "FINAL done" in pasted.stdout
    assert _events(job, "resumed")
    assert _events(job, "command_changed")[-1]["changed"][0].startswith("script edited")


@pytest.mark.slow
def test_the_resume_line_after_a_sigterm_resumes(tmp_path):
    """The job dir's path has a space: the printed line quotes it."""
    proc = _start(["--interval", "5", "--job-dir", "my job", str(SCRIPTS / "slow_steps.py"),
                   "200", "out.pt", "0.05"], tmp_path)
    job = tmp_path / "my job"
    deadline = time.monotonic() + 120
    while not committed_steps(job / "checkpoints") and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    resumed = run_cfrun(_hint(err, "resume with:"), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "FINAL done" in resumed.stdout and _events(job, "resumed")
