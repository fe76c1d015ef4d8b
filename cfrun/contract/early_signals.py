"""SIGTERM/SIGINT/SIGHUP held from cfrun's first line until the supervisor takes them over.

A scheduler may stop cfrun at any moment, also in the second it spends importing typer and
checking the job dir before the supervisor installs its handlers (:class:`Supervisor.run`).
Without a handler the default action kills cfrun with -15 and no stop is reported: the job
then looks crashed, not preempted. So the entry points (``cfrun/__main__.py``,
``cfrun.cli.app.main`` via the console script) call :func:`hold` before any heavy import; a
signal in that window is remembered, and either the supervisor takes it (:func:`take`, then it
stops as for a signal during the run: exit 75, nothing started, nothing lost) or, for the
commands that run no job, :func:`release` delivers it again with the handlers restored.

Only the main thread of the cfrun process calls these.
"""

from __future__ import annotations

import os
import signal
from collections.abc import MutableMapping
from typing import Any

HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The supervisor's stop signals (:func:`cfrun.supervisor.signals.stop_signals`); SIGHUP not when
cfrun is PID 1, where the supervisor forwards it to the ranks."""
_pending: list[int] = []
_previous: dict[int, Any] = {}


def _remember(signum: int, frame: Any) -> None:
    _pending.append(signum)


def hold() -> None:
    """Remember SIGTERM/SIGINT/SIGHUP instead of dying from them. Idempotent; main thread
    only."""
    if _previous:
        return
    for s in HELD:
        if s == signal.SIGHUP and os.getpid() == 1:
            continue
        _previous[s] = signal.signal(s, _remember)


def take(replaced: MutableMapping[Any, Any]) -> int | None:
    """For the supervisor, right after it installed its own handlers: the first signal that
    arrived while held (its number), or None. ``replaced`` (signal -> the handler the
    supervisor replaced, which it restores when it ends) is rewritten in place to name the
    handlers from before :func:`hold`, so after the supervisor nothing is held any more."""
    signum = _pending[0] if _pending else None
    _pending.clear()
    for s, h in _previous.items():
        if replaced.get(s) is _remember:
            replaced[s] = h
    _previous.clear()
    return signum


def release() -> None:
    """For the commands that run no job (``status``, ``ls``, ...): put back the handlers
    :func:`hold` replaced and deliver a held signal again, so it acts as it would have."""
    signums = list(_pending)
    _pending.clear()
    for s, h in _previous.items():
        signal.signal(s, h)
    _previous.clear()
    for s in signums[:1]:
        os.kill(os.getpid(), s)
