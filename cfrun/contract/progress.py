"""Where a job stands in its run: the step it ends at, its step rate and the time left.

Read by ``cfrun status`` (the table, ``--watch``, the list of jobs) and by the supervisor's
progress line, from what the job dir holds: ``--total-steps`` in ``config.json``, the newest
checkpoint's ``progress`` (an epoch loop over a sized loader, :mod:`cfrun.rank.boundary`), the
``state``/``checkpoint`` events and a heartbeat's step and time. Pure functions over those
records: no file is read here, no clock but the ones passed in.

The total is the optimizer step the run ends at: ``--total-steps N`` where the user gave it,
else the newest checkpoint's ``progress``: the epoch loop's batches in all times the job's
optimizer steps per batch (gradient accumulation counted), as measured at that checkpoint, or
a step loop's own bound (one batch per step: :mod:`cfrun.rank.loop_total`). The step rate
is the running attempt's, measured from its first checkpoint (or its start when it has none
yet: start-up then counts as training time) to the newest heartbeat, so a job that has
trained a while reads its steady rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def total_steps(config_total: Any, events: Sequence[dict[str, Any]]) -> int | None:
    """The step the run ends at, or None where nothing says: ``config_total``
    (``--total-steps``, from ``config.json``) when it is a positive int, else the newest
    ``checkpoint`` event's ``progress`` (``done_batches`` of ``total_batches`` at its
    ``step``) scaled to optimizer steps. Never raises for odd records."""
    if isinstance(config_total, int) and not isinstance(config_total, bool) and config_total > 0:
        return config_total
    p = newest_progress(events)
    if p is None:
        return None
    return round(p["total_batches"] * p["step"] / p["done_batches"])


def newest_progress(events: Sequence[dict[str, Any]]) -> dict[str, int] | None:
    """``{step, done_batches, total_batches}`` of the newest ``checkpoint`` event that has a
    usable ``progress`` (positive ints, done within total); None without one."""
    for e in reversed(events):
        if e.get("event") != "checkpoint" or not isinstance(e.get("progress"), dict):
            continue
        p, step = e["progress"], e.get("step")
        done, total = p.get("done_batches"), p.get("total_batches")
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (step, done, total)) and done <= total:
            return {"step": step, "done_batches": done, "total_batches": total}
    return None


def steps_per_s(events: Sequence[dict[str, Any]], step: int | None,
                step_unix_s: float | None) -> float | None:
    """The running attempt's step rate (steps per second): from its first ``checkpoint``
    event (the attempt's newest ``running`` state event and its ``resume_step`` when it has
    none yet) to ``step``, reached at ``step_unix_s`` (a heartbeat's mtime). None where the
    attempt made no step since, or the records do not say."""
    if step is None or step_unix_s is None:
        return None
    start = None
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        if e.get("event") == "state" and e.get("state") == "running" \
                and e.get("node", 0) == 0:
            start = i
            break
    if start is None:
        return None
    run = events[start]
    base_step, base_t = run.get("resume_step") or 0, run.get("t_unix_s")
    attempt = run.get("attempt")
    for e in events[start + 1:]:
        if e.get("event") == "checkpoint" and e.get("attempt") == attempt \
                and isinstance(e.get("step"), int) and e["step"] < step:
            base_step, base_t = e["step"], e.get("t_unix_s")
            break
    if not isinstance(base_t, (int, float)) or not isinstance(base_step, int) \
            or step <= base_step or step_unix_s <= base_t:
        return None
    return (step - base_step) / (step_unix_s - base_t)


def eta_s(step: int | None, total: int | None, rate_steps_per_s: float | None) -> float | None:
    """Seconds until ``step`` reaches ``total`` at ``rate_steps_per_s``; 0 at or past the
    total; None where one of them is unknown or the rate is not positive."""
    if step is None or total is None or rate_steps_per_s is None or rate_steps_per_s <= 0:
        return None
    return max(total - step, 0) / rate_steps_per_s


def fmt_duration(seconds: float) -> str:
    """``1h02m``, ``4m05s``, ``12s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def step_text(step: int | None, total: int | None, *, none: str = "none yet") -> str:
    """``91 of 200``, ``91`` (no total known) or ``none``."""
    if step is None:
        return none
    return f"{step} of {total}" if total is not None else str(step)


def rate_text(rate_steps_per_s: float | None, eta: float | None) -> str | None:
    """``2.10 steps/s, ETA 52s``, ``2.10 steps/s`` or None (no rate)."""
    if rate_steps_per_s is None:
        return None
    text = f"{rate_steps_per_s:.2f} steps/s"
    return text + (f", ETA {fmt_duration(eta)}" if eta is not None else "")
