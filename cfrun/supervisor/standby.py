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

A rank's spare forks its successor at its go, before the script runs
(:func:`cfrun.rank.spare._fork_next_spare`; the supervisor, a child subreaper, adopts it:
:class:`AdoptedProcess`), where torch's import starts no thread (``OMP_NUM_THREADS=1``); a cold
attempt's rank then starts as a spare that takes its go at once (:meth:`Standby.start_rank`),
so a job imports torch once however often it restarts.

``CFRUN_STANDBY=0`` turns it off (a machine short of memory: the spare holds an interpreter with
torch imported, ~300 MB here, no GPU memory).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from cfrun.contract import settings as E
from cfrun.contract.config import RunConfig
from cfrun.supervisor.launcher import TORCHRUN_LOG, die_with_parent, module_argv

logger = logging.getLogger("cfrun")

READY = b"ready"
"""How a spare's ready line starts (``ready\n``; ``ready PID\n`` from a forked spare)."""

FORK_READY_S = 30.0
"""How long a spare forked at a go may take to say ready before it is given up."""


class AdoptedProcess:
    """A warm spare forked by the previous one at its go (:func:`cfrun.rank.spare.
    _fork_next_spare`) and re-parented to the supervisor, a child subreaper: the part of
    ``subprocess.Popen`` the supervisor uses (``pid``, ``args``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``). The supervisor reaps it with
    ``waitpid`` as ``Popen`` would; :meth:`cfrun.supervisor.monitor.Monitor.reap_orphans`
    leaves it alone (it is among the supervisor's own processes). Supervisor's main thread.

    Args:
        pid: the spare's pid, which it said once it was the supervisor's child.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.args = ["cfrun.rank.spare", "(forked)"]
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def poll(self) -> int | None:
        """Its exit status once it exited (negative: the killing signal), else None; never
        blocks. A pid that is no longer ours to reap counts as exited with status 1."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 1 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                self._close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, waiting at most ``timeout`` seconds (None: for ever).

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        deadline_s = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left_s = 0.05 if deadline_s is None else deadline_s - time.monotonic()
            if left_s <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if self._pidfd is not None:
                select.select([self._pidfd], [], [], min(left_s, 0.05))
            else:
                time.sleep(min(left_s, 0.01))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless it was reaped (until then the pid stays its own)."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM it."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL it."""
        self.send_signal(signal.SIGKILL)

    def _close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def standby_wanted(cfg: RunConfig) -> bool:
    """True where a job keeps warm spares: not ``cfrun profile``, and ``CFRUN_STANDBY`` not
    ``0`` (a ``local`` or ``python`` job's spares are its next ranks, a torchrun job's its next
    torchrun).

    Raises:
        BadInputError: ``CFRUN_STANDBY`` is neither 0 nor 1.
    """
    return E.get_flag(E.STANDBY) and not cfg.profile_only


SpareProcess = subprocess.Popen[bytes] | AdoptedProcess
"""A spare's process: started by the supervisor, or forked by the previous spare."""


class _Spare:
    """One warm spare process (:mod:`cfrun.rank.spare`) and its socket. Supervisor's main
    thread only (the spare's parent-death signal is tied to it).

    Args:
        cfg: the job's settings (``cwd``, ``launcher``).
        stdio: ``stdout``/``stderr`` for its ``Popen`` (the console tap's ends).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.proc: SpareProcess | None = None
        self.sock: socket.socket | None = None
        self.is_ready = False
        self.started_s = 0.0
        """When it was started (monotonic seconds)."""
        self.said_ready = False
        """Its ``standby_ready`` event was emitted."""

    def start(self, env: dict[str, str], stdio: dict[str, int]) -> None:
        """Start it with ``env`` less the rank settings (so cfrun's hook does not arm in it);
        no-op while it is alive. A machine out of processes or memory: none (logged)."""
        if self.pending() or self.proc is not None and self.proc.poll() is None:
            return
        self.stop()
        ours, theirs = socket.socketpair()
        spare_env = {k: v for k, v in env.items() if k != E.RANK_SETTINGS}
        try:
            self.proc = subprocess.Popen(
                module_argv("cfrun.rank.spare", str(theirs.fileno()), *self._kind(),
                            *self._shown()),
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

    def forks(self) -> bool:
        """True where each spare forks the next at its go (a rank's spare; not torchrun's)."""
        return self.cfg.launcher != "torchrun"

    def pending(self) -> bool:
        """True while a spare forked at the last go has not said ready yet (given up after
        :data:`FORK_READY_S`)."""
        if self.proc is not None or self.sock is None:
            return False
        if time.monotonic() - self.started_s > FORK_READY_S:
            logger.debug("cfrun: the forked warm spare did not say ready")
            self.stop()
            return False
        return True

    def _shown(self) -> tuple[str, ...]:
        """What a rank's spare adds to its command line after ``--`` (it reads none of it): the
        script and its arguments, as ``python SCRIPT ARGS`` shows them, so that ``ps``,
        ``pkill -f SCRIPT`` and the like find the rank it becomes, and the spares forked from
        it. None for a torchrun's spare."""
        if self.cfg.launcher == "torchrun":
            return ()
        what = ("-m", self.cfg.module) if self.cfg.module else (self.cfg.script,)
        return ("--", *(str(w) for w in what), *(str(a) for a in self.cfg.script_args))

    def wanted(self) -> bool:
        """True when it is not alive (never started, or died) and none is being forked."""
        if self.pending():
            return False
        return self.proc is None or self.proc.poll() is not None

    def ready(self) -> bool:
        """True once it said it is ready and is alive (never blocks)."""
        if self.sock is None or (self.proc is None and not self.pending()):
            return False
        if self.proc is not None and self.proc.poll() is not None:
            return False
        if not self.is_ready:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if readable:
                try:
                    line = self.sock.recv(64)
                except OSError:
                    line = b""
                words = line.split()
                if not words or words[0] != READY:
                    self.stop()
                    return False
                if self.proc is None:  # forked: its pid, now the supervisor's child
                    try:
                        self.proc = AdoptedProcess(int(words[1]))
                    except (IndexError, ValueError):
                        self.stop()
                        return False
                self.is_ready = True
        return self.is_ready

    def go(self, message: dict[str, Any], *, now: bool = False
           ) -> SpareProcess | None:
        """Send the go ``message`` (:mod:`cfrun.rank.spare`); returns the process, now the
        attempt's (no longer this spare's), or None when it is not ready or cannot take it (it
        is stopped). ``now``: send it to a spare just started, which reads it once its
        imports are done (a cold attempt's rank started as a spare, so that it forks the
        next one). A rank's spare forks the next spare at its go (:meth:`forks`): this
        object then waits for that one's ready."""
        if not now and not self.ready():
            logger.warning("cfrun: the warm spare died before its go; its rank starts cold")
            self.stop()
            return None
        if self.sock is None or self.proc is None:
            return None
        payload = json.dumps({**message, "cold": True} if now else message).encode()
        ours = theirs = None
        try:
            if self.forks():
                ours, theirs = socket.socketpair()
                sent = socket.send_fds(self.sock, [payload], [theirs.fileno()])
                self.sock.sendall(payload[sent:])
            else:
                self.sock.sendall(payload)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError as e:  # it died after saying ready
            logger.warning("cfrun: the warm spare did not take its go (%s); its rank starts "
                           "cold", e)
            if ours is not None:
                ours.close()
            self.stop()
            return None
        finally:
            if theirs is not None:
                theirs.close()
        proc = self.proc
        self.sock.close()
        self.sock, self.proc, self.is_ready, self.said_ready = ours, None, False, False
        self.started_s = time.monotonic()
        return proc

    def stop(self) -> None:
        """End it (SIGKILL, then reap it; a forked one not yet ready ends when its socket
        closes); no-op without one."""
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
    def proc(self) -> SpareProcess | None:
        """The first spare's process (local rank 0's, or the torchrun's)."""
        return self.spares[0].proc

    def tend(self, stepped: Callable[[], bool], next_env: Callable[[], dict[str, str]],
             emit: Callable[..., None]) -> None:
        """The attempt's housekeeping (every second): start the spares that are not alive
        once the attempt made a step (``stepped``), with ``next_env()``; event
        ``standby_ready`` (``warmup_s``: its start, or for one forked at a go that go, to
        ready; ``forked``: forked by the spare that became the rank; ``local_rank`` with
        several spares) once each is."""
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
                     **({"forked": True} if isinstance(spare.proc, AdoptedProcess) else {}),
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

    def promote(self, env: dict[str, str], argv: list[str]) -> SpareProcess | None:
        """Make the ready spare the new attempt's process with environment ``env`` (that of
        :func:`cfrun.supervisor.launcher.build_worker_env`): its rank, or under torchrun its
        torchrun, given the attempt's cold command ``argv``
        (:func:`cfrun.supervisor.launcher.build_launch_argv`). Returns its process, now the
        attempt's; None when no spare was ready (it is stopped; start the attempt cold)."""
        if self.cfg.launcher == "torchrun":  # what follows the module in module_argv
            return self.spares[0].go({"env": env,
                                      "run_module": argv[argv.index(TORCHRUN_LOG):]})
        return self.promote_rank(0, env)

    def forks(self, env: dict[str, str]) -> bool:
        """True where a rank's spare started with the attempt's environment ``env`` can fork
        its successor at its go: a rank's (not torchrun's), and ``OMP_NUM_THREADS=1`` (cfrun's
        default for several ranks per node, as torchrun's). Otherwise ``import torch`` starts
        OpenMP's threads, a fork keeps only the calling one, and the spare does not fork
        (:func:`cfrun.rank.spare._fork_next_spare`): starting a cold rank as a spare would
        then gain nothing."""
        return self.spares[0].forks() and env.get("OMP_NUM_THREADS") == "1"

    def promote_rank(self, local_rank: int, env: dict[str, str]
                     ) -> SpareProcess | None:
        """Make local rank ``local_rank``'s spare (``--launcher python``) that rank of the new
        attempt, with the rank's environment ``env``
        (:func:`cfrun.supervisor.launcher.local_rank_env` with several ranks). Returns its
        process, now the rank; None when it was not ready (it is stopped; start the rank
        cold)."""
        return self.spares[local_rank].go(self._rank_go(env))

    def start_rank(self, local_rank: int, attempt_env: dict[str, str],
                   env: dict[str, str]) -> SpareProcess | None:
        """Start local rank ``local_rank`` of an attempt that found no ready spare through a
        spare (``--launcher python``): the one still importing, or a new one started with the
        attempt's environment ``attempt_env`` less the rank settings (as :meth:`tend` starts
        one); it takes the go with the rank's ``env`` at once and reads it once its imports
        are done. It imports what a cold rank imports, then becomes the rank and forks the
        next spare (:func:`cfrun.rank.spare._fork_next_spare`): every later restart of the job
        costs a fork, not an interpreter's start and import. Returns the process, now the
        rank; None where the spare could not start or take the go (start the rank cold)."""
        spare = self.spares[local_rank]
        deadline_s = time.monotonic() + 2.0
        while spare.pending() and not spare.ready() and time.monotonic() < deadline_s:
            time.sleep(0.005)  # forked a moment ago: it says ready within milliseconds
        if spare.wanted():  # none alive: a new one (else the one still importing)
            spare.start(attempt_env, self.stdio)
        return spare.go(self._rank_go(env), now=True)

    def _rank_go(self, env: dict[str, str]) -> dict[str, Any]:
        """A rank's go message with the rank's environment ``env``."""
        return {"env": env, "script": self.cfg.script, "module": self.cfg.module,
                "args": list(self.cfg.script_args)}

    def stop(self) -> None:
        """End every spare (SIGKILL, then reap it)."""
        for spare in self.spares:
            spare.stop()

    def processes(self) -> tuple[Any, ...]:
        """The spares' processes, for the supervisor's ``own_processes``."""
        return tuple(spare.proc for spare in self.spares)
