"""torchrun with its own log in the job dir: ``python -m cfrun.supervisor.torchrun_log LOG MODULE
ARGS...``.

Runs ``python -m MODULE ARGS...`` (``torch.distributed.run``) in this process with Python's
``sys.stderr`` appended to ``LOG`` (``logs/attempt-N.log``; ``-``: left as it is).

torchrun's own parser never sees the script's arguments (:func:`run_torchrun`): argparse takes
any option of the script that abbreviates one of torchrun's (``--d 3``: ambiguous between
``--duplicate-stdout-filters`` and ``--duplicate-stderr-filters``, exit 2; ``--nproc 7``: taken
as torchrun's ``--nproc-per-node``), so only torchrun's options and the script are parsed, and
the script's arguments are handed to the ranks as given. Everything torchrun itself writes
through Python (its warnings, its log records, the ``ChildFailedError`` report and traceback
when a rank fails) lands there, while the ranks it starts inherit file descriptors 1 and 2
unchanged, so the script's own output reaches the console exactly as without cfrun. The
supervisor then reads the report to name the failing rank and how it died
(:func:`rank_exits`), and prints one line per restart instead of torchrun's ~30 lines.

This module imports nothing from torch at the top: the supervisor (torch-free) imports
:func:`rank_exits` from it.
"""

from __future__ import annotations

import os
import re
import signal
import sys

MAX_LOG_READ_BYTES = 1 << 20
"""The tail of an attempt's log read for its failure report (the report is its last lines)."""

_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def rank_exits(log_text: str) -> list[tuple[int, int]]:
    """``(rank, exitcode)`` of every failed rank in torchrun's ``ChildFailedError`` report, in
    the report's order (``Failures`` first, then the ``Root Cause``); a negative exitcode is the
    signal that killed the rank (``-9``: SIGKILL). Empty when the text holds no report."""
    return [(int(rank), int(code)) for rank, code in _ROOT_CAUSE.findall(log_text)]


def read_log_tail(path: str) -> str:
    """The last :data:`MAX_LOG_READ_BYTES` of the attempt's log at ``path``; empty when it is
    missing or unreadable. Never follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, MAX_LOG_READ_BYTES, max(0, size - MAX_LOG_READ_BYTES))
    except OSError:
        return ""
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace")


def read_rank_exits(path: str) -> list[tuple[int, int]]:
    """:func:`rank_exits` of the log at ``path`` (its tail, :func:`read_log_tail`)."""
    return rank_exits(read_log_tail(path))


def read_usage_error(path: str) -> str | None:
    """The last ``error:`` line in the attempt's log at ``path`` (torchrun's own argparse usage
    error, ``run.py: error: ...``), else None."""
    lines = [line.strip() for line in read_log_tail(path).splitlines() if ": error: " in line]
    return lines[-1] if lines else None


def describe_rank_exit(rank: int, exitcode: int) -> str:
    """``rank 1 killed by SIGKILL`` or ``rank 0 exit code 3``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} killed by {name}"
    return f"rank {rank} exit code {exitcode}"


TORCHRUN = "torch.distributed.run"


def split_script(args: list[str]) -> tuple[list[str], list[str]]:
    """``(torchrun's options + SCRIPT, the script's arguments)`` of a torchrun command line
    built by :func:`cfrun.supervisor.launcher.build_torchrun_argv`, which writes each of
    torchrun's options as one word (``--nproc-per-node=2``): the first word that is no option
    is the script. Pure."""
    for i, word in enumerate(args):
        if not word.startswith("-"):
            return args[:i + 1], args[i + 1:]
    return args, []


def run_torchrun(args: list[str]) -> None:
    """torchrun's ``main`` (its error report included: ``record``) on ``args``, with its parser
    given only its own options and the script (:func:`split_script`): the script's arguments
    reach the ranks' ``sys.argv`` exactly as the user typed them."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import record

    own, script_args = split_script(args)
    sys.argv = [torchrun.__file__, *args]
    parsed = torchrun.parse_args(own)
    parsed.training_script_args = script_args
    record(torchrun.run)(parsed)


def main(argv: list[str]) -> None:
    """Entry point (the torchrun process of one attempt). ``argv``: ``LOG MODULE ARGS...``;
    ``LOG`` ``-`` leaves stderr as it is (cfrun verify's plain run)."""
    import runpy

    log_path, module, *args = argv
    if log_path != "-":
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        sys.stderr = open(fd, "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                          errors="replace")
    sys.argv = [module, *args]
    try:
        if module == TORCHRUN:
            run_torchrun(args)
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        quick_exit(exit_status(e.code))
    except Exception:
        sys.excepthook(*sys.exc_info())  # the report and traceback, as an uncaught exception
        quick_exit(1)
    quick_exit(0)


def exit_status(code: object) -> int:
    """The process status ``sys.exit(code)`` gives: None 0, an int itself, anything else printed
    to stderr and 1 (as the interpreter does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def quick_exit(status: int) -> None:
    """Run the atexit handlers, flush, and leave without the interpreter's teardown of torch's
    modules: that took 0.3-1.6 s after torchrun was done, on the path from a rank's failure to
    the supervisor's restart (bench/recovery.py, ``detect``)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
