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
the uninterrupted run's final checkpoint (:func:`stopped_at`: the first checkpoint boundary at
or after step N); ``not exact`` (exit 6, :data:`EXIT_NOT_EXACT`) with the first differing entry
in the user's terms, the first differing step, and the causes cfrun reported at run time
(``not_exact`` events). A run that fails exits with the usual codes. The job dirs live in one
private temporary directory, removed at the end, also on an error or Ctrl-C.

The kills are planned in :mod:`cfrun.cli.verify_plan`, the two runs compared in
:mod:`cfrun.cli.verify_compare`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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
from cfrun.cli.verify_plan import DEFAULT_INTERVAL, Kill, plan_kills
from cfrun.contract import verify as V
from cfrun.contract.config import RunConfig, parse_positive_int
from cfrun.contract.errors import (
    EXIT_NOT_EXACT,
    EXIT_PREEMPTED,
    BadInputError,
    CfrunError,
    JobFailedError,
)

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
    launcher: LauncherOption = "torchrun",
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


def stopped_at(job_dir: Path, stop_step: int) -> int:
    """The step of the final checkpoint of a verify run told to stop at ``stop_step``: the
    ranks stop at the first checkpoint boundary after that step, which a framework's loop can
    put after a later step (Lightning's ``Trainer.fit`` calls the training loader's ``next()``
    for an epoch's first batch from a new iterator, so the boundary due at an epoch's last
    step is the one after the next epoch's first step). The earliest committed checkpoint at
    ``stop_step`` or later; ``stop_step`` when there is none."""
    from cfrun.contract.checkpoints import committed_steps

    later = [s for s in committed_steps(job_dir / "checkpoints") if s >= stop_step]
    return min(later, default=stop_step)


def _has_checkpoint(job_dir: Path, step: int) -> bool:
    """Whether the run in ``job_dir`` has its checkpoint of ``step``."""
    from cfrun.contract.jobdir import step_dir_name

    return (job_dir / "checkpoints" / step_dir_name(step)).is_dir()


@dataclass
class RunResult:
    """One run of a verify: its name, job dir, seconds and exit code."""

    name: str
    job_dir: Path
    seconds: float = 0.0
    exit_code: int | None = None


def _run_supervised(cfg: RunConfig, name: str, python_command: str | None = None
                    ) -> RunResult:
    """Run ``cfg`` under cfrun's supervisor (this process's main thread) to its end;
    ``python_command``: the ``cfrun verify --launcher python ...`` line (the hint of a
    one-rank script that went distributed under torchrun).

    Raises:
        CfrunError: the run failed (its exit code; the message names the run).
    """
    from cfrun.supervisor.core import Supervisor

    result = RunResult(name, Path(cfg.job_dir))
    t0 = time.monotonic()
    try:
        code = Supervisor(cfg, python_command=python_command).run()
    except CfrunError as e:
        e.args = (f"cfrun verify: the {name} run failed: {e}",)
        raise
    finally:
        result.seconds = time.monotonic() - t0
    result.exit_code = code
    if code != 0:
        raise _RunStopped(name, code)
    return result


class _RunStopped(CfrunError):
    """A verify run ended with a non-zero code without an error of its own (a signal: 75)."""

    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"cfrun verify: the {name} run stopped with exit code {code}; "
                         "nothing was compared")
        self.exit_code = code  # type: ignore[misc]


def _plain_run(cfg: RunConfig, root: Path, stop_step: int) -> RunResult:
    """The script without cfrun's runtime (``--against-plain``): launched as cfrun launches it
    (torchrun, or ``python SCRIPT``), with only the observer hook (``CFRUN_VERIFY_OBSERVE``,
    :func:`cfrun.rank.verify.observe`), which ends every rank at ``stop_step``.

    Raises:
        JobFailedError: the script failed (exit code 4).
    """
    from cfrun.contract import settings as E
    from cfrun.supervisor.launcher import TORCHRUN_VARIABLES, build_launch_argv, hooks_dir

    out = root / "plain"
    out.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "CFRUN_RANK_"))
           and k not in (E.HOOK_OWNER_PID, E.RANK_SETTINGS)}
    if cfg.launcher == "python":
        env = {k: v for k, v in env.items()
               if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks_dir()), env.get("PYTHONPATH", ""))
                                        if p)
    env[E.VERIFY_OBSERVE] = json.dumps({"dir": str(out / V.DIR), "stop_step": stop_step,
                                        "launcher": cfg.launcher})
    argv = build_launch_argv(cfg, log_dir=str(out / "torchrun-logs"))
    result = RunResult("plain", out)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cfg.cwd, start_new_session=True)
    try:
        code = proc.wait()
    finally:
        if proc.poll() is None:  # Ctrl-C: nothing of the plain run outlives cfrun
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        result.seconds = time.monotonic() - t0
    result.exit_code = code
    if code != 0:
        raise JobFailedError(f"cfrun verify: the plain run (without cfrun) failed with exit "
                             f"code {code}")
    return result


def _varying(cfg1: RunConfig, root: Path, stop: int, run1: RunResult, runs: list[RunResult],
             loader: str | None, seeded: list[dict[str, Any]], say: Any
             ) -> list[dict[str, Any]]:
    """The killed run differs from the uninterrupted one only in script variables, with the
    same parameters at every step: run the script uninterrupted once more (appended to
    ``runs``) and return the differences that two uninterrupted runs show too
    (:func:`cfrun.cli.verify_compare.varying_variables`); none if the second uninterrupted
    run's parameters (or seeded RNGs) differ from the first's at any step (then the script
    does not compute the same twice, and nothing is set aside).

    Raises:
        CfrunError: the run failed (its exit code).
    """
    world = cfg1.nproc_per_node * cfg1.nnodes
    say(f"cfrun verify: run {len(runs) + 1}: uninterrupted again, to tell the script variables "
        "that differ between any two runs (a clock) from those a resume changed")
    cfg = dataclasses.replace(cfg1, job_dir=str(root / "again"), verify_stop_step=stop)
    again = _run_supervised(cfg, "uninterrupted again")
    runs.append(again)
    ref, got = C.digests(run1.job_dir, world), C.digests(again.job_dir, world)
    if C.divergence(ref, got, C.unseeded(ref, got)) is not None:
        return []
    if not _has_checkpoint(again.job_dir, stop):
        return []
    again_diffs, _ = C.compare_checkpoints(run1.job_dir, again.job_dir, stop, world,
                                             loader)
    return C.varying_variables(seeded, again_diffs)


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
        run1 = _run_supervised(cfg1, "uninterrupted", python_command)
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
        run2 = _run_supervised(cfg2, "killed", python_command)
        runs = [run1, run2]
        plain = None
        if against_plain:
            say(f"cfrun verify: run 3: the plain script, without cfrun, to step {stop}")
            run3 = _plain_run(base, root, stop)
            runs.append(run3)
            plain = C.against_plain(run1.job_dir, run3.job_dir, stop, world)
        if not _has_checkpoint(run2.job_dir, stop):
            raise JobFailedError(f"cfrun verify: the killed run ended without its checkpoint at "
                                 f"step {stop}; nothing was compared")
        return _report(base, cfg1, root, stop, info, plan, runs, plain, say)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _stop_step(run1: RunResult, steps: int | None, info: V.RunInfo, world: int) -> int:
    """The step both runs are compared at: ``--steps``, else the one rank 0 chose in the
    uninterrupted run ``run1``, moved to that run's final checkpoint (:func:`stopped_at`).

    Raises:
        BadInputError: ``run1`` ended before that step, or made no optimizer step.
    """
    stop = steps or info.stop_step
    if stop is not None:
        stop = stopped_at(run1.job_dir, stop)
    if stop is None or not _has_checkpoint(run1.job_dir, stop):
        last = max((r.step for r in C.digests(run1.job_dir, world)[0]), default=0)
        raise BadInputError(
            f"cfrun verify: the script ended after {last} optimizer steps, before the stop "
            f"step {stop if stop is not None else '(not chosen: no epoch ended)'}; give "
            f"--steps below {last}" if last > 1 else
            "cfrun verify: the script made no optimizer step under cfrun; nothing to verify")
    return stop


def _report(base: RunConfig, cfg1: RunConfig, root: Path, stop: int, info: V.RunInfo,
            plan: list[Kill], runs: list[RunResult], plain: dict[str, Any] | None, say: Any
            ) -> dict[str, Any]:
    """The verdict and the report (the ``--json`` object): the killed run (``runs[1]``)
    compared with the uninterrupted one (``runs[0]``, of config ``cfg1``) at step ``stop``,
    entry by entry and step by step, the unseeded RNGs and (after one more uninterrupted run
    in ``root``, appended to ``runs``) the varying script variables set aside; ``plain``: the
    ``--against-plain`` comparison.

    Raises:
        CfrunError: the extra uninterrupted run failed (its exit code).
    """
    world = base.nproc_per_node * base.nnodes
    interval = base.interval or DEFAULT_INTERVAL
    run1, run2 = runs[0], runs[1]
    diffs, compared = C.compare_checkpoints(run1.job_dir, run2.job_dir, stop, world, info.loader)
    kill_rows = C.kill_results(plan, run2.job_dir)
    bound = interval + 1
    over = [k for k in kill_rows if k["recomputed"] is not None and k["recomputed"] > bound]
    ref, got = C.digests(run1.job_dir, world), C.digests(run2.job_dir, world)
    unseeded = C.unseeded(ref, got)
    loose = C.divergence(ref, got, unseeded)
    # RNGs the script never seeds differ between any two runs: they are the news only when
    # the runs differ before any kill (in the killed run's first attempt); else they are
    # left aside (listed apart)
    nondeterministic = C.divergence(ref, [[r for r in g if r.attempt == 0] for g in got],
                                    unseeded) is not None
    seeded = [d for d in diffs if d["rng"] is None or d["rng"] not in unseeded]
    varying: list[dict[str, Any]] = []
    if not over and loose is None and seeded \
            and all(C.may_vary(d["entry"]) for d in seeded):
        varying = _varying(cfg1, root, stop, run1, runs, info.loader, seeded, say)
    relevant = [d for d in seeded if d not in varying]
    exact = not over and loose is None and not relevant
    shown = diffs if nondeterministic else relevant
    aside = [] if nondeterministic else [d for d in diffs if d not in seeded]
    divergence = C.divergence(ref, got) if nondeterministic else loose
    for d in diffs:
        del d["rng"]
    return {
        "verdict": "exact" if exact else "not exact",
        "exact": exact,
        "script": base.script, "args": base.script_args, "world_size": world,
        "steps": stop, "interval": interval, "recompute_bound": bound,
        "epoch_ends": list(info.epoch_ends), "training_loader": info.loader,
        "kills": kill_rows,
        "compared_entries": compared,
        "first_difference": shown[0] if shown else None,
        "differences": shown,
        "unseeded_rng_differences": aside,
        "varying_variables": varying,
        "differ_before_the_first_kill": nondeterministic,
        "first_differing_step": divergence,
        "unseeded_rngs": sorted(unseeded),
        "too_many_recomputed": over,
        "known_causes": C.known_causes(run1.job_dir, run2.job_dir),
        "against_plain": plain,
        "runs": [{"name": r.name, "seconds": round(r.seconds, 2), "exit_code": r.exit_code}
                 for r in runs],
    }


def format_report(rep: dict[str, Any]) -> str:
    """The report as the lines ``cfrun verify`` prints (the verdict last)."""
    lines = []
    for r in rep["runs"]:
        lines.append(f"  {r['name']} run: {r['seconds']:.1f} s")
    for k in rep["kills"]:
        who = f"rank {k['rank']} " if k["rank"] else ""
        where = (f"after step {k['step']}" if k["moment"] == "after step"
                 else f"during the persist of step {k['step']}")
        if k["landed"]:
            lines.append(f"  kill {k['attempt'] + 1}: {who}SIGKILLed {where} ({k['case']}); "
                         f"resumed from step {k['resumed_from']}, {k['recomputed']} steps "
                         "recomputed")
        else:
            lines.append(f"  kill {k['attempt'] + 1}: {who}{where} ({k['case']}): did not land")
    lines.append(f"  compared at step {rep['steps']}: {rep['compared_entries']} entries "
                 "(models, optimizers, schedulers, scalers, RNGs, loader position, script "
                 "variables)" + (f" on each of {rep['world_size']} ranks"
                                 if rep["world_size"] > 1 else ""))
    plain = rep["against_plain"]
    if plain is not None:
        if plain["equal"]:
            lines.append(f"  the uninterrupted run equals the plain script (without cfrun) at "
                         f"every step up to {rep['steps']}")
        else:
            d = plain["first_difference"]
            lines.append("  the uninterrupted run differs from the plain script (without "
                         "cfrun)" + (f" from step {d['step']} ({', '.join(d['what'])})" if d
                                     else f": the plain run made {plain['steps']} steps"))
    names = {"random": "RNG python random", "numpy": "RNG numpy", "torch": "RNG torch",
             "cuda": "RNG cuda"}
    if rep["unseeded_rngs"] and not rep["differ_before_the_first_kill"]:
        lines.append("  not seeded by the script (they differ between two fresh runs; the "
                     "parameters do not follow them, so they are left aside): "
                     + ", ".join(names.get(k, k) for k in rep["unseeded_rngs"]))
    for d in rep["varying_variables"]:
        lines.append(f"  differs between two uninterrupted runs, left aside (the parameters "
                     f"match at every step): {d['entry']} ({d['detail']})")
    if rep["exact"]:
        most = max((k["recomputed"] for k in rep["kills"] if k["recomputed"] is not None),
                   default=0)
        aside = [what for what, shown in (("the unseeded RNGs", rep["unseeded_rng_differences"]),
                                          ("the variables above", rep["varying_variables"]))
                 if shown]
        lines.append(f"exact: every entry bit-identical at step {rep['steps']}"
                     + (f" ({' and '.join(aside)} aside)" if aside else "")
                     + f", at most {most} steps recomputed per kill (bound "
                     f"{rep['recompute_bound']})")
        return "\n".join(lines)
    lines.append("not exact:")
    first = rep["first_difference"]
    if first is not None:
        lines.append(f"  first differing entry: {first['entry']} ({first['detail']})")
        others = [d["entry"] for d in rep["differences"][1:]]
        if others:
            shown = ", ".join(others[:8]) + (f", and {len(others) - 8} more"
                                              if len(others) > 8 else "")
            lines.append(f"  also differ: {shown}")
    d = rep["first_differing_step"]
    if d is not None:
        before = rep["differ_before_the_first_kill"]
        lines.append(f"  the runs first differ at step {d['step']} ({', '.join(d['what'])})"
                     + (": before the first kill, so the script does not compute the same "
                        "twice (wall clock, unseeded randomness, nondeterministic kernels?)"
                        if before else ""))
    for k in rep["too_many_recomputed"]:
        lines.append(f"  the kill at step {k['step']} recomputed {k['recomputed']} steps, more "
                     f"than {rep['recompute_bound']}")
    for cause in rep["known_causes"]:
        lines.append(f"  known cause (cfrun said so at run time): {cause}")
    return "\n".join(lines)


def exit_code(rep: dict[str, Any]) -> int:
    """0 for ``exact``, :data:`EXIT_NOT_EXACT` (6) for ``not exact``."""
    return 0 if rep["exact"] else EXIT_NOT_EXACT


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
