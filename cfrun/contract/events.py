"""The events of ``events.jsonl``: every kind, with its required and optional fields, in one table.

Every process of a job appends events to ``<job_dir>/events.jsonl`` through
:meth:`cfrun.contract.jobdir.JobDir.emit_event`, which checks the kind and the field names
against :data:`EVENTS` (:func:`check`). An undeclared kind, a missing required field or an
undeclared field is a bug in cfrun: it raises :class:`EventSchemaError` under test
(``CFRUN_FAULTS`` set, or pytest running) and is logged once, and the event written anyway, in
production (a training run is never killed over its log). ``cfrun status`` and the tests read
the events back.

Every line also has ``t_unix_s`` (unix seconds) and ``event`` (the kind), and ``node`` (the
node rank) on node R > 0 of a multi-node job (:data:`COMMON`). Torch-free.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from cfrun.contract import settings

logger = logging.getLogger("cfrun")


class EventSchemaError(ValueError):
    """An event whose kind is not declared in :data:`EVENTS` or whose fields do not match it."""


@dataclass(frozen=True)
class EventKind:
    """One kind of event: who writes it, the fields it must have and those it may have
    (``open``: any further fields too, e.g. measurements merged from a record)."""

    writer: str
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    open: bool = False


def _k(writer: str, required: Iterable[str] = (), optional: Iterable[str] = (),
       open: bool = False) -> EventKind:
    return EventKind(writer, frozenset(required), frozenset(optional), open)


COMMON = frozenset({"t_unix_s", "event", "node"})
"""Fields every event may carry besides its own (added by ``emit_event``)."""

_CKPT_FIGURES = ("step", "bytes", "stall_s", "snapshot_s", "persist_s", "pgt_s",
                 "bandwidth_bytes_per_s", "tier")

EVENTS: dict[str, EventKind] = {
    # supervisor (cfrun.supervisor.core, .monitor, .machine)
    "state": _k("supervisor", ["state"], open=True),
    "attempt_start": _k("supervisor", ["attempt", "argv"], ["warm", "warm_ranks"]),
    "attempt_pids": _k("supervisor", ["attempt", "pids"]),
    "standby_ready": _k("supervisor", ["pid", "warmup_s"], ["local_rank", "forked"]),
    "attempt_end": _k("supervisor", ["attempt", "returncode", "duration_s"]),
    "hang": _k("supervisor", ["attempt", "hang_timeout_s"]),
    "signal_forwarded": _k("supervisor", ["signal", "ranks"]),
    "leftovers_killed": _k("supervisor", ["pids"], ["agent_pid"]),
    "command_changed": _k("supervisor", ["changed", "fingerprint"],
                          ["why", "previous_checkpoints"]),
    "foreign_checkpoint": _k("supervisor", ["step", "job_id", "path"]),
    "agent_restart": _k("supervisor", ["returncode"]),
    "failure": _k("supervisor", ["attempt", "cause", "returncode", "hung", "error", "step"],
                  ["made_a_step", "detail"]),
    "teardown_failure": _k("supervisor", ["attempt", "returncode"]),
    "preempted": _k("supervisor", ["step", "final_checkpoint", "newest_committed", "signal",
                                   "ranks_stopped"]),
    # persist agent (cfrun.agent)
    "agent_start": _k("agent", ["pid"]),
    "agent_refused": _k("agent", ["uid", "pid"]),
    "persist_refused": _k("agent", ["error"]),
    "persist_failed": _k("agent", ["step", "error"], ["rank"]),
    "step_superseded": _k("agent", ["step", "later_step"], ["rank", "missing_ranks", "node"]),
    "checkpoint_skipped": _k("agent", ["step", "need_bytes", "free_bytes"]),
    "checkpoint_pruned": _k("agent", ["step", "bytes", "need_bytes", "free_bytes"]),
    "disk_space_back": _k("agent", ["step", "skipped", "free_bytes"]),
    "persist_summary": _k("agent", ["failed", "skipped"], ["events_dropped"]),
    "commit": _k("agent", ["step", "bytes", "persist_s", "pgt_s", "tier"], ["nodes"]),
    "protected": _k("agent", ["step", "bytes", "tier"], ["persist_s", "pgt_s", "streams"]),
    "fetched": _k("agent", ["step", "source", "bytes"], ["fetch_s"]),
    "fetch_failed": _k("agent", ["step", "source", "error"]),
    "peer_unavailable": _k("agent", ["peer"], ["error"]),
    "peer_reconnected": _k("agent", ["peer"]),
    "durable": _k("agent", ["step", "tier"], ["url", "durable_s"]),
    "durable_unknown": _k("agent", ["step"], ["state", "error"]),
    # ranks (cfrun.rank)
    "checkpoint": _k("rank 0", ["attempt", "mode", "persist", "step", "bytes"],
                     _CKPT_FIGURES, open=True),
    "checkpoint_rank": _k("every rank (CFRUN_EVENTS_ALL_RANKS=1)", ["rank", "attempt", "step"],
                          _CKPT_FIGURES, open=True),
    "checkpoint_deferred": _k("rank 0", ["due_step", "in_flight_step"],
                              ["attempt", "waits_for"]),
    "checkpoint_failed": _k("a rank", ["step", "error"], ["rank"]),
    "final_checkpoint": _k("rank 0", ["step", "outcome"], ["attempt", "error"]),
    "persist_lost": _k("a rank", ["step", "error"], ["rank"]),
    "checkpoint_corrupt": _k("a rank", ["step", "error"]),
    "checkpoint_refused": _k("rank 0", ["steps", "count", "error"]),
    "resumed": _k("each rank", ["step", "attempt", "rank"],
                  ["variables", "process_start_unix_s", "agent_wait_s", "read_start_unix_s",
                   "read_s", "read_sync_s", "read_wait_s", "restore_s", "warm"]),
    "first_step": _k("rank 0", ["attempt", "step"]),
    "resharded": _k("rank 0", ["step", "attempt", "from_world_size", "to_world_size"], []),
    "not_exact": _k("a rank", ["reason"], ["step"]),
    "unprotected": _k("a rank", ["where", "error"], ["step", "rank", "attempt", "traceback"]),
    "profile": _k("rank 0", ["probes"], ["costs", "mode", "modes"], open=True),
    "decision": _k("rank 0", ["source", "interval", "mode"],
                   ["reason", "predicted_overhead", "predicted_recovery_s", "k_budget",
                    "k_in_flight", "k_daly", "fingerprint"]),
    "reprofile": _k("rank 0", ["reason"], ["cached_bytes", "state_bytes"]),
    "adapt": _k("rank 0", ["step", "interval", "reason"],
                ["window", "measured_overhead", "noise", "budget", "mean_iter_s", "clean_iter_s",
                 "baseline_iters", "iters", "checkpoints", "pgt_s", "k_in_flight",
                 "run_overhead", "old_interval"]),
}
"""Every event kind: name -> :class:`EventKind`. The list of events in docs/job-directory.md
names them all."""


def problems(kind: str, names: Iterable[str]) -> list[str]:
    """What is wrong with an event ``kind`` carrying fields ``names`` ([] when nothing)."""
    spec = EVENTS.get(kind)
    if spec is None:
        return [f"event kind {kind!r} is not declared in cfrun.contract.events.EVENTS"]
    names = set(names)
    out = []
    missing = sorted(spec.required - names)
    if missing:
        out.append(f"event {kind!r} lacks required fields {missing}")
    if not spec.open:
        unknown = sorted(names - spec.required - spec.optional - COMMON)
        if unknown:
            out.append(f"event {kind!r} has undeclared fields {unknown}")
    return out


def strict() -> bool:
    """True under test: ``CFRUN_FAULTS`` is set or pytest is running (then a schema error
    raises); False in production (it is logged once)."""
    return bool(os.environ.get(settings.FAULTS)) or "pytest" in sys.modules \
        or "PYTEST_CURRENT_TEST" in os.environ


_logged: set[str] = set()


def check(kind: str, names: Iterable[str]) -> None:
    """Check an event before it is written (:meth:`JobDir.emit_event` calls it).

    Raises:
        EventSchemaError: the event does not match :data:`EVENTS`, under test only; in
            production the problem is logged once per kind and the caller writes the event.
    """
    found = problems(kind, names)
    if not found:
        return
    if strict():
        raise EventSchemaError("; ".join(found))
    if kind not in _logged:
        _logged.add(kind)
        logger.warning("cfrun: bug: %s (written anyway)", "; ".join(found))


OVERHEAD_DEFINITION = ("checkpoint stall over the training wall time of the attempts so far "
                       "(a running attempt counted to now)")
"""cfrun's one definition of a job's overhead, as ``cfrun status``, the ``cfrun_overhead_ratio``
metric and the README say it (:func:`overhead_seconds`)."""


def _num(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def overhead_seconds(events: Iterable[dict[str, object]], *,
                     now_unix_s: float | None = None) -> tuple[float, float]:
    """``(stall_s, wall_s)`` of :data:`OVERHEAD_DEFINITION` from ``events.jsonl``'s events, in
    order: ``stall_s`` the sum of the ``checkpoint`` events' stalls (the time the training
    loop waited for its snapshot), ``wall_s`` the ``attempt_end`` durations plus, for an attempt
    that has no ``attempt_end`` (a running one, one ended by SIGTERM or a killed supervisor),
    its start to ``now_unix_s`` when given (the job runs), else to its newest event. The
    overhead is ``stall_s / wall_s`` (undefined while ``wall_s`` is 0). Used by ``cfrun
    status`` and :class:`cfrun.supervisor.metrics.JobMetrics`; never raises for odd events."""
    stall_s = wall_s = 0.0
    open_start: float | None = None
    last_t: float | None = None
    for e in events:
        kind, t = e.get("event"), _num(e.get("t_unix_s"))
        if kind == "checkpoint":
            stall_s += _num(e.get("stall_s")) or 0.0
        elif kind == "attempt_start":
            if open_start is not None and last_t is not None:  # never ended: to its last event
                wall_s += max(0.0, last_t - open_start)
            open_start = t
        elif kind == "attempt_end":
            wall_s += _num(e.get("duration_s")) or 0.0
            open_start = None
        if t is not None:
            last_t = t
    if open_start is not None:
        end = now_unix_s if now_unix_s is not None else last_t
        wall_s += max(0.0, (end or open_start) - open_start)
    return stall_s, wall_s
