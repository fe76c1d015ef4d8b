"""The verdict of a ``cfrun verify`` (:mod:`cfrun.cli.verify`) and its report: the killed run
compared with the uninterrupted one (:mod:`cfrun.cli.verify_compare`), the RNGs the script
never seeds and the script variables that differ between any two runs set aside (one more
uninterrupted run tells them), put together as the ``--json`` object (:func:`build_report`);
that object as the lines ``cfrun verify`` prints (:func:`format_report`) and its exit code
(:func:`exit_code`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from cfrun.cli import verify_compare as C
from cfrun.cli.verify_plan import DEFAULT_INTERVAL, Kill
from cfrun.cli.verify_runs import RunResult, has_checkpoint, run_supervised
from cfrun.contract import verify as V
from cfrun.contract.config import RunConfig
from cfrun.contract.errors import EXIT_NOT_EXACT


def build_report(base: RunConfig, cfg1: RunConfig, root: Path, stop: int, info: V.RunInfo,
                 plan: list[Kill], runs: list[RunResult], plain: dict[str, Any] | None,
                 say: Any) -> dict[str, Any]:
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
    again = run_supervised(cfg, "uninterrupted again")
    runs.append(again)
    ref, got = C.digests(run1.job_dir, world), C.digests(again.job_dir, world)
    if C.divergence(ref, got, C.unseeded(ref, got)) is not None:
        return []
    if not has_checkpoint(again.job_dir, stop):
        return []
    again_diffs, _ = C.compare_checkpoints(run1.job_dir, again.job_dir, stop, world,
                                             loader)
    return C.varying_variables(seeded, again_diffs)


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
