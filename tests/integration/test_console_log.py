"""The ranks' output kept in the job dir (issue 37): ``logs/attempt-N-output.log`` holds what
each attempt printed, the console still gets all of it, and the script sees the streams it
would see without cfrun (a terminal stays a terminal). Real processes, a real SIGKILL, a real
pseudo-terminal."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, clean_env, run_cfrun, run_on_a_terminal

from cfrun.contract import faults

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(SCRIPTS / "print_steps.py")


def _numbers(text: str, stream: str) -> list[int]:
    return [int(n) for n in re.findall(rf"^{stream} (\d+)$", text, re.M)]


@pytest.mark.torchrun
def test_each_attempts_output_is_kept_and_the_console_gets_all_of_it(tmp_path: Path) -> None:
    """torchrun, piped (as under nohup, CI or Kubernetes): a SIGKILL after step 6, a resume.
    Each attempt's file holds its stdout and stderr lines, private; the console's stdout is
    the plain script's, attempt by attempt."""
    run = run_cfrun(["--interval", "3", "--inject-crash", "6", "--job-dir", "j", SCRIPT,
                     "--steps", "12"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    logs = run.job_dir / "logs"
    first = (logs / "attempt-0-output.log").read_text()
    second = (logs / "attempt-1-output.log").read_text()
    for path in (logs / "attempt-0-output.log", logs / "attempt-1-output.log"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    [resumed] = run.events("resumed")
    # attempt 0 printed each step up to the kill; attempt 1 each step after its checkpoint
    assert _numbers(first, "out") == list(range(1, len(_numbers(first, "out")) + 1))
    assert _numbers(first, "err") == _numbers(first, "out")
    assert len(_numbers(first, "out")) >= resumed["step"] - 1
    assert _numbers(second, "out") == list(range(resumed["step"] + 1, 13)), (first, second)
    assert _numbers(second, "err") == _numbers(second, "out")
    assert first.startswith("stdout tty=False stderr tty=False size=None\n")
    # the console got every line of both attempts, in order
    assert run.stdout == "".join(line + "\n" for text in (first, second)
                                 for line in text.splitlines() if line.startswith(("out", "std")))
    assert "err 12" in run.stderr


def test_on_a_terminal_the_script_still_sees_a_terminal_of_its_size(tmp_path: Path) -> None:
    """A terminal of 37 x 101: the script's stdout and stderr are terminals of that size, the
    console shows its lines, and the file holds them with plain newlines (no ``\\r``)."""
    env = clean_env()
    argv = [sys.executable, "-c",
            "import fcntl, os, struct, sys, termios; "
            "fcntl.ioctl(1, termios.TIOCSWINSZ, struct.pack('HHHH', 37, 101, 0, 0)); "
            "os.execv(sys.argv[1], sys.argv[1:])",
            sys.executable, "-m", "cfrun", "--launcher", "python", "--job-dir", "j", SCRIPT,
            "--steps", "4"]
    text = run_on_a_terminal(argv, env, cwd=tmp_path).decode(errors="replace")
    header = "stdout tty=True stderr tty=True size=os.terminal_size(columns=101, lines=37)"
    assert header in text, text[-3000:]
    assert "out 4" in text and "err 4" in text
    kept = (tmp_path / "j" / "logs" / "attempt-0-output.log").read_bytes()
    assert kept.startswith(header.encode() + b"\n") and b"\r" not in kept
    assert _numbers(kept.decode(), "out") == [1, 2, 3, 4] == _numbers(kept.decode(), "err")


def test_the_file_stops_at_its_cap_and_a_link_there_is_not_followed(tmp_path: Path) -> None:
    """A chatty attempt: the file keeps its first BYTES and says so; the console still gets
    everything. A symbolic link planted at the next attempt's file name is not written
    through (its target unchanged) and the job still succeeds."""
    target = tmp_path / "elsewhere.txt"
    target.write_text("untouched\n")
    logs = tmp_path / "j" / "logs"
    # attempt 0 plants it (as another process of the user could), before its kill
    env = faults.arm({"PLANT_LINK": f"{logs / 'attempt-1-output.log'}:{target}"},
                     **{"supervisor.output_cap_bytes": 4096})
    run = run_cfrun(["--interval", "3", "--inject-crash", "6", "--job-dir", "j", SCRIPT,
                     "--steps", "12", "--bulk", "10000"], cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    kept = (logs / "attempt-0-output.log").read_bytes()
    assert len(kept) < 4096 + 200 and kept.startswith(b"stdout tty=False")
    assert b"the rest went to the console only" in kept
    assert "x" * 9999 in run.stdout and "out 12" in run.stdout  # the console: all of it
    assert (logs / "attempt-1-output.log").is_symlink()
    assert target.read_text() == "untouched\n"
    assert "not kept" in run.stderr  # said, once


def test_turned_off_no_file_and_the_script_writes_to_the_console_itself(tmp_path: Path) -> None:
    """``CFRUN_CONSOLE_LOG=0``: no output file; stdout redirected to a file stays a file the
    script writes to directly (seekable), as without cfrun."""
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        p = subprocess.run([sys.executable, "-m", "cfrun", "--launcher", "python", "--job-dir",
                            "j", SCRIPT, "--steps", "3"], cwd=tmp_path, stdout=f,
                           stderr=subprocess.PIPE, text=True,
                           env=clean_env({"CFRUN_CONSOLE_LOG": "0"}), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not list((tmp_path / "j" / "logs").glob("*-output.log"))
    assert _numbers(out.read_text(), "out") == [1, 2, 3]
