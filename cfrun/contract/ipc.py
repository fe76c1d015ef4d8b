"""Messages between ranks and the node's persist agent: length-prefixed JSON on a Unix socket.

The socket lives in the abstract namespace (Linux), named after the job dir, so no file is left
behind and path-length limits do not apply. Frames are bounded (``MAX_FRAME_BYTES``); nothing
received is unpickled. Tensor bytes never travel here: they stay in the shared-memory snapshot
slot, which the agent reads directly (ACUTE's Check-Pack: no unpack, no re-serialization).
"""

from __future__ import annotations

import hashlib
import json
import socket
import struct
from pathlib import Path
from typing import Any

MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct("!I")


class ProtocolError(ConnectionError):
    """A frame was malformed or larger than ``MAX_FRAME_BYTES``."""


def agent_address(job_dir: Path | str) -> str:
    """The agent's abstract socket name for ``job_dir``."""
    from cfrun.contract.settings import node_suffix

    digest = hashlib.sha1(str(Path(job_dir).absolute()).encode()).hexdigest()[:24]
    return f"\0cfrun-agent-{digest}{node_suffix()}"


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Send one JSON message. Raises OSError if the peer is gone."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict[str, Any]:
    """Receive one JSON message.

    Raises:
        ConnectionError: the peer closed the connection.
        ProtocolError: oversized or malformed frame.
    """
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        msg = json.loads(_recv_exact(sock, n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed frame: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    return msg


def connect(job_dir: Path | str, timeout_s: float = 5.0) -> socket.socket:
    """Connect to the job's agent. Raises OSError if none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(agent_address(job_dir))
    except OSError:
        sock.close()
        raise
    return sock
