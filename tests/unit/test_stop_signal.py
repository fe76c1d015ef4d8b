"""A stop signal is never swallowed by code that catches ``Exception`` on the supervisor's main
thread: its handler raises ``SignalReceived`` wherever that thread is, and a logging handler
(``Handler.emit`` catches ``Exception``, reports it and goes on) lost the SIGTERM of a fault
storm that landed while the supervisor logged an attempt's start. A real SIGTERM, delivered
inside a real logging call."""

from __future__ import annotations

import io
import logging
import os
import signal
import time

import pytest

from cfrun.supervisor.signals import SignalReceived, StopSignals


class _SignalledWhileFormatting(logging.StreamHandler):
    """Sends this process SIGTERM while it formats a record (inside ``emit``'s try)."""

    def format(self, record: logging.LogRecord) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs at the next bytecode, here
        return super().format(record)


def test_a_sigterm_inside_a_log_call_reaches_the_supervisor():
    sup = StopSignals(on_second=lambda: None)  # the supervisor's handlers
    logger = logging.getLogger("cfrun.test-stop-signal")
    logger.propagate = False
    handler = _SignalledWhileFormatting(io.StringIO())
    logger.addHandler(handler)
    previous = signal.signal(signal.SIGTERM, sup.on_stop)
    try:
        with pytest.raises(SignalReceived) as got:
            logger.warning("attempt 2 started")
        assert got.value.signum == signal.SIGTERM
        assert sup.shutting_down  # a second signal now ends at once
        with pytest.raises(SignalReceived):  # kept until the supervisor takes it
            sup.check()
        sup.take()
        sup.check()
    finally:
        signal.signal(signal.SIGTERM, previous)
        logger.removeHandler(handler)
