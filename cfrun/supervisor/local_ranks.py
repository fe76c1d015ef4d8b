"""The ranks of one node started by cfrun's supervisor itself: ``--launcher python
--nproc-per-node N`` (issue 35, "recover in half a plain restart").

Under torchrun the ranks are torchrun's children, so a restart pays each rank's interpreter
start and ``import torch`` again, whatever is kept warm. Here the supervisor is the launcher of
its node, as ``torchrun --standalone --nproc-per-node N`` is: :func:`start_local_ranks` starts
N processes, each the attempt's command (``python SCRIPT ARGS``, or ``python -m MODULE ARGS``)
with the environment torchrun gives its worker of that local rank
(:func:`cfrun.supervisor.launcher.local_rank_env`; a new ``MASTER_PORT`` and run id per
attempt; rank 0 hosts the ``env://`` store). Where the supervisor keeps warm spares
(:class:`cfrun.supervisor.standby.Standby`, one per local rank) each ready one *becomes* its
rank instead, and only the others start cold.

The attempt ends as it does under torchrun (torch 2.13's ``LocalElasticAgent``, ``--max-restarts
0``): when every rank exited 0 it succeeded (exit status 0); when a rank exits non-zero or is
killed by a signal, the others get SIGTERM and, :data:`TEARDOWN_GRACE_S` later, SIGKILL, and the
attempt failed (status 1, torchrun's, with the failed rank and its status in
:attr:`LocalRanks.rank_exits`, as cfrun reads them from torchrun's report). :class:`LocalRanks`
holds the N processes behind the part of ``subprocess.Popen`` the monitor uses, so the monitor
watches one object either way. It waits on the ranks' pidfds (Linux >= 5.3), so a death is seen
at once, not at torchrun's next ``--monitor-interval``.

Each rank runs in a session of its own (as torchrun starts them) with a parent-death signal and
the job's marks in its environment (:func:`cfrun.supervisor.launcher.spawn`,
:func:`cfrun.supervisor.launcher.build_worker_env`): nothing outlives the supervisor. Supervisor
process, main thread only.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from typing import Any

from cfrun.contract.config import RunConfig
from cfrun.supervisor.launcher import free_port, local_rank_env

logger = logging.getLogger("cfrun")

TEARDOWN_GRACE_S = 30.0
"""Seconds between the SIGTERM of the other ranks after a rank failed and their SIGKILL:
torchrun's (``LocalElasticAgent``'s ``shutdown_timeout``)."""

_TICK_S = 0.02
"""The wait between looks where pidfds are missing (not Linux, or an old kernel)."""


class LocalRanks:
    """The N rank processes of one attempt, as one ``Popen``-like process for the monitor:
    ``pid`` (local rank 0's), ``pids``, ``poll``, ``wait``, ``send_signal``, ``kill``,
    ``returncode``, ``args``, and :attr:`rank_exits`.

    :meth:`poll` and :meth:`wait` also carry the teardown out (module docstring): the first
    failure seen SIGTERMs the rest, :data:`TEARDOWN_GRACE_S` later they are SIGKILLed.

    Args:
        procs: the ranks' processes, by local rank (at least one).
        grace_s: seconds from the teardown's SIGTERM to its SIGKILL.
    """

    def __init__(self, procs: list[subprocess.Popen[bytes]], *,
                 grace_s: float = TEARDOWN_GRACE_S) -> None:
        if not procs:
            raise ValueError("LocalRanks needs at least one process")
        self.procs = procs
        self.pid = procs[0].pid
        self.pids = tuple(p.pid for p in procs)
        self.args = procs[0].args
        self.returncode: int | None = None
        """None while a rank runs; then 0 (every rank exited 0) or 1 (a rank failed)."""
        self.rank_exits: tuple[tuple[int, int], ...] = ()
        """``(rank, status)`` of the ranks seen failed before the teardown, the first
        failure last (``Outcome.rank_exits``); a negative status is the killing signal."""
        self.grace_s = grace_s
        self._term_at: float | None = None
        self._killed = False
        self._pidfds = [_pidfd(p.pid) for p in procs]

    def poll(self) -> int | None:
        """The attempt's status once every rank exited, else None; starts the teardown at the
        first failure seen and SIGKILLs what is left once its grace is over. Never blocks."""
        if self.returncode is not None:
            return self.returncode
        codes = [p.poll() for p in self.procs]
        if not self.rank_exits:
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                self.rank_exits = tuple(reversed(failed))  # the lowest rank: the root cause
                self._term_at = time.monotonic()
                self._signal_live(signal.SIGTERM)
        if self._term_at is not None and not self._killed and \
                time.monotonic() - self._term_at >= self.grace_s:
            self._killed = True
            self._signal_live(signal.SIGKILL)
        if any(c is None for c in codes):
            return None
        self.returncode = 1 if self.rank_exits else 0
        self._close_pidfds()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for :meth:`poll` to give a status, at most ``timeout`` seconds.

        Raises:
            subprocess.TimeoutExpired: a rank still runs after ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            left_s = None if deadline is None else deadline - time.monotonic()
            if left_s is not None and left_s <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            if self._term_at is not None and not self._killed:  # wake for the SIGKILL
                due_s = self._term_at + self.grace_s - time.monotonic()
                left_s = due_s if left_s is None else min(left_s, due_s)
            self._sleep(left_s)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to every rank still running."""
        self._signal_live(sig)

    def terminate(self) -> None:
        """SIGTERM every rank still running."""
        self._signal_live(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL every rank still running."""
        self._signal_live(signal.SIGKILL)

    def _signal_live(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:  # not reaped: the pid is still this rank's
                try:
                    p.send_signal(sig)
                except OSError:
                    pass

    def _sleep(self, timeout_s: float | None) -> None:
        """Block until a rank may have exited, or ``timeout_s`` (None: no limit) passed."""
        fds = [fd for fd, p in zip(self._pidfds, self.procs)
               if fd is not None and p.returncode is None]
        if len(fds) != sum(p.returncode is None for p in self.procs):
            time.sleep(max(0.0, min(_TICK_S, _TICK_S if timeout_s is None else timeout_s)))
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(None if timeout_s is None else max(0, int(timeout_s * 1000) + 1))

    def _close_pidfds(self) -> None:
        for fd in self._pidfds:
            if fd is not None:
                os.close(fd)
        self._pidfds = [None] * len(self.procs)

    def __del__(self) -> None:
        try:
            self._close_pidfds()
        except Exception:
            pass


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exits), or None where the kernel has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def uses_local_ranks(cfg: RunConfig) -> bool:
    """The supervisor starts the node's ranks itself with torchrun's variables: launcher
    ``local`` (one rank included), or ``python`` with several ranks (with ``python`` and one,
    the attempt's process is the rank, as ``python SCRIPT``)."""
    return cfg.starts_ranks and not cfg.one_python_rank


def attempt_pids(proc: Any) -> set[int]:
    """Pids of an attempt's own processes (its torchrun, its one rank, or :class:`LocalRanks`'
    ranks), which their ``Popen`` reaps (a ``waitpid`` elsewhere would lose their status);
    empty for None."""
    if proc is None:
        return set()
    return set(getattr(proc, "pids", (proc.pid,)))


def start_attempt(cfg: RunConfig, argv: list[str], env: dict[str, str], *, warm: bool,
                  standby: Any, spawn_fn: Callable[..., Any], stdio: dict[str, Any],
                  warm_ranks: tuple[int, ...] = ()) -> Any:
    """Start an attempt's process (supervisor, main thread): with :func:`uses_local_ranks`
    every rank (:func:`start_local_ranks`), each local rank of ``warm_ranks`` from its warm
    spare (those the ``attempt_start`` event names), the others through a spare too
    (:meth:`cfrun.supervisor.standby.Standby.start_rank`: it then forks the next one); else
    the ready warm spare (``warm``: :meth:`cfrun.supervisor.standby.Standby.promote`), or
    for the one rank of ``--launcher python`` a spare started now, or ``spawn_fn(argv, env,
    cwd, **stdio)`` (torchrun, a job without spares, or a spare that failed). ``standby``:
    the :class:`cfrun.supervisor.standby.Standby`, or None.

    Raises:
        OSError: a process could not be started.
    """
    if uses_local_ranks(cfg):
        def promote(local_rank: int, rank_env: dict[str, str]) -> Any:
            if standby is None:
                return None
            if local_rank in warm_ranks:
                proc = standby.promote_rank(local_rank, rank_env)
                if proc is not None:
                    return proc
            return standby.start_rank(local_rank, env, rank_env) if standby.forks(env) \
                else None

        ranks, _ = start_local_ranks(cfg, argv, env, spawn_fn=spawn_fn, stdio=stdio,
                                     promote=promote)
        return ranks
    proc = standby.promote(env, argv) if warm and standby is not None else None
    if proc is None and standby is not None and standby.forks(env):
        proc = standby.start_rank(0, env, env)
    return proc if proc is not None else spawn_fn(argv, env, cfg.cwd, **stdio)


def start_local_ranks(cfg: RunConfig, argv: list[str], env: dict[str, str], *,
                      spawn_fn: Callable[..., Any],
                      promote: Callable[[int, dict[str, str]], Any] | None,
                      stdio: dict[str, Any]) -> tuple[LocalRanks, list[int]]:
    """Start the ``cfg.nproc_per_node`` ranks of one attempt (supervisor, main thread).

    Each local rank gets ``env`` (:func:`cfrun.supervisor.launcher.build_worker_env`) with
    its torchrun variables (:func:`cfrun.supervisor.launcher.local_rank_env`: one free
    ``MASTER_PORT`` and one run id for the attempt). ``promote(local_rank, rank_env)`` makes
    that rank's warm spare the rank (:meth:`cfrun.supervisor.standby.Standby.promote_rank`;
    None when it is not ready); else ``spawn_fn(argv, rank_env, cwd, **stdio)`` starts it cold
    (:func:`cfrun.supervisor.launcher.spawn`).

    Returns:
        The ranks, and the local ranks that were warm spares.

    Raises:
        OSError: a rank could not be started (the ranks started before it are killed).
    """
    port, run_id = free_port(), str(uuid.uuid4())
    procs: list[Any] = []
    warm: list[int] = []
    try:
        for local_rank in range(cfg.nproc_per_node):
            rank_env = local_rank_env(env, local_rank=local_rank,
                                      nproc_per_node=cfg.nproc_per_node, master_port=port,
                                      run_id=run_id)
            proc = promote(local_rank, rank_env) if promote is not None else None
            if proc is None:
                proc = spawn_fn(argv, rank_env, cfg.cwd, **stdio)
            else:
                warm.append(local_rank)
            procs.append(proc)
    except BaseException:
        for p in procs:
            try:
                p.kill()
                p.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        raise
    return LocalRanks(procs), warm
