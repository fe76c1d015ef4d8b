"""The checkpoint manifest: one typed, validated record, built, parsed and verified here only.

A checkpoint directory (``step-NNNNNN/``) holds ``rank-NNNNN.bin`` and ``rank-NNNNN.json`` per
rank and ``manifest.json``, written last (DESIGN.md §3)::

    {"format_version": 1, "cfrun_version": "0.4.0", "step": 120, "world_size": 2,
     "committed_unix_s": 1764000000.5,
     "files": [{"name": "rank-00000.bin", "nbytes": 4096, "xxh3_64": "1f0c..."}, ...],
     "meta": {"step": 120, "mode": "loader", "epoch": 1, "batches": 20, "not_exact": []}}

The same record is written by the persist agent (local commit), the ranks' synchronous path,
``cfrun peer`` (served and flushed to level 2) and read back by every one of them and by
``cfrun ls``/``status``/``export``. Parsing is strict, because a manifest may come from another
machine or another user's hands: the JSON is bounded (size, depth) before it is parsed,
unknown fields are refused (torchsnapshot silently drops them), every type is checked, numbers
must be finite, file names must be ones the format writes (``rank-NNNNN.bin|json``: never
``../../etc/hostname``), and counts are capped. Torch-free.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import xxhash

from cfrun import __version__
from cfrun.contract.errors import (
    CheckpointCorruptError,
    ForeignCheckpointError,
    IncompatibleFormatError,
)
from cfrun.contract.fsio import UnsafeFileError, open_regular, read_regular
from cfrun.contract.jobdir import step_dir_name

FORMAT_VERSION = 1
"""Version of the checkpoint format (manifest, shard JSON, shard bytes); a reader refuses any
other with :class:`IncompatibleFormatError`."""
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20
"""Largest ``manifest.json`` read (about 100 bytes per file: room for 100,000 ranks)."""
MAX_WORLD_SIZE = 100_000
"""Ranks a checkpoint may have: rank file names have five digits."""
MAX_FILES = 2 * MAX_WORLD_SIZE
MAX_FILE_BYTES = 1 << 50
"""Largest size a manifest may record for one file (1 PiB)."""
MAX_META_DEPTH = 8
"""Nesting allowed in the manifest's ``meta`` object (the whole manifest: this plus 3)."""
SHARD_FILE_RE = re.compile(r"^rank-\d{5}\.(bin|json)$")
"""The only file names a checkpoint may list besides ``manifest.json``."""
_XXH3_RE = re.compile(r"^[0-9a-f]{16}$")
_SEAL_TAG_RE = re.compile(r"^[0-9a-f]{64}$")
_VERIFY_CHUNK_BYTES = 8 << 20

_STRING_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_DELTA = [0] * 256
_DEPTH_DELTA[ord("[")] = _DEPTH_DELTA[ord("{")] = 1
_DEPTH_DELTA[ord("]")] = _DEPTH_DELTA[ord("}")] = -1


def shard_names(rank: int) -> tuple[str, str]:
    """``(rank-NNNNN.bin, rank-NNNNN.json)``: one rank's tensor bytes and its tree."""
    return f"rank-{rank:05d}.bin", f"rank-{rank:05d}.json"


def dumps_json(obj: Any) -> bytes:
    """Compact JSON bytes for a rank's shard document (``rank-NNNNN.json``); dict order is
    kept (scripts may depend on it)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def loads_bounded(raw: bytes | bytearray, *, max_bytes: int, max_depth: int,
                  allow_nan: bool = False) -> Any:
    """Parse JSON that may be hostile: at most ``max_bytes`` and ``max_depth`` nested
    arrays/objects (both checked before parsing, so neither the parser's recursion nor its
    memory is at the mercy of the input); ``NaN``/``Infinity`` only with ``allow_nan`` (a
    user's state may hold ``inf``; a manifest never does).

    Raises:
        ValueError: too big, too deep, not UTF-8, not JSON, or a non-finite number.
    """
    if len(raw) > max_bytes:
        raise ValueError(f"{len(raw)} bytes of JSON, more than {max_bytes}")
    brackets = _STRING_RE.sub(b"", bytes(raw)).translate(None, _NOT_BRACKETS)
    depth = max(accumulate(map(_DEPTH_DELTA.__getitem__, brackets)), default=0)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep, more than {max_depth}")
    try:
        if allow_nan:
            return json.loads(raw)
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def _check_finite(obj: Any, where: str) -> None:
    """Floats in ``obj`` are finite (``json.loads`` also accepts ``1e999`` as inf)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, float) and not math.isfinite(o):
            raise CheckpointCorruptError(f"{where}: a number is not finite ({o})")
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, list):
            stack.extend(o)


def _int(d: dict[str, Any], key: str, where: str, lo: int, hi: int) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise CheckpointCorruptError(f"{where}: {key} {v!r} is not an integer in [{lo}, {hi}]")
    return v


def _fields(d: Any, allowed: frozenset[str], where: str,
            optional: frozenset[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise CheckpointCorruptError(f"{where}: expected a JSON object, got "
                                     f"{type(d).__name__}")
    unknown = sorted(set(d) - allowed - optional)
    if unknown:
        raise CheckpointCorruptError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    missing = sorted(allowed - set(d))
    if missing:
        raise CheckpointCorruptError(f"{where}: missing field(s) {', '.join(missing)}")
    return d


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as the manifest records it."""

    name: str
    """``rank-NNNNN.bin`` or ``rank-NNNNN.json`` (:data:`SHARD_FILE_RE`)."""
    nbytes: int
    """Size in bytes."""
    xxh3_64: str
    """xxh3-64 checksum of the whole file, 16 lowercase hex digits."""

    _KEYS = frozenset({"name", "nbytes", "xxh3_64"})

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "nbytes": self.nbytes, "xxh3_64": self.xxh3_64}

    @classmethod
    def from_json(cls, d: Any, where: str = "manifest") -> FileEntry:
        """A checked entry (name allowed, size bounded, checksum well-formed).

        Raises:
            CheckpointCorruptError: anything else, naming the value.
        """
        d = _fields(d, cls._KEYS, f"{where}: file entry")
        name, digest = d["name"], d["xxh3_64"]
        if not isinstance(name, str) or not SHARD_FILE_RE.match(name):
            raise CheckpointCorruptError(f"{where}: file name {str(name)[:80]!r} is not one a "
                                         "checkpoint has (rank-NNNNN.bin|json)")
        nbytes = _int(d, "nbytes", f"{where}: {name}", 0, MAX_FILE_BYTES)
        if not isinstance(digest, str) or not _XXH3_RE.match(digest):
            raise CheckpointCorruptError(f"{where}: {name}: xxh3_64 {str(digest)[:40]!r} is not "
                                         "16 hex digits")
        return cls(name, nbytes, digest)


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's ``manifest.json``: which files, their sizes and checksums, and the step.

    Build with :meth:`build` (the committer: agent, ranks' synchronous path, ``cfrun peer``),
    write :meth:`dumps`; read with :meth:`parse` or :func:`read_manifest`, then
    :meth:`verify_dir` or :meth:`read_file`.
    """

    step: int
    world_size: int
    files: tuple[FileEntry, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    """Small JSON object about the step for ``cfrun ls`` (step, mode, epoch, batches...)."""
    committed_unix_s: float = 0.0
    cfrun_version: str = __version__
    format_version: int = FORMAT_VERSION
    seals: tuple[dict[str, Any], ...] = ()
    """``[{rank, tag}]``: each rank's agent's HMAC over its files, written by ``cfrun peer``
    (:mod:`cfrun.peer`) so that a fetching agent can authenticate the manifest; absent in a
    job dir's own manifests. Checked here for form only (rank in range, 64 hex digits)."""
    mac: str = ""
    """HMAC-SHA256 (hex) of every other field under the job's manifest key
    (:func:`manifest_mac`, :class:`ManifestKeys`), written by this job's committers; checked
    by a resume before any file the manifest names is opened (:meth:`check_mac`). Empty: a
    manifest of a cfrun before issue 32, or of a committer without the job's key."""

    _KEYS = frozenset({"format_version", "cfrun_version", "step", "world_size",
                       "committed_unix_s", "files", "meta"})
    _OPTIONAL = frozenset({"seals", "mac"})

    @classmethod
    def build(cls, step: int, world_size: int, files: list[FileEntry] | tuple[FileEntry, ...],
              meta: dict[str, Any] | None = None, *, committed_unix_s: float | None = None,
              seals: list[dict[str, Any]] | None = None) -> Manifest:
        """The manifest a committer writes now (this cfrun's version and format).

        Raises:
            ValueError: a value the format cannot hold (checked as a reader would).
        """
        m = cls(step, world_size, tuple(files), dict(meta or {}),
                time.time() if committed_unix_s is None else committed_unix_s,
                seals=tuple(dict(s) for s in seals or ()))
        try:
            cls.from_json(m.to_json(), "new manifest")
        except CheckpointCorruptError as e:
            raise ValueError(str(e)) from None
        return m

    def to_json(self) -> dict[str, Any]:
        d = {"format_version": self.format_version, "cfrun_version": self.cfrun_version,
             "step": self.step, "world_size": self.world_size,
             "committed_unix_s": self.committed_unix_s,
             "files": [f.to_json() for f in self.files], "meta": self.meta}
        if self.seals:
            d["seals"] = [dict(s) for s in self.seals]
        if self.mac:
            d["mac"] = self.mac
        return d

    def signed(self, key: bytes) -> Manifest:
        """This manifest with its :attr:`mac` under ``key`` (:attr:`ManifestKeys.sign`)."""
        return dataclasses.replace(self, mac=manifest_mac(key, self))

    def check_mac(self, keys: ManifestKeys, *, require: bool, where: str = "") -> None:
        """Authenticate this manifest before anything it names is read: its :attr:`mac` must
        match under one of ``keys.accept``; a manifest without one passes only when not
        ``require`` (:func:`mac_required`: no checkpoint of the job dir carries one yet, a
        job dir of an older cfrun). Pure: reads no file.

        Raises:
            ForeignCheckpointError: no MAC where one is due, or one under another key (another
                job's manifest, a forged one, a moved job without its key); one line.
        """
        where = where or step_dir_name(self.step)
        if not self.mac:
            if require:
                raise ForeignCheckpointError(
                    f"{where}: its manifest carries no MAC while this job's checkpoints do "
                    "(planted, or written by another job); skipped, nothing deleted")
            return
        if not any(hmac.compare_digest(self.mac, manifest_mac(k, self)) for k in keys.accept):
            raise ForeignCheckpointError(
                f"{where}: its manifest's MAC does not match this job's key (another job's "
                "checkpoint, or a forged one); skipped, nothing deleted")

    def dumps(self) -> bytes:
        """The bytes of ``manifest.json``."""
        return json.dumps(self.to_json(), indent=1, sort_keys=True, allow_nan=False).encode()

    @property
    def nbytes(self) -> int:
        """Bytes of all files."""
        return sum(f.nbytes for f in self.files)

    def entry(self, name: str) -> FileEntry:
        """The entry of file ``name``.

        Raises:
            CheckpointCorruptError: the manifest lists no such file.
        """
        for f in self.files:
            if f.name == name:
                return f
        raise CheckpointCorruptError(f"step {self.step}: the manifest lists no {name}")

    @classmethod
    def parse(cls, raw: bytes | bytearray, where: str = "manifest") -> Manifest:
        """A manifest from the bytes of ``manifest.json`` (bounded, strict: see module doc).

        Raises:
            CheckpointCorruptError: malformed, oversized, unknown fields, bad values.
            IncompatibleFormatError: another ``format_version``.
        """
        try:
            d = loads_bounded(raw, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_META_DEPTH + 3)
        except ValueError as e:
            raise CheckpointCorruptError(f"{where}: unreadable manifest ({e})") from None
        return cls.from_json(d, where)

    @classmethod
    def from_json(cls, d: Any, where: str = "manifest") -> Manifest:
        """A manifest from its parsed JSON (as :meth:`parse`, for a manifest that came inside
        another message)."""
        if isinstance(d, dict) and "format_version" in d and d["format_version"] != FORMAT_VERSION:
            raise IncompatibleFormatError(f"{where}: format_version "
                                          f"{str(d['format_version'])[:20]}, this cfrun reads "
                                          f"{FORMAT_VERSION}")
        d = _fields(d, cls._KEYS, where, optional=cls._OPTIONAL)
        step = _int(d, "step", where, 0, 2**62)
        world_size = _int(d, "world_size", where, 1, MAX_WORLD_SIZE)
        t = d["committed_unix_s"]
        if type(t) not in (int, float) or not math.isfinite(t):
            raise CheckpointCorruptError(f"{where}: committed_unix_s {t!r} is not a finite "
                                         "number")
        version = d["cfrun_version"]
        if not isinstance(version, str) or len(version) > 64:
            raise CheckpointCorruptError(f"{where}: cfrun_version {str(version)[:80]!r} is not "
                                         "a short string")
        raw_files, meta = d["files"], d["meta"]
        if not isinstance(raw_files, list) or not 1 <= len(raw_files) <= MAX_FILES:
            raise CheckpointCorruptError(f"{where}: files must be a list of 1 to {MAX_FILES} "
                                         "entries")
        files = tuple(FileEntry.from_json(f, where) for f in raw_files)
        if len({f.name for f in files}) != len(files):
            raise CheckpointCorruptError(f"{where}: a file is listed twice")
        if not isinstance(meta, dict):
            raise CheckpointCorruptError(f"{where}: meta must be a JSON object")
        _check_finite(meta, where)
        seals = d.get("seals", [])
        if not isinstance(seals, list) or len(seals) > world_size:
            raise CheckpointCorruptError(f"{where}: seals must be a list of at most "
                                         f"{world_size} entries")
        for s in seals:
            s = _fields(s, frozenset({"rank", "tag"}), f"{where}: seal",
                        optional=frozenset({"job_tag", "sha256"}))
            _int(s, "rank", f"{where}: seal", 0, world_size - 1)
            digests = s.get("sha256", [])
            if not isinstance(digests, list) or len(digests) > 2 or not all(
                    isinstance(d, str) and _SEAL_TAG_RE.match(d) for d in digests):
                raise CheckpointCorruptError(f"{where}: seal sha256 must be a list of at most "
                                             "2 digests of 64 hex digits")
            for name in ("tag", "job_tag"):
                if name in s and (not isinstance(s[name], str)
                                  or not _SEAL_TAG_RE.match(s[name])):
                    raise CheckpointCorruptError(f"{where}: seal {name} {str(s[name])[:80]!r} "
                                                 "is not 64 hex digits")
        mac = d.get("mac", "")
        if "mac" in d and (not isinstance(mac, str) or not _SEAL_TAG_RE.match(mac)):
            raise CheckpointCorruptError(f"{where}: mac {str(mac)[:80]!r} is not 64 hex digits")
        return cls(step, world_size, files, meta, float(t), version, FORMAT_VERSION,
                   tuple(dict(s) for s in seals), mac)

    # ------------------------------------------------------------------ files on disk

    def read_file(self, step_dir: Path, name: str) -> bytearray:
        """The bytes of file ``name`` of ``step_dir``, checked: a regular file (not a link,
        FIFO or device) of the recorded size with the recorded checksum. Reads only names the
        manifest lists, which are names the format allows.

        Raises:
            CheckpointCorruptError: unlisted, missing, not a regular file, other size or
                checksum.
        """
        entry = self.entry(name)
        where = f"{step_dir.name}/{name}"
        try:
            data = read_regular(step_dir / name, max_bytes=entry.nbytes)
        except UnsafeFileError as e:
            raise CheckpointCorruptError(f"{where}: refused ({_why(e)}; the manifest says "
                                         f"{entry.nbytes} bytes)") from None
        except OSError as e:
            raise CheckpointCorruptError(f"{where}: unreadable ({e.strerror or e})") from None
        if len(data) != entry.nbytes:
            raise CheckpointCorruptError(f"{where}: {len(data)} bytes, manifest says "
                                         f"{entry.nbytes}")
        if xxhash.xxh3_64_hexdigest(data) != entry.xxh3_64:
            raise CheckpointCorruptError(f"{where}: checksum mismatch")
        return data

    def check_file(self, step_dir: Path, name: str) -> None:
        """As :meth:`read_file` but streamed (memory bounded by one chunk, not the file)."""
        entry = self.entry(name)
        where = f"{step_dir.name}/{name}"
        try:
            fd, size = open_regular(step_dir / name, max_bytes=entry.nbytes)
        except UnsafeFileError as e:
            raise CheckpointCorruptError(f"{where}: refused ({_why(e)}; the manifest says "
                                         f"{entry.nbytes} bytes)") from None
        except OSError as e:
            raise CheckpointCorruptError(f"{where}: unreadable ({e.strerror or e})") from None
        try:
            h = xxhash.xxh3_64()
            got = 0
            while got <= size:
                chunk = os.read(fd, min(_VERIFY_CHUNK_BYTES, size + 1 - got))
                if not chunk:
                    break
                h.update(chunk)
                got += len(chunk)
        except OSError as e:
            raise CheckpointCorruptError(f"{where}: unreadable ({e.strerror or e})") from None
        finally:
            os.close(fd)
        if got != entry.nbytes:
            raise CheckpointCorruptError(f"{where}: {got} bytes, manifest says {entry.nbytes}")
        if h.hexdigest() != entry.xxh3_64:
            raise CheckpointCorruptError(f"{where}: checksum mismatch")

    def verify_dir(self, step_dir: Path, *, skip: frozenset[str] = frozenset()) -> None:
        """Every listed file of ``step_dir`` but those named in ``skip`` matches (see
        :meth:`check_file`); ``skip``: files the caller checks itself as it reads them.

        Raises:
            CheckpointCorruptError: the first file that does not.
        """
        for f in self.files:
            if f.name not in skip:
                self.check_file(step_dir, f.name)


MAC_INFO = b"cfrun-manifest-mac/1"
"""What derives a job dir's manifest key from its ``job.key`` (:meth:`ManifestKeys.of_job_key`)."""


def manifest_mac(key: bytes, manifest: Manifest) -> str:
    """Hex HMAC-SHA256 under ``key`` of ``manifest``'s canonical JSON without its ``mac``
    (every other field: step, world size, files with their sizes and checksums, meta, seals).
    The xxh3 checksums it covers are not cryptographic: the MAC proves the manifest is the
    job's; the files' bytes are guarded by their mode (0600 in a 0700 job dir) locally, and by
    the job seals' SHA-256 where they come from the peer or level 2."""
    d = manifest.to_json()
    d.pop("mac", None)
    data = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hmac.new(key, b"cfrun-manifest/1\n" + data, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ManifestKeys:
    """The keys of a job dir's manifest MACs: ``sign`` writes them, any of ``accept``
    (``sign`` first) passes one. Derived from the job dir's own secret, ``job.key``
    (:mod:`cfrun.contract.jobkey`: made with the job dir, 0600, never through a link; or the
    user's ``--job-key-file``): the job dir's checkpoints live and die with it, so their key
    does too, and it does not depend on a peer token the user may change or drop. A
    checkpoint installed from the peer or level 2 is checked against the job's seal first and
    then committed here under this key."""

    sign: bytes
    accept: tuple[bytes, ...]

    @classmethod
    def of_job_key(cls, job_key: bytes) -> ManifestKeys:
        """The manifest key of a job key (64 hex digits as :func:`cfrun.contract.jobkey.
        ensure_job_key` returns it): one HKDF-Expand block (RFC 5869) with info
        :data:`MAC_INFO`, the key's 32 bytes as the pseudorandom key."""
        prk = bytes.fromhex(job_key.decode("ascii")) if len(job_key) == 64 else job_key
        sign = hmac.new(prk, MAC_INFO + b"\x01", hashlib.sha256).digest()
        return cls(sign, (sign,))

    def to_hex(self) -> tuple[str, ...]:
        """``(sign, *others)`` in hex, for :class:`cfrun.rank.settings.RankSettings`."""
        return tuple(k.hex() for k in self.accept)

    @classmethod
    def from_hex(cls, keys: tuple[str, ...] | list[str]) -> ManifestKeys | None:
        """Inverse of :meth:`to_hex`; None for no keys.

        Raises:
            ValueError: a key is not 64 hex digits.
        """
        raw = [bytes.fromhex(k) for k in keys]
        if any(len(k) != 32 for k in raw):
            raise ValueError("a manifest key is not 32 bytes")
        return cls(raw[0], tuple(raw)) if raw else None


def mac_required(manifests: list[Manifest]) -> bool:
    """Whether MAC-less manifests are refused in a job dir whose manifests are ``manifests``:
    once any carries a MAC (this cfrun committed there), yes. A job dir of an older cfrun (no
    manifest with a MAC) keeps resuming after the upgrade; a checkpoint planted without a MAC
    among this cfrun's is refused. Decided per look at the job dir, so a planted MAC-less step
    gains nothing where this cfrun has committed, and where it has not, no more than it gained
    before (the job dir's identity and private modes guard that case)."""
    return any(m.mac for m in manifests)


def _why(e: OSError) -> str:
    text = str(e)
    return text.split(": ", 1)[1] if ": " in text else text


def read_manifest(step_dir: Path) -> Manifest:
    """Read, bound-check and parse ``step_dir/manifest.json`` (a regular file, not a link).

    Raises:
        CheckpointCorruptError: missing, not a regular file, too big or malformed.
        IncompatibleFormatError: written by an incompatible cfrun.
    """
    try:
        raw = read_regular(step_dir / MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
    except UnsafeFileError as e:
        raise CheckpointCorruptError(f"{step_dir.name}: manifest refused ({_why(e)})") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{step_dir.name}: unreadable manifest "
                                     f"({e.strerror or e})") from None
    return Manifest.parse(raw, step_dir.name)
