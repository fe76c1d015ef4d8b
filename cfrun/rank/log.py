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

    def __init__(self, jobdir: JobDir, rank: int, step: Callable[[], int],
                 verifying: bool = False) -> None:
        self.jobdir = jobdir
        self.rank = rank
        self.step = step
        """The current step (for the event)."""
        self.verifying = verifying
        """A run of ``cfrun verify``, whose report answers the doubt: no hint to run it."""
        self.reasons: list[str] = []

    def flag(self, reason: str) -> None:
        """Record and loudly report (once) that the resume of this run may not be exact; after
        the first reason, rank 0 says once how to settle it (:data:`VERIFY_HINT`)."""
        if reason not in self.reasons:
            self.reasons.append(reason)
            say(f"WARNING: resume may not be exact: {reason}")
            if self.rank == 0:
                if len(self.reasons) == 1 and not self.verifying:
                    say(VERIFY_HINT)
                self.jobdir.emit_event("not_exact", reason=reason, step=self.step())


VERIFY_HINT = ("to know whether it is, run `cfrun verify` with this job's script and arguments: "
               "it kills a copy of the job and compares it bit for bit with an uninterrupted "
               "run (docs: troubleshooting, \"cfrun says not exact\")")
"""Said once by rank 0 after its first ``resume may not be exact`` (the warning is a doubt:
a script can resume exactly although cfrun cannot prove it, e.g. minGPT's ``Trainer`` loop)."""
