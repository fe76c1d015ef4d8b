"""The remote-memory tier (ACUTE's level 1): ``cfrun peer`` server and its client protocol.

ACUTE (IEEE Access'24, §IV-A, §V) keeps checkpoints in the RAM of a reliable on-demand *peer*
node, because the local disk of a spot VM dies with it and network storage is slow. This module
is that peer and the protocol the persist agents use to reach it:

* **Level 1 in RAM, a circular buffer of ``slots`` checkpoints** (§V): each slot holds one step of
  one job, at most ``max_checkpoint_bytes``. Total RAM is bounded by ``slots x
  max_checkpoint_bytes``; a transfer that would exceed it is refused *before* anything is
  allocated. A new step takes a free slot, else the oldest slot already flushed (FIFO), else an
  abandoned partial one; when every slot holds unflushed data the sender waits for the flusher
  (ACUTE's dirty bits), up to a bound, then is refused and persists elsewhere.
* **Check-Trans** (§IV-B): every rank's shard is split into ``nparts`` byte ranges sent
  concurrently, each over its own TCP connection (a thread per connection here).
* **Check-Pack** (§IV-C): the peer never unpacks, parses or re-serializes the bytes it receives;
  each part is stored as received (``recv_into`` a buffer of exactly its size) and the flusher
  writes the parts, in order, as the checkpoint's files: the job dir's own format
  (``rank-NNNNN.bin``/``.json`` + ``manifest.json``), portable and readable by any cfrun.
* **Protected / durable**: a checkpoint is *protected* once every rank's shard is in peer RAM with
  its checksums verified (PGT ends here) and *durable* once the flusher wrote it to level 2
  (:mod:`cfrun.storage.tiers`: a directory or an fsspec URL), manifest last. Flushing is FIFO, one
  checkpoint at a time, in a thread apart from the receivers.

Security (DESIGN.md §9): the server binds only to the address given. Every connection starts
with a challenge-response handshake on a shared secret (HMAC-SHA256 over both sides' random
nonces, ``hmac.compare_digest``; the client checks the server's answer too). After it, frames are
a fixed 20-byte header (magic, version, op, JSON length <= 64 KiB, payload length bounded by the
slot size and the reservation) + a JSON header + raw payload bytes. Nothing is unpickled; JSON is
parsed from bounded bytes only. A malformed, oversized or unauthenticated frame is logged (one
line) and closes that connection; the server keeps serving. The token authenticates connections;
it does not encrypt or sign the stream (run the peer on a private network or through a tunnel).

Frames (client -> server; every request gets one response, op | 0x80)::

    PUT   {job, step, world_size, name, part, nparts, offset, file_bytes, xxh3_64}
          -> {ok, go}  then the client sends payload_len bytes -> {ok}
    SEAL  {job, step, world_size, rank, files: [{name, nbytes, xxh3_64, nparts}], meta}
          -> {ok, state, complete}
    AWAIT {job, step, state: protected|durable, timeout_s} -> {ok, state}
    LIST  {job} -> {ok, flush_to, checkpoints: [{step, world_size, state, bytes}]}
    GET   {job, step, name} -> {ok, nbytes} + payload (``manifest.json`` is built from the seals)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from cfrun.contract.errors import BadInputError
from cfrun.contract.manifest import FileEntry, Manifest
from cfrun.storage.tiers import FILE_RE, MANIFEST, Storage, check_job_name

logger = logging.getLogger("cfrun.peer.server")

PROTOCOL_VERSION = 1
NONCE_BYTES = 32
MAC_BYTES = 32
SERVER_HELLO = b"CFPH"
CLIENT_HELLO = b"CFPC"
AUTH_OK = b"CFPY"
AUTH_NO = b"CFPN"
FRAME_MAGIC = b"CFPF"
FRAME = struct.Struct("!4sBBHIQ")
"""magic, version, op, flags (0), JSON header bytes, payload bytes: 20 bytes."""
MAX_JSON_BYTES = 64 << 10
MAX_PARTS = 64
MAX_RANKS = 1 << 16
MAX_STEP = 10 ** 12
HANDSHAKE_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 900.0
IO_TIMEOUT_S = 60.0
MAX_AWAIT_S = 3600.0
MAX_RESERVE_WAIT_S = 60.0
MAX_CONNECTIONS = 256
STALE_PARTIAL_S = 60.0
"""A partial checkpoint with no transfer for this long may be evicted (its sender died)."""

ENV_TEST_FLUSH_SLOW_S = "CFRUN_TEST_PEER_FLUSH_SLOW_S"
"""Testing aid: the flusher sleeps this long after the first file of each checkpoint."""


class Op(enum.IntEnum):
    """Request codes; a response carries ``op | RESPONSE``."""

    PUT = 1
    SEAL = 2
    AWAIT = 3
    LIST = 4
    GET = 5


RESPONSE = 0x80


class PeerError(ConnectionError):
    """The peer is unreachable, refused a request, or broke the protocol."""


class PeerAuthError(PeerError):
    """The handshake failed: wrong token on one side."""


class ProtocolError(PeerError):
    """A malformed or oversized frame."""


# ---------------------------------------------------------------------- tokens and addresses


def parse_address(text: str, *, option: str = "--listen") -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[v6]:PORT`` for IPv6). Port 0 asks the OS for a free port.

    Raises:
        BadInputError: malformed, or a port outside 0..65535.
    """
    host, sep, port_s = text.strip().rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not sep or not host or not 0 <= port <= 65535:
        raise BadInputError(f"{option} {text!r} is not HOST:PORT; give e.g. {option} "
                            "10.0.0.5:7077")
    return host, port


def read_token(path: str, *, option: str = "--token-file") -> bytes:
    """Read the shared secret from ``path`` (surrounding whitespace stripped).

    Raises:
        BadInputError: missing, unreadable, readable by others, or shorter than 16 bytes.
    """
    p = Path(path).expanduser()
    try:
        st = p.stat()
        data = p.read_bytes().strip()
    except OSError as e:
        raise BadInputError(f"{option} {path!r} cannot be read ({e.strerror}); create it with "
                            f"`openssl rand -hex 32 > {path} && chmod 600 {path}`") from None
    if st.st_mode & 0o007:
        raise BadInputError(f"{option} {path!r} is accessible by other users; "
                            f"run `chmod 600 {path}`")
    if len(data) < 16:
        raise BadInputError(f"{option} {path!r} holds {'no' if not data else 'a too short'} "
                            f"token (16 bytes at least); create one with "
                            f"`openssl rand -hex 32 > {path}`")
    return data


def _mac(token: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, label + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        r = sock.recv_into(view[got:], min(len(view) - got, 4 << 20))
        if not r:
            raise PeerError("connection closed")
        got += r


def _send_frame(sock: socket.socket, op: int, header: dict[str, Any],
                payload_len: int = 0) -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    if len(data) > MAX_JSON_BYTES:
        raise ProtocolError(f"JSON header of {len(data)} bytes exceeds {MAX_JSON_BYTES}")
    sock.sendall(FRAME.pack(FRAME_MAGIC, PROTOCOL_VERSION, op, 0, len(data), payload_len) + data)


def _recv_frame_header(sock: socket.socket, max_payload: int) -> tuple[int, dict[str, Any], int]:
    """Read one frame's fixed header and JSON; the payload (if any) is left in the socket.

    Raises:
        ProtocolError: bad magic/version, a length over its bound, JSON that is not an object.
        PeerError: the connection closed.
    """
    magic, version, op, flags, json_len, payload_len = FRAME.unpack(
        _recv_exact(sock, FRAME.size))
    if magic != FRAME_MAGIC or version != PROTOCOL_VERSION or flags:
        raise ProtocolError(f"bad frame header (magic {magic!r}, version {version})")
    if json_len > MAX_JSON_BYTES:
        raise ProtocolError(f"JSON header of {json_len} bytes exceeds {MAX_JSON_BYTES}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload of {payload_len} bytes exceeds {max_payload}")
    raw = _recv_exact(sock, json_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("frame JSON header does not parse") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame JSON header is not an object")
    return op, header, payload_len


# ---------------------------------------------------------------------- server state


class SlotState(str, enum.Enum):
    """A checkpoint in peer RAM: FILLING -> PROTECTED -> FLUSHING -> DURABLE (evictable);
    FLUSHING -> PROTECTED again when a flush fails (retried); FILLING -> evicted if abandoned."""

    FILLING = "filling"
    PROTECTED = "protected"
    FLUSHING = "flushing"
    DURABLE = "durable"


_ORDER = {SlotState.FILLING: 0, SlotState.PROTECTED: 1, SlotState.FLUSHING: 1,
          SlotState.DURABLE: 2}


@dataclass
class _File:
    nbytes: int
    nparts: int
    parts: dict[int, tuple[int, bytearray]] = field(default_factory=dict)
    """part index -> (offset, bytes as received)."""

    def ordered(self) -> list[bytearray]:
        return [b for _, b in sorted(self.parts.values(), key=lambda ob: ob[0])]


@dataclass
class _Checkpoint:
    job: str
    step: int
    world_size: int
    state: SlotState = SlotState.FILLING
    files: dict[str, _File] = field(default_factory=dict)
    sealed: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    reserved_bytes: int = 0
    pins: int = 0
    t_first: float = field(default_factory=time.time)
    t_activity: float = field(default_factory=time.monotonic)
    t_protected: float | None = None
    flush_error: str | None = None

    def manifest(self) -> dict[str, Any]:
        """The manifest of the job dir's format, from the ranks' seals (checksums as sent)."""
        files = [f for r in sorted(self.sealed) for f in self.sealed[r]]
        return Manifest.build(self.step, self.world_size,
                              [FileEntry(f["name"], f["nbytes"], f["xxh3_64"]) for f in files],
                              self.meta, committed_unix_s=self.t_protected or time.time()
                              ).to_json()


class _Reject(Exception):
    """A request refused with a reply (the connection stays usable)."""


class PeerServer:
    """The ``cfrun peer`` process's server: receivers, circular buffer, FIFO flusher.

    Construct, then :meth:`serve` on the main thread; :meth:`stop` (from a signal handler) stops
    accepting, lets the flusher write what is protected (up to ``drain_s``) and returns.

    Args:
        listen: address to bind, exactly as given (port 0: any free port, see ``address``).
        storage: level 2 (:func:`cfrun.storage.tiers.open_storage`).
        token: the shared secret.
        slots: checkpoints held in RAM at most.
        max_checkpoint_bytes: bytes one checkpoint (all ranks) may hold.
        keep: flushed checkpoints kept per job at level 2 (older ones are deleted).
    """

    def __init__(self, listen: tuple[str, int], storage: Storage, token: bytes, *, slots: int,
                 max_checkpoint_bytes: int, keep: int = 3,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if slots < 1 or max_checkpoint_bytes < 1 or keep < 1:
            raise ValueError("slots, max_checkpoint_bytes and keep must be >= 1")
        self.storage = storage
        self.token = token
        self.slots = slots
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.keep = keep
        self.max_connections = max_connections
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.checkpoints: dict[tuple[str, int], _Checkpoint] = {}
        self.flush_queue: list[_Checkpoint] = []
        self.connections = 0
        self.stopping = threading.Event()
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.address = self.sock.getsockname()[:2]

    # ------------------------------------------------------------------ accounting

    def ram_bytes(self) -> int:
        """Bytes reserved for checkpoints in RAM now (<= slots x max_checkpoint_bytes)."""
        with self.lock:
            return sum(c.reserved_bytes for c in self.checkpoints.values())

    # ------------------------------------------------------------------ main loops

    def serve(self) -> None:
        """Accept connections until :meth:`stop`; then drain the flush queue and return."""
        self.storage.cleanup()
        flusher = threading.Thread(target=self._flusher, name="cfrun-peer-flush", daemon=True)
        flusher.start()
        logger.info("listening on %s:%d, flushing to %s, %d slots of %d bytes", *self.address,
                    self.storage.url, self.slots, self.max_checkpoint_bytes)
        while not self.stopping.is_set():
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            with self.lock:
                if self.connections >= self.max_connections:
                    conn.close()
                    logger.warning("refused %s: %d connections already", _fmt(addr),
                                   self.connections)
                    continue
                self.connections += 1
            threading.Thread(target=self._connection, args=(conn, addr), daemon=True).start()
        self.sock.close()
        with self.cond:
            self.cond.notify_all()
        flusher.join()

    def stop(self) -> None:
        """Stop accepting; :meth:`serve` returns once protected checkpoints are flushed."""
        self.stopping.set()

    def _connection(self, conn: socket.socket, addr: Any) -> None:
        who = _fmt(addr)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if not self._handshake(conn, who):
                return
            while not self.stopping.is_set():
                conn.settimeout(IDLE_TIMEOUT_S)
                op, header, payload_len = _recv_frame_header(conn, self.max_checkpoint_bytes)
                conn.settimeout(IO_TIMEOUT_S)
                if op != Op.PUT and payload_len:
                    raise ProtocolError(f"op {op} carries a payload")
                try:
                    self._dispatch(conn, op, header, payload_len)
                except _Reject as e:
                    _send_frame(conn, op | RESPONSE, {"ok": False, "error": str(e)})
        except ProtocolError as e:
            logger.warning("rejected %s: %s; connection closed", who, e)
        except (PeerError, OSError):
            pass  # the client went away
        except Exception as e:  # a bug must not take the peer down
            logger.exception("connection %s failed: %r", who, e)
        finally:
            conn.close()
            with self.lock:
                self.connections -= 1

    def _handshake(self, conn: socket.socket, who: str) -> bool:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        nonce = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(SERVER_HELLO + bytes([PROTOCOL_VERSION]) + nonce)
        try:
            msg = _recv_exact(conn, 5 + NONCE_BYTES + MAC_BYTES)
        except (PeerError, OSError):
            logger.warning("rejected %s: incomplete handshake; connection closed", who)
            return False
        if msg[:4] != CLIENT_HELLO or msg[4] != PROTOCOL_VERSION:
            logger.warning("rejected %s: not a cfrun peer client (bad hello); connection closed",
                           who)
            return False
        client_nonce, mac = msg[5:5 + NONCE_BYTES], msg[5 + NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(self.token, b"cfrun-peer/1 client", nonce,
                                             client_nonce)):
            logger.warning("rejected %s: authentication failed (wrong token); connection closed",
                           who)
            try:
                conn.sendall(AUTH_NO)
            except OSError:
                pass
            return False
        conn.sendall(AUTH_OK + _mac(self.token, b"cfrun-peer/1 server", client_nonce, nonce))
        return True

    # ------------------------------------------------------------------ requests

    def _dispatch(self, conn: socket.socket, op: int, h: dict[str, Any], payload_len: int) -> None:
        if op == Op.PUT:
            self._put(conn, h, payload_len)
        elif op == Op.SEAL:
            _send_frame(conn, op | RESPONSE, self._seal(h))
        elif op == Op.AWAIT:
            _send_frame(conn, op | RESPONSE, self._await(h))
        elif op == Op.LIST:
            _send_frame(conn, op | RESPONSE, self._list(h))
        elif op == Op.GET:
            self._get(conn, h)
        else:
            raise ProtocolError(f"unknown op {op}")

    @staticmethod
    def _ids(h: dict[str, Any]) -> tuple[str, int, int]:
        try:
            job = check_job_name(h["job"])
            step, world_size = h["step"], h["world_size"]
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"bad job/step/world_size ({e})") from None
        if not (_is_int(step) and 0 <= step <= MAX_STEP and _is_int(world_size)
                and 1 <= world_size <= MAX_RANKS):
            raise ProtocolError("step or world_size out of range")
        return job, step, world_size

    def _put(self, conn: socket.socket, h: dict[str, Any], payload_len: int) -> None:
        job, step, world_size = self._ids(h)
        name, part, nparts = h.get("name"), h.get("part"), h.get("nparts")
        offset, file_bytes, digest = h.get("offset"), h.get("file_bytes"), h.get("xxh3_64")
        if not (isinstance(name, str) and FILE_RE.match(name) and _is_int(part)
                and _is_int(nparts) and 0 <= part < nparts <= MAX_PARTS and _is_int(offset)
                and _is_int(file_bytes) and 0 <= offset and offset + payload_len <= file_bytes
                and file_bytes <= self.max_checkpoint_bytes and isinstance(digest, str)
                and int(name[5:10]) < world_size):
            raise ProtocolError("malformed PUT header")
        wait_s = min(float(h.get("wait_s", 10.0) or 0), MAX_RESERVE_WAIT_S)
        ck, skip = self._reserve(job, step, world_size, payload_len, wait_s)
        if skip:  # already complete (a retried transfer): nothing to send
            _send_frame(conn, Op.PUT | RESPONSE, {"ok": True, "go": False, "complete": True})
            return
        assert ck is not None
        owned = False  # True once the reservation is stored in, or returned to, the checkpoint
        try:
            _send_frame(conn, Op.PUT | RESPONSE, {"ok": True, "go": True})
            buf = bytearray(payload_len)  # within the reservation: bounded by the budget
            _recv_into(conn, memoryview(buf))
            ok = xxhash.xxh3_64_hexdigest(buf) == digest
            with self.lock:
                owned = True
                ck.t_activity = time.monotonic()
                f = ck.files.get(name)
                if (not ok or ck.state is not SlotState.FILLING
                        or self.checkpoints.get((job, step)) is not ck
                        or (f is not None and (f.nbytes != file_bytes or f.nparts != nparts))):
                    ok = False
                    self._release(ck, payload_len)
                else:
                    f = ck.files.setdefault(name, _File(file_bytes, nparts))
                    old = f.parts.get(part)
                    if old is not None:  # a resent part replaces the first copy
                        ck.reserved_bytes -= len(old[1])
                    f.parts[part] = (offset, buf)
                self.cond.notify_all()
            del buf
            _send_frame(conn, Op.PUT | RESPONSE, {"ok": ok, "error": None if ok else
                                                  "checksum mismatch or checkpoint gone"})
        finally:
            if not owned:  # the sender vanished mid-transfer: give the bytes back
                with self.lock:
                    self._release(ck, payload_len)
                    self.cond.notify_all()

    def _release(self, ck: _Checkpoint, nbytes: int) -> None:
        """Return a reservation (lock held); an empty partial checkpoint frees its slot."""
        ck.reserved_bytes -= nbytes
        if ck.state is SlotState.FILLING and not ck.files and ck.reserved_bytes <= 0 \
                and self.checkpoints.get((ck.job, ck.step)) is ck:
            del self.checkpoints[(ck.job, ck.step)]

    def _reserve(self, job: str, step: int, world_size: int, nbytes: int, wait_s: float
                 ) -> tuple[_Checkpoint | None, bool]:
        """Account ``nbytes`` to (job, step), taking a slot if needed; no allocation here."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while True:
                ck = self.checkpoints.get((job, step))
                if ck is not None:
                    if ck.world_size != world_size:
                        raise _Reject(f"step {step} was started with world_size "
                                      f"{ck.world_size}")
                    if ck.state is not SlotState.FILLING:
                        return ck, True
                    if ck.reserved_bytes + nbytes > self.max_checkpoint_bytes:
                        raise _Reject(f"checkpoint exceeds --max-checkpoint-bytes "
                                      f"{self.max_checkpoint_bytes}")
                    ck.reserved_bytes += nbytes
                    ck.t_activity = time.monotonic()
                    return ck, False
                if nbytes > self.max_checkpoint_bytes:
                    raise _Reject(f"checkpoint exceeds --max-checkpoint-bytes "
                                  f"{self.max_checkpoint_bytes}")
                if len(self.checkpoints) >= self.slots:
                    self._evict_one(job, step)
                if len(self.checkpoints) < self.slots:
                    ck = _Checkpoint(job, step, world_size, reserved_bytes=nbytes)
                    self.checkpoints[(job, step)] = ck
                    logger.info("receiving %s step %d (%d ranks)", job, step, world_size)
                    return ck, False
                left = deadline - time.monotonic()
                if left <= 0 or self.stopping.is_set():
                    raise _Reject(f"all {self.slots} slots hold unflushed checkpoints")
                self.cond.wait(min(left, 1.0))

    def _evict_one(self, job: str, step: int) -> None:
        """Free one slot: the oldest durable checkpoint, else an abandoned partial one."""
        now = time.monotonic()
        durable = [c for c in self.checkpoints.values()
                   if c.state is SlotState.DURABLE and not c.pins]
        if durable:
            victim = min(durable, key=lambda c: c.t_protected or 0.0)
        else:
            partial = [c for c in self.checkpoints.values()
                       if c.state is SlotState.FILLING and not c.pins
                       and ((c.job == job and c.step < step)
                            or now - c.t_activity > STALE_PARTIAL_S)]
            if not partial:
                return
            victim = min(partial, key=lambda c: c.t_activity)
            logger.info("dropped partial %s step %d (a sender died mid-transfer)", victim.job,
                        victim.step)
        del self.checkpoints[(victim.job, victim.step)]
        victim.files.clear()

    def _seal(self, h: dict[str, Any]) -> dict[str, Any]:
        job, step, world_size = self._ids(h)
        rank, files, meta = h.get("rank"), h.get("files"), h.get("meta", {})
        if not (_is_int(rank) and 0 <= rank < world_size and isinstance(files, list)
                and isinstance(meta, dict) and 1 <= len(files) <= 8):
            raise ProtocolError("malformed SEAL header")
        with self.cond:
            ck = self.checkpoints.get((job, step))
            if ck is None:
                raise _Reject(f"step {step} is not in peer RAM")
            if ck.state is not SlotState.FILLING:
                return {"ok": True, "state": ck.state.value, "complete": True}
            entries = []
            for fe in files:
                if not isinstance(fe, dict):
                    raise ProtocolError("malformed SEAL file entry")
                name, nbytes, digest = fe.get("name"), fe.get("nbytes"), fe.get("xxh3_64")
                if not (isinstance(name, str) and FILE_RE.match(name)
                        and int(name[5:10]) == rank and _is_int(nbytes)
                        and isinstance(digest, str) and len(digest) <= 32):
                    raise ProtocolError("malformed SEAL file entry")
                f = ck.files.get(name)
                if f is None or f.nbytes != nbytes or len(f.parts) != f.nparts \
                        or not _contiguous(f):
                    raise _Reject(f"{name} of step {step} is incomplete in peer RAM")
                entries.append({"name": name, "nbytes": nbytes, "xxh3_64": digest})
            ck.sealed[rank] = entries
            if rank == 0 or not ck.meta:
                ck.meta = meta
            ck.t_activity = time.monotonic()
            if len(ck.sealed) == ck.world_size:
                ck.state = SlotState.PROTECTED
                ck.t_protected = time.time()
                self.flush_queue.append(ck)
                for other in list(self.checkpoints.values()):  # older partial steps are dead
                    if other.job == job and other.step < step \
                            and other.state is SlotState.FILLING and not other.pins:
                        del self.checkpoints[(other.job, other.step)]
                logger.info("protected %s step %d: %d bytes from %d ranks in %.3f s", job, step,
                            ck.reserved_bytes, ck.world_size, ck.t_protected - ck.t_first)
            self.cond.notify_all()
            return {"ok": True, "state": ck.state.value,
                    "complete": ck.state is not SlotState.FILLING}

    def _await(self, h: dict[str, Any]) -> dict[str, Any]:
        try:
            job, step = check_job_name(h["job"]), h["step"]
            want = SlotState(h.get("state", "protected"))
            timeout_s = min(float(h.get("timeout_s", 60.0)), MAX_AWAIT_S)
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed AWAIT header ({e})") from None
        if not _is_int(step):
            raise ProtocolError("malformed AWAIT header")
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self.cond:
            while True:
                ck = self.checkpoints.get((job, step))
                if ck is None:
                    return {"ok": True, "state": "missing"}
                left = deadline - time.monotonic()
                if _ORDER[ck.state] >= _ORDER[want] or left <= 0 or self.stopping.is_set():
                    return {"ok": True, "state": ck.state.value, "error": ck.flush_error,
                            "flush_to": self.storage.url}
                self.cond.wait(min(left, 1.0))

    def _list(self, h: dict[str, Any]) -> dict[str, Any]:
        try:
            job = check_job_name(h["job"])
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed LIST header ({e})") from None
        with self.lock:
            cks = [{"step": c.step, "world_size": c.world_size, "state": c.state.value,
                    "bytes": c.reserved_bytes}
                   for c in self.checkpoints.values() if c.job == job]
        return {"ok": True, "flush_to": self.storage.url,
                "checkpoints": sorted(cks, key=lambda c: -c["step"])}

    def _get(self, conn: socket.socket, h: dict[str, Any]) -> None:
        try:
            job, step, name = check_job_name(h["job"]), h["step"], h["name"]
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed GET header ({e})") from None
        if not (_is_int(step) and isinstance(name, str)
                and (name == MANIFEST or FILE_RE.match(name))):
            raise ProtocolError("malformed GET header")
        with self.lock:
            ck = self.checkpoints.get((job, step))
            if ck is None or ck.state is SlotState.FILLING:
                raise _Reject(f"step {step} of {job} is not complete in peer RAM")
            if name == MANIFEST:
                parts: list[bytes | bytearray] = [json.dumps(ck.manifest()).encode()]
            elif name in ck.files:
                parts = list(ck.files[name].ordered())
            else:
                raise _Reject(f"{name} is not part of step {step}")
            ck.pins += 1
        try:
            nbytes = sum(len(p) for p in parts)
            _send_frame(conn, Op.GET | RESPONSE, {"ok": True, "nbytes": nbytes}, nbytes)
            for p in parts:
                conn.sendall(p)
        finally:
            with self.lock:
                ck.pins -= 1

    # ------------------------------------------------------------------ flusher

    def _flusher(self) -> None:
        """FIFO: write each protected checkpoint to level 2 (Check-Pack: parts as received)."""
        while True:
            with self.cond:
                while not self.flush_queue:
                    if self.stopping.is_set():
                        return
                    self.cond.wait(0.5)
                ck = self.flush_queue[0]
                ck.state = SlotState.FLUSHING
                ck.pins += 1
            try:
                self._flush(ck)
                with self.cond:
                    self.flush_queue.pop(0)
                    ck.state = SlotState.DURABLE
                    ck.flush_error = None
                    self.cond.notify_all()
            except Exception as e:
                logger.warning("flush of %s step %d failed (%r); retrying", ck.job, ck.step, e)
                with self.cond:
                    ck.state = SlotState.PROTECTED
                    ck.flush_error = repr(e)
                    self.cond.notify_all()
                if self.stopping.wait(2.0):
                    return
            finally:
                with self.lock:
                    ck.pins -= 1

    def _flush(self, ck: _Checkpoint) -> None:
        t0 = time.monotonic()
        manifest = ck.manifest()
        writer = self.storage.begin(ck.job, ck.step)
        slow_s = float(os.environ.get(ENV_TEST_FLUSH_SLOW_S, "0") or 0)
        try:
            for i, entry in enumerate(manifest["files"]):
                parts = ck.files[entry["name"]].ordered()
                h = xxhash.xxh3_64()
                for p in parts:
                    h.update(p)
                if h.hexdigest() != entry["xxh3_64"]:
                    raise RuntimeError(f"{entry['name']}: checksum differs from the sender's")
                writer.write_file(entry["name"], parts)
                if i == 0 and slow_s:
                    logger.info("flushing %s step %d (slowed by %s s)", ck.job, ck.step, slow_s)
                    time.sleep(slow_s)
            writer.commit(manifest)
        except BaseException:
            writer.abort()
            raise
        nbytes = sum(f["nbytes"] for f in manifest["files"])
        logger.info("durable %s step %d: %d bytes flushed to %s in %.3f s", ck.job, ck.step,
                    nbytes, self.storage.url, time.monotonic() - t0)
        for old in self.storage.list_steps(ck.job)[self.keep:]:
            self.storage.delete(ck.job, old)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _contiguous(f: _File) -> bool:
    pos = 0
    for off, buf in sorted(f.parts.values(), key=lambda ob: ob[0]):
        if off != pos:
            return False
        pos += len(buf)
    return pos == f.nbytes


def _fmt(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


# ---------------------------------------------------------------------- client


class PeerClient:
    """One authenticated connection to a peer. Not thread-safe: one per thread/stream.

    Used by the persist agent (send shards, await protected/durable, fetch for a resume).

    Raises (every method):
        PeerAuthError: the token does not match the peer's.
        PeerError: unreachable, closed, refused, or a protocol violation.
    """

    def __init__(self, address: tuple[str, int], token: bytes, *,
                 connect_timeout_s: float = 3.0, io_timeout_s: float = IO_TIMEOUT_S) -> None:
        self.address = address
        self.token = token
        self.io_timeout_s = io_timeout_s
        try:
            self.sock = socket.create_connection(address, timeout=connect_timeout_s)
        except OSError as e:
            raise PeerError(f"cannot connect to peer {_fmt(address)}: {e}") from None
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.settimeout(max(connect_timeout_s, HANDSHAKE_TIMEOUT_S))
            hello = _recv_exact(self.sock, 5 + NONCE_BYTES)
            if hello[:4] != SERVER_HELLO or hello[4] != PROTOCOL_VERSION:
                raise PeerError(f"{_fmt(address)} is not a cfrun peer (protocol "
                                f"{PROTOCOL_VERSION})")
            server_nonce = hello[5:]
            nonce = secrets.token_bytes(NONCE_BYTES)
            self.sock.sendall(CLIENT_HELLO + bytes([PROTOCOL_VERSION]) + nonce
                              + _mac(token, b"cfrun-peer/1 client", server_nonce, nonce))
            try:
                answer = _recv_exact(self.sock, 4 + MAC_BYTES)
            except PeerError:
                raise PeerAuthError(f"peer {_fmt(address)} refused the token") from None
            if answer[:4] != AUTH_OK or not hmac.compare_digest(
                    answer[4:], _mac(token, b"cfrun-peer/1 server", nonce, server_nonce)):
                raise PeerAuthError(f"peer {_fmt(address)} refused the token, or does not "
                                    "know it")
            self.sock.settimeout(io_timeout_s)
        except PeerError:
            self.sock.close()
            raise
        except OSError as e:
            self.sock.close()
            raise PeerError(f"peer {_fmt(address)}: {e}") from None

    def close(self) -> None:
        self.sock.close()

    def _request(self, op: Op, header: dict[str, Any], *, timeout_s: float | None = None
                 ) -> dict[str, Any]:
        try:
            self.sock.settimeout(timeout_s or self.io_timeout_s)
            _send_frame(self.sock, op, header)
            rop, reply, n = _recv_frame_header(self.sock, 0)
        except PeerError:
            raise
        except OSError as e:
            raise PeerError(f"peer {_fmt(self.address)}: {e}") from None
        if rop != op | RESPONSE:
            raise ProtocolError(f"unexpected response op {rop}")
        if not reply.get("ok"):
            raise PeerError(f"peer refused {op.name}: {reply.get('error')}")
        return reply

    def put(self, *, job: str, step: int, world_size: int, name: str, part: int, nparts: int,
            offset: int, file_bytes: int, data: memoryview | bytes, wait_s: float = 10.0) -> None:
        """Send one byte range of one file (the caller's buffer, not copied)."""
        header = {"job": job, "step": step, "world_size": world_size, "name": name,
                  "part": part, "nparts": nparts, "offset": offset, "file_bytes": file_bytes,
                  "xxh3_64": xxhash.xxh3_64_hexdigest(data), "wait_s": wait_s}
        try:
            self.sock.settimeout(max(self.io_timeout_s, wait_s + 5))
            _send_frame(self.sock, Op.PUT, header, len(data))
            rop, reply, _ = _recv_frame_header(self.sock, 0)
            if not reply.get("ok"):
                raise PeerError(f"peer refused PUT: {reply.get('error')}")
            if not reply.get("go"):
                return
            self.sock.settimeout(self.io_timeout_s)
            self.sock.sendall(data)
            rop, reply, _ = _recv_frame_header(self.sock, 0)
        except PeerError:
            raise
        except OSError as e:
            raise PeerError(f"peer {_fmt(self.address)}: {e}") from None
        if not reply.get("ok"):
            raise PeerError(f"peer refused PUT: {reply.get('error')}")

    def seal(self, *, job: str, step: int, world_size: int, rank: int,
             files: list[dict[str, Any]], meta: dict[str, Any]) -> bool:
        """Declare one rank's files complete. Returns True once the whole step is protected."""
        reply = self._request(Op.SEAL, {"job": job, "step": step, "world_size": world_size,
                                        "rank": rank, "files": files, "meta": meta})
        return bool(reply.get("complete"))

    def await_state(self, job: str, step: int, state: str, timeout_s: float) -> dict[str, Any]:
        """Block until the step reaches ``state`` (or times out).

        Returns:
            ``{state, flush_to, error}``: the step's state now (``missing`` if not in RAM).
        """
        return self._request(Op.AWAIT, {"job": job, "step": step, "state": state,
                                        "timeout_s": timeout_s}, timeout_s=timeout_s + 30)

    def list(self, job: str) -> dict[str, Any]:
        """``{flush_to, checkpoints: [{step, world_size, state, bytes}]}``, newest first."""
        return self._request(Op.LIST, {"job": job})

    def get(self, job: str, step: int, name: str, max_bytes: int) -> bytearray:
        """One file of a complete checkpoint in peer RAM (``manifest.json`` included)."""
        try:
            self.sock.settimeout(self.io_timeout_s)
            _send_frame(self.sock, Op.GET, {"job": job, "step": step, "name": name})
            rop, reply, n = _recv_frame_header(self.sock, max_bytes)
            if not reply.get("ok"):
                raise PeerError(f"peer refused GET: {reply.get('error')}")
            buf = bytearray(n)
            _recv_into(self.sock, memoryview(buf))
        except PeerError:
            raise
        except OSError as e:
            raise PeerError(f"peer {_fmt(self.address)}: {e}") from None
        return buf


def serve_main(listen: str, flush_to: str, token_file: str, *, slots: int,
               max_checkpoint_bytes: int, keep: int,
               on_ready: Callable[[tuple[str, int]], None] | None = None) -> int:
    """``cfrun peer``: validate, bind, serve until SIGTERM/SIGINT (then drain). Returns 0.

    Raises:
        BadInputError: bad address, token file or storage URL (exit 2).
        PeerBindError: the address cannot be bound (in use, not local) (exit 69).
    """
    import signal

    from cfrun.contract.errors import PeerBindError
    from cfrun.storage.tiers import open_storage

    host, port = parse_address(listen)
    token = read_token(token_file)
    storage = open_storage(flush_to)
    try:
        server = PeerServer((host, port), storage, token, slots=slots,
                            max_checkpoint_bytes=max_checkpoint_bytes, keep=keep)
    except OSError as e:
        raise PeerBindError(f"cannot listen on {listen!r}: {e.strerror or e}") from None
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    if on_ready is not None:
        on_ready(server.address)
    server.serve()
    logger.info("stopped")
    return 0
