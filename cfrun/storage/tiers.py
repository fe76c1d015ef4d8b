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

import os
import re
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from cfrun.contract import faults, settings
from cfrun.contract.checkpoints import committed_steps
from cfrun.contract.errors import BadInputError, CfrunError, CheckpointCorruptError
from cfrun.contract.fsio import UnsafeFileError, fsync_dir, read_regular, write_atomic
from cfrun.contract.jobdir import STAGING_PREFIX, parse_step_dir_name, step_dir_name
from cfrun.contract.manifest import MANIFEST, MAX_MANIFEST_BYTES, SHARD_FILE_RE, Manifest

WRITE_CHUNK_BYTES = 8 << 20
JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
FILE_RE = SHARD_FILE_RE


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


class _DirWriter:
    def __init__(self, final: Path) -> None:
        self.final = final
        self.staging = final.parent / f"{STAGING_PREFIX}{final.name}"
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(mode=0o700, parents=True)

    def write_file(self, name: str, parts: Iterable[bytes | bytearray | memoryview]) -> int:
        if not FILE_RE.match(name):
            raise ValueError(f"bad checkpoint file name {name!r}")
        th = throttle()
        n, _ = write_atomic(self.staging / name, parts, sync_dir=False,
                            before_chunk=None if th is None else th.take)
        return n

    def commit(self, manifest: Manifest | dict[str, Any]) -> None:
        data = _manifest_bytes(manifest)
        fsync_dir(self.staging)
        write_atomic(self.staging / MANIFEST, [data])
        if self.final.exists():  # the same step flushed before (a restarted peer): replace it
            (self.final / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(self.final, ignore_errors=True)
        os.rename(self.staging, self.final)
        fsync_dir(self.final.parent)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


class DirStorage:
    """Level 2 in a local or mounted directory, with fsync and atomic rename."""

    def __init__(self, root: Path) -> None:
        self.root = root.absolute()
        self.url = str(self.root)

    def _job(self, job: str) -> Path:
        return self.root / check_job_name(job)

    def list_steps(self, job: str) -> list[int]:
        """Steps of ``job`` with a manifest file, newest first (not verified)."""
        return committed_steps(self._job(job))

    def read_manifest(self, job: str, step: int) -> dict[str, Any]:
        """Step ``step``'s manifest, parsed and checked (:meth:`Manifest.parse`), as JSON (the
        form ``cfrun peer``'s seals cover).

        Raises:
            CheckpointCorruptError: missing, not a regular file, oversized or malformed.
            IncompatibleFormatError: another format version.
        """
        path = self._job(job) / step_dir_name(step) / MANIFEST
        try:
            raw = read_regular(path, max_bytes=MAX_MANIFEST_BYTES)
        except (UnsafeFileError, OSError) as e:
            raise CheckpointCorruptError(f"{path}: unreadable ({e})") from None
        return Manifest.parse(raw, str(path)).to_json()

    def read_file(self, job: str, step: int, name: str, max_bytes: int) -> bytes:
        """File ``name`` of step ``step``, at most ``max_bytes`` (the manifest's size for it).

        Raises:
            ValueError: ``name`` is not a checkpoint file's name.
            CheckpointCorruptError: larger than ``max_bytes``, not a regular file, or unreadable.
        """
        if not FILE_RE.match(name):
            raise ValueError(f"bad checkpoint file name {name!r}")
        path = self._job(job) / step_dir_name(step) / name
        try:
            return bytes(read_regular(path, max_bytes=max_bytes))
        except (UnsafeFileError, OSError) as e:
            raise CheckpointCorruptError(f"{path}: unreadable ({e})") from None

    def begin(self, job: str, step: int) -> _DirWriter:
        d = self._job(job)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        return _DirWriter(d / step_dir_name(step))

    def delete(self, job: str, step: int) -> None:
        d = self._job(job) / step_dir_name(step)
        (d / MANIFEST).unlink(missing_ok=True)  # no longer counts, even if the rest stays
        shutil.rmtree(d, ignore_errors=True)

    def cleanup(self, job: str | None = None) -> int:
        """Remove staging directories (flushes cut short). Call when no flush runs."""
        n = 0
        jobs = [self._job(job)] if job else ([p for p in self.root.iterdir() if p.is_dir()]
                                             if self.root.is_dir() else [])
        for d in jobs:
            if not d.is_dir():
                continue
            for p in d.iterdir():
                if p.name.startswith(STAGING_PREFIX):
                    shutil.rmtree(p, ignore_errors=True)
                    n += 1
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
        raise BadInputError(f"storage URL {url!r} needs a package that is missing ({e}); "
                            "e.g. pip install s3fs for s3://, gcsfs for gs://") from None
    except ValueError as e:
        raise BadInputError(f"storage URL {url!r} is not usable: {e}") from None


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
