"""What the tuner measures on rank 0: the iterations, the checkpoints and their PGT, one
adaptation window's worth (CheckFreq §4.4: the overhead is measured, not modelled).

Each optimizer step ends an iteration: its step, its seconds (``time.perf_counter``) and whether
a checkpoint was in flight during it. The tuner (:class:`cfrun.rank.tuner.Tuner`) measures a
profile's probes and each window's overhead from them against the clean iterations near them
(:func:`cfrun.policy.measure_overhead`) and keeps only what the next window needs
(:meth:`IterationLog.prune`). Training thread only.
"""

from __future__ import annotations

import time

from cfrun.policy import NEAR_STEPS


class IterationLog:
    """Rank 0's record of iterations and checkpoints (other ranks keep none)."""

    def __init__(self) -> None:
        self.iters: list[tuple[int, float, bool]] = []
        """(step that ended the iteration, its duration in seconds, checkpoint in flight)."""
        self.ckpts: list[int] = []
        """Steps of the checkpoints taken (profiling and tuned), oldest first."""
        self.pgt_s: dict[int, float] = {}
        """Checkpoint step -> seconds from its boundary to its commit (rank 0's records)."""
        self._last_t: float | None = None

    def tick(self, step: int, in_flight: bool, keep: bool) -> None:
        """The optimizer step ``step`` ended an iteration (``in_flight``: a checkpoint was in
        flight during it); ``keep``: record it (rank 0), else only note the time."""
        now = time.perf_counter()
        if self._last_t is not None and keep:
            self.iters.append((step, now - self._last_t, in_flight))
        self._last_t = now

    def clear(self) -> None:
        """Forget every iteration and checkpoint (a re-profile)."""
        self.iters, self.ckpts, self.pgt_s = [], [], {}

    def prune(self, lo: int) -> None:
        """Keep only what the window from step ``lo`` needs (one window in memory)."""
        keep = lo - 2 * NEAR_STEPS
        self.iters = [it for it in self.iters if it[0] >= keep]
        self.ckpts = [p for p in self.ckpts if p >= keep]
        self.pgt_s = {p: t for p, t in self.pgt_s.items() if p >= keep}
