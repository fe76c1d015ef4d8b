"""Errors cfrun reports to users, each with its exit code and the next thing to try.

Exit codes are a public contract (README, "Exit codes"); Kubernetes ``podFailurePolicy`` rules and
batch schedulers match on them, so they never change meaning.
"""

from __future__ import annotations

from typing import ClassVar

EXIT_SUCCESS = 0
"""The script exited 0."""
EXIT_INTERNAL = 1
"""cfrun itself failed unexpectedly (a bug: the traceback is printed)."""
EXIT_BAD_INPUT = 2
"""Bad command line, script path, option value or job dir. Nothing was started or changed."""
EXIT_LOCKED = 3
"""The job dir is held by another live cfrun."""
EXIT_FAILED = 4
"""The script kept failing until ``--max-restarts`` ran out. Retrying may help."""
EXIT_FATAL = 5
"""The same failure repeated (crash loop) or the job dir is unusable. Retrying will not help."""
EXIT_NOT_EXACT = 6
"""``cfrun verify``: the resume of the script is not exact (a killed run's state at the stop
step differs from the uninterrupted run's, or a kill recomputed more than K+1 steps)."""
EXIT_UNAVAILABLE = 69
"""``cfrun peer`` cannot listen on the address given (in use, or not an address of this host)
(EX_UNAVAILABLE)."""
EXIT_PREEMPTED = 75
"""Stopped by SIGTERM/SIGINT; the job is resumable from its newest checkpoint (EX_TEMPFAIL)."""


class CfrunError(Exception):
    """Base of errors shown to users as one line plus a hint.

    The CLI catches it once, prints ``cfrun: error: <message>`` and ``hint``, and exits with
    ``exit_code``.
    """

    exit_code: ClassVar[int] = EXIT_INTERNAL
    hint: ClassVar[str | None] = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        if hint is not None:
            self.hint = hint  # type: ignore[misc]


class BadInputError(CfrunError):
    """A value given by the user is invalid; the message names it and the fix."""

    exit_code = EXIT_BAD_INPUT


class ChangedCommandError(BadInputError):
    """The job dir holds checkpoints of a job run with another command
    (:func:`cfrun.contract.config.check_identity`); the CLI adds the command line that goes on
    with the change as the hint."""


class JobDirLockedError(CfrunError):
    """Another live cfrun holds the job dir's lock."""

    exit_code = EXIT_LOCKED
    hint = "another cfrun is running this job; wait for it, or use another --job-dir"


class JobFailedError(CfrunError):
    """The script failed more often than ``--max-restarts`` allows."""

    exit_code = EXIT_FAILED


class FatalJobError(CfrunError):
    """A failure that retrying will not fix (crash loop, unusable job dir)."""

    exit_code = EXIT_FATAL


class CheckpointCorruptError(CfrunError):
    """A checkpoint's files do not match its manifest (size or checksum)."""

    exit_code = EXIT_FATAL


class ForeignCheckpointError(CheckpointCorruptError):
    """A checkpoint's manifest is not authenticated by this job's key (no MAC where one is due,
    or one under another key): another job's or a forged checkpoint. It is skipped, never
    moved nor deleted: it is not the job's to move."""


class IncompatibleFormatError(CfrunError):
    """A manifest has a ``format_version`` this cfrun cannot read."""

    exit_code = EXIT_FATAL
    hint = "upgrade cfrun, or start a new job dir"


class PeerBindError(CfrunError):
    """``cfrun peer`` cannot bind its ``--listen`` address."""

    exit_code = EXIT_UNAVAILABLE
    hint = "pick a free port, or an address of this host (`ip addr`); see `ss -ltn`"
