"""A rank's failure before cfrun's runtime starts: recorded for the supervisor all the same.

cfrun's runtime installs itself when the script imports torch (:func:`cfrun.rank.install.arm`);
a script that fails before that (a ``SyntaxError``, an ``ImportError`` of a mistyped module, an
argparse usage error) would leave the supervisor no record of why, and it could not tell the
script's own failure, which will happen again, from a kill from outside. :func:`install`, armed
with the runtime's import watcher at interpreter start, records such a failure as the runtime
does (``errors/attempt-A-rank-R.json``, :class:`cfrun.contract.coordination.RankError`):

* an uncaught exception (``sys.excepthook``; a ``SyntaxError`` of the script itself included);
* argparse's usage error: ``ArgumentParser.exit(status, message)`` with a non-zero status
  (``prog: error: ...``, exit code 2), patched once argparse is imported, recorded as type
  ``SystemExit`` with argparse's message, before or after torch is imported.

The supervisor names the failure with it (:func:`cfrun.supervisor.machine.describe_error`) and
does not restart one that happens before the first optimizer step
(:func:`cfrun.supervisor.machine.decide`). Imports nothing at interpreter start beyond what it
needs to install; a failure to record is silent (the script's own error is what matters).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any


def _step() -> int | None:
    """Optimizer steps this rank completed, or None before cfrun's runtime started."""
    install = sys.modules.get("cfrun.rank.install")
    runtime = getattr(install, "_runtime", None)
    step = getattr(runtime, "step", None) if runtime is not None else None
    return step if isinstance(step, int) and step >= 0 else None


def record(type_name: str, message: str, lines: list[str]) -> None:
    """Write this rank's error record unless one exists (the runtime's own excepthook wrote
    it); only in the rank's own process (``CFRUN_HOOK_OWNER_PID``, set by the hook). Never
    raises."""
    try:
        from cfrun.contract import coordination as co
        from cfrun.contract.settings import HOOK_OWNER_PID
        from cfrun.rank.settings import RankSettings

        if os.environ.get(HOOK_OWNER_PID) != str(os.getpid()):
            return  # a forked child of the rank (its hooks inherited): not the rank's failure

        s = RankSettings.from_env()
        path = co.error_path(s.job_dir, s.attempt, s.rank)
        if co.exists(path):
            return
        co.write(path, co.RankError(type=type_name, message=message[:co.MAX_MESSAGE_CHARS],
                                    step=_step(), t_unix_s=time.time(),
                                    traceback=lines[-co.MAX_TRACEBACK_LINES:]),
                 make_dir=True)
    except Exception:
        pass


def _excepthook(orig: Any) -> Any:
    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if exc_type is not SystemExit:
                record(exc_type.__name__, str(exc),
                       traceback.format_exception(exc_type, exc, tb))
        finally:
            orig(exc_type, exc, tb)

    return excepthook


def patch_argparse(argparse: Any) -> None:
    """Record argparse's usage errors (``ArgumentParser.exit`` with a non-zero status and a
    message): the message's last line, e.g. ``train.py: error: argument --lr: invalid float
    value: 'x'``."""
    parser = argparse.ArgumentParser
    orig = parser.exit

    def exit(self: Any, status: int = 0, message: str | None = None) -> Any:
        if status and message:
            lines = [line for line in message.splitlines() if line.strip()]
            record("SystemExit", lines[-1] if lines else message, lines)
        return orig(self, status, message)

    parser.exit = exit


_installed = False


def install() -> None:
    """Arm the records (rank processes only, at interpreter start; idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    from cfrun.rank.importwatch import when_imported

    sys.excepthook = _excepthook(sys.excepthook)
    when_imported("argparse", lambda: patch_argparse(sys.modules["argparse"]))
