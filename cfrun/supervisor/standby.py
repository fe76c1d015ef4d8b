"""The warm spare of a job, kept by the supervisor (issue 35, "a warm restart").

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
    """True where a job keeps a warm spare: not ``cfrun profile``, and ``CFRUN_STANDBY`` not
    ``0`` (a ``--launcher python`` job's spare is its next rank, a torchrun job's its next
    torchrun).

    Raises:
        BadInputError: ``CFRUN_STANDBY`` is neither 0 nor 1.
    """
    return E.get_flag(E.STANDBY) and cfg.launcher in ("python", "torchrun") \
        and not cfg.profile_only


class Standby:
    """One warm spare at a time for the supervisor's next attempt: its rank (``--launcher
    python``) or its torchrun. Called from the supervisor's main thread only (the spare gets a
    parent-death signal tied to it).

    Args:
        cfg: the job's settings (``cwd``, ``script``, ``module``, ``script_args``).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.stdio: dict[str, int] = {}
        """``stdout``/``stderr`` for the spare's ``Popen``: the console tap's ends (set by the
        supervisor), so the spare, once the rank, writes where a rank does."""
        self.proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._started_s = 0.0
        self._said_ready = False

    def tend(self, stepped: Callable[[], bool], next_env: Callable[[], dict[str, str]],
             emit: Callable[..., None]) -> None:
        """The attempt's housekeeping (every second): start a spare once the attempt made a
        step (``stepped``) and none is alive, with ``next_env()``; event ``standby_ready``
        (``warmup_s``: its start to ready) once it is."""
        if self.wanted():
            if stepped():
                self.start(next_env())
        elif not self._said_ready and self.ready():
            self._said_ready = True
            emit("standby_ready", pid=self.proc.pid if self.proc else None,
                 warmup_s=round(time.monotonic() - self._started_s, 3))

    def start(self, env: dict[str, str]) -> None:
        """Start a spare with the next attempt's environment less the rank settings (so
        cfrun's hook does not arm in it); no-op while one is alive."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.stop()
        ours, theirs = socket.socketpair()
        spare_env = {k: v for k, v in env.items() if k != E.RANK_SETTINGS}
        try:
            self.proc = subprocess.Popen(
                module_argv("cfrun.rank.spare", str(theirs.fileno()),
                            *(("launcher",) if self.cfg.launcher == "torchrun" else ())),
                env=spare_env,
                cwd=self.cfg.cwd, start_new_session=True, preexec_fn=die_with_parent(),
                pass_fds=(theirs.fileno(),), stdout=self.stdio.get("stdout"),
                stderr=self.stdio.get("stderr"))
        except OSError as e:  # no memory for another process: recover cold
            logger.debug("cfrun: no warm spare (%s)", e)
            ours.close()
            return
        finally:
            theirs.close()
        self._sock = ours
        self._ready = self._said_ready = False
        self._started_s = time.monotonic()

    def wanted(self) -> bool:
        """True when no spare is alive (none started, or it died): :meth:`start` one."""
        return self.proc is None or self.proc.poll() is not None

    def ready(self) -> bool:
        """True once the spare said it is ready and is alive (never blocks)."""
        if self.proc is None or self._sock is None or self.proc.poll() is not None:
            return False
        if not self._ready:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if readable:
                try:
                    self._ready = self._sock.recv(len(READY)) == READY
                except OSError:
                    return False
        return self._ready

    def promote(self, env: dict[str, str], argv: list[str]) -> subprocess.Popen[bytes] | None:
        """Make the ready spare the new attempt's process with environment ``env`` (that of
        :func:`cfrun.supervisor.launcher.build_worker_env`): its rank, or under torchrun its
        torchrun, given the attempt's cold command ``argv``
        (:func:`cfrun.supervisor.launcher.build_launch_argv`). Returns its process, now the
        attempt's; None when no spare was ready (it is stopped; start the attempt cold)."""
        if not self.ready():
            logger.warning("cfrun: the warm spare died before its go; this restart starts cold")
            self.stop()
            return None
        assert self._sock is not None and self.proc is not None
        if self.cfg.launcher == "torchrun":  # what follows the module in module_argv
            go = json.dumps({"env": env, "run_module": argv[argv.index(TORCHRUN_LOG):]})
        else:
            go = json.dumps({"env": env, "script": self.cfg.script, "module": self.cfg.module,
                             "args": list(self.cfg.script_args)})
        try:
            self._sock.sendall(go.encode())
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as e:  # it died after saying ready
            logger.warning("cfrun: the warm spare did not take its go (%s); this restart starts "
                           "cold", e)
            self.stop()
            return None
        proc = self.proc
        self._sock.close()
        self._sock, self.proc, self._ready = None, None, False
        return proc

    def stop(self) -> None:
        """End the spare (SIGKILL, then reap it); no-op without one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        proc, self.proc, self._ready = self.proc, None, False
        if proc is not None:
            try:
                proc.kill()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass

    def processes(self) -> tuple[Any, ...]:
        """The spare's process, for the supervisor's ``own_processes``."""
        return (self.proc,)
