"""The final checkpoint: at the script's normal end, a checkpoint of the last step, committed
like any other before the process ends (issue 27, item 2; :mod:`cfrun.rank.boundary`)."""

from __future__ import annotations

from collections.abc import Callable

from cfrun.contract.jobdir import JobDir
from cfrun.rank.discovery import Discovery
from cfrun.rank.log import say
from cfrun.rank.settings import RankSettings
from cfrun.rank.snapshot import SnapshotHandle, Snapshotter

FINAL_WAIT_S = 60.0
"""The longest the script's end waits for the final checkpoint's commit
(:meth:`FinalCheckpoint.take`)."""


class FinalCheckpoint:
    """The final checkpoint's step, once started, and its outcome. The job's newest checkpoint
    is then where the script ended (``cfrun export`` of a finished job gives its final
    weights). No collective: each rank hands its shard to its node's agent, which commits the
    step once it has every rank's (the ranks end at the same step), so it works after
    ``dist.destroy_process_group()`` too.

    It holds no script variable (their frames have ended) nor data position: it is marked
    ``final`` in its manifest, and a resume (``--rerun``) never starts from it
    (:func:`cfrun.codec.checkpoint.open_newest`). Rank 0 records the outcome in a
    ``final_checkpoint`` event, which ``cfrun export`` cites (no ``checkpoint`` event: its wait
    at exit is no training stall; the agent's ``commit`` event is there).
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir, snap: Snapshotter,
                 found: Discovery) -> None:
        self.s = settings
        self.jobdir = jobdir
        self._snap = snap
        self._found = found
        self.step: int | None = None
        """Step of the final checkpoint, once started (its commit feeds no tuner, no
        ``checkpoint`` event: :meth:`cfrun.rank.boundary.Boundary.on_persisted`)."""

    def take(self, step: int, *, last_taken: int | None, restored_step: int | None,
             checkpoint: Callable[[int], SnapshotHandle]) -> None:
        """The rank's atexit, every rank, at a normal end after step ``step``: take it with
        ``checkpoint(step)`` and wait at most :data:`FINAL_WAIT_S` for its commit, unless the
        last step's checkpoint was already committed (``last_taken`` at the loop's end: let it
        commit first) or resumed from (``restored_step``), or no optimizer is alive any more.
        Never raises; says a failure on stderr."""
        outcome, error = "committed", None
        if step == last_taken:  # taken at the loop's end: let it commit first
            self._snap.wait_idle(FINAL_WAIT_S)
        if step in (restored_step, self._snap.last_committed):
            outcome = "already"
        elif not self._found.optimizers():
            outcome, error = "none", "no optimizer was alive at the script's end"
        else:
            self.step = step
            try:
                handle = checkpoint(step)
                if not handle.wait(FINAL_WAIT_S):
                    outcome = "failed"
                    error = self._snap.last_error or f"not committed within {FINAL_WAIT_S:.0f} s"
            except Exception as e:
                outcome, error = "failed", repr(e)
            if outcome == "failed":
                say(f"WARNING: the final checkpoint of step {step} failed: {error}")
        self._note(step, outcome, error)

    def _note(self, step: int, outcome: str, error: str | None) -> None:
        """Rank 0: the ``final_checkpoint`` event (``outcome``: committed, already, none,
        failed, with ``error``)."""
        if self.s.rank == 0:
            extra = {"error": error} if error is not None else {}
            self.jobdir.emit_event("final_checkpoint", step=step, outcome=outcome,
                                   attempt=self.s.attempt, **extra)
