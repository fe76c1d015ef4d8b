"""``cfrun status [JOB_DIR|SCRIPT]``: the state of a job as a table (or JSON, Prometheus
metrics, a plot, a live view), or one line per job of a directory of job dirs. What the
state is comes from :func:`cfrun.cli.inspect.status`; this module words it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

HELP = ("State of a job: steps, checkpoints, interval, overhead, stall and PGT, "
        "restarts, and the command that resumes a stopped one. Without a job dir, or "
        "with a directory of job dirs, one line per job.")
"""``cfrun status --help``'s text."""


def status_cmd(
    job_dir: Annotated[str | None, typer.Argument(
        metavar="[JOB_DIR|SCRIPT]",
        help="A job dir; a directory of job dirs (default ./cfrun-jobs: one line per job); or "
             "a script, whose job dir in ./cfrun-jobs is shown.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    plot: Annotated[str | None, typer.Option(
        "--plot", metavar="PNG",
        help="Write a PNG: the attempts on a timeline (start-up, restarts, training, commits, "
             "failures, ETTR), and checkpoint stall and PGT by step.")] = None,
    metrics: Annotated[bool, typer.Option(
        "--metrics", help="Print the job's Prometheus metrics (text format) instead.")] = False,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Refresh every 2 s until the job stops (a live table on a terminal, a "
                        "line per refresh elsewhere); Ctrl-C leaves.")] = False,
) -> None:
    """State of a job: steps, checkpoints, interval, overhead, stall and PGT, restarts."""
    from rich.console import Console

    from cfrun.cli import inspect as report

    found = report.find_jobs(job_dir, Path.cwd())
    if isinstance(found, list):
        from cfrun.cli.jobs import print_jobs

        print_jobs(found, as_json=as_json)
        return
    jd = found
    if metrics:
        from cfrun.supervisor.metrics import JobMetrics

        # a link, FIFO or device is refused in one line, not followed or waited on
        report.check_regular(jd.config_path, report.MAX_CONFIG_BYTES)
        report.check_regular(jd.events_path, sys.maxsize)  # read in parts
        sys.stdout.write(JobMetrics(jd.root).exposition().decode())
        return
    st = report.status(jd)
    if plot:
        _plot(jd, Path(plot))
        if not as_json:  # where it went, as export says (issue 37, item 7)
            print(f"cfrun: wrote the plot of {jd.root} to {Path(plot).absolute()}",
                  file=sys.stderr)
    if as_json:
        print(json.dumps(st, indent=1))
        return
    if watch:
        _watch(jd, report.status, every_s=2.0)
        return
    Console().print(_status_table(st))


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def or_unknown(value: Any, unknown: str) -> str:
    """``value`` as text, or what its absence means (``cfrun status`` never prints None)."""
    return unknown if value is None else str(value)


def _status_rows(st: dict[str, Any], rate: str | None = None) -> list[tuple[str, str]]:
    """The rows of ``cfrun status``'s table (never "None": :func:`or_unknown`); ``rate``: the
    steps/s row of ``--watch``."""
    rows = [
        ("state", st["state"]),
        ("script", str(st["script"] or "unknown (no config.json)")
         + (f" (-m {st['module']})" if st.get("module") else "")),
        ("current step", _step_text(st) + (f" ({rate})" if rate else "")),
        ("last committed step", or_unknown(st["last_committed_step"], "none yet")),
        # the job's overhead first, then the interval and the last window's reason for it
        # (its "over budget 8.21%" above "0.258% stalled" read as a contradiction: issue 37)
        ("overhead", _overhead_text(st["overhead"])),
        ("interval", f"{st['interval']['steps']} steps ({st['interval']['why']})"
         if st["interval"]["steps"] is not None
         else f"not decided yet ({st['interval']['why']})"),
        ("stall per checkpoint", f"median {_fmt_s(st['stall_s']['median'])}, p95 "
                                 f"{_fmt_s(st['stall_s']['p95'])}, "
                                 f"max {_fmt_s(st['stall_s']['max'])}"),
        ("PGT", f"median {_fmt_s(st['pgt_s']['median'])}, p95 {_fmt_s(st['pgt_s']['p95'])}"),
        ("checkpoints taken", f"{st['checkpoints_taken']}, {st['checkpoints_failed']} failed, "
                              f"{st['checkpoints_skipped']} skipped (no space)"),
        ("attempts", str(st["attempts"])),
        ("restarts", "; ".join(f"attempt {r['attempt']}: {r['cause']} {r['where']}"
                               for r in st["restarts"]) or "none"),
        ("last resume", _resume_text(st.get("last_resume"))),
        ("goodput", _goodput_text(st.get("goodput"))),
        ("disk", f"{st['disk_bytes'] / 1e6:.1f} MB in checkpoints/"),
        ("GPUs", gpu_text(st["gpus"]) or "none seen (no NVML or no GPU on this machine)"),
    ]
    if st.get("resharded"):  # --reshard: the run since is not bit-exact (issue 25, item 4)
        rows.append(("resharded", "; ".join(
            f"step {r['step']}: {r['from_world_size']} -> {r['to_world_size']} ranks "
            f"(attempt {r['attempt']}; not bit-exact)" for r in st["resharded"])))
    if st.get("resume_command"):
        rows.insert(1, ("resume with", st["resume_command"]))
    if st["error"]:
        rows.insert(1, ("error", st["error"]))
    if st["unprotected"]:
        rows.insert(1, ("UNPROTECTED", "; ".join(
            f"attempt {u['attempt']}: {u['error']} ({u['where']}, step {u['step']})"
            for u in st["unprotected"])))
    return rows


def _step_text(st: dict[str, Any]) -> str:
    """``91 of 200``: the newest step and the run's total where known
    (:mod:`cfrun.contract.progress`), with the step rate and the time left of a running job
    (the one-shot table: the attempt's rate since its first checkpoint)."""
    from cfrun.contract import progress

    if st["current_step"] is None:
        return "no step seen yet"
    text = progress.step_text(st["current_step"], st.get("total_steps"))
    if st.get("total_steps") is None and st.get("is_running"):
        text += " (total not known: --total-steps N gives one)"
    rate = progress.rate_text(st.get("steps_per_s"), st.get("eta_s"))
    return text + (f", {rate}" if rate else "")


def _overhead_text(overhead: dict[str, Any]) -> str:
    """``0.95% stalled (budget 3.5%)``: the job's overhead, the one figure of
    :data:`cfrun.contract.events.OVERHEAD_DEFINITION`, in the table and ``--watch``."""
    pct = overhead["stall_pct"]
    return (f"{pct}% stalled" if pct is not None else "not measured yet (no attempt started)") \
        + f" (budget {overhead['budget_pct']}%)"


def _goodput_text(g: dict[str, Any] | None) -> str:
    """``cfrun status``'s goodput row: the ETTR and the time lost per cause."""
    if not g or g.get("ettr") is None:
        return "no attempt yet"
    def dur(s: float) -> str:
        return f"{s:.1f} s" if s >= 1 else f"{s * 1000:.0f} ms"

    lost = ", ".join(f"{cause} {dur(s)}" for cause, s in g["lost_s"].items() if s)
    steps = f" ({g['recomputed_steps']} steps recomputed)" if g.get("recomputed_steps") else ""
    return (f"ETTR {100 * g['ettr']:.1f}% of {dur(g['wall_s'])}: lost "
            f"{lost or 'nothing measurable'}{steps}")


def _resume_text(r: dict[str, Any] | None) -> str:
    """``attempt 1 at step 100: 3.21 s (backoff 0.00 s, launch 0.9 s, ...)`` or ``none``."""
    if not r:
        return "none"
    parts = ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {r[name]:.2f} s"
                      for name in r if name.endswith("_s") and name != "total_s"
                      and r[name] is not None)
    where = f"attempt {r['attempt']} at step {r['step']}"
    if r.get("total_s") is None:  # the previous attempt's end is not recorded (issue 37, 7)
        return f"{where}: {parts or 'no part measured'} (total not known: the attempt " \
               "before it has no recorded end)"
    return f"{where}: {r['total_s']:.2f} s ({parts})"


def gpu_text(gpus: list[dict[str, Any]]) -> str:
    """``GPU 0 H100: 40.1/80.0 GB, 97% busy; ...`` (NVML samples, :mod:`cfrun.contract.gpus`)."""
    return "; ".join(f"GPU {g['index']} {g['name']}: {g['memory_used_bytes'] / 1e9:.1f}/"
                     f"{g['memory_total_bytes'] / 1e9:.1f} GB, {g['utilization_pct']}% busy"
                     for g in gpus)


def _status_table(st: dict[str, Any], rate: str | None = None) -> Any:
    from rich.table import Table

    table = Table(title=f"cfrun job {st['job_dir']}", show_header=False)
    for k, v in _status_rows(st, rate):
        table.add_row(k, v)
    return table


def _watch(jd: Any, status: Any, *, every_s: float) -> None:
    """``cfrun status --watch``: refresh every ``every_s`` until the job stops running (then
    the final state) or Ctrl-C. On a terminal a live rich table; elsewhere one line per
    refresh (step, steps/s, newest checkpoint, overhead), for logs."""
    import time

    from rich.console import Console
    from rich.live import Live

    from cfrun.contract import progress

    console = Console()
    last: tuple[float, int] | None = None

    def snapshot() -> tuple[dict[str, Any], str | None]:
        nonlocal last
        st = status(jd)
        now, step = time.monotonic(), st["current_step"]
        rate = None
        if step is not None and last is not None and now > last[0]:
            per_s = (step - last[1]) / (now - last[0])
            rate = progress.rate_text(per_s, progress.eta_s(step, st.get("total_steps"), per_s))
            st = {**st, "steps_per_s": None, "eta_s": None}  # the row shows this rate
        if step is not None:
            last = (now, step)
        return st, rate

    try:
        if console.is_terminal:
            st, rate = snapshot()
            with Live(_status_table(st, rate), console=console, auto_refresh=False) as live:
                while st["is_running"]:
                    time.sleep(every_s)
                    st, rate = snapshot()
                    live.update(_status_table(st, rate), refresh=True)
            return
        while True:
            st, rate = snapshot()
            print(f"cfrun status: {st['state']}, step "
                  f"{progress.step_text(st['current_step'], st.get('total_steps'))}"
                  f"{f' ({rate})' if rate else ''}, newest checkpoint "
                  f"{or_unknown(st['last_committed_step'], 'none yet')}, overhead "
                  f"{_overhead_text(st['overhead'])}, restarts {len(st['restarts'])}",
                  flush=True)
            if not st["is_running"]:
                return
            time.sleep(every_s)
    except KeyboardInterrupt:
        return


def _plot(jd: Any, out: Path) -> None:
    from cfrun.cli.inspect import read_events
    from cfrun.cli.timeline import plot

    plot(read_events(jd), jd.root.name, out)
