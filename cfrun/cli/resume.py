"""``cfrun resume JOB_DIR``: continue a job with the command, options, working directory and
environment knobs its job dir recorded (config.json), read as data: nothing in it may choose
code to run."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from cfrun.cli.options import ReshardOption
from cfrun.cli.recorded_env import resumable_env
from cfrun.cli.run import run_job
from cfrun.contract import settings as E
from cfrun.contract.config import (
    URL_PASSWORD_WITHHELD,
    RunConfig,
    parse_positive_int,
    redact_url,
    resume_command,
)
from cfrun.contract.errors import BadInputError

HELP = ("Continue a stopped, failed or preempted job with the command, options and "
        "working directory recorded in its job dir (config.json); only --node-rank, "
        "and with --reshard another --nproc-per-node or --nnodes, are taken from "
        "this command line.")
"""``cfrun resume --help``'s text."""


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
    reshard: ReshardOption = False,
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
    from cfrun.contract.errors import JobDirLockedError
    from cfrun.contract.jobdir import JobDir

    jd = Path(job_dir).expanduser().absolute()
    node = parse_positive_int("--node-rank", node_rank, minimum=0)
    os.environ[E.NODE_RANK] = str(node)
    cfg, cfg_path = _recorded_config(job_dir, jd)
    cfg = dataclasses.replace(cfg, job_dir=str(jd), reshard=reshard)
    if nproc_per_node is not None or nnodes is not None:  # another world size: --reshard's
        cfg = dataclasses.replace(
            cfg, nproc_per_node=cfg.nproc_per_node if nproc_per_node is None
            else parse_positive_int("--nproc-per-node", nproc_per_node, minimum=1),
            nnodes=cfg.nnodes if nnodes is None
            else parse_positive_int("--nnodes", nnodes, minimum=1))
    if JobDir(jd).is_locked():
        raise JobDirLockedError(f"job dir {str(jd)!r} is in use by another cfrun")
    _set_recorded_env(cfg, cfg_path)
    cfg = _persist_to_again(cfg, jd, node)
    cfg = _metrics_again(cfg, cfg_path, jd, node)
    # what config.json chooses besides the command, in sight before anything runs
    shown = ["-m", cfg.module] if cfg.module else [cfg.script]
    print(f"cfrun: resuming: {shlex.join([*shown, *cfg.script_args])} in {cfg.cwd} "
          f"(job dir {jd}, {cfg.nproc_per_node} rank(s) per node, persist-to "
          f"{redact_url(cfg.persist_to) or 'none'}, peer {cfg.peer or 'none'})",
          file=sys.stderr, flush=True)
    retry = resume_command(jd, node, "--accept-changed-command", *(["--rerun"] if rerun else []))
    run_job(cfg, accept_changed_command=accept_changed_command, rerun=rerun,
            retry=shlex.split(retry))


def _recorded_config(job_dir: str, jd: Path) -> tuple[RunConfig, Path]:
    """The config this node's run recorded in the job dir ``jd`` (``job_dir`` as given), with
    its script found again (a module as the ranks' ``python -m`` finds it), and its path.

    Raises:
        BadInputError: no such job dir or config, an unreadable config, or its working
            directory, script or module gone.
    """
    from cfrun.contract.jobdir import JobDir
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
    return cfg, cfg_path


def _set_recorded_env(cfg: RunConfig, cfg_path: Path) -> None:
    """Set the recorded knobs (:func:`cfrun.cli.recorded_env.resumable_env`) that the current
    environment lacks; one warning line names the variables refused, one note the withheld
    credentials not set now."""
    env, refused, withheld = resumable_env(cfg.env)
    if refused:
        print(f"cfrun: warning: ignoring {', '.join(refused)} recorded in {cfg_path}: cfrun "
              "resume never takes interpreter or loader variables, paths or addresses from a "
              "job dir", file=sys.stderr)
    missing = [k for k in withheld if k not in os.environ]
    if missing:
        print(f"cfrun: note: {', '.join(missing)} looked like credentials and were not "
              "recorded; set them again if the job needs them", file=sys.stderr)
    for k, v in env.items():
        os.environ.setdefault(k, v)


def _persist_to_again(cfg: RunConfig, jd: Path, node: int) -> RunConfig:
    """``cfg`` with a ``--persist-to`` URL whose password was withheld from config.json taken
    again from ``CFRUN_PERSIST_TO``.

    Raises:
        BadInputError: the password was withheld and ``CFRUN_PERSIST_TO`` is not set.
    """
    if cfg.persist_to and URL_PASSWORD_WITHHELD in cfg.persist_to:
        given = os.environ.get(E.PERSIST_TO)
        if not given:
            raise BadInputError(f"the recorded --persist-to {cfg.persist_to!r} held a password, "
                                f"which cfrun does not record; give the URL again: "
                                f"{E.PERSIST_TO}=URL {resume_command(jd, node)}")
        cfg = dataclasses.replace(cfg, persist_to=given)
    return cfg


def _is_loopback(host: str) -> bool:
    """True for ``localhost`` and a loopback IP address (``127.0.0.0/8``, ``::1``)."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _metrics_again(cfg: RunConfig, cfg_path: Path, jd: Path, node: int) -> RunConfig:
    """``cfg`` with a recorded ``--metrics`` address kept only if it is a loopback one: a
    job dir must not open a port to the network (``0.0.0.0:9100`` in an edited config.json,
    issue 32, finding 6). Another address is dropped with one warning line, unless
    ``CFRUN_METRICS`` gives an address now (the user's choice, used as given)."""
    from cfrun.peer.protocol import parse_address

    given = os.environ.get(E.METRICS)
    if given:
        parse_address(given, option=E.METRICS)
        return dataclasses.replace(cfg, metrics=given)
    if cfg.metrics is None:
        return cfg
    try:
        host, _ = parse_address(str(cfg.metrics), option="--metrics")
    except BadInputError:
        host = ""
    if host and _is_loopback(host):
        return cfg
    print(f"cfrun: warning: not serving metrics on {str(cfg.metrics)!r} as {cfg_path} "
          f"records (not a loopback address); give it again if wanted: "
          f"{E.METRICS}=HOST:PORT {resume_command(jd, node)}", file=sys.stderr)
    return dataclasses.replace(cfg, metrics=None)
