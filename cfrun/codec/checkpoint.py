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

import logging
import math
import os
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
from cfrun.contract.checkpoints import (  # noqa: F401  (re-exported for the ranks)
    CORRUPT,
    INCOMPATIBLE,
    MANIFEST,
    FileEntry,
    Manifest,
    apply_retention,
    check_complete,
    check_good,
    commit,
    committed_steps,
    good_steps,
    quarantine,
    read_manifest,
    remove_staging,
    shard_names,
    staging_dir,
    verify,
    write_file,
)
from cfrun.contract.errors import CheckpointCorruptError, FatalJobError, IncompatibleFormatError
from cfrun.contract.fsio import UnsafeFileError, open_regular
from cfrun.contract.jobdir import step_dir_name
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
    manifest = read_manifest(step_dir)
    if not 0 <= rank < manifest.world_size:
        raise CheckpointCorruptError(f"{step_dir.name}: no rank {rank} in a checkpoint of "
                                     f"{manifest.world_size} ranks")
    return _load_streamed(step_dir, manifest, rank)


_Target = tuple[TensorEntry, "torch.Tensor | None", "torch.Tensor | None"]
"""A tensor to fill from a shard file: its table entry, and either a fresh tensor of its own
or a slice of a full (1/N-reassembled) tensor."""

LOAD_CHUNK_BYTES = 16 << 20
"""A rank streams each shard file through a buffer of this size at load (bounded memory)."""


def _load_streamed(step_dir: Path, manifest: Manifest, rank: int) -> tuple[Any, dict[str, Any]]:
    """Rank ``rank``'s decoded state and meta, holding no more than its own state plus one
    chunk (issue 18, item 10).

    Each tensor is allocated once at its final size; each shard file is streamed once through a
    :data:`LOAD_CHUNK_BYTES` buffer, checksummed as it goes, and only the bytes this rank needs
    are copied out: its own tensors from its own file and, with 1/N sharding, every rank's
    slice of each replicated tensor straight into the full tensor (no per-rank copies, no
    ``torch.cat``). Reading every rank's whole file and reassembling held about twice the
    state per rank.

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
        for q in sorted(targets):
            _stream_into(step_dir, manifest, q, sorted(targets[q], key=lambda x: x[0].offset))
        meta = doc.get("meta", {})
        return decode(tree, [t for t in tensors if t is not None]), meta  # every one is set
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


def _stream_into(step_dir: Path, manifest: Manifest, q: int,
                 targets: list[_Target]) -> None:
    """Stream rank ``q``'s ``.bin`` once, checking its size and checksum, and copy each
    target's byte range (sorted by offset, not overlapping: :func:`check_layout`) into its
    tensor: a fresh contiguous one, or a slice of a full tensor (through a contiguous
    temporary of the slice's size when the slice is not contiguous).

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
    chunk = bytearray(LOAD_CHUNK_BYTES)
    view = memoryview(chunk)
    src = torch.frombuffer(chunk, dtype=torch.uint8)
    pos = 0
    k = 0  # the first target not yet complete
    temp: torch.Tensor | None = None
    try:
        while True:
            n = os.readv(fd, [view])
            if n == 0:
                break
            if pos + n > entry.nbytes:
                raise CheckpointCorruptError(f"{where}: longer than the manifest's "
                                             f"{entry.nbytes} bytes")
            h.update(view[:n])
            end = pos + n
            while k < len(targets) and targets[k][0].offset < end:
                e, fresh, part = targets[k]
                if fresh is not None:
                    dst = fresh.reshape(-1).view(torch.uint8) if e.nbytes else None
                elif part is not None and part.is_contiguous():
                    dst = part.reshape(-1).view(torch.uint8) if e.nbytes else None
                else:
                    if temp is None:
                        temp = torch.empty(e.nbytes, dtype=torch.uint8)
                    dst = temp
                lo, hi = max(e.offset, pos), min(e.offset + e.nbytes, end)
                if dst is not None and hi > lo:
                    dst[lo - e.offset:hi - e.offset].copy_(src[lo - pos:hi - pos])
                if e.offset + e.nbytes > end:
                    break  # the rest of this tensor is in the next chunk
                if fresh is None and part is not None and temp is not None:
                    part.copy_(temp.view(part.dtype).view(part.shape))
                temp = None
                k += 1
            pos = end
    except OSError as err:
        raise CheckpointCorruptError(f"{where}: unreadable ({err.strerror or err})") from None
    finally:
        os.close(fd)
    while k < len(targets) and targets[k][0].nbytes == 0:  # empty tensors at the very end
        k += 1
    if pos != entry.nbytes or k != len(targets):
        raise CheckpointCorruptError(f"{where}: {pos} bytes, manifest says {entry.nbytes}")
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


def _assemble(step_dir: Path, manifest: Manifest, rank: int,
              docs: dict[int, tuple[dict[str, Any], list[torch.Tensor]]]
              ) -> tuple[Any, dict[str, Any]]:
    """Rank ``rank``'s decoded state and meta from the docs and tensors of every rank in
    ``docs`` (read on demand when missing).

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
                 loading_rank: int | None = None) -> Manifest:
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

    Raises:
        WorldSizeChangedError: ``world_size`` is given and the checkpoint has another.
        CheckpointCorruptError: any other failure, whatever its type (an ``OSError``, a
            ``KeyError`` from ``check_state``...), in one line naming it.
        IncompatibleFormatError: written in a format this cfrun cannot read.
    """
    manifest = check_complete(step_dir)
    if world_size is not None and manifest.world_size != world_size:
        raise WorldSizeChangedError(manifest.step, manifest.world_size, world_size)
    try:
        own = frozenset() if loading_rank is None else frozenset({shard_names(loading_rank)[0]})
        manifest.verify_dir(step_dir, skip=own)
        docs = {q: _read_rank(step_dir, manifest, q, real=False)
                for q in range(manifest.world_size)}
        for q in range(manifest.world_size):
            state, meta = _assemble(step_dir, manifest, q, docs)
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
                check_state: Callable[[Any, dict[str, Any]], None] | None = None
                ) -> tuple[int, Any, dict[str, Any]] | None:
    """The newest usable checkpoint (:func:`check_usable`), falling back to older ones.

    A checkpoint that is not usable is moved aside (:func:`quarantine`: ``corrupt-step-…``, or
    ``incompatible-step-…`` for a format this cfrun cannot read) so that neither retention,
    ``cfrun ls`` nor a later resume counts it again; ``on_skip(step, error)`` is called for
    each by the one rank whose move succeeded (by rank 0 where none could move it), so that
    the job says it once. Every rank calls this at resume and reaches the same step.

    Returns:
        ``(step, state, meta)``, or ``None`` when no committed checkpoint is usable.

    Raises:
        WorldSizeChangedError: ``world_size`` is given and the newest readable manifest was
            written by another number of ranks (before any rank loads or quarantines it).
        RankLoadError: this rank's own shard failed after the checks passed, other than by
            its bytes (an I/O error): a corrupt shard is a verdict, and falls back.
    """
    for step in committed_steps(checkpoints):
        step_dir = checkpoints / step_dir_name(step)
        try:
            check_usable(step_dir, world_size=world_size, check_state=check_state,
                         loading_rank=rank)
            state, meta = load_shard(step_dir, rank)
        except (CheckpointCorruptError, IncompatibleFormatError) as e:
            moved = quarantine(checkpoints, step,
                               INCOMPATIBLE if isinstance(e, IncompatibleFormatError) else CORRUPT)
            # said once: by the rank that moved it (or rank 0, if it could not be moved)
            if moved is not None or (rank == 0 and os.path.lexists(step_dir)):
                logger.warning("cfrun: skipping checkpoint %s: %s; trying the previous one",
                               step_dir.name, e)
                if on_skip is not None:
                    on_skip(step, e)
            continue
        except WorldSizeChangedError:
            raise
        except Exception as e:  # not a verdict on the files: this rank could not load them
            raise RankLoadError(step, e) from None
        return step, state, meta
    return None


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
