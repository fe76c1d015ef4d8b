"""The peer's flusher (issue 32, finding 5): per-job queues served in turn, a failing job in
backoff behind the others, one line per outage. A real ``PeerServer`` in this process; the
same with a real ``cfrun peer`` and level 2 refusing a job's directory is in
tests/integration/test_peer.py."""

from __future__ import annotations

import logging
import threading

import pytest
import xxhash

from cfrun.peer import flusher as flusher_mod
from cfrun.peer.protocol import PeerClient, manifest_key, seal_tag
from cfrun.peer.server import PeerServer
from cfrun.storage.tiers import open_storage

TOKEN = b"t" * 32


@pytest.fixture
def server(tmp_path):
    srv = PeerServer(("127.0.0.1", 0), open_storage(str(tmp_path / "l2")), TOKEN, slots=8,
                     max_checkpoint_bytes=1 << 20)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(10)


def _send(c: PeerClient, job: str, step: int) -> None:
    data = f"{job} {step}".encode()
    c.put(job=job, step=step, world_size=1, name="rank-00000.bin", part=0, nparts=1, offset=0,
          file_bytes=len(data), data=data)
    files = [{"name": "rank-00000.bin", "nbytes": len(data),
              "xxh3_64": xxhash.xxh3_64_hexdigest(data)}]
    assert c.seal(job=job, step=step, world_size=1, rank=0, meta={}, files=files,
                  tag=seal_tag(manifest_key(TOKEN, job), step=step, world_size=1, rank=0,
                               files=files, meta={}))


def test_jobs_are_flushed_in_turn_oldest_first_within_a_job(server, monkeypatch):
    order: list[tuple[str, int]] = []
    first = threading.Event()
    go = threading.Event()
    flush = server.flusher.flush

    def recording(ck):
        order.append((ck.job, ck.step))
        first.set()
        go.wait(30)
        flush(ck)

    monkeypatch.setattr(server.flusher, "flush", recording)
    c = PeerClient(server.address, TOKEN)
    _send(c, "x", 1)
    assert first.wait(10)  # x 1 is being flushed; the rest queue up behind it
    for job, step in (("x", 2), ("x", 3), ("y", 1), ("y", 2), ("z", 1)):
        _send(c, job, step)
    go.set()
    for job, step in (("x", 3), ("y", 2), ("z", 1)):
        assert c.await_state(job, step, "durable", 10)["state"] == "durable"
    assert order == [("x", 1), ("y", 1), ("z", 1), ("x", 2), ("y", 2), ("x", 3)]


def test_a_failing_job_backs_off_behind_the_others_and_is_said_once(server, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(flusher_mod, "RETRY_AFTER_S", 0.05)
    monkeypatch.setattr(flusher_mod, "MAX_RETRY_AFTER_S", 0.2)
    tries: list[int] = []
    flush = server.flusher.flush

    def failing(ck):
        if ck.job == "bad" and len(tries) < 5:
            tries.append(ck.step)
            raise OSError(28, "No space left on device")
        flush(ck)

    monkeypatch.setattr(server.flusher, "flush", failing)
    caplog.set_level(logging.INFO, logger="cfrun.peer.server")
    c = PeerClient(server.address, TOKEN)
    _send(c, "bad", 1)
    _send(c, "bad", 2)
    for step in range(1, 4):
        _send(c, "good", step)
        assert c.await_state("good", step, "durable", 10)["state"] == "durable"
    assert c.await_state("bad", 2, "durable", 10)["state"] == "durable"
    assert tries == [1] * 5  # only its oldest was tried; its later one waited behind it
    failed = [r.getMessage() for r in caplog.records if "flush of bad" in r.getMessage()]
    assert len(failed) == 2, failed
    assert "step 1 failed: [Errno 28] No space left on device; retried with backoff" in failed[0]
    assert "works again (step 1 durable) after 5 failed tries" in failed[1]
