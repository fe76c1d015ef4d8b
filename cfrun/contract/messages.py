"""Every message between a rank and its node's persist agent, as typed, validated records.

Torch-free. The frames that carry them are :mod:`cfrun.contract.ipc` (length-prefixed JSON on the
agent's Unix socket); this module says what a frame may hold. Each record has ``to_json()`` (the
dict :func:`cfrun.contract.ipc.send` sends) and ``parse(obj)``, which refuses, in one line naming
the field and its value, any unknown field, a wrong type (``bool`` is not an int, ``"5"`` is not
a step), a non-finite number (``json.loads`` accepts ``NaN`` and ``1e999``) and a value out of
range. Range checks here are the ones that hold for every job; the agent adds the job's own (its
world size, the same world size for every rank of a step) and the slot's
(:func:`cfrun.contract.slots.open_slot`).

The conversation (one connection per rank, kept across checkpoints):

* rank -> agent :class:`Hello` ``{"op": "hello", "rank"}``, once per start of the rank;
  agent -> rank :class:`Ready` ``{"op": "ready", "last_committed"}`` once every earlier persist
  of the queue is done.
* rank -> agent :class:`PersistRequest` ``{"op": "persist", "step", "rank", "world_size", "slot",
  "nbytes", "doc", "t_trigger_unix_s"}``, one per checkpoint (``cfrun.rank.snapshot``); ``doc`` is
  the shard's JSON document (``format_version``, ``rank``, ``tree``, ``tensors`` layout,
  ``meta``) that the agent writes verbatim as ``rank-NNNNN.json``.
* agent -> rank :class:`Persisted` ``{"op": "persisted", "ok": true, "step", "bytes", "tier",
  "persist_s", "pgt_s", "bandwidth_bytes_per_s"}`` once the step is committed (or protected in
  peer RAM), or :class:`PersistFailed` ``{"op": "persisted", "ok": false, "step", "error"}``.

Inside the agent a persist that goes to the peer tier (``cfrun.agent.peerpath``) keeps its
:class:`PersistRequest`; the peer's own wire protocol is :mod:`cfrun.peer.protocol`. There is no
ping or status op: the supervisor checks that the agent answers with a connect and the peer's
credentials (:func:`cfrun.contract.ipc.connect`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MAX_STEP = 10**12
"""A step number above this is refused (no job takes 10^12 optimizer steps)."""
MAX_WORLD_SIZE = 1 << 20
"""More ranks than this is not a job this agent serves."""
MAX_NBYTES = 1 << 44
"""16 TiB: no rank's slot is larger."""
MAX_SECONDS = 1e7
"""Durations in a reply (persist_s, pgt_s) are below this (115 days)."""
MAX_UNIX_S = 1e11
"""A wall-clock time (``t_trigger_unix_s``) is between 0 and this (year 5138)."""
MAX_ERROR_CHARS = 4096
"""An error text in a reply is at most this long."""
MAX_SLOT_CHARS = 4096
"""A slot path is at most this long (PATH_MAX)."""
DOC_FIELDS = frozenset({"format_version", "rank", "tree", "tensors", "meta"})
"""The keys a shard document may have (``cfrun.rank.snapshot`` builds it)."""
COMMIT_META_KEYS = ("step", "mode", "epoch", "batches", "not_exact")
"""The keys of a shard's ``meta`` that go into the manifest."""
TIERS = ("local", "peer")
"""Where a ``persisted`` reply says the checkpoint went."""


class MessageError(ValueError):
    """A message is not a valid record: the one-line text names the field, its value and why."""


# ---------------------------------------------------------------------- field checks


def _fields(obj: Any, op: str, required: tuple[str, ...], optional: tuple[str, ...] = ()
            ) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise MessageError(f"a {op!r} message must be a JSON object, not {type(obj).__name__}")
    if obj.get("op") != op:
        raise MessageError(f"op {obj.get('op')!r} is not {op!r}")
    unknown = sorted(str(k) for k in obj if k not in required and k not in optional and k != "op")
    if unknown:
        raise MessageError(f"unknown field(s) {', '.join(map(repr, unknown))} in a {op!r} "
                           f"message (known: {', '.join(required + optional)})")
    missing = [k for k in required if k not in obj]
    if missing:
        raise MessageError(f"a {op!r} message lacks {', '.join(map(repr, missing))}")
    return obj


def _int(name: str, v: Any, lo: int, hi: int) -> int:
    if type(v) is not int:
        raise MessageError(f"{name} {v!r} is not an integer")
    if not lo <= v <= hi:
        raise MessageError(f"{name} {v} is outside {lo}..{hi}")
    return v


def _num(name: str, v: Any, lo: float, hi: float) -> float:
    if type(v) not in (int, float):
        raise MessageError(f"{name} {v!r} is not a number")
    if not math.isfinite(v):
        raise MessageError(f"{name} {v!r} is not a finite number")
    if not lo <= v <= hi:
        raise MessageError(f"{name} {v!r} is outside {lo:g}..{hi:g}")
    return float(v) if type(v) is float else v


def _str(name: str, v: Any, max_chars: int) -> str:
    if not isinstance(v, str):
        raise MessageError(f"{name} {v!r} is not a string")
    if len(v) > max_chars or "\0" in v:
        raise MessageError(f"{name} {v[:64]!r}... is longer than {max_chars} characters or "
                           f"holds a NUL")
    return v


def _doc(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise MessageError(f"doc {type(doc).__name__} is not a JSON object")
    unknown = sorted(str(k) for k in doc if k not in DOC_FIELDS)
    if unknown:
        raise MessageError(f"unknown field(s) {', '.join(map(repr, unknown))} in doc (known: "
                           f"{', '.join(sorted(DOC_FIELDS))})")
    if not isinstance(doc.get("meta", {}), dict):
        raise MessageError(f"doc.meta {type(doc['meta']).__name__} is not a JSON object")
    return doc


# ---------------------------------------------------------------------- rank -> agent


@dataclass(frozen=True)
class Hello:
    """A rank (re)started: the agent answers :class:`Ready` once its queue is drained.

    Sent by every rank when it connects (``cfrun.rank.snapshot``), before it looks for
    checkpoints or reuses its slot."""

    rank: int

    OP = "hello"

    def __post_init__(self) -> None:
        _int("rank", self.rank, 0, MAX_WORLD_SIZE - 1)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.OP, "rank": self.rank}

    @classmethod
    def parse(cls, obj: Any) -> Hello:
        """Raises :class:`MessageError` (one line)."""
        return cls(_fields(obj, cls.OP, ("rank",))["rank"])


@dataclass(frozen=True)
class PersistRequest:
    """One rank's checkpoint of ``step``: make the slot's bytes and ``doc`` durable.

    Fields: ``slot`` the absolute path of the rank's shared-memory slot (checked by the agent
    with :func:`cfrun.contract.slots.open_slot`); ``nbytes`` how many of its bytes hold the
    snapshot (> 0, 4 KiB-aligned by the rank); ``doc`` the shard's JSON document (keys in
    :data:`DOC_FIELDS`, ``meta`` an object; the tree may hold ``inf``, a user's value);
    ``t_trigger_unix_s`` when the checkpoint was triggered (wall clock, seconds; the PGT starts
    there), None if the sender did not say.
    """

    step: int
    rank: int
    world_size: int
    slot: str
    nbytes: int
    doc: dict[str, Any]
    t_trigger_unix_s: float | None = None

    OP = "persist"

    def __post_init__(self) -> None:
        _int("step", self.step, 0, MAX_STEP)
        _int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        _int("rank", self.rank, 0, MAX_WORLD_SIZE - 1)
        if self.rank >= self.world_size:
            raise MessageError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if type(self.nbytes) is int and self.nbytes < 1:
            raise MessageError(f"nbytes {self.nbytes} is not a positive byte count")
        _int("nbytes", self.nbytes, 1, MAX_NBYTES)
        _str("slot", self.slot, MAX_SLOT_CHARS)
        _doc(self.doc)
        if self.t_trigger_unix_s is not None:
            _num("t_trigger_unix_s", self.t_trigger_unix_s, 0.0, MAX_UNIX_S)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.OP, "step": self.step, "rank": self.rank,
                               "world_size": self.world_size, "slot": self.slot,
                               "nbytes": self.nbytes, "doc": self.doc}
        if self.t_trigger_unix_s is not None:
            out["t_trigger_unix_s"] = self.t_trigger_unix_s
        return out

    @classmethod
    def parse(cls, obj: Any) -> PersistRequest:
        """Raises :class:`MessageError` (one line): e.g. ``step -1 is outside 0..10^12``,
        ``rank 1 is outside 0..0``."""
        o = _fields(obj, cls.OP, ("step", "rank", "world_size", "slot", "nbytes", "doc"),
                    ("t_trigger_unix_s",))
        return cls(o["step"], o["rank"], o["world_size"], o["slot"], o["nbytes"], o["doc"],
                   o.get("t_trigger_unix_s"))

    def commit_meta(self) -> dict[str, Any]:
        """The manifest's ``meta``: :data:`COMMIT_META_KEYS` of ``doc.meta`` (None if absent),
        and ``final: true`` for the checkpoint taken at the script's end (issue 27, item 2)."""
        meta = self.doc.get("meta", {})
        out = {k: meta.get(k) for k in COMMIT_META_KEYS}
        if meta.get("final") is True:
            out["final"] = True
        return out

    def trigger_or(self, default_unix_s: float) -> float:
        """``t_trigger_unix_s``, or ``default_unix_s`` if the sender did not say."""
        return default_unix_s if self.t_trigger_unix_s is None else self.t_trigger_unix_s


# ---------------------------------------------------------------------- agent -> rank


@dataclass(frozen=True)
class Ready:
    """The answer to :class:`Hello`: every earlier persist is done; ``last_committed`` is the
    newest step this agent committed (-1: none yet)."""

    last_committed: int

    OP = "ready"

    def __post_init__(self) -> None:
        _int("last_committed", self.last_committed, -1, MAX_STEP)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.OP, "last_committed": self.last_committed}

    @classmethod
    def parse(cls, obj: Any) -> Ready:
        """Raises :class:`MessageError` (one line)."""
        return cls(_fields(obj, cls.OP, ("last_committed",))["last_committed"])


@dataclass(frozen=True)
class Persisted:
    """The answer to every rank's :class:`PersistRequest` of ``step`` once the step is
    committed in the job dir (``tier`` ``"local"``) or protected in peer RAM (``"peer"``).

    ``bytes``: the step's bytes on this node; ``persist_s``: from the agent's start on it to the
    commit; ``pgt_s``: from the trigger to the commit (the persist gap time); seconds."""

    step: int
    bytes: int
    tier: str
    persist_s: float
    pgt_s: float
    bandwidth_bytes_per_s: int

    OP = "persisted"

    def __post_init__(self) -> None:
        _int("step", self.step, 0, MAX_STEP)
        _int("bytes", self.bytes, 0, MAX_NBYTES * MAX_WORLD_SIZE)
        if self.tier not in TIERS:
            raise MessageError(f"tier {self.tier!r} is not one of {', '.join(TIERS)}")
        _num("persist_s", self.persist_s, -MAX_SECONDS, MAX_SECONDS)  # wall clock
        _num("pgt_s", self.pgt_s, -MAX_SECONDS, MAX_SECONDS)
        _int("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, 0, 10**30)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.OP, "step": self.step, "ok": True, "bytes": self.bytes,
                "tier": self.tier, "persist_s": self.persist_s, "pgt_s": self.pgt_s,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s}

    @classmethod
    def parse(cls, obj: Any) -> Persisted:
        """Raises :class:`MessageError` (one line)."""
        o = _fields(obj, cls.OP, ("step", "ok", "bytes", "tier", "persist_s", "pgt_s",
                                  "bandwidth_bytes_per_s"))
        if o["ok"] is not True:
            raise MessageError(f"ok {o['ok']!r} is not true in a successful 'persisted' reply")
        return cls(o["step"], o["bytes"], o["tier"], o["persist_s"], o["pgt_s"],
                   o["bandwidth_bytes_per_s"])


@dataclass(frozen=True)
class PersistFailed:
    """The answer to a :class:`PersistRequest` that was refused (``error`` starts with
    ``refused:``), failed, or abandoned; ``step`` is None when the request had no valid one."""

    step: int | None
    error: str

    OP = "persisted"

    def __post_init__(self) -> None:
        if self.step is not None:
            _int("step", self.step, 0, MAX_STEP)
        _str("error", self.error, MAX_ERROR_CHARS)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.OP, "step": self.step, "ok": False, "error": self.error}

    @classmethod
    def parse(cls, obj: Any) -> PersistFailed:
        """Raises :class:`MessageError` (one line)."""
        o = _fields(obj, cls.OP, ("step", "ok", "error"))
        if o["ok"] is not False:
            raise MessageError(f"ok {o['ok']!r} is not false in a failed 'persisted' reply")
        return cls(o["step"], o["error"])

    @staticmethod
    def step_of(raw: Any) -> int | None:
        """The step of a request that may not have parsed: its ``step`` if valid, else None."""
        step = raw.get("step") if isinstance(raw, dict) else None
        return step if type(step) is int and 0 <= step <= MAX_STEP else None


Request = Hello | PersistRequest
Reply = Ready | Persisted | PersistFailed


def parse_request(obj: Any) -> Request:
    """A message the agent received (from a rank, or any process of the job's user).

    Raises:
        MessageError: unknown ``op``, or the record's own error (one line).
    """
    op = obj.get("op") if isinstance(obj, dict) else None
    if op == Hello.OP:
        return Hello.parse(obj)
    if op == PersistRequest.OP:
        return PersistRequest.parse(obj)
    raise MessageError(f"unknown op {op!r} (known: {Hello.OP}, {PersistRequest.OP})")


def parse_reply(obj: Any) -> Reply:
    """A message a rank received from the agent.

    Raises:
        MessageError: unknown ``op``, or the record's own error (one line).
    """
    op = obj.get("op") if isinstance(obj, dict) else None
    if op == Ready.OP:
        return Ready.parse(obj)
    if op == Persisted.OP:
        return Persisted.parse(obj) if obj.get("ok") is True else PersistFailed.parse(obj)
    raise MessageError(f"unknown op {op!r} (known: {Ready.OP}, {Persisted.OP})")
