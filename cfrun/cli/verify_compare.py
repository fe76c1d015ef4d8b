"""The comparisons of a ``cfrun verify`` (:mod:`cfrun.cli.verify`) between two runs' job dirs:
their checkpoints at the stop step entry by entry (:mod:`cfrun.codec.compare`), their step
digests (:mod:`cfrun.contract.verify`) to the first differing step, the RNGs the script never
seeds, the script variables that differ between any two runs, and what each kill cost."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from cfrun.cli.verify_plan import AFTER_STEP, Kill
from cfrun.contract import verify as V

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


def may_vary(entry: str) -> bool:
    """Whether checkpoint entry ``entry`` (a name of :func:`cfrun.codec.compare.entry_name`)
    can take its value from outside the computation: a script variable (the clock), or a
    Lightning callback's state or ``ModelCheckpoint`` directory listing (the files an earlier
    run left there: ``ModelCheckpoint`` names a file ``-v1`` when its name is taken)."""
    name = re.sub(r"^rank \d+: ", "", entry)
    return name.startswith(("script variable ", V.LIGHTNING_CALLBACK, V.LIGHTNING_FILES))


def varying_variables(relevant: list[dict[str, Any]], again: list[dict[str, Any]]
                      ) -> list[dict[str, Any]]:
    """Those of ``relevant`` (differences of the killed run from the uninterrupted one) that
    are script variables (or Lightning callback states, :func:`may_vary`) and also differ
    between two uninterrupted runs (``again``): values the script takes from outside its
    computation (the clock: ``step_times``, ``t_prev``; the files in its output directory),
    which no resume can make equal, as for the unseeded RNGs. The caller sets them aside only
    when every step's parameters match across the three runs."""
    names = {d["entry"] for d in again}
    return [d for d in relevant if may_vary(d["entry"]) and d["entry"] in names]


def _events(job_dir: Path) -> list[dict[str, Any]]:
    from cfrun.contract.jobdir import JobDir

    return JobDir(job_dir).read_events()


def known_causes(*job_dirs: Path) -> list[str]:
    """The causes of inexactness cfrun reported at run time (``not_exact`` events) in the job
    dirs, each once, in the order first seen."""
    out: dict[str, None] = {}
    for jd in job_dirs:
        for e in _events(jd):
            if e.get("event") == "not_exact" and isinstance(e.get("reason"), str):
                out[e["reason"]] = None
    return list(out)


def kill_results(kills: list[Kill], job_dir: Path) -> list[dict[str, Any]]:
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


def compare_checkpoints(ref_dir: Path, other_dir: Path, step: int, world_size: int,
                        loader: str | None) -> tuple[list[dict[str, Any]], int]:
    """Differences of every rank's shard of the two checkpoints of ``step``, and the number
    of entries compared."""
    from cfrun.codec.checkpoint import load_shard
    from cfrun.codec.compare import differences, entry_names
    from cfrun.contract.jobdir import step_dir_name

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


def digests(job_dir: Path, world_size: int) -> list[list[V.StepDigest]]:
    """Every rank's step digests of a run, by rank."""
    return [V.read_digests(V.digests_path(job_dir, r)) for r in range(world_size)]


def unseeded(ref: list[list[V.StepDigest]], other: list[list[V.StepDigest]]) -> set[str]:
    """:func:`unseeded_rngs` of any rank of two runs (their :func:`digests`)."""
    return set().union(*(unseeded_rngs(a, b) for a, b in zip(ref, other)))


def divergence(ref: list[list[V.StepDigest]], other: list[list[V.StepDigest]],
               ignore: set[str] | frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """The first step at which two runs (their :func:`digests`) differ on any rank
    (:func:`first_divergence`): ``step``, ``rank`` and ``what``; None when they never do."""
    found: dict[str, Any] | None = None
    for rank, (a, b) in enumerate(zip(ref, other)):
        d = first_divergence(a, b, ignore)
        if d is not None and (found is None or d[0] < found["step"]):
            found = {"step": d[0], "rank": rank, "what": d[1]}
    return found


def against_plain(ref_dir: Path, plain_dir: Path, stop_step: int, world_size: int
                  ) -> dict[str, Any]:
    """``--against-plain``'s part of the report: whether the uninterrupted run (``ref_dir``)
    computed what the plain script (``plain_dir``) computed at every step up to ``stop_step``
    (``equal``), the plain run's steps, the first difference, and the RNGs it never seeds."""
    ref, got = digests(ref_dir, world_size), digests(plain_dir, world_size)
    unseeded_now = unseeded(ref, got)
    d = divergence(ref, got, unseeded_now)
    plain_steps = max((r.step for r in got[0]), default=0)
    return {"equal": d is None and plain_steps >= stop_step, "steps": plain_steps,
            "first_difference": d if d is not None else divergence(ref, got),
            "unseeded_rngs": sorted(unseeded_now)}
