"""The coordination files of a job dir: every path named once, every content a typed record.

The ranks, the supervisor and the inspection commands talk through small files in the job dir
(DESIGN.md §5, "Supervision"); this module is the only place that spells their names and
their fields::

    <job_dir>/
      stop_request.json                        supervisor -> ranks: stop by a grace deadline
      stop_step.json                           rank 0 -> ranks: the step every rank stops at
      stop_decision.json                       rank 0 -> ranks: final checkpoint or not
      fatal.json                               a rank -> supervisor: resuming would be wrong
                                               (the agent -> ranks: starting over would be)
      checkpoint_gate.json                     rank 0 -> ranks: from which step no checkpoint
                                               is in flight (a due one is deferred till then)
      heartbeat-rank-00000                     a rank -> supervisor: its step, rewritten each step
      errors/attempt-A-rank-R.json             a rank's uncaught exception
      ended/node-N-attempt-A-rank-R.json       a rank's end of script, before teardown
      preempted/node-N-attempt-A-rank-R.json   a rank stopped for a preemption

Each record has ``to_json()`` and ``parse(doc)``; ``parse`` refuses unknown fields, missing
fields, wrong types, out-of-range and non-finite numbers with :class:`MalformedRecordError`.
Writers use the one fsync writer (:func:`cfrun.contract.fsio.atomic_write_json`) through
:func:`write`; :func:`read` returns None for a missing or unreadable file (a reader polls
before the writer has written) and also for a malformed one, which is never trusted and is
reported once on stderr.

Torch-free: imported by the ranks, the supervisor and the CLI.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from cfrun.contract.fsio import atomic_write_json, read_regular

STOP_REQUEST = "stop_request.json"
STOP_STEP = "stop_step.json"
STOP_DECISION = "stop_decision.json"
FATAL = "fatal.json"
CHECKPOINT_GATE = "checkpoint_gate.json"
ERRORS_DIR = "errors"
ENDED_DIR = "ended"
PREEMPTED_DIR = "preempted"
HEARTBEAT_PREFIX = "heartbeat-rank-"
HEARTBEAT_GLOB = HEARTBEAT_PREFIX + "*"

STALE_AT_START = (FATAL, STOP_REQUEST, STOP_STEP, STOP_DECISION)
"""Files of a previous cfrun that a new supervisor removes before its first attempt."""

MAX_RECORD_BYTES = 1 << 20
"""Largest coordination file read (a rank error with its traceback is a few KiB)."""
MAX_MESSAGE_CHARS = 2000
"""A rank error's message is cut to this many characters."""
MAX_TRACEBACK_LINES = 12
"""A rank error keeps this many last lines of its traceback."""


class MalformedRecordError(ValueError):
    """A coordination file's content is not the record it must be (unknown or missing field,
    wrong type, out of range, not finite)."""


# ---------------------------------------------------------------------------- paths


def checkpoint_gate_path(job_dir: Path) -> Path:
    """``<job_dir>/checkpoint_gate.json`` (:class:`CheckpointGate`)."""
    return Path(job_dir) / CHECKPOINT_GATE


def stop_request_path(job_dir: Path) -> Path:
    """``<job_dir>/stop_request.json`` (:class:`StopRequest`)."""
    return Path(job_dir) / STOP_REQUEST


def stop_step_path(job_dir: Path) -> Path:
    """``<job_dir>/stop_step.json`` (:class:`StopStep`)."""
    return Path(job_dir) / STOP_STEP


def stop_decision_path(job_dir: Path) -> Path:
    """``<job_dir>/stop_decision.json`` (:class:`StopDecision`)."""
    return Path(job_dir) / STOP_DECISION


def fatal_path(job_dir: Path) -> Path:
    """``<job_dir>/fatal.json`` (:class:`Fatal`)."""
    return Path(job_dir) / FATAL


def heartbeat_path(job_dir: Path, rank: int) -> Path:
    """``<job_dir>/heartbeat-rank-00003`` for global rank 3 (:class:`Heartbeat`)."""
    return Path(job_dir) / f"{HEARTBEAT_PREFIX}{rank:05d}"


def warm_imports_path(job_dir: Path, node_rank: int) -> Path:
    """``<job_dir>/warm-imports-node-N.json``: the modules node N's local rank 0 had imported at
    its first step, imported ahead by the node's next warm spare
    (:mod:`cfrun.rank.warm_imports`)."""
    return Path(job_dir) / f"warm-imports-node-{node_rank}.json"


def heartbeat_paths(job_dir: Path) -> list[Path]:
    """Every rank's heartbeat file in ``job_dir`` (any order)."""
    return list(Path(job_dir).glob(HEARTBEAT_GLOB))


def newest_heartbeat_step(job_dir: Path) -> int | None:
    """The highest step in the ranks' heartbeats (``heartbeat-rank-*``), None before any (a
    malformed file counts as absent, :meth:`Heartbeat.read`)."""
    steps = [b.step for b in map(Heartbeat.read, heartbeat_paths(job_dir)) if b is not None]
    return max(steps) if steps else None


def newest_heartbeat(job_dir: Path) -> tuple[int, float] | None:
    """``(step, mtime_unix_s)`` of the heartbeat with the highest step (the time that step
    was reached: a beat's mtime), None before any (:func:`newest_heartbeat_step`)."""
    best: tuple[int, float] | None = None
    for path in heartbeat_paths(job_dir):
        beat = Heartbeat.read(path)
        if beat is None:
            continue
        try:
            mtime_s = os.stat(path).st_mtime
        except OSError:
            continue
        if best is None or beat.step > best[0]:
            best = (beat.step, mtime_s)
    return best


_TRANSPORT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote worker crashing", "NCCL communicator was aborted")


def is_transport_error(error_type: str | None, message: str | None) -> bool:
    """A rank's error that only reports another rank's death (a collective lost its peer):
    gloo's and NCCL's ``DistNetworkError``/``DistBackendError``, or a message that says the
    peer closed, reset or crashed. The supervisor does not blame it for a failure
    (:mod:`cfrun.supervisor.machine`); the rank prints one line for it instead of its
    traceback (:mod:`cfrun.rank.install`)."""
    return error_type in ("DistNetworkError", "DistBackendError") or \
        any(t in (message or "") for t in _TRANSPORT)


def error_path(job_dir: Path, attempt: int, rank: int) -> Path:
    """``<job_dir>/errors/attempt-A-rank-R.json`` (:class:`RankError`)."""
    return Path(job_dir) / ERRORS_DIR / f"attempt-{attempt}-rank-{rank}.json"


def ended_path(job_dir: Path, node_rank: int, attempt: int, rank: int) -> Path:
    """``<job_dir>/ended/node-N-attempt-A-rank-R.json`` (:class:`EndedMark`)."""
    return Path(job_dir) / ENDED_DIR / f"node-{node_rank}-attempt-{attempt}-rank-{rank}.json"


def preempted_path(job_dir: Path, node_rank: int, attempt: int, rank: int) -> Path:
    """``<job_dir>/preempted/node-N-attempt-A-rank-R.json`` (:class:`PreemptedMark`)."""
    return (Path(job_dir) / PREEMPTED_DIR
            / f"node-{node_rank}-attempt-{attempt}-rank-{rank}.json")


_RANK_FILE = re.compile(r".*-rank-(\d+)(?:\.json)?$")


def rank_of(path: Path) -> int | None:
    """The rank R in a ``...-rank-R[.json]`` file name, None for another name."""
    m = _RANK_FILE.match(Path(path).name)
    return int(m.group(1)) if m else None


def errors_of(job_dir: Path, attempt: int) -> dict[int, Path]:
    """rank -> its ``errors/`` file of ``attempt``."""
    return _by_rank(Path(job_dir) / ERRORS_DIR, f"attempt-{attempt}-rank-*.json")


def ended_of(job_dir: Path, node_rank: int, attempt: int) -> dict[int, Path]:
    """rank -> the ``ended/`` mark of node ``node_rank``'s rank in ``attempt``."""
    return _by_rank(Path(job_dir) / ENDED_DIR, f"node-{node_rank}-attempt-{attempt}-rank-*.json")


def preempted_of(job_dir: Path, node_rank: int, attempt: int) -> dict[int, Path]:
    """rank -> the ``preempted/`` mark of node ``node_rank``'s rank in ``attempt``."""
    return _by_rank(Path(job_dir) / PREEMPTED_DIR,
                    f"node-{node_rank}-attempt-{attempt}-rank-*.json")


def _by_rank(directory: Path, pattern: str) -> dict[int, Path]:
    out = {}
    for p in directory.glob(pattern):
        rank = rank_of(p)
        if rank is not None:
            out[rank] = p
    return out


# ---------------------------------------------------------------------------- records


def _check(name: str, value: Any, kind: str, *, optional: bool = False) -> None:
    """Raise :class:`MalformedRecordError` unless ``value`` is of ``kind``: ``int`` (not a
    bool), ``step`` (int >= 0), ``rank`` (int >= 0), ``float`` (finite int or float),
    ``time`` (finite, >= 0), ``str``, ``bool``, ``lines`` (list of str)."""
    if value is None:
        if optional:
            return
        raise MalformedRecordError(f"field {name!r} is null")
    ok: bool
    if kind in ("int", "step", "rank"):
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and kind != "int" and value < 0:
            raise MalformedRecordError(f"field {name!r} is {value}, must be >= 0")
    elif kind in ("float", "time"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise MalformedRecordError(f"field {name!r} is {value}, must be finite")
        if ok and kind == "time" and value < 0:
            raise MalformedRecordError(f"field {name!r} is {value}, must be >= 0")
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "lines":
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
    else:  # pragma: no cover - a bug in a record's table
        raise AssertionError(kind)
    if not ok:
        raise MalformedRecordError(f"field {name!r} is {value!r}, not {kind}")


R = TypeVar("R", bound="_Record")


class _Record:
    """Base of the records: ``KINDS`` maps each field to its kind (:func:`_check`);
    ``OPTIONAL`` names the fields that may be absent or null."""

    KINDS: ClassVar[dict[str, str]] = {}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            _check(f.name, value, self.KINDS[f.name], optional=f.name in self.OPTIONAL)
            if f.name in self.CHOICES and value not in self.CHOICES[f.name]:
                raise MalformedRecordError(f"field {f.name!r} is {value!r}, not one of "
                                           f"{', '.join(self.CHOICES[f.name])}")

    def to_json(self) -> dict[str, Any]:
        """The record as the JSON object its file holds."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def parse(cls: type[R], doc: Any) -> R:  # noqa: PYI019  (3.10 has no Self)
        """The record from a decoded JSON object.

        Raises:
            MalformedRecordError: not an object, an unknown or missing field, a bad value.
        """
        if not isinstance(doc, dict):
            raise MalformedRecordError(f"{cls.__name__} must be a JSON object, not "
                                       f"{type(doc).__name__}")
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(doc) - set(names))
        if unknown:
            raise MalformedRecordError(f"{cls.__name__} has unknown fields {unknown}")
        missing = [n for n in names if n not in doc and n not in cls.OPTIONAL]
        if missing:
            raise MalformedRecordError(f"{cls.__name__} lacks fields {missing}")
        return cls(**{n: doc.get(n) for n in names})


@dataclass(frozen=True)
class StopRequest(_Record):
    """``stop_request.json``: the supervisor (on SIGTERM/SIGINT to cfrun) asks the ranks to
    stop at one step and be done by ``deadline_unix_s`` (unix seconds); ``signal`` is the
    signal's name (``"SIGTERM"``)."""

    deadline_unix_s: float
    signal: str

    KINDS: ClassVar[dict[str, str]] = {"deadline_unix_s": "time", "signal": "str"}


@dataclass(frozen=True)
class StopStep(_Record):
    """``stop_step.json``: rank 0's choice of the optimizer step every rank stops at."""

    step: int

    KINDS: ClassVar[dict[str, str]] = {"step": "step"}


DECISIONS = ("have", "take", "none")


@dataclass(frozen=True)
class StopDecision(_Record):
    """``stop_decision.json``: rank 0's decision at stop step ``step``: ``have`` (the step is
    committed already), ``take`` (a final checkpoint fits before the deadline) or ``none``;
    ``need_s`` is the seconds it estimated a final checkpoint needs."""

    step: int
    decision: str
    need_s: float | None = None

    KINDS: ClassVar[dict[str, str]] = {"step": "step", "decision": "str", "need_s": "time"}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"need_s"})
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"decision": DECISIONS}


@dataclass(frozen=True)
class CheckpointGate(_Record):
    """``checkpoint_gate.json``: rank 0 of attempt ``attempt`` saw the checkpoint of step
    ``after_step`` end (committed or failed); every rank counts it as in flight up to step
    ``idle_from_step`` (a few steps ahead, so every rank reads it before that step) and from
    there takes a deferred checkpoint (:class:`cfrun.rank.boundary.Boundary`)."""

    attempt: int
    after_step: int
    idle_from_step: int

    KINDS: ClassVar[dict[str, str]] = {"attempt": "step", "after_step": "step",
                                       "idle_from_step": "step"}


@dataclass(frozen=True)
class Fatal(_Record):
    """``fatal.json``: rank ``rank`` of attempt ``attempt`` found that resuming would be wrong
    (``message`` says why); the supervisor stops the job with exit code 5."""

    message: str
    attempt: int | None = None
    rank: int | None = None

    KINDS: ClassVar[dict[str, str]] = {"message": "str", "attempt": "step", "rank": "rank"}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"attempt", "rank"})


@dataclass(frozen=True)
class RankError(_Record):
    """``errors/attempt-A-rank-R.json``: a rank's uncaught exception, written by its
    excepthook: the exception's class name, its message (at most 2000 characters), the
    optimizer step it happened after, the traceback's last lines, and when (unix seconds; the
    supervisor reports the earliest failure)."""

    type: str
    message: str
    step: int | None = None
    t_unix_s: float | None = None
    traceback: tuple[str, ...] | list[str] = ()

    KINDS: ClassVar[dict[str, str]] = {"type": "str", "message": "str", "step": "step",
                                       "t_unix_s": "time", "traceback": "lines"}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"step", "t_unix_s", "traceback"})

    def __post_init__(self) -> None:
        if self.traceback is None:
            object.__setattr__(self, "traceback", [])
        if isinstance(self.traceback, tuple):
            object.__setattr__(self, "traceback", list(self.traceback))
        super().__post_init__()


@dataclass(frozen=True)
class EndedMark(_Record):
    """``ended/node-N-attempt-A-rank-R.json``: the script's end on a rank, before teardown:
    ``clean`` (returned or ``sys.exit(0)``, no uncaught exception, no preemption), the step
    it reached, and whether it stopped for a preemption."""

    clean: bool
    step: int
    preempted: bool = False

    KINDS: ClassVar[dict[str, str]] = {"clean": "bool", "step": "step", "preempted": "bool"}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"preempted"})

    def __post_init__(self) -> None:
        if self.preempted is None:
            object.__setattr__(self, "preempted", False)
        super().__post_init__()


@dataclass(frozen=True)
class PreemptedMark(_Record):
    """``preempted/node-N-attempt-A-rank-R.json``: the rank stopped for a preemption at
    ``step``; ``final_checkpoint`` is the step of the final checkpoint it saw durable, or
    None (the supervisor's evidence that exit code 0 means "preempted", not "done")."""

    step: int
    final_checkpoint: int | None = None

    KINDS: ClassVar[dict[str, str]] = {"step": "step", "final_checkpoint": "step"}
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"final_checkpoint"})


@dataclass(frozen=True)
class Heartbeat:
    """``heartbeat-rank-R``: the rank's optimizer step count as right-aligned text of
    :data:`WIDTH` characters and a newline, rewritten in place (``pwrite`` at 0) every step;
    not JSON, so that a beat is one syscall and never torn. Its mtime is the beat's time."""

    step: int
    WIDTH: ClassVar[int] = 14

    def to_bytes(self) -> bytes:
        """The file's bytes (always the same length, so a rewrite never leaves a tail)."""
        return f"{self.step:>{self.WIDTH}}\n".encode()

    @classmethod
    def parse_bytes(cls, data: bytes | bytearray) -> Heartbeat:
        """Raises: MalformedRecordError: not a non-negative decimal step."""
        text = data.decode("ascii", errors="replace").strip()
        if not text.isdigit():
            raise MalformedRecordError(f"heartbeat {text[:20]!r} is not a step count")
        return cls(int(text))

    @classmethod
    def read(cls, path: Path) -> Heartbeat | None:
        """The beat in ``path``; None when missing, unreadable, empty (just created) or
        malformed (not trusted)."""
        try:
            return cls.parse_bytes(read_regular(path, max_bytes=64))
        except (OSError, MalformedRecordError):
            return None


# ---------------------------------------------------------------------------- I/O

_warned: set[str] = set()


def write(path: Path, record: _Record, *, make_dir: bool = False) -> None:
    """Write ``record`` to ``path`` with the one fsync writer (atomic, 0600, never through a
    link); ``make_dir`` creates the parent (``errors/``, ``ended/``, ``preempted/``) first.

    Raises:
        OSError: the write failed (callers in a rank swallow it; the supervisor does not).
    """
    if make_dir:
        Path(path).parent.mkdir(mode=0o700, exist_ok=True)
    atomic_write_json(path, record.to_json())


def read(path: Path, cls: type[R], *, problems: list[str] | None = None) -> R | None:
    """The record of type ``cls`` in ``path``, or None.

    None when the file is missing or unreadable (not yet written, a race with its writer) and
    when it is malformed (invalid JSON, not ``cls``): a malformed file is never trusted, and is
    reported once per path on stderr and appended to ``problems`` (a message naming the file
    and the fault) when given.
    """
    try:
        data = read_regular(path, max_bytes=MAX_RECORD_BYTES)
    except OSError:
        return None
    try:
        return cls.parse(json.loads(data))
    except (ValueError, TypeError) as e:  # MalformedRecordError, JSONDecodeError, UnicodeError
        msg = f"cfrun: ignoring malformed {path}: {e}"
        if problems is not None:
            problems.append(msg)
        if str(path) not in _warned:
            _warned.add(str(path))
            print(msg, file=sys.stderr, flush=True)
        return None


def exists(path: Path) -> bool:
    """True when ``path`` exists (also as a link or a non-JSON file: the presence counts)."""
    return Path(path).exists() or Path(path).is_symlink()
