"""Peer tier pieces in one process: storage semantics, the circular buffer, parsing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import xxhash

from cfrun.contract.config import parse_bytes
from cfrun.contract.errors import BadInputError, CheckpointCorruptError
from cfrun.contract.manifest import FileEntry, Manifest
from cfrun.peer.server import PeerClient, PeerError, PeerServer, parse_address, read_token
from cfrun.agent.peertier import split_parts
from cfrun.storage.tiers import open_storage

TOKEN = b"t" * 32


@pytest.mark.parametrize("url", ["dir", "file"])
def test_level2_counts_a_step_only_with_its_manifest(tmp_path, url):
    root = tmp_path / "l2"
    store = open_storage(str(root) if url == "dir" else f"file://{root}")
    w = store.begin("job", 10)
    w.write_file("rank-00000.bin", [b"abc", bytearray(b"def")])
    with pytest.raises(CheckpointCorruptError, match="missing field"):
        w.commit({"format_version": 1, "files": [], "step": 10})  # not a valid manifest
    w.commit(Manifest.build(10, 1, [FileEntry("rank-00000.bin", 6,
                                              xxhash.xxh3_64_hexdigest(b"abcdef"))]))
    w = store.begin("job", 20)  # cut short: files, no manifest
    w.write_file("rank-00000.bin", [b"xyz"])
    assert store.list_steps("job") == [10]
    assert store.read_file("job", 10, "rank-00000.bin") == b"abcdef"
    assert store.cleanup() == 1
    assert store.list_steps("job") == [10]
    store.delete("job", 10)
    assert store.list_steps("job") == []
    with pytest.raises(ValueError):
        store.list_steps("../etc")
    with pytest.raises(ValueError):
        store.read_file("job", 10, "../../secret")


def test_split_parts_covers_the_shard_in_aligned_ranges():
    for nbytes in (4096, 5 << 20, (8 << 20) + 4096, 123 << 20):
        for streams in range(1, 9):
            parts = split_parts(nbytes, streams)
            assert len(parts) <= streams
            assert parts[0][0] == 0 and sum(n for _, n in parts) == nbytes
            assert all(off % 4096 == 0 for off, _ in parts)
            assert all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
    assert len(split_parts(64 << 20, 8)) == 8


def test_parsers():
    assert parse_bytes("x", "4G") == 4 << 30 and parse_bytes("x", "512MiB") == 512 << 20
    assert parse_bytes("x", "1000") == 1000
    with pytest.raises(BadInputError):
        parse_bytes("--max-checkpoint-bytes", "lots")
    assert parse_address("10.0.0.5:7077") == ("10.0.0.5", 7077)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("7077", "host:", "host:99999", ":80"):
        with pytest.raises(BadInputError):
            parse_address(bad)


def test_read_token_refuses_empty_short_and_shared_files(tmp_path):
    p = tmp_path / "t"
    p.write_text("  " + "a" * 20 + "\n")
    p.chmod(0o600)
    assert read_token(str(p)) == b"a" * 20
    for text, mode in (("", 0o600), ("short", 0o600), ("a" * 20, 0o644)):
        p.write_text(text)
        p.chmod(mode)
        with pytest.raises(BadInputError):
            read_token(str(p))
    with pytest.raises(BadInputError):
        read_token(str(tmp_path / "missing"))


@pytest.fixture
def server(tmp_path):
    srv = PeerServer(("127.0.0.1", 0), open_storage(str(tmp_path / "l2")), TOKEN, slots=2,
                     max_checkpoint_bytes=1 << 20)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(10)


def _send(c: PeerClient, job: str, step: int, data: bytes, *, seal: bool = True,
          wait_s: float = 10.0) -> bool:
    c.put(job=job, step=step, world_size=1, name="rank-00000.bin", part=0, nparts=1, offset=0,
          file_bytes=len(data), data=data, wait_s=wait_s)
    if not seal:
        return False
    c.put(job=job, step=step, world_size=1, name="rank-00000.json", part=0, nparts=1,
          offset=0, file_bytes=2, data=b"{}", wait_s=wait_s)
    return c.seal(job=job, step=step, world_size=1, rank=0, meta={"step": step}, files=[
        {"name": "rank-00000.bin", "nbytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)},
        {"name": "rank-00000.json", "nbytes": 2, "xxh3_64": xxhash.xxh3_64_hexdigest(b"{}")}])


def test_partial_checkpoint_is_never_served_and_a_newer_one_drops_it(server):
    c = PeerClient(server.address, TOKEN)
    _send(c, "j", 5, b"x" * 1000, seal=False)  # the sender died before its seal
    assert [e["state"] for e in c.list("j")["checkpoints"]] == ["filling"]
    with pytest.raises(PeerError):
        c.get("j", 5, "rank-00000.bin", 1 << 20)
    assert _send(c, "j", 6, b"y" * 1000)
    assert c.await_state("j", 6, "durable", 10)["state"] == "durable"
    assert [e["step"] for e in c.list("j")["checkpoints"]] == [6]
    assert bytes(c.get("j", 6, "rank-00000.bin", 1 << 20)) == b"y" * 1000


def test_full_buffer_makes_senders_wait_for_the_flusher_then_refuses(server, monkeypatch):
    """ACUTE's dirty bits: no slot holding unflushed data is ever overwritten."""
    gate = threading.Event()
    flush = server._flush
    monkeypatch.setattr(server, "_flush", lambda ck: (gate.wait(30), flush(ck)))
    c = PeerClient(server.address, TOKEN)
    assert _send(c, "j", 1, b"a" * 100) and _send(c, "j", 2, b"b" * 100)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="unflushed"):
        _send(c, "j", 3, b"c" * 100, wait_s=0.5)
    assert time.monotonic() - t0 >= 0.5
    gate.set()
    assert c.await_state("j", 2, "durable", 10)["state"] == "durable"
    assert _send(c, "j", 3, b"c" * 100)  # the oldest durable slot (step 1) is reused
    assert sorted(e["step"] for e in c.list("j")["checkpoints"]) == [2, 3]
    assert server.ram_bytes() <= 2 * (1 << 20)


def test_oversized_checkpoint_is_refused_before_allocation(server):
    c = PeerClient(server.address, TOKEN)
    with pytest.raises(PeerError, match="max-checkpoint-bytes"):
        _send(c, "j", 1, b"z" * ((1 << 20) - 1))  # the JSON file tips it over
    assert server.ram_bytes() <= 1 << 20
