"""Admission to the ``cfrun peer``: accept, run every handshake, bound what is unauthenticated.

Runs on the peer's main thread (:meth:`cfrun.peer.server.PeerServer.serve`). All handshakes run
in one non-blocking ``selectors`` loop, so a connection that has not proved the token costs a
socket and 69 bytes, no thread. The limits (DESIGN.md §9) are what lets a valid client in while
slow clients flood the port (the slowloris attack):

* the **whole** handshake must complete within :data:`~cfrun.peer.protocol.HANDSHAKE_DEADLINE_S`
  (a client that sends one byte a second never gets there);
* at most :data:`~cfrun.peer.protocol.MAX_UNAUTHENTICATED` connections mid-handshake, at most
  :data:`~cfrun.peer.protocol.MAX_UNAUTHENTICATED_PER_ADDRESS` of them from one address; a new
  connection over a limit **evicts** one (of its own address first, else of the busiest
  address) instead of being refused: first the oldest that sent part of a hello (a real client
  sends its 69 bytes in one segment; a partial one is a slow sender), else the oldest. The
  newest connection always gets its turn, and a valid client needs only its round trip however
  many slow ones arrive (and retries once if it was evicted all the same:
  :class:`cfrun.peer.protocol.PeerClient`);
* authenticated connections have their own cap (``max_connections``); over it the client is told
  ``busy``.

Evictions and expired handshakes are counted and logged once per 10 s; a bad hello or a wrong
token is logged on its own line.

**Tenants** (issue 32, :mod:`cfrun.peer.tenants`): the client's proof is checked against every
tenant's token, all of them every time, each with ``hmac.compare_digest``, so neither the answer
(``CFPN`` for any wrong token) nor the work done tells which tenants exist or which one came
close; the cost is one HMAC per tenant (at most :data:`~cfrun.peer.tenants.MAX_TENANTS`). The
matching tenant's token then proves the server and keys the session, and the connection is
admitted as that tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import selectors
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from cfrun.peer.protocol import (
    AUTH_BUSY,
    AUTH_NO,
    AUTH_OK,
    CLIENT_HELLO,
    CLIENT_HELLO_BYTES,
    HANDSHAKE_DEADLINE_S,
    MAX_UNAUTHENTICATED,
    MAX_UNAUTHENTICATED_PER_ADDRESS,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    SERVER_HELLO,
    Channel,
    fmt_address,
    handshake_mac,
    session_keys,
)
from cfrun.peer.tenants import DEFAULT_TENANT, MAX_TENANTS, Tenant

logger = logging.getLogger("cfrun.peer.server")

SUMMARY_EVERY_S = 10.0


@dataclass
class _Pending:
    sock: socket.socket
    host: str
    who: str
    nonce: bytes
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


class Gate:
    """The handshakes of one listening socket.

    Args:
        sock: the bound, listening socket (made non-blocking here).
        tenants: the tenants (:func:`cfrun.peer.tenants.read_tenants`), 1 to
            :data:`~cfrun.peer.tenants.MAX_TENANTS`; a bare token is the one default tenant's.
        admit: ``admit(channel, who, greeting, tenant)`` is called with each authenticated
            connection, the bytes that complete the handshake (the server's proof), which its
            handler sends first, and the tenant whose token the client proved; returns False
            when the authenticated cap is reached (the client is then told ``busy``).
        max_unauthenticated, max_per_address: the limits above.
        deadline_s: the whole-handshake deadline.
    """

    def __init__(self, sock: socket.socket, tenants: list[Tenant] | bytes,
                 admit: Callable[[Channel, str, bytes, Tenant], bool], *,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 max_per_address: int = MAX_UNAUTHENTICATED_PER_ADDRESS,
                 deadline_s: float = HANDSHAKE_DEADLINE_S) -> None:
        self.sock = sock
        if isinstance(tenants, bytes):
            tenants = [Tenant(DEFAULT_TENANT, tenants)]
        if not 1 <= len(tenants) <= MAX_TENANTS:
            raise ValueError(f"{len(tenants)} tenants; 1 to {MAX_TENANTS} are served")
        self.tenants = list(tenants)
        self._client_macs = [hmac.new(t.token, b"cfrun-peer/2 client", hashlib.sha256)
                             for t in self.tenants]
        """Each tenant's client proof with the key and label absorbed (copied per try)."""
        self.admit = admit
        self.max_unauthenticated = max_unauthenticated
        self.max_per_address = max_per_address
        self.deadline_s = deadline_s
        self.pending: dict[socket.socket, _Pending] = {}  # insertion order = age
        self.per_host: Counter[str] = Counter()
        self.sel = selectors.DefaultSelector()
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ)
        self.evicted = 0
        self.expired = 0
        self.repeated = 0
        """Rejections whose reason was already logged in this summary period."""
        self.reasons_logged: set[str] = set()
        self.next_summary = time.monotonic() + SUMMARY_EVERY_S

    def step(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for activity; accept, advance handshakes, expire, evict."""
        now = time.monotonic()
        if self.pending:
            oldest = min(p.deadline for p in self.pending.values())
            timeout_s = max(0.0, min(timeout_s, oldest - now))
        for key, _ in self.sel.select(timeout_s):
            if key.fileobj is self.sock:
                self._accept()
            else:
                p = self.pending.get(key.fileobj)  # type: ignore[call-overload]
                if p is not None:
                    self._advance(p)
        now = time.monotonic()
        for p in [p for p in self.pending.values() if p.deadline <= now]:
            self.expired += 1
            self._drop(p)
        if now >= self.next_summary:
            self.next_summary = now + SUMMARY_EVERY_S
            if self.evicted or self.expired or self.repeated:
                logger.warning("rejected %d unauthenticated connections in the last %.0f s "
                               "(%d evicted: at most %d mid-handshake, %d per address; %d past "
                               "the %g s handshake deadline; %d for a reason logged above)",
                               self.evicted + self.expired + self.repeated, SUMMARY_EVERY_S,
                               self.evicted, self.max_unauthenticated, self.max_per_address,
                               self.expired, self.deadline_s, self.repeated)
                self.evicted = self.expired = self.repeated = 0
            self.reasons_logged.clear()

    def close(self) -> None:
        """Drop every pending handshake (the listening socket is the caller's)."""
        for p in list(self.pending.values()):
            self._drop(p)
        self.sel.close()

    # ------------------------------------------------------------------ internals

    def _accept(self) -> None:
        for _ in range(64):  # a bounded batch, then the pending ones get their turn
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                logger.warning("accept failed: %s", e)
                return
            host, who = str(addr[0]), fmt_address(addr)
            if self.per_host[host] >= self.max_per_address:
                self._evict(self._victim(host))
            elif len(self.pending) >= self.max_unauthenticated:
                self._evict(self._victim(self.per_host.most_common(1)[0][0]))
            nonce = secrets.token_bytes(NONCE_BYTES)
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello = SERVER_HELLO + bytes([PROTOCOL_VERSION]) + nonce
                if conn.send(hello) != len(hello):
                    raise OSError("short send")
            except OSError:
                conn.close()
                continue
            p = _Pending(conn, host, who, nonce, time.monotonic() + self.deadline_s)
            self.pending[conn] = p
            self.per_host[host] += 1
            self.sel.register(conn, selectors.EVENT_READ)

    def _victim(self, host: str) -> _Pending:
        """The oldest pending connection of ``host`` that sent part of a hello, else its oldest."""
        mine = [p for p in self.pending.values() if p.host == host]
        return next((p for p in mine if p.buf), mine[0])

    def _evict(self, p: _Pending) -> None:
        self.evicted += 1
        self._drop(p)

    def _drop(self, p: _Pending) -> None:
        self.sel.unregister(p.sock)
        del self.pending[p.sock]
        self.per_host[p.host] -= 1
        if self.per_host[p.host] <= 0:
            del self.per_host[p.host]
        p.sock.close()

    def _reject(self, p: _Pending, why: str, answer: bytes = b"") -> None:
        """Close ``p`` (after ``answer``). The first rejection of each kind of reason in a
        summary period gets a line of its own, the rest are counted in the summary: a flood
        of 2,000 bad connections wrote 2,000 lines (issue 24, item 10)."""
        kind = re.sub(r"\d+", "N", why)
        if kind in self.reasons_logged:
            self.repeated += 1
        else:
            self.reasons_logged.add(kind)
            logger.warning("rejected %s: %s; connection closed (more of this kind are counted "
                           "in a summary every %.0f s)", p.who, why, SUMMARY_EVERY_S)
        if answer:
            try:
                p.sock.send(answer)
            except OSError:
                pass
        self._drop(p)

    def _advance(self, p: _Pending) -> None:
        try:
            data = p.sock.recv(CLIENT_HELLO_BYTES - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._reject(p, "incomplete handshake")
            return
        p.buf += data
        prefix = CLIENT_HELLO + bytes([PROTOCOL_VERSION])
        if p.buf[:len(prefix)] != prefix[:len(p.buf)]:
            self._reject(p, "not a cfrun peer client (bad hello)")
            return
        if len(p.buf) < CLIENT_HELLO_BYTES:
            return
        client_nonce, mac = bytes(p.buf[5:5 + NONCE_BYTES]), bytes(p.buf[5 + NONCE_BYTES:])
        tenant = self._tenant_of(mac, p.nonce, client_nonce)
        if tenant is None:
            self._reject(p, "authentication failed (wrong token)", AUTH_NO)
            return
        sock = p.sock
        self.sel.unregister(sock)
        del self.pending[sock]
        self.per_host[p.host] -= 1
        if self.per_host[p.host] <= 0:
            del self.per_host[p.host]
        client_key, server_key = session_keys(tenant.token, p.nonce, client_nonce)
        try:
            sock.setblocking(True)
            sock.settimeout(self.deadline_s)
            ch = Channel(sock, server_key, client_key)
            greeting = AUTH_OK + handshake_mac(tenant.token, b"server", client_nonce, p.nonce)
            if not self.admit(ch, p.who, greeting, tenant):
                sock.sendall(AUTH_BUSY)
                sock.close()
                return
        except OSError:
            sock.close()
            return

    def _tenant_of(self, mac: bytes, server_nonce: bytes, client_nonce: bytes) -> Tenant | None:
        """The tenant whose token made the client's proof ``mac``, or None. Every tenant's
        proof is computed and compared (constant-time compares, no early exit), so the work is
        the same whichever tenant matched, or none."""
        found = None
        for tenant, base in zip(self.tenants, self._client_macs):
            want = base.copy()
            want.update(server_nonce + client_nonce)
            if hmac.compare_digest(want.digest(), mac) and found is None:
                found = tenant
        return found
