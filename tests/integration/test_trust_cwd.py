"""cfrun's own processes import nothing from the working directory (issue 24, item 1).

``python -m`` and ``python -c`` put the working directory first on ``sys.path``. cfrun started
its persist agent, reaper and torchrun wrapper that way, so a user who could write the
directory cfrun was started from (a shared project dir, /tmp) planted ``argparse.py`` there
and it ran with the job's uid. Plain ``python /elsewhere/train.py`` from that directory runs
none of it: the script's own directory comes first for the script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS, clean_env, rank_pids

pytestmark = [pytest.mark.timeout(300), pytest.mark.launched]  # as users launch

PLANTED = """\
import importlib, os, sys
with open(os.environ["PLANTED_LOG"], "a") as f:
    f.write(f"{__name__} {os.getpid()} {sys.argv[:3]}\\n")
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules[__name__]
sys.modules[__name__] = importlib.import_module(__name__)  # the real one, so the job runs on
"""


def test_modules_planted_in_the_working_directory_never_run(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    for name in ("argparse", "xxhash", "runpy", "filelock", "psutil"):
        (shared / f"{name}.py").write_text(PLANTED)
    log = tmp_path / "planted.log"
    cfrun = Path(sys.executable).parent / "cfrun"  # the console script, as users type it
    p = subprocess.run([str(cfrun), "--interval", "5", "--job-dir", str(tmp_path / "j"),
                        str(SCRIPTS / "slow_steps.py"), "12", str(tmp_path / "out.pt"), "0"],
                       cwd=shared, env=clean_env({"PLANTED_LOG": str(log)}),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "out.pt").exists()
    assert not log.exists(), log.read_text()  # no process of the job imported them
    # the same plant is live for a plain `python -c` from there: the test's plant works
    subprocess.run([sys.executable, "-c", "import argparse"], cwd=shared,
                   env=clean_env({"PLANTED_LOG": str(log)}), check=True)
    assert "argparse" in log.read_text()


def test_no_secret_of_a_running_job_is_on_a_command_line(tmp_path):
    """Issue 24, items 5 and 7: the agent's abstract socket name was on its command line
    (``/proc/PID/cmdline`` is every user's to read), so a local user bound it first and the job
    could not start; a password in ``--persist-to`` was there too. Now neither is on the
    command line of any process of the job, nor in config.json."""
    import json
    import time

    import psutil

    from cfrun.contract import ipc

    level2 = "file://alice:hunter2@" + str(tmp_path / "l2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j", "--persist-to",
         level2, str(SCRIPTS / "slow_steps.py"), "400", "out.pt", "0.05"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        record = None
        while record is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                record = ipc.read_agent_record(str(tmp_path / "j"))
            except OSError:
                time.sleep(0.2)
        assert record is not None, proc.communicate(timeout=300)
        lines = []  # cfrun's own command is the user's to write (CFRUN_PERSIST_TO keeps it off)
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                lines.append(" ".join(p.cmdline()))
            except psutil.Error:
                pass
        assert any("cfrun.agent" in line for line in lines), lines
        assert not [line for line in lines if record.address in line or "hunter2" in line]
        config = (tmp_path / "j" / "config.json").read_text()
        assert "hunter2" not in config and json.loads(config)["persist_to"].startswith(
            "file://alice:<withheld>@")
    finally:
        proc.kill()
        proc.communicate()


def test_a_job_dir_swapped_while_the_job_runs_is_never_loaded(tmp_path):
    """Issue 24, item 3: whoever could write the job dir's parent renamed a running job's dir
    away and put one of their own (here a copy, as a forger would start from) in its place;
    the next restart loaded its checkpoint. Now the supervisor re-identifies the job dir
    (device and inode) before each attempt: the restart after a rank's kill stops with exit 5
    and one line, and nothing of the planted dir is loaded."""
    import shutil
    import signal
    import time

    import psutil

    from cfrun.contract.checkpoints import committed_steps

    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun", "--interval", "5", "--job-dir", "j",
         str(SCRIPTS / "slow_steps.py"), "400", "out.pt", "0.05"],
        cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not committed_steps(tmp_path / "j" / "checkpoints"):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        (tmp_path / "j").rename(tmp_path / "j-moved")
        shutil.copytree(tmp_path / "j-moved", tmp_path / "j", symlinks=True)
        ranks = rank_pids(tmp_path / "j")
        assert ranks
        psutil.Process(ranks[0]).send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 5, err[-3000:]
    assert "was replaced while the job ran" in err
    assert not [line for line in (tmp_path / "j" / "events.jsonl").read_text().splitlines()
                if '"resumed"' in line]
