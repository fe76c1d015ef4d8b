"""``job.lock``: the job dir's lock file, held by the live supervisor of its node.

An OS file lock (``flock``, through :mod:`filelock`), so a cfrun that died leaves no stale lock.
The lock file is opened without following a link and created 0600
(:func:`cfrun.contract.fsio.open_private`). :class:`cfrun.contract.jobdir.JobDir` names the
file (:attr:`~cfrun.contract.jobdir.JobDir.lock_path`, one per node) and its ``lock`` /
``unlock`` / ``is_locked`` hand over to :class:`JobLock`. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

import filelock

from cfrun.contract.errors import BadInputError, JobDirLockedError
from cfrun.contract.fsio import FILE_MODE, open_private


class JobLock:
    """The lock file ``path`` of the job dir ``root``.

    Only the supervisor calls :meth:`acquire` (for its lifetime); any process may call
    :meth:`is_held`. Not thread-safe.

    Args:
        path: the lock file (``<job_dir>/job.lock``, ``job-node1.lock`` ...).
        root: the job dir, named in the error when another process holds the lock.
    """

    def __init__(self, path: Path, root: Path) -> None:
        self.path = path
        self.root = root
        self._lock: filelock.BaseFileLock | None = None

    def acquire(self) -> None:
        """Take the lock without waiting; kept until :meth:`release` or this process ends.

        Raises:
            JobDirLockedError: another live process holds it.
            BadInputError: the lock path is a symbolic link.
        """
        os.close(open_private(self.path, os.O_WRONLY))  # 0600, never a link
        lock = filelock.FileLock(str(self.path), timeout=0, mode=FILE_MODE)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise JobDirLockedError(
                f"job dir {str(self.root)!r} is in use by another cfrun") from None
        self._lock = lock

    def release(self) -> None:
        """Give the lock back (nothing when not held)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def is_held(self) -> bool:
        """True when a live process holds the lock. Reads only: a shared ``flock`` tried
        without blocking on a read-only descriptor, so the lock file is neither created nor
        truncated and a job dir on a read-only disk answers too (``cfrun status``, issue 37,
        item 3); a lock file that cannot be opened or locked counts as not held.

        Raises:
            BadInputError: the lock path is a symbolic link.
        """
        import fcntl

        if self.path.is_symlink():
            raise BadInputError(f"{str(self.path)!r} is a symbolic link; cfrun does not "
                                "write through links in a job dir: remove it")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                         | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
        return False
