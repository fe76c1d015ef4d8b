"""The remote-memory tier (ACUTE's level 1): the ``cfrun peer`` server.

ACUTE (IEEE Access'24, §IV-A, §V) keeps checkpoints in the RAM of a reliable on-demand *peer*
node, because the local disk of a spot VM dies with it and network storage is slow. The peer is
three parts, each in its own module:

* **The server** (this module): binds, runs the admission gate (:mod:`cfrun.peer.gate`), gives
  each authenticated connection a thread of its own and turns each request (PUT, SEAL, AWAIT,
  LIST, GET) into a call on the RAM buffer. **Check-Trans** (§IV-B): every rank's shard arrives
  as ``nparts`` byte ranges over as many connections at once. **Check-Pack** (§IV-C): the peer
  never unpacks, parses or re-serializes the bytes it receives; each part is received
  (``recv_into``) into a buffer of exactly its size, reserved before it is allocated.
* **The RAM buffer** (:mod:`cfrun.peer.buffer`): ``slots`` checkpoints of at most
  ``max_checkpoint_bytes`` each, ACUTE's circular buffer with dirty bits.
* **The flusher** (:mod:`cfrun.peer.flusher`): one thread writing protected checkpoints to level
  2 (:mod:`cfrun.storage.tiers`), job by job in turn (oldest first within a job; a job whose
  flush fails waits, with backoff, behind the others), then applying level-2 retention.
* **Tenants** (:mod:`cfrun.peer.tenants`, issue 32): one token per tenant; each connection
  belongs to the tenant whose token it proved, and every job it names is that tenant's: a ring
  of slots of its own (:class:`TenantRoom`) and a level-2 directory of its own. A tenant can
  neither list, read, write, seal, await nor evict another tenant's checkpoints.

A checkpoint is *protected* once every rank's shard is in peer RAM with its checksums verified
(PGT ends here) and *durable* once the flusher wrote it to level 2 (manifest last).

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

import hmac
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from cfrun.peer.buffer import (  # noqa: F401  (STALE_PARTIAL_S: re-exported)
    STALE_PARTIAL_S,
    RamBuffer,
    Refused,
    SlotState,
)
from cfrun.peer.flusher import Flusher, Lane
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
from cfrun.peer.tenants import DEFAULT_TENANT, Tenant, read_tenants, slot_shares
from cfrun.storage.tiers import FILE_RE, MANIFEST, Storage, below, check_job_name

logger = logging.getLogger("cfrun.peer.server")


@dataclass
class TenantRoom:
    """One tenant's part of the peer: its ring of RAM slots (keyed by
    :meth:`~cfrun.peer.tenants.Tenant.key`), its level 2 (``--flush-to`` itself for the default
    tenant, ``<flush>/_tenants/<name>`` for the others) and the keys that check its agents'
    seals (:func:`~cfrun.peer.protocol.manifest_key` of its token and the job's name)."""

    tenant: Tenant
    buffer: RamBuffer
    storage: Storage
    manifest_keys: dict[str, bytes] = field(default_factory=dict)


class PeerServer:
    """The ``cfrun peer`` process's server: the accept loop, the admission gate, one thread per
    authenticated connection, and the dispatch of its requests to the RAM buffer
    (:class:`~cfrun.peer.buffer.RamBuffer`); the flush thread is a
    :class:`~cfrun.peer.flusher.Flusher`.

    Construct, then :meth:`serve` on the main thread; :meth:`stop` (from a signal handler) stops
    accepting, lets the flusher write what is protected and returns.

    **Slots and tenants**: the ``slots`` are shared out as fixed per-tenant rings
    (:func:`~cfrun.peer.tenants.slot_shares`: ``slots // tenants`` each, the remainder to the
    first tenants by name), so one tenant filling its slots can neither take nor evict
    another's; the RAM bound stays ``slots x max_checkpoint_bytes``.

    Args:
        listen: address to bind, exactly as given (port 0: any free port, see ``address``).
        storage: level 2 (:func:`cfrun.storage.tiers.open_storage`), ``--flush-to``.
        token: the shared secret of the one default tenant, or the tenants
            (:func:`~cfrun.peer.tenants.read_tenants`).
        slots: checkpoints held in RAM at most, all tenants together.
        max_checkpoint_bytes: bytes one checkpoint (all ranks) may hold.
        keep: flushed checkpoints kept per job at level 2 (older ones are deleted).

    Raises:
        BadInputError: fewer slots than tenants.
        OSError: the address cannot be bound.
    """

    def __init__(self, listen: tuple[str, int], storage: Storage, token: bytes | list[Tenant],
                 *, slots: int, max_checkpoint_bytes: int, keep: int = 3,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if slots < 1 or max_checkpoint_bytes < 1 or keep < 1:
            raise ValueError("slots, max_checkpoint_bytes and keep must be >= 1")
        self.storage = storage
        self.tenants = [Tenant(DEFAULT_TENANT, token)] if isinstance(token, bytes) \
            else list(token)
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.max_connections = max_connections
        self.stopping = threading.Event()
        shares = slot_shares(slots, [t.name for t in self.tenants])
        self.rooms = {t.name: TenantRoom(t, RamBuffer(shares[t.name], max_checkpoint_bytes,
                                                      self.stopping),
                                         below(storage, *t.level2_below) if t.level2_below
                                         else storage)
                      for t in self.tenants}
        self.flusher = Flusher([Lane(name, room.buffer, room.storage)
                                for name, room in self.rooms.items()], keep, self.stopping)
        self.lock = threading.Lock()
        self.connections = 0
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen(1024)  # a flood of SYNs must not overflow the backlog
        self.address = self.sock.getsockname()[:2]

    def _manifest_key(self, room: TenantRoom, job: str) -> bytes:
        with self.lock:
            key = room.manifest_keys.get(job)
            if key is None:
                key = room.manifest_keys[job] = manifest_key(room.tenant.token, job)
            return key

    def ram_bytes(self) -> int:
        """Bytes the RAM rings hold now, all tenants (:meth:`RamBuffer.ram_bytes`)."""
        return sum(room.buffer.ram_bytes() for room in self.rooms.values())

    # ------------------------------------------------------------------ main loops

    def serve(self) -> None:
        """Accept connections until :meth:`stop`; then drain the flush queue and return."""
        for room in self.rooms.values():
            try:
                room.storage.cleanup()
            except OSError as e:  # a link at <flush>/_tenants: that tenant's flushes say so
                logger.warning("level 2 of tenant %s not cleaned up: %s", room.tenant.name, e)
        self.flusher.start()
        rings = "" if list(self.rooms) == [DEFAULT_TENANT] else ", tenants " + ", ".join(
            f"{name} ({room.buffer.slots})" for name, room in self.rooms.items())
        logger.info("listening on %s:%d, flushing to %s, %d slots of %d bytes%s", *self.address,
                    self.storage.shown, sum(r.buffer.slots for r in self.rooms.values()),
                    self.max_checkpoint_bytes, rings)
        gate = Gate(self.sock, self.tenants, self._admit)
        try:
            while not self.stopping.is_set():
                gate.step(0.2)
        finally:
            gate.close()
            self.sock.close()
        for room in self.rooms.values():
            room.buffer.wake()
        self.flusher.join()

    def stop(self) -> None:
        """Stop accepting; :meth:`serve` returns once protected checkpoints are flushed."""
        self.stopping.set()
        self.flusher.notify()

    def _admit(self, ch: Channel, who: str, greeting: bytes, tenant: Tenant) -> bool:
        """An authenticated connection of ``tenant`` (from the gate): a thread of its own, if
        under the cap."""
        with self.lock:
            if self.connections >= self.max_connections:
                logger.warning("refused %s: %d connections already", who, self.connections)
                return False
            self.connections += 1
        threading.Thread(target=self._connection, args=(ch, who, greeting,
                                                         self.rooms[tenant.name]),
                         daemon=True).start()
        return True

    def _connection(self, ch: Channel, who: str, greeting: bytes, room: TenantRoom) -> None:
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
                    self._dispatch(ch, room, op, header, payload_len)
                except Refused as e:
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

    def _dispatch(self, ch: Channel, room: TenantRoom, op: int, h: dict[str, Any],
                  payload_len: int) -> None:
        """One request of a connection of ``room``'s tenant: every job it names is that
        tenant's (:meth:`~cfrun.peer.tenants.Tenant.key`)."""
        if op == Op.PUT:
            self._put(ch, room, h, payload_len)
        elif op == Op.SEAL:
            ch.send_header(op | RESPONSE, self._seal(room, h))
        elif op == Op.AWAIT:
            ch.send_header(op | RESPONSE, self._await(room, h))
        elif op == Op.LIST:
            ch.send_header(op | RESPONSE, self._list(room, h))
        elif op == Op.GET:
            self._get(ch, room, h)
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

    def _put(self, ch: Channel, room: TenantRoom, h: dict[str, Any], payload_len: int) -> None:
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
        buffer = room.buffer
        ck = buffer.reserve(room.tenant.key(job), step, world_size, payload_len, wait_s)
        if ck is None:  # already complete (a retried transfer): nothing to send
            ch.drop_payload()
            ch.send_header(Op.PUT | RESPONSE, {"ok": True, "go": False, "complete": True})
            return
        owned = False  # True once the reservation is stored in, or returned to, the buffer
        try:
            ch.send_header(Op.PUT | RESPONSE, {"ok": True, "go": True})
            buf = bytearray(payload_len)  # within the reservation: bounded by the budget
            ch.recv_payload_into(memoryview(buf))  # its tag checked before anything is kept
            owned = True
            ok = buffer.receive(ck, name, part=part, nparts=nparts, offset=offset,
                                file_bytes=file_bytes, buf=buf,
                                checksum_ok=xxhash.xxh3_64_hexdigest(buf) == digest)
            del buf
            ch.send_header(Op.PUT | RESPONSE, {"ok": ok, "error": None if ok else
                                               "checksum mismatch or checkpoint gone"})
        finally:
            if not owned:  # the sender vanished mid-transfer: give the bytes back
                buffer.abandon(ck, payload_len)

    def _seal(self, room: TenantRoom, h: dict[str, Any]) -> dict[str, Any]:
        job, step, world_size = self._ids(h)
        rank, files, meta, tag = h.get("rank"), h.get("files"), h.get("meta", {}), h.get("tag")
        job_tag, sha256 = h.get("job_tag"), h.get("sha256")
        if not (is_int(rank) and 0 <= rank < world_size and isinstance(files, list)
                and isinstance(meta, dict) and 1 <= len(files) <= MAX_SEAL_FILES
                and check_tag(tag) and (job_tag is None or check_tag(job_tag))
                and (sha256 is None or (isinstance(sha256, list) and len(sha256) == len(files)
                                        and all(check_tag(d) for d in sha256)))):
            raise ProtocolError("malformed SEAL header")
        entries = []
        for fe in files:
            if not isinstance(fe, dict):
                raise ProtocolError("malformed SEAL file entry")
            name, nbytes, digest = fe.get("name"), fe.get("nbytes"), fe.get("xxh3_64")
            if not (isinstance(name, str) and FILE_RE.match(name)
                    and int(name[5:10]) == rank and is_int(nbytes)
                    and isinstance(digest, str) and len(digest) <= 32):
                raise ProtocolError("malformed SEAL file entry")
            entries.append({"name": name, "nbytes": nbytes, "xxh3_64": digest})
        want = seal_tag(self._manifest_key(room, job), step=step, world_size=world_size,
                        rank=rank, files=entries, meta=meta)
        state = room.buffer.seal(room.tenant.key(job), step, rank, entries, meta, tag,
                                 tag_ok=hmac.compare_digest(tag, want), job_tag=job_tag,
                                 sha256=sha256)
        if state is SlotState.PROTECTED:
            self.flusher.notify()
        return {"ok": True, "state": state.value, "complete": state is not SlotState.FILLING}

    def _await(self, room: TenantRoom, h: dict[str, Any]) -> dict[str, Any]:
        try:
            job, step = check_job_name(h["job"]), h["step"]
            want = SlotState(h.get("state", "protected"))
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed AWAIT header ({e})") from None
        if not is_int(step):
            raise ProtocolError("malformed AWAIT header")
        timeout_s = number(h, "timeout_s", 0.0, MAX_AWAIT_S, 60.0)
        state, error = room.buffer.await_state(room.tenant.key(job), step, want, timeout_s)
        if state == "missing":
            return {"ok": True, "state": state}
        return {"ok": True, "state": state, "error": error, "flush_to": room.storage.shown}

    def _list(self, room: TenantRoom, h: dict[str, Any]) -> dict[str, Any]:
        try:
            job = check_job_name(h["job"])
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed LIST header ({e})") from None
        return {"ok": True, "flush_to": room.storage.shown,
                "checkpoints": room.buffer.listing(room.tenant.key(job))}

    def _get(self, ch: Channel, room: TenantRoom, h: dict[str, Any]) -> None:
        try:
            job, step, name = check_job_name(h["job"]), h["step"], h["name"]
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed GET header ({e})") from None
        max_bytes = h.get("max_bytes")
        if not (is_int(step) and check_get_name(name) and is_int(max_bytes)
                and 0 <= max_bytes <= MAX_FETCH_BYTES):
            raise ProtocolError("malformed GET header (job, step, name, max_bytes)")
        ck = room.buffer.pin(room.tenant.key(job), step)  # complete: its files no longer change
        try:
            if name == MANIFEST:
                parts: list[bytes | bytearray] = [dumps_json(ck.manifest())]
            elif name in ck.files:
                parts = list(ck.files[name].ordered())
            else:
                raise Refused(f"{name} is not part of step {step}")
            nbytes = sum(len(p) for p in parts)
            if nbytes > max_bytes:
                raise Refused(f"{name} of step {step} is {nbytes} bytes, more than the "
                              f"{max_bytes} asked for")
            ch.send_header(Op.GET | RESPONSE, {"ok": True, "nbytes": nbytes}, nbytes)
            if nbytes:
                ch.send_payload(parts)
        finally:
            room.buffer.unpin(ck)


def serve_main(listen: str, flush_to: str, token_file: str, *, slots: int,
               max_checkpoint_bytes: int, keep: int,
               on_ready: Callable[[tuple[str, int]], None] | None = None) -> int:
    """``cfrun peer``: validate, bind, serve until SIGTERM/SIGINT (then drain). Returns 0.

    ``token_file``: a token file (one tenant), or a directory of them, one per tenant
    (:func:`cfrun.peer.tenants.read_tenants`).

    Raises:
        BadInputError: bad address, token file or directory, storage URL, or fewer
            ``slots`` than tenants (exit 2).
        PeerBindError: the address cannot be bound (in use, not local) (exit 69).
    """
    import signal

    from cfrun.contract.errors import PeerBindError
    from cfrun.storage.tiers import open_storage

    host, port = parse_address(listen)
    tenants = read_tenants(token_file)
    slot_shares(slots, [t.name for t in tenants])  # refused before anything is bound
    storage = open_storage(flush_to)
    try:
        server = PeerServer((host, port), storage, tenants, slots=slots,
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
