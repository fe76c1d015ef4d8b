"""The words of a ``cfrun`` command line as the user typed them: the options before SCRIPT
read as cfrun reads them (``-mMODULE`` spelled out, torchrun options that mean nothing under
cfrun refused), and the lines a hint repeats them in. The words after SCRIPT are the
script's: never looked at."""

from __future__ import annotations

import shlex
from typing import Any


def _takes_value(command: Any) -> set[str]:
    """The option names of ``command`` (a click command) that take a value."""
    return {name for p in command.params if not getattr(p, "is_flag", True)
            for name in (*p.opts, *p.secondary_opts)}


def refuse_dropped(run: Any, words: list[str]) -> None:
    """Refuse a torchrun option that has no meaning under cfrun (``--tee``, ``--log-dir``,
    ``-m``: :data:`cfrun.contract.cluster.DROPPED_TORCHRUN_OPTIONS`) among ``cfrun run``'s
    options, in one line naming it, before typer would call it unknown. The words after the
    script are the script's: never looked at.

    Raises:
        BadInputError: a dropped option before the script.
    """
    from cfrun.contract.cluster import check_dropped_option

    takes_value = _takes_value(run)
    i = 0
    while i < len(words) and words[i].startswith("-") and words[i] != "--":
        check_dropped_option(words[i])
        i += 2 if words[i] in takes_value else 1


def module_words(command: Any, words: list[str]) -> list[str]:
    """``words`` (a job command's options, then SCRIPT and its arguments) with ``-mMODULE`` and
    ``--module=MODULE`` among the options split into ``-m MODULE`` (Python's and argparse's
    spellings; cfrun's ``-m``/``--module`` is a flag that makes SCRIPT a module name, as
    torchrun's is). The words after SCRIPT are the script's: never looked at."""
    takes_value = _takes_value(command)
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


def run_retry(ctx: Any) -> list[str]:
    """The command line that gives this ``cfrun [run] ...`` again with
    ``--accept-changed-command`` (the hint of a refused changed command): the words as typed
    (:func:`cfrun.cli.app.main` keeps them in ``ctx.obj``), the flag before the script; empty
    (no hint) where they are not known (the command run without ``main``)."""
    typed = list((ctx.obj or {}).get("argv") or [])
    if not typed:
        return []
    lead = ["cfrun", "run"] if typed[:1] == ["run"] else ["cfrun"]
    return [*lead, "--accept-changed-command", *typed[len(lead) - 1:]]


def python_launcher_line(ctx: Any) -> str | None:
    """This ``cfrun [run|profile|verify] ...`` as typed, with ``--launcher python`` in place of
    any ``--launcher`` given: the hint of a one-rank script that went distributed because
    torchrun set ``RANK`` (:func:`cfrun.supervisor.machine.went_distributed`). None where the
    words are not known (the command run without :func:`cfrun.cli.app.main`)."""
    typed = list((ctx.obj or {}).get("argv") or [])
    if not typed:
        return None
    lead = ["cfrun", typed[0]] if typed[0] in ("run", "profile", "verify") else ["cfrun"]
    words = typed[len(lead) - 1:]
    takes_value = _takes_value(ctx.command)
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
