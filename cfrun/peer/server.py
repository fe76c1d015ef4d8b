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

Security (DESIGN.md §9): the server binds only to the address given; admission (handshake,
deadline, caps on unauthenticated connections) is :mod:`cfrun.peer.gate`, the wire protocol
(session keys, a MAC on every frame, bounded and finite JSON) is :mod:`cfrun.peer.protocol`.
Nothing is unpickled. A malformed, oversized, out-of-range or unauthenticated frame is logged
(one line) and closes that connection; the server keeps serving. The stream is authenticated,
not encrypted (run the peer on a private network or through a tunnel for secrecy). Each rank's
seal carries its agent's tag over its files (:func:`cfrun.peer.protocol.seal_tag`); the peer
checks it and keeps the tags in the manifest it serves and flushes, so an agent verifies a
checkpoint it fetches back end to end.
"""

from __future__ import annotations

import collections
import enum
import hmac
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from cfrun.contract.manifest import FileEntry, Manifest
from cfrun.peer.gate import Gate
from cfrun.peer.protocol import (  # noqa: F401  (re-exported: older imports of the server)
    IDLE_TIMEOUT_S,
    IO_TIMEOUT_S,
    MAX_AWAIT_S,
    MAX_CONNECTIONS,
    MAX_FETCH_BYTES,
    MAX_PARTS,
    MAX_RANKS,
    MAX_RESERVE_WAIT_S,
    MAX_SEAL_FILES,
    MAX_STEP,
    RESPONSE,
    Channel,
    Op,
    PeerAuthError,
    PeerClient,
    PeerError,
    ProtocolError,
    check_get_name,
    check_tag,
    dumps_json,
    is_int,
    manifest_key,
    number,
    parse_address,
    read_token,
    seal_tag,
)
from cfrun.storage.tiers import FILE_RE, MANIFEST, Storage, check_job_name

logger = logging.getLogger("cfrun.peer.server")

STALE_PARTIAL_S = 60.0
"""A partial checkpoint with no transfer for this long may be evicted (its sender died)."""
MAX_EVICTED_REMEMBERED = 4096
"""Flushed-then-evicted checkpoints remembered so that a late AWAIT still hears ``durable``
(a few dozen bytes each)."""



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
    seal_tags: dict[int, str] = field(default_factory=dict)
    """rank -> its agent's tag over its files (:func:`cfrun.peer.protocol.seal_tag`)."""
    meta: dict[str, Any] = field(default_factory=dict)
    reserved_bytes: int = 0
    pins: int = 0
    t_first: float = field(default_factory=time.time)
    t_activity: float = field(default_factory=time.monotonic)
    t_protected: float | None = None
    flush_error: str | None = None

    def manifest(self) -> dict[str, Any]:
        """The manifest of the job dir's format, from the ranks' seals (checksums as sent),
        with the agents' seal tags (``seals``) that let a fetching agent verify it."""
        files = [f for r in sorted(self.sealed) for f in self.sealed[r]]
        return Manifest.build(self.step, self.world_size,
                              [FileEntry(f["name"], f["nbytes"], f["xxh3_64"]) for f in files],
                              self.meta, committed_unix_s=self.t_protected or time.time(),
                              seals=[{"rank": r, "tag": self.seal_tags[r]}
                                     for r in sorted(self.seal_tags)]).to_json()


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
        self.evicted_durable: collections.OrderedDict[tuple[str, int], None] = \
            collections.OrderedDict()
        """Checkpoints evicted from RAM after their flush (newest last, at most
        :data:`MAX_EVICTED_REMEMBERED`): an AWAIT that comes late still hears ``durable``."""
        self.connections = 0
        self._manifest_keys: dict[str, bytes] = {}
        self.stopping = threading.Event()
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(1024)  # a flood of SYNs must not overflow the backlog
        self.address = self.sock.getsockname()[:2]

    # ------------------------------------------------------------------ accounting

    def _manifest_key(self, job: str) -> bytes:
        key = self._manifest_keys.get(job)
        if key is None:
            key = self._manifest_keys[job] = manifest_key(self.token, job)
        return key

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
        gate = Gate(self.sock, self.token, self._admit)
        try:
            while not self.stopping.is_set():
                gate.step(0.2)
        finally:
            gate.close()
            self.sock.close()
        with self.cond:
            self.cond.notify_all()
        flusher.join()

    def stop(self) -> None:
        """Stop accepting; :meth:`serve` returns once protected checkpoints are flushed."""
        self.stopping.set()

    def _admit(self, ch: Channel, who: str, greeting: bytes) -> bool:
        """An authenticated connection (from the gate): a thread of its own, if under the cap."""
        with self.lock:
            if self.connections >= self.max_connections:
                logger.warning("refused %s: %d connections already", who, self.connections)
                return False
            self.connections += 1
        threading.Thread(target=self._connection, args=(ch, who, greeting), daemon=True).start()
        return True

    def _connection(self, ch: Channel, who: str, greeting: bytes) -> None:
        conn = ch.sock
        try:
            conn.sendall(greeting)
            while not self.stopping.is_set():
                conn.settimeout(IDLE_TIMEOUT_S)
                op, header, payload_len = ch.recv_header(self.max_checkpoint_bytes)
                conn.settimeout(IO_TIMEOUT_S)
                if op != Op.PUT and payload_len:
                    raise ProtocolError(f"op {op} carries a payload")
                try:
                    self._dispatch(ch, op, header, payload_len)
                except _Reject as e:
                    ch.drop_payload()  # a refused PUT's payload is never sent
                    ch.send_header(op | RESPONSE, {"ok": False, "error": str(e)})
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

    # ------------------------------------------------------------------ requests

    def _dispatch(self, ch: Channel, op: int, h: dict[str, Any], payload_len: int) -> None:
        if op == Op.PUT:
            self._put(ch, h, payload_len)
        elif op == Op.SEAL:
            ch.send_header(op | RESPONSE, self._seal(h))
        elif op == Op.AWAIT:
            ch.send_header(op | RESPONSE, self._await(h))
        elif op == Op.LIST:
            ch.send_header(op | RESPONSE, self._list(h))
        elif op == Op.GET:
            self._get(ch, h)
        else:
            raise ProtocolError(f"unknown op {op}")

    @staticmethod
    def _ids(h: dict[str, Any]) -> tuple[str, int, int]:
        try:
            job = check_job_name(h["job"])
            step, world_size = h["step"], h["world_size"]
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"bad job/step/world_size ({e})") from None
        if not (is_int(step) and 0 <= step <= MAX_STEP and is_int(world_size)
                and 1 <= world_size <= MAX_RANKS):
            raise ProtocolError("step or world_size out of range")
        return job, step, world_size

    def _put(self, ch: Channel, h: dict[str, Any], payload_len: int) -> None:
        job, step, world_size = self._ids(h)
        name, part, nparts = h.get("name"), h.get("part"), h.get("nparts")
        offset, file_bytes, digest = h.get("offset"), h.get("file_bytes"), h.get("xxh3_64")
        if not (isinstance(name, str) and FILE_RE.match(name) and is_int(part)
                and is_int(nparts) and 0 <= part < nparts <= MAX_PARTS and is_int(offset)
                and is_int(file_bytes) and 0 <= offset and offset + payload_len <= file_bytes
                and file_bytes <= self.max_checkpoint_bytes and isinstance(digest, str)
                and int(name[5:10]) < world_size):
            raise ProtocolError("malformed PUT header")
        wait_s = number(h, "wait_s", 0.0, MAX_RESERVE_WAIT_S, 10.0)
        ck, skip = self._reserve(job, step, world_size, payload_len, wait_s)
        if skip:  # already complete (a retried transfer): nothing to send
            ch.drop_payload()
            ch.send_header(Op.PUT | RESPONSE, {"ok": True, "go": False, "complete": True})
            return
        assert ck is not None
        owned = False  # True once the reservation is stored in, or returned to, the checkpoint
        try:
            ch.send_header(Op.PUT | RESPONSE, {"ok": True, "go": True})
            buf = bytearray(payload_len)  # within the reservation: bounded by the budget
            ch.recv_payload_into(memoryview(buf))  # its tag checked before anything is kept
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
            ch.send_header(Op.PUT | RESPONSE, {"ok": ok, "error": None if ok else
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
        if victim.state is SlotState.DURABLE:
            self.evicted_durable[(victim.job, victim.step)] = None
            while len(self.evicted_durable) > MAX_EVICTED_REMEMBERED:
                self.evicted_durable.popitem(last=False)

    def _seal(self, h: dict[str, Any]) -> dict[str, Any]:
        job, step, world_size = self._ids(h)
        rank, files, meta, tag = h.get("rank"), h.get("files"), h.get("meta", {}), h.get("tag")
        if not (is_int(rank) and 0 <= rank < world_size and isinstance(files, list)
                and isinstance(meta, dict) and 1 <= len(files) <= MAX_SEAL_FILES
                and check_tag(tag)):
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
                        and int(name[5:10]) == rank and is_int(nbytes)
                        and isinstance(digest, str) and len(digest) <= 32):
                    raise ProtocolError("malformed SEAL file entry")
                f = ck.files.get(name)
                if f is None or f.nbytes != nbytes or len(f.parts) != f.nparts \
                        or not _contiguous(f):
                    raise _Reject(f"{name} of step {step} is incomplete in peer RAM")
                entries.append({"name": name, "nbytes": nbytes, "xxh3_64": digest})
            want = seal_tag(self._manifest_key(job), step=step, world_size=world_size,
                            rank=rank, files=entries, meta=meta)
            if not hmac.compare_digest(tag, want):
                raise _Reject(f"the seal of rank {rank} of step {step} does not match its files "
                              "(an agent of another job or token?)")
            ck.sealed[rank] = entries
            ck.seal_tags[rank] = tag
            if rank == 0:
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
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed AWAIT header ({e})") from None
        if not is_int(step):
            raise ProtocolError("malformed AWAIT header")
        timeout_s = number(h, "timeout_s", 0.0, MAX_AWAIT_S, 60.0)
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                ck = self.checkpoints.get((job, step))
                if ck is None and (job, step) in self.evicted_durable:  # flushed, then evicted
                    return {"ok": True, "state": SlotState.DURABLE.value, "error": None,
                            "flush_to": self.storage.url}
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

    def _get(self, ch: Channel, h: dict[str, Any]) -> None:
        try:
            job, step, name = check_job_name(h["job"]), h["step"], h["name"]
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed GET header ({e})") from None
        max_bytes = h.get("max_bytes")
        if not (is_int(step) and check_get_name(name) and is_int(max_bytes)
                and 0 <= max_bytes <= MAX_FETCH_BYTES):
            raise ProtocolError("malformed GET header (job, step, name, max_bytes)")
        with self.lock:
            ck = self.checkpoints.get((job, step))
            if ck is None or ck.state is SlotState.FILLING:
                raise _Reject(f"step {step} of {job} is not complete in peer RAM")
            if name == MANIFEST:
                parts: list[bytes | bytearray] = [dumps_json(ck.manifest())]
            elif name in ck.files:
                parts = list(ck.files[name].ordered())
            else:
                raise _Reject(f"{name} is not part of step {step}")
            nbytes = sum(len(p) for p in parts)
            if nbytes > max_bytes:
                raise _Reject(f"{name} of step {step} is {nbytes} bytes, more than the "
                              f"{max_bytes} asked for")
            ck.pins += 1
        try:
            ch.send_header(Op.GET | RESPONSE, {"ok": True, "nbytes": nbytes}, nbytes)
            if nbytes:
                ch.send_payload(parts)
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
        from cfrun.contract import faults

        slow_s = float(faults.value("peer.flush_delay_s") or 0)
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


def _contiguous(f: _File) -> bool:
    pos = 0
    for off, buf in sorted(f.parts.values(), key=lambda ob: ob[0]):
        if off != pos:
            return False
        pos += len(buf)
    return pos == f.nbytes


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
