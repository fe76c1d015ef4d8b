"""How long a cfrun process lives: the Linux ``prctl`` settings that tie a child's life to its
parent's and let the supervisor reap what its children leave behind.

- :func:`die_with`: the calling process gets a signal (SIGKILL) when its parent dies
  (``PR_SET_PDEATHSIG``), and exits at once where the parent is already gone. The supervisor's
  children call it before their first line (:func:`cfrun.supervisor.launcher.die_with_parent`,
  a ``Popen`` ``preexec_fn``); a warm spare forked from another calls it once it is the
  supervisor's child (:func:`cfrun.rank.spare._fork_next_spare`).
- :func:`become_subreaper`: orphaned descendants of the calling process (ranks of a dead
  torchrun, a forked spare whose go-between exited) become its children
  (``PR_SET_CHILD_SUBREAPER``), which it reaps.

Linux sends the parent-death signal when the *thread* that forked the child exits: the
supervisor forks only from its main thread, its only one. Where ``prctl`` is missing (not
Linux) each call is a no-op. Torch-free; imported by the supervisor and the rank's spare.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where there is none. Look it up before a fork: the child of a
    ``Popen`` then calls it without loading a library."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with(parent_pid: int, *, orphan_exit_code: int, sig: int = signal.SIGKILL,
             prctl_fn: Callable[..., int] | None = None) -> None:
    """Make the calling process receive ``sig`` when its parent, ``parent_pid``, dies; exit at
    once with ``orphan_exit_code`` where it died already (``getppid`` is no longer
    ``parent_pid``: the signal would never come). ``prctl_fn`` is :func:`prctl`'s, looked up
    ahead; without it, it is looked up here. No-op where there is no ``prctl``."""
    fn = prctl_fn if prctl_fn is not None else prctl()
    if fn is None:
        return
    fn(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(orphan_exit_code)


def become_subreaper() -> None:
    """``PR_SET_CHILD_SUBREAPER`` on the calling process: orphaned descendants become its
    children. No-op where there is no ``prctl``."""
    fn = prctl()
    if fn is not None:
        fn(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
