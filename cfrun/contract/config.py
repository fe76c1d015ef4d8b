"""Resolved run configuration: parsers for user values and the frozen ``RunConfig``.

Every parser raises :class:`cfrun.contract.errors.BadInputError` with a message that names the
value and
the fix, so the CLI can print it as one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfrun.contract.errors import BadInputError, ChangedCommandError, FatalJobError

_OVERHEAD_RE = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+)\s*(%?)\s*$")


MIN_OVERHEAD_PCT = 0.1
"""The smallest budget accepted, in percent: below it the policy has nothing to measure against
the noise of a step time, and a value such as ``0.035`` is most likely a fraction meant as 3.5%."""


def parse_overhead(text: str) -> float:
    """Parse an overhead budget, always a number of percent, into a fraction of the step time.

    One rule: the number is a percentage, with or without ``%``: ``"3.5%"`` and ``"3.5"`` are
    both 3.5% (0.035); ``"0.5"`` is 0.5%. Accepted from :data:`MIN_OVERHEAD_PCT` up to (not
    including) 100%.

    Raises:
        BadInputError: not a number, below 0.1% (a fraction such as 0.035 is refused with the
            percentage it probably meant; a negative number or 0 as out of range), or >= 100%.
    """
    m = _OVERHEAD_RE.match(text)
    if m is None:
        raise BadInputError(
            f"--overhead {text!r} is not a number; give a percentage such as 3.5%"
        )
    pct = float(m.group(1))  # -1 is a number, out of range (issue 37, item 7)
    if 0.0 < pct < MIN_OVERHEAD_PCT:
        raise BadInputError(
            f"--overhead {text!r} means {pct:g}%, below the {MIN_OVERHEAD_PCT:g}% cfrun can hold; "
            f"the budget is in percent: for {pct * 100:g}% write {pct * 100:g}%"
        )
    if not MIN_OVERHEAD_PCT <= pct < 100.0:
        raise BadInputError(
            f"--overhead {text!r} is out of range; give a budget from {MIN_OVERHEAD_PCT:g}% to "
            "below 100%, e.g. 3.5%"
        )
    return pct / 100.0


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


LAUNCHERS = ("torchrun", "python", "local")
"""The launchers a :class:`RunConfig` names (:attr:`RunConfig.launcher`): ``--launcher``'s
values less ``auto``, which :func:`resolve_launcher` turns into one of them."""

LAUNCHER_CHOICES = ("auto", *LAUNCHERS)
"""The values of ``--launcher`` and ``CFRUN_LAUNCHER``."""


def resolve_launcher(launcher: str, nnodes: int) -> str:
    """The launcher a job runs with: ``launcher`` as given, or for ``auto`` (the default)
    ``local`` on one node (cfrun's supervisor starts the node's ranks itself with the
    environment ``torchrun --standalone`` gives them, so each restart takes warm spares: issue
    35) and ``torchrun`` on several (its c10d rendezvous joins the nodes). Pure.

    Raises:
        BadInputError: ``launcher`` is not one of :data:`LAUNCHER_CHOICES`.
    """
    launcher = launcher.strip() or "auto"
    if launcher not in LAUNCHER_CHOICES:
        raise BadInputError(f"--launcher {launcher!r} must be one of "
                            f"{', '.join(LAUNCHER_CHOICES)}")
    if launcher == "auto":
        return "local" if nnodes == 1 else "torchrun"
    return launcher


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, resolved from flags, environment and defaults.

    Stored as ``config.json`` in the job dir so ``cfrun resume JOBDIR`` can run it again.
    """

    script: str
    """Path of the training script, absolute (with :attr:`module`, the module's file)."""
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
    launcher: str = "torchrun"
    """How the ranks start (``--launcher``, resolved by :func:`resolve_launcher`; a job dir
    written before ``auto`` existed says ``torchrun``): ``torchrun``; ``local`` (one node's
    default): cfrun's supervisor starts the node's ranks itself, each with the variables
    ``torchrun --standalone`` gives it (``RANK``, ``WORLD_SIZE``, ``MASTER_*``, one rank
    included, :mod:`cfrun.supervisor.local_ranks`); or ``python``: as ``local``, but one rank
    runs as ``python SCRIPT`` would, with none of torchrun's variables. With ``local`` and
    ``python`` each rank can be a warm spare.
    A launch option, not part of the job's command (:class:`Command`): changing it between runs
    is no changed command."""
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
    retry_before_first_step: bool = False
    """``--retry-before-first-step``: restart a failure before the first optimizer step like
    any other, instead of stopping at its second time in a row (a data mount that comes up
    late)."""
    mtbf_s: float | None = None
    """Mean time between failures (``--mtbf``); None: learned from this job's restarts."""
    total_steps: int | None = None
    """The optimizer step the run ends at (``--total-steps``): the total and the ETA of
    ``cfrun status`` and the progress line for a loop cfrun cannot size; None: the epoch
    loop's length, or a step loop's bound, where cfrun reads it
    (:mod:`cfrun.contract.progress`). Not part of the job's command."""
    profile_only: bool = False
    """``cfrun profile``: stop the script once the interval is decided."""
    inject_crash: str = ""
    """Testing aid: ``STEP[@ATTEMPT],...``: rank 0 SIGKILLs itself after that step."""
    reshard: bool = False
    """``--reshard``: this run may go on from checkpoints written by another number of ranks
    (issue 25, item 4; :mod:`cfrun.codec.reshard`). A choice of this run only: ``cfrun resume``
    takes it from its own command line, never from ``config.json``."""
    verify: bool = False
    """A run of ``cfrun verify`` (:class:`cfrun.rank.settings.RankSettings`: digests, a stop
    step, kills)."""
    verify_stop_step: int | None = None
    """``cfrun verify``: the step every rank stops at (None: rank 0 chooses)."""
    verify_kills: tuple[tuple[int, int, int, int], ...] = ()
    """``cfrun verify``: ``(step, attempt, rank, moment)`` kills (:mod:`cfrun.rank.verify`)."""
    peer: str | None = None
    """``HOST:PORT`` of a ``cfrun peer``: checkpoints go to its RAM first (ACUTE level 1)."""
    peer_token_file: str | None = None
    """File with the peer's shared secret, absolute; required with ``peer``."""
    peer_streams: int = 4
    """Parallel connections per rank shard to the peer (ACUTE's sharding degree), 1..64."""
    persist_to: str | None = None
    """Level-2 store (directory or fsspec URL) that a resume also searches."""
    job_key_file: str | None = None
    """``--job-key-file``: a key of the job's own (:mod:`cfrun.contract.jobkey`), absolute; its
    seals are then under it, not the peer token's. None: with a peer, the token's key; without,
    the job dir's own ``job.key`` (made with the job)."""
    nnodes: int = 1
    """Nodes in the job (torchrun ``--nnodes``); each runs its own cfrun, supervisor and agent."""
    node_rank: int = 0
    """This node's index, 0..nnodes-1 (torchrun ``--node-rank``)."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of torchrun's c10d rendezvous; required with ``nnodes > 1``."""
    rdzv_id: str | None = None
    """Rendezvous id shared by the nodes (default: the job dir's name)."""
    job_name: str | None = None
    """The job's name at a peer and at level 2 (``--job-name``); None: the job dir's
    ``identity.json`` names it (:func:`default_job_name` for a new job)."""
    local_addr: str | None = None
    """This node's address for the rendezvous and the ranks' store (torchrun ``--local-addr``);
    None: torchrun looks it up from the host name."""
    metrics: str | None = None
    """``HOST:PORT`` where the supervisor serves Prometheus metrics (``--metrics``); None: only
    the ``metrics.prom`` textfile in the job dir (:mod:`cfrun.supervisor.metrics`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables recorded for ``cfrun resume`` (CFRUN_*, CUDA_*, OMP_*, PYTHON*)."""
    module: str | None = None
    """``-m MODULE``: the ranks run ``python -m MODULE`` (torchrun ``--module``); :attr:`script`
    is the module's file (:func:`cfrun.contract.pymodule.find_module_file`), recorded and
    hashed like a script's. None: :attr:`script` runs as ``python SCRIPT``."""

    @property
    def shown(self) -> str:
        """The script as the user named it: ``-m pkg.train``, else the script's file name."""
        return f"-m {self.module}" if self.module else Path(self.script).name

    @property
    def starts_ranks(self) -> bool:
        """cfrun's supervisor starts the node's ranks itself (launcher ``local`` or ``python``,
        :mod:`cfrun.supervisor.local_ranks`), not torchrun."""
        return self.launcher != "torchrun"

    @property
    def one_python_rank(self) -> bool:
        """The job's one rank runs as ``python SCRIPT`` would (launcher ``python``, one rank):
        the attempt's process is the rank, with none of torchrun's variables."""
        return self.launcher == "python" and self.nproc_per_node == 1

    def __post_init__(self) -> None:
        if self.interval is not None and self.interval < 1:
            raise BadInputError(f"interval {self.interval} must be at least 1")
        if not 0.0 < self.overhead < 1.0:
            raise BadInputError(f"overhead {self.overhead} must lie in (0, 1)")
        if self.nproc_per_node < 1:
            raise BadInputError(f"--nproc-per-node {self.nproc_per_node} must be at least 1")
        if self.module is not None and not (
                isinstance(self.module, str) and self.module
                and all(p.isidentifier() for p in self.module.split("."))):
            raise BadInputError(f"module {self.module!r} is not a module name; give e.g. "
                                "-m pkg.train")
        if self.launcher not in LAUNCHERS:
            raise BadInputError(f"--launcher {self.launcher!r} must be one of "
                                f"{', '.join(LAUNCHERS)}")
        if self.launcher != "torchrun" and self.nnodes > 1:
            raise BadInputError(
                f"--launcher {self.launcher} starts the ranks of one node; it cannot run "
                f"--nnodes {self.nnodes}: drop --launcher {self.launcher} (torchrun's "
                f"rendezvous joins the nodes) or run on one node")
        if self.max_restarts < 0:
            raise BadInputError(f"--max-restarts {self.max_restarts} must be at least 0")
        if self.total_steps is not None and self.total_steps < 1:
            raise BadInputError(f"--total-steps {self.total_steps} must be at least 1")
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
        doc = {k: v for k, v in data.items() if k in names}
        if isinstance(doc.get("verify_kills"), list):
            doc["verify_kills"] = tuple(tuple(k) for k in doc["verify_kills"])
        return cls(**doc)


URL_PASSWORD_WITHHELD = "<withheld>"
"""What a URL's password reads as wherever cfrun writes the URL (config.json, events)."""
_URL_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^/@\s:]*):([^/@\s]*)@", re.IGNORECASE)


def redact_url(url: str | None) -> str | None:
    """``url`` with its password replaced by :data:`URL_PASSWORD_WITHHELD`
    (``s3://user:pw@host/p`` -> ``s3://user:<withheld>@host/p``); config.json, events and
    replies never hold a credential (issue 24, item 7)."""
    if url is None:
        return None
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}:{URL_PASSWORD_WITHHELD}@", url)


def default_job_dir(script: str, cwd: Path, script_args: Sequence[str] = (),
                    nproc_per_node: int = 1, nnodes: int = 1, module: str | None = None) -> Path:
    """``./cfrun-jobs/<script stem>-<8 hex digits>`` under ``cwd``: one job dir per command.

    The digits are the first of a SHA-256 of the script's absolute path (links resolved), its
    arguments, the ranks per node and the nodes, so the same command gets the same job dir
    every time (a re-run, a restarted pod resume: the script's bytes may change, the identity
    check says so, :func:`check_identity`), while two scripts with one file name in different
    directories, or runs with other arguments (a learning-rate sweep) or another world size,
    get job dirs of their own and run side by side.

    A script run with no arguments on one rank keeps the name cfrun gave every job dir before
    arguments counted (the hash of the path alone); so does any command whose job dir of that
    name already holds its job (``identity.json`` with these arguments and world size), so a
    job started by an older cfrun resumes there.

    ``module`` (``-m MODULE``, ``script`` its file): ``./cfrun-jobs/<module>-<8 hex digits>``,
    the module's name hashed too."""
    path = (cwd / script).resolve()
    jobs = cwd / "cfrun-jobs"
    if module:
        doc = json.dumps([str(path), list(script_args), nproc_per_node, nnodes, module])
        return jobs / f"{module}-{_hex8(doc)}"
    path_only = jobs / f"{path.stem}-{_hex8(str(path))}"
    args = list(script_args)
    if (not args and nproc_per_node == nnodes == 1) or \
            _holds_command(path_only, args, nproc_per_node * nnodes):
        return path_only
    return jobs / f"{path.stem}-{_hex8(json.dumps([str(path), args, nproc_per_node, nnodes]))}"


def _hex8(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _holds_command(job_dir: Path, script_args: list[str], world_size: int) -> bool:
    """True when ``job_dir``'s ``identity.json`` records these arguments and world size."""
    from cfrun.contract.jobdir import JobDir

    try:
        old = read_identity(JobDir(job_dir).identity_path)
    except (BadInputError, OSError):
        return False
    return old is not None and list(old.command.script_args) == script_args \
        and old.command.world_size == world_size


def resume_command(job_dir: str | Path, node_rank: int = 0, *flags: str) -> str:
    """The ``cfrun resume [FLAGS] [--node-rank R] JOB_DIR`` line cfrun's hints print, quoted
    for a POSIX shell (a job dir with a space in its path pastes as one argument); ``--node-rank``
    only for a node other than 0."""
    import shlex

    argv = ["cfrun", "resume", *flags, *(["--node-rank", str(node_rank)] if node_rank else [])]
    return shlex.join([*argv, str(job_dir)])


# ----------------------------------------------------------------- the job's identity

IDENTITY_FORMAT = 1
"""Version of ``identity.json``'s layout."""
MAX_IDENTITY_BYTES = 1 << 20
"""``identity.json`` is at most this large (1 MiB)."""
_NAME_CHARS_RE = re.compile(r"[^A-Za-z0-9._-]+")
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
"""A job's name at a peer and at level 2 (one path component there; no '..' in it either)."""


def file_sha256(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes (the training script's), read in 1 MiB chunks.

    Raises:
        OSError: unreadable.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Command:
    """What makes two runs the same job: the script (path and bytes), its arguments, the world
    size (ranks per node times nodes). The supervisor compares it with the job dir's
    ``identity.json`` before anything runs (:func:`check_identity`)."""

    script: str
    """Path of the training script, absolute."""
    script_sha256: str
    """Hex SHA-256 of the script's bytes."""
    script_args: tuple[str, ...]
    """Arguments passed to the script."""
    world_size: int
    """Ranks in the job (``nproc_per_node * nnodes``)."""
    module: str | None = None
    """``-m MODULE``: the module's name (:attr:`script` is its file); None: a script file."""

    @classmethod
    def of(cls, cfg: RunConfig) -> Command:
        """The command ``cfg`` runs; reads the script's bytes.

        Raises:
            BadInputError: the script cannot be read.
        """
        try:
            sha = file_sha256(cfg.script)
        except OSError as e:
            raise BadInputError(f"script {cfg.script!r} cannot be read ({e.strerror}); give a "
                                "readable training script") from None
        return cls(cfg.script, sha, tuple(cfg.script_args), cfg.nproc_per_node * cfg.nnodes,
                   cfg.module or None)

    @property
    def fingerprint(self) -> str:
        """Hex SHA-256 of the script's hash, the arguments and the world size (not the script's
        path: a moved script with the same bytes is the same command), and the module's name
        for ``-m MODULE`` (its ``__package__`` and relative imports depend on it)."""
        doc = json.dumps([self.script_sha256, list(self.script_args), self.world_size,
                          *([self.module] if self.module else [])])
        return hashlib.sha256(doc.encode()).hexdigest()


def default_job_name(job_dir: Path | str) -> str:
    """The job's name at a peer and at level 2 when ``--job-name`` is not given:
    ``<job dir's name>-<12 hex digits of the job dir's absolute path>``. The same job dir path
    (a restarted pod, a fresh node with an empty job dir) finds its checkpoints there again;
    another job dir is another job, even where the job dirs' names are alike. The name does not
    depend on the command (the nodes of a job may run different arguments); a checkpoint of
    another command is refused at install by its fingerprint (:meth:`Identity.refusal`)."""
    root = Path(job_dir).absolute()
    digits = hashlib.sha256(str(root).encode()).hexdigest()[:12]
    stem = _NAME_CHARS_RE.sub("-", root.name).replace("..", "-").lstrip("._-")[:80] or "job"
    return f"{stem}-{digits}"


def job_id_of(job_name: str) -> str:
    """The job id (32 hex digits, 128 bits) of the job named ``job_name``; written into every
    checkpoint's manifest (``meta.job_id``). It follows from the name, so a fresh node with an
    empty job dir knows it, and checkpoints of another job are told apart at a peer or at
    level 2 even where a store's directories were mixed up."""
    return hashlib.sha256(f"cfrun job id\0{job_name}".encode()).hexdigest()[:32]


def check_job_name(name: str, option: str = "--job-name") -> str:
    """Return ``name`` if it can name a job at a peer and at level 2.

    Raises:
        BadInputError: other characters than letters, digits, '.', '_', '-', or too long.
    """
    if not JOB_NAME_RE.match(name) or ".." in name:
        raise BadInputError(f"{option} {name!r} may only hold letters, digits, '.', '_' and '-' "
                            "(a letter or digit first, at most 100, no '..'); give e.g. "
                            f"{option} digits-run-3")
    return name


@dataclass(frozen=True)
class Identity:
    """A job dir's ``identity.json``: which job it holds.

    Written once by the first supervisor that runs the job (shared by the nodes of a multi-node
    job), rewritten only when a changed command is accepted (``--accept-changed-command``).
    """

    job_id: str
    """32 hex digits (:func:`job_id_of`), in every checkpoint's manifest ``meta.job_id``."""
    job_name: str
    """The job's name at a peer and at level 2."""
    command: Command
    """The command the job runs now."""
    fingerprints: tuple[str, ...]
    """Every command fingerprint this job accepted, oldest first (the last is ``command``'s)."""
    changes: tuple[dict[str, Any], ...] = ()
    """Accepted changes: ``{t_unix_s, changed: [...], fingerprint}``, oldest first."""
    created_unix_s: float = 0.0
    nnodes: int = 1
    """Nodes in the job: with several, each node's arguments may differ, so only the job id of
    a checkpoint is checked, not the command it was taken under."""
    previous_job_ids: tuple[str, ...] = ()
    """Ids the job had before an accepted ``--job-name`` change: its checkpoints from then are
    still its own."""

    @classmethod
    def new(cls, command: Command, job_name: str, nnodes: int = 1) -> Identity:
        """The identity of a job that starts now."""
        import time

        return cls(job_id_of(job_name), job_name, command, (command.fingerprint,),
                   created_unix_s=round(time.time(), 3), nnodes=nnodes)

    def to_json(self) -> dict[str, Any]:
        """The ``identity.json`` document."""
        return {"format": IDENTITY_FORMAT, "job_id": self.job_id, "job_name": self.job_name,
                "script": self.command.script, "script_sha256": self.command.script_sha256,
                "script_args": list(self.command.script_args),
                **({"module": self.command.module} if self.command.module else {}),
                "world_size": self.command.world_size, "fingerprint": self.command.fingerprint,
                "fingerprints": list(self.fingerprints), "changes": list(self.changes),
                "created_unix_s": self.created_unix_s, "nnodes": self.nnodes,
                "previous_job_ids": list(self.previous_job_ids)}

    @classmethod
    def from_json(cls, d: Any, where: str) -> Identity:
        """Parse an ``identity.json`` document.

        Raises:
            BadInputError: not an identity this cfrun wrote (names ``where`` and the fix).
        """
        try:
            if not isinstance(d, dict) or d.get("format") != IDENTITY_FORMAT:
                raise TypeError("not an identity document")
            args = d["script_args"]
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise TypeError("script_args is not a list of strings")
            module = d.get("module")
            if module is not None and not isinstance(module, str):
                raise TypeError("module is not a string")
            command = Command(str(d["script"]), str(d["script_sha256"]), tuple(args),
                              int(d["world_size"]), module or None)
            prints = d["fingerprints"]
            if not isinstance(prints, list) or not all(isinstance(p, str) for p in prints):
                raise TypeError("fingerprints is not a list of strings")
            changes = d.get("changes", [])
            if not isinstance(changes, list):
                raise TypeError("changes is not a list")
            old_ids = d.get("previous_job_ids", [])
            if not isinstance(old_ids, list) or not all(isinstance(i, str) for i in old_ids):
                raise TypeError("previous_job_ids is not a list of strings")
            return cls(str(d["job_id"]), str(d["job_name"]), command, tuple(prints),
                       tuple(changes), float(d.get("created_unix_s", 0.0)),
                       int(d.get("nnodes", 1)), tuple(old_ids))
        except (KeyError, TypeError, ValueError) as e:
            raise BadInputError(f"{where} is unreadable ({e}); restore it, or start the job "
                                "again in a new --job-dir") from None

    def meta(self) -> dict[str, str]:
        """What every checkpoint's manifest ``meta`` carries of the job: ``job_id`` and
        ``command`` (the fingerprint it was taken under)."""
        return {"job_id": self.job_id, "command": self.command.fingerprint}

    def owns(self, job_id: Any) -> bool:
        """True when ``job_id`` (from a manifest's ``meta``) is this job's, now or before an
        accepted rename."""
        return job_id == self.job_id or job_id in self.previous_job_ids

    def refusal(self, meta: Any) -> str | None:
        """Why a checkpoint with manifest ``meta`` is not this job's (None: it is).

        Another job id, none (an older cfrun or a foreign writer), or a command this job never
        ran (another script, other arguments under the same ``--job-name``)."""
        meta = meta if isinstance(meta, dict) else {}
        job_id = meta.get("job_id")
        if not self.owns(job_id):
            return (f"checkpoint of another job (job id {job_id or 'none'}, this job "
                    f"{self.job_id})")
        command = meta.get("command")
        if self.nnodes == 1 and command not in self.fingerprints:
            return (f"checkpoint of another command (fingerprint {str(command)[:12]}, this "
                    f"job ran {', '.join(p[:12] for p in self.fingerprints)})")
        return None


def read_identity(path: Path) -> Identity | None:
    """The job dir's identity at ``path`` (``identity.json``), None if there is none.

    Raises:
        BadInputError: it exists but is not a regular file or not an identity.
    """
    from cfrun.contract.fsio import read_regular

    try:
        raw = read_regular(path, max_bytes=MAX_IDENTITY_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise BadInputError(f"{path} is unreadable ({e}); restore it, or start the job "
                            "again in a new --job-dir") from None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise BadInputError(f"{path} is unreadable ({e}); restore it, or start the job again "
                            "in a new --job-dir") from None
    return Identity.from_json(doc, str(path))


def describe_changes(old: Identity, new: Command, job_name: str | None) -> list[str]:
    """What differs between the job's recorded command and ``new``, one phrase each:
    ``script edited (sha256 ...)``, ``script /a/t.py -> /b/u.py``, ``argument --lr: 0.1 -> 0.2``,
    ``world size 2 -> 4``, ``job name a -> b`` (``job_name``: given by ``--job-name``)."""
    out: list[str] = []
    was = old.command
    if was.module != new.module:
        out.append(f"{'-m ' + was.module if was.module else 'script'} -> "
                   f"{'-m ' + new.module if new.module else 'script'}")
    if Path(was.script) != Path(new.script):
        same = was.script_sha256 == new.script_sha256
        out.append(f"script {was.script} -> {new.script}"
                   f"{' (moved, the same bytes)' if same else ''}")
    elif was.script_sha256 != new.script_sha256:
        out.append(f"script edited (sha256 {was.script_sha256[:12]} -> "
                   f"{new.script_sha256[:12]})")
    if was.script_args != new.script_args:
        out.append(_describe_args(list(was.script_args), list(new.script_args)))
    if was.world_size != new.world_size:
        out.append(f"world size {was.world_size} -> {new.world_size}")
    if job_name is not None and job_name != old.job_name:
        out.append(f"job name {old.job_name} -> {job_name}")
    return out


def _describe_args(old: list[str], new: list[str]) -> str:
    """``argument --lr: 0.1 -> 0.2`` (the differing run, named by the option before it when
    there is one), else ``arguments A -> B``."""
    import shlex

    head = 0
    while head < min(len(old), len(new)) and old[head] == new[head]:
        head += 1
    tail = 0
    while tail < min(len(old), len(new)) - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    a, b = old[head:len(old) - tail], new[head:len(new) - tail]
    a_s, b_s = shlex.join(a) or "(none)", shlex.join(b) or "(none)"
    if head and old[head - 1].startswith("-") and not any(x.startswith("-") for x in a + b):
        return f"argument {old[head - 1]}: {a_s} -> {b_s}"
    if head and old[head - 1].startswith("-") and not (a[:1] + b[:1])[0].startswith("-"):
        # the run starts with the values of the option before it: name it on both sides
        # (``--epochs 2 -> --epochs 3 --lr 0.2``, not ``2 -> 3 --lr 0.2``; issue 37, item 7)
        a, b = old[head - 1:len(old) - tail], new[head - 1:len(new) - tail]
        a_s, b_s = shlex.join(a), shlex.join(b)
    return f"arguments {a_s} -> {b_s}"


NO_CHECKPOINT = "no checkpoint to resume"
"""Why a changed command was taken without ``--accept-changed-command`` (the ``why`` of its
``command_changed`` event and of its record in ``identity.json``)."""
ACCEPTED = "--accept-changed-command"
"""Why a changed command was taken when the flag was given."""


RESHARD = "--reshard"
"""Why a changed world size was taken (``--reshard``, issue 25 item 4)."""
FINISHED = "finished job, started over"
"""Why a changed command was taken in the job dir of a finished job: a new run from step 0, its
checkpoints set aside (:meth:`cfrun.contract.jobdir.JobDir.set_aside_checkpoints`)."""


class WorldSizeRefusedError(FatalJobError):
    """The job dir's checkpoints were written by another number of ranks and the run did not
    ask to reshard (exit 5, nothing touched): the one line names ``--reshard``."""


def reshard_refusal(job_dir: Path | str, saved: int, now: int) -> str:
    """The one line that refuses a resume on another world size without ``--reshard``
    (the supervisor's, and the rank's where the newest checkpoint has another world size)."""
    return (f"job dir {str(job_dir)!r} holds checkpoints written by {saved} ranks and this run "
            f"has {now}: add --reshard to go on from them on {now} ranks (not bit-exact: the "
            f"state is resharded and the data position mapped by global samples), or run on "
            f"{saved} ranks")


def check_identity(path: Path, command: Command, *, job_name: str | None,
                   accept_changed: bool, nnodes: int = 1,
                   resumable: bool = True, reshard: bool = False,
                   why: str | None = None) -> tuple[Identity, list[str], bool]:
    """Decide whether ``command`` may run in the job dir whose identity is at ``path``.

    Called by the supervisor before it creates, locks or writes anything in the job dir. Reads
    only. Returns ``(identity, changes, write)``: the identity the job runs under, the changes
    taken (empty: none; the newest record of ``identity.changes`` says why), and whether
    ``identity.json`` must be written (new or changed).

    A new job dir gets a new identity (named ``job_name`` or :func:`default_job_name`); the
    same command keeps the recorded identity. A changed one (script edited or moved, other
    arguments, another world size, another ``--job-name``) is taken as the job's command when
    the job dir holds no committed checkpoint (``resumable`` False: nothing to resume, nothing
    to protect: a ``-h`` run, an argparse typo, an import error fixed) with the old command's
    fingerprints dropped, so a checkpoint of the old command at a peer or at level 2 is never
    installed under the new one; with a checkpoint it is refused unless ``accept_changed``,
    which keeps the job's id and name and adds the new fingerprint. ``why`` (with ``resumable``
    False): the reason recorded for a changed command taken (default :data:`NO_CHECKPOINT`;
    :data:`FINISHED` for a finished job's checkpoints set aside).

    Another world size alone is taken with ``reshard`` (``--reshard``: the ranks reshard the
    checkpoint, :mod:`cfrun.codec.reshard`), recorded with that reason; without it a job dir
    with a checkpoint refuses it with exit 5, naming the flag (issue 25, item 4).

    Raises:
        WorldSizeRefusedError: the world size changed, the job dir holds a checkpoint and
            ``reshard`` is False (exit 5).
        ChangedCommandError: the command changed otherwise, the job dir holds a checkpoint and
            ``accept_changed`` is False (one line naming what changed and the two ways on).
        BadInputError: ``identity.json`` is unreadable.
    """
    old = read_identity(path)
    if old is None:
        name = job_name or default_job_name(path.parent)
        return Identity.new(command, name, nnodes), [], True
    changes = describe_changes(old, command, job_name)
    if not changes:
        return old, [], False
    world_changed = old.command.world_size != command.world_size
    if resumable and world_changed and not reshard:
        raise WorldSizeRefusedError(reshard_refusal(path.parent, old.command.world_size,
                                                    command.world_size))
    only_world = world_changed and len(changes) == 1
    if resumable and not accept_changed and not only_world:
        raise ChangedCommandError(
            f"job dir {str(path.parent)!r} holds a job run with another command: "
            f"{'; '.join(changes)}. To start a new job give a new --job-dir; to go on from "
            "its checkpoints with the change add --accept-changed-command")
    import time

    why = (RESHARD if only_world and not accept_changed else ACCEPTED) if resumable \
        else why or NO_CHECKPOINT
    prints = () if not resumable else old.fingerprints
    prints += () if command.fingerprint in prints else (command.fingerprint,)
    record = {"t_unix_s": round(time.time(), 3), "changed": changes,
              "fingerprint": command.fingerprint, "why": why}
    name = job_name or old.job_name
    job_id = old.job_id if name == old.job_name else job_id_of(name)
    old_ids = old.previous_job_ids + (() if job_id == old.job_id else (old.job_id,))
    return Identity(job_id, name, command, prints, (*old.changes, record), old.created_unix_s,
                    nnodes, old_ids), changes, True


def job_identity(job_dir: Path | str) -> Identity | None:
    """The identity in ``job_dir``'s ``identity.json`` for the persist agent (which stamps
    :meth:`Identity.meta` into every manifest and installs only this job's checkpoints); None
    when there is none (``cfrun profile``) or it is unreadable (said by the supervisor)."""
    from cfrun.contract.jobdir import JobDir

    try:
        return read_identity(JobDir(job_dir).identity_path)
    except BadInputError:
        return None
