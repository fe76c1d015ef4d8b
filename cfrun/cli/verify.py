"""``cfrun verify SCRIPT [ARGS]...``: prove on the user's own script that a resume is exact.

Runs the script under cfrun twice in temporary job dirs, both stopped at the same optimizer
step N (the ranks take a final committed checkpoint there and the script ends: its tail does
not run; :mod:`cfrun.rank.verify`): once uninterrupted, once with K real SIGKILLs at chosen
steps (:func:`~cfrun.cli.verify_plan.plan_kills`: before the first checkpoint, inside an epoch,
right after an epoch's last step, during a persist, and with several ranks a kill of one rank
that is not rank 0), each restarted by the supervisor as usual. Then it compares the two
checkpoints of step N entry by entry, bit for bit (:mod:`cfrun.codec.compare`), and the two
runs' digests of every step (:class:`cfrun.contract.verify.StepDigest`) to find the first step
where they differ. ``--against-plain`` adds a third run of the script without cfrun's runtime,
observed by one optimizer step hook (:func:`cfrun.rank.verify.observe`), whose step digests are
compared with the uninterrupted run's.

Verdict: ``exact`` (exit 0) when every entry is bit-identical and no kill recomputed more than
K+1 steps (K: the checkpoint interval), RNGs the script never seeds and script variables that
differ between two uninterrupted runs set aside (each named on its own line): when the killed
run differs from the uninterrupted one only in script variables, with the same parameters at
every step, the script runs uninterrupted once more, and a variable that differs there too
takes its value from outside the computation (a clock: ``step_times``; the same goes for a
Lightning ``ModelCheckpoint``'s file names, ``-v1`` when an earlier run left its files), as
long as the parameters still match at every step
(:func:`~cfrun.cli.verify_compare.varying_variables`). Both runs are compared at the step of
the uninterrupted run's final checkpoint (:func:`~cfrun.cli.verify_runs.stopped_at`: the first
checkpoint boundary at or after step N); ``not exact`` (exit 6,
:data:`~cfrun.contract.errors.EXIT_NOT_EXACT`) with the first differing entry
in the user's terms, the first differing step, and the causes cfrun reported at run time
(``not_exact`` events). A run that fails exits with the usual codes. The job dirs live in one
private temporary directory, removed at the end, also on an error or Ctrl-C.

The kills are planned in :mod:`cfrun.cli.verify_plan`, the runs run in
:mod:`cfrun.cli.verify_runs`, the two runs compared in :mod:`cfrun.cli.verify_compare`, the
verdict and the report made in :mod:`cfrun.cli.verify_report`; this module is the command and
the order of the runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from cfrun.cli import verify_compare as C
from cfrun.cli.argv import python_launcher_line
from cfrun.cli.launch import one_node_launch
from cfrun.cli.logs import log, setup_logging_if_given
from cfrun.cli.options import (
    CrashLoopOption,
    GraceOption,
    HangTimeoutOption,
    IntervalOption,
    LauncherOption,
    LocalAddrOption,
    LogFormatOption,
    MasterAddrOption,
    MasterPortOption,
    MaxRestartsOption,
    ModuleOption,
    NprocPerNodeOption,
    RdzvBackendOption,
    RdzvConfOption,
    ScriptArgsArgument,
    ScriptArgument,
    StandaloneOption,
)
from cfrun.cli.runconfig import build_config
from cfrun.cli.verify_plan import DEFAULT_INTERVAL, plan_kills
from cfrun.cli.verify_report import build_report, exit_code, format_report
from cfrun.cli.verify_runs import (
    RunResult,
    has_checkpoint,
    plain_run,
    run_supervised,
    stopped_at,
)
from cfrun.contract import verify as V
from cfrun.contract.config import RunConfig, parse_positive_int
from cfrun.contract.errors import EXIT_PREEMPTED, BadInputError, JobFailedError

HELP = ("Check that SCRIPT resumes exactly: run it to step N uninterrupted and again "
        "with SIGKILLs at chosen steps, then compare the two states at step N bit "
        "for bit. Exit 0: exact; 6: not exact, with the first differing entry.")
"""``cfrun verify --help``'s text."""


def verify_cmd(
    ctx: typer.Context,
    script: ScriptArgument,
    script_args: ScriptArgsArgument = None,
    module: ModuleOption = False,
    steps: Annotated[str | None, typer.Option(
        "--steps", metavar="INTEGER",
        help="Optimizer steps each run makes before it stops (default: the first epoch of "
             "the training loader plus two checkpoint intervals when the loader has a "
             "length, else 200).")] = None,
    kills: Annotated[str, typer.Option(
        "--kills", metavar="INTEGER",
        help="SIGKILLs in the second run, at the hard cases: inside an epoch, right after an "
             "epoch's last step, during a persist, before the first checkpoint.")] = "3",
    against_plain: Annotated[bool, typer.Option(
        "--against-plain",
        help="Also run the script without cfrun to step N and check that the uninterrupted "
             "run computes the same at every step (a third run).")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object (the script's output goes to stderr).")] = False,
    interval: IntervalOption = None,
    nproc_per_node: NprocPerNodeOption = "1",
    launcher: LauncherOption = "auto",
    max_restarts: MaxRestartsOption = "5",
    grace: GraceOption = "25",
    hang_timeout: HangTimeoutOption = "1800",
    crash_loop: CrashLoopOption = "3",
    local_addr: LocalAddrOption = None,
    standalone: StandaloneOption = False,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    rdzv_backend: RdzvBackendOption = "c10d",
    rdzv_conf: RdzvConfOption = None,
    log_format: LogFormatOption = "auto",
) -> None:
    """Check that SCRIPT resumes exactly (:mod:`cfrun.cli.verify`)."""
    setup_logging_if_given(ctx, log_format)
    steps_n = parse_positive_int("--steps", steps, minimum=2) if steps is not None else None
    kills_n = parse_positive_int("--kills", kills, minimum=0)
    nproc_per_node = one_node_launch(nproc_per_node, standalone, rdzv_backend, master_addr,
                                     master_port)
    cfg = build_config(script, script_args, None, interval or str(DEFAULT_INTERVAL), "3.5%",
                       nproc_per_node, max_restarts, "2", grace, None, hang_timeout,
                       crash_loop, "", profile_only=False, launcher=launcher,
                       local_addr=local_addr, module=module)
    restore = json_stdout_guard()[1] if as_json else None
    try:
        rep = verify(cfg, steps=steps_n, kills=kills_n, against_plain=against_plain,
                     say=lambda line: log.info("%s", line),
                     python_command=python_launcher_line(ctx))
    except KeyboardInterrupt:  # Ctrl-C between two runs (a run's own supervisor takes it)
        print("cfrun verify: interrupted; nothing was compared", file=sys.stderr)
        raise typer.Exit(EXIT_PREEMPTED) from None
    finally:
        if restore is not None:
            restore()
    if as_json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"cfrun verify: {cfg.shown} {' '.join(cfg.script_args)}".rstrip()
              + f", {rep['steps']} steps, checkpoint every {rep['interval']} steps")
        print(format_report(rep))
    raise typer.Exit(exit_code(rep))


def verify(base: RunConfig, *, steps: int | None, kills: int, against_plain: bool,
           say: Any = print, python_command: str | None = None) -> dict[str, Any]:
    """Run the verify (module doc) and return its report (the ``--json`` object). ``say``
    prints a progress line; ``python_command``: the ``cfrun verify --launcher python ...`` line
    a one-rank script that went distributed under torchrun is told to run instead. Removes
    every temporary job dir before it returns or raises.

    Raises:
        CfrunError: a run failed (its exit code), or the stop step was never reached (exit 2).
    """
    world = base.nproc_per_node * base.nnodes
    interval = base.interval or DEFAULT_INTERVAL
    if steps is not None and kills and not plan_kills(steps, interval, [], world, kills):
        raise BadInputError(f"--steps {steps} leaves no room for a kill with checkpoints every "
                            f"{interval} steps; give more --steps or a smaller --interval")
    root = Path(tempfile.mkdtemp(prefix="cfrun-verify-"))  # 0700
    try:
        cfg1 = dataclasses.replace(base, job_dir=str(root / "uninterrupted"), verify=True,
                                   verify_stop_step=steps, interval=interval, rdzv_id=None)
        say(f"cfrun verify: run 1: uninterrupted, checkpoint every {interval} steps"
            + (f", stop at step {steps}" if steps else ""))
        run1 = run_supervised(cfg1, "uninterrupted", python_command)
        info = V.RunInfo.read(V.info_path(run1.job_dir)) or V.RunInfo()
        stop = _stop_step(run1, steps, info, world)
        plan = plan_kills(stop, interval, list(info.epoch_ends), world, kills)
        if kills and not plan:
            raise BadInputError(f"cfrun verify: step {stop} leaves no room for a kill with "
                                f"checkpoints every {interval} steps; give more --steps or a "
                                "smaller --interval")
        say(f"cfrun verify: run 1 reached step {stop} in {run1.seconds:.1f} s; run 2: "
            f"{len(plan)} kills: " + "; ".join(k.describe() for k in plan))
        cfg2 = dataclasses.replace(cfg1, job_dir=str(root / "killed"), verify_stop_step=stop,
                                   verify_kills=tuple((k.step, k.attempt, k.rank, k.moment)
                                                      for k in plan),
                                   max_restarts=base.max_restarts + len(plan))
        run2 = run_supervised(cfg2, "killed", python_command)
        runs = [run1, run2]
        plain = None
        if against_plain:
            say(f"cfrun verify: run 3: the plain script, without cfrun, to step {stop}")
            run3 = plain_run(base, root, stop)
            runs.append(run3)
            plain = C.against_plain(run1.job_dir, run3.job_dir, stop, world)
        if not has_checkpoint(run2.job_dir, stop):
            raise JobFailedError(f"cfrun verify: the killed run ended without its checkpoint at "
                                 f"step {stop}; nothing was compared")
        return build_report(base, cfg1, root, stop, info, plan, runs, plain, say)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _stop_step(run1: RunResult, steps: int | None, info: V.RunInfo, world: int) -> int:
    """The step both runs are compared at: ``--steps``, else the one rank 0 chose in the
    uninterrupted run ``run1``, moved to that run's final checkpoint
    (:func:`~cfrun.cli.verify_runs.stopped_at`).

    Raises:
        BadInputError: ``run1`` ended before that step, or made no optimizer step.
    """
    stop = steps or info.stop_step
    if stop is not None:
        stop = stopped_at(run1.job_dir, stop)
    if stop is None or not has_checkpoint(run1.job_dir, stop):
        last = max((r.step for r in C.digests(run1.job_dir, world)[0]), default=0)
        raise BadInputError(
            f"cfrun verify: the script ended after {last} optimizer steps, before the stop "
            f"step {stop if stop is not None else '(not chosen: no epoch ended)'}; give "
            f"--steps below {last}" if last > 1 else
            "cfrun verify: the script made no optimizer step under cfrun; nothing to verify")
    return stop


def json_stdout_guard() -> tuple[int, Any]:
    """For ``--json``: point this process's fd 1 (inherited by the scripts it runs) at stderr,
    so stdout carries the one JSON object only. Returns the saved fd and a function that
    puts stdout back."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)

    def restore() -> None:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)

    return saved, restore
