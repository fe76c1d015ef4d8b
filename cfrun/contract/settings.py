"""Every ``CFRUN_*`` environment variable, in one place: its type, default and meaning.

Why environment variables at all: every option of ``cfrun`` and ``cfrun peer`` is also a variable
(as torchrun's are), so that a batch script or a Kubernetes manifest can set them; a few knobs
exist only as variables because no user should need them on a command line (debugging, benchmark
layouts); and the supervisor passes what the ranks must know through the environment, the one
channel that reaches them through torchrun unchanged.

Precedence of ``cfrun [run]``'s settings: command-line flag > environment variable > default.
``cfrun resume JOBDIR`` takes every setting from the job dir's ``config.json`` instead (the
variables below do not change a resumed job; only ``--node-rank``/``CFRUN_NODE_RANK`` picks
the node); it sets the environment variables recorded there (prefixes ``CFRUN_``, ``CUDA_``,
``OMP_``, ``PYTHON``, ``NCCL_``, ``MKL_``) where the current environment lacks them, and runs the
script in the recorded working directory. The launcher passes the resolved values to the ranks
through the ``CFRUN_RANK_*`` variables below; users do not set those.

Each variable is declared once, by :func:`_declare`, into :data:`SETTINGS` (name ->
:class:`Setting`); the module constant of the same name (``JOB_DIR = "CFRUN_JOB_DIR"``) is what
code refers to. Values are read with the typed accessors (:func:`get_str`, :func:`get_int`,
:func:`get_float`, :func:`get_flag`, :func:`get_json`), which parse, validate and fall back to
the declared default; a bad value raises :class:`~cfrun.contract.errors.BadInputError` with one
line naming the variable and the fix. The options of ``cfrun`` and ``cfrun peer`` are parsed by
their own parsers (:mod:`cfrun.contract.config`) through typer's ``envvar``. Test faults are not
settings: they are named points of :mod:`cfrun.contract.faults`, armed through ``CFRUN_FAULTS``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cfrun.contract.errors import BadInputError

TYPES = ("str", "int", "float", "flag", "json", "path", "choice", "address", "url", "duration",
         "percent", "bytes", "steps")
"""Kinds of value. ``int``/``float``/``flag``/``json`` have their own accessor; the others are
text read with :func:`get_str` (``choice``: one of :attr:`Setting.choices`), or parsed by the
option parsers of :mod:`cfrun.contract.config` (``duration``, ``percent``, ``bytes``,
``steps``: ``STEP[@ATTEMPT],...``)."""

SET_BY = ("user", "launcher", "hook")
"""Who sets a variable: the user (``user``), the supervisor for the ranks (``launcher``), or the
hook in a rank for its own children (``hook``)."""


@dataclass(frozen=True)
class Setting:
    """One ``CFRUN_*`` variable: what it holds and who sets it (see the module docstring)."""

    name: str
    """The variable's name, ``CFRUN_...``."""
    type: str
    """One of :data:`TYPES`."""
    default: str | None
    """The text the variable defaults to when it is unset or empty (parsed like a set value);
    ``None``: no default, the accessors return ``None``."""
    meaning: str
    """What the value means, with its unit; the options table of docs/command-line.md shows the
    user's ones."""
    set_by: str = "user"
    """One of :data:`SET_BY`."""
    unset: str = "none"
    """What happens when the variable is unset and :attr:`default` is ``None`` (the manual's
    wording)."""
    choices: tuple[str, ...] = ()
    """The values allowed for a ``choice``."""


SETTINGS: dict[str, Setting] = {}
"""Every declared variable, name -> :class:`Setting`, in declaration order."""


def _declare(name: str, type: str, default: str | None, meaning: str, *, set_by: str = "user",
             unset: str = "none", choices: tuple[str, ...] = ()) -> str:
    if not name.startswith("CFRUN_") or name in SETTINGS or type not in TYPES \
            or set_by not in SET_BY or (type == "choice") != bool(choices):
        raise ValueError(f"bad declaration of {name}")
    SETTINGS[name] = Setting(name, type, default, meaning, set_by, unset, choices)
    return name


# ----------------------------------------------------------------- options of `cfrun [run]`

JOB_DIR = _declare("CFRUN_JOB_DIR", "path", None, "job directory: checkpoints, events, config",
                   unset="./cfrun-jobs/<script name>-<hash>")
JOB_NAME = _declare("CFRUN_JOB_NAME", "str", None,
                    "the job's name at a peer and at level 2 (letters, digits, '.', '_', '-')",
                    unset="job dir name and a hash of its path and the command")
INTERVAL = _declare("CFRUN_INTERVAL", "int", None,
                    "checkpoint every K optimizer steps (turns the overhead policy off)",
                    unset="policy")
OVERHEAD = _declare("CFRUN_OVERHEAD", "percent", "3.5%",
                    "overhead budget: 3.5%, 3.5 (percent) or 0.035 (fraction)")
TOTAL_STEPS = _declare("CFRUN_TOTAL_STEPS", "int", None,
                       "the optimizer step the run ends at, for its ETA (a while loop)",
                       unset="the epoch loop's length, or the step loop's bound, where cfrun "
                             "reads it")
MTBF = _declare("CFRUN_MTBF", "duration", None,
                "mean time between failures (90s, 30m, 6h, 2d) for the Young/Daly limit",
                unset="learned")
NPROC_PER_NODE = _declare("CFRUN_NPROC_PER_NODE", "int", "1", "ranks on this node (torchrun)")
LAUNCHER = _declare("CFRUN_LAUNCHER", "choice", "auto",
                    "auto: local on one node, torchrun on several; local: cfrun starts the "
                    "ranks of one node itself, with the variables torchrun --standalone sets "
                    "(RANK, WORLD_SIZE, MASTER_*), and restarts them from warm spares; "
                    "torchrun: the ranks run under torchrun; python: as local, but one rank "
                    "runs as `python SCRIPT` would, with none of them set",
                    choices=("auto", "torchrun", "python", "local"))
NNODES = _declare("CFRUN_NNODES", "int", "1",
                  "nodes in the job; one cfrun per node, same job dir on a shared file system")
NODE_RANK = _declare("CFRUN_NODE_RANK", "int", "0",
                     "this node's index in a multi-node job (torchrun --node-rank); also names "
                     "this node's config, lock, agent socket and snapshot slots in the shared "
                     "job dir")
RDZV_ENDPOINT = _declare("CFRUN_RDZV_ENDPOINT", "address", None,
                         "HOST:PORT of the torchrun c10d rendezvous; required with --nnodes > 1")
LOCAL_ADDR = _declare("CFRUN_LOCAL_ADDR", "str", None,
                      "this node's address for the rendezvous (torchrun --local-addr): where "
                      "the host name does not resolve to the address the other nodes reach")
RDZV_ID = _declare("CFRUN_RDZV_ID", "str", None, "rendezvous id shared by the nodes",
                   unset="job dir name")
MAX_RESTARTS = _declare("CFRUN_MAX_RESTARTS", "int", "5",
                        "restarts after failures before giving up (exit code 4)")
KEEP = _declare("CFRUN_KEEP", "int", "2", "committed checkpoints kept")
GRACE = _declare("CFRUN_GRACE", "duration", "25",
                 "time the ranks get after SIGTERM for a final checkpoint before SIGKILL "
                 "(seconds, or 30s, 2m)")
HANG_TIMEOUT = _declare("CFRUN_HANG_TIMEOUT", "duration", "1800",
                        "time without an optimizer step before the job restarts (seconds, or "
                        "30m, 1h; 0: off)")
METRICS = _declare("CFRUN_METRICS", "address", None,
                   "HOST:PORT where the supervisor serves Prometheus metrics at /metrics (port 0: "
                   "a free port, logged); the job dir's metrics.prom is written either way")
LOG_FORMAT = _declare("CFRUN_LOG_FORMAT", "choice", "auto",
                      "cfrun's own log records on stderr: auto (rich on a terminal, else text), "
                      "text (one line per record, never wrapped) or json (one JSON object per "
                      "line)", choices=("auto", "text", "json"))
CRASH_LOOP = _declare("CFRUN_CRASH_LOOP", "int", "3",
                      "the same failure at the same step this many times: stop with exit code 5 "
                      "(0: off)")
RETRY_BEFORE_FIRST_STEP = _declare(
    "CFRUN_RETRY_BEFORE_FIRST_STEP", "flag", None,
    "restart a failure before the first optimizer step like any other (a late data mount)",
    unset="off")
INJECT_CRASH = _declare("CFRUN_INJECT_CRASH", "steps", None,
                        "testing aid, STEP[@ATTEMPT],...: rank 0 SIGKILLs itself after step STEP "
                        "in attempt ATTEMPT (default 0)")
RESHARD = _declare("CFRUN_RESHARD", "flag", None,
                   "go on from checkpoints written by another number of ranks or nodes (not "
                   "bit-exact; a resharded event says from and to)", unset="off")
PEER = _declare("CFRUN_PEER", "address", None,
                "HOST:PORT of a `cfrun peer`: checkpoints go to its RAM first (ACUTE level 1)")
PEER_TOKEN_FILE = _declare("CFRUN_PEER_TOKEN_FILE", "path", None,
                           "file holding the peer's shared secret (cfrun --peer-token-file and "
                           "cfrun peer --token-file)")
PEER_STREAMS = _declare("CFRUN_PEER_STREAMS", "int", "4",
                        "parallel connections per rank to the peer (1..64)")
PERSIST_TO = _declare("CFRUN_PERSIST_TO", "url", None,
                      "level 2 (directory or fsspec URL) that a resume also searches")
JOB_KEY_FILE = _declare("CFRUN_JOB_KEY_FILE", "path", None,
                        "a key of the job's own: checkpoints at the peer and level 2 are "
                        "sealed under it, not under the peer token, and only its seals count")

# ----------------------------------------------------------------- options of `cfrun peer`

PEER_LISTEN = _declare("CFRUN_PEER_LISTEN", "address", None,
                       "cfrun peer: HOST:PORT to listen on (port 0: a free port, printed)")
PEER_FLUSH_TO = _declare("CFRUN_PEER_FLUSH_TO", "url", None,
                         "cfrun peer: level 2, a directory or fsspec URL checkpoints are "
                         "flushed to")
PEER_SLOTS = _declare("CFRUN_PEER_SLOTS", "int", "2", "cfrun peer: checkpoints held in RAM")
PEER_MAX_CHECKPOINT_BYTES = _declare(
    "CFRUN_PEER_MAX_CHECKPOINT_BYTES", "bytes", "auto",
    "cfrun peer: largest checkpoint accepted, e.g. 8G (auto: half the RAM / slots, at most 16G)")
PEER_KEEP = _declare("CFRUN_PEER_KEEP", "int", "3",
                     "cfrun peer: flushed checkpoints kept per job at level 2")

# ----------------------------------------------------------------- variables without an option

DEBUG = _declare("CFRUN_DEBUG", "flag", "0",
                 "1: the CLI shows the traceback of an error instead of one line")
PROGRESS_S = _declare("CFRUN_PROGRESS_S", "float", "30",
                      "seconds between the supervisor's progress lines on a terminal (0: none)")
PEER_JOB = _declare("CFRUN_PEER_JOB", "str", None,
                    "older name of CFRUN_JOB_NAME (read when that is not set)",
                    unset="CFRUN_JOB_NAME")
S3_ENDPOINT_URL = _declare("CFRUN_S3_ENDPOINT_URL", "url", None,
                           "endpoint of s3:// level-2 stores (e.g. a MinIO server)",
                           unset="the AWS configuration")
SHARD = _declare("CFRUN_SHARD", "choice", "1",
                 "1: each data-parallel rank persists 1/N of the replicated tensors "
                 "(DeepFreeze); 0: every rank persists its whole state; rank0: rank 0 alone "
                 "persists the replicated tensors", choices=("0", "1", "rank0"))
CONSOLE_LOG = _declare("CFRUN_CONSOLE_LOG", "flag", "1",
                       "1: the ranks' output is also kept in the job dir "
                       "(logs/attempt-N-output.log); 0: it goes to the console alone")
STANDBY = _declare("CFRUN_STANDBY", "flag", "1",
                   "1: a job keeps a warm spare process (Python and torch imported) that becomes "
                   "the next attempt's rank, one per rank (--launcher python), or torchrun "
                   "after a failure; 0: "
                   "restarts start cold")
STANDBY_IMPORTS = _declare("CFRUN_STANDBY_IMPORTS", "flag", "1",
                           "1: the warm spare also imports what the last rank had imported at "
                           "its first step (torch's stack and the standard library: "
                           "torch._dynamo, which the first optimizer imports, ~1 s); 0: only "
                           "torch and cfrun")
EVENTS_ALL_RANKS = _declare("CFRUN_EVENTS_ALL_RANKS", "flag", "0",
                            "1: ranks other than 0 also log each checkpoint (checkpoint_rank "
                            "events)")
FF_EVAL = _declare("CFRUN_FF_EVAL", "choice", "one",
                   "while a resume fast-forwards, other loaders (evaluation) yield one batch "
                   "(one) or run in full (run)", choices=("one", "run"))
SHM_DIR = _declare("CFRUN_SHM_DIR", "path", None,
                   "directory of the snapshot slots",
                   unset="/dev/shm when it has room for twice the snapshot, else <job_dir>/.slots")
SNAPSHOT_MODE = _declare("CFRUN_SNAPSHOT_MODE", "choice", "thread",
                         "thread: background copy; inline: copy on the training thread; gpu/host: "
                         "force or forbid the device-side first copy on CUDA (default: when it "
                         "fits)", choices=("thread", "inline", "gpu", "host"))
FAULTS = _declare("CFRUN_FAULTS", "json", None,
                  "testing aid: armed fault points, a JSON object of point -> value "
                  "(cfrun.contract.faults.POINTS)")

# ---------------------------------------------------------------- set by the launcher for ranks

RANK_SETTINGS = _declare("CFRUN_RANK_SETTINGS", "json", None,
                         "the rank runtime's settings as one JSON object, set by the supervisor",
                         set_by="launcher")
RANK_JOB_DIR = _declare("CFRUN_RANK_JOB_DIR", "path", None, "the job dir", set_by="launcher")
RANK_SUPERVISOR_PID = _declare(
    "CFRUN_RANK_SUPERVISOR_PID", "int", None,
    "pid of the supervisor that started this torchrun; marks every process of the job "
    "(inherited by ranks, workers and their children) so that none outlives the supervisor "
    "(cfrun.supervisor.launcher.kill_job_processes)", set_by="launcher")
VERIFY_OBSERVE = _declare("CFRUN_VERIFY_OBSERVE", "json", None,
                          "cfrun verify --against-plain: the plain run's observer (a step hook "
                          "that records a digest per step and ends the process at the stop "
                          "step), a JSON object set for that run only",
                          set_by="launcher")
AGENT_ADDRESS = _declare("CFRUN_AGENT_ADDRESS", "str", None,
                         "the persist agent's abstract socket name, set by the supervisor for "
                         "the agent only (never on a command line: issue 24, item 5)",
                         set_by="launcher")
HOOK_OWNER_PID = _declare("CFRUN_HOOK_OWNER_PID", "int", None,
                          "pid of the rank process whose hook is live; children that inherit it "
                          "stay inert (hooks/sitecustomize.py)", set_by="hook")


# ----------------------------------------------------------------- typed accessors


def _text(name: str, type_: tuple[str, ...], env: Mapping[str, str] | None) -> str | None:
    """The variable's text, or its default; checks that ``name`` is declared with a ``type_``."""
    setting = SETTINGS.get(name)
    if setting is None:
        raise KeyError(f"{name} is not declared in cfrun.contract.settings")
    if setting.type not in type_:
        raise TypeError(f"{name} is declared as {setting.type}, not {'/'.join(type_)}")
    raw = (os.environ if env is None else env).get(name, "").strip()
    return raw or setting.default


def _bad(name: str, text: str, what: str) -> BadInputError:
    setting = SETTINGS[name]
    default = f"the default, {setting.default}" if setting.default is not None else setting.unset
    return BadInputError(f"{name}={text!r} is not {what}; set {name} to {what} ({setting.meaning})"
                         f" or unset it for {default}")


def get_str(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A text setting (``str``, ``path``, ``choice``, ``address``, ``url``, ...), or its
    default; ``None`` when unset without a default. Any process; ``env`` defaults to
    ``os.environ``.

    Raises:
        BadInputError: a ``choice`` outside :attr:`Setting.choices`.
        KeyError, TypeError: ``name`` is undeclared or not a text setting (a bug).
    """
    text = _text(name, ("str", "path", "choice", "address", "url", "duration", "percent",
                        "bytes", "steps"), env)
    choices = SETTINGS[name].choices
    if text is not None and choices and text not in choices:
        raise _bad(name, text, "one of " + ", ".join(choices))
    return text


def get_int(name: str, env: Mapping[str, str] | None = None, *, minimum: int | None = None
            ) -> int | None:
    """An ``int`` setting (``minimum`` and above when given), or its default, or ``None``.

    Raises:
        BadInputError: not a whole number, or below ``minimum``.
    """
    text = _text(name, ("int",), env)
    if text is None:
        return None
    what = "a whole number" if minimum is None else f"a whole number >= {minimum}"
    try:
        value = int(text)
    except ValueError:
        raise _bad(name, text, what) from None
    if minimum is not None and value < minimum:
        raise _bad(name, text, what)
    return value


def get_float(name: str, env: Mapping[str, str] | None = None, *, minimum: float | None = None
              ) -> float | None:
    """A finite ``float`` setting (``minimum`` and above when given), or its default, or ``None``.

    Raises:
        BadInputError: not a finite number, or below ``minimum``.
    """
    text = _text(name, ("float",), env)
    if text is None:
        return None
    what = "a number" if minimum is None else f"a number >= {minimum:g}"
    try:
        value = float(text)
    except ValueError:
        raise _bad(name, text, what) from None
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        raise _bad(name, text, what)
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def get_flag(name: str, env: Mapping[str, str] | None = None) -> bool:
    """A ``flag`` setting: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``
    (any case; unset: the default).

    Raises:
        BadInputError: any other value.
    """
    text = _text(name, ("flag",), env) or "0"
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise _bad(name, text, "1 or 0")


def get_json(name: str, env: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """A ``json`` setting: a JSON object, or ``None`` when unset.

    Raises:
        BadInputError: not JSON, or not an object.
    """
    text = _text(name, ("json",), env)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _bad(name, text, "a JSON object")
    return value


def node_rank() -> int:
    """This process's node in a multi-node job (``CFRUN_NODE_RANK``; 0 when unset). Any process.

    Raises:
        BadInputError: not a whole number >= 0.
    """
    return get_int(NODE_RANK, minimum=0) or 0


def node_suffix() -> str:
    """``""`` on node 0 (or a single-node job), ``"-node<R>"`` on node R > 0: keeps the names of
    per-node things apart when several nodes share one job dir (or one machine, in tests)."""
    node = node_rank()
    return f"-node{node}" if node > 0 else ""
