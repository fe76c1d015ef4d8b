"""How cfrun launches the script and what it does when the launch fails (issue 22, items 5-8),
with real processes and signals: the script's own options reach it unchanged (torchrun's
parser never sees them); a failure before the first optimizer step (a SyntaxError, an
ImportError, an argparse usage error) is started at most twice and named in one line; a closed
output pipe (``| head``) ends the job without restarts; SIGHUP stops the job as SIGTERM does."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, Run, clean_env, run_cfrun, slow_but, slow_reference
from test_supervision import _resume_and_compare, _sigterm_run, _start

from cfrun.contract import faults, slots

pytestmark = [pytest.mark.timeout(600), pytest.mark.launched]  # as users launch
ARGS = ["--d", "3", "--st", "2", "--ma", "1", "--nproc", "7"]
"""Each abbreviates two of torchrun's options (``--nproc``: ``--nproc-per-node``)."""


def _argv_lines(stdout: str) -> list[list[str]]:
    return [json.loads(line[len("ARGV "):]) for line in stdout.splitlines()
            if line.startswith("ARGV ")]


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_scripts_own_options_reach_every_rank_unchanged(tmp_path: Path, nproc: int) -> None:
    run = run_cfrun(["--nproc-per-node", str(nproc), "--job-dir", "j",
                     str(SCRIPTS / "print_argv.py"), *ARGS, "--", "x"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _argv_lines(run.stdout) == [[*ARGS, "--", "x"]] * nproc
    assert len(run.events("attempt_start")) == 1


@pytest.mark.slow
def test_the_scripts_own_options_reach_it_under_profile_and_verify(tmp_path: Path) -> None:
    script = [str(SCRIPTS / "train_argv.py"), *ARGS]
    run = run_cfrun(["profile", "--job-dir", "p", *script], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _argv_lines(run.stdout) == [ARGS]
    run = run_cfrun(["verify", "--steps", "12", "--interval", "5", "--kills", "1",
                     "--against-plain", *script], cwd=tmp_path, env={"TMPDIR": "/tmp"},
                    timeout=540)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = _argv_lines(run.stdout) + _argv_lines(run.stderr)
    assert len(lines) >= 3 and all(line == ARGS for line in lines)  # every run of the three


FAILING = {
    "syntax": ("x = (1,\nprint('never')\n", "SyntaxError: '(' was never closed"),
    "import": ("import json\nimport torhc\n", "ModuleNotFoundError: No module named 'torhc'"),
    # argparse's usage error after torch is imported (cfrun's runtime is installed by then)
    "argparse": ("import argparse\nimport torch\np = argparse.ArgumentParser()\n"
                 "p.add_argument('--lr', type=float, required=True)\np.parse_args()\n",
                 "bad.py: error: the following arguments are required: --lr"),
}


@pytest.mark.parametrize("kind", slow_but(sorted(FAILING), "syntax"))
def test_a_failure_before_the_first_step_runs_at_most_twice_and_names_its_error(
        tmp_path: Path, kind: str) -> None:
    source, message = FAILING[kind]
    (tmp_path / "bad.py").write_text(source)
    run = run_cfrun(["--job-dir", "j", "bad.py"], cwd=tmp_path)
    assert run.returncode == 5, run.stderr[-3000:]
    assert len(run.events("attempt_start")) <= 2
    [error] = [line for line in run.stderr.splitlines() if line.startswith("cfrun: error:")]
    assert message in error and "does not restart a failure that happens before any step" \
        in error, error
    assert "newest checkpoint" not in run.stderr and "step None" not in run.stderr
    status = run_cfrun(["status", "--json", "j"], cwd=tmp_path)
    st = json.loads(status.stdout)
    assert message in st["error"], st
    assert all(r["where"] == "before the first step" and message in r["cause"]
               for r in st["restarts"]), st["restarts"]


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.slow
def test_the_retry_option_restarts_a_failure_before_the_first_step(tmp_path: Path,
                                                                    how: str) -> None:
    (tmp_path / "bad.py").write_text(FAILING["syntax"][0])
    flag = ["--retry-before-first-step"] if how == "flag" else []
    env = {"CFRUN_RETRY_BEFORE_FIRST_STEP": "1"} if how == "env" else None
    run = run_cfrun(["--max-restarts", "3", *flag, "--job-dir", "j", "bad.py"], cwd=tmp_path,
                    env=env)
    assert run.returncode == 4, run.stderr[-3000:]
    assert len(run.events("attempt_start")) == 4  # no crash loop either: restarts ran out
    assert "SyntaxError: '(' was never closed" in run.stderr.splitlines()[-2]


@pytest.mark.slow
def test_a_closed_output_pipe_ends_the_job_like_python_without_restarts(tmp_path: Path) -> None:
    """``cfrun print_lines.py | head -3``: the script dies of a BrokenPipeError, as it does
    under plain python; cfrun ends the job there (it restarted it 5 times before, taking the
    script's "Broken pipe" for a rank's death)."""
    proc = subprocess.Popen([sys.executable, "-m", "cfrun", "--job-dir", "j",
                             str(SCRIPTS / "print_lines.py")], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # head exits
    err = proc.communicate(timeout=240)[1]
    run = Run(proc.returncode, "", err, tmp_path / "j")
    assert lines == ["step 1\n", "step 2\n", "step 3\n"]
    assert run.returncode == 4, err[-3000:]
    assert len(run.events("attempt_start")) == 1, err[-3000:]
    assert "BrokenPipeError" in err and "output pipe was closed" in err.splitlines()[-2]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """slow_steps.py, 60 steps, uninterrupted: the final state (shared with other modules)."""
    return slow_reference(tmp_path_factory)[1]


def _slot_dirs(job_dir: Path) -> list[Path]:
    base = slots.shm_base()
    return list(base.glob(slots.dir_prefix(job_dir) + "_*")) if base is not None else []


@pytest.mark.slow
def test_sighup_stops_like_sigterm_and_resumes_exactly(reference, tmp_path: Path) -> None:
    """A closed terminal or a dropped ssh session (SIGHUP) killed cfrun with -1 before: no
    final checkpoint, status "dead", the slot directory left in /dev/shm."""
    run, _, _ = _sigterm_run(tmp_path, "j", [], at_step=12, sig=signal.SIGHUP)
    assert run.returncode == 75, run.stderr[-2000:]
    [pre] = run.events("preempted")
    assert pre["final_checkpoint"] == pre["step"] >= 12 and pre["signal"] == "SIGHUP"
    assert "stopped by SIGHUP; resume with: cfrun resume" in run.stderr
    assert not _slot_dirs(tmp_path / "j")
    _resume_and_compare(tmp_path, "j", reference, pre["step"])


def test_sighup_while_cfrun_starts_is_held_and_reported_as_a_stop(tmp_path: Path) -> None:
    env = faults.arm({}, **{"supervisor.start_delay_s": 3.0})
    proc = _start(["--interval", "5", "--job-dir", "j", str(SCRIPTS / "slow_steps.py"), "60",
                   "j.pt", "0.05"], tmp_path, env)
    deadline = time.monotonic() + 120
    while not (tmp_path / "j").is_dir() and time.monotonic() < deadline:  # cfrun holds it now
        time.sleep(0.05)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=300)
    run = Run(proc.returncode, out, err, tmp_path / "j")
    assert run.returncode == 75, (run.returncode, err[-2000:])
    assert not run.events("attempt_start")
    [pre] = run.events("preempted")
    assert pre["signal"] == "SIGHUP"
    assert not _slot_dirs(tmp_path / "j")
