"""``cfrun ls JOB_DIR``: a job's committed checkpoints, each with its step, epoch, size, age
and verification state (or one line per job of a directory of job dirs). Reads only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from cfrun.cli.status import or_unknown

HELP = ("Committed checkpoints: step, epoch, size, age and verification state. With "
        "a directory of job dirs, one line per job.")
"""``cfrun ls --help``'s text."""


def ls_cmd(
    job_dir: Annotated[str, typer.Argument(
        metavar="JOB_DIR", help="The job dir, or a directory of job dirs (./cfrun-jobs): one "
                                "line per job, as cfrun status lists them.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    check: Annotated[bool, typer.Option("--verify/--no-verify",
                                        help="Check every file's checksum.")] = True,
) -> None:
    """Committed checkpoints: step, epoch, size, age and verification state."""
    from rich.console import Console
    from rich.table import Table

    from cfrun.cli import inspect as report
    from cfrun.cli.jobs import jobs_in, print_jobs

    several = jobs_in(Path(job_dir).expanduser())
    if several is not None:
        print_jobs(several, as_json=as_json)
        return
    rows = report.checkpoints(report.open_job_dir(job_dir), check=check)
    if as_json:
        print(json.dumps(rows, indent=1))
        report.check_listing(rows)
        return
    table = Table("step", "epoch", "batches", "size", "age", "verified")
    for r in rows:
        size = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f} MB"
        age = "-" if r["age_s"] is None else f"{r['age_s']:.0f} s"
        step = f"{r['step']} (final)" if r.get("final") else str(r["step"])
        # a final checkpoint holds no data position: "-", never "None" (issue 37, item 7)
        table.add_row(step, or_unknown(r["epoch"], "-"), or_unknown(r["batches"], "-"), size,
                      age, r["verified"])
    Console().print(table)
    report.check_listing(rows)
