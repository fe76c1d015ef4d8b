"""The warm spares of a job, kept by the supervisor (issue 35, "a warm restart").

While an attempt trains, :class:`Standby` starts one spare process
(:mod:`cfrun.rank.spare`): Python started, torch and cfrun imported, nothing of the job done.
When the attempt's rank dies the next attempt *promotes* the spare instead of starting a new
interpreter: it sends the attempt's environment over the spare's socket and the spare becomes
the rank (``python SCRIPT ARGS`` as before, its state read from the newest checkpoint as
always). The import, ~1.5 s here and ~4 s on a GPU machine, is then off the recovery path; a
new spare is started once the new rank has made a step, so every failure finds one.

The spare is one of the supervisor's own processes (``own_processes``: never killed as a
straggler of an attempt); it carries the job's marks in its environment
(:func:`cfrun.supervisor.launcher.job_processes`) and a parent-death signal, so the reaper and
the kernel end it with the supervisor, and :meth:`stop` ends it with the job. A spare that is
not ready, died, or cannot take the go is simply not used: the attempt starts cold.

Under torchrun (the default launcher) the spare is the next attempt's *torchrun*: Python
started and torch's launcher imported (``cfrun.rank.spare FD launcher``); at the go it runs
torchrun (:mod:`cfrun.supervisor.torchrun_log`) with the attempt's arguments and environment,
and torchrun starts the ranks as fresh processes, as a cold attempt's does. That takes
torchrun's own start (~1 s of import here) off the recovery path for any number of ranks; the
ranks' import is still paid (they are torchrun's children).

A ``--launcher python --nproc-per-node N`` job (cfrun starts the node's ranks itself,
:mod:`cfrun.supervisor.local_ranks`) keeps N spares, one per local rank: at a restart each
ready one becomes its rank (its go carries that rank's environment), and a rank whose spare is
not ready (it died, or is still importing: then it is kept for the next restart) starts cold
beside them. So every rank's interpreter start and import are off the recovery path.

``CFRUN_STANDBY=0`` turns it off (a machine short of memory: the spare holds an interpreter with
torch imported, ~300 MB here, no GPU memory).
"""

from __future__ import annotations

import json
import logging
import select
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from cfrun.contract import settings as E
from cfrun.contract.config import RunConfig
from cfrun.supervisor.launcher import TORCHRUN_LOG, die_with_parent, module_argv

logger = logging.getLogger("cfrun")

READY = b"ready\n"


def standby_wanted(cfg: RunConfig) -> bool:
    """True where a job keeps warm spares: not ``cfrun profile``, and ``CFRUN_STANDBY`` not
    ``0`` (a ``local`` or ``python`` job's spares are its next ranks, a torchrun job's its next
    torchrun).

    Raises:
        BadInputError: ``CFRUN_STANDBY`` is neither 0 nor 1.
    """
    return E.get_flag(E.STANDBY) and not cfg.profile_only


class _Spare:
    """One warm spare process (:mod:`cfrun.rank.spare`) and its socket. Supervisor's main
    thread only (the spare's parent-death signal is tied to it).

    Args:
        cfg: the job's settings (``cwd``, ``launcher``).
        stdio: ``stdout``/``stderr`` for its ``Popen`` (the console tap's ends).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.is_ready = False
        self.started_s = 0.0
        """When it was started (monotonic seconds)."""
        self.said_ready = False
        """Its ``standby_ready`` event was emitted."""

    def start(self, env: dict[str, str], stdio: dict[str, int]) -> None:
        """Start it with ``env`` less the rank settings (so cfrun's hook does not arm in it);
        no-op while it is alive. A machine out of processes or memory: none (logged)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.stop()
        ours, theirs = socket.socketpair()
        spare_env = {k: v for k, v in env.items() if k != E.RANK_SETTINGS}
        try:
            self.proc = subprocess.Popen(
                module_argv("cfrun.rank.spare", str(theirs.fileno()), *self._kind()),
                env=spare_env,
                cwd=self.cfg.cwd, start_new_session=True, preexec_fn=die_with_parent(),
                pass_fds=(theirs.fileno(),), stdout=stdio.get("stdout"),
                stderr=stdio.get("stderr"))
        except OSError as e:  # no memory for another process: recover cold
            logger.debug("cfrun: no warm spare (%s)", e)
            ours.close()
            return
        finally:
            theirs.close()
        self.sock = ours
        self.is_ready = self.said_ready = False
        self.started_s = time.monotonic()

    def _kind(self) -> tuple[str, ...]:
        """The spare's second word (:func:`cfrun.rank.spare.main`): ``launcher`` for a
        torchrun, ``ranks`` for a rank that sees torchrun's variables (launcher ``local``, or
        one of several ``python`` ranks: DDP's imports ahead too), none for the one rank of
        ``--launcher python``."""
        if self.cfg.launcher == "torchrun":
            return ("launcher",)
        return () if self.cfg.one_python_rank else ("ranks",)

    def wanted(self) -> bool:
        """True when it is not alive (never started, or died)."""
        return self.proc is None or self.proc.poll() is not None

    def ready(self) -> bool:
        """True once it said it is ready and is alive (never blocks)."""
        if self.proc is None or self.sock is None or self.proc.poll() is not None:
            return False
        if not self.is_ready:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if readable:
                try:
                    self.is_ready = self.sock.recv(len(READY)) == READY
                except OSError:
                    return False
        return self.is_ready

    def go(self, message: dict[str, Any]) -> subprocess.Popen[bytes] | None:
        """Send the go ``message`` (:mod:`cfrun.rank.spare`); returns the process, now the
        attempt's (no longer this spare's), or None when it is not ready or cannot take it (it
        is stopped)."""
        if not self.ready():
            logger.warning("cfrun: the warm spare died before its go; its rank starts cold")
            self.stop()
            return None
        assert self.sock is not None and self.proc is not None
        try:
            self.sock.sendall(json.dumps(message).encode())
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as e:  # it died after saying ready
            logger.warning("cfrun: the warm spare did not take its go (%s); its rank starts "
                           "cold", e)
            self.stop()
            return None
        proc = self.proc
        self.sock.close()
        self.sock, self.proc, self.is_ready = None, None, False
        return proc

    def stop(self) -> None:
        """End it (SIGKILL, then reap it); no-op without one."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        proc, self.proc, self.is_ready = self.proc, None, False
        if proc is not None:
            try:
                proc.kill()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass


class Standby:
    """The warm spares for the supervisor's next attempt: one per local rank (``--launcher
    python``: ``--nproc-per-node``, 1 by default) or one torchrun. Called from the
    supervisor's main thread only (the spares get a parent-death signal tied to it).

    Args:
        cfg: the job's settings (``cwd``, ``script``, ``module``, ``script_args``,
            ``nproc_per_node``).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.stdio: dict[str, int] = {}
        """``stdout``/``stderr`` for the spares' ``Popen``: the console tap's ends (set by the
        supervisor), so a spare, once a rank, writes where a rank does."""
        count = cfg.nproc_per_node if cfg.starts_ranks else 1
        self.spares = [_Spare(cfg) for _ in range(count)]
        """The spares, by local rank (one for a torchrun)."""

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The first spare's process (local rank 0's, or the torchrun's)."""
        return self.spares[0].proc

    def tend(self, stepped: Callable[[], bool], next_env: Callable[[], dict[str, str]],
             emit: Callable[..., None]) -> None:
        """The attempt's housekeeping (every second): start the spares that are not alive
        once the attempt made a step (``stepped``), with ``next_env()``; event
        ``standby_ready`` (``warmup_s``: its start to ready; ``local_rank`` with several
        spares) once each is."""
        if self.wanted() and stepped():
            env = next_env()
            for spare in self.spares:
                if spare.wanted():
                    spare.start(env, self.stdio)
        for local_rank, spare in enumerate(self.spares):
            if not spare.said_ready and spare.ready():
                spare.said_ready = True
                assert spare.proc is not None
                emit("standby_ready", pid=spare.proc.pid,
                     warmup_s=round(time.monotonic() - spare.started_s, 3),
                     **({"local_rank": local_rank} if len(self.spares) > 1 else {}))

    def start(self, env: dict[str, str]) -> None:
        """Start every spare that is not alive with the next attempt's environment ``env``."""
        for spare in self.spares:
            spare.start(env, self.stdio)

    def wanted(self) -> bool:
        """True when a spare is not alive (none started, or it died): :meth:`start` it."""
        return any(spare.wanted() for spare in self.spares)

    def ready(self) -> bool:
        """True once every spare said it is ready and is alive (never blocks)."""
        return all(spare.ready() for spare in self.spares)

    def ready_ranks(self) -> list[int]:
        """The local ranks whose spare is ready now (never blocks)."""
        return [r for r, spare in enumerate(self.spares) if spare.ready()]

    def promote(self, env: dict[str, str], argv: list[str]) -> subprocess.Popen[bytes] | None:
        """Make the ready spare the new attempt's process with environment ``env`` (that of
        :func:`cfrun.supervisor.launcher.build_worker_env`): its rank, or under torchrun its
        torchrun, given the attempt's cold command ``argv``
        (:func:`cfrun.supervisor.launcher.build_launch_argv`). Returns its process, now the
        attempt's; None when no spare was ready (it is stopped; start the attempt cold)."""
        if self.cfg.launcher == "torchrun":  # what follows the module in module_argv
            return self.spares[0].go({"env": env,
                                      "run_module": argv[argv.index(TORCHRUN_LOG):]})
        return self.promote_rank(0, env)

    def promote_rank(self, local_rank: int, env: dict[str, str]
                     ) -> subprocess.Popen[bytes] | None:
        """Make local rank ``local_rank``'s spare (``--launcher python``) that rank of the new
        attempt, with the rank's environment ``env``
        (:func:`cfrun.supervisor.launcher.local_rank_env` with several ranks). Returns its
        process, now the rank; None when it was not ready (it is stopped; start the rank
        cold)."""
        return self.spares[local_rank].go({
            "env": env, "script": self.cfg.script, "module": self.cfg.module,
            "args": list(self.cfg.script_args)})

    def stop(self) -> None:
        """End every spare (SIGKILL, then reap it)."""
        for spare in self.spares:
            spare.stop()

    def processes(self) -> tuple[Any, ...]:
        """The spares' processes, for the supervisor's ``own_processes``."""
        return tuple(spare.proc for spare in self.spares)
