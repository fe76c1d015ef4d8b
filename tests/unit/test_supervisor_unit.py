"""Unit tests for cfrun.supervisor.core with real processes: the lock of a killed holder, leftovers
of a dead supervisor, the restart backoff as the supervisor carries it out (the policy alone:
test_supervisor_machine.py)."""

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

from cfrun.contract import ipc
from cfrun.contract import settings as E
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import JobFailedError
from cfrun.contract.jobdir import JobDir
from cfrun.supervisor import core as S
from cfrun.supervisor.machine import backoff_delay_s

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]


def _child(code: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A python child that prints READY when set up, then sleeps."""
    full = textwrap.dedent(code) + "\nprint('READY', flush=True)\nimport time\ntime.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", full], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert proc.stdout.readline().strip() == "READY"
    return proc


def test_lock_of_a_sigkilled_holder_is_taken_by_the_next(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.create()
    holder = _child("from cfrun.contract.jobdir import JobDir\n"
                    f"jd = JobDir({str(jd.root)!r})\njd.lock()")
    try:
        assert jd.is_locked()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        jd.lock()  # no stale lock: the OS dropped the dead holder's flock
        jd.unlock()
    finally:
        holder.kill()
        holder.wait()


def _cfg(tmp_path: Path, **kw) -> RunConfig:
    (tmp_path / "train.py").touch()  # the supervisor hashes it (the job's identity)
    return RunConfig(script=str(tmp_path / "train.py"), script_args=[],
                     job_dir=str(tmp_path / "job"), cwd=str(tmp_path), **kw)


def test_leftover_agent_and_ranks_of_a_dead_supervisor_are_killed(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    jd = JobDir(cfg.job_dir)
    jd.create()
    # an agent left behind (answers on the job's socket) and a rank of a supervisor long gone
    agent = _child(f"""
        import os, socket
        from cfrun.contract import ipc
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = ipc.new_agent_address()
        s.bind("\\0" + address)
        s.listen(4)
        ipc.write_agent_record({cfg.job_dir!r}, ipc.AgentRecord(os.getpid(), address))
        """)
    rank = _child("", env={E.RANK_JOB_DIR: cfg.job_dir, E.RANK_SUPERVISOR_PID: "999999999"})
    other_job = _child("", env={E.RANK_JOB_DIR: str(tmp_path / "other"),
                                E.RANK_SUPERVISOR_PID: "999999999"})
    other_node = _child("", env={E.RANK_JOB_DIR: cfg.job_dir, E.NODE_RANK: "1",
                                 E.RANK_SUPERVISOR_PID: "999999999"})
    try:
        sup = S.Supervisor(cfg)
        sup._kill_leftovers()
        # both sleep 120 s unless killed (psutil may have reaped them: no exit status to check)
        agent.wait(timeout=5)
        rank.wait(timeout=5)
        assert other_job.poll() is None and other_node.poll() is None  # not this job's node
        with pytest.raises(OSError):
            ipc.connect(cfg.job_dir, timeout_s=0.5).close()
        [ev] = [e for e in jd.read_events() if e["event"] == "leftovers_killed"]
        assert sorted(ev["pids"]) == sorted([agent.pid, rank.pid])
    finally:
        for p in (agent, rank, other_job, other_node):
            p.kill()
            p.wait()


class _Failed:
    """A torchrun that failed at once with exit code 1."""

    pid = 0
    returncode = 1

    def wait(self, timeout: float | None = None) -> int:
        return 1

    def poll(self) -> int:
        return 1


def test_restarts_back_off_exponentially_up_to_30_s(tmp_path: Path, monkeypatch) -> None:
    cfg = _cfg(tmp_path, max_restarts=6, crash_loop_limit=0)
    slept: list[float] = []
    monkeypatch.setattr(S.Supervisor, "_backoff_wait", lambda self, delay_s: slept.append(delay_s))
    monkeypatch.setattr(S.Supervisor, "_start_agent", lambda self: None)
    spawned: list[list[str]] = []

    def fake_spawn(argv, env, cwd, **stdio):
        spawned.append(argv)
        return _Failed()

    sup = S.Supervisor(cfg, spawn_fn=fake_spawn, backoff_s=4.0)
    with pytest.raises(JobFailedError):
        sup.run()
    assert slept == [4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert len(spawned) == 7
    restarting = [e for e in JobDir(cfg.job_dir).read_events()
                  if e["event"] == "state" and e["state"] == "restarting"]
    assert [e["backoff_s"] for e in restarting] == slept
    assert backoff_delay_s(0.5, 1) == 0.5 and backoff_delay_s(0.5, 4) == 4.0


def test_backoff_wait_reaps_orphans_meanwhile(tmp_path: Path) -> None:
    """As PID 1 orphans become cfrun's children: they must not stay zombies during a backoff."""
    sup = S.Supervisor(_cfg(tmp_path))
    orphan = subprocess.Popen(["true"])  # exits at once; nobody waits for it: a zombie
    deadline = time.monotonic() + 10
    while psutil.Process(orphan.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    sup._backoff_wait(0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert not psutil.pid_exists(orphan.pid)
    orphan.wait(timeout=1)
