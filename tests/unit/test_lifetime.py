"""cfrun.contract.lifetime with real processes: a child tied by die_with is SIGKILLed when its
parent dies, one whose parent is gone already exits at once, and a subreaper adopts the
orphans of its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from cfrun.contract import lifetime

pytestmark = pytest.mark.skipif(lifetime.prctl() is None, reason="needs Linux's prctl")


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _read_pid(path: Path, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.endswith("\n"):
            return int(text)
        time.sleep(0.02)
    raise AssertionError(f"no pid in {path}")


def test_a_child_tied_by_die_with_is_killed_with_its_parent(tmp_path: Path) -> None:
    # the parent forks a child that ties itself to it, says its pid and sleeps; SIGKILL to
    # the parent must end the child too, with no one signalling it
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, time
        from cfrun.contract.lifetime import die_with
        parent = os.getpid()
        if os.fork() == 0:
            die_with(parent, orphan_exit_code=3)
            with open({str(pid_file)!r}, "w") as f:
                f.write(f"{{os.getpid()}}\\n")
            time.sleep(60)
            os._exit(0)
        time.sleep(60)
    """)])
    try:
        child = _read_pid(pid_file)
        assert psutil.Process(child).ppid() == parent.pid
        parent.kill()
        parent.wait(10)
        assert _wait_gone(child), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


def test_a_child_whose_parent_is_gone_exits_with_the_code_given() -> None:
    # the parent pid given is not the process's parent: the death signal would never come,
    # so die_with exits at once with the code given
    run = subprocess.run([sys.executable, "-c",
                          "from cfrun.contract.lifetime import die_with\n"
                          "die_with(1, orphan_exit_code=7)\nprint('went on')"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 7 and "went on" not in run.stdout


def test_a_subreaper_adopts_the_orphan_of_its_child(tmp_path: Path) -> None:
    # the subreaper starts a child that forks a grandchild and exits: the grandchild's new
    # parent is the subreaper, not init
    pid_file = tmp_path / "grandchild.pid"
    reaper = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        from cfrun.contract.lifetime import become_subreaper
        become_subreaper()
        subprocess.run([sys.executable, "-c",
            "import os, time\\n"
            "if os.fork() == 0:\\n"
            "    time.sleep(0.5)\\n"
            "    open({str(pid_file)!r}, 'w').write(f'{{os.getpid()}} {{os.getppid()}}\\\\n')\\n"
            "    time.sleep(60)\\n"
            "os._exit(0)\\n"], check=True)
        time.sleep(60)
    """)])
    try:
        deadline = time.monotonic() + 20
        while not (pid_file.exists() and pid_file.read_text().endswith("\n")):
            assert time.monotonic() < deadline, "the grandchild never wrote its pid"
            time.sleep(0.02)
        grandchild, its_parent = map(int, pid_file.read_text().split())
        assert its_parent == reaper.pid
    finally:
        reaper.kill()
        reaper.wait(10)
        try:
            os.kill(grandchild, signal.SIGKILL)
        except (NameError, ProcessLookupError):
            pass
