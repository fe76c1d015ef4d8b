"""cfrun's own log lines on stderr (the ``cfrun`` logger): rich on a terminal, one plain line
per record elsewhere, or JSON lines for log collectors (``--log-format``, ``CFRUN_LOG_FORMAT``).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from cfrun.contract import settings as E
from cfrun.contract.errors import BadInputError

log = logging.getLogger("cfrun")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record (``--log-format json``): ``t_unix_s``, ``level``, ``logger``
    and ``message``, for log collectors (Kubernetes, Loki, CloudWatch)."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({"t_unix_s": round(record.created, 3), "level": record.levelname,
                           "logger": record.name, "message": record.getMessage()})


def setup_logging(log_format: str | None = None) -> None:
    """Give the ``cfrun`` logger one stderr handler. ``log_format`` (``--log-format``, else
    ``CFRUN_LOG_FORMAT``): ``auto`` is rich on a terminal and ``text`` elsewhere; ``text`` is
    ``LEVEL message``, one line per record, never wrapped, no trailing blanks (CI, pod logs);
    ``json`` is :class:`JsonLogFormatter`. Called again with a format, it replaces the handler.

    Raises:
        BadInputError: an unknown format.
    """
    fmt = (log_format or E.get_str(E.LOG_FORMAT) or "auto").strip().lower()
    if fmt not in ("auto", "text", "json"):
        raise BadInputError(f"--log-format {log_format!r} is not a log format; give auto, text "
                            "or json")
    if log.handlers and log_format is None:
        return
    for old in list(log.handlers):
        log.removeHandler(old)
    handler: logging.Handler
    if fmt == "auto" and sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False,
                              markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonLogFormatter() if fmt == "json"
                             else logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def setup_logging_if_given(ctx: Any, log_format: str) -> None:
    """A command's ``--log-format`` typed on its command line replaces the handler that
    :func:`cfrun.cli.app.main` set up from ``CFRUN_LOG_FORMAT`` (a default or the variable
    changes nothing).

    Raises:
        BadInputError: an unknown format.
    """
    if ctx.get_parameter_source("log_format").name == "COMMANDLINE":
        setup_logging(log_format)
