"""Arguments and options that several commands share (``cfrun run``, ``profile``,
``verify``, ``resume``): one typer definition each, so every command takes them with the same
names, environment variables, metavars and help."""

from __future__ import annotations

from typing import Annotated

import typer

from cfrun.contract import settings as E

ScriptArgument = Annotated[str, typer.Argument(
    metavar="SCRIPT", help="The training script, run unchanged (a module name with -m).")]

ModuleOption = Annotated[bool, typer.Option(
    "--module", "-m",
    help="SCRIPT is a module name, run as python -m SCRIPT runs it (torchrun's -m): the "
         "working directory first on sys.path, a package's __main__; its file is recorded "
         "and hashed like a script's.")]

ScriptArgsArgument = Annotated[list[str] | None, typer.Argument(
    metavar="[ARGS]...", help="Arguments for the script, passed through untouched.")]

LogFormatOption = Annotated[str, typer.Option(
    "--log-format", metavar="[auto|text|json]", envvar=E.LOG_FORMAT,
    help="cfrun's own log lines: auto (rich on a terminal, text elsewhere), text (one line "
         "per record, never wrapped) or json (JSON lines).")]

IntervalOption = Annotated[str | None, typer.Option(
    "--interval", metavar="INTEGER", envvar=E.INTERVAL,
    help="Checkpoint every K optimizer steps (turns the overhead policy off).")]

NprocPerNodeOption = Annotated[str, typer.Option(
    "--nproc-per-node", "--nproc_per_node", metavar="INTEGER", envvar=E.NPROC_PER_NODE,
    help="Ranks on this node (torchrun).")]

LauncherOption = Annotated[str, typer.Option(
    "--launcher", metavar="[auto|local|torchrun|python]", envvar=E.LAUNCHER,
    help="auto (default): local on one node, torchrun on several. local: cfrun starts the "
         "node's ranks itself with the variables torchrun --standalone sets (RANK, "
         "WORLD_SIZE, MASTER_*) and restarts them from warm spares. torchrun: every attempt "
         "under torchrun. python: as local, but one rank runs as python SCRIPT would, "
         "without RANK, WORLD_SIZE or MASTER_*."
)]

TotalStepsOption = Annotated[str | None, typer.Option(
    "--total-steps", metavar="INTEGER", envvar=E.TOTAL_STEPS,
    help="The optimizer step the run ends at: gives cfrun status and the progress line a "
         "total and an ETA. Default: the epoch loop's length, or a step loop's bound (while "
         "it < n, if it > max_iters: break), where cfrun can read it.")]

MaxRestartsOption = Annotated[str, typer.Option(
    "--max-restarts", "--max_restarts", metavar="INTEGER", envvar=E.MAX_RESTARTS,
    help="Restarts after failures before giving up (exit code 4).")]

KeepOption = Annotated[str, typer.Option(
    "--keep", metavar="INTEGER", envvar=E.KEEP, help="Committed checkpoints to keep.")]

GraceOption = Annotated[str, typer.Option(
    "--grace", metavar="DURATION", envvar=E.GRACE,
    help="Time the ranks get after SIGTERM before SIGKILL: seconds, or 30s, 2m.")]

HangTimeoutOption = Annotated[str, typer.Option(
    "--hang-timeout", metavar="DURATION", envvar=E.HANG_TIMEOUT,
    help="Time without an optimizer step before a rank counts as hung and the job "
         "restarts: seconds, or 30m, 1h (0: off).")]

CrashLoopOption = Annotated[str, typer.Option(
    "--crash-loop", metavar="INTEGER", envvar=E.CRASH_LOOP,
    help="Stop (exit 5) after the same failure at the same step this many times in a row "
         "(0: off).")]

ReshardOption = Annotated[bool, typer.Option(
    "--reshard", envvar=E.RESHARD,
    help="Go on from checkpoints written by another number of ranks or nodes: replicated state "
         "from any rank, sharded (FSDP2, TP) state resharded to the new mesh, the data "
         "position mapped by global samples. Not bit-exact (a resharded event says from and "
         "to). Without it such a resume is refused (exit 5).")]

RetryBeforeFirstStepOption = Annotated[bool, typer.Option(
    "--retry-before-first-step", envvar=E.RETRY_BEFORE_FIRST_STEP,
    help="Restart a failure before the first optimizer step like any other (a data mount "
         "that comes up late). Without it such a failure (a SyntaxError, an ImportError, a "
         "usage error) stops the job the second time in a row (exit 5).")]

LocalAddrOption = Annotated[str | None, typer.Option(
    "--local-addr", "--local_addr", metavar="ADDRESS", envvar=E.LOCAL_ADDR,
    help="This node's address for the rendezvous and the ranks' store (torchrun "
         "--local-addr), where the host name does not resolve to it.")]

StandaloneOption = Annotated[bool, typer.Option(
    "--standalone",
    help="torchrun's one-node rendezvous: what cfrun does on one node anyway (accepted so a "
         "torchrun command line pastes).")]

MasterAddrOption = Annotated[str | None, typer.Option(
    "--master-addr", "--master_addr", metavar="HOST",
    help="torchrun's static rendezvous host: with --nnodes > 1 and no --rdzv-endpoint, the "
         "rendezvous is at HOST:--master-port; on one node cfrun picks a free port itself.")]

MasterPortOption = Annotated[str | None, typer.Option(
    "--master-port", "--master_port", metavar="PORT",
    help="torchrun's static rendezvous port (default 29500), with --master-addr; on one node "
         "not used (cfrun picks a free port at each attempt).")]

RdzvBackendOption = Annotated[str, typer.Option(
    "--rdzv-backend", "--rdzv_backend", metavar="[c10d|static]",
    help="torchrun's rendezvous backend: cfrun always uses c10d at the rendezvous endpoint "
         "(static's node ranks are kept: --node-rank).")]

RdzvConfOption = Annotated[str | None, typer.Option(
    "--rdzv-conf", "--rdzv_conf", metavar="KEY=VALUE,...",
    help="torchrun's rendezvous settings: accepted and not used (cfrun sets is_host itself; "
         "its timeouts are torchrun's defaults).")]
