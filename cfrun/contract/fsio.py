"""The one durable file writer, and the one careful file reader, of every cfrun process.

Writing (:func:`write_atomic`): a new temporary file beside the target, created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 (never an existing file, never through a
symlink someone planted), written, fsynced, renamed over the target in one step, then the
directory fsynced. A reader sees the old file or the new one, never a torn one, also after a
power loss (DESIGN.md §3, "Persist"). CheckFreq's prototype wrote straight to the final name.

Reading (:func:`read_regular`): opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
``fstat`` before a byte is read: a FIFO, a device (``/dev/zero``), a symlink or a file over the
caller's size limit is refused with one line instead of hanging or filling the memory.

Appending and locking (:func:`open_private`): a job dir's own files that are not replaced but
written in place (``events.jsonl``, ``job.lock``) are opened without following a link and
created 0600.

Torch-free; imported by the supervisor, the agent, the ranks, ``cfrun peer`` and the CLI.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import xxhash

from cfrun.contract.errors import BadInputError

WRITE_CHUNK_BYTES = 8 << 20
"""Bytes per ``write()`` call (bounded, so a throttle or a kill point sees progress)."""
FILE_MODE = 0o600
"""Mode of every file cfrun creates in a job dir or a checkpoint: the owner's only."""


class UnsafeFileError(OSError):
    """A file to read is not a regular file (FIFO, device, symlink, directory) or is too big."""


def new_file_flags(*, direct: bool = False) -> int:
    """``open()`` flags for a file that must be new: write-only, ``O_CREAT | O_EXCL`` (never an
    existing file), ``O_NOFOLLOW`` (never through a symlink), ``O_CLOEXEC``; with ``direct``
    also ``O_DIRECT`` where the OS has it (the persist agent's slot writer)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        flags |= os.O_DIRECT
    return flags


def open_new(path: Path | str, *, direct: bool = False) -> int:
    """Create ``path`` (must not exist, mode 0600) and return its write-only fd.

    Raises:
        FileExistsError: ``path`` exists (a file, or a symlink: it is not followed).
        OSError: anything else the OS refuses (``EINVAL`` for ``O_DIRECT`` on tmpfs...).
    """
    return os.open(path, new_file_flags(direct=direct), FILE_MODE)


def open_private(path: Path | str, flags: int) -> int:
    """``os.open`` a file of the job dir with ``flags`` without following a link, creating it
    0600 (:data:`FILE_MODE`); returns the fd. Any process (the events, the lock).

    Raises:
        BadInputError: ``path`` is a symbolic link.
        OSError: anything else the OS refuses.
    """
    try:
        return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise BadInputError(f"{str(path)!r} is a symbolic link; cfrun does not write "
                                "through links in a job dir: remove it") from None
        raise


def fsync_dir(path: Path | str) -> None:
    """fsync a directory so renames and new entries in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, parts: Iterable[bytes | bytearray | memoryview], *,
              before_chunk: Callable[[int], None] | None = None) -> tuple[int, str]:
    """Write ``parts`` to ``fd`` in chunks of at most :data:`WRITE_CHUNK_BYTES`.

    ``before_chunk(nbytes)`` runs before each chunk (a throttle). Returns the bytes written and
    their xxh3-64 checksum (16 hex digits), the checksum a checkpoint manifest records.
    """
    h = xxhash.xxh3_64()
    nbytes = 0
    for part in parts:
        view = memoryview(part).cast("B")
        h.update(view)
        for start in range(0, len(view), WRITE_CHUNK_BYTES):
            piece = view[start:start + WRITE_CHUNK_BYTES]
            if before_chunk is not None:
                before_chunk(len(piece))
            while piece:
                piece = piece[os.write(fd, piece):]
        nbytes += len(view)
    return nbytes, h.hexdigest()


def write_atomic(path: Path | str, parts: Iterable[bytes | bytearray | memoryview], *,
                 sync_dir: bool = True, exclusive: bool = False,
                 before_chunk: Callable[[int], None] | None = None) -> tuple[int, str]:
    """Durably replace ``path`` with the concatenation of ``parts`` (mode 0600).

    Writes ``.<name>.tmp-<random>`` beside ``path`` (created exclusively, not following links),
    fsyncs it, renames it over ``path``, and fsyncs the directory unless ``sync_dir`` is False
    (a checkpoint's staging directory is fsynced once, before its manifest, instead). Any
    process calls it; two writers of the same path leave one complete file. ``exclusive``:
    ``path`` must not exist (a hard link puts the file in place, so this is atomic too); a
    checkpoint file is never overwritten.

    Returns:
        ``(nbytes, xxh3_64)``: the size and checksum of what was written.

    Raises:
        FileExistsError: ``exclusive`` and ``path`` exists.
        OSError: the disk refused (full, read-only, the directory is gone); the temporary file
            is removed and ``path`` is unchanged.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
    fd = open_new(tmp)
    try:
        try:
            result = write_all(fd, parts, before_chunk=before_chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            _link_new(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return result


def _link_new(tmp: Path, path: Path) -> None:
    """Give ``tmp`` the name ``path`` if that name is free, then drop ``tmp``."""
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: check, then rename (not atomic)
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.rename(tmp, path)
        return
    os.unlink(tmp)


def atomic_write_json(path: Path | str, obj: Mapping[str, Any] | list[Any]) -> None:
    """Write ``obj`` as JSON (indent 1, sorted keys) with :func:`write_atomic`: readers see the
    old file or the new one, never a torn one.

    Raises:
        OSError: as :func:`write_atomic`.
    """
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    write_atomic(path, [data])


def open_regular(path: Path | str, *, max_bytes: int, dir_fd: int | None = None
                 ) -> tuple[int, int]:
    """Open ``path`` for reading only if it is a regular file of at most ``max_bytes``.

    Opened with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink fails, a FIFO does not block the open),
    then ``fstat``-checked, so what is checked is what is read. ``dir_fd``: resolve ``path``
    relative to that open directory (no path component swapped in between).

    Returns:
        ``(fd, size_bytes)``; the caller closes ``fd``.

    Raises:
        UnsafeFileError: a symlink, FIFO, device, socket or directory, or over ``max_bytes``.
        FileNotFoundError, OSError: missing or unreadable.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:  # the last component is a symlink
            raise UnsafeFileError(f"{path}: a symlink, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path}: not a regular file ({_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise UnsafeFileError(f"{path}: {st.st_size} bytes, more than the {max_bytes} "
                                  "a file of this kind may have")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: Path | str, *, max_bytes: int, dir_fd: int | None = None
                 ) -> bytearray:
    """The contents of a regular file of at most ``max_bytes`` (see :func:`open_regular`).

    Reads at most the size ``fstat`` gave plus one byte, so a file that grows meanwhile is
    refused instead of read without end.

    Raises:
        UnsafeFileError, OSError: as :func:`open_regular`, or the file changed size.
    """
    fd, size = open_regular(path, max_bytes=max_bytes, dir_fd=dir_fd)
    try:
        buf = bytearray(size)
        view = memoryview(buf)
        got = 0
        while got < size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        if got != size or os.read(fd, 1):
            raise UnsafeFileError(f"{path}: changed size while being read")
        return buf
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return f"mode {oct(mode)}"


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed, files that vanish while
    walking skipped); 0 for a missing ``path``. Used for disk accounting: ``cfrun status`` and
    the agent's pruning for free space. A ``path`` that is itself a link counts 0: ``os.walk``
    follows its top (a ``checkpoints`` linked to ``/`` walked the whole machine; issue 24)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return 0
    except OSError:
        return 0
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total
