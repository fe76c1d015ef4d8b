"""The copy of a checkpoint into the snapshot slot: what is copied at the boundary, what later,
and when the next ``optimizer.step()`` may proceed (:mod:`cfrun.rank.snapshot`, "What blocks the
training loop").

At the boundary after step s, small tensors and module buffers (BatchNorm statistics change in
the next forward) are copied on the training thread; parameters and optimizer state, which only
the next ``optimizer.step()`` changes, are copied later: by the snapshot thread on CPU
(``copy_`` releases the GIL), on cfrun's side streams on CUDA (:mod:`cfrun.rank.cudacopy`). The
next step waits for that copy (:meth:`Copier.gate`): on CPU by waiting for the thread, on CUDA
by making the current stream wait for the copy's event (the host never blocks). Whether the
script wrote a late-copied tensor meanwhile is the verdict's (:mod:`cfrun.rank.verdict`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from cfrun.contract import faults
from cfrun.contract.settings import SNAPSHOT_MODE
from cfrun.rank import cuda
from cfrun.rank.copyplan import SYNC_COPY_MAX_BYTES, CopyPlan, copy_all, plan_key
from cfrun.rank.cudacopy import CudaCopies, DeviceEvents, Pairs, synchronize
from cfrun.rank.slot import SnapshotSlot
from cfrun.rank.verdict import Verdict

logger = logging.getLogger(__name__)

ENV_SNAPSHOT_MODE = SNAPSHOT_MODE
"""``thread`` (default on CPU): background copy; ``inline``: copy on the training thread;
``gpu``/``host`` force or forbid the device-side first copy on CUDA (default: when it fits)."""


@dataclass
class CopyJob:
    """What is left of one checkpoint's copy for the snapshot thread (:meth:`Copier.finish`)."""

    later_cpu: Pairs
    """(slot view, live CPU tensor) pairs the snapshot thread copies."""
    later_cuda: Pairs
    """(slot view, live CUDA tensor) pairs queued on the side streams, or, with
    :attr:`host_copy`, copied by the snapshot thread; the sources are held until then."""
    done_events: DeviceEvents = field(default_factory=list)
    """Per device, the events complete once the CUDA copies have landed (or, with
    :attr:`host_copy`, once the step and the boundary are done with the tensors)."""
    host_copy: bool = False
    """The slot is not page-locked: the snapshot thread copies :attr:`later_cuda` itself."""


class Copier:
    """One rank's copy engine: the copy mode, the copy plan of the last layout, the CUDA side
    streams (:class:`CudaCopies`), the verdict (:class:`Verdict`) and :attr:`copy_done`, the
    flag the step gate waits on. Training thread, except :meth:`finish`, :meth:`check` and
    :meth:`release` (the snapshot thread, one checkpoint at a time)."""

    def __init__(self) -> None:
        self.mode = os.environ.get(ENV_SNAPSHOT_MODE, "thread")
        self.mode_is_forced = ENV_SNAPSHOT_MODE in os.environ
        self.cuda = CudaCopies()
        self.verdict = Verdict()
        self.copy_done = threading.Event()
        """Set when no host-thread copy reads the live tensors (what :meth:`gate` waits for)."""
        self.copy_done.set()
        self.cancelled = False
        """Set by :meth:`quiesce` when the copy did not finish in time: the snapshot is
        dropped, not handed off."""
        self._plan: tuple[tuple[Any, ...], CopyPlan] | None = None
        """(key, plan) of the last checkpoint's layout (:meth:`plan_for`)."""
        self._warned: set[str] = set()
        # fault points (cfrun.contract.faults), read once: their defaults in every real run
        self.copy_delay_s = float(faults.value("rank.snapshot_copy_delay_s") or 0)
        sync_max = faults.value("rank.sync_copy_max_bytes")
        self.sync_copy_max_bytes = SYNC_COPY_MAX_BYTES if sync_max is None else int(sync_max)

    def use_mode(self, mode: str) -> None:
        """Copy the next checkpoints in ``mode`` (the tuner's choice), unless
        ``CFRUN_SNAPSHOT_MODE`` forces one."""
        if not self.mode_is_forced:
            self.mode = mode

    def plan_for(self, tensors: list[torch.Tensor], async_flags: list[bool]) -> CopyPlan:
        """The copy plan of this state's layout: the last one when the layout, the mode and
        the small-tensor limit are unchanged, else a new one."""
        key = (self.mode == "inline", self.sync_copy_max_bytes, plan_key(tensors, async_flags))
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, CopyPlan(tensors, async_flags, key[0], key[1]))
        return self._plan[1]

    def start(self, slot: SnapshotSlot, tensors: list[torch.Tensor], async_ids: set[int]
              ) -> tuple[CopyPlan, CopyJob]:
        """Boundary (training thread): copy into ``slot`` now what cannot wait, queue the CUDA
        copies, watch the late ones' version counters, and return the plan and what is left
        for the snapshot thread. Small tensors and those not in ``async_ids`` are copied now
        (CUDA ones asynchronously on the current stream); in ``inline`` mode everything.
        Raises OSError/RuntimeError when the slot or a copy fails (nothing is in flight then).
        """
        written = self.verdict.written_positions
        async_flags = [id(t) in async_ids and not (written and i in written)
                       for i, t in enumerate(tensors)]
        plan = self.plan_for(tensors, async_flags)
        devices = plan.devices
        buf = slot.ensure(plan.total, pin=bool(devices), device=devices[0] if devices else None)
        plan.bind(buf, slot.generation)
        host_copy = bool(devices) and not slot.pinned
        if host_copy:
            self._warn_once("unpinned", f"cfrun: the snapshot slot could not be page-locked "
                            f"({slot.pin_error}); CUDA state is copied from the snapshot "
                            "thread, and the next optimizer step waits for that copy")
        inline = self.mode == "inline"
        with torch.no_grad():  # a copy from a parameter must not record autograd history
            copy_all(*plan.pairs(buf, plan.now, tensors))
        job = CopyJob(list(zip(plan.dsts(plan.later_cpu), [tensors[i] for i in plan.later_cpu])),
                      list(zip(plan.dsts(plan.later_cuda),
                               [tensors[i] for i in plan.later_cuda])),
                      host_copy=host_copy)
        if devices:
            job.done_events = self.cuda.enqueue(
                buf, job.later_cuda, [plan.entries[i] for i in plan.later_cuda], devices,
                mode=self.mode, copy=not host_copy,
                crossing=bool(plan.crossing.intersection(plan.later_cuda)))
        if inline:
            synchronize(job.done_events)
            if host_copy:
                for dst, src in job.later_cuda:
                    dst.copy_(src.detach())
            job.later_cuda = []
        self.verdict.watch(plan.later_cpu + ([] if inline else plan.later_cuda), tensors)
        if job.later_cpu or (host_copy and job.later_cuda):
            self.copy_done.clear()
        self.cancelled = False
        return plan, job

    def gate(self, *, timed: bool) -> list[tuple[Any, Any]]:
        """The next ``optimizer.step()``'s pre-hook (training thread): give the in-flight
        checkpoint's verdict, make the CUDA streams wait for its copy, wait for the snapshot
        thread's copy. Returns the CUDA timing events of the waits with ``timed``
        (:meth:`CudaCopies.wait_gates`)."""
        if self.verdict.pending:  # only at the step after a checkpoint
            self.verdict.give()
        timed_pairs = self.cuda.wait_gates(timed=timed)
        if not self.copy_done.is_set():  # set at nearly every step: no lock taken then
            self.copy_done.wait()
        return timed_pairs

    def quiesce(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until no copy of the in-flight snapshot reads the
        live tensors, the snapshot thread's and the CUDA copies the gate would have made the
        next step wait for (their events are polled: the host waits, once). If they do not
        finish in time the snapshot is marked :attr:`cancelled`. Returns True when nothing
        was left to copy."""
        deadline = time.monotonic() + timeout_s
        if self.verdict.pending:
            self.verdict.give()
        ok = self.copy_done.wait(timeout_s)
        if ok:
            ok = self.cuda.poll_gates(deadline)
        else:
            self.cuda.gates = []
        if not ok:
            self.cancelled = True
        return ok

    def finish(self, job: CopyJob) -> float:
        """Snapshot thread: make the copy of ``job`` complete (the CPU copies, the host-side
        CUDA copies of an unpinned slot, the side streams' copies). Returns its seconds.

        Before any CUDA call the thread makes the state's first device its current one (a
        thread starts on device 0, and its first CUDA call would create a context there: on
        every rank, ~500 MB of GPU 0; issue 18, item 4). With ``host_copy`` (the slot is not
        page-locked) it copies the CUDA tensors itself once the step's and the boundary's
        events are complete, and the next step's gate waits for it (issue 18, item 7)."""
        if job.done_events:
            torch.cuda.set_device(job.done_events[0][0])
            cuda.relax_capture_mode()
        t0 = time.perf_counter()
        if self.copy_delay_s > 0:
            time.sleep(self.copy_delay_s)
        with torch.no_grad():
            copy_all([d for d, _ in job.later_cpu], [src for _, src in job.later_cpu])
        if job.host_copy:
            synchronize(job.done_events)
            self.cuda.copy_on_side_streams(job.later_cuda)
        self.copy_done.set()
        synchronize(job.done_events)
        job.later_cuda = []  # the side streams are done with the sources
        return time.perf_counter() - t0

    def check(self, step: int, msg: dict[str, Any]) -> None:
        """Snapshot thread, after :meth:`finish`: wait for the verdict; may the checkpoint of
        ``step`` (hand-off message ``msg``) be handed off?

        Raises:
            TornSnapshotError: the script wrote a late-copied tensor before the copy was done.
            RuntimeError: cfrun was turned off before the copy finished (:meth:`quiesce`).
        """
        self.verdict.check(step, msg)
        if self.cancelled:
            raise RuntimeError("cfrun was turned off before this snapshot's copy finished "
                               "(the next step may have changed it): dropped")

    def release(self, job: CopyJob) -> None:
        """Snapshot thread, however the checkpoint ended: the gate is open, the CUDA copies are
        over (before the slot and the sources may be reused), the sources let go."""
        self.copy_done.set()
        try:
            synchronize(job.done_events)
        except Exception:
            pass
        job.later_cpu = []
        job.later_cuda = []

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
