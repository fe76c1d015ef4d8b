"""Level-2 storage (durable, usually remote): a plain directory or an fsspec URL.

The peer's flusher writes checkpoints here and a resume reads them back (ACUTE §IV-A: "Lv.2";
DESIGN.md §8). The layout is the job dir's own checkpoint layout, one prefix per job::

    <root>/<job>/step-000120/rank-00000.bin  rank-00000.json ... manifest.json (written LAST)

so a level-2 checkpoint is a set of portable files that any cfrun (or ``cfrun export`` after a
copy into a job dir) reads. Two implementations, chosen by the URL:

* :class:`DirStorage` for a plain path: every file is written into ``.staging-step-N``, fsynced,
  then the manifest, then an atomic rename and a directory fsync (as
  :mod:`cfrun.contract.checkpoints`);
* :class:`FsspecStorage` for ``scheme://`` URLs (``s3://``, ``gs://``, ``file://``, ...): object
  stores have no rename, so files go straight to their final keys and the manifest is written
  last; **a step counts only if its manifest exists and parses** (a flush cut short leaves files
  without a manifest, which are never used, and removed by the next :meth:`cleanup`). Deleting
  removes the manifest first. ``file://`` goes through fsspec too (no fsync: use a plain path for
  local durability).

``s3://`` uses s3fs; its endpoint comes from ``CFRUN_S3_ENDPOINT_URL`` (e.g. a MinIO or moto
server), else from the AWS configuration (``AWS_ENDPOINT_URL``, profiles, instance roles).

Testing/benchmark aid: the fault point ``storage.throttle_bytes_per_s`` of
:mod:`cfrun.contract.faults` limits every write of this module (and of the persist agent's local
writes) to that many bytes per second with a token bucket, to *simulate* network storage (ACUTE
§III-B measured EBS/EFS ~90% slower than a local SSD). :func:`throttle` reads the point once per
file written, not per chunk.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from cfrun.contract import faults, settings
from cfrun.contract.config import redact_url
from cfrun.contract.errors import BadInputError, CfrunError, CheckpointCorruptError
from cfrun.contract.fsio import UnsafeFileError, new_file_flags, read_regular, write_all
from cfrun.contract.jobdir import STAGING_PREFIX, parse_step_dir_name, step_dir_name
from cfrun.contract.manifest import MANIFEST, MAX_MANIFEST_BYTES, SHARD_FILE_RE, Manifest

WRITE_CHUNK_BYTES = 8 << 20
JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
FILE_RE = SHARD_FILE_RE


BELOW_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")
"""A directory between a level-2 root and its jobs (:func:`below`): a job name's characters,
and it may start with ``_``, which a job name may not (so ``<root>/_tenants`` is no job's)."""


def _check_below(name: str) -> str:
    if not isinstance(name, str) or not BELOW_RE.match(name) or ".." in name:
        raise ValueError(f"level-2 directory name {name!r} must match {BELOW_RE.pattern} "
                         "without '..'")
    return name


def check_job_name(job: str) -> str:
    """Return ``job`` if it is a safe single path component (``[A-Za-z0-9._-]``, <= 100 chars).

    Raises:
        ValueError: anything else (it becomes part of storage paths and keys).
    """
    if not isinstance(job, str) or not JOB_RE.match(job) or ".." in job:
        raise ValueError(f"job name {job!r} must match {JOB_RE.pattern} without '..'")
    return job


class Throttle:
    """A token bucket shared by the writers of one process (simulated network storage)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = bytes_per_s
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def take(self, nbytes: int) -> None:
        """Block until ``nbytes`` may be written at ``rate`` bytes per second."""
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + nbytes / self.rate
            wait_s = self.next_free - now
        if wait_s > 0:
            time.sleep(wait_s)


_THROTTLE: Throttle | None = None
_THROTTLE_LOCK = threading.Lock()


def throttle() -> Throttle | None:
    """This process's throttle if the fault point ``storage.throttle_bytes_per_s`` is armed, else
    None. Writers call it once per file and then :meth:`Throttle.take` per chunk."""
    global _THROTTLE
    rate = float(faults.value("storage.throttle_bytes_per_s") or 0)
    if rate <= 0:
        return None
    with _THROTTLE_LOCK:
        if _THROTTLE is None or _THROTTLE.rate != rate:
            _THROTTLE = Throttle(rate)
        return _THROTTLE


def _chunks(parts: Iterable[bytes | bytearray | memoryview]) -> Iterable[memoryview]:
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), WRITE_CHUNK_BYTES):
            yield view[start:start + WRITE_CHUNK_BYTES]


class CheckpointWriter(Protocol):
    """Writes one checkpoint: files in any order, then :meth:`commit` with the manifest."""

    def write_file(self, name: str, parts: Iterable[bytes | bytearray | memoryview]) -> int: ...

    def commit(self, manifest: Manifest | dict[str, Any]) -> None: ...

    def abort(self) -> None: ...


class Storage(Protocol):
    """A level-2 store. Thread-safe for different steps; one writer per step."""

    url: str
    shown: str
    """:attr:`url` as logs and replies show it: its password withheld (:func:`redact_url`)."""

    def list_steps(self, job: str) -> list[int]: ...

    def read_manifest(self, job: str, step: int) -> dict[str, Any]: ...

    def read_file(self, job: str, step: int, name: str, max_bytes: int) -> bytes: ...

    def begin(self, job: str, step: int) -> CheckpointWriter: ...

    def delete(self, job: str, step: int) -> None: ...

    def cleanup(self, job: str | None = None) -> int: ...


def _manifest_bytes(manifest: Manifest | dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` for a record (or its JSON form, checked as a reader
    would check it).

    Raises:
        CheckpointCorruptError, IncompatibleFormatError: ``manifest`` is not a valid one.
    """
    if not isinstance(manifest, Manifest):
        manifest = Manifest.from_json(manifest, "manifest to write")
    return manifest.dumps()


# ---------------------------------------------------------------------- plain directory

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkRefusedError(UnsafeFileError):
    """A path below a level-2 directory is a symbolic link (or not a directory where one must
    be): cfrun never writes, reads or deletes through it (issue 32, item 1). One line naming
    the path and the fix."""

    def __init__(self, path: Path | str, what: str = "a symbolic link") -> None:
        super().__init__(f"level 2: {path} is {what}; cfrun never writes, reads or deletes "
                         "through it: remove it (whoever could plant it can write the flush "
                         "dir)")


def _open_dir_at(parent_fd: int, name: str, where: Path, *, create: bool = False) -> int:
    """Open directory ``name`` in the open directory ``parent_fd`` without following a link
    (``O_NOFOLLOW | O_DIRECTORY``, relative to the fd: no component swapped in between);
    with ``create`` make it first (0700). ``where`` is its path, for messages.

    Raises:
        LinkRefusedError: a symbolic link, or not a directory.
        FileNotFoundError: missing (and not ``create``).
    """
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = "a symbolic link" if _is_link_at(parent_fd, name) else "not a directory"
            raise LinkRefusedError(where, kind) from None
        raise


def _is_link_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _kind_at(dir_fd: int, name: str) -> int | None:
    """``st_mode`` of ``name`` in ``dir_fd`` (a link itself, never its target); None: gone."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None


def _rmtree_at(parent_fd: int, name: str) -> None:
    """Remove ``name`` in ``parent_fd`` and all below it, never following a link: a link met
    on the way is removed itself (its target is untouched). Missing entries are skipped."""
    mode = _kind_at(parent_fd, name)
    if mode is None:
        return
    if not stat.S_ISDIR(mode):
        try:
            os.unlink(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        return
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link meanwhile
            os.unlink(name, dir_fd=parent_fd)
            return
        if e.errno == errno.ENOENT:
            return
        raise
    try:
        for child in os.listdir(fd):
            _rmtree_at(fd, child)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass


def _write_at(dir_fd: int, name: str, parts: Iterable[bytes | bytearray | memoryview]
              ) -> int:
    """Durably write file ``name`` in the open directory ``dir_fd``: a new temporary file
    (``O_EXCL | O_NOFOLLOW``) fsynced and renamed over ``name``, all relative to the fd.
    Returns the bytes written."""
    tmp = f".{name}.tmp-{secrets.token_hex(6)}"
    fd = os.open(tmp, new_file_flags(), 0o600, dir_fd=dir_fd)
    try:
        try:
            th = throttle()
            n, _ = write_all(fd, parts, before_chunk=None if th is None else th.take)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    return n


class _DirWriter:
    """One step's flush into ``<job>/.staging-step-N`` (through the job directory's fd),
    renamed to ``<job>/step-N`` at :meth:`commit`."""

    def __init__(self, job_fd: int, job_path: Path, step: int) -> None:
        self.job_fd = job_fd
        self.job_path = job_path
        self.name = step_dir_name(step)
        self.staging = f"{STAGING_PREFIX}{self.name}"
        self.staging_fd: int | None = None
        try:
            _rmtree_at(job_fd, self.staging)
            os.mkdir(self.staging, 0o700, dir_fd=job_fd)
            self.staging_fd = _open_dir_at(job_fd, self.staging, job_path / self.staging)
        except BaseException:
            self._close()
            raise

    def _close(self) -> None:
        if self.staging_fd is not None:
            os.close(self.staging_fd)
            self.staging_fd = None
        if self.job_fd >= 0:
            os.close(self.job_fd)
            self.job_fd = -1

    def write_file(self, name: str, parts: Iterable[bytes | bytearray | memoryview]) -> int:
        if not FILE_RE.match(name):
            raise ValueError(f"bad checkpoint file name {name!r}")
        assert self.staging_fd is not None
        return _write_at(self.staging_fd, name, parts)

    def commit(self, manifest: Manifest | dict[str, Any]) -> None:
        data = _manifest_bytes(manifest)
        assert self.staging_fd is not None
        os.fsync(self.staging_fd)
        _write_at(self.staging_fd, MANIFEST, [data])
        os.fsync(self.staging_fd)
        mode = _kind_at(self.job_fd, self.name)
        if mode is not None:  # the same step flushed before (a restarted peer): replace it
            if not stat.S_ISDIR(mode):
                raise LinkRefusedError(self.job_path / self.name,
                                       "a symbolic link" if stat.S_ISLNK(mode)
                                       else "not a directory")
            old = _open_dir_at(self.job_fd, self.name, self.job_path / self.name)
            try:
                os.unlink(MANIFEST, dir_fd=old)
            except FileNotFoundError:
                pass
            finally:
                os.close(old)
            _rmtree_at(self.job_fd, self.name)
        os.rename(self.staging, self.name, src_dir_fd=self.job_fd, dst_dir_fd=self.job_fd)
        os.fsync(self.job_fd)
        self._close()

    def abort(self) -> None:
        if self.job_fd >= 0:
            _rmtree_at(self.job_fd, self.staging)
        self._close()


class DirStorage:
    """Level 2 in a local or mounted directory, with fsync and atomic rename.

    The root (``--flush-to``, the operator's choice) may be reached through links; below it
    nothing is: every job and step directory is opened relative to its parent's fd with
    ``O_NOFOLLOW | O_DIRECTORY``, files with ``O_NOFOLLOW``, so a link planted at
    ``<root>/<job>`` or at a step directory fails that job's flush with one line naming it
    (:class:`LinkRefusedError`); nothing is written, read or deleted through it, and a step
    directory that is a link is no step (never listed, so never deleted by retention)."""

    def __init__(self, root: Path, below: tuple[str, ...] = ()) -> None:
        self.top = root.absolute()
        """``--flush-to`` itself (reached through links if the operator's path has them)."""
        self.below = tuple(_check_below(name) for name in below)
        """Directories between :attr:`top` and the jobs (a tenant's, :func:`below`), each
        opened like a job directory: never through a link."""
        self.root = self.top.joinpath(*self.below)
        self.url = str(self.root)
        self.shown = self.url

    def _job(self, job: str) -> Path:
        return self.root / check_job_name(job)

    def _open_root(self, *, create: bool = False) -> int:
        if create:
            self.top.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        where = self.top
        for name in self.below:
            where = where / name
            try:
                sub = _open_dir_at(fd, name, where, create=create)
            finally:
                os.close(fd)
            fd = sub
        return fd

    def _open_job(self, job: str, *, create: bool = False) -> int:
        """The job's directory, opened without following a link.

        Raises:
            LinkRefusedError: ``<root>/<job>`` is a link or not a directory.
            FileNotFoundError: it (or the root) is missing and not ``create``.
        """
        path = self._job(job)
        root = self._open_root(create=create)
        try:
            return _open_dir_at(root, path.name, path, create=create)
        finally:
            os.close(root)

    def _open_step(self, job: str, step: int) -> int:
        job_fd = self._open_job(job)
        try:
            name = step_dir_name(step)
            return _open_dir_at(job_fd, name, self._job(job) / name)
        finally:
            os.close(job_fd)

    def list_steps(self, job: str) -> list[int]:
        """Steps of ``job`` with a manifest file, newest first (not verified); step
        directories that are links are not steps.

        Raises:
            LinkRefusedError: ``<root>/<job>`` is a link.
        """
        try:
            job_fd = self._open_job(job)
        except FileNotFoundError:
            return []
        steps = []
        try:
            for name in os.listdir(job_fd):
                step = parse_step_dir_name(name)
                mode = _kind_at(job_fd, name) if step is not None else None
                if step is None or mode is None or not stat.S_ISDIR(mode):
                    continue
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=job_fd)
                except OSError:
                    continue
                try:
                    if _kind_at(fd, MANIFEST) is not None:
                        steps.append(step)
                finally:
                    os.close(fd)
        finally:
            os.close(job_fd)
        return sorted(steps, reverse=True)

    def read_manifest(self, job: str, step: int) -> dict[str, Any]:
        """Step ``step``'s manifest, parsed and checked (:meth:`Manifest.parse`), as JSON (the
        form ``cfrun peer``'s seals cover).

        Raises:
            CheckpointCorruptError: missing, not a regular file, reached through a link,
                oversized or malformed.
            IncompatibleFormatError: another format version.
        """
        path = self._job(job) / step_dir_name(step) / MANIFEST
        try:
            fd = self._open_step(job, step)
            try:
                raw = read_regular(MANIFEST, max_bytes=MAX_MANIFEST_BYTES, dir_fd=fd)
            finally:
                os.close(fd)
        except (UnsafeFileError, OSError) as e:
            raise CheckpointCorruptError(f"{path}: unreadable ({e})") from None
        return Manifest.parse(raw, str(path)).to_json()

    def read_file(self, job: str, step: int, name: str, max_bytes: int) -> bytes:
        """File ``name`` of step ``step``, at most ``max_bytes`` (the manifest's size for it).

        Raises:
            ValueError: ``name`` is not a checkpoint file's name.
            CheckpointCorruptError: larger than ``max_bytes``, not a regular file, reached
                through a link, or unreadable.
        """
        if not FILE_RE.match(name):
            raise ValueError(f"bad checkpoint file name {name!r}")
        path = self._job(job) / step_dir_name(step) / name
        try:
            fd = self._open_step(job, step)
            try:
                return bytes(read_regular(name, max_bytes=max_bytes, dir_fd=fd))
            finally:
                os.close(fd)
        except (UnsafeFileError, OSError) as e:
            raise CheckpointCorruptError(f"{path}: unreadable ({e})") from None

    def begin(self, job: str, step: int) -> _DirWriter:
        """Start writing step ``step`` of ``job`` (its directory made if missing).

        Raises:
            LinkRefusedError: ``<root>/<job>`` or the staging directory is a link.
        """
        return _DirWriter(self._open_job(job, create=True), self._job(job), step)

    def delete(self, job: str, step: int) -> None:
        """Delete step ``step`` of ``job``, manifest first; never through a link.

        Raises:
            LinkRefusedError: ``<root>/<job>`` or the step directory is a link.
        """
        try:
            job_fd = self._open_job(job)
        except FileNotFoundError:
            return
        try:
            name = step_dir_name(step)
            try:
                fd = _open_dir_at(job_fd, name, self._job(job) / name)
            except FileNotFoundError:
                return
            try:  # no longer counts, even if the rest stays
                os.unlink(MANIFEST, dir_fd=fd)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
            _rmtree_at(job_fd, name)
        finally:
            os.close(job_fd)

    def cleanup(self, job: str | None = None) -> int:
        """Remove staging directories (flushes cut short). Call when no flush runs. Job
        directories that are links are skipped (``job`` given: refused)."""
        n = 0
        try:
            root = self._open_root()
        except (FileNotFoundError, NotADirectoryError):
            return 0  # a link at a directory of :attr:`below` is refused (LinkRefusedError)
        try:
            names = [check_job_name(job)] if job else os.listdir(root)
            for name in names:
                try:
                    job_fd = _open_dir_at(root, name, self.root / name)
                except (FileNotFoundError, LinkRefusedError):
                    if job:
                        raise
                    continue
                try:
                    for entry in os.listdir(job_fd):
                        if entry.startswith(STAGING_PREFIX):
                            _rmtree_at(job_fd, entry)
                            n += 1
                finally:
                    os.close(job_fd)
        finally:
            os.close(root)
        return n


# ---------------------------------------------------------------------- fsspec URL


class _FsspecWriter:
    def __init__(self, fs: Any, prefix: str) -> None:
        self.fs = fs
        self.prefix = prefix
        try:  # a flush of this step cut short earlier: its manifest must not survive
            fs.rm(f"{prefix}/{MANIFEST}")
        except (FileNotFoundError, OSError):
            pass
        if hasattr(fs, "makedirs"):
            try:
                fs.makedirs(prefix, exist_ok=True)
            except OSError:
                pass

    def write_file(self, name: str, parts: Iterable[bytes | bytearray | memoryview]) -> int:
        th = throttle()
        n = 0
        with self.fs.open(f"{self.prefix}/{name}", "wb") as f:
            for chunk in _chunks(parts):
                if th is not None:
                    th.take(len(chunk))
                f.write(chunk)
                n += len(chunk)
        return n

    def commit(self, manifest: Manifest | dict[str, Any]) -> None:
        data = _manifest_bytes(manifest)
        with self.fs.open(f"{self.prefix}/{MANIFEST}", "wb") as f:  # last: makes it count
            f.write(data)

    def abort(self) -> None:
        try:
            self.fs.rm(self.prefix, recursive=True)
        except (FileNotFoundError, OSError):
            pass


class FsspecStorage:
    """Level 2 behind an fsspec URL: manifest written last, only steps with one count."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        """The URL as given, password and all: for fsspec only, never shown."""
        self.shown = redact_url(self.url) or ""
        """:attr:`url` with its password withheld: what logs and replies show."""
        protocol = self.url.split("://", 1)[0]
        options: dict[str, Any] = {}
        endpoint = settings.get_str(settings.S3_ENDPOINT_URL)
        if protocol in ("s3", "s3a") and endpoint:
            options["endpoint_url"] = endpoint
        if protocol in ("s3", "s3a"):
            options["use_listings_cache"] = False
        self.fs, self.base = fsspec.core.url_to_fs(self.url, **options)
        self.base = self.base.rstrip("/")

    def _job(self, job: str) -> str:
        return f"{self.base}/{check_job_name(job)}"

    def _invalidate(self) -> None:
        try:
            self.fs.invalidate_cache()
        except Exception:
            pass

    def list_steps(self, job: str) -> list[int]:
        """Steps of ``job`` whose manifest exists, newest first (not verified)."""
        self._invalidate()
        prefix = self._job(job)
        try:
            names = self.fs.find(prefix)
        except (FileNotFoundError, OSError):
            return []
        steps = []
        for path in names:
            rel = path[len(prefix):].strip("/").split("/")
            step = parse_step_dir_name(rel[0]) if len(rel) == 2 and rel[1] == MANIFEST else None
            if step is not None:
                steps.append(step)
        return sorted(steps, reverse=True)

    def read_manifest(self, job: str, step: int) -> dict[str, Any]:
        """Step ``step``'s manifest, parsed and checked (at most ``MAX_MANIFEST_BYTES`` read),
        as JSON.

        Raises:
            CheckpointCorruptError: missing, oversized or malformed.
            IncompatibleFormatError: another format version.
        """
        path = f"{self._job(job)}/{step_dir_name(step)}/{MANIFEST}"
        try:
            raw = self.fs.cat_file(path, start=0, end=MAX_MANIFEST_BYTES + 1)
        except (FileNotFoundError, OSError) as e:
            raise CheckpointCorruptError(f"{path}: unreadable ({e})") from None
        return Manifest.parse(raw, path).to_json()

    def read_file(self, job: str, step: int, name: str, max_bytes: int) -> bytes:
        """File ``name`` of step ``step``; reads at most ``max_bytes`` + 1 bytes, so an object
        larger than its manifest says is refused without being read whole (issue 24, item 10).

        Raises:
            ValueError: ``name`` is not a checkpoint file's name.
            CheckpointCorruptError: larger than ``max_bytes``, or unreadable.
        """
        if not FILE_RE.match(name):
            raise ValueError(f"bad checkpoint file name {name!r}")
        path = f"{self._job(job)}/{step_dir_name(step)}/{name}"
        try:
            raw = self.fs.cat_file(path, start=0, end=max_bytes + 1)
        except (FileNotFoundError, OSError) as e:
            raise CheckpointCorruptError(f"{path}: unreadable ({e})") from None
        if len(raw) > max_bytes:
            raise CheckpointCorruptError(f"{path}: larger than the {max_bytes} bytes its "
                                         "manifest declares")
        return bytes(raw)

    def begin(self, job: str, step: int) -> _FsspecWriter:
        return _FsspecWriter(self.fs, f"{self._job(job)}/{step_dir_name(step)}")

    def delete(self, job: str, step: int) -> None:
        prefix = f"{self._job(job)}/{step_dir_name(step)}"
        try:
            self.fs.rm(f"{prefix}/{MANIFEST}")
        except (FileNotFoundError, OSError):
            pass
        try:
            self.fs.rm(prefix, recursive=True)
        except (FileNotFoundError, OSError):
            pass

    def cleanup(self, job: str | None = None) -> int:
        """Remove step prefixes that have files but no manifest (flushes cut short)."""
        self._invalidate()
        n = 0
        try:
            jobs = [self._job(job)] if job else [p for p in self.fs.ls(self.base, detail=False)]
        except (FileNotFoundError, OSError):
            return 0
        for prefix in jobs:
            try:
                entries = self.fs.ls(prefix, detail=False)
            except (FileNotFoundError, NotADirectoryError, OSError):
                continue
            for entry in entries:
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if parse_step_dir_name(name) is None:
                    continue
                if not self.fs.exists(f"{entry.rstrip('/')}/{MANIFEST}"):
                    try:
                        self.fs.rm(entry, recursive=True)
                        n += 1
                    except (FileNotFoundError, OSError):
                        pass
        return n


def open_storage(url: str) -> DirStorage | FsspecStorage:
    """The level-2 store for a plain path or an fsspec URL.

    Raises:
        BadInputError: an fsspec scheme whose package is not installed (e.g. s3fs for s3://).
    """
    if "://" not in url:
        return DirStorage(Path(url).expanduser())
    try:
        return FsspecStorage(url)
    except ImportError as e:
        raise BadInputError(f"storage URL {redact_url(url)!r} needs a package that is missing "
                            f"({e}); e.g. pip install s3fs for s3://, gcsfs for gs://") from None
    except ValueError as e:
        raise BadInputError(f"storage URL {redact_url(url)!r} is not usable: {e}") from None


def below(storage: Storage, *names: str) -> DirStorage | FsspecStorage:
    """The same level 2, ``names`` further down: ``<root>/<names...>/<job>/step-N``. The peer
    gives each tenant but the default one its own (:mod:`cfrun.peer.tenants`).

    A plain directory opens each of ``names`` relative to its parent without following a link
    (as a job directory: :class:`LinkRefusedError`); an fsspec URL gets the longer prefix.

    Raises:
        ValueError: a name that is not a single safe path component (:data:`BELOW_RE`).
        TypeError: a store of another kind.
    """
    for name in names:
        _check_below(name)
    if isinstance(storage, DirStorage):
        return DirStorage(storage.top, storage.below + tuple(names))
    if isinstance(storage, FsspecStorage):
        return FsspecStorage("/".join([storage.url, *names]))
    raise TypeError(f"cannot place a store below {type(storage).__name__}")


# ---------------------------------------------------------------------- retention


def checkpoint_job_id(manifest: dict[str, Any]) -> str | None:
    """The job id a manifest (as JSON) carries: its ``job_id`` field, else ``meta.job_id``;
    None when it carries none (written by a cfrun without job identity).

    Level 2 keeps one prefix per job *name*; the id tells apart two jobs that share a name.
    """
    for where in (manifest, manifest.get("meta")):
        if isinstance(where, dict) and isinstance(where.get("job_id"), str):
            return str(where["job_id"])
    return None


def same_job_steps(storage: Storage, job: str, job_id: str | None, steps: Iterable[int]
                   ) -> list[int]:
    """Those of ``steps`` (of ``job``'s prefix) whose manifest names the job id ``job_id``
    (None: names none), in the order given. A step whose manifest cannot be read or parsed
    is nobody's: it is not returned (and so never deleted by retention)."""
    mine = []
    for step in steps:
        try:
            manifest = storage.read_manifest(job, step)
        except (CfrunError, OSError, ValueError):
            continue
        if checkpoint_job_id(manifest) == job_id:
            mine.append(step)
    return mine


def apply_retention(storage: Storage, job: str, keep: int, *, flushed_step: int,
                    job_id: str | None) -> list[int]:
    """Level-2 retention after ``flushed_step`` of ``job`` was flushed (the peer's flusher).

    Keeps ``flushed_step`` and the ``keep - 1`` newest *older* steps of the same job (same job
    id); deletes that job's older steps beyond them. Never deletes ``flushed_step`` nor any
    step above it (a resumed run flushes below the steps a previous attempt left: those are
    not its to judge), nor a step of another job id under the same name, nor a step whose
    manifest does not parse.

    Returns:
        The steps deleted, newest first.

    Raises:
        ValueError: ``keep`` < 1.
        Exception: whatever level 2 raises while listing or deleting.
    """
    if keep < 1:
        raise ValueError(f"keep {keep!r} must be >= 1")
    older = [s for s in storage.list_steps(job) if s < flushed_step]
    doomed = same_job_steps(storage, job, job_id, older)[keep - 1:]
    for step in doomed:
        storage.delete(job, step)
    return doomed
