"""``cfrun verify SCRIPT [ARGS]...``: prove on the user's own script that a resume is exact.

Runs the script under cfrun twice in temporary job dirs, both stopped at the same optimizer
step N (the ranks take a final committed checkpoint there and the script ends: its tail does
not run; :mod:`cfrun.rank.verify`): once uninterrupted, once with K real SIGKILLs at chosen
steps (:func:`plan_kills`: before the first checkpoint, inside an epoch, right after an
epoch's last step, during a persist, and with several ranks a kill of one rank that is not
rank 0), each restarted by the supervisor as usual. Then it compares the two checkpoints of
step N entry by entry, bit for bit (:mod:`cfrun.codec.compare`), and the two runs' digests of
every step (:class:`cfrun.contract.verify.StepDigest`) to find the first step where they
differ. ``--against-plain`` adds a third run of the script without cfrun's runtime, observed
by one optimizer step hook (:func:`cfrun.rank.verify.observe`), whose step digests are compared
with the uninterrupted run's.

Verdict: ``exact`` (exit 0) when every entry is bit-identical and no kill recomputed more than
K+1 steps (K: the checkpoint interval), RNGs the script never seeds and script variables that
differ between two uninterrupted runs set aside (each named on its own line): when the killed
run differs from the uninterrupted one only in script variables, with the same parameters at
every step, the script runs uninterrupted once more, and a variable that differs there too
takes its value from outside the computation (a clock: ``step_times``; the same goes for a
Lightning ``ModelCheckpoint``'s file names, ``-v1`` when an earlier run left its files), as
long as the parameters still match at every step (:func:`varying_variables`). Both runs are
compared at the step of the uninterrupted run's final checkpoint (:func:`stopped_at`: the
first checkpoint boundary at or after step N); ``not exact`` (exit 6,
:data:`EXIT_NOT_EXACT`) with the first differing entry in the user's terms, the first
differing step, and the causes cfrun reported at run time (``not_exact`` events). A run that
fails exits with the usual codes. The job dirs live in one private temporary directory, removed
at the end, also on an error or Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfrun.contract import verify as V
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import EXIT_NOT_EXACT, BadInputError, CfrunError, JobFailedError
from cfrun.contract.jobdir import JobDir, step_dir_name

AFTER_STEP, DURING_PERSIST = 0, 1
"""Kill moments (:data:`cfrun.rank.verify.AFTER_STEP`, ``DURING_PERSIST``; torch-free here)."""
DEFAULT_INTERVAL = 10
"""Checkpoint interval of the verify runs without ``--interval``
(:data:`cfrun.rank.verify.DEFAULT_INTERVAL`)."""


@dataclass(frozen=True)
class Kill:
    """One planned kill: ``rank`` SIGKILLs itself at ``step`` in ``attempt`` at ``moment``;
    ``case`` says which hard case it stands for."""

    step: int
    attempt: int
    rank: int
    moment: int
    case: str

    def describe(self) -> str:
        where = (f"after step {self.step}" if self.moment == AFTER_STEP
                 else f"during the persist of step {self.step}")
        who = f"rank {self.rank} " if self.rank else ""
        return f"{who}killed {where} ({self.case})"


def plan_kills(stop_step: int, interval: int, epoch_ends: list[int], world_size: int,
               count: int) -> list[Kill]:
    """``count`` kills at distinct steps below ``stop_step``, in increasing step order, one per
    attempt (attempt i+1 resumes before the next kill's step, so each lands). The hard cases,
    in order of preference: inside an epoch (mid-interval after the first checkpoint; with
    several ranks made by the last rank, so one rank of several dies), right after the first
    epoch's last step (``epoch_ends[0]``: before the epoch's tail runs), during the persist of
    the first checkpoint of the next epoch (or of one three quarters of the way), before the
    first checkpoint; more kills than cases go mid-interval in later intervals. Fewer than
    ``count`` when ``stop_step`` leaves no room."""
    k = max(1, interval)
    end = epoch_ends[0] if epoch_ends else None
    last_rank = world_size - 1
    candidates: list[tuple[int, int, int, str]] = []  # step, moment, rank, case
    inside = k + max(1, k // 2) if k > 1 else 2
    if end is None or inside < end:
        candidates.append((inside, AFTER_STEP, last_rank,
                           ("inside an epoch" if end is not None else "between two checkpoints")
                           + (", one rank of several" if last_rank else "")))
    if end is not None and end < stop_step:
        candidates.append((end, AFTER_STEP, 0, "right after an epoch's last step"))
    persist = ((end // k) + 1) * k if end is not None else max(k, (3 * stop_step // 4) // k * k)
    if persist < stop_step:
        candidates.append((persist, DURING_PERSIST, 0, "during a persist"))
    if k > 1:
        candidates.append((max(1, k // 2), AFTER_STEP, 0, "before the first checkpoint"))
    extra = 2 * k + max(1, k // 2)
    while len(candidates) < count + 4 and extra < stop_step:
        candidates.append((extra, AFTER_STEP, last_rank if len(candidates) % 2 else 0,
                           "inside an interval"))
        extra += k
    chosen: list[tuple[int, int, int, str]] = []
    for cand in candidates:
        if len(chosen) >= count:
            break
        if 1 <= cand[0] < stop_step and all(cand[0] != c[0] for c in chosen):
            chosen.append(cand)
    chosen.sort()
    return [Kill(step, attempt, rank, moment, case)
            for attempt, (step, moment, rank, case) in enumerate(chosen)]


_DIGEST_RNG = {"torch": "torch", "cuda": "cuda", "python": "random", "numpy": "numpy"}
"""Digest RNG key -> the checkpoint's name for that RNG (:func:`cfrun.codec.compare.rng_kind`)."""


def unseeded_rngs(ref: list[V.StepDigest], other: list[V.StepDigest]) -> set[str]:
    """The global RNGs (checkpoint names: ``random``, ``numpy``...) whose states differ between
    two fresh runs already right after step 1 of their first attempt: the script never seeds
    them, so they come from the process's entropy."""
    a = next((r for r in ref if r.step == 1 and r.attempt == 0), None)
    b = next((r for r in other if r.step == 1 and r.attempt == 0), None)
    if a is None or b is None:
        return set()
    return {_DIGEST_RNG.get(k, k) for k in set(a.rng) | set(b.rng) if a.rng.get(k) != b.rng.get(k)}


def first_divergence(ref: list[V.StepDigest], other: list[V.StepDigest],
                     ignore: set[str] | frozenset[str] = frozenset()
                     ) -> tuple[int, list[str]] | None:
    """The first step at which a record of ``other`` (any attempt) differs from ``ref``'s
    record of that step, and what differs there (``model parameters``, ``RNG numpy``...);
    None when every step both recorded is the same. RNGs named in ``ignore`` (checkpoint
    names, :func:`unseeded_rngs`) are left out."""
    by_step: dict[int, V.StepDigest] = {}
    for rec in ref:
        by_step.setdefault(rec.step, rec)
    found: tuple[int, list[str]] | None = None
    for rec in other:
        mine = by_step.get(rec.step)
        if mine is None or (found is not None and rec.step >= found[0]):
            continue
        what = ["model parameters"] if rec.params != mine.params else []
        names = {"torch": "RNG torch", "cuda": "RNG cuda", "python": "RNG python random",
                 "numpy": "RNG numpy"}
        what += [names.get(k, f"RNG {k}") for k in sorted(set(rec.rng) | set(mine.rng))
                 if rec.rng.get(k) != mine.rng.get(k) and _DIGEST_RNG.get(k, k) not in ignore]
        if what:
            found = (rec.step, what)
    return found


def _may_vary(entry: str) -> bool:
    """Whether checkpoint entry ``entry`` (a name of :func:`cfrun.codec.compare.entry_name`)
    can take its value from outside the computation: a script variable (the clock), or a
    Lightning callback's state or ``ModelCheckpoint`` directory listing (the files an earlier
    run left there: ``ModelCheckpoint`` names a file ``-v1`` when its name is taken)."""
    name = re.sub(r"^rank \d+: ", "", entry)
    return name.startswith(("script variable ", V.LIGHTNING_CALLBACK, V.LIGHTNING_FILES))


def varying_variables(relevant: list[dict[str, Any]], again: list[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """Those of ``relevant`` (differences of the killed run from the uninterrupted one) that
    are script variables (or Lightning callback states, :func:`_may_vary`) and also differ
    between two uninterrupted runs (``again``): values the script takes from outside its
    computation (the clock: ``step_times``, ``t_prev``; the files in its output directory),
    which no resume can make equal, as for the unseeded RNGs. The caller sets them aside only
    when every step's parameters match across the three runs."""
    names = {d["entry"] for d in again}
    return [d for d in relevant if _may_vary(d["entry"]) and d["entry"] in names]


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


def _events(job_dir: Path) -> list[dict[str, Any]]:
    return JobDir(job_dir).read_events()


def _known_causes(*job_dirs: Path) -> list[str]:
    out: dict[str, None] = {}
    for jd in job_dirs:
        for e in _events(jd):
            if e.get("event") == "not_exact" and isinstance(e.get("reason"), str):
                out[e["reason"]] = None
    return list(out)


def _kill_results(kills: list[Kill], job_dir: Path) -> list[dict[str, Any]]:
    """Per kill: did it land (a failure of its attempt), the step the next attempt resumed
    from (0: from the start) and the steps recomputed."""
    events = _events(job_dir)
    failed = {e.get("attempt") for e in events if e.get("event") == "failure"}
    resumed: dict[int, int] = {}
    for e in events:
        if e.get("event") == "resumed" and isinstance(e.get("step"), int):
            resumed.setdefault(int(e.get("attempt", -1)), e["step"])
    out = []
    for kill in kills:
        landed = kill.attempt in failed
        start = resumed.get(kill.attempt + 1, 0) if landed else None
        out.append({"step": kill.step, "attempt": kill.attempt, "rank": kill.rank,
                    "moment": "after step" if kill.moment == AFTER_STEP else "during persist",
                    "case": kill.case, "landed": landed, "resumed_from": start,
                    "recomputed": kill.step - start if start is not None else None})
    return out


def _compare(ref_dir: Path, other_dir: Path, step: int, world_size: int, loader: str | None
             ) -> tuple[list[dict[str, Any]], int]:
    """Differences of every rank's shard of the two checkpoints of ``step``, and the number
    of entries compared."""
    from cfrun.codec.checkpoint import load_shard
    from cfrun.codec.compare import differences, entry_names

    diffs: list[dict[str, Any]] = []
    compared = 0
    for rank in range(world_size):
        a, _ = load_shard(ref_dir / "checkpoints" / step_dir_name(step), rank)
        b, _ = load_shard(other_dir / "checkpoints" / step_dir_name(step), rank)
        compared += len(entry_names(a, loader=loader))
        prefix = f"rank {rank}: " if world_size > 1 else ""
        diffs += [{"entry": prefix + d.entry, "detail": d.detail, "rng": d.rng}
                  for d in differences(a, b, loader=loader)]
    return diffs, compared


def _digests(job_dir: Path, world_size: int) -> list[list[V.StepDigest]]:
    return [V.read_digests(V.digests_path(job_dir, r)) for r in range(world_size)]


def _unseeded(ref: list[list[V.StepDigest]], other: list[list[V.StepDigest]]) -> set[str]:
    return set().union(*(unseeded_rngs(a, b) for a, b in zip(ref, other)))


def _divergence(ref: list[list[V.StepDigest]], other: list[list[V.StepDigest]],
                ignore: set[str] | frozenset[str] = frozenset()) -> dict[str, Any] | None:
    found: dict[str, Any] | None = None
    for rank, (a, b) in enumerate(zip(ref, other)):
        d = first_divergence(a, b, ignore)
        if d is not None and (found is None or d[0] < found["step"]):
            found = {"step": d[0], "rank": rank, "what": d[1]}
    return found


def _varying(cfg1: RunConfig, root: Path, stop: int, run1: RunResult, runs: list[RunResult],
             loader: str | None, seeded: list[dict[str, Any]], say: Any
             ) -> list[dict[str, Any]]:
    """The killed run differs from the uninterrupted one only in script variables, with the
    same parameters at every step: run the script uninterrupted once more (appended to
    ``runs``) and return the differences that two uninterrupted runs show too
    (:func:`varying_variables`); none if the second uninterrupted run's parameters (or seeded
    RNGs) differ from the first's at any step (then the script does not compute the same
    twice, and nothing is set aside).

    Raises:
        CfrunError: the run failed (its exit code).
    """
    world = cfg1.nproc_per_node * cfg1.nnodes
    say(f"cfrun verify: run {len(runs) + 1}: uninterrupted again, to tell the script variables "
        "that differ between any two runs (a clock) from those a resume changed")
    cfg = dataclasses.replace(cfg1, job_dir=str(root / "again"), verify_stop_step=stop)
    again = _run_supervised(cfg, "uninterrupted again")
    runs.append(again)
    ref, got = _digests(run1.job_dir, world), _digests(again.job_dir, world)
    if _divergence(ref, got, _unseeded(ref, got)) is not None:
        return []
    if not (again.job_dir / "checkpoints" / step_dir_name(stop)).is_dir():
        return []
    again_diffs, _ = _compare(run1.job_dir, again.job_dir, stop, world, loader)
    return varying_variables(seeded, again_diffs)


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
        stop = steps or info.stop_step
        if stop is not None:
            stop = stopped_at(run1.job_dir, stop)
        if stop is None or not (run1.job_dir / "checkpoints" / step_dir_name(stop)).is_dir():
            last = max((r.step for r in _digests(run1.job_dir, world)[0]), default=0)
            raise BadInputError(
                f"cfrun verify: the script ended after {last} optimizer steps, before the stop "
                f"step {stop if stop is not None else '(not chosen: no epoch ended)'}; give "
                f"--steps below {last}" if last > 1 else
                "cfrun verify: the script made no optimizer step under cfrun; nothing to verify")
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
            ref, got = _digests(run1.job_dir, world), _digests(run3.job_dir, world)
            unseeded = _unseeded(ref, got)
            d = _divergence(ref, got, unseeded)
            plain_steps = max((r.step for r in got[0]), default=0)
            plain = {"equal": d is None and plain_steps >= stop, "steps": plain_steps,
                     "first_difference": d if d is not None else _divergence(ref, got),
                     "unseeded_rngs": sorted(unseeded)}
        if not (run2.job_dir / "checkpoints" / step_dir_name(stop)).is_dir():
            raise JobFailedError(f"cfrun verify: the killed run ended without its checkpoint at "
                                 f"step {stop}; nothing was compared")
        diffs, compared = _compare(run1.job_dir, run2.job_dir, stop, world, info.loader)
        kill_rows = _kill_results(plan, run2.job_dir)
        bound = interval + 1
        over = [k for k in kill_rows if k["recomputed"] is not None and k["recomputed"] > bound]
        ref, got = _digests(run1.job_dir, world), _digests(run2.job_dir, world)
        unseeded = _unseeded(ref, got)
        loose = _divergence(ref, got, unseeded)
        # RNGs the script never seeds differ between any two runs: they are the news only when
        # the runs differ before any kill (in the killed run's first attempt); else they are
        # left aside (listed apart)
        nondeterministic = _divergence(ref, [[r for r in g if r.attempt == 0] for g in got],
                                       unseeded) is not None
        seeded = [d for d in diffs if d["rng"] is None or d["rng"] not in unseeded]
        varying: list[dict[str, Any]] = []
        if not over and loose is None and seeded \
                and all(_may_vary(d["entry"]) for d in seeded):
            varying = _varying(cfg1, root, stop, run1, runs, info.loader, seeded, say)
        relevant = [d for d in seeded if d not in varying]
        exact = not over and loose is None and not relevant
        shown = diffs if nondeterministic else relevant
        aside = [] if nondeterministic else [d for d in diffs if d not in seeded]
        divergence = _divergence(ref, got) if nondeterministic else loose
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
            "known_causes": _known_causes(run1.job_dir, run2.job_dir),
            "against_plain": plain,
            "runs": [{"name": r.name, "seconds": round(r.seconds, 2), "exit_code": r.exit_code}
                     for r in runs],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


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
