"""The kills of a ``cfrun verify`` run (:mod:`cfrun.cli.verify`): which rank SIGKILLs itself
after which step, in which attempt, for which hard case of a resume. Pure: no process, no
file."""

from __future__ import annotations

from dataclasses import dataclass

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
