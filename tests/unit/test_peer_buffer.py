"""The peer's data safety (issue 13, "Jobs collide on a peer"): level-2 retention, durable only
when listed, RAM held within the budget with transfers in progress, in one process.

A real ``PeerServer`` on loopback (its threads), real clients on real sockets, real files for
level 2. A sender "dies mid-transfer" by closing its socket after part of a payload.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from cfrun.contract.manifest import FileEntry, Manifest
from cfrun.peer.protocol import RESPONSE, Op, PeerClient, PeerError, manifest_key, seal_tag
from cfrun.peer.server import PeerServer
from cfrun.storage.tiers import DirStorage, apply_retention, open_storage

TOKEN = b"t" * 32
MIB = 1 << 20


@contextlib.contextmanager
def running(tmp_path: Path, *, slots: int = 2, max_checkpoint_bytes: int = MIB, keep: int = 3,
            storage: Any = None) -> Iterator[PeerServer]:
    srv = PeerServer(("127.0.0.1", 0), storage or open_storage(str(tmp_path / "l2")), TOKEN,
                     slots=slots, max_checkpoint_bytes=max_checkpoint_bytes, keep=keep)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.stop()
        t.join(20)


def _send(c: PeerClient, job: str, step: int, data: bytes, *, meta: dict[str, Any] | None = None,
          wait_s: float = 10.0) -> bool:
    """One rank's shard and its JSON, then its seal (as the agent sends them)."""
    c.put(job=job, step=step, world_size=1, name="rank-00000.bin", part=0, nparts=1, offset=0,
          file_bytes=len(data), data=data, wait_s=wait_s)
    c.put(job=job, step=step, world_size=1, name="rank-00000.json", part=0, nparts=1,
          offset=0, file_bytes=2, data=b"{}", wait_s=wait_s)
    files = [
        {"name": "rank-00000.bin", "nbytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)},
        {"name": "rank-00000.json", "nbytes": 2, "xxh3_64": xxhash.xxh3_64_hexdigest(b"{}")}]
    meta = meta if meta is not None else {"step": step}
    tag = seal_tag(manifest_key(TOKEN, job), step=step, world_size=1, rank=0, files=files,
                   meta=meta)
    return c.seal(job=job, step=step, world_size=1, rank=0, meta=meta, files=files, tag=tag)


def _until(pred: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _level2_step(store: Any, job: str, step: int, job_id: str | None) -> None:
    """A checkpoint at level 2 as a flush writes it, of the job ``job_id`` (None: no id)."""
    data = f"{job}/{step}/{job_id}".encode()
    w = store.begin(job, step)
    w.write_file("rank-00000.bin", [data])
    meta: dict[str, Any] = {"step": step}
    if job_id is not None:
        meta["job_id"] = job_id
    w.commit(Manifest.build(step, 1, [FileEntry("rank-00000.bin", len(data),
                                                xxhash.xxh3_64_hexdigest(data))], meta))


class StalledPut:
    """One PUT on a connection of its own whose sender sends ``sent_bytes`` of the payload,
    then waits: :meth:`finish` sends the rest, :meth:`die` closes the connection (the sender's
    node died mid-transfer). ``outcome``: the final reply, or the exception."""

    def __init__(self, address: tuple[str, int], job: str, step: int, data: memoryview | bytes,
                 digest: str, *, sent_bytes: int, name: str = "rank-00000.bin", part: int = 0,
                 nparts: int = 1, offset: int = 0, file_bytes: int | None = None,
                 wait_s: float = 10.0) -> None:
        self.client = PeerClient(address, TOKEN)
        self.data = memoryview(data)
        self.sent_bytes = sent_bytes
        self.header = {"job": job, "step": step, "world_size": 1, "name": name, "part": part,
                       "nparts": nparts, "offset": offset,
                       "file_bytes": len(self.data) if file_bytes is None else file_bytes,
                       "xxh3_64": digest, "wait_s": wait_s}
        self.started = threading.Event()
        """Set once the peer answered the header (reservation made, or refused)."""
        self.refused: str | None = None
        self.decision = threading.Event()
        self.dies = False
        self.outcome: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _parts(self) -> Iterator[memoryview]:
        yield self.data[:self.sent_bytes]
        self.decision.wait(60)
        if self.dies:
            self.client.sock.close()
            raise ConnectionAbortedError("the sender died mid-transfer")
        yield self.data[self.sent_bytes:]

    def _run(self) -> None:
        ch = self.client.ch
        try:
            self.client.sock.settimeout(90)
            ch.send_header(Op.PUT, self.header, len(self.data))
            op, reply, _ = ch.recv_header(0)
            assert op == Op.PUT | RESPONSE
            if not reply.get("ok") or not reply.get("go"):
                self.refused = str(reply.get("error"))
                return
            self.started.set()
            ch.send_payload(self._parts())
            self.outcome = ch.recv_header(0)[1]
        except Exception as e:
            self.outcome = e
        finally:
            self.started.set()

    def finish(self) -> dict[str, Any]:
        self.decision.set()
        self.thread.join(60)
        assert isinstance(self.outcome, dict), self.outcome
        return self.outcome

    def die(self) -> None:
        self.dies = True
        self.decision.set()
        self.thread.join(60)


# ---------------------------------------------------------------------- level-2 retention


def test_retention_keeps_the_flushed_step_and_newer_ones_and_never_another_jobs(tmp_path):
    """Before: the peer deleted the step it had just flushed (level 2 held higher steps of the
    same name) and another job's steps, and still answered durable."""
    store = open_storage(str(tmp_path / "l2"))
    for step in (10, 20, 300, 400):  # 300, 400: an earlier attempt of this job got further
        _level2_step(store, "j", step, "job-a")
    _level2_step(store, "j", 5, "job-b")  # another job under the same name
    _level2_step(store, "j", 15, None)  # written without a job id: not this job's
    _level2_step(store, "other", 1, "job-a")
    with running(tmp_path, keep=2, storage=store) as srv:
        c = PeerClient(srv.address, TOKEN)
        assert _send(c, "j", 30, b"y" * 100, meta={"step": 30, "job_id": "job-a"})
        assert c.await_state("j", 30, "durable", 30)["state"] == "durable"
        assert store.list_steps("j") == [400, 300, 30, 20, 15, 5]  # only 10 went
        assert store.read_file("j", 30, "rank-00000.bin", 100) == b"y" * 100
        assert _send(c, "j", 40, b"z" * 100, meta={"step": 40, "job_id": "job-a"})
        assert c.await_state("j", 40, "durable", 30)["state"] == "durable"
        assert store.list_steps("j") == [400, 300, 40, 30, 15, 5]
        assert store.read_manifest("j", 5)["meta"]["job_id"] == "job-b"
        assert store.list_steps("other") == [1]


def test_retention_without_job_ids_counts_the_steps_below_the_flushed_one(tmp_path):
    store = DirStorage(tmp_path / "l2")
    for step in (1, 2, 3, 4, 5, 9):
        _level2_step(store, "j", step, None)
    assert apply_retention(store, "j", 3, flushed_step=5, job_id=None) == [2, 1]
    assert store.list_steps("j") == [9, 5, 4, 3]
    assert apply_retention(store, "j", 1, flushed_step=3, job_id=None) == []  # 3 is the newest
    assert apply_retention(store, "j", 1, flushed_step=4, job_id="x") == []  # no step of "x"
    assert store.list_steps("j") == [9, 5, 4, 3]
    with pytest.raises(ValueError, match="keep 0"):
        apply_retention(store, "j", 0, flushed_step=5, job_id=None)


class HidingStorage(DirStorage):
    """A level 2 whose listing leaves out the steps in ``hidden`` (a listing that lags, or a
    store where something removed them)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hidden: set[int] = set()

    def list_steps(self, job: str) -> list[int]:
        return [s for s in super().list_steps(job) if s not in self.hidden]


def test_durable_is_answered_only_once_the_flushed_step_is_listed_at_level_2(tmp_path):
    store = HidingStorage(tmp_path / "l2")
    store.hidden.add(7)
    with running(tmp_path, storage=store) as srv:
        c = PeerClient(srv.address, TOKEN)
        assert _send(c, "j", 7, b"q" * 100)
        replies: list[dict[str, Any]] = []

        def failed() -> bool:
            replies.append(c.await_state("j", 7, "durable", 0.2))
            assert replies[-1]["state"] != "durable", "durable, yet not listed at level 2"
            return replies[-1].get("error") is not None

        _until(failed)
        assert "not listed" in replies[-1]["error"]
        store.hidden.clear()  # the listing catches up: the retried flush is durable
        assert c.await_state("j", 7, "durable", 30)["state"] == "durable"


def test_a_flush_never_replaces_another_jobs_step_under_the_same_name(tmp_path):
    store = open_storage(str(tmp_path / "l2"))
    _level2_step(store, "j", 7, "job-b")
    with running(tmp_path, storage=store) as srv:
        c = PeerClient(srv.address, TOKEN)
        assert _send(c, "j", 7, b"a" * 100, meta={"step": 7, "job_id": "job-a"})
        reply: dict[str, Any] = {}

        def failed() -> bool:
            reply.update(c.await_state("j", 7, "durable", 0.2))
            assert reply["state"] != "durable", "durable over another job's step"
            return reply.get("error") is not None

        _until(failed)
        assert "another job" in reply["error"]
        assert store.read_manifest("j", 7)["meta"]["job_id"] == "job-b"
        assert store.read_file("j", 7, "rank-00000.bin", 1 << 20) == b"j/7/job-b"


# ---------------------------------------------------------------------- RAM held


def test_a_transfer_in_progress_is_never_evicted_and_counts_against_the_budget(tmp_path):
    """Before: a newer step evicted the partial step whose part was still arriving; its
    receive buffer stayed allocated but uncounted, and the part was then refused."""
    data = os.urandom(600_000)
    digest = xxhash.xxh3_64_hexdigest(data)
    with running(tmp_path, slots=2, max_checkpoint_bytes=MIB) as srv:
        a = StalledPut(srv.address, "j", 1, data, digest, sent_bytes=100_000)
        a.started.wait(30)
        b = StalledPut(srv.address, "j", 2, data, digest, sent_bytes=100_000)
        b.started.wait(30)
        assert a.refused is None and b.refused is None
        assert srv.ram_bytes() == 2 * len(data)  # both receive buffers, though half empty
        c = PeerClient(srv.address, TOKEN)
        with pytest.raises(PeerError, match="transfers in progress"):
            c.put(job="j", step=3, world_size=1, name="rank-00000.bin", part=0, nparts=1,
                  offset=0, file_bytes=100, data=b"c" * 100, wait_s=0.5)
        assert srv.ram_bytes() <= 2 * MIB
        assert a.finish() == {"ok": True, "error": None}  # step 1 was kept: its part stored
        b.die()
        _until(lambda: srv.ram_bytes() == len(data))  # b's buffer given back, its slot freed
        assert [e["step"] for e in c.list("j")["checkpoints"]] == [1]
        assert _send(c, "j", 3, b"c" * 100)  # the freed slot
        assert c.await_state("j", 3, "durable", 30)["state"] == "durable"
        assert [e["step"] for e in c.list("j")["checkpoints"]] == [3]  # 1: superseded, dropped
        assert srv.ram_bytes() == 102


def test_an_abandoned_partial_checkpoints_bytes_are_freed(tmp_path):
    """A sender stores one part of step 1, dies in the middle of the next; step 2 completes.
    Step 1's bytes stay counted while its transfer is in progress, then all of them are freed."""
    data = os.urandom(200_000)
    digest = xxhash.xxh3_64_hexdigest(data)
    with running(tmp_path, slots=2, max_checkpoint_bytes=MIB) as srv:
        c = PeerClient(srv.address, TOKEN)
        c.put(job="j", step=1, world_size=1, name="rank-00000.bin", part=0, nparts=2, offset=0,
              file_bytes=2 * len(data), data=data)
        dying = StalledPut(srv.address, "j", 1, data, digest, sent_bytes=50_000, part=1,
                           nparts=2, offset=len(data), file_bytes=2 * len(data))
        dying.started.wait(30)
        assert srv.ram_bytes() == 2 * len(data)
        assert _send(c, "j", 2, b"n" * 1000)  # step 1 is now superseded, but still arriving
        assert srv.ram_bytes() == 2 * len(data) + 1002
        assert sorted(e["step"] for e in c.list("j")["checkpoints"]) == [1, 2]
        dying.die()
        _until(lambda: srv.ram_bytes() == 1002)  # both of step 1's buffers are gone
        assert [e["step"] for e in c.list("j")["checkpoints"]] == [2]


def test_ram_held_never_exceeds_the_limit_under_senders_that_die_mid_transfer(tmp_path):
    """A stream of senders, each of a newer step, each dying after part of its payload.
    Measured twice: the buffer's accounting, sampled, and the bytes Python really allocated
    (tracemalloc's peak over the whole stream)."""
    slots, max_bytes, part = 2, 4 * MIB, 3 * MIB + MIB // 2
    limit = slots * max_bytes
    data = os.urandom(part)
    digest = xxhash.xxh3_64_hexdigest(data)
    with running(tmp_path, slots=slots, max_checkpoint_bytes=max_bytes) as srv:
        seen: list[int] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                seen.append(srv.ram_bytes())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            sampler.start()
            senders: list[StalledPut] = []
            killers: list[threading.Thread] = []

            def die_soon(s: StalledPut) -> None:
                s.started.wait(60)
                time.sleep(0.2)
                s.die()

            for step in range(1, 13):
                s = StalledPut(srv.address, "j", step, data, digest, sent_bytes=MIB,
                               wait_s=20)
                senders.append(s)
                k = threading.Thread(target=die_soon, args=(s,), daemon=True)
                k.start()
                killers.append(k)
                time.sleep(0.05)
            for k in killers:
                k.join(120)
            _until(lambda: srv.ram_bytes() == 0)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            done.set()
            tracemalloc.stop()
        sampler.join(10)
        print(f"peak {peak / MIB:.1f} MiB allocated, accounting at most {max(seen) / MIB:.1f} "
              f"MiB, limit {limit / MIB:.0f} MiB")
        assert max(seen) <= limit
        assert peak <= limit + MIB, f"{peak / MIB:.1f} MiB allocated, limit {limit / MIB} MiB"
        assert sum(s.refused is None for s in senders) >= 2  # some did get in
        c = PeerClient(srv.address, TOKEN)
        assert _send(c, "j", 100, b"ok" * 10)  # and the peer serves on
        assert c.await_state("j", 100, "durable", 30)["state"] == "durable"


def test_a_refused_sender_is_told_why_in_one_line(tmp_path):
    with running(tmp_path, slots=1, max_checkpoint_bytes=MIB) as srv:
        data = os.urandom(1000)
        a = StalledPut(srv.address, "j", 1, data, xxhash.xxh3_64_hexdigest(data),
                       sent_bytes=10)
        a.started.wait(30)
        b = StalledPut(srv.address, "j", 2, data, xxhash.xxh3_64_hexdigest(data),
                       sent_bytes=10, wait_s=0.2)
        b.thread.join(30)
        assert b.refused is not None and "\n" not in b.refused
        assert "1 slots hold unflushed checkpoints or transfers in progress" in b.refused
        a.die()
        _until(lambda: srv.ram_bytes() == 0)
