"""Whether this process takes checkpoints at all: a state cfrun would save wrongly is never
claimed to be saved (:mod:`cfrun.rank.boundary`). FSDP1 state, an optimizer step captured in a
CUDA graph, or a script that updates its parameters by hand (no ``torch.optim`` step) leave the
job *unprotected*: said once, on stderr and (rank 0) as an ``unprotected`` event; the script
goes on untouched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cfrun.contract.jobdir import JobDir
from cfrun.rank.discovery import Discovery, uncheckpointable
from cfrun.rank.log import say
from cfrun.rank.settings import RankSettings

Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
"""``Guard.wrap`` (:mod:`cfrun.rank.install`): a hook made safe for the user's script."""

NO_OPTIMIZER_BACKWARDS = 100
"""``backward()`` calls with no ``torch.optim`` optimizer step in between after which a rank
says that its job is unprotected (a script that updates its parameters by hand: cfrun's steps
and checkpoints are the optimizers' steps). Gradient accumulation rarely spans this many."""


class BackwardWatch:
    """Counts autograd backward passes (``torch.autograd.backward``, which ``Tensor.backward``
    calls) until the first optimizer step; at ``limit`` of them with no step, calls
    ``on_unprotected(count)`` once. Either way it then restores torch's own function, so a
    training step pays for it only until the first optimizer step. Training thread.
    """

    def __init__(self, on_unprotected: Callable[[int], None],
                 limit: int = NO_OPTIMIZER_BACKWARDS) -> None:
        self.count = 0
        self._limit = limit
        self._on_unprotected = on_unprotected
        self._orig = torch.autograd.backward
        watch = self

        def backward(*args: Any, **kwargs: Any) -> Any:
            watch.count += 1
            if watch.count >= watch._limit:
                watch.stop()
                watch._on_unprotected(watch.count)
            return watch._orig(*args, **kwargs)

        self._counting = backward
        torch.autograd.backward = backward

    def stop(self) -> None:
        """Put torch's ``autograd.backward`` back (idempotent; not if someone replaced ours)."""
        if torch.autograd.backward is self._counting:
            torch.autograd.backward = self._orig


class Unprotected:
    """Why this process takes no checkpoints (:attr:`why`, None while it does), and the watch
    for a script with no optimizer step (:class:`BackwardWatch`, until the first step).
    Training thread.

    Args:
        step: the optimizer steps completed (for the event).
        wrap: guards the backward counter's call-back.
    """

    def __init__(self, settings: RankSettings, jobdir: JobDir, step: Callable[[], int],
                 wrap: Wrap) -> None:
        self.s = settings
        self.jobdir = jobdir
        self._step = step
        self.why: str | None = None
        """Why this process takes no checkpoints (FSDP1 state, a CUDA graph step)."""
        self._backward_watch: BackwardWatch | None = BackwardWatch(
            wrap("the backward() counter", self._no_optimizer))
        self._checked_layout = False

    def check_step(self, capturing: bool, found: Discovery) -> bool:
        """At each optimizer step: a step ``capturing`` in a CUDA graph (issue 18), or, at the
        first, FSDP1 state among the ``found`` objects, leave the job unprotected. Returns
        True when that was said now (:meth:`unprotect`)."""
        if capturing:
            return self.unprotect(
                "CUDA graph", "the optimizer step is captured in a CUDA graph: its replays run "
                "no optimizer hooks, so cfrun sees no steps and takes no checkpoints; capture "
                "the forward and backward only, and step the optimizer outside the graph")
        if not self._checked_layout:
            self._checked_layout = True
            why = uncheckpointable(found)
            if why is not None:
                return self.unprotect("FSDP1", why)
        return False

    def stepped(self) -> None:
        """An optimizer stepped: the backward watch is done."""
        if self._backward_watch is not None:
            self._backward_watch.stop()
            self._backward_watch = None

    def unprotect(self, where: str, why: str) -> bool:
        """No checkpoints in this process from now on: say ``why`` once, on stderr and (rank 0)
        as an ``unprotected`` event naming ``where``. Returns False when it was said already."""
        if self.why is not None:
            return False
        self.why = why
        self._report(
            where, f"{why}; this job is unprotected (no checkpoints, a restart starts over)", why)
        return True

    def _report(self, where: str, line: str, error: str) -> None:
        """``WARNING: line`` on stderr, and (rank 0) an ``unprotected`` event naming ``where``
        and ``error``."""
        say(f"WARNING: {line}")
        if self.s.rank == 0:
            self.jobdir.emit_event("unprotected", where=where, error=error, step=self._step(),
                                   rank=self.s.rank, attempt=self.s.attempt)

    def _no_optimizer(self, backwards: int) -> None:
        """:class:`BackwardWatch`: ``backwards`` backward passes and no optimizer step. Says
        once, on stderr and (rank 0) as an ``unprotected`` event, that no checkpoint will be
        taken; the script goes on untouched."""
        self._backward_watch = None
        self._report(
            "no optimizer",
            f"no torch.optim optimizer stepped after {backwards} backward() calls: this job is "
            "unprotected (no checkpoints, a restart starts over). cfrun counts steps and "
            "checkpoints at optimizer.step(); update the parameters with a torch.optim "
            "optimizer (e.g. torch.optim.SGD(params, lr)) instead of by hand",
            f"no torch.optim optimizer stepped after {backwards} backward() calls (parameters "
            "updated by hand?): no checkpoints")
