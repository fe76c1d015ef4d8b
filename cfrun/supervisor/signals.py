"""The supervisor's signals: which stop the job, which go on to the ranks, and what came.

A stop signal (:func:`stop_signals`) raises :class:`SignalReceived` on the supervisor's main
thread wherever it is, so a blocking wait ends at once; the supervisor then stops the job as a
preemption (:meth:`cfrun.supervisor.core.Supervisor._preempt`, exit 75). Python drops that
exception where the main thread runs a finalizer (a ``__del__``, a weakref callback, a
generator closed by the garbage collector): it prints "Exception ignored" and goes on, and a
fault storm's SIGTERM was lost that way (the ranks trained to their end). So the stop is also
kept (:attr:`StopSignals.signum`) until the supervisor takes it, and its loops raise it again
(:meth:`StopSignals.check`, every 0.1 s). A second stop signal ends the job at once.

The forwarded signals (:func:`forwarded_signals`) are queued for the monitor, which sends them
to the ranks (:func:`forward_pending`).

Main thread only (``signal.signal`` and the handlers run there).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("cfrun")


def forward_pending(pending: list[int], proc: subprocess.Popen[bytes] | None, launcher: str,
                    emit: Callable[..., None]) -> None:
    """Send the signals queued in ``pending`` (emptied) to the ranks of the attempt whose
    process is ``proc``: torchrun's children, not torchrun, whose own handler would end the
    attempt on SIGHUP or SIGQUIT; with ``launcher`` ``local`` or ``python`` the process is the
    rank itself (with ``local`` or several ranks,
    :class:`cfrun.supervisor.local_ranks.LocalRanks`: its ``pids``).
    Event ``signal_forwarded`` through ``emit``. A rank that is gone is skipped."""
    import psutil

    while pending:
        signum = pending.pop(0)
        ranks: list[Any] = []
        if proc is not None and launcher != "torchrun":
            for pid in getattr(proc, "pids", (proc.pid,)):
                try:
                    ranks.append(psutil.Process(pid))
                except psutil.Error:
                    pass
        elif proc is not None:
            try:
                ranks = psutil.Process(proc.pid).children()
            except psutil.Error:
                ranks = []
        for r in ranks:
            try:
                r.send_signal(signum)
            except psutil.Error:
                pass
        name = signal.Signals(signum).name
        logger.info("cfrun: forwarded %s to %d rank(s)", name, len(ranks))
        emit("signal_forwarded", signal=name, ranks=len(ranks))


def forwarded_signals() -> tuple[signal.Signals, ...]:
    """Signals cfrun passes on to the ranks: SIGUSR1 and SIGUSR2 always; SIGHUP and SIGQUIT too
    when cfrun is PID 1 (a container's entrypoint), where the kernel would otherwise drop them
    (elsewhere they end cfrun, and with it every process of the job, as for any program)."""
    sigs = [signal.SIGUSR1, signal.SIGUSR2]
    if os.getpid() == 1:
        sigs += [signal.SIGHUP, signal.SIGQUIT]
    return tuple(sigs)


def stop_signals() -> tuple[signal.Signals, ...]:
    """Signals that stop the job as a preemption (final checkpoint, exit 75, resumable):
    SIGTERM, SIGINT, and SIGHUP (a closed terminal, a dropped ssh session) unless cfrun is
    PID 1, where SIGHUP is passed on to the ranks (:func:`forwarded_signals`)."""
    sigs = [signal.SIGTERM, signal.SIGINT]
    if os.getpid() != 1:
        sigs.append(signal.SIGHUP)
    return tuple(sigs)


class SignalReceived(BaseException):
    """A stop signal (:func:`stop_signals`) arrived; ``signum`` says which.

    A ``BaseException``, as ``KeyboardInterrupt`` is: the handler raises it wherever the main
    thread is, and code that catches ``Exception`` there must not swallow the stop. A logging
    handler does (``Handler.emit`` reports an exception of its own and goes on): a SIGTERM that
    landed while the supervisor logged an attempt's start was lost, and the job ran to its end
    (a fault storm on a loaded machine)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The supervisor's signal handlers and what they received.

    Args:
        on_second: called by the handler of a second stop signal (the supervisor kills its
            persist agent; the shutdown under way then kills the ranks at once).
    """

    def __init__(self, on_second: Callable[[], None]) -> None:
        self.shutting_down = False
        """Set once a stop is under way: a stop signal from then on is the second."""
        self.second = False
        """A second stop signal came: end at once, leave nothing behind."""
        self.signum: int | None = None
        """The stop signal received and not taken yet (:meth:`check`, :meth:`take`)."""
        self.taken: int | None = None
        """The stop signal the supervisor acted on (:meth:`take`), if one came."""
        self.pending: list[int] = []
        """Forwarded signals not sent to the ranks yet (the monitor's queue)."""
        self._on_second = on_second

    def on_stop(self, signum: int, frame: Any) -> None:
        """Handler of :func:`stop_signals`. Raises :class:`SignalReceived` (the first)."""
        if self.shutting_down:
            self.second = True
            self._on_second()
            return
        self.shutting_down = True  # set before raising: a signal from now on is the second
        self.signum = signum
        raise SignalReceived(signum)

    def queue_forward(self, signum: int, frame: Any) -> None:
        """Handler of :func:`forwarded_signals`: forwarded by the attempt's loop (≤ 0.1 s)."""
        self.pending.append(signum)

    def check(self) -> None:
        """Raise a stop again that Python dropped in a finalizer (the module's docstring).

        Raises:
            SignalReceived: a stop signal came and :meth:`take` has not been called since.
        """
        if self.signum is not None:
            raise SignalReceived(self.signum)

    def take(self) -> None:
        """The supervisor acts on the stop now: :meth:`check` raises no more; :attr:`taken`
        keeps which signal it was (``cfrun verify`` stops on it even where the script had
        ended before it came)."""
        self.shutting_down = True
        self.taken, self.signum = self.signum, None
