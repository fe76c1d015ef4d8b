"""torchrun with its own log in the job dir: ``python -m cfrun.supervisor.torchrun_log LOG MODULE
ARGS...``.

Runs ``python -m MODULE ARGS...`` (``torch.distributed.run``) in this process with Python's
``sys.stderr`` appended to ``LOG`` (``logs/attempt-N.log``). Everything torchrun itself writes
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


def read_rank_exits(path: str) -> list[tuple[int, int]]:
    """:func:`rank_exits` of the log at ``path`` (its last :data:`MAX_LOG_READ_BYTES`); empty
    when it is missing or unreadable. Never follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, MAX_LOG_READ_BYTES, max(0, size - MAX_LOG_READ_BYTES))
    except OSError:
        return []
    finally:
        os.close(fd)
    return rank_exits(data.decode("utf-8", "replace"))


def describe_rank_exit(rank: int, exitcode: int) -> str:
    """``rank 1 killed by SIGKILL`` or ``rank 0 exit code 3``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"rank {rank} killed by {name}"
    return f"rank {rank} exit code {exitcode}"


def main(argv: list[str]) -> None:
    """Entry point (the torchrun process of one attempt). ``argv``: ``LOG MODULE ARGS...``."""
    import runpy

    log_path, module, *args = argv
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    sys.stderr = open(fd, "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    sys.argv = [module, *args]
    try:
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
