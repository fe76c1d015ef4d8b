"""The ``cfrun`` command line (typer).

``cfrun [OPTIONS] SCRIPT [ARGS]...`` runs a training script under cfrun; it is short for
``cfrun run``. Everything after SCRIPT goes to the script untouched, even words that look like
cfrun options. Every option can also be set by the environment variable shown in ``--help``;
a flag wins over the environment.

Errors in what the user gave are one line, ``cfrun: error: ...``, plus a hint, and a distinct
exit code (README, "Exit codes"); nothing is created or changed before the input is valid.

This module holds the one typer app, its commands in the order ``cfrun --help`` lists them
(each in a module of its own: :mod:`cfrun.cli.run`, :mod:`~cfrun.cli.profile`,
:mod:`~cfrun.cli.verify`, :mod:`~cfrun.cli.resume`, :mod:`~cfrun.cli.status`,
:mod:`~cfrun.cli.ls`, :mod:`~cfrun.cli.export`, :mod:`~cfrun.cli.peer`) and :func:`main`,
which dispatches a command line to them and maps errors to exit codes.
"""

from __future__ import annotations

import sys

import typer

from cfrun import __version__
from cfrun.cli import export, ls, peer, profile, resume, run, status, verify
from cfrun.cli.argv import module_words, refuse_dropped
from cfrun.cli.helpfmt import HELP_OPTIONS, CfrunCommand, root_help
from cfrun.cli.logs import setup_logging
from cfrun.contract import early_signals, faults
from cfrun.contract import settings as E
from cfrun.contract.errors import EXIT_BAD_INPUT, CfrunError

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

_SCRIPT_FIRST = {"allow_interspersed_args": False}
"""A job command's options come before SCRIPT; every word after it is the script's."""

# in this order in `cfrun --help`
app.command("run", cls=CfrunCommand,
            hidden=True,  # `cfrun SCRIPT` is the documented spelling; `cfrun run SCRIPT` works too
            context_settings=_SCRIPT_FIRST, help=run.HELP)(run.run_cmd)
app.command("profile", cls=CfrunCommand, context_settings=_SCRIPT_FIRST,
            help=profile.HELP)(profile.profile_cmd)
app.command("verify", cls=CfrunCommand, context_settings=_SCRIPT_FIRST,
            help=verify.HELP)(verify.verify_cmd)
app.command("resume", cls=CfrunCommand, help=resume.HELP)(resume.resume_cmd)
app.command("status", cls=CfrunCommand, help=status.HELP)(status.status_cmd)
app.command("ls", cls=CfrunCommand, help=ls.HELP)(ls.ls_cmd)
app.command("export", cls=CfrunCommand, help=export.HELP)(export.export_cmd)
app.command("peer", cls=CfrunCommand, help=peer.HELP)(peer.peer_cmd)

SUBCOMMANDS = {"run", "resume", "profile", "verify", "status", "ls", "export", "peer"}
JOB_COMMANDS = {"run", "resume", "profile", "verify"}
"""The commands whose supervisor takes over a SIGTERM/SIGINT held since the first line."""


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
    setup_logging()
    command = typer.main.get_command(app)
    debug = False
    try:
        debug = E.get_flag(E.DEBUG)
        faults.check()
        if args[0] in ("run", "profile", "verify"):
            job_command = command.commands[args[0]]  # type: ignore[attr-defined]
            args = [args[0], *module_words(job_command, args[1:])]
        if args[0] in ("run", "profile", "verify"):
            refuse_dropped(command.commands[args[0]], args[1:])  # type: ignore[attr-defined]
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
