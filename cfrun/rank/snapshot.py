"""Phase 1 of a checkpoint: copy the state into a reusable shared-memory slot, off the step path,
and hand it to the node's persist agent.

CheckFreq §4.3.1 (snapshot overlapped with compute; the next weight update waits for it),
ACUTE's Check-Mem, DeepFreeze's "blocking phase". One ``Snapshotter`` per rank; it keeps the
checkpoint in flight (its step, its handle, the snapshot thread serving it, what became of the
last one) and passes the checkpoint along the rooms that hold each piece of its data:

* **Slot** (:mod:`cfrun.rank.slot`). A file in the job's private slot directory in shared
  memory, mapped into the rank and read by the persist agent through ``mmap`` without any copy
  or unpickling. Allocated once, grown only if the state grows; on CUDA page-locked. Made ready
  on a background thread from the first optimizer step of each process (:meth:`prepare`), not in
  the first checkpoint (issue 23).
* **Copy plan** (:mod:`cfrun.rank.copyplan`). The slot layout, the slot views, the entries' JSON
  and the copy groups of a state are worked out once per layout; each group is one
  ``torch._foreach_copy_`` call (issue 23: ~640 tensors cost ~25 ms of Python per checkpoint).
* **What blocks the training loop** (:mod:`cfrun.rank.copier`). At the boundary after step s,
  small tensors and module buffers (BatchNorm statistics change in the next forward) are copied
  on the training thread; parameters and optimizer state, which only the next
  ``optimizer.step()`` changes, are copied in the background (a CPU thread: ``copy_`` releases
  the GIL; on CUDA a side stream). The next ``optimizer.step()`` waits for that copy
  (:meth:`Snapshotter.gate`): on CPU by waiting for the thread, on CUDA by making the current
  stream wait for the copy's event (the host never blocks). With ``gpu`` mode, or when free
  device memory allows, state is first copied device-to-device into a staging buffer taken from
  the caching allocator for that checkpoint only (CheckFreq's GPU snapshot), so the step waits
  only for that fast copy.
* **CUDA details** (:mod:`cfrun.rank.cudacopy`). One side stream per device (cfrun's own,
  created once, reused), which first waits for an event recorded at the boundary and for those
  the step hook recorded on the streams the optimizer steps ran on. If the slot cannot be
  page-locked, the snapshot thread does the copy once those events are complete, and the next
  step waits for the thread. The snapshot thread makes the state's device current first. The
  training thread never waits for the queued step (only ``inline`` mode does); the background
  thread waits for the copies' events before the hand-off and holds the source tensors until
  then. Tensors on several devices get one stream, event and gate per device.
* **The verdict** (:mod:`cfrun.rank.verdict`). A checkpoint whose late-copied tensors the
  script wrote before the copy was complete is dropped, never committed (DESIGN 9b; issue 33).
* **Hand-off** (:mod:`cfrun.rank.handoff`). When the copy is complete the rank sends the agent
  one message (step, slot, bytes, the JSON tree); from then on the agent persists and commits it
  even if the rank dies. A rank waits for the agent's reply only so long, then the checkpoint
  counts as failed (``persist_lost``) and the next checkpoint reconnects (issue 13).
* **At most one checkpoint in flight.** A checkpoint that comes due while the previous one is
  still being persisted is deferred (:meth:`cfrun.rank.boundary.Boundary._in_flight`: a rule
  every rank evaluates alike), never stalled on, so a failure rolls back at most one
  checkpoint and a slow disk costs frequency, not step time.
* **The event** (:mod:`cfrun.rank.checkpoint_event`). The boundary's, the gate's and the
  persist's measurements become one ``checkpoint`` event.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cfrun.codec.format import FORMAT_VERSION, plan_layout
from cfrun.contract import messages
from cfrun.rank.checkpoint_event import CheckpointEvent
from cfrun.rank.copier import Copier, CopyJob
from cfrun.rank.handoff import AgentLink
from cfrun.rank.slot import SLOT_ALIGN_BYTES, SnapshotSlot
from cfrun.rank.verdict import TornSnapshotError

logger = logging.getLogger(__name__)

PREPARE_HEADROOM = 1 / 64
"""A slot prepared ahead of the first checkpoint (:meth:`Snapshotter.prepare`) is this much
larger than the models' and optimizers' tensors (for the script's own tensors)..."""
PREPARE_HEADROOM_MIN_BYTES = 1 << 20
"""... and at least this many bytes larger."""


class SnapshotHandle:
    """One checkpoint given to :meth:`Snapshotter.start`, on its way: copied, handed off to the
    agent, then persisted and committed there, all in the background (torchsnapshot's
    ``PendingSnapshot``). Any thread may wait on it.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        """The step the checkpoint holds."""
        self._finished = threading.Event()
        self._committed = False
        self._error: BaseException | None = None
        self._before_wait: Callable[[], Any] | None = None
        """Gives the checkpoint's verdict first when the training thread waits
        (:meth:`Snapshotter.give_verdict`)."""

    def done(self) -> bool:
        """True once the background work of this checkpoint has ended, however it ended."""
        return self._finished.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` seconds (None: no limit) for the background work to end.

        Returns True when the agent committed the checkpoint; False when it is still in flight
        after ``timeout_s`` or the agent refused it (its reason in
        :attr:`Snapshotter.last_error`).

        Raises:
            Exception: what ended the copy or the hand-off in the background thread (e.g.
                ``ConnectionError``/``OSError``: no persist agent), re-raised here.
        """
        if self._before_wait is not None:
            self._before_wait()
        if not self._finished.wait(timeout_s):
            return False
        if self._error is not None:
            raise self._error
        return self._committed

    def _settle(self, committed: bool, error: BaseException | None) -> None:
        """Background thread: the checkpoint's outcome (before the slot is free again)."""
        self._committed = committed
        self._error = error
        self._finished.set()


class Snapshotter:
    """Rank-side two-phase checkpointing: the checkpoint in flight. Training-thread API:
    ``ready``, ``busy``, ``start`` (returns a :class:`SnapshotHandle`), ``gate``,
    ``wait_idle``; the snapshot thread finishes each checkpoint's copy, hands it off and
    awaits the persist.

    Holds the slot (:class:`SnapshotSlot`), the copy engine (:attr:`copier`), the link to the
    agent (:attr:`link`) and the checkpoint's measurements (:class:`CheckpointEvent`); of
    its own, the in-flight step, :attr:`persist_done`, the snapshot thread and its queue, and
    what became of the last checkpoint (:attr:`last_error`, :attr:`last_committed`,
    :attr:`last_cost_s`, :attr:`last_dropped_step`).

    Args:
        emit: called with a ``checkpoint`` event's fields when a checkpoint is committed and
            its stall is known (rank 0 writes it to events.jsonl; the fields:
            :class:`cfrun.rank.checkpoint_event.CheckpointEvent`).
        on_lost: called (background thread) with a step whose hand-off failed because the agent
            was unreachable or died, or because the copy or hand-off raised; the next
            checkpoint reconnects.
    """

    def __init__(self, job_dir: Path, rank: int, world_size: int, attempt: int,
                 emit: Callable[[dict[str, Any]], None],
                 on_lost: Callable[[int, str], None] = lambda step, error: None) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.on_lost = on_lost
        self.slot = SnapshotSlot(job_dir, rank)
        self.copier = Copier()
        self.link = AgentLink(job_dir, rank, attempt, on_ready=self._remove_stale_slots)
        self.event = CheckpointEvent(emit)
        self.persist_done = threading.Event()
        self.persist_done.set()
        self.thread: threading.Thread | None = None
        """The snapshot thread (``cfrun-snapshot``): one for the process's life, started ahead
        of the first checkpoint (:meth:`prepare_bytes`), serving one checkpoint at a time
        (:meth:`_serve`). Starting a thread per checkpoint held the training thread 4-7 ms
        on a 2-core machine: ``Thread.start()`` waits until the new thread runs, and the new
        thread then keeps the GIL for up to a switch interval (issue 23)."""
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._inflight = -1
        self.last_error: str | None = None
        self.last_dropped_step: int | None = None
        """The newest checkpoint dropped by :meth:`give_verdict` (``on_lost`` says it so)."""
        self.last_cost_s = 0.0
        """Seconds the last checkpoint took from snapshot start to commit (for the grace)."""
        self.last_committed = -1

    @property
    def handed_off(self) -> threading.Event:
        """Set once the agent has the in-flight checkpoint (or its hand-off failed): from then
        on a SIGKILL of this rank no longer loses it (:meth:`Boundary.on_before_step` waits)."""
        return self.link.handed_off

    @property
    def mode(self) -> str:
        """The copy mode (:data:`cfrun.rank.copier.ENV_SNAPSHOT_MODE`)."""
        return self.copier.mode

    @mode.setter
    def mode(self, mode: str) -> None:
        self.copier.mode = mode

    def use_mode(self, mode: str) -> None:
        """Copy the next checkpoints in ``mode`` (the tuner's choice), unless
        ``CFRUN_SNAPSHOT_MODE`` forces one."""
        self.copier.use_mode(mode)

    def ready(self, timeout_s: float = 120.0) -> bool:
        """Connect to the persist agent and wait until it has drained earlier work.

        Called before looking for checkpoints, so a snapshot handed off by a previous attempt
        of this rank is committed first; then deletes the slots of dead earlier ranks. Returns
        False if no agent answers (then checkpoints are written synchronously by the caller).
        """
        return self.link.connect(timeout_s)

    def _remove_stale_slots(self) -> None:
        try:
            self.slot.remove_stale()
        except OSError as e:
            logger.warning("cfrun: could not remove old snapshot slots: %r", e)

    # ------------------------------------------------------------------ training thread

    def busy(self) -> bool:
        """True while the previous checkpoint is being copied or persisted."""
        return not self.persist_done.is_set()

    @property
    def inflight_step(self) -> int | None:
        """Step of the checkpoint being copied or persisted, if any."""
        return self._inflight if self.busy() else None

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` seconds (None: no limit) until no checkpoint is in flight,
        however the last one ended (errors were reported through ``on_lost``). Returns True
        when idle. Any thread; on the training thread it first gives the in-flight
        checkpoint's verdict (:meth:`give_verdict`: the script writes nothing while it waits)."""
        self.copier.verdict.give_if_training_thread()
        return self.persist_done.wait(timeout_s)

    def wait_copied(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` seconds until no host-thread copy reads the live tensors
        (what :meth:`gate` waits for). Returns True when none does."""
        self.copier.verdict.give_if_training_thread()
        return self.copier.copy_done.wait(timeout_s)

    def prepare(self, tensors: list[torch.Tensor]) -> int:
        """Make the slot ready for a state like ``tensors`` (the models' and optimizers':
        :meth:`cfrun.rank.capture.Capture.model_tensors`) before the first checkpoint, off the
        training thread: allocated, every page written once and, with CUDA tensors,
        page-locked (:meth:`SnapshotSlot.prepare`), so the first checkpoint costs what the
        others cost (issue 23). The size is theirs plus :data:`PREPARE_HEADROOM` for the
        script's variables, the RNG and the data position (a larger state grows the slot at
        its checkpoint, as before). Training thread; nothing when a checkpoint is in flight.
        Returns the bytes asked for (0 when nothing was done)."""
        _, nbytes = plan_layout(tensors)
        return self.prepare_bytes(nbytes, sorted({t.device for t in tensors if t.is_cuda},
                                                 key=str))

    def prepare_bytes(self, nbytes: int, devices: list[torch.device]) -> int:
        """:meth:`prepare` for a state of about ``nbytes`` with tensors on ``devices`` (CUDA
        ones; none: not page-locked). Nothing when a checkpoint is in flight or the slot is
        (being) prepared at least this large already. Returns the bytes asked for, or 0."""
        nbytes += max(PREPARE_HEADROOM_MIN_BYTES, int(nbytes * PREPARE_HEADROOM))
        nbytes = -(-nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        self._ensure_thread()
        if self.busy() or nbytes <= self.slot.prepared_bytes:
            return 0
        self.slot.prepare(nbytes, pin=bool(devices), device=devices[0] if devices else None)
        return nbytes

    def gate(self) -> float:
        """Make the coming ``optimizer.step()`` wait until the snapshot no longer reads the live
        tensors (:meth:`cfrun.rank.copier.Copier.gate`). Returns the seconds the training
        thread was blocked.

        Called from the optimizer step pre-hook on the training thread. CUDA copies are waited
        for on the device (each device's current stream waits for the copy's event); only a
        host-thread copy blocks the host.
        """
        t0 = time.perf_counter()
        first = self.event.awaiting_gate()
        timed = self.copier.gate(timed=first)
        waited = time.perf_counter() - t0
        if first:
            self.event.update(gate_s=waited, gate_events=timed)
        return waited

    def give_verdict(self) -> list[int]:
        """Check that the script wrote none of the tensors the in-flight checkpoint copies
        after its boundary before the copy is known to be complete, and let the snapshot
        thread hand the checkpoint off, or drop it (:meth:`cfrun.rank.verdict.Verdict.give`).
        Training thread only, at the next ``optimizer.step()``'s gate or whenever it waits for
        the checkpoint. Returns the positions found written (empty: the checkpoint is exact)."""
        return self.copier.verdict.give()

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        """Optimizer step post-hook (training thread): the events a CUDA copy is ordered after
        (:meth:`cfrun.rank.cudacopy.CudaCopies.after_step`)."""
        self.copier.cuda.after_step(opt)

    def start(self, step: int, tree: Any, tensors: list[torch.Tensor], async_ids: set[int],
              meta: dict[str, Any], t_trigger: float, t_boundary: float, *,
              capture_s: float | None = None) -> SnapshotHandle:
        """Copy ``tensors`` into the slot and hand the checkpoint to the agent.

        Training thread, every rank, only when :meth:`busy` is False. Small tensors and those
        not in ``async_ids`` are copied now (CUDA ones asynchronously on the current stream);
        the rest in the background. Returns without waiting for any of it, except in
        ``inline`` mode: the handle's ``wait()`` waits for the commit and re-raises an error of
        the background thread. Raises OSError/RuntimeError when the synchronous part fails
        (the caller logs it). ``t_boundary``: ``time.perf_counter()`` when the boundary's work
        began; ``capture_s``: the seconds of it the caller spent capturing the state (the
        ``checkpoint`` event then splits its stall: ``capture_s``, and ``enqueue_s`` for this
        call's part: the slot, the copy plan, the copies started).
        """
        plan, job = self.copier.start(self.slot, tensors, async_ids)
        doc = {"format_version": FORMAT_VERSION, "rank": self.rank, "tree": tree,
               "tensors": plan.entry_docs, "meta": meta}
        msg = messages.PersistRequest(step, self.rank, self.world_size, str(self.slot.path),
                                      plan.total, doc, t_trigger).to_json()
        self._inflight = step
        self.persist_done.clear()
        self.handed_off.clear()
        self.event.begin(step, t_trigger, capture_s)
        handle = SnapshotHandle(step)
        handle._before_wait = self.copier.verdict.give_if_training_thread
        self._ensure_thread()
        self._jobs.put((job, msg, handle))
        self.event.update(boundary_s=time.perf_counter() - t_boundary)  # all of it is stall
        return handle

    def quiesce(self, timeout_s: float) -> bool:
        """cfrun turns itself off (:meth:`cfrun.rank.runtime.Runtime.on_disabled`; the step
        gate is off from then on): wait up to ``timeout_s`` seconds until no copy of the
        in-flight snapshot reads the live tensors. If they do not finish in time, the snapshot
        is dropped rather than handed off: the next step may change the tensors under the
        copy, and a torn snapshot must not be committed (issue 18, item 2). Returns True when
        nothing was left to copy (:meth:`cfrun.rank.copier.Copier.quiesce`)."""
        return self.copier.quiesce(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """At exit: let the last hand-off and persist finish, then free the slot and end the
        snapshot thread."""
        if self.copier.verdict.pending:  # the script has ended: it writes nothing more
            self.give_verdict()
        self.wait_idle(timeout_s)
        if self.thread is not None and not self.busy():
            self._jobs.put(None)
        self.slot.wait_prepared()
        self.gate()
        if not self.busy():
            self.slot.release()

    # ------------------------------------------------------------------ snapshot thread

    def _ensure_thread(self) -> None:
        """Start the snapshot thread if it is not running (the first call, or after it died:
        it never should, :meth:`_background` catches everything)."""
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._serve, name="cfrun-snapshot",
                                           daemon=True)
            self.thread.start()

    def _serve(self) -> None:
        """The snapshot thread: each checkpoint :meth:`start` queues, in turn (at most one is
        in flight), until :meth:`close` queues None."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._background(*job)
            del job  # no reference to the sources and the slot views until the next one

    def _background(self, job: CopyJob, msg: dict[str, Any], handle: SnapshotHandle) -> None:
        """Finish the copy, wait for the verdict, hand off, await the persist. Never dies
        silently: any error is reported once (``on_lost``) and kept for ``handle.wait()``, and
        the in-flight flags are always cleared."""
        step = int(msg["step"])
        stage = "copy"
        committed = False
        error: BaseException | None = None
        try:
            snapshot_s = self.copier.finish(job)
            self.copier.check(step, msg)
            stage = "hand-off"
            committed = self._hand_off(step, msg, snapshot_s)
        except Exception as e:
            error = e
            self._lost(step, stage, e)
        finally:
            self.copier.release(job)  # before the slot and the sources may be reused
            handle._settle(committed, error)
            self.handed_off.set()
            self.persist_done.set()

    def _lost(self, step: int, stage: str, e: Exception) -> None:
        """Snapshot thread: the checkpoint of ``step`` failed at ``stage``: say why
        (:attr:`last_error`, ``on_lost``) and drop the connection after a failed hand-off."""
        if stage == "hand-off" and isinstance(e, TimeoutError):
            self.last_error = (f"no reply from the persist agent for step {step} within "
                               f"{self.link.reply_timeout_s():.0f} s; counted as failed")
        elif stage == "hand-off" and isinstance(e, OSError):
            self.last_error = f"persist agent unavailable: {e!r}"
        elif isinstance(e, TornSnapshotError):
            self.last_error = str(e)
            self.last_dropped_step = step
        else:
            self.last_error = f"snapshot {stage} of step {step} failed: {e!r}"
        if stage == "hand-off":
            self.link.drop()  # a reply may still come: start afresh
        try:
            self.on_lost(step, self.last_error)
        except Exception as e2:
            logger.warning("cfrun: %s (reporting it failed too: %r)", self.last_error, e2)

    def _hand_off(self, step: int, msg: dict[str, Any], snapshot_s: float) -> bool:
        """Send the checkpoint to the agent and wait for its commit (snapshot thread).
        Returns True when the agent committed it, False when it refused it."""
        reply = self.link.persist(step, msg)
        if not reply.get("ok"):
            self.last_error = str(reply.get("error"))
            return False
        self.last_error = None  # an earlier problem is over (said at exit only if it lasts)
        self.last_cost_s = snapshot_s + float(reply["persist_s"])
        self.last_committed = step
        self.event.update(snapshot_s=snapshot_s, tier=reply.get("tier", "local"), **{
            k: reply[k] for k in ("bytes", "persist_s", "pgt_s", "bandwidth_bytes_per_s")})
        return True
