"""The supervisor's progress line on a terminal: step, steps/s, newest checkpoint, overhead.

Every ``progress_s`` (``CFRUN_PROGRESS_S``; only when cfrun's stderr is a terminal) one whole
line, written with one ``write`` so that it never cuts into a line of the script's own output.
"""

from __future__ import annotations

import os
import sys
import time

from cfrun.contract import coordination as co
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
        self._progress_step = (0.0, 0)

    def progress(self, started_unix_s: float) -> None:
        """Every ``progress_s``, one whole line on cfrun's stderr (a terminal only): step,
        steps/s, newest checkpoint, overhead against the budget. Each line goes out in one
        ``write``, so it never cuts into a line of the script's own output (a script line
        written in two parts, as ``print`` under ``python -u`` does, can still have a progress
        line land between them)."""
        now = time.monotonic()
        if not self.progress_s or now - self._progress_at < self.progress_s:
            return
        self._progress_at = now
        step = co.newest_heartbeat_step(self.jobdir.root)
        if step is None:  # no beat yet, or one being rewritten: keep the previous sample
            return
        if self._progress_step[0] == 0.0:  # the first sample: a rate needs two
            self._progress_step = (now, step)
            return
        t0, s0 = self._progress_step
        rate = (step - s0) / max(now - t0, 1e-9)
        self._progress_step = (now, step)
        steps = committed_steps(self.jobdir.checkpoints)
        line = (f"cfrun: step {step} ({rate:.2f} steps/s), newest checkpoint step "
                f"{steps[0] if steps else 'none'}, {self.overhead_text(started_unix_s)}\n")
        try:
            os.write(sys.stderr.fileno(), line.encode())
        except (OSError, ValueError):
            pass

    def overhead_text(self, started_unix_s: float) -> str:
        """``overhead S% stalled (budget B%)``: the job's overhead as ``cfrun status`` shows it
        (:func:`cfrun.contract.events.overhead_seconds`, to now), and the step slowdown the
        policy measured in its latest window (``adapt`` events of this attempt, since
        ``started_unix_s``) when there is one."""
        events = self.jobdir.read_events()
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
