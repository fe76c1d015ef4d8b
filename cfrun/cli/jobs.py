"""``cfrun status DIR`` and ``cfrun ls DIR`` of a directory of job dirs (``./cfrun-jobs``): one
line per job that tells it apart from the others (issue 37, item 4)::

    cfrun-jobs/train-1a2b3c4d  running    step 91 of 200 (2.10 steps/s, ETA 52s)  newest ...
    cfrun-jobs/train-5e6f7a8b  succeeded  step 200 of 200                         newest ...

(each line goes on with ``newest checkpoint 80   train.py --lr 0.1``)

The job dir (relative to the working directory where it lies under it), the state
(:func:`cfrun.cli.inspect.summary`), the step of the run's total with the step rate and the
time left while it runs (:mod:`cfrun.contract.progress`: ``--total-steps`` or the epoch loop's
length), the newest committed checkpoint, and the script with its arguments. ``--json``: the
:func:`~cfrun.cli.inspect.summary` of each job. Reads only, as every view of a job dir does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cfrun.contract import progress
from cfrun.contract.jobdir import JobDir


def jobs_in(path: Path) -> list[JobDir] | None:
    """The job dirs directly inside ``path`` when ``path`` is a directory of job dirs (no
    ``config.json`` of its own, at least one job dir inside), else None."""
    from cfrun.cli import inspect as report

    if not path.is_dir() or JobDir(path).config_path.is_file():
        return None
    return report.jobs_under(path) or None


def job_line_fields(row: dict[str, Any], cwd: Path) -> list[str]:
    """The columns of one job's line (see the module docstring) from its
    :func:`cfrun.cli.inspect.summary`."""
    path = Path(row["job_dir"])
    shown = str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)
    step = "step " + progress.step_text(row.get("current_step"), row.get("total_steps"))
    rate = progress.rate_text(row.get("steps_per_s"), row.get("eta_s"))
    if rate:
        step += f" ({rate})"
    newest = row.get("last_committed_step")
    checkpoint = f"newest checkpoint {'none yet' if newest is None else newest}"
    return [shown, str(row["state"]), step, checkpoint, str(row.get("command") or "?")]


def job_lines(rows: list[dict[str, Any]], cwd: Path) -> list[str]:
    """One line per job, its columns aligned (the last, the command, left as it is)."""
    table = [job_line_fields(r, cwd) for r in rows]
    if not table:
        return []
    widths = [max(len(t[i]) for t in table) for i in range(len(table[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(t, widths)), t[-1]]).rstrip()
            for t in table]


def print_jobs(jds: list[JobDir], *, as_json: bool) -> None:
    """Print the list of jobs (``--json``: a JSON list of their summaries)."""
    from cfrun.cli import inspect as report

    rows = [report.summary(j) for j in jds]
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    for line in job_lines(rows, Path.cwd()):
        print(line)
