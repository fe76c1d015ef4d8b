"""Peer tier pieces in one process: storage semantics, the circular buffer, parsing."""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time

import pytest
import xxhash

from cfrun.agent.peertier import PeerTier, split_parts
from cfrun.contract.config import parse_bytes
from cfrun.contract.errors import BadInputError, CheckpointCorruptError
from cfrun.contract.manifest import FileEntry, Manifest
from cfrun.peer.protocol import (
    FRAME,
    FRAME_MAGIC,
    MAX_FETCH_BYTES,
    Channel,
    Op,
    PeerClient,
    PeerError,
    ProtocolError,
    dumps_json,
    handshake_mac,
    hkdf_sha256,
    loads_json,
    manifest_key,
    number,
    parse_address,
    read_token,
    recv_exact,
    seal_tag,
    session_keys,
    verify_manifest,
)
from cfrun.peer.server import PeerServer
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
    assert store.read_file("job", 10, "rank-00000.bin", 6) == b"abcdef"
    assert store.cleanup() == 1
    assert store.list_steps("job") == [10]
    store.delete("job", 10)
    assert store.list_steps("job") == []
    with pytest.raises(ValueError):
        store.list_steps("../etc")
    with pytest.raises(ValueError):
        store.read_file("job", 10, "../../secret", 6)


@pytest.mark.parametrize("url", ["dir", "file"])
def test_level2_refuses_a_file_larger_than_its_manifest_and_odd_step_names(tmp_path, url):
    """Issue 24, items 9 and 10: a planted ``step-\u00b2`` (``str.isdigit`` but not ``int``)
    or ``step-\u0663`` (an Arabic-Indic 3) is no step, and an object larger than the size
    the reader declares is refused after reading at most one byte more."""
    root = tmp_path / "l2"
    store = open_storage(str(root) if url == "dir" else f"file://{root}")
    w = store.begin("job", 10)
    w.write_file("rank-00000.bin", [b"x" * 4096])
    w.commit(Manifest.build(10, 1, [FileEntry("rank-00000.bin", 4096,
                                              xxhash.xxh3_64_hexdigest(b"x" * 4096))]))
    for odd in ("step-\u00b2", "step-\u0663", "step-12a", "step-"):
        (root / "job" / odd).mkdir()
        (root / "job" / odd / "manifest.json").write_text("{}")
    assert store.list_steps("job") == [10]
    assert store.read_file("job", 10, "rank-00000.bin", 4096) == b"x" * 4096
    with pytest.raises(CheckpointCorruptError):
        store.read_file("job", 10, "rank-00000.bin", 100)


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
    p.write_text("  " + "a" * 32 + "\n")
    p.chmod(0o600)
    assert read_token(str(p)) == b"a" * 32
    for text, mode in (("", 0o600), ("short", 0o600), ("a" * 16, 0o600), ("a" * 32, 0o644)):
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
    files = [
        {"name": "rank-00000.bin", "nbytes": len(data), "xxh3_64": xxhash.xxh3_64_hexdigest(data)},
        {"name": "rank-00000.json", "nbytes": 2, "xxh3_64": xxhash.xxh3_64_hexdigest(b"{}")}]
    meta = {"step": step}
    tag = seal_tag(manifest_key(TOKEN, job), step=step, world_size=1, rank=0, files=files,
                   meta=meta)
    return c.seal(job=job, step=step, world_size=1, rank=0, meta=meta, files=files, tag=tag)


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
    flush = server.flusher.flush
    monkeypatch.setattr(server.flusher, "flush", lambda ck: (gate.wait(30), flush(ck)))
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


def test_a_late_await_for_a_flushed_and_evicted_checkpoint_still_hears_durable(server):
    """The agent's durable watcher may ask after newer checkpoints took the slot (a loaded
    machine); a flushed step must not read as missing then."""
    c = PeerClient(server.address, TOKEN)
    for step in (1, 2, 3, 4):  # two slots: 1 and 2 are evicted once flushed
        assert _send(c, "j", step, bytes([step]) * 100)
        assert c.await_state("j", step, "durable", 10)["state"] == "durable"
    assert sorted(e["step"] for e in c.list("j")["checkpoints"]) == [3, 4]
    late = c.await_state("j", 1, "durable", 10)
    assert late["state"] == "durable" and late["flush_to"] == server.storage.url
    assert c.await_state("j", 99, "durable", 1)["state"] == "missing"
    assert c.await_state("other", 1, "durable", 1)["state"] == "missing"


def test_oversized_checkpoint_is_refused_before_allocation(server):
    c = PeerClient(server.address, TOKEN)
    with pytest.raises(PeerError, match="max-checkpoint-bytes"):
        _send(c, "j", 1, b"z" * ((1 << 20) - 1))  # the JSON file tips it over
    assert server.ram_bytes() <= 1 << 20


# ---------------------------------------------------------------------- keys, tokens, JSON


def test_hkdf_matches_rfc5869_test_vectors():
    okm = hkdf_sha256(bytes([0x0B] * 22), salt=bytes(range(13)), info=bytes(range(0xF0, 0xFA)),
                      length=42)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf"
                         "34007208d5b887185865")  # RFC 5869 A.1
    okm = hkdf_sha256(bytes([0x0B] * 22), salt=b"", info=b"", length=42)
    assert okm.hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
                         "9d201395faa4b61a96c8")  # RFC 5869 A.3
    c2s, s2c = session_keys(TOKEN, b"s" * 32, b"c" * 32)
    assert len(c2s) == len(s2c) == 32 and c2s != s2c
    assert session_keys(TOKEN, b"s" * 32, b"d" * 32)[0] != c2s  # fresh nonces, fresh keys
    assert manifest_key(TOKEN, "a") != manifest_key(TOKEN, "b")


def test_token_file_must_be_a_private_regular_file_of_ours(tmp_path):
    p = tmp_path / "t"
    p.write_text("a" * 32)
    for mode in (0o640, 0o604, 0o660):
        p.chmod(mode)
        with pytest.raises(BadInputError, match=r"chmod 600") as e:
            read_token(str(p))
        assert str(p) in str(e.value) and "\n" not in str(e.value)
    p.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(p)
    with pytest.raises(BadInputError, match="symbolic link"):
        read_token(str(link))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(BadInputError, match="not a regular file"):
        read_token(str(fifo))  # and does not hang waiting for a writer
    if os.getuid() == 0:
        os.chown(p, 12345, -1)
        with pytest.raises(BadInputError, match="owned by uid 12345"):
            read_token(str(p))


def test_json_headers_refuse_non_finite_numbers_and_numbers_out_of_range():
    assert loads_json(b'{"wait_s": 1.5, "n": 3}') == {"wait_s": 1.5, "n": 3}
    for raw in (b'{"wait_s": NaN}', b'{"wait_s": Infinity}', b'{"wait_s": -Infinity}',
                b'{"wait_s": 1e999}', b'{"x": [1, -1e400]}'):
        with pytest.raises(ProtocolError, match="non-finite"):
            loads_json(raw)
    with pytest.raises(ProtocolError):
        loads_json(b'{"n": ' + b"9" * 5000 + b"}")  # int digits limit: refused, not parsed
    assert number({"wait_s": 0}, "wait_s", 0, 60, 10) == 0.0
    assert number({}, "wait_s", 0, 60, 10) == 10.0
    for bad in (float("nan"), float("inf"), -1, 61, True, "5", None):
        with pytest.raises(ProtocolError, match="wait_s"):
            number({"wait_s": bad}, "wait_s", 0, 60, 10)
    with pytest.raises(ValueError):
        dumps_json({"wait_s": float("nan")})  # never sent either


def _manifest(token: bytes, job: str, step: int, world_size: int = 2) -> dict:
    key = manifest_key(token, job)
    meta = {"step": step, "epoch": 1}
    files, seals = [], []
    for r in range(world_size):
        mine = [{"name": f"rank-{r:05d}.bin", "nbytes": 10 + r, "xxh3_64": f"{r:016x}"},
                {"name": f"rank-{r:05d}.json", "nbytes": 2, "xxh3_64": "0" * 16}]
        files += mine
        seals.append({"rank": r, "tag": seal_tag(key, step=step, world_size=world_size, rank=r,
                                                 files=mine, meta=meta)})
    return {"format_version": 1, "step": step, "world_size": world_size, "files": files,
            "meta": meta, "seals": seals}


def test_manifest_seals_cover_every_rank_file_checksum_and_meta():
    key = manifest_key(TOKEN, "j")
    verify_manifest(key, _manifest(TOKEN, "j", 40), 40, job="j")
    tampered = []
    m = _manifest(TOKEN, "j", 40)
    m["files"][2]["xxh3_64"] = "f" * 16  # rank 1's checksum, as a forger would set it
    tampered.append(m)
    m = _manifest(TOKEN, "j", 40)
    m["files"][0]["nbytes"] = 1 << 30
    tampered.append(m)
    m = _manifest(TOKEN, "j", 40)
    m["meta"]["epoch"] = 7
    tampered.append(m)
    m = _manifest(TOKEN, "j", 40)
    del m["seals"][1]
    tampered.append(m)
    m = _manifest(TOKEN, "j", 40)
    m["files"].append({"name": "rank-00001.bin", "nbytes": 1, "xxh3_64": "0"})  # an extra file
    tampered.append(m)
    m = _manifest(TOKEN, "j", 40)
    m["seals"][1] = {"rank": 0, "tag": m["seals"][0]["tag"]}  # one seal twice
    tampered.append(m)
    tampered.append(_manifest(b"x" * 32, "j", 40))  # another token
    tampered.append(_manifest(TOKEN, "other", 40))  # another job's agents
    for m in tampered:
        with pytest.raises(CheckpointCorruptError, match="not authenticated") as e:
            verify_manifest(key, m, 40, job="j")
        assert "\n" not in str(e.value)
    with pytest.raises(CheckpointCorruptError, match="names step 40"):
        verify_manifest(key, _manifest(TOKEN, "j", 40), 41, job="j")  # a replayed older step


# ---------------------------------------------------------------------- relays, tampering, limits


class Relay:
    """A TCP relay on 127.0.0.1 between a client and the peer (the attacker on the path).

    ``mode``: ``forward`` (faithful), ``flip`` (one byte of the stream from ``direction`` at
    ``offset`` inverted), ``answer`` (forwards the handshake, then answers every request itself
    with a forged frame: it cannot compute the tags, so it sends what it has), ``reset_first``
    (resets the first connection at once, a TCP RST, then forwards faithfully).
    """

    HANDSHAKE_S2C = 37 + 36
    HANDSHAKE_C2S = 69

    def __init__(self, target: tuple[str, int], mode: str, *, direction: str = "s2c",
                 offset: int = 0) -> None:
        self.target, self.mode, self.direction, self.offset = target, mode, direction, offset
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()[:2]
        self.threads: list[threading.Thread] = []
        self.answered = 0
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "reset_first":
                self.mode = "forward"
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # linger 0: the close is a reset
                continue
            server = socket.create_connection(self.target, timeout=10)
            client.settimeout(10)
            if self.mode == "answer":
                threading.Thread(target=self._answer, args=(client, server), daemon=True).start()
                continue
            for src, dst, name in ((client, server, "c2s"), (server, client, "s2c")):
                threading.Thread(target=self._pump, args=(src, dst, name), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, name: str) -> None:
        pos = 0
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                at = self.offset - pos
                if self.mode == "flip" and name == self.direction and 0 <= at < len(data):
                    data[at] ^= 0x01
                pos += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _answer(self, client: socket.socket, server: socket.socket) -> None:
        try:
            client.sendall(recv_exact(server, 37))  # the server's hello
            server.sendall(recv_exact(client, self.HANDSHAKE_C2S))  # the client's proof
            client.sendall(recv_exact(server, 36))  # the server's proof: handshake done
            server.close()
            while True:  # now the relay answers: a LIST with a forged step, any GET forged too
                fixed = recv_exact(client, FRAME.size)
                _, _, op, _, json_len, _ = FRAME.unpack(fixed)
                recv_exact(client, json_len + 32)
                body = json.dumps({"ok": True, "flush_to": "x", "nbytes": 2, "checkpoints": [
                    {"step": 99999999, "world_size": 1, "state": "durable", "bytes": 2}]}).encode()
                self.answered += 1
                client.sendall(FRAME.pack(FRAME_MAGIC, 2, op | 0x80, 0, len(body), 0) + body
                               + secrets.token_bytes(32))
        except (OSError, PeerError):
            pass
        finally:
            client.close()


def test_a_relay_that_answers_after_the_handshake_is_caught_at_its_first_frame(server):
    relay = Relay(server.address, "answer")
    try:
        c = PeerClient(relay.address, TOKEN)  # the handshake passes: the relay forwarded it
        with pytest.raises(ProtocolError, match="frame failed authentication") as e:
            c.list("j")
        assert relay.answered == 1 and "\n" not in str(e.value)
    finally:
        relay.close()


def test_a_connection_reset_in_the_handshake_is_tried_once_more(server):
    """A peer that resets a connection before its greeting (its accept queue overflowing, a
    restart) gets one more try, as one that closes it does: the client connects, and the
    reset was the first connection's."""
    relay = Relay(server.address, "reset_first")
    try:
        c = PeerClient(relay.address, TOKEN)
        assert c.list("j")["checkpoints"] == [] and relay.mode == "forward"
        c.close()
    finally:
        relay.close()


@pytest.mark.parametrize("direction,offset", [
    ("s2c", 73 + 20 + 5),                   # the GET reply's JSON
    ("s2c", 73 + 20 + 14 + 32 + 500),       # the GET reply's payload
    ("s2c", 73 + 20 + 14 + 32 + 1000 + 3),  # the payload's tag
    ("c2s", 69 + 20 + 5),                   # the GET request's JSON
])
def test_one_byte_flipped_in_flight_is_detected(server, direction, offset, caplog):
    c = PeerClient(server.address, TOKEN)
    assert _send(c, "j", 1, b"q" * 1000)
    c.close()
    relay = Relay(server.address, "flip", direction=direction, offset=offset)
    try:
        c = PeerClient(relay.address, TOKEN)
        with pytest.raises(PeerError) as e:
            c.get("j", 1, "rank-00000.bin", 1000, exact=True)
        if direction == "s2c":  # the client caught it
            assert "failed authentication (MAC mismatch" in str(e.value)
        else:  # the server caught it, said so and closed the stream
            deadline = time.monotonic() + 5
            while "frame failed authentication" not in caplog.text:
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.05)
        clean = PeerClient(server.address, TOKEN)  # the stream, not the peer, was hurt
        assert bytes(clean.get("j", 1, "rank-00000.bin", 1000, exact=True)) == b"q" * 1000
        relay.offset = -1
        assert bytes(PeerClient(relay.address, TOKEN).get("j", 1, "rank-00000.bin", 1000)) \
            == b"q" * 1000  # a faithful relay changes nothing
    finally:
        relay.close()


def test_a_put_payload_altered_in_flight_is_never_stored(server, caplog):
    relay = Relay(server.address, "flip", direction="c2s", offset=69 + 20 + 200 + 32 + 100)
    try:
        c = PeerClient(relay.address, TOKEN)
        with pytest.raises(PeerError):
            _send(c, "j", 1, b"p" * 1000)
        assert server.ram_bytes() == 0  # the reservation was given back, nothing kept
        assert "payload failed authentication" in caplog.text
    finally:
        relay.close()


def test_out_of_range_wait_s_is_refused_and_the_peer_keeps_serving(server):
    c = PeerClient(server.address, TOKEN)
    for bad in (float("nan"), float("inf"), -1.0, 1e9):
        with pytest.raises(ProtocolError, match="wait_s"):
            _send(c, "j", 1, b"x" * 10, wait_s=bad)  # the client refuses to send it
    ch = Channel(c.sock, c.ch.send_key, c.ch.recv_key)
    ch.send_seq, ch.recv_seq = c.ch.send_seq, c.ch.recv_seq
    ch.send_header(Op.PUT, {"job": "j", "step": 1, "world_size": 1, "name": "rank-00000.bin",
                            "part": 0, "nparts": 1, "offset": 0, "file_bytes": 10,
                            "xxh3_64": "0", "wait_s": -5}, 10)
    with pytest.raises(PeerError):  # the server refused it and closed the stream
        ch.recv_header(0)
    t0 = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - t0 < 0.2  # nobody spins
    assert _send(PeerClient(server.address, TOKEN), "j", 2, b"y" * 10)


def test_fetches_are_bounded_by_what_the_client_asked_for(server):
    c = PeerClient(server.address, TOKEN)
    assert _send(c, "j", 1, b"z" * 1000)
    with pytest.raises(PeerError, match="more than the 999 asked for"):
        c.get("j", 1, "rank-00000.bin", 999)
    with pytest.raises(ProtocolError, match="announces 1000 bytes, expected 1001"):
        c.get("j", 1, "rank-00000.bin", 1001, exact=True)
    with pytest.raises(ValueError):
        c.get("j", 1, "rank-00000.bin", MAX_FETCH_BYTES + 1)


def test_a_peer_that_announces_a_huge_payload_is_refused_before_allocation():
    """A hostile server that knows the token: its 1 TiB reply is refused from the header."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lsock.accept()
        nonce = secrets.token_bytes(32)
        conn.sendall(b"CFPH\x02" + nonce)
        hello = recv_exact(conn, 69)
        cn = hello[5:37]
        conn.sendall(b"CFPY" + handshake_mac(TOKEN, b"server", cn, nonce))
        c2s, s2c = session_keys(TOKEN, nonce, cn)
        ch = Channel(conn, s2c, c2s)
        ch.recv_header(0)
        ch.send_header(Op.GET | 0x80, {"ok": True, "nbytes": 1 << 40}, 1 << 40)
        time.sleep(1)
        conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = PeerClient(lsock.getsockname()[:2], TOKEN)
    with pytest.raises(ProtocolError, match="exceeds 1000"):
        c.get("j", 1, "rank-00000.bin", 1000)
    t.join(5)
    lsock.close()


def test_a_seal_with_a_wrong_tag_is_refused(server):
    c = PeerClient(server.address, TOKEN)
    _send(c, "j", 1, b"x" * 10, seal=False)
    c.put(job="j", step=1, world_size=1, name="rank-00000.json", part=0, nparts=1, offset=0,
          file_bytes=2, data=b"{}")
    files = [{"name": "rank-00000.bin", "nbytes": 10, "xxh3_64": xxhash.xxh3_64_hexdigest(
        b"x" * 10)}, {"name": "rank-00000.json", "nbytes": 2,
                      "xxh3_64": xxhash.xxh3_64_hexdigest(b"{}")}]
    tag = seal_tag(manifest_key(TOKEN, "other-job"), step=1, world_size=1, rank=0, files=files,
                   meta={})
    with pytest.raises(PeerError, match="seal of rank 0 of step 1 does not match"):
        c.seal(job="j", step=1, world_size=1, rank=0, files=files, meta={}, tag=tag)


JOB_KEY = b"1" * 64


def test_a_checkpoint_fetched_back_is_verified_end_to_end(server, tmp_path):
    """The agent's tier: fetch from peer RAM verifies; the level-2 flush carries the job's
    seals; a level-2 checkpoint rewritten by someone without the job's key (a file, its
    checksum and its size changed consistently: xxh3 is no MAC), and one sealed by another job
    that holds the same peer token (issue 24, items 2 and 4), are refused."""
    from cfrun.agent.peertier import fetch_verified
    from cfrun.peer.protocol import job_seal_key

    slot = tmp_path / "slot"
    payload = secrets.token_bytes(5000)
    slot.write_bytes(payload)
    tier = PeerTier(server.address, TOKEN, "j", streams=2, emit=lambda *a, **k: None,
                    job_key=JOB_KEY)
    try:
        assert tier.send_shard(step=7, world_size=1, rank=0, slot=slot, nbytes=len(payload),
                               doc=b'{"a": 1}', meta={"step": 7})
        _, manifest = tier.fetch(7, tmp_path / "staging")
        assert [s["rank"] for s in manifest["seals"]] == [0]
        assert (tmp_path / "staging" / "rank-00000.bin").read_bytes() == payload
        assert tier.await_state(7, "durable", 10)["state"] == "durable"
        store = server.storage
        flushed = store.read_manifest("j", 7)

        def install(manifest, key=JOB_KEY, files=None):
            files = files or {}
            return fetch_verified(
                tmp_path / f"st-{secrets.token_hex(4)}", manifest, 7, job="j",
                seal_key=job_seal_key(key, "j"),
                read=lambda name, n: files.get(name) or store.read_file("j", 7, name, n))

        assert len(install(flushed)) == 2  # the level-2 flush carries the job's seals
        evil = b"evil"
        forged = json.loads(json.dumps(flushed))
        forged["files"][0].update(xxh3_64=xxhash.xxh3_64_hexdigest(evil), nbytes=len(evil))
        with pytest.raises(CheckpointCorruptError, match="rank 0's job seal does not match"):
            install(forged, files={"rank-00000.bin": evil})
        with pytest.raises(CheckpointCorruptError, match="not sealed by this job"):
            install(flushed, key=b"2" * 64)  # a job dir with another key: not installed
        # another job's agent with the same peer token seals a step under this job's name
        other = PeerTier(server.address, TOKEN, "j", streams=1, emit=lambda *a, **k: None,
                         job_key=b"3" * 64)
        try:
            assert other.send_shard(step=9, world_size=1, rank=0, slot=slot,
                                    nbytes=len(payload), doc=b'{"a": 2}', meta={"step": 9})
            with pytest.raises(CheckpointCorruptError, match="job seal does not match"):
                tier.fetch(9, tmp_path / "staging9")
        finally:
            other.close()
    finally:
        tier.close()


def test_a_flood_of_bad_hellos_logs_one_line_per_reason_and_counts_the_rest(
        tmp_path, caplog, monkeypatch):
    """Issue 24, item 10: 2,000 rejected connections wrote 2,000 log lines. Now the first of
    each kind of reason in a summary period has a line, and the summary counts the others."""
    import logging

    from cfrun.peer import gate
    from cfrun.peer.protocol import CLIENT_HELLO_BYTES

    monkeypatch.setattr(gate, "SUMMARY_EVERY_S", 1.0)
    caplog.set_level(logging.WARNING, logger="cfrun.peer")
    srv = PeerServer(("127.0.0.1", 0), open_storage(str(tmp_path / "l2")), TOKEN, slots=2,
                     max_checkpoint_bytes=1 << 20)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        for _ in range(30):
            s = socket.create_connection(srv.address, timeout=5)
            s.recv(64)  # the server's hello
            s.sendall(b"X" * CLIENT_HELLO_BYTES)
            try:
                s.recv(64)
            except OSError:
                pass
            s.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _bad_hellos(caplog)[0] + sum(
                _bad_hellos(caplog)[1]) < 30:
            time.sleep(0.1)
    finally:
        srv.stop()
    single, summed = _bad_hellos(caplog)
    assert single + sum(summed) == 30, caplog.text
    assert single <= 3 and summed, caplog.text  # one per 1 s period, on a slow machine a few


def _bad_hellos(caplog) -> tuple[int, list[int]]:
    """(lines of their own for a bad hello, the counts of the summary lines)."""
    msgs = [r.getMessage() for r in caplog.records]
    single = sum("bad hello" in m for m in msgs)
    summed = [int(m.split("; ")[-1].split()[0]) for m in msgs if "for a reason logged above" in m]
    return single, summed


def test_a_level2_password_is_in_no_log_line_or_reply(tmp_path, caplog, monkeypatch):
    """Issue 32, finding 6: ``--flush-to file://alice:hunter2@...`` showed the password in the
    peer's start-up line, its flush lines and every LIST and AWAIT reply. The store keeps the
    URL whole for fsspec; what is shown is :attr:`shown` (password withheld)."""
    import logging

    caplog.set_level(logging.INFO)
    monkeypatch.chdir(tmp_path)  # fsspec's file:// takes "alice:hunter2@/..." as relative
    store = open_storage("file://alice:hunter2@/l2")
    assert store.shown == "file://alice:<withheld>@/l2"
    srv = PeerServer(("127.0.0.1", 0), store, TOKEN, slots=2, max_checkpoint_bytes=1 << 20)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        c = PeerClient(srv.address, TOKEN)
        assert _send(c, "j", 1, b"a" * 100)
        durable = c.await_state("j", 1, "durable", 10)
        listing = c.list("j")
    finally:
        srv.stop()
        t.join(10)
    assert durable["state"] == "durable" and durable["flush_to"] == store.shown
    assert listing["flush_to"] == store.shown
    assert "durable j step 1" in caplog.text and "listening on" in caplog.text
    assert "hunter2" not in caplog.text + json.dumps([durable, listing])
    with pytest.raises(BadInputError) as refused:
        open_storage("nosuchscheme://alice:hunter2@host/p")
    assert "hunter2" not in str(refused.value)


def test_peer_help_asks_for_the_token_length_read_token_needs(tmp_path) -> None:
    """Issue 32, finding 6: ``cfrun peer --help`` said 16 bytes where :func:`read_token`
    needs :data:`MIN_TOKEN_BYTES` (32); a token of 16 is refused in one line."""
    import re

    from typer.testing import CliRunner

    from cfrun.cli import app as A
    from cfrun.peer.protocol import MIN_TOKEN_BYTES

    result = CliRunner().invoke(A.app, ["peer", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    shown = " ".join(re.sub(r"[│|]", " ", result.output).split())
    assert MIN_TOKEN_BYTES == 32 and f">= {MIN_TOKEN_BYTES} bytes" in shown
    assert "16 bytes" not in shown
    short = tmp_path / "token"
    short.write_bytes(b"x" * 16)
    short.chmod(0o600)
    with pytest.raises(BadInputError, match="32") as refused:
        read_token(str(short))
    assert "\n" not in str(refused.value)
