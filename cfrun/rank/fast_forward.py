"""Fast-forward: completed epochs of a replayed resume run without data, with the script's
output suppressed (:mod:`cfrun.rank.resume`, "loader loops, replay")."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path
from typing import Any

from cfrun.rank.log import say


class _NullWriter(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


class FastForward:
    """Whether completed epochs are running without data (:attr:`active`), the script's stdout
    and warning filters meanwhile, and how evaluation loaders run then (:attr:`ff_eval`, with
    the fallback file a failed fast-forward leaves for the next attempt). Training thread.

    Args:
        fallback_path: the job's ``ff_eval_run`` file: when it exists, evaluation loaders run
            in full while fast-forwarding.
        ff_eval: ``one`` (one batch each) or ``run`` (in full), the run's setting.
    """

    def __init__(self, fallback_path: Path, ff_eval: str) -> None:
        self._fallback_path = fallback_path
        self.ff_eval = "run" if fallback_path.exists() else ff_eval
        self.active = False
        """True while completed epochs run without data (output suppressed)."""
        self._saved_stdout: Any = None
        self._warn_filters: Any = None

    def enter(self, epochs: int, *, one_batch: bool = False) -> None:
        """Suppress the script's output while ``epochs`` completed epochs run without data
        (``one_batch``: with one training batch each, for a wrapped training loader)."""
        if self.active:
            return
        self.active = True
        how = ("with one training batch each (the training loader is read through a wrapper)"
               if one_batch else "without loading data")
        say(f"fast-forwarding {epochs} completed epoch(s) {how} "
            "(script output suppressed until the resume point); the epoch loop is not a "
            "for ... in range() or while loop, so its end-of-epoch code (validation, saving, "
            "logging) runs again, with stdout and torch.save suppressed")
        self._saved_stdout = sys.stdout
        sys.stdout = _NullWriter()
        self._warn_filters = warnings.filters[:]
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")

    def exit(self) -> None:
        """Give the script its stdout and warnings back (idempotent)."""
        if self.active:
            self.active = False
            if self._saved_stdout is not None:
                sys.stdout = self._saved_stdout
                self._saved_stdout = None
                warnings.filters[:] = self._warn_filters  # type: ignore[index]

    def on_script_failed(self) -> None:
        """The excepthook: a script that breaks while fast-forwarding with evaluation loaders cut
        to one batch gets them in full in the next attempt (the ``ff_eval_run`` file)."""
        if self.active and self.ff_eval == "one":
            self.exit()
            say("the script failed while fast-forwarding with evaluation loaders cut to one "
                "batch; the next attempt runs them in full (fallback)")
            self._fallback_path.touch()
