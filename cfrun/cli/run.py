"""``cfrun [run] SCRIPT [ARGS]...``: run a training script under cfrun's supervisor, which
checkpoints it and goes on from the newest checkpoint after a failure; a job dir with
checkpoints of the same command resumes by itself. Also how ``cfrun resume`` runs a job."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from typing import Annotated

import typer

from cfrun import __version__
from cfrun.cli.argv import python_launcher_line, run_retry
from cfrun.cli.launch import run_cluster
from cfrun.cli.logs import log, setup_logging_if_given
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
    ReshardOption,
    RetryBeforeFirstStepOption,
    ScriptArgsArgument,
    ScriptArgument,
    StandaloneOption,
    TotalStepsOption,
)
from cfrun.cli.runconfig import build_config, job_key_path
from cfrun.contract import settings as E
from cfrun.contract.config import RunConfig, parse_positive_int
from cfrun.contract.errors import ChangedCommandError

HELP = ("Run SCRIPT under torchrun with checkpoints every few optimizer steps, and go on from "
        "the newest one after a crash, a lost node or a SIGTERM. A job dir with checkpoints "
        "of the same command resumes by itself.")
"""``cfrun run --help``'s text, and the top of ``cfrun --help``."""

JobDirOption = Annotated[str | None, typer.Option(
    "--job-dir", metavar="PATH", envvar=E.JOB_DIR,
    help="Job directory (checkpoints, events, config). Default: "
         "./cfrun-jobs/<script name>-<hash of the script's path, its arguments, the ranks "
         "per node and the nodes>."
)]
JobNameOption = Annotated[str | None, typer.Option(
    "--job-name", metavar="NAME", envvar=E.JOB_NAME,
    help="The job's name at a peer and at level 2 (letters, digits, '.', '_', '-'); give "
         "the scheduler's job name where a changed command must find its checkpoints on "
         "a fresh node. Default: the job dir's name and a hash of its path and the "
         "command.")]
AcceptChangedCommandOption = Annotated[bool, typer.Option(
    "--accept-changed-command",
    help="Go on from the job dir's checkpoints although the script or its arguments "
         "changed (recorded as a command_changed event; another world size needs "
         "--reshard). Without it a changed command is refused (exit 2) where the job dir "
         "has a checkpoint, and taken where it has none.")]
RerunOption = Annotated[bool, typer.Option(
    "--rerun",
    help="Run a finished job's command again, from its newest checkpoint (the script's "
         "tail after it runs again). Without it a finished job says so and exits 0.")]
MetricsOption = Annotated[str | None, typer.Option(
    "--metrics", metavar="HOST:PORT", envvar=E.METRICS,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics, without authentication "
         "(bind 127.0.0.1, or a pod IP behind a NetworkPolicy; port 0: a free port). The "
         "job dir's metrics.prom is written either way.")]
DryRunOption = Annotated[bool, typer.Option(
    "--dry-run",
    help="Print the resolved settings (flags, CFRUN_* variables, PET_* and SLURM defaults), "
         "the launch command and what the job dir would do (new, resume from step N, "
         "finished, refused) as JSON, and exit without starting or writing anything."
)]
OverheadOption = Annotated[str, typer.Option(
    "--overhead", metavar="PERCENT", envvar=E.OVERHEAD,
    help="Overhead budget in percent: 3.5% and 3.5 both mean 3.5% (from 0.1% to below "
         "100%); ignored with --interval.")]
MtbfOption = Annotated[str | None, typer.Option(
    "--mtbf", metavar="DURATION", envvar=E.MTBF,
    help="Mean time between failures (e.g. 6h): never checkpoint more often than the "
         "Young/Daly optimum needs. Default: learned from this job's restarts.")]
InjectCrashOption = Annotated[str, typer.Option(
    "--inject-crash", metavar="STEP[@ATTEMPT],...", envvar=E.INJECT_CRASH,
    help="Testing aid: STEP[@ATTEMPT],... rank 0 SIGKILLs itself after that step.")]
PeerOption = Annotated[str | None, typer.Option(
    "--peer", metavar="HOST:PORT", envvar=E.PEER,
    help="HOST:PORT of a cfrun peer: checkpoints go to its RAM (protected), which "
         "flushes them to durable storage; the job dir takes them while it is down.")]
PeerTokenFileOption = Annotated[str | None, typer.Option(
    "--peer-token-file", metavar="PATH", envvar=E.PEER_TOKEN_FILE,
    help="File with the peer's shared secret (mode 600).")]
PeerStreamsOption = Annotated[str, typer.Option(
    "--peer-streams", metavar="INTEGER", envvar=E.PEER_STREAMS,
    help="Parallel connections per rank to the peer (1..64).")]
PersistToOption = Annotated[str | None, typer.Option(
    "--persist-to", metavar="PATH|URL", envvar=E.PERSIST_TO,
    help="Level-2 store (directory or URL such as s3://bucket/prefix) that a resume also "
         "searches: give the peer's --flush-to.")]
JobKeyFileOption = Annotated[str | None, typer.Option(
    "--job-key-file", metavar="PATH", envvar=E.JOB_KEY_FILE,
    help="A key of the job's own (64 hex digits, mode 600): its checkpoints at the peer "
         "and level 2 are sealed under it instead of the peer token, and only its seals "
         "are installed; give it on every machine. Default: a key derived from the peer "
         "token and the job's name (a new machine needs only the token).")]
NnodesOption = Annotated[str, typer.Option(
    "--nnodes", metavar="INTEGER", envvar=E.NNODES,
    help="Nodes in the job; run one cfrun per node with the same --job-dir on a shared "
         "file system (torchrun c10d rendezvous).")]
NodeRankOption = Annotated[str, typer.Option(
    "--node-rank", "--node_rank", metavar="INTEGER", envvar=E.NODE_RANK,
    help="This node's index, 0..nnodes-1.")]
RdzvEndpointOption = Annotated[str | None, typer.Option(
    "--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT", envvar=E.RDZV_ENDPOINT,
    help="HOST:PORT of the rendezvous (required with --nnodes > 1).")]
RdzvIdOption = Annotated[str | None, typer.Option(
    "--rdzv-id", "--rdzv_id", metavar="TEXT", envvar=E.RDZV_ID,
    help="Rendezvous id shared by the nodes (default: the job dir's name).")]


def run_cmd(
    ctx: typer.Context,
    script: ScriptArgument,
    script_args: ScriptArgsArgument = None,
    module: ModuleOption = False,
    job_dir: JobDirOption = None,
    job_name: JobNameOption = None,
    accept_changed_command: AcceptChangedCommandOption = False,
    rerun: RerunOption = False,
    reshard: ReshardOption = False,
    metrics: MetricsOption = None,
    dry_run: DryRunOption = False,
    log_format: LogFormatOption = "auto",
    interval: IntervalOption = None,
    overhead: OverheadOption = "3.5%",
    nproc_per_node: NprocPerNodeOption = "1",
    launcher: LauncherOption = "auto",
    max_restarts: MaxRestartsOption = "5",
    keep: KeepOption = "2",
    grace: GraceOption = "25",
    mtbf: MtbfOption = None,
    hang_timeout: HangTimeoutOption = "1800",
    crash_loop: CrashLoopOption = "3",
    retry_before_first_step: RetryBeforeFirstStepOption = False,
    total_steps: TotalStepsOption = None,
    inject_crash: InjectCrashOption = "",
    peer: PeerOption = None,
    peer_token_file: PeerTokenFileOption = None,
    peer_streams: PeerStreamsOption = "4",
    persist_to: PersistToOption = None,
    job_key_file: JobKeyFileOption = None,
    nnodes: NnodesOption = "1",
    node_rank: NodeRankOption = "0",
    rdzv_endpoint: RdzvEndpointOption = None,
    rdzv_id: RdzvIdOption = None,
    local_addr: LocalAddrOption = None,
    standalone: StandaloneOption = False,
    master_addr: MasterAddrOption = None,
    master_port: MasterPortOption = None,
    rdzv_backend: RdzvBackendOption = "c10d",
    rdzv_conf: RdzvConfOption = None,
) -> None:
    """Run SCRIPT under cfrun (resumes by itself if the job dir has checkpoints)."""
    setup_logging_if_given(ctx, log_format)  # main() set up CFRUN_LOG_FORMAT's already
    cluster = run_cluster(ctx, standalone=standalone, rdzv_backend=rdzv_backend,
                          master_addr=master_addr, master_port=master_port, nnodes=nnodes,
                          node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                          nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                          local_addr=local_addr)
    cfg = build_config(script, script_args, job_dir, interval, overhead, keep=keep, grace=grace,
                       mtbf=mtbf, hang_timeout=hang_timeout, crash_loop=crash_loop,
                       inject_crash=inject_crash, profile_only=False, peer=peer,
                       peer_token_file=peer_token_file, peer_streams=peer_streams,
                       persist_to=persist_to, job_name=job_name, launcher=launcher,
                       metrics=metrics, module=module, **cluster)
    cfg = dataclasses.replace(
        cfg, retry_before_first_step=retry_before_first_step,
        job_key_file=job_key_path(job_key_file), reshard=reshard,
        total_steps=parse_positive_int("--total-steps", total_steps, minimum=1)
        if total_steps is not None else None)
    if dry_run:
        _print_dry_run(cfg, accept_changed_command=accept_changed_command, rerun=rerun)
        return
    run_job(cfg, accept_changed_command=accept_changed_command, rerun=rerun,
            retry=run_retry(ctx), python_command=python_launcher_line(ctx),
            default_job_dir=job_dir is None)


def _print_dry_run(cfg: RunConfig, *, accept_changed_command: bool, rerun: bool) -> None:
    """``--dry-run``: the resolved config (without the environment, recorded at run time),
    the launch command and what the job dir would do, as one JSON object on stdout."""
    from cfrun.supervisor.admission import dry_run_outcome
    from cfrun.supervisor.launcher import build_launch_argv

    config = cfg.to_json()
    config.pop("env", None)  # the environment is recorded at run time, not shown here
    print(json.dumps({"config": config, "launch": build_launch_argv(cfg),
                      "job_dir": dry_run_outcome(
                          cfg, accept_changed_command=accept_changed_command,
                          rerun=rerun)}, indent=1))


def run_job(cfg: RunConfig, *, accept_changed_command: bool = False, rerun: bool = False,
            retry: list[str] | None = None, python_command: str | None = None,
            default_job_dir: bool = False) -> None:
    """Run the job's supervisor and exit with its code. ``retry``: the command line that goes
    on with a refused changed command (the hint of :class:`ChangedCommandError`);
    ``python_command``: the one that runs it with ``--launcher python`` (the hint of a one-rank
    script that went distributed under torchrun); ``default_job_dir``: no ``--job-dir`` was
    given (a new one is removed again if the run trains nothing).

    Raises:
        typer.Exit: always, with the supervisor's exit code.
        CfrunError: the supervisor refused the job or failed (:class:`ChangedCommandError`
            with the ``retry`` line as its hint).
    """
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
