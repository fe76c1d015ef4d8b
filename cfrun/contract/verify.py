"""The files of a ``cfrun verify`` run in its (temporary) job dir, and their records. Torch-free.

The ranks (:mod:`cfrun.rank.verify`) write, the ``cfrun verify`` command
(:mod:`cfrun.cli.verify`) reads:

* ``verify/digests-rank-R.jsonl``: one :class:`StepDigest` per optimizer step, appended by rank
  R (one ``write`` each, so a SIGKILL loses no earlier line); a resumed attempt appends the
  steps it recomputes again, with its own attempt number;
* ``verify/info.json``: rank 0's :class:`RunInfo`: the stop step it chose or was given, the
  steps where an epoch of the training loader ended, the loader's name and length;
* ``verify/stop_step.json``: rank 0's chosen stop step, read by the other ranks
  (:class:`cfrun.contract.coordination.StopStep`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfrun.contract.fsio import read_regular

DIR = "verify"
LIGHTNING_CALLBACK = "Lightning callback state "
"""How the name of a Lightning callback's state entry starts
(:func:`cfrun.codec.compare.entry_name`)."""
LIGHTNING_FILES = "Lightning ModelCheckpoint files "
"""How the name of the recorded listing of a Lightning ``ModelCheckpoint`` directory starts."""
MAX_DIGEST_FILE_BYTES = 1 << 30
"""The longest digest file read back (about 5 million steps)."""


def verify_dir(job_root: Path) -> Path:
    """``<job_dir>/verify``."""
    return job_root / DIR


def digests_path(job_root: Path, rank: int) -> Path:
    """``<job_dir>/verify/digests-rank-RRRRR.jsonl``."""
    return verify_dir(job_root) / f"digests-rank-{rank:05d}.jsonl"


def info_path(job_root: Path) -> Path:
    """``<job_dir>/verify/info.json``."""
    return verify_dir(job_root) / "info.json"


def stop_step_path(job_root: Path) -> Path:
    """``<job_dir>/verify/stop_step.json``."""
    return verify_dir(job_root) / "stop_step.json"


@dataclass(frozen=True)
class StepDigest:
    """What one rank's state looked like right after optimizer step ``step`` of ``attempt``:
    a digest of the stepping optimizer's parameters (``params``) and of each global RNG
    (``rng``: ``torch``, ``cuda``, ``python``, ``numpy``), hex strings. Equal digests mean
    equal bits (up to a 64-bit hash collision)."""

    step: int
    attempt: int
    params: str
    rng: dict[str, str] = field(default_factory=dict)

    def to_line(self) -> bytes:
        """One JSON line."""
        return (json.dumps({"step": self.step, "attempt": self.attempt, "params": self.params,
                            "rng": self.rng}, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, doc: Any) -> StepDigest | None:
        """The record, or None for anything malformed (a line cut by a SIGKILL)."""
        if not isinstance(doc, dict):
            return None
        step, attempt, params, rng = (doc.get(k) for k in ("step", "attempt", "params", "rng"))
        if type(step) is not int or type(attempt) is not int or not isinstance(params, str) \
                or not isinstance(rng, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in rng.items()):
            return None
        return cls(step=step, attempt=attempt, params=params, rng=dict(rng))


def read_digests(path: Path) -> list[StepDigest]:
    """Every well-formed record of a digest file, in file order ([] when it is missing)."""
    try:
        text = read_regular(path, max_bytes=MAX_DIGEST_FILE_BYTES).decode(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            record = StepDigest.from_json(json.loads(line))
        except ValueError:
            continue
        if record is not None:
            out.append(record)
    return out


@dataclass(frozen=True)
class RunInfo:
    """Rank 0's account of a verify run (``verify/info.json``)."""

    stop_step: int | None = None
    """The step the ranks stop at (None: not chosen yet)."""
    epoch_ends: tuple[int, ...] = ()
    """Steps after which an epoch of the training loader ended (its last optimizer step)."""
    loader: str | None = None
    """The script's name for the training loader (``train_loader``), when one was found."""
    loader_len: int | None = None
    """Batches per epoch of the training loader, when it has a length."""
    interval: int | None = None
    """Steps between checkpoints."""

    def to_json(self) -> dict[str, Any]:
        return {"stop_step": self.stop_step, "epoch_ends": list(self.epoch_ends),
                "loader": self.loader, "loader_len": self.loader_len, "interval": self.interval}

    @classmethod
    def read(cls, path: Path) -> RunInfo | None:
        """The record in ``path``; None when missing or malformed."""
        try:
            doc = json.loads(read_regular(path, max_bytes=1 << 20))
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict):
            return None
        ends = doc.get("epoch_ends", [])
        if not isinstance(ends, list) or not all(type(e) is int for e in ends):
            return None

        def opt_int(key: str) -> int | None:
            v = doc.get(key)
            return v if type(v) is int else None

        loader = doc.get("loader")
        return cls(stop_step=opt_int("stop_step"), epoch_ends=tuple(ends),
                   loader=loader if isinstance(loader, str) else None,
                   loader_len=opt_int("loader_len"), interval=opt_int("interval"))
