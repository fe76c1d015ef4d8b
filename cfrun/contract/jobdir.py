"""The job directory: the on-disk contract between the supervisor, the ranks and later commands.

Layout::

    <job_dir>/
      job.lock                  filelock held by the live supervisor (released by the OS on death)
      agent.json                the persist agent's pid, socket name, slot dir (contract.ipc)
      config.json               resolved RunConfig, cfrun version, format version
      identity.json             job id, job name, command fingerprint (contract.config.Identity),
                                one per node (identity-node1.json ...)
      events.jsonl              one JSON object per line (kinds: cfrun.contract.events.EVENTS)
      strategy.json             the policy's current plan (rank 0's tuner)
      profiles/<fingerprint>.json  the policy's cached profiles
      checkpoints/step-000120/  rank-00000.bin, rank-00000.json, ... then manifest.json (last)
      checkpoints/.staging-*/   checkpoints being written; never read, removed at startup
      checkpoints.previous-<UTC time>/  a finished job's checkpoints, set aside when its
                                command changed and a new run started over (never read)

Only the job's user may read it (issue 12, the local trust boundary): the directory and
``checkpoints/`` are 0700, the files cfrun creates here 0600, and the lock and the events are
opened without following links (a link found there is refused, not written through).

The supervisor's and the ranks' coordination files (stop request and decision, marks, rank
errors, heartbeats) are named in :mod:`cfrun.contract.coordination`; every other name of the
layout is a constant or a property here, and no other module spells one.

Events, heartbeats and marks are best effort (issue 13, "a full disk"): a write the disk refuses
is dropped, counted and said once per outage on stderr (:data:`best_effort`), never raised, so
a full or read-only job dir never kills the supervisor, the agent or a rank.

:class:`JobDir` keeps the layout's paths, the tree's creation and checks and the directory's
identity; what is written into two of its files has a room of its own: ``events.jsonl`` in
:mod:`cfrun.contract.eventlog` (:class:`~cfrun.contract.eventlog.EventLog`, and the count of
dropped writes, :data:`best_effort`), ``job.lock`` in :mod:`cfrun.contract.joblock`
(:class:`~cfrun.contract.joblock.JobLock`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Any

from cfrun.contract.errors import BadInputError, FatalJobError
from cfrun.contract.eventlog import (  # noqa: F401  (best_effort ...: re-exported)
    BestEffortWrites,
    EventLog,
    best_effort,
)
from cfrun.contract.fsio import atomic_write_json, fsync_dir  # noqa: F401  (re-exported)
from cfrun.contract.joblock import JobLock

CHECKPOINTS = "checkpoints"
PROFILES = "profiles"
LOGS = "logs"
"""``logs/``: torchrun's own output per attempt (``attempt-N.log``) and its ``--log-dir``."""
TORCHRUN_LOGS = "torchrun"
"""``logs/torchrun/``: torchrun's ``--log-dir`` (:meth:`JobDir.private_torchrun_logs`)."""
"""The policy's cached profiles (cfrun.rank.tuner)."""
EVENTS = "events.jsonl"
IDENTITY = "identity.json"
"""The job's identity, shared by every node (:class:`cfrun.contract.config.Identity`)."""
FOREIGN_PREFIX = "foreign-"
"""A checkpoint of another job found in ``checkpoints/``, set aside by the supervisor."""
STRATEGY = "strategy.json"
"""Rank 0's current plan of this attempt (:meth:`cfrun.rank.tuner.Tuner.plan`), followed by the
other ranks and read by the CLI."""
CONFIG_STEM, AGENT_STEM, LOCK_STEM = "config", "agent", "job"
"""``config.json``, ``agent.json``, ``job.lock``: one per node (``config-node1.json`` ...)."""
COMMIT_LOCK = ".commit.lock"
"""Lock in ``checkpoints/`` the agents of several nodes take to commit a step."""
DIR_MODE = 0o700
"""Mode of the job dir and the directories cfrun makes in it."""
FILE_MODE = 0o600
"""Mode of the files cfrun creates in the job dir."""
PREVIOUS_CHECKPOINTS_PREFIX = "checkpoints.previous-"
"""``checkpoints.previous-<UTC time>/``: a finished job's ``checkpoints/`` set aside
(:meth:`JobDir.set_aside_checkpoints`)."""
STAGING_PREFIX = ".staging-"
STEP_PREFIX = "step-"


def step_dir_name(step: int) -> str:
    """``step-000120`` for step 120: names sort in step order."""
    return f"{STEP_PREFIX}{step:06d}"


_STEP_DIR = re.compile(r"step-([0-9]{1,18})", re.ASCII)


def parse_step_dir_name(name: str) -> int | None:
    """The step of a ``step-NNNNNN`` name, or None for any other name.

    Only ASCII digits count: ``str.isdigit`` accepts ``step-\u00b2`` (then ``int()`` fails) and
    ``int()`` accepts other scripts' digits (``step-\u0663`` would read as step 3), so a name
    planted at level 2 could stop a flusher or pose as a step (issue 24, item 9)."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def check_ancestors(path: Path | str) -> None:
    """Refuse a job dir that another user could swap: every existing directory above ``path``
    (its real path: a link is judged by where it leads) must be owned by root or by this user,
    and not writable by others unless sticky (``/tmp``: others may not rename what is ours),
    as OpenSSH's StrictModes asks of ``~/.ssh``. Whoever can write an ancestor can rename the
    running job's dir away and put one of their own in its place; the next restart would load
    their checkpoint (issue 24, item 3).

    A directory writable by its group (a cluster's setgid project dir, a Kubernetes volume
    mounted with ``fsGroup``, a checkout of mode 775) is said in one warning line instead of
    refused, when the job dir is made (not on every run of the job: issue 37, item 7). What
    guards the job is what the warning says (issue 32, finding 2: a group member swapped the job
    dir as the ranks started and the job resumed from their checkpoint): the job dir is
    re-identified by device and inode by the supervisor before each attempt, by every rank
    before it reads anything of it (:meth:`cfrun.rank.runtime.Runtime.check_job_dir`) and by the
    agent before each commit (:meth:`JobDir.check_same`), and a manifest is read only with the
    job dir's MAC (:meth:`cfrun.contract.manifest.Manifest.check_mac`): a swap stops the job
    (exit 5), a planted checkpoint is never resumed from. Refusing such ancestors would refuse
    the setgid project dirs and ``fsGroup`` volumes where many clusters train.

    Raises:
        BadInputError: an ancestor owned by another user, or writable by others without the
            sticky bit; one line naming it and the fix (exit 2, nothing started).
    """
    me = os.getuid()
    here = Path(os.path.realpath(Path(path).absolute()))
    is_new = not here.exists()
    for d in here.parents:
        try:
            st = os.stat(d)
        except FileNotFoundError:
            continue  # created by cfrun, private
        if st.st_uid not in (0, me):
            raise BadInputError(
                f"--job-dir {str(path)!r} lies under {str(d)!r}, owned by uid {st.st_uid}: that "
                "user could swap the job dir; give a --job-dir under a directory of your own")
        if st.st_mode & stat.S_ISVTX:
            continue
        if st.st_mode & 0o002:
            raise BadInputError(
                f"--job-dir {str(path)!r} lies under {str(d)!r}, writable by others: they could "
                f"swap the job dir; run `chmod o-w {d}` or give a --job-dir elsewhere")
        if st.st_mode & 0o020 and is_new:
            print(f"cfrun: warning: --job-dir {str(path)!r} lies under {str(d)!r}, writable by "
                  "its group: a member who swaps the job dir "
                  "stops the job (every rank checks its identity before reading it, exit 5) "
                  f"but cannot feed it a checkpoint; `chmod g-w {d}` closes this",
                  file=sys.stderr)


class JobDir:
    """Paths and small operations on one job directory: its layout, its tree and identity.

    Any process may construct it; only the supervisor calls :meth:`lock`. The events and the
    lock are kept by collaborators (:attr:`event_log`, :class:`~cfrun.contract.joblock.JobLock`).
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).absolute()
        self.event_log = EventLog(self.root / EVENTS)
        """``events.jsonl`` (:class:`~cfrun.contract.eventlog.EventLog`)."""
        self._lock: JobLock | None = None

    @property
    def config_path(self) -> Path:
        from cfrun.contract.settings import node_suffix

        return self.root / f"{CONFIG_STEM}{node_suffix()}.json"  # one per node in a shared job dir

    def config_path_of(self, suffix: str) -> Path:
        """The config of the node whose :func:`~cfrun.contract.settings.node_suffix` is
        ``suffix`` (``cfrun resume --node-rank``)."""
        return self.root / f"{CONFIG_STEM}{suffix}.json"

    @property
    def identity_path(self) -> Path:
        """``identity.json`` (:data:`IDENTITY`); one per node, as the config
        (``identity-node1.json``): the nodes of a job may run different arguments."""
        from cfrun.contract.settings import node_suffix

        return self.root / f"{Path(IDENTITY).stem}{node_suffix()}.json"

    @property
    def events_path(self) -> Path:
        return self.event_log.path

    @property
    def strategy_path(self) -> Path:
        """``strategy.json`` (:data:`STRATEGY`)."""
        return self.root / STRATEGY

    @property
    def profiles(self) -> Path:
        """``profiles/``: the policy's cache, one ``<fingerprint>.json`` per job fingerprint."""
        return self.root / PROFILES

    def profile_path(self, fingerprint: str) -> Path:
        """``profiles/<fingerprint>.json``."""
        return self.profiles / f"{fingerprint}.json"

    @property
    def commit_lock_path(self) -> Path:
        """``checkpoints/.commit.lock`` (:data:`COMMIT_LOCK`)."""
        return self.checkpoints / COMMIT_LOCK

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def logs(self) -> Path:
        """``logs/`` (:data:`LOGS`)."""
        return self.root / LOGS

    @property
    def torchrun_logs(self) -> Path:
        """``logs/torchrun/`` (:data:`TORCHRUN_LOGS`)."""
        return self.logs / TORCHRUN_LOGS

    def private_torchrun_logs(self) -> Path:
        """Make ``logs/torchrun/`` 0700 (created if missing) and drop group and other bits of
        every directory and regular file below it of this user; returns its path. torchrun
        creates its per-run and per-rank directories there with the process's umask (0755:
        issue 32, finding 6), so the supervisor calls this before and after each attempt.
        Links below are neither followed nor changed (``lstat`` first; nobody else can
        write below a 0700 directory to swap one in).

        Raises:
            BadInputError: ``logs/torchrun`` is a symbolic link or not a directory.
        """
        top = self.torchrun_logs
        _private_subdir(top)
        for where, dirs, files in os.walk(top, followlinks=False):
            for name in dirs + files:
                path = os.path.join(where, name)
                try:
                    st = os.lstat(path)
                    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 and \
                            (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
                except OSError:
                    pass  # gone meanwhile: nothing to change
        return top

    def attempt_output_path(self, attempt: int) -> Path:
        """``logs/attempt-N-output.log`` (``attempt-N-node1-output.log`` on node 1): what the
        ranks printed during attempt N, as the console showed it
        (:mod:`cfrun.supervisor.console`)."""
        from cfrun.contract.settings import node_suffix

        return self.logs / f"attempt-{attempt}{node_suffix()}-output.log"

    def attempt_log_path(self, attempt: int) -> Path:
        """``logs/attempt-N.log`` (``attempt-N-node1.log`` on node 1): what torchrun itself
        wrote during attempt N (:mod:`cfrun.supervisor.torchrun_log`)."""
        from cfrun.contract.settings import node_suffix

        return self.logs / f"attempt-{attempt}{node_suffix()}.log"

    @property
    def agent_path(self) -> Path:
        from cfrun.contract.settings import node_suffix

        return self.root / f"{AGENT_STEM}{node_suffix()}.json"  # one agent per node

    @property
    def lock_path(self) -> Path:
        from cfrun.contract.settings import node_suffix

        return self.root / f"{LOCK_STEM}{node_suffix()}.lock"  # one supervisor per node

    def check_usable(self) -> None:
        """Raise if ``root`` exists but cannot be a job dir (a file, or a foreign directory).

        Raises:
            BadInputError: ``root`` is a file, a directory of another user, or a non-empty
                directory without ``config.json`` that is not a job dir (cfrun never writes
                into someone else's directory).
        """
        if self.root.exists() and not self.root.is_dir():
            raise BadInputError(
                f"--job-dir {str(self.root)!r} is a file; give a directory path (it is created)"
            )
        check_ancestors(self.root)
        if self.root.is_dir() and self.root.stat().st_uid != os.getuid():
            raise BadInputError(
                f"--job-dir {str(self.root)!r} belongs to uid {self.root.stat().st_uid}, not to "
                f"you (uid {os.getuid()}); give a directory of your own or a new path"
            )
        if self.root.is_dir() and any(self.root.iterdir()) and not self._looks_like_job_dir():
            raise BadInputError(
                f"--job-dir {str(self.root)!r} is a non-empty directory that is not a cfrun job "
                "dir; give a new or empty directory"
            )

    def _looks_like_job_dir(self) -> bool:
        """Written by cfrun: a node's config or lock (several nodes share one job dir and
        start at about the same time), the events or the checkpoints."""
        return (any(self.root.glob(f"{CONFIG_STEM}*.json"))
                or any(self.root.glob(f"{LOCK_STEM}*.lock"))
                or self.events_path.exists() or self.checkpoints.is_dir())

    def create(self) -> None:
        """Create the directory tree (idempotent): the job dir, ``checkpoints/``, ``logs/`` and
        the ``profiles/`` cache 0700 (an existing one of this user, e.g. from an older cfrun, is
        made 0700 too).

        Raises:
            BadInputError: ``checkpoints``, ``profiles`` or ``logs`` is a symbolic link or not
                a directory.
        """
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        _make_private_dir(self.root)
        for sub in (self.checkpoints, self.profiles, self.logs):
            _private_subdir(sub)

    def set_aside_checkpoints(self) -> Path:
        """Move ``checkpoints/`` to ``checkpoints.previous-<UTC time>`` in the job dir (a
        rename: nothing is copied or deleted) and make a new empty ``checkpoints/``; returns
        where they went. With the lock held (:meth:`lock`).

        Raises:
            FatalJobError: the rename or the new directory failed (nothing was removed; the
                message names the path and the error).
        """
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        dst = self.root / f"{PREVIOUS_CHECKPOINTS_PREFIX}{stamp}"
        n = 1
        while dst.exists():
            n += 1
            dst = self.root / f"{PREVIOUS_CHECKPOINTS_PREFIX}{stamp}-{n}"
        try:
            os.rename(self.checkpoints, dst)
            self.checkpoints.mkdir(mode=DIR_MODE)
            fsync_dir(self.root)
        except OSError as e:
            raise FatalJobError(f"cannot move {str(self.checkpoints)!r} aside to {str(dst)!r} "
                                f"({e.strerror or e}); move or remove it yourself, or give a "
                                "new --job-dir") from None
        return dst

    def lock(self) -> None:
        """Take the job dir's lock for this process's lifetime.

        The lock is an OS file lock (``flock``), so a cfrun that died leaves no stale lock.

        Raises:
            JobDirLockedError: another live process holds it.
            BadInputError: the lock path is a symbolic link.
        """
        lock = JobLock(self.lock_path, self.root)
        lock.acquire()
        self._lock = lock

    def dir_id(self) -> tuple[int, int]:
        """The job dir's (device, inode), the link itself if it is one: what identifies the
        directory the lock was taken in.

        Raises:
            OSError: the job dir is gone.
        """
        st = os.stat(self.root, follow_symlinks=False)
        return st.st_dev, st.st_ino

    def check_same(self, expected: tuple[int, int]) -> None:
        """Raise unless the job dir is still the directory whose :meth:`dir_id` was
        ``expected``: renamed away and replaced by another (whoever could write an ancestor, or
        an accident) means its checkpoints are not this job's. The supervisor checks before each
        attempt (the ranks load then), the agent before each commit (issue 24, item 3).

        Raises:
            FatalJobError: the job dir was replaced or removed; nothing is loaded or committed.
        """
        try:
            now: tuple[int, int] | None = self.dir_id()
        except OSError:
            now = None
        if now != expected:
            raise FatalJobError(
                f"job dir {str(self.root)!r} was {'removed' if now is None else 'replaced'} "
                "while the job ran (another directory now has its name); stopped: nothing of "
                "it is loaded or committed. Find out who moved it, then start the job again")

    def unlock(self) -> None:
        """Give the lock back (nothing when not held)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def is_locked(self) -> bool:
        """True when a live process holds the lock; reads only, so a read-only job dir answers
        too (:meth:`cfrun.contract.joblock.JobLock.is_held`).

        Raises:
            BadInputError: the lock path is a symbolic link.
        """
        return JobLock(self.lock_path, self.root).is_held()

    def unwritable(self, error: OSError) -> BadInputError:
        """The one line (exit 2) for a job dir this command must write and cannot:
        ``error`` names the path; the fix depends on why (a read-only file system, a full
        disk, no permission)."""
        path = str(error.filename or self.root)
        why = error.strerror or str(error)
        if path != str(self.root):
            why += f": {path!r}"
        if error.errno == errno.EROFS:
            fix = ("give a --job-dir on a writable disk, or remount it read-write (cfrun "
                   "status, ls and export read it as it is)")
        elif error.errno in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space there, or give a --job-dir on another disk"
        else:
            fix = "make it writable by this user, or give another --job-dir"
        return BadInputError(f"job dir {str(self.root)!r} cannot be written ({why}); {fix}")

    def emit_event(self, kind: str, **fields: Any) -> None:
        """Append one event to ``events.jsonl``, best effort: a write the disk refuses is
        dropped and counted, never raised (:meth:`cfrun.contract.eventlog.EventLog.append`).

        Raises:
            EventSchemaError: an undeclared kind or field, under test only.
            BadInputError: ``events.jsonl`` is a symbolic link (never written through).
        """
        self.event_log.append(kind, **fields)

    def read_events(self) -> list[dict[str, Any]]:
        """All events, oldest first; a torn last line (a crash mid-append) is skipped."""
        return self.event_log.read()


def _private_subdir(path: Path) -> None:
    """Create ``path`` (one level, mode 0700) unless it exists, refuse it when it is a link or
    not a directory, and make it private (:func:`_make_private_dir`).

    Raises:
        BadInputError: ``path`` is a symbolic link or not a directory.
    """
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        pass
    if path.is_symlink() or not path.is_dir():
        raise BadInputError(f"{str(path)!r} is not a directory (a link?); remove it, "
                            "cfrun creates it")
    _make_private_dir(path)


def _make_private_dir(path: Path) -> None:
    """Drop group and other bits of ``path`` (a directory) if it has any and is ours."""
    st = os.stat(path)
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
