"""Resolved run configuration: parsers for user values and the frozen ``RunConfig``.

Every parser raises :class:`cfrun.contract.errors.BadInputError` with a message that names the
value and
the fix, so the CLI can print it as one line.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfrun.contract.errors import BadInputError

_OVERHEAD_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%?)\s*$")


def parse_overhead(text: str) -> float:
    """Parse an overhead budget into a fraction of the baseline iteration time.

    Accepts ``"3.5%"`` and ``"3.5"`` (percent, for values >= 1) and ``"0.035"`` (a fraction, for
    values < 1). The result lies in (0, 1): a budget of 100% or more is no budget.

    Raises:
        BadInputError: not a number, zero, negative, or >= 100%.
    """
    m = _OVERHEAD_RE.match(text)
    if m is None:
        raise BadInputError(
            f"--overhead {text!r} is not a number; give a percentage such as 3.5% (or 0.035)"
        )
    value = float(m.group(1))
    fraction = value / 100.0 if (m.group(2) == "%" or value >= 1.0) else value
    if not 0.0 < fraction < 1.0:
        raise BadInputError(
            f"--overhead {text!r} is out of range; give a budget above 0% and below 100%, e.g. 3.5%"
        )
    return fraction


def parse_interval(text: str) -> int:
    """Parse ``--interval K``: checkpoint every K optimizer steps, K >= 1.

    Raises:
        BadInputError: not a whole number, or < 1.
    """
    try:
        value = int(text.strip())
    except ValueError:
        raise BadInputError(
            f"--interval {text!r} is not a whole number; give the steps between checkpoints, "
            "e.g. --interval 50"
        ) from None
    if value < 1:
        raise BadInputError(
            f"--interval {text!r} must be at least 1 (steps between checkpoints), "
            "e.g. --interval 50"
        )
    return value


def parse_positive_int(name: str, text: str, *, minimum: int = 0) -> int:
    """Parse a whole number ``>= minimum`` for option ``name``.

    Raises:
        BadInputError: not a whole number or below ``minimum``.
    """
    try:
        value = int(str(text).strip())
    except ValueError:
        raise BadInputError(f"{name} {text!r} is not a whole number; give e.g. {name} 3") from None
    if value < minimum:
        raise BadInputError(f"{name} {text!r} must be at least {minimum}")
    return value


def parse_inject_crash(text: str) -> list[tuple[int, int]]:
    """Parse ``--inject-crash``: ``STEP[@ATTEMPT][,STEP@ATTEMPT...]``.

    Returns ``(step, attempt)`` pairs: rank 0 SIGKILLs itself right after optimizer step ``step``
    in attempt ``attempt`` (default 0, the first). For demos and tests.

    Raises:
        BadInputError: malformed.
    """
    pairs: list[tuple[int, int]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step_s, _, attempt_s = part.partition("@")
        try:
            pairs.append((int(step_s), int(attempt_s or 0)))
        except ValueError:
            raise BadInputError(
                f"--inject-crash {text!r} is malformed; give STEP or STEP@ATTEMPT, "
                "e.g. 150 or 150@0"
            ) from None
    return pairs


_BYTES_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)i?[bB]?\s*$")


def parse_bytes(name: str, text: str) -> int:
    """Parse a byte count: ``1073741824``, ``512M``, ``4G``, ``1.5GiB`` (powers of 1024).

    Raises:
        BadInputError: not a positive size.
    """
    m = _BYTES_RE.match(str(text))
    value = 0
    if m is not None:
        value = int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))
    if value < 1:
        raise BadInputError(f"{name} {text!r} is not a size in bytes; give e.g. {name} 4G")
    return value


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, resolved from flags, environment and defaults.

    Stored as ``config.json`` in the job dir so ``cfrun resume JOBDIR`` can run it again.
    """

    script: str
    """Path of the training script, absolute."""
    script_args: list[str]
    """Arguments passed to the script unchanged."""
    job_dir: str
    """Job directory, absolute."""
    cwd: str
    """Working directory the script runs in, absolute."""
    interval: int | None = None
    """Fixed steps between checkpoints; ``None`` lets the overhead policy choose."""
    overhead: float = 0.035
    """Overhead budget as a fraction of baseline iteration time (0.035 = 3.5%)."""
    nproc_per_node: int = 1
    """Ranks started on this node (torchrun ``--nproc-per-node``)."""
    max_restarts: int = 5
    """Restarts after failures before cfrun gives up with exit code 4."""
    keep: int = 2
    """Committed checkpoints kept; older ones are deleted after a newer one commits."""
    grace_s: float = 25.0
    """Seconds between a forwarded SIGTERM and SIGKILL of the ranks."""
    hang_timeout_s: float = 1800.0
    """A rank with no optimizer step for this long is killed and the job restarted (0: off)."""
    crash_loop_limit: int = 3
    """The same failure at the same step this many times in a row stops the job (exit 5)."""
    mtbf_s: float | None = None
    """Mean time between failures (``--mtbf``); None: learned from this job's restarts."""
    profile_only: bool = False
    """``cfrun profile``: stop the script once the interval is decided."""
    inject_crash: str = ""
    """Testing aid: ``STEP[@ATTEMPT],...``: rank 0 SIGKILLs itself after that step."""
    peer: str | None = None
    """``HOST:PORT`` of a ``cfrun peer``: checkpoints go to its RAM first (ACUTE level 1)."""
    peer_token_file: str | None = None
    """File with the peer's shared secret, absolute; required with ``peer``."""
    peer_streams: int = 4
    """Parallel connections per rank shard to the peer (ACUTE's sharding degree), 1..64."""
    persist_to: str | None = None
    """Level-2 store (directory or fsspec URL) that a resume also searches."""
    nnodes: int = 1
    """Nodes in the job (torchrun ``--nnodes``); each runs its own cfrun, supervisor and agent."""
    node_rank: int = 0
    """This node's index, 0..nnodes-1 (torchrun ``--node-rank``)."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of torchrun's c10d rendezvous; required with ``nnodes > 1``."""
    rdzv_id: str | None = None
    """Rendezvous id shared by the nodes (default: the job dir's name)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables recorded for ``cfrun resume`` (CFRUN_*, CUDA_*, OMP_*, PYTHON*)."""

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 1:
            raise BadInputError(f"interval {self.interval} must be at least 1")
        if not 0.0 < self.overhead < 1.0:
            raise BadInputError(f"overhead {self.overhead} must lie in (0, 1)")
        if self.nproc_per_node < 1:
            raise BadInputError(f"--nproc-per-node {self.nproc_per_node} must be at least 1")
        if self.max_restarts < 0:
            raise BadInputError(f"--max-restarts {self.max_restarts} must be at least 0")
        if self.keep < 1:
            raise BadInputError(f"--keep {self.keep} must be at least 1")
        if self.peer and not self.peer_token_file:
            raise BadInputError("--peer needs --peer-token-file F (the peer's shared secret)")
        if not 1 <= self.peer_streams <= 64:
            raise BadInputError(f"--peer-streams {self.peer_streams} must lie in 1..64")
        if self.nnodes < 1:
            raise BadInputError(f"--nnodes {self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise BadInputError(f"--node-rank {self.node_rank} must lie in 0..{self.nnodes - 1} "
                                f"(--nnodes {self.nnodes})")
        if self.nnodes > 1:
            host, _, port = (self.rdzv_endpoint or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise BadInputError(
                    f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (the c10d "
                    f"rendezvous every node reaches), got {self.rdzv_endpoint!r}")
            if self.peer:
                raise BadInputError("--peer is not supported with --nnodes > 1 yet; run one "
                                    "node per job with --peer, or drop --peer")


    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict; inverse of :meth:`from_json`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunConfig:
        """Rebuild from :meth:`to_json` output, ignoring keys this version does not know."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def default_job_dir(script: str, cwd: Path) -> Path:
    """``./cfrun-jobs/<script stem>`` under ``cwd``: one job dir per script by default."""
    return cwd / "cfrun-jobs" / Path(script).stem
