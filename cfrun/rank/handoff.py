"""The hand-off of a checkpoint to the node's persist agent, over its Unix socket
(:mod:`cfrun.rank.snapshot`, "Hand-off" and "Bounded wait for the agent").

When the copy is complete the rank sends the agent one message (step, slot, bytes, the JSON
tree); from then on the agent persists and commits it even if the rank dies. A rank waits for
the agent's reply only so long (:meth:`AgentLink.reply_timeout_s`: :data:`REPLY_TIMEOUT_MIN_S`,
or ten times the last persist if that is longer); then the checkpoint counts as failed
(``persist_lost``), the connection is dropped and the next checkpoint reconnects (issue 13, "a
full disk": an agent that never answers must not hold the ranks forever).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cfrun.contract import faults, ipc

logger = logging.getLogger(__name__)

REPLY_TIMEOUT_MIN_S = 600.0
"""Seconds a rank waits at least for the agent's reply to a persist before it counts the
checkpoint as failed (the agent writes the ranks' shards one after another: a slow disk and a
large state take minutes)."""
REPLY_TIMEOUT_PER_PERSIST = 10.0
"""A rank waits at least this many times the last persist's seconds."""


class AgentLink:
    """One rank's connection to the persist agent: the socket, the reply timeout learnt from
    the last persist, and :attr:`handed_off`, whether the agent has the in-flight checkpoint.

    Args:
        on_ready: called after the agent answered ``ready`` to a ``hello`` (it has drained the
            work of this rank's predecessors: their slots may go).
    """

    def __init__(self, job_dir: Path, rank: int, attempt: int,
                 on_ready: Callable[[], None] = lambda: None) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.on_ready = on_ready
        self.sock: socket.socket | None = None
        self.handed_off = threading.Event()
        """Set once the agent has the in-flight checkpoint (or its hand-off failed): from then
        on a SIGKILL of this rank no longer loses it (:meth:`Boundary.on_before_step` waits)."""
        self.handed_off.set()
        self.reply_timeout_min_s = REPLY_TIMEOUT_MIN_S
        """The least seconds :meth:`reply_timeout_s` allows (tests lower it)."""
        self.last_persist_s = 0.0
        """Seconds the agent took for the last committed persist (its reply's ``persist_s``)."""
        # fault points (cfrun.contract.faults), read once: None in every real run
        self._kill_after_step = _armed_int("rank.kill_after_snapshot", attempt)
        self._kill_before_step = _armed_int("rank.kill_before_handoff", attempt)
        self._error_at_step = _armed_int("rank.snapshot_handoff_error", attempt)
        self._test_error_done = False

    def reply_timeout_s(self) -> float:
        """Seconds to wait for the agent's reply to a persist: :attr:`reply_timeout_min_s`, or
        :data:`REPLY_TIMEOUT_PER_PERSIST` times the last persist's seconds if longer."""
        return max(self.reply_timeout_min_s, REPLY_TIMEOUT_PER_PERSIST * self.last_persist_s)

    def connect(self, timeout_s: float = 120.0) -> bool:
        """Connect to the persist agent and wait until it has drained earlier work, retrying
        for up to ``timeout_s`` seconds; then :attr:`on_ready`. Returns False if no agent
        answers, or if it answers other than ``ready``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = ipc.connect(self.job_dir)
                self.sock.settimeout(timeout_s)
                ipc.send(self.sock, {"op": "hello", "rank": self.rank})
                reply = ipc.recv(self.sock)
                self.sock.settimeout(None)
                is_ready = reply.get("op") == "ready"
                break
            except OSError:
                self.sock = None
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)
        if is_ready:
            self.on_ready()
        return is_ready

    def persist(self, step: int, msg: dict[str, Any]) -> dict[str, Any]:
        """Send the checkpoint of ``step`` (``msg``, a ``PersistRequest``) and wait for the
        agent's reply (snapshot thread); reconnects first if the last hand-off dropped the
        connection. Sets :attr:`handed_off` once sent. Returns the reply.

        Raises:
            ConnectionError: no persist agent, or one that is not ready.
            TimeoutError: no reply within :meth:`reply_timeout_s`.
            OSError: the connection broke.
        """
        if self._kill_before_step is not None and step >= self._kill_before_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.sock is None and not self.connect(timeout_s=30.0):
            raise ConnectionError("no persist agent")
        if self.sock is None:
            raise ConnectionError("the persist agent is not ready")
        if (self._error_at_step is not None and step >= self._error_at_step
                and not self._test_error_done):
            self._test_error_done = True
            raise TypeError(f"injected hand-off error at step {step} "
                            "(fault point rank.snapshot_handoff_error)")
        ipc.send(self.sock, msg)
        self.handed_off.set()
        if self._kill_after_step is not None and step >= self._kill_after_step:
            os.kill(os.getpid(), signal.SIGKILL)
        self.sock.settimeout(self.reply_timeout_s())  # TimeoutError: counted as failed
        reply = ipc.recv(self.sock)
        self.sock.settimeout(None)
        if reply.get("ok"):
            self.last_persist_s = float(reply["persist_s"])
        return reply

    def drop(self) -> None:
        """Close the connection (a reply may still come: start afresh); the next
        :meth:`persist` reconnects, to a restarted agent if need be."""
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None


def _armed_int(point: str, attempt: int) -> int | None:
    """A step-valued fault point (cfrun.contract.faults): its step in attempt 0, else None."""
    value = faults.value(point)
    return int(value) if value is not None and attempt == 0 else None
