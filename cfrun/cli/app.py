"""The ``cfrun`` command line (typer).

``cfrun [OPTIONS] SCRIPT [ARGS]...`` runs a training script under cfrun; it is short for
``cfrun run``. Everything after SCRIPT goes to the script untouched, even words that look like
cfrun options. Every option can also be set by the environment variable shown in ``--help``;
a flag wins over the environment.

Errors in what the user gave are one line, ``cfrun: error: ...``, plus a hint, and a distinct
exit code (README, "Exit codes"); nothing is created or changed before the input is valid.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from cfrun import __version__
from cfrun.cli.helpfmt import HELP_OPTIONS, CfrunCommand, root_help
from cfrun.cli.options import (
    CrashLoopOption,
    GraceOption,
    HangTimeoutOption,
    IntervalOption,
    KeepOption,
    LauncherOption,
    LocalAddrOption,
    LogFormatOption,
    MasterAddrOption,
    MasterPortOption,
    MaxRestartsOption,
    ModuleOption,
    NprocPerNodeOption,
    RdzvBackendOption,
    RdzvConfOption,
    RetryBeforeFirstStepOption,
    ScriptArgsArgument,
    ScriptArgument,
    StandaloneOption,
    TotalStepsOption,
)
from cfrun.contract import coordination, early_signals, faults
from cfrun.contract import settings as E
from cfrun.contract.config import (
    URL_PASSWORD_WITHHELD,
    RunConfig,
    check_job_name,
    default_job_dir,
    parse_bytes,
    parse_inject_crash,
    parse_interval,
    parse_overhead,
    parse_positive_int,
    redact_url,
    resume_command,
)
from cfrun.contract.errors import (
    EXIT_BAD_INPUT,
    EXIT_PREEMPTED,
    BadInputError,
    CfrunError,
    ChangedCommandError,
    JobFailedError,
)
from cfrun.policy import parse_duration

# typer < 0.22 raises click's exceptions; newer typer vendors click (typer._click) and raises its
# own, even when a standalone click is installed too (moto[server] and flask pull it in):
# catch both.
_EXIT_L: list[type[BaseException]] = [typer.Exit]
_USAGE_L: list[type[BaseException]] = [typer.TyperException] if hasattr(typer, "TyperException") \
    else []
_ABORT_L: list[type[BaseException]] = [typer.Abort]
try:
    from typer._click import exceptions as _vendored

    _USAGE_L.append(_vendored.UsageError)
except ImportError:
    pass
try:
    import click

    _EXIT_L.append(click.exceptions.Exit)
    _USAGE_L.append(click.UsageError)
    _ABORT_L.append(click.Abort)
except ImportError:
    pass
_EXIT: tuple[type[BaseException], ...] = tuple(_EXIT_L)
_USAGE: tuple[type[BaseException], ...] = tuple(_USAGE_L)
_ABORT: tuple[type[BaseException], ...] = tuple(_ABORT_L)


app = typer.Typer(
    name="cfrun",
    help="Make an unmodified PyTorch training script fault-tolerant.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": HELP_OPTIONS},
)

SUBCOMMANDS = {"run", "resume", "profile", "verify", "status", "ls", "export", "peer"}
JOB_COMMANDS = {"run", "resume", "profile", "verify"}
"""The commands whose supervisor takes over a SIGTERM/SIGINT held since the first line."""
_RECORDED_ENV_PREFIXES = ("CFRUN_", "CUDA_", "OMP_", "NCCL_", "MKL_")
_CODE_ENV_PREFIXES = ("PYTHON", "LD_", "DYLD_")
"""Interpreter and loader variables: never recorded, never taken back by ``cfrun resume``."""
_CODE_ENV_WORDS = ("PYTHON", "PRELOAD", "PLUGIN", "INJECTION", "LIBRARY_PATH")
"""Variables naming code to load (``NCCL_NET_PLUGIN``, ``CUDA_INJECTION64_PATH``): the same."""
_SECRET_ENV_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH",
                     "SESSION")
_URL_WITH_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^/@\s:]*:[^/@\s]*@", re.IGNORECASE)
WITHHELD = "<not recorded: looks like a credential>"
"""The value config.json holds for a recorded variable that looks like a credential."""

log = logging.getLogger("cfrun")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record (``--log-format json``): ``t_unix_s``, ``level``, ``logger``
    and ``message``, for log collectors (Kubernetes, Loki, CloudWatch)."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"t_unix_s": round(record.created, 3), "level": record.levelname,
                           "logger": record.name, "message": record.getMessage()})


def _setup_logging(log_format: str | None = None) -> None:
    """Give the ``cfrun`` logger one stderr handler. ``log_format`` (``--log-format``, else
    ``CFRUN_LOG_FORMAT``): ``auto`` is rich on a terminal and ``text`` elsewhere; ``text`` is
    ``LEVEL message``, one line per record, never wrapped, no trailing blanks (CI, pod logs);
    ``json`` is :class:`JsonLogFormatter`. Called again with a format, it replaces the handler.

    Raises:
        BadInputError: an unknown format.
    """
    fmt = (log_format or E.get_str(E.LOG_FORMAT) or "auto").strip().lower()
    if fmt not in ("auto", "text", "json"):
        raise BadInputError(f"--log-format {log_format!r} is not a log format; give auto, text "
                            "or json")
    if log.handlers and log_format is None:
        return
    for old in list(log.handlers):
        log.removeHandler(old)
    handler: logging.Handler
    if fmt == "auto" and sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False,
                              markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLogFormatter() if fmt == "json"
                             else logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _resolve_script(script: str) -> Path:
    path = Path(script)
    if not path.exists():
        raise BadInputError(f"script {script!r} does not exist; give the path of a Python "
                            "training script, e.g. cfrun train.py")
    if path.is_dir():
        raise BadInputError(f"script {script!r} is a directory; give the path of a Python "
                            "training script inside it")
    return path.resolve()


def _is_code_env(name: str) -> bool:
    """True for a variable that makes the interpreter or the loader run code of its choosing."""
    return name.upper().startswith(_CODE_ENV_PREFIXES) or \
        any(w in name.upper() for w in _CODE_ENV_WORDS)


def _looks_secret(name: str, value: str) -> bool:
    """True for a credential by its name (KEY, SECRET, TOKEN, PASSWORD, PASSWD, CREDENTIAL,
    AUTH, SESSION) or its value (a URL with a password: ``s3://user:pw@host``)."""
    return any(w in name.upper() for w in _SECRET_ENV_WORDS) or \
        _URL_WITH_PASSWORD.search(value) is not None


def _recorded_env() -> dict[str, str]:
    """The environment config.json keeps for ``cfrun resume`` (the ``cfrun run`` process):
    variables with the ``CFRUN_``, ``CUDA_``, ``OMP_``, ``NCCL_`` or ``MKL_`` prefixes, except
    the ranks' own and interpreter or loader variables; a credential's name is kept with
    :data:`WITHHELD` instead of its value."""
    return {k: WITHHELD if _looks_secret(k, v) else v for k, v in os.environ.items()
            if k.startswith(_RECORDED_ENV_PREFIXES) and not k.startswith("CFRUN_RANK_")
            and not _is_code_env(k)}


_RESUMABLE_ENV = frozenset({
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_SCHEDULE", "OMP_DYNAMIC",
    "OMP_WAIT_POLICY", "OMP_MAX_ACTIVE_LEVELS", "OMP_STACKSIZE", "MKL_NUM_THREADS",
    "MKL_DYNAMIC", "MKL_CBWR", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
    "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS"})
"""Thread, device and ordering knobs ``cfrun resume`` sets again; values, never code or paths."""
_NOT_A_KNOB = re.compile(r"FILE|PATH|DIR|CONF|PLUGIN|LIB|DUMP|TOOL|URL|ENDPOINT|SOCKET|HOST")
"""A name of these words names something to load, write or reach, not a tuning value."""


def _resumable_name(name: str) -> bool:
    """An allowlist (issue 24, item 8): the knobs of :data:`_RESUMABLE_ENV`, NCCL's tuning
    variables (not one naming a file, path, plugin, library or address: ``NCCL_CONF_FILE``,
    ``NCCL_DEBUG_FILE``, ``NCCL_TOPO_DUMP_FILE`` chose code and targets), and cfrun's own
    user settings of value types (``CFRUN_FAULTS``, ``CFRUN_S3_ENDPOINT_URL``,
    ``CFRUN_SHM_DIR`` are json, url and path: refused)."""
    if name in _RESUMABLE_ENV:
        return True
    if name.startswith("NCCL_"):
        return re.fullmatch(r"NCCL_[A-Z0-9_]+", name) is not None \
            and not _NOT_A_KNOB.search(name[5:])
    setting = E.SETTINGS.get(name)
    return setting is not None and setting.set_by == "user" \
        and setting.type not in ("path", "url", "json", "address")


def _resumable_env(env: dict[str, Any]) -> tuple[dict[str, str], list[str], list[str]]:
    """Split a recorded environment into what ``cfrun resume`` sets again, the names it
    refuses (interpreter or loader variables, other prefixes than cfrun records, values that
    are not strings) and the names whose value was withheld. config.json is data: nothing in
    it may choose code to run."""
    keep: dict[str, str] = {}
    refused: list[str] = []
    withheld: list[str] = []
    for k, v in env.items():
        if isinstance(k, str) and v == WITHHELD and k.startswith(_RECORDED_ENV_PREFIXES):
            withheld.append(k)  # only named in a note: nothing is set
        elif not isinstance(k, str) or not isinstance(v, str) or _is_code_env(k) or "=" in k \
                or "\0" in k + v or not _resumable_name(k):
            refused.append(str(k))
        else:
            keep[k] = v
    return keep, sorted(refused), sorted(withheld)


RESHARD_HELP = ("Go on from checkpoints written by another number of ranks or nodes: "
                "replicated state from any rank, sharded (FSDP2, TP) state resharded to the "
                "new mesh, the data position mapped by global samples. Not bit-exact (a "
                "resharded event says from and to). Without it such a resume is refused "
                "(exit 5).")


@app.command(
    "run",
    cls=CfrunCommand,
    hidden=True,  # `cfrun SCRIPT` is the documented spelling; `cfrun run SCRIPT` works too
    context_settings={"allow_interspersed_args": False},
    help="Run SCRIPT under torchrun with checkpoints every few optimizer steps, and go on from "
         "the newest one after a crash, a lost node or a SIGTERM. A job dir with checkpoints "
         "of the same command resumes by itself.",
)
def run_cmd(
    ctx: typer.Context,
    script: ScriptArgument,
    script_args: ScriptArgsArgument = None,
    module: ModuleOption = False,
    job_dir: Annotated[str | None, typer.Option(
        "--job-dir", metavar="PATH", envvar=E.JOB_DIR,
        help="Job directory (checkpoints, events, config). Default: "
             "./cfrun-jobs/<script name>-<hash of the script's path, its arguments, the ranks "
             "per node and the nodes>."
    )] = None,
    job_name: Annotated[str | None, typer.Option(
        "--job-name", metavar="NAME", envvar=E.JOB_NAME,
        help="The job's name at a peer and at level 2 (letters, digits, '.', '_', '-'); give "
             "the scheduler's job name where a changed command must find its checkpoints on "
             "a fresh node. Default: the job dir's name and a hash of its path and the "
             "command.")] = None,
    accept_changed_command: Annotated[bool, typer.Option(
        "--accept-changed-command",
        help="Go on from the job dir's checkpoints although the script or its arguments "
             "changed (recorded as a command_changed event; another world size needs "
             "--reshard). Without it a changed command is refused (exit 2) where the job dir "
             "has a checkpoint, and taken where it has none.")] = False,
    rerun: Annotated[bool, typer.Option(
        "--rerun",
        help="Run a finished job's command again, from its newest checkpoint (the script's "
             "tail after it runs again). Without it a finished job says so and exits 0.")
    ] = False,
    reshard: Annotated[bool, typer.Option(
        "--reshard", envvar=E.RESHARD,
        help=RESHARD_HELP)] = False,
    metrics: Annotated[str | None, typer.Option(
        "--metrics", metavar="HOST:PORT", envvar=E.METRICS,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics, without authentication "
             "(bind 127.0.0.1, or a pod IP behind a NetworkPolicy; port 0: a free port). The "
             "job dir's metrics.prom is written either way.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run",
        help="Print the resolved settings (flags, CFRUN_* variables, PET_* and SLURM defaults), "
             "the launch command and what the job dir would do (new, resume from step N, "
             "finished, refused) as JSON, and exit without starting or writing anything."
    )] = False,
    log_format: LogFormatOption = "auto",
    interval: IntervalOption = None,
    overhead: Annotated[str, typer.Option(
        "--overhead", metavar="PERCENT", envvar=E.OVERHEAD,
        help="Overhead budget in percent: 3.5% and 3.5 both mean 3.5% (from 0.1% to below "
             "100%); ignored with --interval.")] = "3.5%",
    nproc_per_node: NprocPerNodeOption = "1",
    launcher: LauncherOption = "torchrun",
    max_restarts: MaxRestartsOption = "5",
    keep: KeepOption = "2",
    grace: GraceOption = "25",
    mtbf: Annotated[str | None, typer.Option(
        "--mtbf", metavar="DURATION", envvar=E.MTBF,
        help="Mean time between failures (e.g. 6h): never checkpoint more often than the "
             "Young/Daly optimum needs. Default: learned from this job's restarts.")] = None,
    hang_timeout: HangTimeoutOption = "1800",
    crash_loop: CrashLoopOption = "3",
    retry_before_first_step: RetryBeforeFirstStepOption = False,
    total_steps: TotalStepsOption = None,
    inject_crash: Annotated[str, typer.Option(
        "--inject-crash", metavar="STEP[@ATTEMPT],...", envvar=E.INJECT_CRASH,
        help="Testing aid: STEP[@ATTEMPT],... rank 0 SIGKILLs itself after that step.")] = "",
    peer: Annotated[str | None, typer.Option(
        "--peer", metavar="HOST:PORT", envvar=E.PEER,
        help="HOST:PORT of a cfrun peer: checkpoints go to its RAM (protected), which "
             "flushes them to durable storage; the job dir takes them while it is down.")] = None,
    peer_token_file: Annotated[str | None, typer.Option(
        "--peer-token-file", metavar="PATH", envvar=E.PEER_TOKEN_FILE,
        help="File with the peer's shared secret (mode 600).")] = None,
    peer_streams: Annotated[str, typer.Option(
        "--peer-streams", metavar="INTEGER", envvar=E.PEER_STREAMS,
        help="Parallel connections per rank to the peer (1..64).")] = "4",
    persist_to: Annotated[str | None, typer.Option(
        "--persist-to", metavar="PATH|URL", envvar=E.PERSIST_TO,
        help="Level-2 store (directory or URL such as s3://bucket/prefix) that a resume also "
             "searches: give the peer's --flush-to.")] = None,
    job_key_file: Annotated[str | None, typer.Option(
        "--job-key-file", metavar="PATH", envvar=E.JOB_KEY_FILE,
        help="A key of the job's own (64 hex digits, mode 600): its checkpoints at the peer "
             "and level 2 are sealed under it instead of the peer token, and only its seals "
             "are installed; give it on every machine. Default: a key derived from the peer "
             "token and the job's name (a new machine needs only the token).")] = None,
    nnodes: Annotated[str, typer.Option(
        "--nnodes", metavar="INTEGER", envvar=E.NNODES,
        help="Nodes in the job; run one cfrun per node with the same --job-dir on a shared "
             "file system (torchrun c10d rendezvous).")] = "1",
    node_rank: Annotated[str, typer.Option(
        "--node-rank", "--node_rank", metavar="INTEGER", envvar=E.NODE_RANK,
        help="This node's index, 0..nnodes-1.")] = "0",
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT", envvar=E.RDZV_ENDPOINT,
        help="HOST:PORT of the rendezvous (required with --nnodes > 1).")] = None,
    rdzv_id: Annotated[str | None, typer.Option(
        "--rdzv-id", "--rdzv_id", metavar="TEXT", envvar=E.RDZV_ID,
        help="Rendezvous id shared by the nodes (default: the job dir's name).")] = None,
    local_addr: LocalAddrOption = None,
    standalone: StandaloneOption = False,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    rdzv_backend: RdzvBackendOption = "c10d",
    rdzv_conf: RdzvConfOption = None,
) -> None:
    """Run SCRIPT under cfrun (resumes by itself if the job dir has checkpoints)."""
    if ctx.get_parameter_source("log_format").name == "COMMANDLINE":  # type: ignore[union-attr]
        _setup_logging(log_format)  # main() set up CFRUN_LOG_FORMAT's already
    rdzv_endpoint = _torchrun_rendezvous(standalone, nnodes, rdzv_backend, rdzv_endpoint,
                                         master_addr, master_port)
    given = {"nnodes": nnodes, "node_rank": node_rank, "rdzv_endpoint": rdzv_endpoint,
             "rdzv_id": rdzv_id, "nproc_per_node": nproc_per_node, "max_restarts": max_restarts,
             "local_addr": local_addr}
    taken = _cluster_defaults(ctx, given)
    nnodes, node_rank, rdzv_endpoint, rdzv_id, nproc_per_node, max_restarts, local_addr = (
        taken[k] for k in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "nproc_per_node",
                           "max_restarts", "local_addr"))
    from cfrun.contract.cluster import fixed_nnodes, resolve_nproc_per_node

    nnodes, nproc_per_node = fixed_nnodes(nnodes), resolve_nproc_per_node(nproc_per_node)
    cfg = _build_config(script, script_args, job_dir, interval, overhead, nproc_per_node,
                        max_restarts, keep, grace, mtbf, hang_timeout, crash_loop, inject_crash,
                        profile_only=False, peer=peer, peer_token_file=peer_token_file,
                        peer_streams=peer_streams, persist_to=persist_to, nnodes=nnodes,
                        node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                        job_name=job_name, launcher=launcher, metrics=metrics,
                        local_addr=local_addr, module=module)
    cfg = dataclasses.replace(
        cfg, retry_before_first_step=retry_before_first_step,
        job_key_file=_job_key_path(job_key_file), reshard=reshard,
        total_steps=parse_positive_int("--total-steps", total_steps, minimum=1)
        if total_steps is not None else None)
    if dry_run:
        from cfrun.supervisor.admission import dry_run_outcome
        from cfrun.supervisor.launcher import build_launch_argv

        config = cfg.to_json()
        config.pop("env", None)  # the environment is recorded at run time, not shown here
        print(json.dumps({"config": config, "launch": build_launch_argv(cfg),
                          "job_dir": dry_run_outcome(
                              cfg, accept_changed_command=accept_changed_command,
                              rerun=rerun)}, indent=1))
        return
    _run(cfg, accept_changed_command=accept_changed_command, rerun=rerun,
         retry=_run_retry(ctx), python_command=_python_launcher_line(ctx),
         default_job_dir=job_dir is None)


def _torchrun_rendezvous(standalone: bool, nnodes: str, backend: str, endpoint: str | None,
                         master_addr: str | None, master_port: str | None) -> str | None:
    """The rendezvous endpoint from torchrun's spellings: ``--rdzv-endpoint`` as given, else
    ``--master-addr:--master-port`` (port 29500 by default, torchrun's) where several nodes
    meet; on one node cfrun's ``--standalone`` rendezvous picks its own port and these are
    no-ops.

    Raises:
        BadInputError: ``--standalone`` with several nodes, or a backend other than c10d or
            static.
    """
    if backend.strip().lower() not in ("c10d", "static"):
        raise BadInputError(f"--rdzv-backend {backend!r} is not supported; give c10d or static "
                            "(cfrun runs torchrun's c10d rendezvous), or drop it")
    if standalone and nnodes.partition(":")[0].strip() not in ("", "1"):
        raise BadInputError(f"--standalone runs one node, but --nnodes is {nnodes!r}; drop "
                            "--standalone, or --nnodes")
    if endpoint or not master_addr:
        return endpoint
    return f"{master_addr}:{master_port or 29500}"


def _one_node_launch(nproc_per_node: str, standalone: bool, rdzv_backend: str,
                     master_addr: str | None, master_port: str | None) -> str:
    """The launch options of ``cfrun profile`` and ``cfrun verify`` (one node), checked as
    ``cfrun SCRIPT`` checks them: torchrun's rendezvous spellings (no-ops on one node, accepted
    so a torchrun command line pastes) and ``--nproc-per-node auto|gpu`` resolved. Returns
    the ranks per node.

    Raises:
        BadInputError: as :func:`_torchrun_rendezvous` and
            :func:`cfrun.contract.cluster.resolve_nproc_per_node`.
    """
    from cfrun.contract.cluster import resolve_nproc_per_node

    _torchrun_rendezvous(standalone, "1", rdzv_backend, None, master_addr, master_port)
    return resolve_nproc_per_node(nproc_per_node)


def _run_retry(ctx: Any) -> list[str]:
    """The command line that gives this ``cfrun [run] ...`` again with
    ``--accept-changed-command`` (the hint of a refused changed command): the words as typed
    (:func:`main` keeps them in ``ctx.obj``), the flag before the script; empty (no hint)
    where they are not known (the command run without :func:`main`)."""
    typed = list((ctx.obj or {}).get("argv") or [])
    if not typed:
        return []
    lead = ["cfrun", "run"] if typed[:1] == ["run"] else ["cfrun"]
    return [*lead, "--accept-changed-command", *typed[len(lead) - 1:]]


def _python_launcher_line(ctx: Any) -> str | None:
    """This ``cfrun [run|profile|verify] ...`` as typed, with ``--launcher python`` in place of
    any ``--launcher`` given: the hint of a one-rank script that went distributed because
    torchrun set ``RANK`` (:func:`cfrun.supervisor.machine.went_distributed`). None where the
    words are not known (the command run without :func:`main`)."""
    typed = list((ctx.obj or {}).get("argv") or [])
    if not typed:
        return None
    lead = ["cfrun", typed[0]] if typed[0] in ("run", "profile", "verify") else ["cfrun"]
    words = typed[len(lead) - 1:]
    takes_value = {name for p in ctx.command.params if not getattr(p, "is_flag", True)
                   for name in (*p.opts, *p.secondary_opts)}
    options: list[str] = []
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] != "--":
        word = words[i]
        if word == "--launcher":
            i += 2
            continue
        if word.startswith("--launcher="):
            i += 1
            continue
        if word in ("-m", "--module") or word.startswith(("-m", "--module=")):
            break  # the module's name (SCRIPT) follows or is in it: the rest is the script's
        step = 2 if word in takes_value else 1
        options += words[i:i + step]
        i += step
    return shlex.join([*lead, "--launcher", "python", *options, *words[i:]])


def _cluster_defaults(ctx: Any, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with each option that neither a flag nor its ``CFRUN_*`` variable set taken
    from the launcher's environment (:func:`cfrun.contract.cluster.cluster_defaults`: torchrun's
    ``PET_*``, then SLURM); one INFO line says what was taken and from where."""
    from cfrun.contract.cluster import cluster_defaults

    found = cluster_defaults(os.environ)
    out = dict(given)
    taken = []
    for option in given:
        source = ctx.get_parameter_source(option)
        if source is not None and getattr(source, "name", "") != "DEFAULT":
            continue
        default = found.get(option)
        if default is not None:
            out[option] = default[0]
            taken.append(f"{option.replace('_', '-')} {default[0]} ({default[1]})")
    if taken:
        log.info("cfrun: from the environment: %s", ", ".join(taken))
    return out


def _job_key_path(path: str | None) -> str | None:
    """``--job-key-file``, checked now (one line, exit 2) and made absolute.

    Raises:
        BadInputError: as :func:`cfrun.contract.jobkey.read_key_file`.
    """
    if not path:
        return None
    from cfrun.contract.jobkey import read_key_file

    read_key_file(path)
    return str(Path(path).expanduser().absolute())


def _build_config(script: str, script_args: list[str] | None, job_dir: str | None,
                  interval: str | None, overhead: str, nproc_per_node: str, max_restarts: str,
                  keep: str, grace: str, mtbf: str | None, hang_timeout: str, crash_loop: str,
                  inject_crash: str, *, profile_only: bool, peer: str | None = None,
                  peer_token_file: str | None = None, peer_streams: str = "4",
                  persist_to: str | None = None, nnodes: str = "1", node_rank: str = "0",
                  rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                  job_name: str | None = None, launcher: str = "torchrun",
                  metrics: str | None = None, local_addr: str | None = None,
                  module: bool = False) -> RunConfig:
    """The run's :class:`RunConfig` from the command line's words; ``module`` (``-m``):
    ``script`` is a module name, whose file is found without running it
    (:func:`cfrun.contract.pymodule.find_module_file`). Checks everything before anything is
    created.

    Raises:
        BadInputError: a value is invalid (one line naming it and the fix).
    """
    if module:
        from cfrun.contract.pymodule import find_module_file

        script_path = find_module_file(script, Path.cwd())
    else:
        script_path = _resolve_script(script)
    option = "--job-name"
    if job_name is None and E.get_str(E.PEER_JOB):  # the older name of CFRUN_JOB_NAME
        job_name, option = E.get_str(E.PEER_JOB), E.PEER_JOB
    if job_name is not None:
        check_job_name(job_name, option)
    cwd = Path.cwd()
    nproc_n = parse_positive_int("--nproc-per-node", nproc_per_node, minimum=1)
    nnodes_n = parse_positive_int("--nnodes", nnodes, minimum=1)
    jd = Path(job_dir).expanduser().absolute() if job_dir else \
        default_job_dir(str(script_path), cwd, script_args or [], nproc_n, nnodes_n,
                        module=script if module else None)
    parse_inject_crash(inject_crash)  # validate now: the ranks parse it again
    grace_s = _parse_seconds("--grace", grace, "25")
    hang_timeout_s = _parse_seconds("--hang-timeout", hang_timeout, "600")
    token_path = None
    if peer:
        from cfrun.peer.protocol import parse_address, read_token

        if parse_address(peer, option="--peer")[1] == 0:
            raise BadInputError(f"--peer {peer!r} has port 0; give the port the peer listens on")
        if not peer_token_file:
            raise BadInputError("--peer needs --peer-token-file F, the file with the peer's "
                                "shared secret")
        read_token(peer_token_file, option="--peer-token-file")
        token_path = str(Path(peer_token_file).expanduser().absolute())
    if metrics:
        from cfrun.peer.protocol import parse_address

        parse_address(metrics, option="--metrics")
    if persist_to:
        from cfrun.storage.tiers import open_storage

        open_storage(persist_to)
        if "://" not in persist_to:
            persist_to = str(Path(persist_to).expanduser().absolute())
    cfg = RunConfig(
        script=str(script_path),
        script_args=list(script_args or []),
        job_dir=str(jd),
        cwd=str(cwd),
        interval=parse_interval(interval) if interval is not None else None,
        overhead=parse_overhead(overhead),
        nproc_per_node=nproc_n,
        launcher=launcher.strip() or "torchrun",
        max_restarts=parse_positive_int("--max-restarts", max_restarts, minimum=0),
        keep=parse_positive_int("--keep", keep, minimum=1),
        grace_s=grace_s,
        hang_timeout_s=hang_timeout_s,
        mtbf_s=parse_duration("--mtbf", mtbf) if mtbf else None,
        profile_only=profile_only,
        crash_loop_limit=parse_positive_int("--crash-loop", crash_loop, minimum=0),
        inject_crash=inject_crash,
        nnodes=nnodes_n,
        node_rank=parse_positive_int("--node-rank", node_rank, minimum=0),
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id or jd.name,
        peer=peer or None,
        peer_token_file=token_path,
        peer_streams=parse_positive_int("--peer-streams", peer_streams, minimum=1),
        persist_to=persist_to or None,
        job_name=job_name,
        metrics=metrics or None,
        local_addr=local_addr or None,
        env=_recorded_env(),
        module=script if module else None,
    )
    return cfg


def _parse_seconds(name: str, text: str, example: str) -> float:
    """A DURATION option: plain seconds (``25``, ``0``) or a number with a unit (``30s``,
    ``2m``, ``1h``, :func:`cfrun.policy.parse_duration`)."""
    try:
        value = float(text)
    except ValueError:
        value = parse_duration(name, text) if text.strip()[-1:].isalpha() else -1.0
    if not value >= 0:
        raise BadInputError(f"{name} {text!r} is not a duration; give seconds or a number with "
                            f"s, m, h or d, e.g. {name} {example}")
    return value


def _plan_record(strategy: Path) -> dict[str, Any]:
    """The plan in ``strategy.json`` (:meth:`cfrun.rank.tuner.Tuner.plan`), {} when there is
    none or it does not read as one."""
    try:
        record = json.loads(strategy.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _plan_phase(strategy: Path) -> str | None:
    """The phase of the plan in ``strategy.json`` (``profiling`` until rank 0 decides, then
    ``tuned``), or None when there is none."""
    record = _plan_record(strategy)
    return str(record.get("phase", "tuned")) if record else None


@app.command("profile", cls=CfrunCommand, context_settings={"allow_interspersed_args": False},
             help="Profile SCRIPT: measure checkpoint costs, choose the snapshot mode and the "
                  "interval, then stop.")
def profile_cmd(
    ctx: typer.Context,
    script: ScriptArgument,
    script_args: ScriptArgsArgument = None,
    module: ModuleOption = False,
    job_dir: Annotated[str | None, typer.Option(
        "--job-dir", metavar="PATH", envvar=E.JOB_DIR,
        help="Job dir to profile into (default ./cfrun-jobs/<script name>-<hash>, the one "
             "cfrun SCRIPT [ARGS] takes); a later run with the same script, arguments and "
             "ranks trains there and reuses the profile.")] = None,
    overhead: Annotated[str, typer.Option(
        "--overhead", metavar="PERCENT", envvar=E.OVERHEAD,
        help="Overhead budget in percent: 3.5% and 3.5 both mean 3.5%.")] = "3.5%",
    mtbf: Annotated[str | None, typer.Option(
        "--mtbf", metavar="DURATION", envvar=E.MTBF,
        help="Mean time between failures, e.g. 6h.")] = None,
    nproc_per_node: NprocPerNodeOption = "1",
    launcher: LauncherOption = "torchrun",
    local_addr: LocalAddrOption = None,
    standalone: StandaloneOption = False,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    rdzv_backend: RdzvBackendOption = "c10d",
    rdzv_conf: RdzvConfOption = None,
) -> None:
    """Profile SCRIPT: measure checkpoint costs, choose snapshot mode and interval, stop."""
    import shutil

    from rich.console import Console
    from rich.table import Table

    from cfrun.contract.checkpoints import committed_steps
    from cfrun.contract.gpus import samples as gpu_samples
    from cfrun.contract.jobdir import JobDir
    from cfrun.rank.probes import PROBE_MODES
    from cfrun.supervisor.core import Supervisor

    nproc_per_node = _one_node_launch(nproc_per_node, standalone, rdzv_backend, master_addr,
                                      master_port)
    cfg = _build_config(script, script_args, job_dir, None, overhead, nproc_per_node, "0", "2",
                        "25", mtbf, "1800", "0", "", profile_only=True, module=module,
                        launcher=launcher, local_addr=local_addr)
    jd = JobDir(cfg.job_dir)
    if committed_steps(jd.checkpoints):
        raise BadInputError(f"job dir {cfg.job_dir!r} already has checkpoints; profile into a "
                            "new --job-dir (profiling must not replace a job's checkpoints)")
    code = Supervisor(cfg, python_command=_python_launcher_line(ctx)).run()
    shutil.rmtree(jd.checkpoints, ignore_errors=True)  # profiling checkpoints are not a job's
    jd.checkpoints.mkdir(mode=0o700, parents=True, exist_ok=True)
    for hb in coordination.heartbeat_paths(jd.root):
        hb.unlink()
    strategy = jd.strategy_path
    if code == 0 and _plan_phase(strategy) != "tuned":  # rank 0's plan, still profiling
        planned = len(_plan_record(strategy).get("probe_steps") or PROBE_MODES)
        strategy.unlink(missing_ok=True)
        probes = sum(1 for e in jd.read_events() if e.get("event") == "checkpoint")
        raise JobFailedError(
            f"the script ended before profiling finished ({probes} of {planned} "
            "profiling checkpoints taken); nothing was decided",
            hint="profile with more steps (profiling takes about 50 to 60 optimizer steps)")
    if code != 0:
        raise typer.Exit(code)
    st = json.loads(strategy.read_text())
    prof = json.loads(jd.profile_path(st["fingerprint"]).read_text())
    c, d = prof["costs"], prof["decision"]
    table = Table("measured", "value", title=f"cfrun profile: {cfg.shown}")
    for name, value in [
        ("iteration time", f"{c['iter_s'] * 1e3:.2f} ms"),
        ("optimizer step time", f"{prof.get('opt_step_s', 0) * 1e3:.2f} ms"),
        ("state size", f"{c['state_bytes'] / 1e6:.2f} MB"),
        *[(f"stall per checkpoint ({m})", f"{v['stall_s'] * 1e3:.2f} ms")
          for m, v in prof["modes"].items()],
        *[(f"interference per checkpoint ({m})", f"{v['interference_s'] * 1e3:.2f} ms")
          for m, v in prof["modes"].items()],
        ("snapshot + persist", f"{c['persist_s'] * 1e3:.2f} ms"),
        ("persist bandwidth", f"{c['state_bytes'] / max(c['persist_s'], 1e-9) / 1e9:.2f} GB/s"),
        ("memory", prof.get("memory", "-")),
        ("GPUs", _gpu_text([g.to_json() for g in gpu_samples()]) or "none (no NVML)"),
        ("chosen snapshot mode", prof["mode"]),
        ("chosen interval", f"{d['interval']} steps ({d['reason']})"),
        ("predicted overhead", f"{100 * d['predicted_overhead']:.2f}% "
                               f"(budget {100 * prof['budget']:.2f}%)"),
        ("predicted recovery time", f"{d['predicted_recovery_s']:.1f} s"),
    ]:
        table.add_row(name, str(value))
    Console().print(table)
    print(f"strategy written to {strategy}")


@app.command("verify", cls=CfrunCommand, context_settings={"allow_interspersed_args": False},
             help="Check that SCRIPT resumes exactly: run it to step N uninterrupted and again "
                  "with SIGKILLs at chosen steps, then compare the two states at step N bit "
                  "for bit. Exit 0: exact; 6: not exact, with the first differing entry.")
def verify_cmd(
    ctx: typer.Context,
    script: ScriptArgument,
    script_args: ScriptArgsArgument = None,
    module: ModuleOption = False,
    steps: Annotated[str | None, typer.Option(
        "--steps", metavar="INTEGER",
        help="Optimizer steps each run makes before it stops (default: the first epoch of "
             "the training loader plus two checkpoint intervals when the loader has a "
             "length, else 200).")] = None,
    kills: Annotated[str, typer.Option(
        "--kills", metavar="INTEGER",
        help="SIGKILLs in the second run, at the hard cases: inside an epoch, right after an "
             "epoch's last step, during a persist, before the first checkpoint.")] = "3",
    against_plain: Annotated[bool, typer.Option(
        "--against-plain",
        help="Also run the script without cfrun to step N and check that the uninterrupted "
             "run computes the same at every step (a third run).")] = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object (the script's output goes to stderr).")] = False,
    interval: IntervalOption = None,
    nproc_per_node: NprocPerNodeOption = "1",
    launcher: LauncherOption = "torchrun",
    max_restarts: MaxRestartsOption = "5",
    grace: GraceOption = "25",
    hang_timeout: HangTimeoutOption = "1800",
    crash_loop: CrashLoopOption = "3",
    local_addr: LocalAddrOption = None,
    standalone: StandaloneOption = False,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    rdzv_backend: RdzvBackendOption = "c10d",
    rdzv_conf: RdzvConfOption = None,
    log_format: LogFormatOption = "auto",
) -> None:
    """Check that SCRIPT resumes exactly (:mod:`cfrun.cli.verify`)."""
    from cfrun.cli import verify as V

    if ctx.get_parameter_source("log_format").name == "COMMANDLINE":  # type: ignore[union-attr]
        _setup_logging(log_format)
    steps_n = parse_positive_int("--steps", steps, minimum=2) if steps is not None else None
    kills_n = parse_positive_int("--kills", kills, minimum=0)
    nproc_per_node = _one_node_launch(nproc_per_node, standalone, rdzv_backend, master_addr,
                                      master_port)
    cfg = _build_config(script, script_args, None, interval or str(V.DEFAULT_INTERVAL), "3.5%",
                        nproc_per_node, max_restarts, "2", grace, None, hang_timeout,
                        crash_loop, "", profile_only=False, launcher=launcher,
                        local_addr=local_addr, module=module)
    restore = V.json_stdout_guard()[1] if as_json else None
    try:
        rep = V.verify(cfg, steps=steps_n, kills=kills_n, against_plain=against_plain,
                       say=lambda line: log.info("%s", line),
                       python_command=_python_launcher_line(ctx))
    except KeyboardInterrupt:  # Ctrl-C between two runs (a run's own supervisor takes it)
        print("cfrun verify: interrupted; nothing was compared", file=sys.stderr)
        raise typer.Exit(EXIT_PREEMPTED) from None
    finally:
        if restore is not None:
            restore()
    if as_json:
        print(json.dumps(rep, indent=1))
    else:
        print(f"cfrun verify: {cfg.shown} {' '.join(cfg.script_args)}".rstrip()
              + f", {rep['steps']} steps, checkpoint every {rep['interval']} steps")
        print(V.format_report(rep))
    raise typer.Exit(V.exit_code(rep))


@app.command("resume", cls=CfrunCommand,
             help="Continue a stopped, failed or preempted job with the command, options and "
                  "working directory recorded in its job dir (config.json); only --node-rank, "
                  "and with --reshard another --nproc-per-node or --nnodes, are taken from "
                  "this command line.")
def resume_cmd(
    job_dir: Annotated[str, typer.Argument(
        metavar="JOB_DIR", help="A job dir written by an earlier cfrun run.")],
    node_rank: Annotated[str, typer.Option(
        "--node-rank", "--node_rank", metavar="INTEGER", envvar=E.NODE_RANK,
        help="Which node's settings to resume in a multi-node job dir.")] = "0",
    accept_changed_command: Annotated[bool, typer.Option(
        "--accept-changed-command",
        help="Go on although the recorded script was edited since (recorded as a "
             "command_changed event); without it an edited script of a job dir with a "
             "checkpoint is refused (exit 2).")
    ] = False,
    rerun: Annotated[bool, typer.Option(
        "--rerun", help="Run a finished job again from its newest checkpoint.")] = False,
    reshard: Annotated[bool, typer.Option("--reshard", envvar=E.RESHARD, help=RESHARD_HELP)
                       ] = False,
    nproc_per_node: Annotated[str | None, typer.Option(
        "--nproc-per-node", "--nproc_per_node", metavar="INTEGER",
        help="Ranks per node of the resumed job (default: as recorded); another world size "
             "needs --reshard.")
    ] = None,
    nnodes: Annotated[str | None, typer.Option(
        "--nnodes", metavar="INTEGER",
        help="Nodes of the resumed job (default: as recorded); another world size needs "
             "--reshard.")] = None,
) -> None:
    """Continue a stopped, failed or preempted job with its recorded command and settings.

    The script, its arguments, every option and the working directory come from the job dir's
    ``config.json`` (current ``CFRUN_*`` variables do not change them; only ``--node-rank``
    picks the node, and ``--nproc-per-node``/``--nnodes`` give another world size, which
    ``--reshard`` lets resume from the recorded checkpoints: issue 25, item 4).
    Recorded environment variables (``CFRUN_``, ``CUDA_``, ``OMP_``,
    ``NCCL_``, ``MKL_`` prefixes) are set again where the current environment lacks them;
    interpreter and loader variables (``PYTHON*``, ``LD_*``, plugins) found there are ignored
    with a warning, and credentials were never recorded. Prints the command it resumes. The job
    dir named here is used even if it was moved since.
    """
    import dataclasses

    from cfrun.contract.errors import JobDirLockedError
    from cfrun.contract.jobdir import JobDir

    jd = Path(job_dir).expanduser().absolute()
    node = parse_positive_int("--node-rank", node_rank, minimum=0)
    os.environ[E.NODE_RANK] = str(node)
    from cfrun.contract.settings import node_suffix

    cfg_path = JobDir(jd).config_path_of(node_suffix())
    if not jd.is_dir():
        raise BadInputError(f"job dir {job_dir!r} does not exist; give the --job-dir of an "
                            "earlier run (default ./cfrun-jobs/<script name>-<hash>)")
    if not cfg_path.is_file():
        raise BadInputError(f"{job_dir!r} is not a cfrun job dir (no {cfg_path.name}); give "
                            "the --job-dir of an earlier run")
    try:
        data = json.loads(cfg_path.read_text())
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        cfg = RunConfig.from_json(data)
        if not isinstance(cfg.env, dict) or not isinstance(cfg.script_args, list):
            raise TypeError("env or script_args has the wrong type")
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as e:
        raise BadInputError(f"{cfg_path} is unreadable ({e}); start the job again with "
                            "cfrun SCRIPT into a new --job-dir") from None
    if not Path(cfg.cwd).is_dir():
        raise BadInputError(f"the recorded working directory {cfg.cwd!r} no longer exists; "
                            "recreate it, or start the job again with cfrun SCRIPT from "
                            "another directory") from None
    if cfg.module:  # found again as the ranks' python -m will find it
        from cfrun.contract.pymodule import find_module_file

        try:
            found = find_module_file(cfg.module, Path(cfg.cwd))
        except BadInputError as e:
            raise BadInputError(f"the recorded module cannot be run: {e}; restore it, or start "
                                "the job again with cfrun -m MODULE") from None
        cfg = dataclasses.replace(cfg, script=str(found))
    elif not Path(cfg.script).is_file():
        raise BadInputError(f"the recorded script {cfg.script!r} no longer exists; restore "
                            "it, or start the job again with cfrun SCRIPT") from None
    cfg = dataclasses.replace(cfg, job_dir=str(jd), reshard=reshard)
    if nproc_per_node is not None or nnodes is not None:  # another world size: --reshard's
        cfg = dataclasses.replace(
            cfg, nproc_per_node=cfg.nproc_per_node if nproc_per_node is None
            else parse_positive_int("--nproc-per-node", nproc_per_node, minimum=1),
            nnodes=cfg.nnodes if nnodes is None
            else parse_positive_int("--nnodes", nnodes, minimum=1))
    if JobDir(jd).is_locked():
        raise JobDirLockedError(f"job dir {str(jd)!r} is in use by another cfrun")
    env, refused, withheld = _resumable_env(cfg.env)
    if refused:
        print(f"cfrun: warning: ignoring {', '.join(refused)} recorded in {cfg_path}: cfrun "
              "resume never takes interpreter or loader variables from a job dir",
              file=sys.stderr)
    missing = [k for k in withheld if k not in os.environ]
    if missing:
        print(f"cfrun: note: {', '.join(missing)} looked like credentials and were not "
              "recorded; set them again if the job needs them", file=sys.stderr)
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if cfg.persist_to and URL_PASSWORD_WITHHELD in cfg.persist_to:
        given = os.environ.get(E.PERSIST_TO)
        if not given:
            raise BadInputError(f"the recorded --persist-to {cfg.persist_to!r} held a password, "
                                f"which cfrun does not record; give the URL again: "
                                f"{E.PERSIST_TO}=URL {resume_command(jd, node)}")
        cfg = dataclasses.replace(cfg, persist_to=given)
    # what config.json chooses besides the command, in sight before anything runs
    shown = ["-m", cfg.module] if cfg.module else [cfg.script]
    print(f"cfrun: resuming: {shlex.join([*shown, *cfg.script_args])} in {cfg.cwd} "
          f"(job dir {jd}, {cfg.nproc_per_node} rank(s) per node, persist-to "
          f"{redact_url(cfg.persist_to) or 'none'}, peer {cfg.peer or 'none'})",
          file=sys.stderr, flush=True)
    retry = resume_command(jd, node, "--accept-changed-command", *(["--rerun"] if rerun else []))
    _run(cfg, accept_changed_command=accept_changed_command, rerun=rerun,
         retry=shlex.split(retry))


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _or(value: Any, unknown: str) -> str:
    """``value`` as text, or what its absence means (``cfrun status`` never prints None)."""
    return unknown if value is None else str(value)


@app.command("status", cls=CfrunCommand,
             help="State of a job: steps, checkpoints, interval, overhead, stall and PGT, "
                  "restarts, and the command that resumes a stopped one. Without a job dir, or "
                  "with a directory of job dirs, one line per job.")
def status_cmd(
    job_dir: Annotated[str | None, typer.Argument(
        metavar="[JOB_DIR|SCRIPT]",
        help="A job dir; a directory of job dirs (default ./cfrun-jobs: one line per job); or "
             "a script, whose job dir in ./cfrun-jobs is shown.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    plot: Annotated[str | None, typer.Option(
        "--plot", metavar="PNG",
        help="Write a PNG: the attempts on a timeline (start-up, restarts, training, commits, "
             "failures, ETTR), and checkpoint stall and PGT by step.")] = None,
    metrics: Annotated[bool, typer.Option(
        "--metrics", help="Print the job's Prometheus metrics (text format) instead.")] = False,
    watch: Annotated[bool, typer.Option(
        "--watch", help="Refresh every 2 s until the job stops (a live table on a terminal, a "
                        "line per refresh elsewhere); Ctrl-C leaves.")] = False,
) -> None:
    """State of a job: steps, checkpoints, interval, overhead, stall and PGT, restarts."""
    from rich.console import Console

    from cfrun.cli import inspect as report

    found = report.find_jobs(job_dir, Path.cwd())
    if isinstance(found, list):
        from cfrun.cli.jobs import print_jobs

        print_jobs(found, as_json=as_json)
        return
    jd = found
    if metrics:
        from cfrun.supervisor.metrics import JobMetrics

        sys.stdout.write(JobMetrics(jd.root).exposition().decode())
        return
    st = report.status(jd)
    if plot:
        _plot(jd, Path(plot))
        if not as_json:  # where it went, as export says (issue 37, item 7)
            print(f"cfrun: wrote the plot of {jd.root} to {Path(plot).absolute()}",
                  file=sys.stderr)
    if as_json:
        print(json.dumps(st, indent=1))
        return
    if watch:
        _watch(jd, report.status, every_s=2.0)
        return
    Console().print(_status_table(st))


def _status_rows(st: dict[str, Any], rate: str | None = None) -> list[tuple[str, str]]:
    """The rows of ``cfrun status``'s table (never "None": :func:`_or`); ``rate``: the steps/s
    row of ``--watch``."""
    rows = [
        ("state", st["state"]),
        ("script", str(st["script"] or "unknown (no config.json)")
         + (f" (-m {st['module']})" if st.get("module") else "")),
        ("current step", _step_text(st) + (f" ({rate})" if rate else "")),
        ("last committed step", _or(st["last_committed_step"], "none yet")),
        ("interval", f"{st['interval']['steps']} steps ({st['interval']['why']})"
         if st["interval"]["steps"] is not None
         else f"not decided yet ({st['interval']['why']})"),
        ("overhead", _overhead_text(st["overhead"])),
        ("stall per checkpoint", f"median {_fmt_s(st['stall_s']['median'])}, p95 "
                                 f"{_fmt_s(st['stall_s']['p95'])}, "
                                 f"max {_fmt_s(st['stall_s']['max'])}"),
        ("PGT", f"median {_fmt_s(st['pgt_s']['median'])}, p95 {_fmt_s(st['pgt_s']['p95'])}"),
        ("checkpoints taken", f"{st['checkpoints_taken']}, {st['checkpoints_failed']} failed, "
                              f"{st['checkpoints_skipped']} skipped (no space)"),
        ("attempts", str(st["attempts"])),
        ("restarts", "; ".join(f"attempt {r['attempt']}: {r['cause']} {r['where']}"
                               for r in st["restarts"]) or "none"),
        ("last resume", _resume_text(st.get("last_resume"))),
        ("goodput", _goodput_text(st.get("goodput"))),
        ("disk", f"{st['disk_bytes'] / 1e6:.1f} MB in checkpoints/"),
        ("GPUs", _gpu_text(st["gpus"]) or "none seen (no NVML or no GPU on this machine)"),
    ]
    if st.get("resharded"):  # --reshard: the run since is not bit-exact (issue 25, item 4)
        rows.append(("resharded", "; ".join(
            f"step {r['step']}: {r['from_world_size']} -> {r['to_world_size']} ranks "
            f"(attempt {r['attempt']}; not bit-exact)" for r in st["resharded"])))
    if st.get("resume_command"):
        rows.insert(1, ("resume with", st["resume_command"]))
    if st["error"]:
        rows.insert(1, ("error", st["error"]))
    if st["unprotected"]:
        rows.insert(1, ("UNPROTECTED", "; ".join(
            f"attempt {u['attempt']}: {u['error']} ({u['where']}, step {u['step']})"
            for u in st["unprotected"])))
    return rows




def _step_text(st: dict[str, Any]) -> str:
    """``91 of 200``: the newest step and the run's total where known
    (:mod:`cfrun.contract.progress`), with the step rate and the time left of a running job
    (the one-shot table: the attempt's rate since its first checkpoint)."""
    from cfrun.contract import progress

    if st["current_step"] is None:
        return "no step seen yet"
    text = progress.step_text(st["current_step"], st.get("total_steps"))
    if st.get("total_steps") is None and st.get("is_running"):
        text += " (total not known: --total-steps N gives one)"
    rate = progress.rate_text(st.get("steps_per_s"), st.get("eta_s"))
    return text + (f", {rate}" if rate else "")


def _overhead_text(overhead: dict[str, Any]) -> str:
    """``0.95% stalled (budget 3.5%)``: the job's overhead, the one figure of
    :data:`cfrun.contract.events.OVERHEAD_DEFINITION`, in the table and ``--watch``."""
    pct = overhead["stall_pct"]
    return (f"{pct}% stalled" if pct is not None else "not measured yet (no attempt started)") \
        + f" (budget {overhead['budget_pct']}%)"


def _goodput_text(g: dict[str, Any] | None) -> str:
    """``cfrun status``'s goodput row: the ETTR and the time lost per cause."""
    if not g or g.get("ettr") is None:
        return "no attempt yet"
    def dur(s: float) -> str:
        return f"{s:.1f} s" if s >= 1 else f"{s * 1000:.0f} ms"

    lost = ", ".join(f"{cause} {dur(s)}" for cause, s in g["lost_s"].items() if s)
    steps = f" ({g['recomputed_steps']} steps recomputed)" if g.get("recomputed_steps") else ""
    return (f"ETTR {100 * g['ettr']:.1f}% of {dur(g['wall_s'])}: lost "
            f"{lost or 'nothing measurable'}{steps}")


def _resume_text(r: dict[str, Any] | None) -> str:
    """``attempt 1 at step 100: 3.21 s (backoff 0.00 s, launch 0.9 s, ...)`` or ``none``."""
    if not r:
        return "none"
    parts = ", ".join(f"{name.removesuffix('_s').replace('_', ' ')} {r[name]:.2f} s"
                      for name in r if name.endswith("_s") and name != "total_s"
                      and r[name] is not None)
    where = f"attempt {r['attempt']} at step {r['step']}"
    if r.get("total_s") is None:  # the previous attempt's end is not recorded (issue 37, 7)
        return f"{where}: {parts or 'no part measured'} (total not known: the attempt " \
               "before it has no recorded end)"
    return f"{where}: {r['total_s']:.2f} s ({parts})"


def _gpu_text(gpus: list[dict[str, Any]]) -> str:
    """``GPU 0 H100: 40.1/80.0 GB, 97% busy; ...`` (NVML samples, :mod:`cfrun.contract.gpus`)."""
    return "; ".join(f"GPU {g['index']} {g['name']}: {g['memory_used_bytes'] / 1e9:.1f}/"
                     f"{g['memory_total_bytes'] / 1e9:.1f} GB, {g['utilization_pct']}% busy"
                     for g in gpus)


def _status_table(st: dict[str, Any], rate: str | None = None) -> Any:
    from rich.table import Table

    table = Table(title=f"cfrun job {st['job_dir']}", show_header=False)
    for k, v in _status_rows(st, rate):
        table.add_row(k, v)
    return table


def _watch(jd: Any, status: Any, *, every_s: float) -> None:
    """``cfrun status --watch``: refresh every ``every_s`` until the job stops running (then
    the final state) or Ctrl-C. On a terminal a live rich table; elsewhere one line per
    refresh (step, steps/s, newest checkpoint, overhead), for logs."""
    import time

    from rich.console import Console
    from rich.live import Live

    from cfrun.contract import progress

    console = Console()
    last: tuple[float, int] | None = None

    def snapshot() -> tuple[dict[str, Any], str | None]:
        nonlocal last
        st = status(jd)
        now, step = time.monotonic(), st["current_step"]
        rate = None
        if step is not None and last is not None and now > last[0]:
            per_s = (step - last[1]) / (now - last[0])
            rate = progress.rate_text(per_s, progress.eta_s(step, st.get("total_steps"), per_s))
            st = {**st, "steps_per_s": None, "eta_s": None}  # the row shows this rate
        if step is not None:
            last = (now, step)
        return st, rate

    try:
        if console.is_terminal:
            st, rate = snapshot()
            with Live(_status_table(st, rate), console=console, auto_refresh=False) as live:
                while st["is_running"]:
                    time.sleep(every_s)
                    st, rate = snapshot()
                    live.update(_status_table(st, rate), refresh=True)
            return
        while True:
            st, rate = snapshot()
            print(f"cfrun status: {st['state']}, step "
                  f"{progress.step_text(st['current_step'], st.get('total_steps'))}"
                  f"{f' ({rate})' if rate else ''}, newest checkpoint "
                  f"{_or(st['last_committed_step'], 'none yet')}, overhead "
                  f"{_overhead_text(st['overhead'])}, restarts {len(st['restarts'])}",
                  flush=True)
            if not st["is_running"]:
                return
            time.sleep(every_s)
    except KeyboardInterrupt:
        return


def _plot(jd: Any, out: Path) -> None:
    from cfrun.cli.timeline import plot

    plot(jd.read_events(), jd.root.name, out)


@app.command("ls", cls=CfrunCommand,
             help="Committed checkpoints: step, epoch, size, age and verification state. With "
                  "a directory of job dirs, one line per job.")
def ls_cmd(
    job_dir: Annotated[str, typer.Argument(
        metavar="JOB_DIR", help="The job dir, or a directory of job dirs (./cfrun-jobs): one "
                                "line per job, as cfrun status lists them.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    check: Annotated[bool, typer.Option("--verify/--no-verify",
                                        help="Check every file's checksum.")] = True,
) -> None:
    """Committed checkpoints: step, epoch, size, age and verification state."""
    from rich.console import Console
    from rich.table import Table

    from cfrun.cli import inspect as report
    from cfrun.cli.jobs import jobs_in, print_jobs

    several = jobs_in(Path(job_dir).expanduser())
    if several is not None:
        print_jobs(several, as_json=as_json)
        return
    rows = report.checkpoints(report.open_job_dir(job_dir), check=check)
    if as_json:
        print(json.dumps(rows, indent=1))
        report.check_listing(rows)
        return
    table = Table("step", "epoch", "batches", "size", "age", "verified")
    for r in rows:
        size = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.2f} MB"
        age = "-" if r["age_s"] is None else f"{r['age_s']:.0f} s"
        step = f"{r['step']} (final)" if r.get("final") else str(r["step"])
        # a final checkpoint holds no data position: "-", never "None" (issue 37, item 7)
        table.add_row(step, _or(r["epoch"], "-"), _or(r["batches"], "-"), size, age,
                      r["verified"])
    Console().print(table)
    report.check_listing(rows)


@app.command("export", cls=CfrunCommand,
             help="Write a checkpoint's model weights as a plain torch or safetensors file, or a "
                  "torch.distributed.checkpoint directory.")
def export_cmd(
    job_dir: Annotated[str, typer.Argument(metavar="JOB_DIR", help="The job dir.")],
    out: Annotated[str, typer.Argument(
        metavar="OUT", help="Output file (a new directory with --format dcp).")],
    step: Annotated[str | None, typer.Option(
        "--step", metavar="INTEGER", help="Step (default: newest).")] = None,
    fmt: Annotated[str, typer.Option(
        "--format", metavar="[torch|safetensors|dcp]",
        help="torch (torch.save), safetensors, or dcp (a torch.distributed.checkpoint "
             "directory, for DCP and TorchTitan).")] = "torch",
) -> None:
    """Write a checkpoint's model weights as a plain torch or safetensors file."""
    from cfrun.cli import inspect as report

    jd = report.open_job_dir(job_dir)
    step_n = parse_positive_int("--step", step, minimum=0) if step is not None else None
    out_path = Path(out)
    if fmt == "dcp":
        if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
            raise BadInputError(f"output {out!r} exists; --format dcp writes a new directory: "
                                "give a path that does not exist yet")
    elif out_path.is_dir():
        raise BadInputError(f"output {out!r} is a directory; give a file name, e.g. model.pt")
    if not out_path.parent.is_dir():
        raise BadInputError(f"output {out!r}: directory {str(out_path.parent)!r} does not "
                            "exist; create it first, or give a file in an existing directory")
    got_step, n = report.export(jd, out_path, step=step_n, fmt=fmt)
    note = report.export_note(jd, got_step, asked=step_n is not None)
    print(f"exported step {got_step} ({note}): {n} tensors -> {out_path}")


@app.command("peer", cls=CfrunCommand,
             help="Serve as a remote-memory checkpoint tier (ACUTE level 1) for cfrun --peer. "
                  "It holds checkpoints in RAM, flush them to --flush-to, serve them back "
                  "for a resume. Stops on SIGTERM or SIGINT after flushing what it holds.")
def peer_cmd(
    listen: Annotated[str, typer.Option(
        "--listen", metavar="HOST:PORT", envvar=E.PEER_LISTEN,
        help="HOST:PORT to listen on; only that address is bound (port 0: a free port, "
             "printed).")],
    flush_to: Annotated[str, typer.Option(
        "--flush-to", metavar="PATH|URL", envvar=E.PEER_FLUSH_TO,
        help="Level 2: a directory or fsspec URL (s3://bucket/prefix, gs://..., file://...) "
             "where checkpoints are flushed, FIFO.")],
    token_file: Annotated[str, typer.Option(
        "--token-file", metavar="PATH", envvar=E.PEER_TOKEN_FILE,
        help="File with the shared secret (>= 16 bytes, mode 600) that clients must prove.")],
    slots: Annotated[str, typer.Option(
        "--slots", metavar="INTEGER", envvar=E.PEER_SLOTS,
        help="Checkpoints held in RAM (a circular buffer).")] = "2",
    max_checkpoint_bytes: Annotated[str, typer.Option(
        "--max-checkpoint-bytes", metavar="SIZE", envvar=E.PEER_MAX_CHECKPOINT_BYTES,
        help="Largest checkpoint (all ranks) accepted, e.g. 8G; RAM use is at most slots "
             "times this. Default: half the RAM divided by --slots, at most 16G.")] = "auto",
    keep: Annotated[str, typer.Option(
        "--keep", metavar="INTEGER", envvar=E.PEER_KEEP,
        help="Flushed checkpoints kept per job at level 2.")] = "3",
) -> None:
    """Serve as a remote-memory checkpoint tier (ACUTE level 1) for `cfrun --peer`.

    Holds up to --slots checkpoints in RAM, received from all ranks in parallel and kept as
    received; flushes each complete one to --flush-to in arrival order; serves them back for a
    resume. Stops on SIGTERM/SIGINT after flushing what it holds.
    """
    from cfrun.peer.server import serve_main

    n_slots = parse_positive_int("--slots", slots, minimum=1)
    if max_checkpoint_bytes == "auto":
        import psutil

        max_bytes = min(16 << 30, psutil.virtual_memory().total // 2 // n_slots)
    else:
        max_bytes = parse_bytes("--max-checkpoint-bytes", max_checkpoint_bytes)
    peer_log = logging.getLogger("cfrun.peer.server")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s cfrun peer: %(message)s"))
    peer_log.addHandler(handler)
    peer_log.setLevel(logging.INFO)
    peer_log.propagate = False
    code = serve_main(listen, flush_to, token_file, slots=n_slots,
                      max_checkpoint_bytes=max_bytes,
                      keep=parse_positive_int("--keep", keep, minimum=1))
    raise typer.Exit(code)


def _run(cfg: RunConfig, *, accept_changed_command: bool = False, rerun: bool = False,
         retry: list[str] | None = None, python_command: str | None = None,
         default_job_dir: bool = False) -> None:
    """Run the job's supervisor and exit with its code. ``retry``: the command line that goes
    on with a refused changed command (the hint of :class:`ChangedCommandError`);
    ``python_command``: the one that runs it with ``--launcher python`` (the hint of a one-rank
    script that went distributed under torchrun); ``default_job_dir``: no ``--job-dir`` was
    given (a new one is removed again if the run trains nothing)."""
    from cfrun.supervisor.core import Supervisor

    # the node's identity names its config, lock, agent socket and slots
    # (cfrun.contract.settings.node_suffix)
    os.environ[E.NODE_RANK] = str(cfg.node_rank)
    os.environ[E.NNODES] = str(cfg.nnodes)
    log.info("cfrun %s: %s -> job dir %s (%s)", __version__, cfg.shown, cfg.job_dir,
             f"interval {cfg.interval}" if cfg.interval else f"overhead budget {cfg.overhead:.2%}")
    try:
        code = Supervisor(cfg, accept_changed_command=accept_changed_command, rerun=rerun,
                          python_command=python_command, default_job_dir=default_job_dir).run()
    except ChangedCommandError as e:
        if not retry:
            raise
        raise ChangedCommandError(str(e), hint="to go on from its checkpoints with the change: "
                                  f"{shlex.join(retry)}") from None
    raise typer.Exit(code)


def _refuse_dropped(run: Any, words: list[str]) -> None:
    """Refuse a torchrun option that has no meaning under cfrun (``--tee``, ``--log-dir``,
    ``-m``: :data:`cfrun.contract.cluster.DROPPED_TORCHRUN_OPTIONS`) among ``cfrun run``'s
    options, in one line naming it, before typer would call it unknown. The words after the
    script are the script's: never looked at.

    Raises:
        BadInputError: a dropped option before the script.
    """
    from cfrun.contract.cluster import check_dropped_option

    takes_value = {name for p in run.params if not getattr(p, "is_flag", True)
                   for name in (*p.opts, *p.secondary_opts)}
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] != "--":
        check_dropped_option(words[i])
        i += 2 if words[i] in takes_value else 1


def _module_words(command: Any, words: list[str]) -> list[str]:
    """``words`` (a job command's options, then SCRIPT and its arguments) with ``-mMODULE`` and
    ``--module=MODULE`` among the options split into ``-m MODULE`` (Python's and argparse's
    spellings; cfrun's ``-m``/``--module`` is a flag that makes SCRIPT a module name, as
    torchrun's is). The words after SCRIPT are the script's: never looked at."""
    takes_value = {name for p in command.params if not getattr(p, "is_flag", True)
                   for name in (*p.opts, *p.secondary_opts)}
    out = list(words)
    i = 0
    while i < len(out) and out[i].startswith("-") and out[i] != "--":
        word = out[i]
        if word.startswith("--module="):
            out[i:i + 1] = ["--module", word.split("=", 1)[1]]
            break  # the module's name is SCRIPT: the rest is its arguments
        if word.startswith("-m") and not word.startswith("--") and len(word) > 2:
            out[i:i + 1] = ["-m", word[2:]]
            break
        if word in ("-m", "--module"):
            break
        i += 2 if word in takes_value else 1
    return out


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``cfrun`` console script. Exits the process with cfrun's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    typed = list(args)  # as the user gave them (a hint repeats them)
    if not args or args[0] in HELP_OPTIONS:
        print(root_help(typer.main.get_command(app)), end="")
        sys.exit(0)
    if args[0] == "--version":
        print(f"cfrun {__version__}")
        sys.exit(0)
    if args[0] not in SUBCOMMANDS:
        args = ["run", *args]
    if args[0] not in JOB_COMMANDS:
        early_signals.release()  # no supervisor takes a held SIGTERM over: let it act now
    _setup_logging()
    command = typer.main.get_command(app)
    debug = False
    try:
        debug = E.get_flag(E.DEBUG)
        faults.check()
        if args[0] in ("run", "profile", "verify"):
            job_command = command.commands[args[0]]  # type: ignore[attr-defined]
            args = [args[0], *_module_words(job_command, args[1:])]
        if args[0] in ("run", "profile", "verify"):
            _refuse_dropped(command.commands[args[0]], args[1:])  # type: ignore[attr-defined]
        rc = command.main(args=args, prog_name="cfrun", standalone_mode=False,
                          obj={"argv": typed})
    except _EXIT as e:
        sys.exit(e.exit_code)  # type: ignore[attr-defined]
    except _USAGE as e:
        ctx = getattr(e, "ctx", None)
        where = ctx.command_path if ctx is not None and ctx.command_path != "cfrun run" \
            else "cfrun"
        message = e.format_message().rstrip(".")  # type: ignore[attr-defined]
        print(f"cfrun: error: {message}; see {where} --help", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except _ABORT:
        sys.exit(EXIT_BAD_INPUT)
    except CfrunError as e:
        if debug:
            raise
        print(f"cfrun: error: {e}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        sys.exit(e.exit_code)
    sys.exit(rc if isinstance(rc, int) else 0)  # typer returns Exit codes in this mode
