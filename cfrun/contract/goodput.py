"""Goodput: a job's wall time split into productive training and what was lost, per cause
(issue 35; ByteRobust's "effective training time ratio", ETTR).

Read from ``events.jsonl`` alone (torch-free; ``cfrun status``, its ``--json`` and the
Prometheus metrics call :func:`goodput`). The job's wall time is, per run of the supervisor,
from its ``state: running`` event (not one after ``restarting``) to its last attempt's end
(to ``now`` while it runs). It is split into:

* ``startup_s``: a run's first attempt that did not resume, from the run's start to the
  attempt's first optimizer step (``first_step``, rank 0): the launcher, the interpreter and
  torch, the script's own start-up. A plain ``torchrun`` pays it too.
* ``restart_s``: an attempt that resumed or followed another in the same run, from the previous
  attempt's end (or the run's start) to its first optimizer step: noticing the failure, the
  back-off, the launch, the import, the read and the restore, the script's start-up.
* ``recompute_s``: the steps a resumed attempt did again (the failed attempt's step less the
  resumed step, from the supervisor's ``failure`` event) times the median step time between
  two checkpoints of one attempt.
* ``stall_s``: the checkpoints' stalls (``checkpoint`` events: the time the loop waited).
* ``profiling_s``: the policy's profile's excess over clean iterations (``profile`` events).
* ``productive_s``: the rest. ``ettr`` = productive / wall.

The parts add up to the wall time by construction; what makes them right is that each is
measured from its own events (``tests/integration/test_goodput.py`` checks them against a job
whose kills it chose).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

CAUSES = ("startup", "restart", "recompute", "stall", "profiling")
"""The causes of lost time, in the order ``cfrun status`` lists them."""


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _scan(events: Iterable[dict[str, Any]]) -> tuple[
        list[dict[str, Any]], dict[int, dict[str, Any]], list[tuple[int, int, float]], float,
        float, float | None]:
    """One pass over the events: the supervisor's runs (their start, their attempts), each
    attempt's start, end, first step, resumed step and failed step, the checkpoints' (attempt,
    step, time), the stalls' and the profile's sums, and the newest event's time."""
    runs: list[dict[str, Any]] = []
    attempts: dict[int, dict[str, Any]] = {}
    stall_s = profiling_s = 0.0
    ckpts: list[tuple[int, int, float]] = []  # (attempt, step, t)
    last_t: float | None = None
    current: dict[str, Any] | None = None
    last_state: object = None
    for e in events:
        kind, t = e.get("event"), _num(e.get("t_unix_s"))
        if t is not None:
            last_t = t
        att = e.get("attempt")
        if kind == "state":
            if e.get("state") == "running" and t is not None and last_state not in (
                    "restarting", "running"):  # a new run of the supervisor (a restart is not)
                current = {"start": t, "attempts": []}
                runs.append(current)
            last_state = e.get("state")
        elif kind == "attempt_start" and isinstance(att, int) and t is not None:
            if current is None:
                current = {"start": t, "attempts": []}
                runs.append(current)
            attempts[att] = {"start": t, "end": None, "first_step_t": None, "resumed": None,
                             "fail_step": None}
            current["attempts"].append(att)
        elif kind == "attempt_end" and isinstance(att, int) and att in attempts:
            attempts[att]["end"] = t
        elif kind == "first_step" and isinstance(att, int) and att in attempts:
            if attempts[att]["first_step_t"] is None:
                attempts[att]["first_step_t"] = t
        elif kind == "resumed" and e.get("rank", 0) == 0 and isinstance(att, int) \
                and att in attempts:
            attempts[att]["resumed"] = e.get("step")
        elif kind == "failure" and isinstance(att, int) and att in attempts:
            attempts[att]["fail_step"] = e.get("step")
        elif kind == "checkpoint":
            stall_s += _num(e.get("stall_s")) or 0.0
            if isinstance(att, int) and isinstance(e.get("step"), int) and t is not None:
                ckpts.append((att, e["step"], t))
        elif kind == "profile":
            profiling_s += max(0.0, _num(e.get("excess_s")) or 0.0)
    return runs, attempts, ckpts, stall_s, profiling_s, last_t


def goodput(events: Iterable[dict[str, Any]], *, now_unix_s: float | None = None
            ) -> dict[str, Any] | None:
    """``{wall_s, productive_s, ettr, lost_s: {cause: seconds}, recomputed_steps, step_s,
    restarts}`` from the job's events in order, or None before any attempt started.
    ``now_unix_s``: the end of an attempt still running (else its newest event). Never raises
    for odd events (a missing field leaves its part at 0)."""
    runs, attempts, ckpts, stall_s, profiling_s, last_t = _scan(events)
    if not attempts:
        return None
    per_step = [(t2 - t1) / (s2 - s1) for (a1, s1, t1), (a2, s2, t2) in zip(ckpts, ckpts[1:])
                if a1 == a2 and s2 > s1 and t2 >= t1]
    step_s = statistics.median(per_step) if per_step else None
    wall_s = startup_s = restart_s = recompute_s = 0.0
    recomputed = restarts = 0
    for run in runs:
        if not run["attempts"]:
            continue
        last = attempts[run["attempts"][-1]]
        end = last["end"] if last["end"] is not None else (
            now_unix_s if now_unix_s is not None else last_t)
        wall_s += max(0.0, (end or run["start"]) - run["start"])
        prev_end, prev_fail = run["start"], None
        for i, n in enumerate(run["attempts"]):
            a = attempts[n]
            first = a["first_step_t"]
            if first is not None:
                lost = max(0.0, first - prev_end)
                if i == 0 and a["resumed"] is None:
                    startup_s += lost
                else:
                    restart_s += lost
                    restarts += 1
            if i > 0 and isinstance(a["resumed"], int) and isinstance(prev_fail, int):
                steps = max(0, prev_fail - a["resumed"])
                recomputed += steps
                recompute_s += steps * (step_s or 0.0)
            prev_end = a["end"] if a["end"] is not None else prev_end
            prev_fail = a["fail_step"]
    lost_s = {"startup": startup_s, "restart": restart_s, "recompute": recompute_s,
              "stall": stall_s, "profiling": profiling_s}
    productive_s = max(0.0, wall_s - sum(lost_s.values()))
    return {"wall_s": round(wall_s, 3), "productive_s": round(productive_s, 3),
            "ettr": round(productive_s / wall_s, 4) if wall_s > 0 else None,
            "lost_s": {k: round(v, 3) for k, v in lost_s.items()},
            "recomputed_steps": recomputed, "step_s": round(step_s, 6) if step_s else None,
            "restarts": restarts}


def timeline(events: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The job's timeline for ``cfrun status --plot`` (seconds from the first run's start):
    ``spans``, one per attempt phase, ``{"attempt", "kind", "t0_s", "t1_s"}`` with ``kind``
    ``startup`` or ``restart`` (the attempt's start-up, as :func:`goodput` counts it: from the
    run's start or the previous attempt's end to the first optimizer step) and ``training``
    (from that step to the attempt's end); ``commits``, ``[(t_s, step)]``; ``failures``,
    ``[(t_s, attempt, cause)]``. None before any attempt started. The start-up and restart
    spans add up to :func:`goodput`'s ``startup_s`` and ``restart_s``."""
    events = list(events)
    t_first = next((_num(e.get("t_unix_s")) for e in events
                    if e.get("event") in ("state", "attempt_start")
                    and _num(e.get("t_unix_s")) is not None), None)
    if t_first is None or not any(e.get("event") == "attempt_start" for e in events):
        return None
    spans: list[dict[str, Any]] = []
    commits: list[tuple[float, int]] = []
    failures: list[tuple[float, Any, Any]] = []
    prev_end: float | None = None
    last_state: object = None
    first_of_run = True
    open_span: dict[str, Any] | None = None
    for e in events:
        kind, t = e.get("event"), _num(e.get("t_unix_s"))
        if t is None:
            continue
        rel = t - t_first
        att = e.get("attempt")
        if kind == "state":
            if e.get("state") == "running" and last_state not in ("restarting", "running"):
                prev_end, first_of_run = rel, True
            last_state = e.get("state")
        elif kind == "attempt_start" and isinstance(att, int):
            if prev_end is None:
                prev_end = rel
            open_span = {"attempt": att, "kind": "startup" if first_of_run else "restart",
                         "t0_s": prev_end, "t1_s": None}
        elif kind == "resumed" and e.get("rank", 0) == 0 and open_span is not None:
            open_span["kind"] = "restart"
        elif kind == "first_step" and open_span is not None and att == open_span["attempt"] \
                and open_span["t1_s"] is None:
            open_span["t1_s"] = rel
            spans.append(open_span)
            spans.append({"attempt": att, "kind": "training", "t0_s": rel, "t1_s": None})
        elif kind == "attempt_end" and isinstance(att, int):
            if spans and spans[-1]["attempt"] == att and spans[-1]["t1_s"] is None:
                spans[-1]["t1_s"] = rel
            prev_end, first_of_run, open_span = rel, False, None
        elif kind == "commit" and isinstance(e.get("step"), int):
            commits.append((rel, e["step"]))
        elif kind == "failure":
            failures.append((rel, att, e.get("cause")))
    end = max(_num(e.get("t_unix_s")) or t_first for e in events) - t_first
    for s in spans:
        if s["t1_s"] is None:
            s["t1_s"] = end
    return {"spans": spans, "commits": commits, "failures": failures, "end_s": end}
