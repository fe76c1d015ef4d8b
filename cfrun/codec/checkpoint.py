"""Writing and loading one rank's tensors in a checkpoint (the part of checkpointing that
touches torch).

The directory operations (commit, verify, retention, quarantine, listing) are torch-free and
live in :mod:`cfrun.contract.checkpoints`, re-exported here for the ranks. This module adds
what needs tensors: :func:`write_shard` (the ranks' synchronous path), :func:`load_shard` and
:func:`load_newest` (resume, ``cfrun export``).

The loader checks what a checksum cannot (a checksum only says the bytes are the ones the
manifest's writer meant): file names, file types and sizes before reading, bounded JSON, every
tensor's dtype from an allow-list, ``nbytes`` equal to elements times item size, offsets where
the writer puts them and inside the file. Any check failing, or any error while reading or
decoding, makes the checkpoint corrupt (:class:`CheckpointCorruptError`): :func:`load_newest`
then moves it aside and falls back to an older one, on every rank alike
(:func:`check_usable`).

A checkpoint that is fine but does not fit the live job (a changed layer width, another
optimizer grouping, another scheduler) is not corrupt: :func:`check_fits` names the first
difference (:class:`JobMismatchError`) and the rank stops the job with exit 5, the checkpoints
untouched.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from cfrun.codec.format import (
    _DTYPES,
    FORMAT_VERSION,
    TensorEntry,
    decode,
    dumps_json,
    meta_tensor,
    plan_layout,
    tensor_bytes,
    tensor_from_buffer,
)
from cfrun.contract import faults
from cfrun.contract.checkpoints import (  # noqa: F401  (re-exported for the ranks)
    CORRUPT,
    INCOMPATIBLE,
    MANIFEST,
    FileEntry,
    Manifest,
    ManifestKeys,
    apply_retention,
    check_complete,
    check_good,
    commit,
    committed_steps,
    good_steps,
    is_final,
    quarantine,
    read_manifest,
    remove_staging,
    shard_names,
    staging_dir,
    verify,
    write_file,
)
from cfrun.contract.errors import (
    CheckpointCorruptError,
    FatalJobError,
    ForeignCheckpointError,
    IncompatibleFormatError,
)
from cfrun.contract.fsio import UnsafeFileError, open_regular
from cfrun.contract.jobdir import step_dir_name
from cfrun.contract.manifest import mac_required
from cfrun.contract.shard import read_doc

logger = logging.getLogger(__name__)

_fsync_write = write_file
"""Old name of :func:`cfrun.contract.checkpoints.write_file` (callers move to that)."""

_DECODE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError,
                  RuntimeError, RecursionError, MemoryError)
"""What decoding a crafted shard can raise; each means a corrupt checkpoint."""


def write_shard(staging: Path, rank: int, tree: Any, tensors: list[torch.Tensor],
                meta: dict[str, Any]) -> list[FileEntry]:
    """Write one rank's state into ``staging`` (phase 2, synchronous form).

    Called by each rank for the same step. Creates ``staging`` if needed. Files are written
    with :func:`cfrun.contract.fsio.write_atomic` (new, 0600, fsynced, renamed into place).

    Args:
        tree: JSON tree from :func:`cfrun.codec.format.encode`.
        tensors: the tensors ``tree`` refers to, any device.
        meta: extra JSON-able fields stored in the shard's JSON (step, data position...).

    Returns:
        The two files written, for the manifest.

    Raises:
        OSError: the disk refused the write (full, read-only...).
    """
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    entries, total = plan_layout(tensors)
    bin_name, json_name = shard_names(rank)
    chunks: list[memoryview | bytes] = []
    pos = 0
    for entry, t in zip(entries, tensors):
        if entry.offset > pos:
            chunks.append(bytes(entry.offset - pos))
        chunks.append(tensor_bytes(t).numpy().data)
        pos = entry.offset + entry.nbytes
    if total > pos:
        chunks.append(bytes(total - pos))
    bin_entry = write_file(staging / bin_name, chunks)
    doc = {"format_version": FORMAT_VERSION, "rank": rank, "tree": tree,
           "tensors": [e.to_json() for e in entries], "meta": meta}
    json_entry = write_file(staging / json_name, [dumps_json(doc)])
    return [bin_entry, json_entry]


def load_shard(step_dir: Path, rank: int) -> tuple[Any, dict[str, Any]]:
    """Load and verify one rank's state from a committed checkpoint.

    Called by each rank on resume, and by ``cfrun export`` (rank 0).

    Returns:
        ``(state, meta)``: the decoded tree (tensors on CPU) and the shard's meta dict.

    Raises:
        CheckpointCorruptError: a file is missing, not a regular file, truncated, fails its
            checksum, or holds metadata the writer does not write (see the module doc).
        IncompatibleFormatError: written by an incompatible cfrun.
    """
    return ShardRead(step_dir, rank, background=False).wait()


_Target = tuple[TensorEntry, "torch.Tensor | None", "torch.Tensor | None"]
"""A tensor to fill from a shard file: its table entry, and either a fresh tensor of its own
or a slice of a full (1/N-reassembled) tensor."""

_Streams = list[tuple[int, list[_Target]]]
"""What to stream: each rank's ``.bin`` (by rank) with its targets, sorted by offset."""

LOAD_CHUNK_BYTES = 16 << 20
"""Bytes of a shard file no tensor takes (alignment padding, other ranks' tensors) are read
through a buffer of this size; every tensor's bytes are read straight into the tensor."""


class ShardRead:
    """One rank's shard of a committed checkpoint, its tensors read on a background thread.

    The constructor (the caller's thread) reads and checks the JSON document, allocates every
    tensor at its final size and decodes the tree around them (:attr:`state`, :attr:`meta`:
    what the resume needs to arm itself, tensors not yet filled); a thread then streams each
    needed ``.bin`` once, straight into the tensors, and checksums it
    (:func:`_stream_into`). :meth:`wait` joins it. Holds the rank's own state plus one
    :data:`LOAD_CHUNK_BYTES` buffer (issue 18, item 10); with 1/N sharding each rank's slice of
    a replicated tensor goes straight into the full tensor.

    The idea: the restarted script imports its libraries and builds its model while the
    checkpoint is read, so the read costs the recovery nothing once the script is slower
    (issue 23, item 5; CheckFreq and Gemini overlap the other way, the write with training).

    Args:
        rank: the rank whose state is loaded (each rank loads its own; ``cfrun export`` rank 0).
        background: False: read on the caller's thread before returning.

    Raises:
        CheckpointCorruptError: the manifest or the JSON document (from the constructor).
        IncompatibleFormatError: written by an incompatible cfrun (from the constructor).
    """

    def __init__(self, step_dir: Path, rank: int, *, background: bool = True,
                 manifest: Manifest | None = None) -> None:
        self.step_dir = step_dir
        self.start_unix_s = time.time()
        self.read_s: float | None = None
        """Seconds from the constructor's start to the end of the read (set at its end)."""
        self._error: BaseException | None = None
        if manifest is None:  # else the one the caller authenticated (not read again)
            manifest = read_manifest(step_dir)
        if not 0 <= rank < manifest.world_size:
            raise CheckpointCorruptError(f"{step_dir.name}: no rank {rank} in a checkpoint of "
                                         f"{manifest.world_size} ranks")
        self.state, self.meta, streams = _plan_load(step_dir, manifest, rank)
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, args=(manifest, streams),
                                            name="cfrun-checkpoint-read", daemon=True)
            self._thread.start()
        else:
            self._run(manifest, streams)

    def _run(self, manifest: Manifest, streams: _Streams) -> None:
        try:
            if self._thread is not None:
                time.sleep(float(faults.value("rank.read_delay_s") or 0.0))
            for q, targets in streams:
                _stream_into(self.step_dir, manifest, q, targets)
        except BaseException as e:  # handed to wait(), on the caller's thread
            self._error = e
        finally:
            self.read_s = time.time() - self.start_unix_s

    def done(self) -> bool:
        """True once the read ended (well or not)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> tuple[Any, dict[str, Any]]:
        """Wait for the read to end; ``(state, meta)`` as :func:`load_shard` returns them.

        Raises:
            CheckpointCorruptError: a ``.bin`` is not a regular file, has another size, is
                unreadable or fails its checksum.
            Exception: anything else the read raised (not a verdict on the files).
        """
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.state, self.meta


def _plan_load(step_dir: Path, manifest: Manifest, rank: int) -> tuple[Any, dict[str, Any],
                                                                          _Streams]:
    """Rank ``rank``'s decoded tree and meta around freshly allocated tensors, and what to
    stream into them (:class:`ShardRead`).

    Each tensor is allocated once at its final size; only the bytes this rank needs are read:
    its own tensors from its own file and, with 1/N sharding, every rank's slice of each
    replicated tensor straight into the full tensor (no per-rank copies, no ``torch.cat``).

    Raises:
        CheckpointCorruptError: see :func:`load_shard`; also the ranks' 1/N layouts disagree.
    """
    doc, entries = read_doc(step_dir, manifest, rank)
    try:
        tree = doc["tree"]
        layout = (tree.get("sharded") if isinstance(tree, dict) else None) or []
        tensors: list[torch.Tensor | None] = [None] * len(entries)
        fulls: dict[int, torch.Tensor] = {}
        for ent in layout:
            i = int(ent["index"])
            dtype = _DTYPES.get(str(ent["dtype"]))
            if dtype is None or not 0 <= i < len(entries) or i in fulls:
                raise ValueError(f"sharded entry {ent} names no tensor of the table")
            fulls[i] = torch.empty([int(n) for n in ent["shape"]], dtype=dtype)
        own: list[_Target] = []
        for i, e in enumerate(entries):
            if i in fulls:
                continue
            t = _empty_like_entry(e)
            tensors[i] = t
            own.append((e, t, None))
        targets: dict[int, list[_Target]] = {rank: own}
        for q in range(manifest.world_size) if layout else ():
            q_entries = entries
            q_layout = layout
            if q != rank:
                q_doc, q_entries = read_doc(step_dir, manifest, q)
                q_tree = q_doc["tree"]
                q_layout = (q_tree.get("sharded") if isinstance(q_tree, dict) else None) or []
            if len(q_layout) != len(layout):
                raise ValueError(f"rank {q} has {len(q_layout)} sharded tensors, rank {rank} "
                                 f"{len(layout)}")
            for k, (ent, q_ent) in enumerate(zip(layout, q_layout)):
                if (q_ent["shape"], q_ent["dim"], q_ent["ranges"], q_ent["dtype"]) != (
                        ent["shape"], ent["dim"], ent["ranges"], ent["dtype"]):
                    raise ValueError(f"sharded tensor {k}: rank {q}'s layout {q_ent} differs "
                                     f"from rank {rank}'s {ent}")
                j = int(q_ent["index"])
                if not 0 <= j < len(q_entries):
                    raise ValueError(f"rank {q}'s sharded entry {k} names no tensor")
                full = fulls[int(ent["index"])]
                start, stop = (int(n) for n in ent["ranges"][q])
                part = full.narrow(int(ent["dim"]), start, stop - start)
                e = q_entries[j]
                if list(e.shape) != list(part.shape) or e.dtype != ent["dtype"]:
                    raise ValueError(f"sharded tensor {k}: rank {q}'s slice is {e.dtype} "
                                     f"{list(e.shape)}, not {ent['dtype']} {list(part.shape)}")
                targets.setdefault(q, []).append((e, None, part))
        for i, full in fulls.items():
            tensors[i] = full
        meta = doc.get("meta", {})
        state = decode(tree, [t for t in tensors if t is not None])  # every one is set
        streams = [(q, sorted(targets[q], key=lambda x: x[0].offset)) for q in sorted(targets)]
        return state, meta, streams
    except CheckpointCorruptError:
        raise
    except _DECODE_ERRORS as e:
        raise CheckpointCorruptError(f"{step_dir.name}: rank {rank}'s shard does not decode "
                                     f"({type(e).__name__}: {str(e)[:200]})") from None


def _empty_like_entry(e: TensorEntry) -> torch.Tensor:
    """A fresh CPU tensor of ``e``'s dtype and shape (its bytes come from the stream).

    Raises:
        ValueError: unknown dtype, or ``nbytes`` other than elements times item size.
    """
    dtype = _DTYPES.get(e.dtype)
    if dtype is None:
        raise ValueError(f"unknown dtype {e.dtype!r} in checkpoint")
    if e.nbytes != math.prod(e.shape) * dtype.itemsize:
        raise ValueError(f"nbytes {e.nbytes} does not hold shape {list(e.shape)} of {e.dtype}")
    return torch.empty(e.shape, dtype=dtype)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of contiguous CPU tensor ``t``, writable, in place (any dtype, bfloat16 too)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def _stream_into(step_dir: Path, manifest: Manifest, q: int,
                 targets: list[_Target]) -> None:
    """Read rank ``q``'s ``.bin`` once, sequentially, checking its size and checksum: each
    target's bytes (sorted by offset, not overlapping: :func:`check_layout`) straight into its
    tensor, a fresh contiguous one or a contiguous slice of a full tensor (a slice that is not
    contiguous through a temporary of its size), and the bytes between them through a
    :data:`LOAD_CHUNK_BYTES` buffer. Large ``readv`` calls into the final memory, the kernel
    told the file is read sequentially: page-cache speed, no copy (issue 23, item 5).

    Raises:
        CheckpointCorruptError: not a regular file, another size, unreadable, checksum.
    """
    bin_name, _ = shard_names(q)
    entry = manifest.entry(bin_name)
    where = f"{step_dir.name}/{bin_name}"
    try:
        fd, _size = open_regular(step_dir / bin_name, max_bytes=entry.nbytes)
    except UnsafeFileError as err:
        raise CheckpointCorruptError(f"{where}: refused ({err})") from None
    except OSError as err:
        raise CheckpointCorruptError(f"{where}: unreadable ({err.strerror or err})") from None
    h = xxhash.xxh3_64()
    scratch = memoryview(bytearray(min(LOAD_CHUNK_BYTES, entry.nbytes) or 1))
    pos = 0

    def fill(view: memoryview) -> None:
        """Read exactly ``len(view)`` bytes at ``pos`` into ``view``, hash them."""
        nonlocal pos
        got = 0
        while got < len(view):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise CheckpointCorruptError(f"{where}: {pos + got} bytes, manifest says "
                                             f"{entry.nbytes}")
            got += n
        h.update(view)
        pos += got

    def skip_to(offset: int) -> None:
        while pos < offset:
            fill(scratch[:min(len(scratch), offset - pos)])

    try:
        with contextlib.suppress(AttributeError, OSError):  # advice only (not on every OS)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for e, fresh, part in targets:
            if e.offset < pos or e.offset + e.nbytes > entry.nbytes:
                raise CheckpointCorruptError(f"{where}: tensor bytes at {e.offset} outside the "
                                             "file or overlapping")
            skip_to(e.offset)
            if e.nbytes == 0:
                continue
            dst = fresh if fresh is not None else part
            assert dst is not None
            if dst.is_contiguous():
                fill(_byte_view(dst))
            else:
                temp = torch.empty(e.nbytes, dtype=torch.uint8)
                fill(_byte_view(temp))
                dst.copy_(temp.view(dst.dtype).view(dst.shape))
        skip_to(entry.nbytes)
        if os.read(fd, 1):
            raise CheckpointCorruptError(f"{where}: longer than the manifest's "
                                         f"{entry.nbytes} bytes")
    except OSError as err:
        raise CheckpointCorruptError(f"{where}: unreadable ({err.strerror or err})") from None
    finally:
        os.close(fd)
    if h.hexdigest() != entry.xxh3_64:
        raise CheckpointCorruptError(f"{where}: checksum mismatch")


class WorldSizeChangedError(Exception):
    """The newest checkpoint was written by another number of ranks (nothing is skipped or
    quarantined: the checkpoint is fine, the run is not)."""

    def __init__(self, step: int, saved: int, now: int) -> None:
        super().__init__(f"checkpoint step {step} was written by {saved} ranks, this run has "
                         f"{now}")
        self.step, self.saved, self.now = step, saved, now


class RankLoadError(Exception):
    """This rank could not read its own shard of a checkpoint that every rank's
    :func:`check_usable` passed (an I/O error, or a file changed meanwhile). The other ranks
    may have loaded it: the caller moves the checkpoint aside and restarts the attempt, so
    that every rank falls back to the same older one."""

    def __init__(self, step: int, error: BaseException) -> None:
        super().__init__(f"checkpoint step {step}: this rank's shard did not load "
                         f"({type(error).__name__}: {str(error)[:200]})")
        self.step = step


class JobMismatchError(FatalJobError):
    """A checkpoint that is fine does not fit the live job: a model's or optimizer's keys,
    shapes or dtypes, the optimizer's parameter groups, or the schedulers and scalers differ
    (:func:`check_fits`). The user changed the job; nothing is moved aside (exit 5)."""


def _read_rank(step_dir: Path, manifest: Manifest, rank: int, *, real: bool = True
               ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One rank's verified JSON doc and its tensors (CPU; ``real=False``: ``meta`` tensors of
    the table's dtypes and shapes, the ``.bin`` not read), every entry checked.

    Raises:
        CheckpointCorruptError: see :func:`load_shard`.
    """
    bin_name, _ = shard_names(rank)
    doc, entries = read_doc(step_dir, manifest, rank)
    try:
        if not real:
            return doc, [meta_tensor(e) for e in entries]
        data = manifest.read_file(step_dir, bin_name)
        tensors = [tensor_from_buffer(data, e) for e in entries]
    except _DECODE_ERRORS as e:
        raise CheckpointCorruptError(f"{step_dir.name}/{bin_name}: {e}") from None
    return doc, tensors


def assemble_rank(step_dir: Path, manifest: Manifest, rank: int,
              docs: dict[int, tuple[dict[str, Any], list[torch.Tensor]]]
              ) -> tuple[Any, dict[str, Any]]:
    """Rank ``rank``'s decoded state and meta from the docs and tensors of every rank in
    ``docs`` (read on demand when missing, verified whole): what :func:`check_usable` judges
    and what a resume on another world size reads (:class:`cfrun.codec.reshard.ReshardRead`).

    Raises:
        CheckpointCorruptError: the tree does not decode, or the ranks' 1/N layouts disagree.
    """
    def rank_doc(q: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if q not in docs:
            docs[q] = _read_rank(step_dir, manifest, q)
        return docs[q]

    doc, tensors = rank_doc(rank)
    tensors = list(tensors)  # reassemble replaces entries: the cached list stays as read
    try:
        layout = doc["tree"].get("sharded") if isinstance(doc["tree"], dict) else None
        if layout:  # DeepFreeze 1/N: every rank's slices of the replicated tensors
            from cfrun.codec.sharding import reassemble

            others = {}
            for q in range(manifest.world_size):
                if q != rank:
                    q_doc, q_tensors = rank_doc(q)
                    q_tree = q_doc["tree"]
                    others[q] = (q_tensors, (q_tree.get("sharded") if isinstance(q_tree, dict)
                                             else None) or [])
            reassemble(rank, tensors, layout, others)
        meta = doc.get("meta", {})
        return decode(doc["tree"], tensors), meta
    except _DECODE_ERRORS as e:
        raise CheckpointCorruptError(f"{step_dir.name}: rank {rank}'s shard does not decode "
                                     f"({type(e).__name__}: {str(e)[:200]})") from None


def check_usable(step_dir: Path, *, world_size: int | None = None,
                 check_state: Callable[[Any, dict[str, Any]], None] | None = None,
                 loading_rank: int | None = None, manifest: Manifest | None = None) -> Manifest:
    """Judge a committed checkpoint the same way on every rank, before any rank loads it.

    Every rank's shard is listed and present (:func:`check_complete`), every file passes its
    checksum (streamed), and every rank's tree decodes against ``meta`` tensors of its table
    (no tensor bytes held) and passes ``check_state(state, meta)`` (what the resume will look
    up). All of it depends only on the files, so every rank of the job reaches the same verdict
    without talking to the others, and all of them fall back to the same older checkpoint.
    Called by each rank at resume (:func:`load_newest`); costs one read of the whole checkpoint
    per rank (from the page cache after the first rank of a node). ``loading_rank``: the rank
    about to load its shard; its own ``.bin`` is not read here, since the load streams and
    checksums it anyway (:func:`_stream_into`) and a mismatch there falls back the same way
    (:func:`load_newest`); every other rank still checks that file, so all reach one verdict.
    One read of the rank's own shard instead of two (issue 16: load time at resume).
    ``manifest``: the one the caller read and authenticated (:func:`open_newest`), used as
    it is, so that the files checked are the ones it names.

    Raises:
        WorldSizeChangedError: ``world_size`` is given and the checkpoint has another.
        CheckpointCorruptError: any other failure, whatever its type (an ``OSError``, a
            ``KeyError`` from ``check_state``...), in one line naming it.
        IncompatibleFormatError: written in a format this cfrun cannot read.
    """
    manifest = check_complete(step_dir, manifest)
    if world_size is not None and manifest.world_size != world_size:
        raise WorldSizeChangedError(manifest.step, manifest.world_size, world_size)
    try:
        own = frozenset() if loading_rank is None else frozenset({shard_names(loading_rank)[0]})
        manifest.verify_dir(step_dir, skip=own)
        docs = {q: _read_rank(step_dir, manifest, q, real=False)
                for q in range(manifest.world_size)}
        for q in range(manifest.world_size):
            state, meta = assemble_rank(step_dir, manifest, q, docs)
            if check_state is not None:
                check_state(state, meta)
    except (CheckpointCorruptError, IncompatibleFormatError):
        raise
    except Exception as e:
        raise CheckpointCorruptError(f"{step_dir.name}: {type(e).__name__}: "
                                     f"{str(e)[:200]}") from None
    return manifest


def load_newest(checkpoints: Path, rank: int, *, on_skip: Any = None,
                world_size: int | None = None,
                check_state: Callable[[Any, dict[str, Any]], None] | None = None,
                below: int | None = None, keys: ManifestKeys | None = None,
                on_refused: Callable[[list[tuple[int, str]]], None] | None = None
                ) -> tuple[int, Any, dict[str, Any]] | None:
    """The newest usable checkpoint (:func:`check_usable`), falling back to older ones, read
    on the caller's thread (:func:`open_newest` with the read done before it returns).

    Returns:
        ``(step, state, meta)``, or ``None`` when no committed checkpoint is usable.

    Raises:
        WorldSizeChangedError, RankLoadError: see :func:`open_newest`.
    """
    got = open_newest(checkpoints, rank, on_skip=on_skip, world_size=world_size,
                      check_state=check_state, below=below, background=False, keys=keys,
                      on_refused=on_refused)
    if got is None:
        return None
    state, meta = got[1].wait()
    return got[0], state, meta


MAX_RESUME_CANDIDATES = 64
"""Step directories a resume examines at most, newest first (their manifests only, until one
is authenticated and usable): a flood of planted ``step-*`` directories costs a bounded number
of small reads, never a read of the files they name (issue 32, finding 4)."""


def _authenticated(checkpoints: Path, steps: list[int], keys: ManifestKeys | None
                   ) -> tuple[dict[int, Manifest], list[tuple[int, str]]]:
    """The manifests of ``steps`` that are the job's (:meth:`Manifest.check_mac`: MAC-less ones
    only where no manifest of ``steps`` carries a MAC, :func:`mac_required`), and the refused
    ``(step, why)``. Unreadable manifests are left out of both (:func:`check_usable` judges
    them). Reads manifests only. ``keys`` None: no authentication, an empty dict."""
    if keys is None:
        return {}, []
    read: dict[int, Manifest] = {}
    for step in steps:
        try:
            read[step] = read_manifest(checkpoints / step_dir_name(step))
        except (CheckpointCorruptError, IncompatibleFormatError):
            continue
    require = mac_required(list(read.values()))
    ours: dict[int, Manifest] = {}
    refused: list[tuple[int, str]] = []
    for step, m in read.items():
        try:
            m.check_mac(keys, require=require, where=step_dir_name(step))
        except ForeignCheckpointError as e:
            refused.append((step, str(e)))
            continue
        ours[step] = m
    return ours, refused


def open_newest(checkpoints: Path, rank: int, *, on_skip: Any = None,
                world_size: int | None = None,
                check_state: Callable[[Any, dict[str, Any]], None] | None = None,
                below: int | None = None, background: bool = True,
                reshard: Callable[[Path, int, int], Any] | None = None,
                keys: ManifestKeys | None = None,
                on_refused: Callable[[list[tuple[int, str]]], None] | None = None
                ) -> tuple[int, Any] | None:
    """The newest usable checkpoint (:func:`check_usable`), falling back to older ones, and
    this rank's :class:`ShardRead` of it (its tensors still being read when ``background``).

    With ``keys`` (the job's :class:`ManifestKeys`), a manifest is authenticated before any
    file it names is opened (:func:`_authenticated`), and the files checked and read are the
    ones that manifest names (it is not read again). A manifest that is not the job's is
    skipped where it lies (:class:`ForeignCheckpointError`: nothing moved nor deleted), and
    all of them are handed to ``on_refused([(step, why), ...])`` once. At most
    :data:`MAX_RESUME_CANDIDATES` step directories are examined.

    A checkpoint that is not usable is moved aside (:func:`skip_checkpoint`). Every rank calls
    this at resume and reaches the same step; a rank whose own shard then fails its read
    (:meth:`ShardRead.wait`) calls :func:`skip_checkpoint` and this again with ``below`` the
    step, which is where the synchronous read would have gone on (:mod:`cfrun.rank.resume`).

    Args:
        below: only steps lower than this one (the fallback after a failed read).
        background: False: the shard is read (and its failure judged) before returning.
        reshard: with ``--reshard``, what reads a checkpoint of another world size than
            ``world_size`` (:class:`cfrun.codec.reshard.ReshardRead`, given by the caller, so
            that this module does not import the one that imports it); None: such a
            checkpoint is refused.
        keys: the job's manifest keys (the rank's settings); None: manifests are not
            authenticated (``cfrun export``, a rank started without a supervisor).
        on_refused: called once with every ``(step, why)`` refused as not the job's.

    Returns:
        ``(step, read)``, or ``None`` when no committed checkpoint is usable.

    Raises:
        WorldSizeChangedError: ``world_size`` is given and the newest readable manifest was
            written by another number of ranks (before any rank loads or quarantines it).
        RankLoadError: this rank's own shard failed after the checks passed, other than by
            its bytes (an I/O error): a corrupt shard is a verdict, and falls back.
    """
    steps = [s for s in committed_steps(checkpoints)
             if below is None or s < below][:MAX_RESUME_CANDIDATES]
    ours, refused = _authenticated(checkpoints, steps, keys)
    if refused and on_refused is not None:
        on_refused(refused)
    refused_steps = {s for s, _ in refused}
    for step in steps:
        if step in refused_steps:
            continue
        step_dir = checkpoints / step_dir_name(step)
        manifest: Manifest | None = ours.get(step)
        if manifest is not None and manifest.meta.get("final") is True:
            continue  # the script's end: no position to resume at (issue 27, item 2)
        if manifest is None and is_final(step_dir):
            continue
        try:
            manifest = check_usable(step_dir, world_size=None if reshard else world_size,
                                    check_state=check_state,
                                    loading_rank=None if reshard else rank,
                                    manifest=manifest)  # all verified
            read: Any
            if reshard and world_size is not None and manifest.world_size != world_size:
                read = reshard(step_dir, rank, world_size)
            else:
                read = ShardRead(step_dir, rank, background=background, manifest=manifest)
            if not background:
                read.wait()
        except (CheckpointCorruptError, IncompatibleFormatError) as e:
            skip_checkpoint(checkpoints, step, rank, e, on_skip)
            continue
        except WorldSizeChangedError:
            raise
        except Exception as e:  # not a verdict on the files: this rank could not load them
            raise RankLoadError(step, e) from None
        return step, read
    return None


def skip_checkpoint(checkpoints: Path, step: int, rank: int, error: Exception,
                    on_skip: Any = None) -> None:
    """Move checkpoint ``step``, found unusable, aside (:func:`quarantine`: ``corrupt-step-…``,
    or ``incompatible-step-…`` for a format this cfrun cannot read) so that neither retention,
    ``cfrun ls`` nor a later resume counts it again; ``on_skip(step, error)`` is called by the
    one rank whose move succeeded (by rank 0 where none could move it), so that the job says
    it once. Called by each rank that judged it so (:func:`open_newest`, the resume)."""
    step_dir = checkpoints / step_dir_name(step)
    moved = quarantine(checkpoints, step,
                       INCOMPATIBLE if isinstance(error, IncompatibleFormatError) else CORRUPT)
    # said once: by the rank that moved it (or rank 0, if it could not be moved)
    if moved is not None or (rank == 0 and os.path.lexists(step_dir)):
        logger.warning("cfrun: skipping checkpoint %s: %s; trying the previous one",
                       step_dir.name, error)
        if on_skip is not None:
            on_skip(step, error)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def check_like(loaded: Any, live: Any, where: str, *, strict_keys: bool = False) -> None:
    """The tensors of a loaded ``state_dict`` have the dtype and shape of the live object's.

    A checksum shows the bytes are the ones the manifest's writer meant, not that they fit the
    live job: a changed layer width, or ``int32`` written over ``float32`` bytes (the right size;
    ``load_state_dict`` would convert it silently). The rank calls this (through
    :func:`check_fits`) before ``load_state_dict`` for each model and optimizer. Nested dicts and
    lists are compared key by key; with ``strict_keys`` a key of the top-level dict on one side
    only is a difference too (a model's state dict), else such keys are left alone.

    Raises:
        JobMismatchError: the first difference, naming the tensor, its dtype and shape on
            both sides.
    """
    if strict_keys and isinstance(loaded, dict) and isinstance(live, dict):
        for k in loaded:
            if k not in live:
                raise JobMismatchError(f"{where}.{k} is in the checkpoint, not in the live job")
        for k in live:
            if k not in loaded:
                raise JobMismatchError(f"{where}.{k} is in the live job, not in the checkpoint")
    stack: list[tuple[str, Any, Any]] = [(where, loaded, live)]
    while stack:
        path, a, b = stack.pop()
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape:
                raise JobMismatchError(
                    f"{path} is {_dtype_name(a)} {list(a.shape)} in the checkpoint, "
                    f"{_dtype_name(b)} {list(b.shape)} live")
        elif isinstance(a, dict) and isinstance(b, dict):
            stack.extend((f"{path}.{k}", a[k], b[k]) for k in reversed(list(a)) if k in b)
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
            stack.extend((f"{path}[{i}]", x, y) for i, (x, y) in reversed(list(enumerate(zip(a,
                                                                                          b)))))


def _check_groups(saved: Any, live: dict[str, Any], where: str) -> None:
    """An optimizer's parameter groups: as many, each with as many parameters. (Their
    hyperparameter names are not compared: a newer torch adds some to the same optimizer.)"""
    groups, now = saved.get("param_groups"), live["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(now):
        n = len(groups) if isinstance(groups, list) else "no"
        raise JobMismatchError(f"{where} has {n} parameter groups in the checkpoint, "
                               f"{len(now)} live")
    for g, (a, b) in enumerate(zip(groups, now)):
        n_saved = len(a.get("params", ())) if isinstance(a, dict) else 0
        if n_saved != len(b["params"]):
            raise JobMismatchError(f"{where} parameter group {g} has {n_saved} parameters in "
                                   f"the checkpoint, {len(b['params'])} live")


def check_fits(state: dict[str, Any], models: list[Any], optimizers: list[Any],
               schedulers: list[Any], scalers: list[Any]) -> None:
    """The checkpoint's state fits the live job, before anything is applied: as many models,
    optimizers, schedulers and scalers; every model's keys, shapes and dtypes
    (:func:`check_like`); every optimizer's parameter groups (count, sizes) and state tensors;
    every scheduler's and scaler's public state names (another class has others). Called by
    each rank when it arrives at the resume point (training thread).

    Raises:
        JobMismatchError: the first difference, in one line.
    """
    for kind, live, saved in (("models", models, state["modules"]),
                              ("optimizers", optimizers, state["optimizers"]),
                              ("LR schedulers", schedulers, state["schedulers"]),
                              ("GradScalers", scalers, state["scalers"])):
        if len(live) != len(saved):
            raise JobMismatchError(f"the script built {len(live)} {kind}, the checkpoint "
                                   f"holds {len(saved)}")
    for i, (m, sd) in enumerate(zip(models, state["modules"])):
        check_like(sd, m.state_dict(), f"model {i} ({type(m).__name__})", strict_keys=True)
    for i, (o, sd) in enumerate(zip(optimizers, state["optimizers"])):
        where = f"optimizer {i} ({type(o).__name__})"
        live = o.state_dict()
        _check_groups(sd, live, where)
        check_like(sd, live, where)
    for kind, objs, saved in (("LR scheduler", schedulers, state["schedulers"]),
                              ("GradScaler", scalers, state["scalers"])):
        for i, (obj, sd) in enumerate(zip(objs, saved)):
            if sd is None:  # its state could not be stored (flagged when taken)
                continue
            # public names only: a newer torch adds private attributes to the same class
            got = {k for k in obj.state_dict() if not str(k).startswith("_")}
            keys = {k for k in sd if not str(k).startswith("_")} if isinstance(sd, dict) \
                else set()
            if keys != got:
                parts = [f"{', '.join(sorted(map(str, a - b)))} only {where}"
                         for a, b, where in ((keys, got, "in the checkpoint"),
                                             (got, keys, "live")) if a - b]
                raise JobMismatchError(f"{kind} {i} ({type(obj).__name__}): "
                                       f"{'; '.join(parts)} (another class?)")


def check_free_params(saved: Any, live: list[list[tuple[int, torch.Tensor]]]) -> None:
    """The checkpoint's free parameters (fp32 master weights no module owns, per optimizer:
    ``[{"index", "value"}]``) are the live job's: the same positions in each optimizer's
    flattened ``param_groups``, each of the same dtype and shape. ``saved`` None: a checkpoint
    of an older cfrun (nothing to check). Called by each rank before anything is applied.

    Raises:
        JobMismatchError: the first difference, in one line.
    """
    if saved is None:
        return
    if len(saved) != len(live):
        raise JobMismatchError(f"the checkpoint holds free parameters of {len(saved)} "
                               f"optimizers, the live job {len(live)}")
    for i, (items, now) in enumerate(zip(saved, live)):
        got = dict(now)
        where = f"optimizer {i}'s parameters outside any model (master weights?)"
        if sorted(int(it["index"]) for it in items) != sorted(got):
            raise JobMismatchError(f"{where}: positions {[it['index'] for it in items]} in the "
                                   f"checkpoint, {sorted(got)} live")
        for it in items:
            check_like(it["value"], got[int(it["index"])].detach(),
                       f"{where} [{it['index']}]")
