"""What a rank says: its stderr lines, and the reasons its resume may not be exact."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from cfrun.contract.jobdir import JobDir


def say(msg: str) -> None:
    """A cfrun line on the rank's stderr, prefixed so it is told apart from the script's."""
    rank = os.environ.get("RANK", "0")  # `--launcher python`: no RANK, the only rank is 0
    try:
        sys.__stderr__.write(f"[cfrun rank {rank}] {msg}\n")  # type: ignore[union-attr]
        sys.__stderr__.flush()  # type: ignore[union-attr]
    except Exception:
        pass


def kill_self(msg: str) -> None:
    """Say ``msg`` (:func:`say`), flush the script's stdio streams so its last lines show, and
    SIGKILL this rank: ``--inject-crash`` and ``cfrun verify``'s planned kills, a real kill."""
    say(msg)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


class NotExact:
    """The reasons this run's resume may not be exact, each reported loudly once.

    Every phase that meets something it cannot restore exactly (a variable that cannot be
    stored, a loop it cannot find, an IterableDataset...) calls :meth:`flag`; checkpoints record
    :attr:`reasons` in their metadata. Rank 0 also writes a ``not_exact`` event. Training
    thread only.
    """

    def __init__(self, jobdir: JobDir, rank: int, step: Callable[[], int]) -> None:
        self.jobdir = jobdir
        self.rank = rank
        self.step = step
        """The current step (for the event)."""
        self.reasons: list[str] = []

    def flag(self, reason: str) -> None:
        """Record and loudly report (once) that the resume of this run may not be exact."""
        if reason not in self.reasons:
            self.reasons.append(reason)
            say(f"WARNING: resume may not be exact: {reason}")
            if self.rank == 0:
                self.jobdir.emit_event("not_exact", reason=reason, step=self.step())
