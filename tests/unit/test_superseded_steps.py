"""Issue 22: a step the ranks disagree on fails at once, never a 600 s wait.

A rank hands off its checkpoints in step order, the next only after the previous one's reply;
so once it hands off a later step, an earlier step still missing its shard can never complete.
A real persist agent fails that step on the spot (a failure reply to the ranks waiting on it, a
warning, a ``step_superseded`` event, its staging directory removed, its straggling shards
refused unwritten) and the next checkpoint commits. With several nodes, a node's mark of a
later step fails the step it never marked on every other node (:class:`Committer`, two of them
sharing a job dir).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cfrun.agent.commit import Committer
from cfrun.contract import ipc
from cfrun.contract.checkpoints import committed_steps, staging_dir, write_file
from cfrun.contract.jobdir import JobDir
from cfrun.contract.messages import Persisted, PersistFailed, PersistRequest

ROOT = Path(__file__).resolve().parents[2]
REPLY_S = 30.0
"""Socket timeout for a reply: far above the milliseconds a prompt failure takes, far below
the 600 s a rank waits for a reply that never comes."""


@contextmanager
def _agent(job: Path, slot_dir: Path, world_size: int) -> Iterator[tuple[subprocess.Popen,
                                                                          str]]:
    """A real persist agent (``python -m cfrun.agent``) for ``job``; SIGTERMed at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CFRUN_")}
    env["PYTHONPATH"] = str(ROOT)
    address = ipc.new_agent_address()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cfrun.agent", "--job-dir", str(job), "--keep", "2",
         "--address", address, "--slot-dir", str(slot_dir), "--world-size", str(world_size),
         "--no-odirect"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield proc, address
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)


def _connect(job: Path, proc: subprocess.Popen, address: str) -> socket.socket:
    deadline = time.monotonic() + 60
    while True:
        try:
            sock = ipc.connect(job, address=address, expect_pid=proc.pid)
            sock.settimeout(REPLY_S)
            return sock
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "no agent"
            time.sleep(0.1)


def test_a_later_step_fails_the_earlier_one_at_once_and_the_next_commits(tmp_path):
    """World size 3. Rank 0 hands off step 90; rank 1 goes on to step 112 without a shard of
    90: rank 0 hears at once that 90 failed ("superseded"), 90's staging is gone, rank 2's late
    shard of 90 is refused unwritten, and step 112 then commits with every rank's shard."""
    job = tmp_path / "job"
    JobDir(job).create()
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir(mode=0o700)
    slot = slot_dir / "rank00000-a.slot"
    slot.write_bytes(os.urandom(1 << 16))
    slot.chmod(0o600)
    with _agent(job, slot_dir, 3) as (proc, address):
        socks = [_connect(job, proc, address) for _ in range(3)]

        def send(rank: int, step: int) -> None:
            ipc.send(socks[rank], PersistRequest(step, rank, 3, str(slot), 1 << 16,
                                                 {"meta": {"step": step}}).to_json())

        send(0, 90)
        staging = staging_dir(job / "checkpoints", 90)
        deadline = time.monotonic() + REPLY_S
        while not (staging / "rank-00000.json").exists():  # rank 0's shard is durable
            assert time.monotonic() < deadline, "rank 0's shard of step 90 was not written"
            time.sleep(0.02)
        t0 = time.monotonic()
        send(1, 112)
        reply0 = ipc.recv(socks[0])
        assert reply0["step"] == 90 and not reply0["ok"], reply0
        assert "superseded" in reply0["error"] and "rank 1" in reply0["error"], reply0
        assert time.monotonic() - t0 < REPLY_S
        assert not staging.exists()
        send(2, 90)  # a straggler's shard of the failed step: refused, not written
        reply2 = ipc.recv(socks[2])
        assert reply2["step"] == 90 and not reply2["ok"] and "superseded" in reply2["error"]
        assert not staging.exists()
        send(0, 112)
        send(2, 112)
        replies = [ipc.recv(s) for s in socks]
        assert all(r["ok"] and r["step"] == 112 for r in replies), replies
    assert committed_steps(job / "checkpoints") == [112]
    [ev] = [e for e in JobDir(job).read_events() if e["event"] == "step_superseded"]
    assert (ev["step"], ev["later_step"], ev["rank"], ev["missing_ranks"]) == (90, 112, 1, [1, 2])


def test_a_node_that_marked_a_later_step_fails_the_step_it_never_marked(tmp_path):
    """Two nodes (one rank each) share the job dir. Node 0's rank hands off step 90, node 1's
    goes on to step 112: node 0's wait for node 1's mark of 90 ends at once with a failure
    reply (node 1's mark of 112 says it never comes), and node 0's mark of 90 is removed so
    90 can never commit; step 112 then commits."""
    jd = JobDir(tmp_path / "job")
    jd.create()
    replies: list[tuple[str, Persisted | PersistFailed]] = []

    def committer(node: int) -> Committer:
        return Committer(jd, keep=2, nnodes=2, node_rank=node, local_world_size=1,
                         reply=lambda conn, rec: replies.append((str(conn), rec)))

    nodes = [committer(0), committer(1)]

    def add(node: int, step: int) -> None:
        staging = staging_dir(jd.checkpoints, step)
        staging.mkdir(parents=True, exist_ok=True)
        files = [write_file(staging / f"rank-{node:05d}.bin", [b"x" * 64]),
                 write_file(staging / f"rank-{node:05d}.json", [b"{}"])]
        req = PersistRequest(step, node, 2, "/unused.slot", 64, {"meta": {"step": step}})
        nodes[node].add(f"node{node}-{step}", req, files, time.time())  # type: ignore[arg-type]

    def reply_of(conn: str) -> Persisted | PersistFailed:
        deadline = time.monotonic() + REPLY_S
        while not [r for c, r in replies if c == conn]:
            assert time.monotonic() < deadline, f"no reply to {conn}"
            time.sleep(0.01)
        return next(r for c, r in replies if c == conn)

    add(0, 90)
    add(1, 112)
    failed = reply_of("node0-90")
    assert isinstance(failed, PersistFailed) and "superseded" in failed.error, failed
    assert not (staging_dir(jd.checkpoints, 90) / "node-00000.json").exists()
    add(0, 112)
    assert isinstance(reply_of("node0-112"), Persisted)
    assert isinstance(reply_of("node1-112"), Persisted)
    assert committed_steps(jd.checkpoints) == [112]
    kinds = [(e["step"], e["node"]) for e in jd.read_events() if e["event"] == "step_superseded"]
    assert kinds == [(90, 1)]
