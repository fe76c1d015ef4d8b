"""Finding and following jobs (issue 37, item 4): a directory of job dirs lists each job with
its arguments, state, step of total and ETA (``cfrun status DIR``, ``cfrun ls DIR``);
``--total-steps`` gives a ``while`` loop a total and an ETA; the progress line comes at the
interval the manual states, the first one included; a run that trained nothing (``-h``, an
argparse typo) leaves no job dir behind.

Real cfrun processes: a finished epoch-loop job (``train_tiny.py``) beside a running
``while`` loop (``train_until_file.py``) on a pseudo-terminal."""

from __future__ import annotations

import json
import os
import pty
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ARGPARSE_SCRIPT, SCRIPTS, cfrun_in_process, clean_env, job_events, run_cfrun

pytestmark = pytest.mark.timeout(300)

PROGRESS_S = 4.0
"""The progress interval of the job on the terminal (CFRUN_PROGRESS_S)."""



class Terminal:
    """A command on a pseudo-terminal, its output collected with the wall time each chunk
    arrived (``time.time()``) by a thread, until it exits."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.chunks: list[tuple[float, str]] = []
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: nothing but exec (or exit) from here
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                return
            if not chunk:
                return
            self.chunks.append((time.time(), chunk.decode(errors="replace")))

    def lines(self) -> list[tuple[float, str]]:
        """Whole lines so far, each with the arrival time of the chunk that ended it."""
        out, part = [], ""
        for t, text in list(self.chunks):
            part += text
            *whole, part = part.replace("\r", "").split("\n")
            out += [(t, line) for line in whole]
        return out

    def wait(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.reader.join(timeout=10)
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.1)
        os.kill(self.pid, 9)
        raise AssertionError("the job on the terminal did not end: " + self.text()[-3000:])

    def text(self) -> str:
        return "".join(t for _, t in self.chunks)


def _wait_for(what, deadline_s: float, describe) -> None:
    deadline = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < deadline, describe()
        time.sleep(0.1)




@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A working directory whose ``./cfrun-jobs`` holds one finished epoch-loop job
    (``train_tiny.py --epochs 1``: 23 steps, a final checkpoint); tests copy it."""
    cwd = tmp_path_factory.mktemp("jobs")
    shutil.copy(SCRIPTS / "train_tiny.py", cwd / "train_tiny.py")
    shutil.copy(SCRIPTS / "digits.py", cwd / "digits.py")
    run = run_cfrun(["--interval", "10", "train_tiny.py", "--epochs", "1", "--out", "o.pt"],
                    cwd=cwd)
    assert run.returncode == 0, run.stderr[-3000:]
    return cwd


def _copy(finished: Path, tmp_path: Path) -> Path:
    cwd = tmp_path / "w"
    shutil.copytree(finished, cwd)
    return cwd


def test_a_list_of_jobs_shows_each_jobs_arguments_step_of_total_and_eta(finished, tmp_path):
    """``cfrun status`` and ``cfrun ls cfrun-jobs`` beside a running ``while`` loop given
    ``--total-steps 1000``: each line has the job's arguments, its state and its step of the
    total, and the running one its rate and ETA; the one-shot table of the running job shows
    the total and the ETA too. On the terminal, the first progress line comes
    ``CFRUN_PROGRESS_S`` after the attempt's start (it came after twice that) and the lines
    carry the total and, from the second on, the ETA."""
    cwd = _copy(finished, tmp_path)
    env = clean_env({"CFRUN_PROGRESS_S": str(PROGRESS_S), "CFRUN_LAUNCHER": "python",
                     "COLUMNS": "300"})
    stop = cwd / "stop"
    term = Terminal([sys.executable, "-m", "cfrun", "--total-steps", "1000",
                     str(SCRIPTS / "train_until_file.py"), str(stop), "5", "out.pt"], env, cwd)
    try:
        jobs = cwd / "cfrun-jobs"

        def running_job() -> Path | None:
            found = [p for p in jobs.glob("train_until_file-*") if list(p.glob("heartbeat-*"))]
            return found[0] if found else None

        _wait_for(lambda: running_job() is not None, 120, term.text)
        job = running_job()
        assert job is not None
        time.sleep(1.0)  # a few steps: a rate
        for args in (["status"], ["status", "cfrun-jobs"], ["ls", "cfrun-jobs"]):
            listed = cfrun_in_process(args, cwd=cwd)
            assert listed.returncode == 0, listed.stderr
            lines = listed.stdout.strip().splitlines()
            assert len(lines) == 2, listed.stdout
            until = next(ln for ln in lines if ln.startswith(f"cfrun-jobs/{job.name}"))
            assert " running " in until and " of 1000 (" in until and "steps/s, ETA " in until
            assert until.endswith(f"train_until_file.py {stop} 5 out.pt"), until
            tiny = next(ln for ln in lines if ln.startswith("cfrun-jobs/train_tiny-"))
            assert " succeeded " in tiny and "step 23 of 23 " in tiny, tiny
            assert tiny.endswith("train_tiny.py --epochs 1 --out o.pt"), tiny
        rows = json.loads(cfrun_in_process(["status", "--json"], cwd=cwd).stdout)
        mine = next(r for r in rows if r["job_dir"] == str(job))
        assert mine["total_steps"] == 1000 and mine["eta_s"] > 0 and mine["steps_per_s"] > 0
        table = cfrun_in_process(["status", str(job)], cwd=cwd, env={"COLUMNS": "300"})
        assert " of 1000, " in table.stdout and "ETA" in table.stdout, table.stdout

        def progress_lines() -> list[tuple[float, str]]:
            return [(t, ln) for t, ln in term.lines() if ln.startswith("cfrun: step")
                    or ln.startswith("cfrun: no optimizer step yet")]

        _wait_for(lambda: len(progress_lines()) >= 2, 120, term.text)
    finally:
        stop.touch()
    assert term.wait(120) == 0, term.text()[-3000:]
    started = job_events(job, "attempt_start")[0]["t_unix_s"]
    first_t, _ = progress_lines()[0]
    # the first line PROGRESS_S after the attempt's start; it came after twice that
    assert first_t - started < 1.5 * PROGRESS_S, (first_t - started, term.text()[-3000:])
    steps = [ln for _, ln in progress_lines() if ln.startswith("cfrun: step")]
    assert steps and all(" of 1000" in ln for ln in steps), steps
    # a line with a rate has the ETA (one after the stop file may show 0 steps/s, none)
    assert any("ETA" in ln for ln in steps), steps


def test_total_steps_is_recorded_and_checked(tmp_path):
    (tmp_path / "train.py").write_text(ARGPARSE_SCRIPT)
    for bad in ("0", "x"):
        run = cfrun_in_process(["--total-steps", bad, "train.py"], cwd=tmp_path)
        assert run.returncode == 2 and "--total-steps" in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) <= 2, run.stderr
    dry = cfrun_in_process(["--total-steps", "50", "--dry-run", "train.py"], cwd=tmp_path)
    assert json.loads(dry.stdout)["config"]["total_steps"] == 50


def test_runs_that_trained_nothing_leave_no_job_dir(tmp_path):
    """``-h`` and an argparse typo make no optimizer step: their default job dirs are removed
    again (the typo's hint asks for the command again, not a resume of the bad arguments);
    a job dir named with ``--job-dir`` is kept, and so is the default one of a run that
    trained."""
    (tmp_path / "train.py").write_text(ARGPARSE_SCRIPT)
    helped = run_cfrun(["train.py", "-h"], cwd=tmp_path)
    assert helped.returncode == 0 and "usage: train.py" in helped.stdout, helped.stderr
    assert not (tmp_path / "cfrun-jobs").exists(), list((tmp_path / "cfrun-jobs").iterdir())
    assert "no optimizer step was made" in helped.stderr
    typo = run_cfrun(["train.py", "--lrr", "0.2"], cwd=tmp_path)
    assert typo.returncode == 5, typo.stderr[-3000:]
    assert not (tmp_path / "cfrun-jobs").exists()
    hint = next(ln for ln in typo.stderr.splitlines() if ln.startswith("hint: "))
    assert "run the command again" in hint and "cfrun resume" not in hint, hint
    named = run_cfrun(["--job-dir", "mine", "train.py", "-h"], cwd=tmp_path)
    assert named.returncode == 0 and (tmp_path / "mine" / "events.jsonl").is_file()
    trained = run_cfrun(["train.py", "--epochs", "1"], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert len(list((tmp_path / "cfrun-jobs").iterdir())) == 1


@pytest.mark.parametrize("shape,total", [("break", 41), ("while", 40)])
def test_a_step_loops_own_bound_gives_the_total(tmp_path, shape, total):
    """No ``--total-steps``: nanoGPT's ``while True`` loop ends at ``if iter_num > max_iters:
    break`` (iterations 0 to ``max_iters``, 41 steps for 40); ``while iter_num < max_iters`` at
    40. cfrun reads the counter and the bound in the loop's frame at each checkpoint, so the
    checkpoints carry the total and ``cfrun status`` shows the step of it (it showed no
    total and no ETA for such a loop: issue 37, item 5)."""
    run = run_cfrun(["--interval", "5", "--job-dir", "j", str(SCRIPTS / "train_max_iters.py"),
                     f"--shape={shape}", "--max_iters=40"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"FINAL iter_num {total if shape == 'while' else 41}" in run.stdout
    progress = [e.get("progress") for e in run.events("checkpoint")]
    assert progress and all(p is not None and p["total_batches"] == total for p in progress), \
        progress
    st = json.loads(cfrun_in_process(["status", "--json", "j"], cwd=tmp_path).stdout)
    assert st["total_steps"] == total, st
