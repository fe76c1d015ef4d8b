"""``events.jsonl``: the job's append-only record, and the count of the writes a disk refused.

Every process of a job appends one JSON object per line (:meth:`EventLog.append`, kinds and
fields checked against :data:`cfrun.contract.events.EVENTS`); the supervisor, the policy, the
CLI and the tests read them back (:meth:`EventLog.read`). :class:`cfrun.contract.jobdir.JobDir`
holds the job dir's one (:attr:`~cfrun.contract.jobdir.JobDir.event_log`) and its
``emit_event`` / ``read_events`` hand over to it.

Events, heartbeats and marks are best effort (issue 13, "a full disk"): a write the disk refuses
is dropped, counted and said once per outage on stderr (:data:`best_effort`), never raised, so
a full or read-only job dir never kills the supervisor, the agent or a rank. Torch-free.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from cfrun.contract import events as _events
from cfrun.contract.fsio import UnsafeFileError, open_private, read_regular
from cfrun.contract.settings import node_rank


class BestEffortWrites:
    """Counts the failed best-effort writes of this process (events, heartbeats, marks,
    coordination files) and says each outage once on stderr.

    An *outage* of a kind of write (``"events"``, ``"heartbeat"`` ...) begins with its first
    failed write and ends with its next successful one; its first failure prints one line,
    its end another with the number of writes dropped. Thread-safe; one per process
    (:data:`best_effort`). Never raises.
    """

    def __init__(self) -> None:
        self.failed: dict[str, int] = {}
        """kind -> writes that failed in this process."""
        self._dropped: dict[str, int] = {}  # kind -> failures in the current outage
        self._lock = threading.Lock()

    def failure(self, kind: str, path: Path | str, error: BaseException) -> None:
        """A write of ``kind`` to ``path`` failed with ``error``: count it; the first failure
        of an outage says so on stderr."""
        with self._lock:
            self.failed[kind] = self.failed.get(kind, 0) + 1
            first = kind not in self._dropped
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
        if first:
            _stderr_line(f"cfrun: cannot write {kind} ({str(path)!r}: {error}); dropping "
                         f"{kind} writes until the disk takes them again (pid {os.getpid()})")

    def success(self, kind: str) -> None:
        """A write of ``kind`` succeeded: an outage of it ends (said once, with its count)."""
        if kind not in self._dropped:  # the common case: no lock
            return
        with self._lock:
            dropped = self._dropped.pop(kind, 0)
        if dropped:
            _stderr_line(f"cfrun: {kind} writes work again; {dropped} were dropped "
                         f"(pid {os.getpid()})")

    @property
    def total(self) -> int:
        """Failed writes of every kind so far."""
        return sum(self.failed.values())


def _stderr_line(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed or full: nothing more to do
        pass


best_effort = BestEffortWrites()
"""This process's count of dropped best-effort writes (:class:`BestEffortWrites`)."""


class EventLog:
    """One job dir's ``events.jsonl``: appended to by every process, read by whoever reports.

    Any process may construct it; appends from several processes and threads are safe
    (``O_APPEND``, one ``write`` per line). Holds no file open between calls.

    Args:
        path: ``<job_dir>/events.jsonl`` (:data:`cfrun.contract.jobdir.EVENTS`).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, kind: str, **fields: Any) -> None:
        """Append one event line (O_APPEND: safe across processes), best effort: a write the
        disk refuses (``ENOSPC``, ``EROFS``, ``EIO``, ``EACCES`` ...) is dropped and counted in
        :data:`best_effort`, which says the outage once on stderr; it is never raised (the
        supervisor, the agent and the ranks call this on their main paths).

        Events of node R > 0 of a multi-node job carry ``"node": R`` (node 0's carry none).
        ``kind`` and the field names are checked against :data:`cfrun.contract.events.EVENTS`
        (:func:`cfrun.contract.events.check`).

        Raises:
            EventSchemaError: an undeclared kind or field, or a missing required field, under
                test only (in production it is logged once and the event written anyway).
            BadInputError: ``events.jsonl`` is a symbolic link (never written through).
        """
        _events.check(kind, fields)
        record = {"t_unix_s": round(time.time(), 6), "event": kind, **fields}
        node = node_rank()
        if node:
            record.setdefault("node", node)
        line = json.dumps(record, sort_keys=True, default=str) + "\n"
        try:
            fd = open_private(self.path, os.O_RDWR | os.O_APPEND)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # a writer died mid-line
                    line = "\n" + line
                data = line.encode()
                written = os.write(fd, data)
                if written != len(data):  # a short append (the disk filled up mid-line)
                    raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)")
            finally:
                os.close(fd)
        except OSError as e:
            best_effort.failure("events", self.path, e)
            return
        best_effort.success("events")

    def read(self) -> list[dict[str, Any]]:
        """All events, oldest first; a torn last line (a crash mid-append) is skipped. A link,
        FIFO or device in the file's place reads as no events (never followed, never waited
        on: :func:`cfrun.contract.fsio.read_regular`)."""
        try:
            data = read_regular(self.path, max_bytes=sys.maxsize)
        except (UnsafeFileError, FileNotFoundError):
            return []
        out = []
        for line in data.decode("utf-8", "replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out
