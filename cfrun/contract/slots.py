"""Where snapshot slots live, and the checks every process makes on them (torch-free).

A *slot* is a file in shared memory that a rank fills with its state and the node's persist agent
reads (``cfrun.rank.snapshot``). Slots hold the training state in clear, so they live in a
private directory of the job (issue 12, the local trust boundary):

* **The slot directory** ``<base>/cfrun-<job hash><node suffix>_<random>``, base ``$CFRUN_SHM_DIR``
  or ``/dev/shm``, is made by the supervisor when it starts (``mkdtemp``: an exclusive
  ``mkdir``, mode 0700, a name nobody can guess) and passed to the agent, which publishes it in
  ``agent.json`` for the ranks. When it has no room the ranks use ``<job_dir>/.slots`` (0700,
  inside the 0700 job dir) instead.
* **Slot files** ``rank<R>-<pid>-<random>.slot`` are created exclusively (``O_CREAT|O_EXCL|
  O_NOFOLLOW``), mode 0600.
* **The agent** opens a slot only inside one of those two directories, by name, without
  following a link (``openat`` on the directory, ``O_NOFOLLOW``), and only if the directory and
  the file belong to its uid, the directory has no group or other bits, the file is regular and
  at least as large as the message says (:func:`open_slot`).
* **Cleanup** never follows a link and never deletes what it does not own: a foreign file next
  to ours stays, and so does its directory (:func:`remove_dirs`, :func:`remove_dead_slots`).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from cfrun.contract.settings import SHM_DIR as ENV_SHM_DIR

FALLBACK = ".slots"
"""The slot directory inside the job dir, used when the shared-memory one has no room."""
SUFFIX = ".slot"


class SlotRefused(ValueError):
    """A slot named in a message is not a private slot of this job; the message says why."""


def dir_prefix(job_dir: Path | str) -> str:
    """``cfrun-<12 hex of the job dir's path><node suffix>``: the slot directories of one job
    dir on this node start with it plus ``_`` (another node's have ``-node<R>`` before it)."""
    from cfrun.contract.settings import node_suffix

    digest = hashlib.sha1(str(Path(job_dir).absolute()).encode()).hexdigest()[:12]
    return f"cfrun-{digest}{node_suffix()}"


def shm_base() -> Path | None:
    """``$CFRUN_SHM_DIR``, else ``/dev/shm`` when it is a writable directory, else None."""
    env = os.environ.get(ENV_SHM_DIR)
    if env:
        return Path(env)
    dev_shm = Path("/dev/shm")
    if dev_shm.is_dir() and os.access(dev_shm, os.W_OK):
        return dev_shm
    return None


def fallback_dir(job_dir: Path | str) -> Path:
    """``<job_dir>/.slots``."""
    return Path(job_dir).absolute() / FALLBACK


def create_dir(job_dir: Path | str) -> Path | None:
    """Make a fresh private slot directory in shared memory (the supervisor, at start).

    Returns None when there is no shared-memory base (the ranks use :func:`fallback_dir`)."""
    base = shm_base()
    if base is None:
        return None
    try:
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=dir_prefix(job_dir) + "_", dir=base))
    except OSError:
        return None


def ensure_private(directory: Path) -> None:
    """Create ``directory`` 0700 if missing; check that it is a directory of ours (not a link)
    without group or other bits.

    Raises:
        SlotRefused: it is a link, not a directory, another user's, or open to others.
    """
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    _check_dir(directory, st)


def is_private_dir(directory: Path) -> bool:
    """True when ``directory`` exists as a directory of ours (not a link), mode 0700."""
    try:
        _check_dir(directory, os.lstat(directory))
    except (OSError, SlotRefused):
        return False
    return True


def _check_dir(directory: Path, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise SlotRefused(f"slot directory {str(directory)!r} is not a directory (a link?)")
    if st.st_uid != os.getuid():
        raise SlotRefused(f"slot directory {str(directory)!r} belongs to uid {st.st_uid}, "
                          f"not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise SlotRefused(f"slot directory {str(directory)!r} has mode "
                          f"{stat.S_IMODE(st.st_mode):o}, not 0700")


MEMORY_FS_TYPES = frozenset({"tmpfs", "hugetlbfs"})
"""File systems whose file mappings ``cudaHostRegister`` can page-lock. A mapping of a file on
a disk file system (ext4, xfs: the ``<job_dir>/.slots`` fallback when /dev/shm is small, e.g.
Docker's 64 MiB) fails with "invalid argument" (issue 23)."""


def fs_type(path: Path | str) -> str | None:
    """The type of the file system ``path`` lies on (``tmpfs``, ``ext4``...): the mount of
    ``/proc/self/mounts`` with the longest mount point that contains ``path``'s real path;
    None when that table cannot be read (not Linux)."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ").replace("\\011", "\t")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        return None
    return kind


def is_memory_fs(path: Path | str) -> bool:
    """True when ``path`` lies on a file system in :data:`MEMORY_FS_TYPES` (its mappings can be
    page-locked for CUDA)."""
    return fs_type(path) in MEMORY_FS_TYPES


def create_slot(directory: Path, rank: int, nbytes: int) -> Path:
    """Create a new slot file of ``nbytes`` zero bytes in ``directory`` (a rank): exclusively,
    without following a link, mode 0600, under a name nobody can guess. Returns its path."""
    path = directory / f"rank{rank:05d}-{os.getpid()}-{secrets.token_hex(8)}{SUFFIX}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def open_slot(slot: str, allowed: Iterable[Path], nbytes: int) -> int:
    """Open the slot ``slot`` read-only for the agent; returns the file descriptor.

    ``slot`` must name a file directly inside one of the ``allowed`` directories; it is opened
    by name relative to that directory without following links or blocking (a FIFO), and both
    must be ours: the directory 0700, the file regular with at least ``nbytes`` bytes.

    Raises:
        SlotRefused: any of that does not hold (the message names the check).
    """
    path = Path(os.path.normpath(slot))
    if not path.is_absolute() or path.name in ("", ".", "..") or \
            path.parent not in {Path(os.path.normpath(a)) for a in allowed}:
        raise SlotRefused(f"slot {slot!r} is not in this job's private slot directory")
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SlotRefused(f"slot directory {str(path.parent)!r}: {e.strerror}") from None
    try:
        _check_dir(path.parent, os.fstat(dir_fd))
        try:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dir_fd)
        except OSError as e:
            why = "is a symbolic link" if e.errno == errno.ELOOP else e.strerror
            raise SlotRefused(f"slot {slot!r} {why}") from None
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SlotRefused(f"slot {slot!r} is not a regular file")
        if st.st_uid != os.getuid():
            raise SlotRefused(f"slot {slot!r} belongs to uid {st.st_uid}, not {os.getuid()}")
        if st.st_size < nbytes:
            raise SlotRefused(f"slot {slot!r} holds {st.st_size} bytes, fewer than the "
                              f"{nbytes} the message names")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _slot_pid(name: str) -> int | None:
    """The pid in a slot file name ``rank<R>-<pid>-<random>.slot``, or None."""
    parts = name.removesuffix(SUFFIX).split("-")
    if len(parts) != 3 or not name.endswith(SUFFIX) or not parts[0].startswith("rank"):
        return None
    try:
        return int(parts[1])
    except ValueError:
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _own_entries(directory: Path) -> list[os.DirEntry[str]]:
    """Entries of ``directory`` (a directory of ours, not a link) owned by this uid."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return []
    out = []
    with os.scandir(directory) as it:
        for entry in it:
            try:
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    out.append(entry)
            except OSError:
                continue
    return out


def remove_dead_slots(directories: Iterable[Path]) -> int:
    """Delete slot files of ours in ``directories`` whose rank process is gone (a rank, once
    the agent drained its predecessors' work). Links and foreign files are left alone.
    Returns the number deleted."""
    n = 0
    for directory in directories:
        for entry in _own_entries(directory):
            pid = _slot_pid(entry.name)
            if pid is None or pid == os.getpid() or _pid_alive(pid) \
                    or entry.is_dir(follow_symlinks=False):
                continue  # (a link is unlinked itself, never followed)
            try:
                os.unlink(entry.path)
                n += 1
            except FileNotFoundError:
                pass
    return n


def remove_dirs(job_dir: Path | str) -> int:
    """Delete this node's slot directories of ``job_dir`` and the slot files of ours in them
    (the supervisor, at the start and the end of a job). Links are unlinked, never followed;
    a directory that still holds a foreign file stays. Returns the number of files deleted."""
    prefix = dir_prefix(job_dir) + "_"
    candidates = [fallback_dir(job_dir)]
    for base in {b for b in (shm_base(), Path("/dev/shm")) if b is not None}:
        try:
            with os.scandir(base) as it:
                candidates += [Path(e.path) for e in it if e.name.startswith(prefix)]
        except OSError:
            continue
    return sum(remove_dir(d) for d in candidates)


def remove_dir(directory: Path) -> int:
    """Delete our files in ``directory`` (a directory of ours, not followed if a link) and then
    the directory if that leaves it empty. Returns the number of files deleted."""
    n = 0
    for entry in _own_entries(directory):
        try:
            if entry.is_dir(follow_symlinks=False):
                continue  # we make no sub-directories; leave it
            os.unlink(entry.path)
            n += 1
        except OSError:
            continue
    try:
        st = os.lstat(directory)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            os.rmdir(directory)
    except OSError:
        pass  # not empty (a foreign file), or gone
    return n
