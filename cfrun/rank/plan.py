"""``strategy.json``: the one record of rank 0's checkpoint plan that every rank follows (issue 22).

Rank 0 publishes a record at its first step of every attempt and at every later decision
(:meth:`PlanBoard.publish`); every other rank adopts the newest record of its attempt when the
file changes (:meth:`PlanBoard.newer`). A record takes effect at its ``effective_step``, two
steps after the step it was made at: until then the plan before it applies (:meth:`PlanBoard.at`),
so every rank decides alike whether it read the record at its step ``s`` or ``s + 1``. A record
belongs to an attempt: rank 0's node and attempt number and a random ``attempt_id``; on another
node a follower ignores the ``attempt_id`` the file held when it started. The decisions
themselves are :class:`cfrun.rank.tuner.Tuner`'s; this module keeps the record and when it
applies. Training thread only.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from cfrun.contract.jobdir import JobDir, atomic_write_json
from cfrun.rank.log import say

Plan = tuple[str, int, int]
"""(phase, interval, base step) of a plan."""


class PlanBoard:
    """The plan record of one rank, as publisher (rank 0) or follower.

    Args:
        jobdir: the job dir (``strategy.json``).
        rank, attempt, node_rank: this rank's (:class:`cfrun.rank.settings.RankSettings`).
        fixed: ``--interval K``: the plan applies from step 0, nothing is published or read.
    """

    def __init__(self, jobdir: JobDir, *, rank: int, attempt: int, node_rank: int,
                 fixed: bool) -> None:
        self.path: Path = jobdir.strategy_path
        self.attempt = attempt
        self.node_rank = node_rank
        self.plan_from: int | None = 0 if fixed else None
        """No checkpoint before this step; None: no plan of this attempt yet (no checkpoint)."""
        self._prev: Plan | None = None
        """The plan before the current one, which applies until :attr:`_switch_step`."""
        self._switch_step = 0
        self._in_force: Plan | None = None
        """The newest plan published or adopted."""
        self.seq = 0
        """Rank 0: plans published this attempt. A follower: the last one adopted."""
        self.attempt_id = uuid.uuid4().hex if rank == 0 else ""
        self._stale_id: str | None = None
        """A follower: the ``attempt_id`` in ``strategy.json`` when it started (an earlier
        attempt's, never followed)."""
        if rank != 0 and not fixed:
            self._stale_id = record_of(self.path).get("attempt_id")
        self._stat: tuple[int, int] | None = None
        self._late_said = False

    def at(self, step: int, current: Plan) -> Plan:
        """The plan that applies at ``step``: the previous one before the newest record's
        effective step, else ``current``."""
        if self._prev is not None and step < self._switch_step:
            return self._prev
        return current

    def switch_to(self, record: dict[str, Any]) -> None:
        """``record`` (published or adopted) is the plan from its effective step on; the one
        before it (as of the last record) applies until then."""
        effective = int(record["effective_step"])
        if self.plan_from is None:
            self.plan_from = effective
        else:
            self._prev = self._in_force
        self._in_force = (str(record["phase"]), int(record.get("interval") or 0),
                          int(record["base_step"]))
        self._switch_step = effective

    def publish(self, record: dict[str, Any]) -> None:
        """Rank 0: ``record`` is the plan from its effective step on, for every rank. A write
        that fails is said once per failure: the followers then take no checkpoint (the
        agent fails rank 0's shard of such a step at once)."""
        self.switch_to(record)
        try:
            atomic_write_json(self.path, record)
        except OSError as e:
            say(f"WARNING: the checkpoint plan could not be written ({e!r})")

    def newer(self) -> dict[str, Any] | None:
        """A follower: rank 0's newest record of this attempt when ``strategy.json`` changed
        since the last look and holds one newer than the last adopted, else None."""
        try:
            st = self.path.stat()
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns)
        if key == self._stat:
            return None
        self._stat = key
        record = record_of(self.path)
        if self.of_this_attempt(record) and int(record.get("seq", 0)) > self.seq:
            return record
        return None

    def warn_if_late(self, step: int, first_step: int, late_steps: int) -> None:
        """A follower with no plan ``late_steps`` steps after its first: said once."""
        if self.plan_from is None and step >= first_step + late_steps and not self._late_said:
            self._late_said = True
            say(f"WARNING: no checkpoint plan from rank 0 for attempt {self.attempt} after "
                f"{late_steps} steps ({self.path}); this rank takes no checkpoints until it "
                "comes")

    def of_this_attempt(self, record: dict[str, Any]) -> bool:
        """Whether ``record`` is rank 0's plan of the current attempt: on rank 0's node its
        attempt number; on another node an ``attempt_id`` other than the stale one."""
        if not record.get("attempt_id"):
            return False
        if record.get("node_rank") == self.node_rank:
            return record.get("attempt") == self.attempt
        return record["attempt_id"] != self._stale_id


def record_of(path: Path) -> dict[str, Any]:
    """``strategy.json``'s record, or ``{}`` when it is missing or unreadable."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
