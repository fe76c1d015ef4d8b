"""``cfrun peer``: serve as a remote-memory checkpoint tier (ACUTE level 1) for
``cfrun --peer``; the server itself is :mod:`cfrun.peer.server`."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from cfrun.contract import settings as E
from cfrun.contract.config import parse_bytes, parse_positive_int

HELP = ("Serve as a remote-memory checkpoint tier (ACUTE level 1) for cfrun --peer. "
        "It holds checkpoints in RAM, flush them to --flush-to, serve them back "
        "for a resume. Stops on SIGTERM or SIGINT after flushing what it holds.")
"""``cfrun peer --help``'s text."""


def peer_cmd(
    listen: Annotated[str, typer.Option(
        "--listen", metavar="HOST:PORT", envvar=E.PEER_LISTEN,
        help="HOST:PORT to listen on; only that address is bound (port 0: a free port, "
             "printed).")],
    flush_to: Annotated[str, typer.Option(
        "--flush-to", metavar="PATH|URL", envvar=E.PEER_FLUSH_TO,
        help="Level 2: a directory or fsspec URL (s3://bucket/prefix, gs://..., file://...) "
             "where checkpoints are flushed, job by job in turn.")],
    token_file: Annotated[str, typer.Option(
        "--token-file", metavar="PATH", envvar=E.PEER_TOKEN_FILE,
        help="File with the shared secret (>= 32 bytes, mode 600) that clients must prove; "
             "or a directory (mode 700) of such files, one per tenant, named after it.")],
    slots: Annotated[str, typer.Option(
        "--slots", metavar="INTEGER", envvar=E.PEER_SLOTS,
        help="Checkpoints held in RAM (a circular buffer; split between the tenants).")] = "2",
    max_checkpoint_bytes: Annotated[str, typer.Option(
        "--max-checkpoint-bytes", metavar="SIZE", envvar=E.PEER_MAX_CHECKPOINT_BYTES,
        help="Largest checkpoint (all ranks) accepted, e.g. 8G; RAM use is at most slots "
             "times this. Default: half the RAM divided by --slots, at most 16G.")] = "auto",
    keep: Annotated[str, typer.Option(
        "--keep", metavar="INTEGER", envvar=E.PEER_KEEP,
        help="Flushed checkpoints kept per job at level 2.")] = "3",
) -> None:
    """Serve as a remote-memory checkpoint tier (ACUTE level 1) for `cfrun --peer`.

    Holds up to --slots checkpoints in RAM, received from all ranks in parallel and kept as
    received; flushes each complete one to --flush-to in arrival order; serves them back for a
    resume. Stops on SIGTERM/SIGINT after flushing what it holds.
    """
    from cfrun.peer.server import serve_main

    n_slots = parse_positive_int("--slots", slots, minimum=1)
    if max_checkpoint_bytes == "auto":
        import psutil

        max_bytes = min(16 << 30, psutil.virtual_memory().total // 2 // n_slots)
    else:
        max_bytes = parse_bytes("--max-checkpoint-bytes", max_checkpoint_bytes)
    peer_log = logging.getLogger("cfrun.peer.server")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s cfrun peer: %(message)s"))
    peer_log.addHandler(handler)
    peer_log.setLevel(logging.INFO)
    peer_log.propagate = False
    code = serve_main(listen, flush_to, token_file, slots=n_slots,
                      max_checkpoint_bytes=max_bytes,
                      keep=parse_positive_int("--keep", keep, minimum=1))
    raise typer.Exit(code)
