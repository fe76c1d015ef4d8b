"""What this node's ranks left in the job dir for the supervisor, read after and during an attempt.

Heartbeats (``heartbeat-rank-*``: the newest step, a step's time), the end-of-script marks
(``ended/``), the error records (``errors/``), the ``preempted`` marks, ``fatal.json``
(:mod:`cfrun.contract.coordination` defines each), and the job's failure history for the
learned MTBF. Read-only; a record that is unreadable or malformed is skipped or read as the
safe answer, never raised. The monitor (:class:`cfrun.supervisor.monitor.Monitor`) builds each
attempt's :class:`~cfrun.supervisor.machine.Outcome` from them.
"""

from __future__ import annotations

import time
from typing import Any

from cfrun.contract import coordination as co
from cfrun.contract.config import RunConfig
from cfrun.contract.jobdir import JobDir
from cfrun.policy import learned_mtbf_s
from cfrun.supervisor.machine import RankError


class RankRecords:
    """Reads the ranks' records of ``jobdir`` for node ``cfg.node_rank`` (supervisor only).

    Args:
        cfg: the job's settings (``node_rank``, ``hang_timeout_s``, ``mtbf_s``).
        jobdir: the job dir.
    """

    def __init__(self, cfg: RunConfig, jobdir: JobDir) -> None:
        self.cfg = cfg
        self.jobdir = jobdir

    def mtbf_s(self) -> float | None:
        """``--mtbf``, else learned from this job's history (wall time per failure)."""
        if self.cfg.mtbf_s:
            return self.cfg.mtbf_s
        events = self.jobdir.read_events()
        wall_s = sum(float(e.get("duration_s", 0)) for e in events
                     if e.get("event") == "attempt_end")
        failures = sum(1 for e in events if e.get("event") == "failure")
        return learned_mtbf_s(wall_s, failures)

    def stepped_since(self, started_unix_s: float) -> bool:
        """A rank wrote a heartbeat (one per optimizer step) at or after ``started_unix_s``."""
        for p in co.heartbeat_paths(self.jobdir.root):
            try:
                if p.stat().st_mtime >= started_unix_s:
                    return True
            except OSError:  # removed meanwhile
                continue
        return False

    def is_hung(self, started_unix_s: float) -> bool:
        """No rank wrote a heartbeat (one per optimizer step) for ``hang_timeout_s``."""
        limit = self.cfg.hang_timeout_s
        if not limit:
            return False
        beats = []
        for p in co.heartbeat_paths(self.jobdir.root):
            try:
                beats.append(p.stat().st_mtime)
            except OSError:  # removed meanwhile
                continue
        beats = [t for t in beats if t >= started_unix_s]
        if not beats:  # before the first step: startup, data loading, resume
            return time.time() - started_unix_s > max(limit, 600.0)
        return time.time() - min(beats) > limit

    def last_step(self) -> int | None:
        """The highest step in the ranks' heartbeats (``heartbeat-rank-*``), None before any."""
        return co.newest_heartbeat_step(self.jobdir.root)

    def ended_marks(self, attempt: int) -> dict[int, dict[str, Any]]:
        """rank -> the end-of-script mark this node's rank wrote in ``attempt``
        (:class:`cfrun.contract.coordination.EndedMark`: ``clean``, ``preempted``, ``step``);
        an unreadable or malformed mark reads as not clean."""
        out: dict[int, dict[str, Any]] = {}
        for rank, p in co.ended_of(self.jobdir.root, self.cfg.node_rank, attempt).items():
            mark = co.read(p, co.EndedMark)
            out[rank] = mark.to_json() if mark is not None else {"clean": False}
        return out

    def rank_errors(self, attempt: int) -> tuple[RankError, ...]:
        """The ranks' errors of ``attempt`` (``errors/attempt-A-rank-R.json``,
        :class:`cfrun.contract.coordination.RankError`); unreadable or malformed records are
        skipped."""
        out = []
        for rank, path in co.errors_of(self.jobdir.root, attempt).items():
            e = co.read(path, co.RankError)
            if e is None:
                continue
            try:
                t = e.t_unix_s if e.t_unix_s else path.stat().st_mtime
            except OSError:
                continue
            out.append(RankError(rank=rank, type=e.type, message=e.message, step=e.step,
                                 t_unix_s=float(t)))
        return tuple(out)

    def preempted_marks(self, attempt: int) -> list[int]:
        """The stop steps of this node's ranks' ``preempted`` marks of ``attempt``
        (cfrun.rank.preemption.Marks)."""
        steps = []
        for p in co.preempted_of(self.jobdir.root, self.cfg.node_rank, attempt).values():
            mark = co.read(p, co.PreemptedMark)
            if mark is not None:
                steps.append(mark.step)
        return steps

    def fatal_message(self) -> str | None:
        """``fatal.json``'s message (a rank found that resuming would be wrong), or None
        without one; ``"unknown"`` when it exists but is unreadable or malformed (its presence
        alone stops the job)."""
        path = co.fatal_path(self.jobdir.root)
        if not co.exists(path):
            return None
        fatal = co.read(path, co.Fatal)
        return fatal.message if fatal is not None else "unknown"
