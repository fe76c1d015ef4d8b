"""``cfrun profile SCRIPT [ARGS]...``: run the script until rank 0 has measured the checkpoint
costs and chosen the snapshot mode and the interval, then stop and print what it measured.
The job dir keeps the profile (a later run of the same command reuses it), not the
profiling checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cfrun.cli.argv import python_launcher_line
from cfrun.cli.launch import one_node_launch
from cfrun.cli.options import (
    LauncherOption,
    LocalAddrOption,
    MasterAddrOption,
    MasterPortOption,
    ModuleOption,
    NprocPerNodeOption,
    RdzvBackendOption,
    RdzvConfOption,
    ScriptArgsArgument,
    ScriptArgument,
    StandaloneOption,
)
from cfrun.cli.runconfig import build_config
from cfrun.cli.status import gpu_text
from cfrun.contract import coordination
from cfrun.contract import settings as E
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import BadInputError, JobFailedError

if TYPE_CHECKING:
    from cfrun.contract.jobdir import JobDir

HELP = ("Profile SCRIPT: measure checkpoint costs, choose the snapshot mode and the "
        "interval, then stop.")
"""``cfrun profile --help``'s text."""


def _plan_record(strategy: Path) -> dict[str, Any]:
    """The plan in ``strategy.json`` (:meth:`cfrun.rank.tuner.Tuner.plan`), {} when there is
    none or it does not read as one."""
    try:
        record = json.loads(strategy.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _plan_phase(strategy: Path) -> str | None:
    """The phase of the plan in ``strategy.json`` (``profiling`` until rank 0 decides, then
    ``tuned``), or None when there is none."""
    record = _plan_record(strategy)
    return str(record.get("phase", "tuned")) if record else None


def profile_cmd(
    ctx: typer.Context,
    script: ScriptArgument,
    script_args: ScriptArgsArgument = None,
    module: ModuleOption = False,
    job_dir: Annotated[str | None, typer.Option(
        "--job-dir", metavar="PATH", envvar=E.JOB_DIR,
        help="Job dir to profile into (default ./cfrun-jobs/<script name>-<hash>, the one "
             "cfrun SCRIPT [ARGS] takes); a later run with the same script, arguments and "
             "ranks trains there and reuses the profile.")] = None,
    overhead: Annotated[str, typer.Option(
        "--overhead", metavar="PERCENT", envvar=E.OVERHEAD,
        help="Overhead budget in percent: 3.5% and 3.5 both mean 3.5%.")] = "3.5%",
    mtbf: Annotated[str | None, typer.Option(
        "--mtbf", metavar="DURATION", envvar=E.MTBF,
        help="Mean time between failures, e.g. 6h.")] = None,
    nproc_per_node: NprocPerNodeOption = "1",
    launcher: LauncherOption = "auto",
    local_addr: LocalAddrOption = None,
    standalone: StandaloneOption = False,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    rdzv_backend: RdzvBackendOption = "c10d",
    rdzv_conf: RdzvConfOption = None,
) -> None:
    """Profile SCRIPT: measure checkpoint costs, choose snapshot mode and interval, stop."""
    import shutil

    from cfrun.contract.checkpoints import committed_steps
    from cfrun.contract.jobdir import JobDir
    from cfrun.rank.probes import PROBE_MODES
    from cfrun.supervisor.core import Supervisor

    nproc_per_node = one_node_launch(nproc_per_node, standalone, rdzv_backend, master_addr,
                                     master_port)
    cfg = build_config(script, script_args, job_dir, None, overhead, nproc_per_node, "0", "2",
                       "25", mtbf, "1800", "0", "", profile_only=True, module=module,
                       launcher=launcher, local_addr=local_addr)
    jd = JobDir(cfg.job_dir)
    if committed_steps(jd.checkpoints):
        raise BadInputError(f"job dir {cfg.job_dir!r} already has checkpoints; profile into a "
                            "new --job-dir (profiling must not replace a job's checkpoints)")
    code = Supervisor(cfg, python_command=python_launcher_line(ctx)).run()
    shutil.rmtree(jd.checkpoints, ignore_errors=True)  # profiling checkpoints are not a job's
    jd.checkpoints.mkdir(mode=0o700, parents=True, exist_ok=True)
    for hb in coordination.heartbeat_paths(jd.root):
        hb.unlink()
    strategy = jd.strategy_path
    if code == 0 and _plan_phase(strategy) != "tuned":  # rank 0's plan, still profiling
        planned = len(_plan_record(strategy).get("probe_steps") or PROBE_MODES)
        strategy.unlink(missing_ok=True)
        probes = sum(1 for e in jd.read_events() if e.get("event") == "checkpoint")
        raise JobFailedError(
            f"the script ended before profiling finished ({probes} of {planned} "
            "profiling checkpoints taken); nothing was decided",
            hint="profile with more steps (profiling takes about 50 to 60 optimizer steps)")
    if code != 0:
        raise typer.Exit(code)
    _print_profile(cfg, jd, strategy)


def _print_profile(cfg: RunConfig, jd: JobDir, strategy: Path) -> None:
    """The table of what the profile measured and chose (the job dir's profile that
    ``strategy.json`` names), and where the strategy was written."""
    from rich.console import Console
    from rich.table import Table

    from cfrun.contract.gpus import samples as gpu_samples

    st = json.loads(strategy.read_text())
    prof = json.loads(jd.profile_path(st["fingerprint"]).read_text())
    c, d = prof["costs"], prof["decision"]
    table = Table("measured", "value", title=f"cfrun profile: {cfg.shown}")
    for name, value in [
        ("iteration time", f"{c['iter_s'] * 1e3:.2f} ms"),
        ("optimizer step time", f"{prof.get('opt_step_s', 0) * 1e3:.2f} ms"),
        ("state size", f"{c['state_bytes'] / 1e6:.2f} MB"),
        *[(f"stall per checkpoint ({m})", f"{v['stall_s'] * 1e3:.2f} ms")
          for m, v in prof["modes"].items()],
        *[(f"interference per checkpoint ({m})", f"{v['interference_s'] * 1e3:.2f} ms")
          for m, v in prof["modes"].items()],
        ("snapshot + persist", f"{c['persist_s'] * 1e3:.2f} ms"),
        ("persist bandwidth", f"{c['state_bytes'] / max(c['persist_s'], 1e-9) / 1e9:.2f} GB/s"),
        ("memory", prof.get("memory", "-")),
        ("GPUs", gpu_text([g.to_json() for g in gpu_samples()]) or "none (no NVML)"),
        ("chosen snapshot mode", prof["mode"]),
        ("chosen interval", f"{d['interval']} steps ({d['reason']})"),
        ("predicted overhead", f"{100 * d['predicted_overhead']:.2f}% "
                               f"(budget {100 * prof['budget']:.2f}%)"),
        ("predicted recovery time", f"{d['predicted_recovery_s']:.1f} s"),
    ]:
        table.add_row(name, str(value))
    Console().print(table)
    print(f"strategy written to {strategy}")
