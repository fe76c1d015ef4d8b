"""The supervisor's progress line on a terminal: step, steps/s, newest checkpoint, overhead.

Every ``progress_s`` (``CFRUN_PROGRESS_S``; only when cfrun's stderr is a terminal) one whole
line, written with one ``write`` so that it never cuts into a line of the script's own output.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from cfrun.contract import coordination as co
from cfrun.contract import progress
from cfrun.contract.checkpoints import committed_steps
from cfrun.contract.config import RunConfig
from cfrun.contract.events import overhead_seconds
from cfrun.contract.jobdir import JobDir


class ProgressLine:
    """The progress line of one supervisor (its main thread calls :meth:`progress` every 0.1 s).

    Args:
        cfg: the job's settings (``overhead``, ``interval``).
        jobdir: the job dir (heartbeats, checkpoints, events).
        progress_s: seconds between lines (0: none).
    """

    def __init__(self, cfg: RunConfig, jobdir: JobDir, progress_s: float) -> None:
        self.cfg = cfg
        self.jobdir = jobdir
        self.progress_s = progress_s
        self._progress_at = 0.0
        """When the previous progress line was due (monotonic s; the attempt's start first)."""
        self._attempt_started_at = 0.0
        """The running attempt's start (monotonic s)."""
        self._progress_step: tuple[float, int] | None = None
        """``(monotonic s, step)`` the next progress line's rate is measured from."""

    def start(self, t0: float) -> None:
        """An attempt started at ``t0`` (monotonic s): its first line ``progress_s`` later, its
        rate from its first step on."""
        self._progress_at = self._attempt_started_at = t0
        self._progress_step = None

    def progress(self, started_unix_s: float) -> None:
        """One whole line on cfrun's stderr (a terminal only) ``progress_s`` after the
        attempt's start and every ``progress_s`` after it (issue 37, item 4: the first came
        after twice that): the step of the run's total, the steps/s since the previous line
        (the first: since the attempt's first step) and the time left where the total is
        known (:mod:`cfrun.contract.progress`), the newest checkpoint, the overhead against the
        budget; before the first step, that there is none yet. Each line goes out in one
        ``write``, so it never cuts into a line of the script's own output (a script line
        written in two parts, as ``print`` under ``python -u`` does, can still have a progress
        line land between them)."""
        if not self.progress_s:
            return
        now = time.monotonic()
        if self._progress_step is None:  # the rate's start: the attempt's first step
            first = co.newest_heartbeat_step(self.jobdir.root)
            if first is not None:
                self._progress_step = (now, first)
        if now - self._progress_at < self.progress_s:
            return
        self._progress_at = now
        step = co.newest_heartbeat_step(self.jobdir.root)
        if step is None:
            line = (f"cfrun: no optimizer step yet, {now - self._attempt_started_at:.0f} s "
                    "after the attempt's start\n")
        else:
            events = self.jobdir.read_events()
            total = progress.total_steps(self.cfg.total_steps, events)
            rate = None
            if self._progress_step is not None and now > self._progress_step[0]:
                rate = (step - self._progress_step[1]) / (now - self._progress_step[0])
            self._progress_step = (now, step)
            said = progress.rate_text(rate, progress.eta_s(step, total, rate)) \
                or "rate not measured yet"
            steps = committed_steps(self.jobdir.checkpoints)
            line = (f"cfrun: step {progress.step_text(step, total)}"
                    f"{f' ({said})' if said else ''}, newest checkpoint step "
                    f"{steps[0] if steps else 'none'}, "
                    f"{self.overhead_text(started_unix_s, events)}\n")
        try:
            os.write(sys.stderr.fileno(), line.encode())
        except (OSError, ValueError):
            pass

    def overhead_text(self, started_unix_s: float,
                      events: list[dict[str, Any]] | None = None) -> str:
        """``overhead S% stalled (budget B%)``: the job's overhead as ``cfrun status`` shows it
        (:func:`cfrun.contract.events.overhead_seconds`, to now), and the step slowdown the
        policy measured in its latest window (``adapt`` events of this attempt, since
        ``started_unix_s``) when there is one. ``events``: the job's, read here when None."""
        events = self.jobdir.read_events() if events is None else events
        stall_s, wall_s = overhead_seconds(events, now_unix_s=time.time())
        measured = None
        for e in events:
            if e.get("event") == "adapt" and e.get("t_unix_s", 0) >= started_unix_s \
                    and e.get("measured_overhead") is not None:
                measured = float(e["measured_overhead"])
        text = f"overhead {100 * stall_s / max(wall_s, 1e-9):.2f}% stalled"
        if measured is not None:
            text += f", last policy window {100 * measured:.2f}%"
        if self.cfg.interval is not None:
            return text + f" (budget {100 * self.cfg.overhead:.2f}%, not applied: --interval)"
        return text + f" (budget {100 * self.cfg.overhead:.2f}%)"
