"""Issue 13, "a full disk": I/O errors never kill the machinery.

Real files and processes: events to a file the kernel refuses to grow (``RLIMIT_FSIZE``), to a
read-only or full tmpfs (CI runs as root; elsewhere those cases skip and say why), a real
persist agent whose job dir fills up mid-step, pruning by :class:`SpaceGuard`, and a rank that
waits for an agent that never answers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mounted_tmpfs

from cfrun.agent.local import SPACE_MARGIN_BYTES, SpaceGuard
from cfrun.contract import ipc
from cfrun.contract.checkpoints import commit, committed_steps, staging_dir, write_file
from cfrun.contract.fsio import tree_bytes
from cfrun.contract.jobdir import JobDir
from cfrun.contract.messages import PersistRequest

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CFRUN_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, unmounted at the end (skips when mounting is not permitted)."""
    with mounted_tmpfs(tmp_path, "4m") as mnt:
        yield mnt


# ---------------------------------------------------------------- best-effort events

def test_events_to_a_file_that_cannot_grow_are_dropped_counted_and_said_once(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse to grow events.jsonl (a short write, then EFBIG):
    emit_event never raises, the outage is said once with its end and count, and the events
    after it are readable (the torn line is skipped)."""
    code = textwrap.dedent("""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        from cfrun.contract.jobdir import JobDir, best_effort
        jd = JobDir(sys.argv[1])
        jd.emit_event("agent_start", pid=1)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (jd.events_path.stat().st_size + 10, hard))
        for _ in range(5):
            jd.emit_event("agent_start", pid=2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        jd.emit_event("agent_start", pid=3)
        print(best_effort.failed)
    """)
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "{'events': 5}"
    assert p.stderr.count("cfrun: cannot write events") == 1, p.stderr
    assert "events writes work again; 5 were dropped" in p.stderr
    assert [e["pid"] for e in JobDir(tmp_path).read_events()] == [1, 3]


def test_events_to_a_read_only_or_full_job_dir_never_raise(tmpfs, capfd):
    jd = JobDir(tmpfs / "job")
    jd.create()
    jd.emit_event("agent_start", pid=1)
    ballast = tmpfs / "ballast"
    with open(ballast, "wb") as f:  # fill the disk to the last byte
        free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
        os.posix_fallocate(f.fileno(), 0, free)
    for _ in range(100):  # the file's last page may take a few lines first
        jd.emit_event("agent_start", pid=2)
    ballast.unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
        jd.emit_event("agent_start", pid=3)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    jd.emit_event("agent_start", pid=4)
    err = capfd.readouterr().err
    assert "cfrun: cannot write events" in err and "work again" in err, err
    pids = [e["pid"] for e in jd.read_events()]
    assert pids[0] == 1 and pids[-1] == 4 and 3 not in pids


# ---------------------------------------------------------------- SpaceGuard pruning

def _commit_step(jd: JobDir, step: int, nbytes: int) -> None:
    staging = staging_dir(jd.checkpoints, step)
    staging.mkdir(parents=True)
    files = [write_file(staging / "rank-00000.bin", [b"x" * nbytes]),
             write_file(staging / "rank-00000.json", [b"{}"])]
    commit(jd.checkpoints, step, files, world_size=1, meta={"step": step}, keep=None)


def _request(step: int, nbytes: int) -> PersistRequest:
    return PersistRequest(step, 0, 1, "/nonexistent.slot", nbytes, {})


def test_space_guard_prunes_oldest_first_never_the_newest_then_skips(tmp_path):
    """A disk of ``capacity`` bytes (checkpoints/ the only user): to fit a new checkpoint the
    guard deletes the oldest committed ones first, never the newest; when even that is not
    enough it skips, once per outage, and says when space is back."""
    jd = JobDir(tmp_path / "job")
    jd.create()
    size = 1 << 20
    for step in (10, 20, 30):
        _commit_step(jd, step, size)
    need = SpaceGuard.need_bytes(_request(40, size))
    capacity = {"bytes": 3 * size + need - size // 2}  # room once one old step is gone

    def free(_: Path) -> int:
        return capacity["bytes"] - tree_bytes(jd.checkpoints)

    guard = SpaceGuard(jd, free=free)
    assert guard.admit(_request(40, size)) is None
    assert committed_steps(jd.checkpoints) == [30, 20]
    capacity["bytes"] = size + need - SPACE_MARGIN_BYTES  # not even with the newest alone
    why = guard.admit(_request(50, size))
    assert why is not None and why.startswith("skipped:")
    assert committed_steps(jd.checkpoints) == [30]  # the newest committed one stays
    assert guard.admit(_request(60, size)) is not None
    assert (guard.skipped, guard.outage_skipped) == (2, 2)
    capacity["bytes"] = 10 * need
    assert guard.admit(_request(70, size)) is None and guard.outage_skipped == 0
    kinds = [(e["event"], e["step"]) for e in jd.read_events()]
    assert kinds == [("checkpoint_pruned", 10), ("checkpoint_pruned", 20),
                     ("checkpoint_skipped", 50), ("checkpoint_skipped", 60),
                     ("disk_space_back", 70)]


# ---------------------------------------------------------------- the agent on a full disk

def _ask(sock: socket.socket, msg: dict) -> dict:
    ipc.send(sock, msg)
    sock.settimeout(30)
    return ipc.recv(sock)


def test_agent_answers_every_rank_through_a_full_disk_and_removes_failed_staging(tmpfs,
                                                                                tmp_path):
    """A real agent, world size 2, its job dir on a 4 MiB tmpfs. Step 10 does not fit: both
    ranks hear "skipped". Step 20 fits, rank 0's shard is written, then the disk fills: rank
    1's write fails, both ranks hear the failure, the staging directory is gone, the agent
    serves on (hello answered), and once space is back step 30 commits. At its end it says how
    many failed and were skipped."""
    job = tmpfs / "job"
    JobDir(job).create()
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir(mode=0o700)
    small, big = 1 << 20, 6 << 20
    slot_small = slot_dir / "rank00000-small.slot"
    slot_small.write_bytes(os.urandom(small))
    slot_big = slot_dir / "rank00000-big.slot"
    slot_big.write_bytes(b"\0" * big)
    for s in (slot_small, slot_big):
        s.chmod(0o600)
    address = ipc.new_agent_address()
    agent = subprocess.Popen(
        [sys.executable, "-m", "cfrun.agent", "--job-dir", str(job), "--keep", "2",
         "--address", address, "--slot-dir", str(slot_dir), "--world-size", "2",
         "--no-odirect"], env=_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r0 = ipc.connect(job, address=address, expect_pid=agent.pid)
                break
            except OSError:
                assert agent.poll() is None and time.monotonic() < deadline, "no agent"
                time.sleep(0.1)
        r1 = ipc.connect(job, address=address, expect_pid=agent.pid)

        def persist(sock, step, rank, slot, nbytes):
            return _ask(sock, PersistRequest(step, rank, 2, str(slot), nbytes,
                                             {"meta": {"step": step}}).to_json())

        assert _ask(r0, {"op": "hello", "rank": 0})["op"] == "ready"
        # step 10 cannot fit (2 x 6 MiB on a 4 MiB disk): both ranks hear it at once
        for sock, rank in ((r0, 0), (r1, 1)):
            reply = persist(sock, 10, rank, slot_big, big)
            assert not reply["ok"] and "skipped" in reply["error"], reply
        # step 20 fits; after rank 0's shard the disk fills up
        ipc.send(r0, PersistRequest(20, 0, 2, str(slot_small), small,
                                    {"meta": {"step": 20}}).to_json())
        staging = staging_dir(job / "checkpoints", 20)
        deadline = time.monotonic() + 30
        while not (staging / "rank-00000.json").exists():
            assert time.monotonic() < deadline, "rank 0's shard was not written"
            time.sleep(0.05)
        ballast = tmpfs / "ballast"
        with open(ballast, "wb") as f:
            st = os.statvfs(tmpfs)
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
        reply1 = persist(r1, 20, 1, slot_small, small)
        r0.settimeout(30)
        reply0 = ipc.recv(r0)
        assert not reply0["ok"] and not reply1["ok"], (reply0, reply1)
        assert "No space left" in reply1["error"], reply1
        assert not staging.exists()
        ballast.unlink()
        # the agent serves on: a hello is answered, and step 30 commits
        assert _ask(r1, {"op": "hello", "rank": 1})["op"] == "ready"
        ipc.send(r0, PersistRequest(30, 0, 2, str(slot_small), small,
                                    {"meta": {"step": 30}}).to_json())
        reply1 = persist(r1, 30, 1, slot_small, small)
        r0.settimeout(30)
        reply0 = ipc.recv(r0)
        assert reply0["ok"] and reply1["ok"], (reply0, reply1)
        assert committed_steps(job / "checkpoints") == [30]
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=300)
    assert agent.returncode == 0, err
    assert "1 checkpoint(s) failed and 1 were skipped" in err, err
    assert err.count("skipping checkpoints") == 1, err
    kinds = [e["event"] for e in JobDir(job).read_events()]
    assert "checkpoint_skipped" in kinds and "persist_summary" in kinds, kinds
    summary = [e for e in JobDir(job).read_events() if e["event"] == "persist_summary"][-1]
    assert (summary["failed"], summary["skipped"]) == (1, 1)
    assert not [p for p in (job / "checkpoints").iterdir() if p.name.startswith(".staging-")]


# ---------------------------------------------------------------- the rank's bounded wait

def test_a_rank_waits_for_the_agents_reply_only_so_long(tmp_path):
    """An agent that takes the persist and never answers: the checkpoint counts as failed
    after the reply timeout (``on_lost``), the rank is idle again and drops the connection."""
    import torch

    from cfrun.rank.snapshot import Snapshotter

    lost: list[tuple[int, str]] = []
    snap = Snapshotter(tmp_path, 0, 1, 0, emit=lambda fields: None,
                       on_lost=lambda step, error: lost.append((step, error)))
    snap.link.reply_timeout_min_s = 0.5
    rank_end, agent_end = socket.socketpair()
    snap.link.sock = rank_end
    t = torch.arange(16, dtype=torch.float32)
    handle = snap.start(7, {"x": 1}, [t], set(), {}, time.time(), time.perf_counter())
    (msg,) = [ipc.recv(agent_end)]
    assert msg["op"] == "persist" and msg["step"] == 7
    with pytest.raises(TimeoutError):
        handle.wait(30)
    assert not snap.busy() and snap.link.sock is None
    assert lost and lost[0][0] == 7 and "no reply from the persist agent" in lost[0][1]
    agent_end.close()
    snap.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_agent_whose_writer_thread_died_exits_for_a_restart(tmp_path):
    """Should the writer thread ever die (here: a SystemExit raised while handling a hello,
    which the writer does not catch), the agent exits 1 instead of living on unanswering,
    so the supervisor starts a new one."""
    from cfrun.agent.server import PersistAgent

    job = tmp_path / "job"
    JobDir(job).create()
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir(mode=0o700)
    agent = PersistAgent(job, keep=2, slot_dir=slot_dir, world_size=1)

    def die(conn, req):
        raise SystemExit("the writer dies")

    agent._handle = die  # type: ignore[method-assign]

    def hello() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                sock = ipc.connect(job)
                ipc.send(sock, {"op": "hello", "rank": 0})
                return
            except OSError:
                time.sleep(0.05)

    import threading

    threading.Thread(target=hello, daemon=True).start()
    with pytest.raises(SystemExit) as exc:
        agent.serve()
    assert exc.value.code == 1
    assert not JobDir(job).agent_path.exists()
