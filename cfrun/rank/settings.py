"""What the supervisor tells each rank: one JSON object in ``CFRUN_RANK_SETTINGS``.

The supervisor (:func:`cfrun.supervisor.launcher.build_worker_env`) builds a
:class:`RankSettings` and puts :meth:`RankSettings.to_json` into the environment of torchrun and
its ranks; each rank reads it back with :meth:`RankSettings.from_env` (unknown fields refused,
types and ranges checked), adding torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``. The
variable's presence is also what arms the hook (``hooks/sitecustomize.py``). Torch-free: the
supervisor imports this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfrun.contract.errors import BadInputError
from cfrun.contract.settings import RANK_SETTINGS

ENV = RANK_SETTINGS
"""The variable that holds the JSON (``CFRUN_RANK_SETTINGS``)."""

_FROM_TORCHRUN = ("rank", "world_size", "local_rank")
"""Fields that torchrun sets per rank (``RANK``, ...), never part of the JSON."""


@dataclass(frozen=True)
class RankSettings:
    """The settings of one rank for one attempt. Built by the supervisor, read by the rank.

    Raises:
        BadInputError: a field has the wrong type or lies out of range (the message names it).
    """

    job_dir: Path
    """The job directory (absolute)."""
    script: str
    """The training script; :meth:`from_json` turns it into its realpath (frames are matched
    against it)."""
    attempt: int = 0
    """cfrun's attempt number (0 = first start), across restarts."""
    interval: int | None = None
    """Fixed steps between checkpoints, or None: the overhead policy chooses."""
    overhead: float = 0.035
    """Overhead budget as a fraction of the iteration time (cfrun.policy)."""
    mtbf_s: float | None = None
    """Mean time between failures in seconds (``--mtbf`` or learned), or None."""
    profile_only: bool = False
    """``cfrun profile``: stop the script once the interval is decided."""
    inject_crash: tuple[tuple[int, int], ...] = ()
    """``(step, attempt)`` pairs: rank 0 SIGKILLs itself right after that step
    (``--inject-crash``)."""
    ff_eval: str = "one"
    """``one``: other loaders yield one batch while fast-forwarding; ``run``: all of them."""
    supervisor_pid: int = 0
    """Pid of the supervisor that started this attempt."""
    node_rank: int = 0
    """This node's index in a multi-node job."""
    launcher: str = "torchrun"
    """``torchrun``; ``local``: cfrun's supervisor started this rank itself, with torchrun's
    variables as ``torchrun --standalone`` sets them (:mod:`cfrun.supervisor.local_ranks`);
    or ``python``: as ``local``, but with :attr:`nproc_per_node` 1 the job's one rank,
    started as ``python SCRIPT`` without torchrun's variables (rank 0 of world 1, whatever
    ``RANK`` says) (``--launcher``, resolved)."""
    nproc_per_node: int = 1
    """Ranks on this node (``--nproc-per-node``); with launcher ``local`` or ``python`` also the
    world size (one node)."""
    verify: bool = False
    """A run of ``cfrun verify`` (:mod:`cfrun.rank.verify`): record a digest per step, stop at
    :attr:`verify_stop_step` with a final checkpoint, make the :attr:`verify_kills`."""
    verify_stop_step: int | None = None
    """``cfrun verify``: every rank stops at this optimizer step with a final, committed
    checkpoint, and the script ends there (exit 0; its tail does not run). None with
    :attr:`verify`: rank 0 chooses it (:func:`cfrun.rank.verify.auto_stop_step`)."""
    verify_kills: tuple[tuple[int, int, int, int], ...] = ()
    """``cfrun verify``: ``(step, attempt, rank, moment)``: in that attempt that rank SIGKILLs
    itself at that step, right after its optimizer step (moment 0,
    :data:`cfrun.rank.verify.AFTER_STEP`) or while the checkpoint it takes at the step's
    boundary persists (moment 1, :data:`cfrun.rank.verify.DURING_PERSIST`)."""
    reshard: bool = False
    """``--reshard``: a checkpoint written by another number of ranks is resharded onto this
    world (:mod:`cfrun.codec.reshard`); without it such a checkpoint stops the job (exit 5)."""
    manifest_keys: tuple[str, ...] = ()
    """The job's manifest keys in hex (:class:`cfrun.contract.manifest.ManifestKeys`, the
    signing one first): rank 0 writes a MAC into the manifests it commits and every rank
    authenticates a manifest before it opens a file it names. Empty: no authentication."""
    job_dir_id: tuple[int, int] | None = None
    """The job dir's ``(st_dev, st_ino)`` as the supervisor locked it
    (:meth:`cfrun.contract.jobdir.JobDir.dir_id`): the rank checks it before it reads
    anything of the job dir (issue 32, finding 2). None: not checked."""
    rank: int = 0
    """torchrun's ``RANK`` (not in the JSON)."""
    world_size: int = 1
    """torchrun's ``WORLD_SIZE`` (not in the JSON)."""
    local_rank: int = 0
    """torchrun's ``LOCAL_RANK`` (not in the JSON)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        if self.interval is not None and self.interval < 1:
            raise BadInputError(f"{ENV}: interval {self.interval} must be at least 1")
        if not 0.0 < self.overhead < 1.0:
            raise BadInputError(f"{ENV}: overhead {self.overhead} must lie in (0, 1)")
        if self.mtbf_s is not None and not self.mtbf_s > 0:
            raise BadInputError(f"{ENV}: mtbf_s {self.mtbf_s} must be positive")
        if self.ff_eval not in ("one", "run"):
            raise BadInputError(f"{ENV}: ff_eval {self.ff_eval!r} must be 'one' or 'run' "
                                "(CFRUN_FF_EVAL)")
        if self.launcher not in ("torchrun", "python", "local"):
            raise BadInputError(f"{ENV}: launcher {self.launcher!r} must be 'torchrun', "
                                "'python' or 'local' (CFRUN_LAUNCHER)")
        if self.nproc_per_node < 1:
            raise BadInputError(f"{ENV}: nproc_per_node {self.nproc_per_node} must be at least 1")
        if self.launcher != "torchrun" and self.world_size != self.nproc_per_node:
            raise BadInputError(f"{ENV}: launcher {self.launcher!r} runs the {self.nproc_per_node} "
                                f"rank(s) of one node, not WORLD_SIZE {self.world_size}")
        if self.verify_stop_step is not None and self.verify_stop_step < 1:
            raise BadInputError(f"{ENV}: verify_stop_step {self.verify_stop_step} must be at "
                                "least 1")
        for kill in self.verify_kills:
            if len(kill) != 4 or min(kill) < 0 or kill[0] < 1 or kill[3] not in (0, 1):
                raise BadInputError(f"{ENV}: verify_kills entry {list(kill)} must be [step >= 1, "
                                    "attempt, rank, moment 0 or 1]")
        for name in ("attempt", "supervisor_pid", "node_rank", "rank", "local_rank"):
            if getattr(self, name) < 0:
                raise BadInputError(f"{ENV}: {name} {getattr(self, name)} must not be negative")
        if not 0 <= self.rank < self.world_size:
            raise BadInputError(f"RANK {self.rank} must lie in 0..WORLD_SIZE-1 "
                                f"({self.world_size})")

    def to_json(self) -> str:
        """The JSON object for ``CFRUN_RANK_SETTINGS`` (the torchrun fields left out)."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in _FROM_TORCHRUN}
        doc["job_dir"] = str(self.job_dir)
        doc["inject_crash"] = [list(pair) for pair in self.inject_crash]
        doc["verify_kills"] = [list(kill) for kill in self.verify_kills]
        doc["manifest_keys"] = list(self.manifest_keys)
        doc["job_dir_id"] = list(self.job_dir_id) if self.job_dir_id is not None else None
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, rank: int = 0, world_size: int = 1,
                  local_rank: int = 0) -> RankSettings:
        """Parse :meth:`to_json`'s output for rank ``rank`` of ``world_size``.

        Raises:
            BadInputError: not a JSON object, an unknown or missing field, a bad value.
        """
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise BadInputError(f"{ENV} is not JSON ({e}); it is set by cfrun's supervisor, "
                                "do not set it by hand") from None
        if not isinstance(doc, dict):
            raise BadInputError(f"{ENV} must be a JSON object, got {type(doc).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - set(_FROM_TORCHRUN)
        unknown = sorted(set(doc) - known)
        if unknown:
            raise BadInputError(f"{ENV} has unknown fields {unknown}: the supervisor and the "
                                "ranks run different cfrun versions")
        missing = sorted({"job_dir", "script"} - set(doc))
        if missing:
            raise BadInputError(f"{ENV} lacks the fields {missing}")
        if not isinstance(doc["job_dir"], str) or not isinstance(doc["script"], str):
            raise BadInputError(f"{ENV}: job_dir and script must be strings")
        pairs = doc.get("inject_crash", [])
        if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 for p in pairs):
            raise BadInputError(f"{ENV}: inject_crash {pairs!r} must be a list of "
                                "[step, attempt] pairs")
        kills = doc.get("verify_kills", [])
        if not isinstance(kills, list) or not all(
                isinstance(k, list) and len(k) == 4 for k in kills):
            raise BadInputError(f"{ENV}: verify_kills {kills!r} must be a list of "
                                "[step, attempt, rank, moment] lists")
        doc["verify_kills"] = tuple(tuple(k) for k in kills)
        keys = doc.get("manifest_keys", [])
        if not isinstance(keys, list) or not all(
                isinstance(k, str) and len(k) == 64 and _is_hex(k) for k in keys):
            raise BadInputError(f"{ENV}: manifest_keys must be a list of 64-hex-digit keys")
        doc["manifest_keys"] = tuple(keys)
        dir_id = doc.get("job_dir_id")
        if dir_id is not None:
            if not (isinstance(dir_id, list) and len(dir_id) == 2):
                raise BadInputError(f"{ENV}: job_dir_id {dir_id!r} must be [st_dev, st_ino]")
            doc["job_dir_id"] = tuple(dir_id)
        doc["job_dir"] = Path(doc["job_dir"])
        doc["script"] = os.path.realpath(doc["script"])
        doc["inject_crash"] = tuple(tuple(p) for p in pairs)
        return cls(**doc, rank=rank, world_size=world_size, local_rank=local_rank)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankSettings:
        """This rank's settings: ``CFRUN_RANK_SETTINGS`` plus torchrun's ``RANK``,
        ``WORLD_SIZE`` and ``LOCAL_RANK`` (rank process, at install); with ``--launcher
        python`` and one rank (no torchrun) rank 0 of world 1 (with several, the supervisor
        set torchrun's variables itself).

        Raises:
            BadInputError: the variable is missing or invalid (the rank then runs unprotected).
        """
        env = os.environ if env is None else env
        if ENV not in env:
            raise BadInputError(f"{ENV} is not set (cfrun's supervisor sets it for the ranks)")
        if _is_one_python_rank(env[ENV]):  # no torchrun: rank 0 of 1, whatever RANK says
            return cls.from_json(env[ENV])
        try:
            ids = {name: int(env.get(var, default)) for name, var, default in (
                ("rank", "RANK", "0"), ("world_size", "WORLD_SIZE", "1"),
                ("local_rank", "LOCAL_RANK", "0"))}
        except ValueError as e:
            raise BadInputError(f"torchrun's RANK/WORLD_SIZE/LOCAL_RANK are not integers ({e})"
                                ) from None
        return cls.from_json(env[ENV], **ids)


def _is_one_python_rank(text: str) -> bool:
    """The settings ``text`` are those of a ``--launcher python`` job's one rank (its
    environment has none of torchrun's variables that count); False for anything else,
    unparsable text included (:meth:`RankSettings.from_json` then says what is wrong)."""
    if '"launcher": "python"' not in text:
        return False
    try:
        doc = json.loads(text)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("nproc_per_node", 1) == 1


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def _check_type(name: str, value: Any, annotation: Any) -> None:
    """Refuse a field whose JSON type does not match its annotation (bool is not an int)."""
    ann = str(annotation)
    optional = "None" in ann
    if value is None:
        if optional:
            return
        raise BadInputError(f"{ENV}: {name} must not be null")
    if ann.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif ann.startswith("float"):
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
    elif ann == "bool":
        ok = isinstance(value, bool)
    elif ann == "str":
        ok = isinstance(value, str)
    elif ann == "Path":
        ok = isinstance(value, Path)
    elif ann.startswith("tuple[str"):  # manifest_keys
        ok = isinstance(value, tuple) and all(isinstance(x, str) for x in value)
    elif ann.startswith("tuple[int, int]"):  # job_dir_id
        ok = isinstance(value, tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    else:  # inject_crash, verify_kills
        ok = isinstance(value, tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) for pair in value for x in pair)
    if not ok:
        raise BadInputError(f"{ENV}: {name} {value!r} has the wrong type (expected {ann})")
