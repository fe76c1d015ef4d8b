"""Reading exactly N bytes from a stream socket: the one loop both of cfrun's socket protocols use.

Torch-free. The agent's socket (:mod:`cfrun.contract.ipc`, length-prefixed JSON) and the peer
tier's (:mod:`cfrun.peer.protocol`, authenticated frames) both read fixed-size pieces; each passes
the error type its callers expect when the other end closes the connection early
(``ConnectionError`` for the agent's, ``PeerError`` for the peer's).
"""

from __future__ import annotations

import socket
import time

RECV_CHUNK_BYTES = 1 << 20
"""At most this many bytes per ``recv`` (the caller may choose another size)."""


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None, *,
              closed: type[Exception] = ConnectionError,
              chunk_bytes: int = RECV_CHUNK_BYTES) -> None:
    """Fill ``view`` from ``sock``; with ``deadline`` (``time.monotonic()``) the whole read must
    end by then (the socket's timeout is set to what is left before each ``recv``).

    Raises:
        closed: (``closed("connection closed")``) the other end closed the connection first.
        TimeoutError: the socket's timeout or the deadline passed.
        OSError: the socket failed.
    """
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        r = sock.recv_into(view[got:], min(len(view) - got, chunk_bytes))
        if not r:
            raise closed("connection closed")
        got += r


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None, *,
               closed: type[Exception] = ConnectionError,
               chunk_bytes: int = RECV_CHUNK_BYTES) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (see :func:`recv_into` for the arguments and errors)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline, closed=closed, chunk_bytes=chunk_bytes)
    return bytes(buf)
