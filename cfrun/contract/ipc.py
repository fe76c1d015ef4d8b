"""Messages between ranks and the node's persist agent: length-prefixed JSON on a Unix socket.

The socket lives in the abstract namespace (Linux), so no file is left behind and path-length
limits do not apply. Its name is random (:func:`new_agent_address`, chosen by the supervisor
each time it starts an agent), so no other user can bind it first; the agent records it with
its pid in ``agent.json`` (0600) in the job dir, which only the job's user can read
(:func:`write_agent_record`, :func:`read_agent_record`). Both ends check the other's peer
credentials (``SO_PEERCRED``): the agent serves only processes of its own uid, and
:func:`connect` refuses an agent of another uid (or, for the supervisor, another pid than the one
it started), saying so in one line. Abstract names are visible in ``/proc/net/unix``, so the
credential check, not the name, is what keeps other users out.

Frames are bounded (``MAX_FRAME_BYTES``); nothing received is unpickled. Tensor bytes never
travel here: they stay in the shared-memory snapshot slot, which the agent reads directly
(ACUTE's Check-Pack: no unpack, no re-serialization).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfrun.contract.wire import recv_exact

MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct("!I")
AGENT_RECORD_MAX_BYTES = 4096
"""``agent.json`` is a few dozen bytes; a larger one is not ours."""
ADDRESS_PREFIX = "cfrun-agent-"

_refusals_said: set[tuple[str, int]] = set()


class ProtocolError(ConnectionError):
    """A frame was malformed or larger than ``MAX_FRAME_BYTES``."""


class RefusedPeer(PermissionError):
    """The process at the other end of the socket is not the one this end may talk to."""


@dataclass(frozen=True)
class AgentRecord:
    """What ``agent.json`` holds: the agent's pid, its abstract socket name (without the
    leading NUL) and the job's private slot directory (None: only ``<job_dir>/.slots``)."""

    pid: int
    address: str
    slot_dir: str | None = None


def new_agent_address() -> str:
    """A fresh abstract socket name for an agent: 128 random bits, so nobody can bind it first
    (the supervisor calls this for every agent it starts, restarts included)."""
    return f"{ADDRESS_PREFIX}{secrets.token_hex(16)}"


def agent_record_path(job_dir: Path | str) -> Path:
    """``<job_dir>/agent.json`` (``agent-node<R>.json`` on node R > 0 of a shared job dir)."""
    from cfrun.contract.jobdir import JobDir

    return JobDir(job_dir).agent_path


def write_agent_record(job_dir: Path | str, record: AgentRecord) -> None:
    """Publish ``record`` atomically as ``agent.json``, mode 0600 (the agent, once it listens).

    The temporary file is created exclusively without following links, then renamed over the
    old record (a rename replaces a link, never writes through it)."""
    path = agent_record_path(job_dir)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    data = json.dumps({"pid": record.pid, "address": record.address,
                       "slot_dir": record.slot_dir}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def remove_agent_record(job_dir: Path | str, pid: int) -> None:
    """Remove ``agent.json`` if it still names ``pid`` (an agent that stops)."""
    try:
        if read_agent_record(job_dir).pid == pid:
            agent_record_path(job_dir).unlink()
    except OSError:
        pass


def read_agent_record(job_dir: Path | str) -> AgentRecord:
    """Read ``agent.json`` without following links; it must be a small regular file of this
    process's uid.

    Raises:
        FileNotFoundError: no agent has published an address (yet).
        RefusedPeer: the file is a link, not regular, not ours, or malformed.
    """
    path = agent_record_path(job_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RefusedPeer(f"{path} is a symbolic link; it is not the agent's record") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                or st.st_size > AGENT_RECORD_MAX_BYTES:
            raise RefusedPeer(f"{path} is not a small regular file of uid {os.getuid()}")
        raw = os.read(fd, AGENT_RECORD_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        obj = json.loads(raw)
        pid, address, slot_dir = obj["pid"], obj["address"], obj.get("slot_dir")
        if type(pid) is not int or pid <= 0 or not isinstance(address, str) \
                or not address.startswith(ADDRESS_PREFIX) or "\0" in address \
                or not (slot_dir is None or isinstance(slot_dir, str)):
            raise ValueError("wrong field types")
    except (ValueError, KeyError, TypeError) as e:
        raise RefusedPeer(f"{path} is malformed ({e})") from None
    return AgentRecord(pid, address, slot_dir)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket, as the
    kernel recorded them when it connected or listened (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def say_refused_once(key: str, uid: int, line: str) -> bool:
    """Write ``line`` to stderr (one line, never wrapped) the first time this process refuses
    ``uid`` for ``key`` (an address, or ``"agent"``): an attacker that retries does not flood
    the log. Returns True if it said it now."""
    if (key, uid) in _refusals_said:
        return False
    _refusals_said.add((key, uid))
    print(line.replace("\n", " "), file=sys.stderr, flush=True)
    return True


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Send one JSON message. Raises OSError if the peer is gone."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv(sock: socket.socket) -> dict[str, Any]:
    """Receive one JSON message.

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: oversized or malformed frame.
    """
    (n,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = json.loads(recv_exact(sock, n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed frame: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    return msg


def connect(job_dir: Path | str, timeout_s: float = 5.0, *, address: str | None = None,
            expect_pid: int | None = None) -> socket.socket:
    """Connect to the job's agent at the address in ``agent.json`` (or ``address``) and check
    that the process answering runs as this process's uid (and is ``expect_pid``, when given:
    the supervisor, which knows the pid it started). Any process of the job may call it.

    Raises:
        FileNotFoundError: no ``agent.json`` yet.
        RefusedPeer: the answering process is another user's (or not ``expect_pid``); logged
            once per address in one line.
        OSError: nobody listens.
    """
    if address is None:
        address = read_agent_record(job_dir).address
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect("\0" + address)
        pid, uid, _ = peer_credentials(sock)
        if uid != os.getuid():
            say_refused_once(address, uid, f"cfrun: refused the agent at {address}: it runs "
                             f"as uid {uid} (pid {pid}), not as this job's uid {os.getuid()}")
            raise RefusedPeer(f"the process at {address} runs as uid {uid}, not {os.getuid()}")
        if expect_pid is not None and pid != expect_pid:
            say_refused_once(address, uid, f"cfrun: refused the agent at {address}: pid {pid} "
                             f"answers, not the agent (pid {expect_pid}) started for this job")
            raise RefusedPeer(f"pid {pid} answers at {address}, not {expect_pid}")
    except OSError:
        sock.close()
        raise
    return sock
