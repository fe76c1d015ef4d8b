"""Help text for the ``cfrun`` command line, laid out as torchrun's and click's are.

typer's own layout writes required arguments as ``{script}`` and every value type as ``<str>``;
cfrun parses its values itself (one-line errors naming the value and the fix), so the type a
user must give is the metavar each option declares (``INTEGER``, ``PERCENT``, ``DURATION``...).
:class:`CfrunCommand` writes a command's help with click's ``HelpFormatter`` from
those metavars; :func:`root_help` writes ``cfrun --help``: the run options (``cfrun SCRIPT`` is
``cfrun run SCRIPT``) and the subcommands.
"""

from __future__ import annotations

import importlib
from typing import Any

import typer.core

# typer >= 0.22 vendors click as typer._click (its commands derive from that copy); older typer
# uses click itself.
_click: Any = getattr(typer.core, "_click", None) or importlib.import_module("click")

HELP_OPTIONS = ["-h", "--help"]
"""torchrun and most tools take both."""

_VERSION_RECORD = ("--version", "Show cfrun's version and exit.")


def _records(command: Any, ctx: Any) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(argument records, option records) of ``command``: (term, help) pairs for ``write_dl``."""
    arguments: list[tuple[str, str]] = []
    options: list[tuple[str, str]] = []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        help_text = " ".join((getattr(param, "help", None) or "").split())
        if isinstance(param, typer.core.TyperArgument):
            arguments.append((param.metavar or (param.name or "").upper(), help_text))
            continue
        if not isinstance(param, typer.core.TyperOption):
            continue
        opts = sorted(param.opts, key=lambda o: not o.startswith("-") or o.startswith("--"))
        names = ", ".join([*opts, *param.secondary_opts])
        term = names if param.is_flag else f"{names} {param.metavar or 'TEXT'}"
        extra = []
        if param.envvar:
            extra.append(f"env var: {param.envvar}")
        if param.default not in (None, False, "", ()) and not param.is_flag:
            extra.append(f"default: {param.default}")
        if param.required:
            extra.append("required")
        if extra:
            help_text = f"{help_text}  [{'; '.join(extra)}]".strip()
        options.append((term, help_text))
    return arguments, options


def _usage_pieces(command: Any, ctx: Any) -> list[str]:
    pieces = ["[OPTIONS]"]
    for param in command.get_params(ctx):
        if isinstance(param, typer.core.TyperArgument):
            pieces.append(param.metavar or (param.name or "").upper())
    return pieces


def write_help(command: Any, ctx: Any, formatter: Any,
               *, prog: str, extra_options: list[tuple[str, str]] | None = None,
               extra_usage: list[str] | None = None) -> None:
    """Write ``command``'s help into ``formatter``: usage, its text, arguments, options."""
    formatter.write_usage(prog, " ".join(_usage_pieces(command, ctx)))
    for line in extra_usage or []:
        formatter.write_text(line)
    if command.help:
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text(" ".join(command.help.split()))
    arguments, options = _records(command, ctx)
    if arguments:
        with formatter.section("Arguments"):
            formatter.write_dl(arguments)
    with formatter.section("Options"):
        formatter.write_dl(options + (extra_options or []))


class CfrunCommand(typer.core.TyperCommand):
    """A typer command whose ``--help`` is laid out by :func:`write_help` (metavars as types,
    no markup, required arguments in capitals without braces)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        write_help(self, ctx, formatter, prog=ctx.command_path)


def _summary(help_text: str) -> str:
    """A command's first sentence, whole (click's short help cuts it at a width)."""
    text = " ".join(help_text.split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def root_help(group: Any, width: int | None = None) -> str:
    """The text of ``cfrun --help``: the run command's usage and options under the name
    ``cfrun``, ``--version``, and the subcommands with their one-line summaries."""
    run = group.commands["run"]
    ctx = _click.Context(run, info_name="cfrun", help_option_names=HELP_OPTIONS)
    formatter = _click.HelpFormatter(width=width)
    write_help(run, ctx, formatter, prog="cfrun",
               extra_usage=["   or: cfrun COMMAND [ARGS]..."],
               extra_options=[_VERSION_RECORD])
    with formatter.section("Commands"):
        formatter.write_dl([("run", "cfrun run SCRIPT [ARGS]... is cfrun SCRIPT [ARGS]... "
                                    "(above), spelled out.")]
                           + [(name, _summary(cmd.help or ""))
                              for name, cmd in group.commands.items() if not cmd.hidden])
    formatter.write_paragraph()
    formatter.write_text("Everything after SCRIPT goes to the script untouched. cfrun COMMAND "
                         "--help shows a command's options.")
    return formatter.getvalue()
