"""The CUDA half of a checkpoint's copy: cfrun's side streams, the events that order a copy after
the optimizer step's kernels, and the gates the next step's streams wait on
(:mod:`cfrun.rank.snapshot`, "CUDA details").

Small tensors and module buffers are copied with ``non_blocking=True`` on the current stream,
ordered before the next forward without a host sync (:class:`cfrun.rank.copier.Copier`). The
rest is copied here, on one side stream per device (cfrun's own, created once, reused), which
first waits for an event recorded at the boundary and for those :meth:`CudaCopies.after_step`
recorded on the streams the optimizer steps ran on. With the staging buffer (``gpu`` mode, or
when free device memory allows) state is first copied device-to-device into a buffer taken from
the caching allocator for that checkpoint only (CheckFreq's GPU snapshot), so the next step
waits only for that fast copy. The buffer is taken on the training stream before the boundary's
event is recorded, so that what its allocation queues there (under
``torch.use_deterministic_algorithms``, a fill) comes before the side stream's copies (issue
33). Tensors on several devices get one stream, event and gate per device. One
:class:`CudaCopies` per rank; training thread, except
:meth:`CudaCopies.copy_on_side_streams` (the snapshot thread, slot not page-locked).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from cfrun.codec.format import TensorEntry
from cfrun.rank import cuda
from cfrun.rank.copyplan import copy_all, run_layout, split_pairs, staged_view

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
"""(slot view, live tensor) of each copy."""
DeviceEvents = list[tuple[torch.device, Any]]
"""(device, ``torch.cuda.Event``) pairs."""


class CudaCopies:
    """The side streams, the step events and the pending gates of one rank's CUDA copies.

    Holds, for the process's life, one side stream per device (:meth:`side_stream`) and the
    events :meth:`after_step` records; for the checkpoint in flight, the ``(device, event)``
    gates the next step's current streams wait on (:meth:`wait_gates`), cleared there.
    """

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}
        """device -> cfrun's side stream there (:meth:`side_stream`)."""
        self.step_events: dict[tuple[torch.device, int], Any] = {}
        """(device, stream handle) -> an event recorded there after the last optimizer step
        that ran on that stream (:meth:`after_step`): the side stream waits for all of them."""
        self.gates: DeviceEvents = []
        """What the next step's stream on each device waits for (:meth:`enqueue`)."""

    def side_stream(self, device: torch.device) -> Any:
        """This device's side stream, created on first use and reused by every checkpoint: a
        stream of cfrun's own (:func:`cfrun.rank.cuda.dedicated_stream`), not one of torch's
        pool that NCCL or the script may be using too."""
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = cuda.dedicated_stream(device)
        return stream

    def after_step(self, opt: torch.optim.Optimizer) -> None:
        """Optimizer step post-hook (training thread): on each CUDA device of ``opt``'s
        parameters, record an event on the stream current now, the one the step's kernels
        went to. A checkpoint's side stream waits for these events as well as for the stream
        current at the boundary: a loop body under ``with torch.cuda.stream(s)`` steps on
        ``s``, and a copy ordered after the boundary's stream alone would race that step (a
        snapshot mixing two steps; issue 18, item 6). Not while a CUDA graph is captured."""
        groups = opt.param_groups
        count = sum(len(g["params"]) for g in groups)
        cached = opt.__dict__.get("_cfrun_cuda_devices")
        if cached is None or cached[0] != count:
            devs = sorted({p.device for g in groups for p in g["params"]
                           if isinstance(p, torch.Tensor) and p.is_cuda}, key=str)
            cached = opt.__dict__["_cfrun_cuda_devices"] = (count, devs)
        if not cached[1]:
            return
        if len(self.step_events) > 64:  # streams come and go: keep the recent ones
            self.step_events.clear()
        for device in cached[1]:
            stream = torch.cuda.current_stream(device)
            key = (device, int(stream.cuda_stream))
            event = self.step_events.get(key)
            if event is None:
                event = self.step_events[key] = torch.cuda.Event()
            event.record(stream)

    def enqueue(self, buf: torch.Tensor, pairs: Pairs, entries: list[TensorEntry],
                devices: list[torch.device], *, mode: str, copy: bool = True,
                crossing: bool = False) -> DeviceEvents:
        """Queue the device-to-host copies of ``pairs`` (slot view, live tensor; ``entries``
        their places in the slot ``buf``) on each device's side stream.

        Training thread. The side stream first waits for an event recorded on the stream
        current at the boundary, after everything this checkpoint queued there (the staging
        buffer's allocation included: :meth:`_staging`), and for the streams the optimizer
        steps ran on (:meth:`after_step`). With the staging buffer (``mode`` ``gpu``, or free
        device memory for it unless ``host``) the tensors are first copied into it
        (:meth:`_stage`); without it, one ``_foreach_copy_`` into the slot, each tensor whose
        slot range spans two page-locked pieces cut there when ``crossing`` (:meth:`_direct`).

        Returns ``(device, event)`` pairs: with ``copy``, one per device, complete once every
        copy into the slot from that device (the current-stream ones included) has landed,
        and sets the gates :meth:`wait_gates` makes the next step's stream wait for. Without
        ``copy`` (the slot is not page-locked: a copy into it would block this thread), nothing
        is queued and the events are those the snapshot thread waits for before it copies.
        Never blocks the host.
        """
        by_device: dict[torch.device, list[int]] = {d: [] for d in devices}
        for i, (_, src) in enumerate(pairs):
            by_device[src.device].append(i)
        done_events: DeviceEvents = []
        self.gates = []
        for device, idx in by_device.items():
            with torch.cuda.device(device):
                dev_pairs = [pairs[i] for i in idx]
                dev_entries = [entries[i] for i in idx]
                # the staging buffer first: it comes from the training stream, and whatever
                # its allocation queues there (under torch.use_deterministic_algorithms, a
                # fill with 0xFF: NaN as float32) must run before the side stream writes it
                staging = self._staging(device, dev_entries, mode) if idx and copy else None
                current = torch.cuda.current_stream(device)
                ready = torch.cuda.Event()
                ready.record(current)  # after the step, the boundary's copies, the buffer
                waits = [ready] + [ev for (d, _), ev in self.step_events.items()
                                   if d == device]
                if not idx:  # only current-stream copies from this device
                    done_events.append((device, ready))
                    continue
                side = self.side_stream(device)
                if not copy:  # the snapshot thread copies, on this side stream
                    done_events.extend((device, ev) for ev in waits)
                    continue
                for ev in waits:
                    side.wait_event(ev)
                if staging is not None:
                    gate, done = self._stage(side, buf, [s.detach() for _, s in dev_pairs],
                                             staging)
                else:
                    gate, done = self._direct(side, buf, dev_pairs, dev_entries,
                                              crossing=crossing)
                self.gates.append((device, gate))
                done_events.append((device, done))
        return done_events

    @staticmethod
    def _staging(device: torch.device, entries: list[TensorEntry], mode: str
                 ) -> _Staging | None:
        """The device-side staging buffer for tensors going to the slot places ``entries``
        (``mode`` ``gpu``, or free device memory for it unless ``host``), else None. Taken
        from the caching allocator on the training stream (current here): once the copy is
        done its memory goes back to that stream's pool, which the next steps allocate from
        (issue 18, item 5). Training thread, before the event the side stream waits for is
        recorded (:meth:`enqueue`): an allocation is a use of the memory on the stream it is
        made on, and under ``torch.use_deterministic_algorithms(True)`` (with
        ``torch.utils.deterministic.fill_uninitialized_memory``, the default) ``torch.empty``
        fills the buffer there, a kernel the side stream's copies into it must follow (issue
        33: the fill ran between the side stream's two copies, and a checkpoint held NaN)."""
        offsets, runs, staged_bytes = run_layout(entries)
        if not (mode == "gpu" or (mode != "host" and (
                torch.cuda.mem_get_info(device)[0] > 1.2 * staged_bytes + (256 << 20)))):
            return None
        return _Staging(torch.empty(staged_bytes, dtype=torch.uint8, device=device), offsets,
                        runs)

    @staticmethod
    def _direct(side: Any, buf: torch.Tensor, pairs: Pairs, entries: list[TensorEntry], *,
                crossing: bool) -> tuple[Any, Any]:
        """Queue one device's copies straight into the slot on its side stream ``side``, one
        ``_foreach_copy_``, each tensor whose slot range spans two page-locked pieces cut
        there when ``crossing``; returns (the event the next step waits for, the event
        complete once the copies have landed): the same one."""
        dsts = [d for d, _ in pairs]
        sources = [s.detach() for _, s in pairs]
        if crossing:  # a tensor spans two page-locked pieces: cut it there
            dsts, sources = split_pairs(buf, dsts, sources, entries)
        with torch.cuda.stream(side):
            copy_all(dsts, sources)
            done = torch.cuda.Event()
            done.record(side)
        return done, done

    @staticmethod
    def _stage(side: Any, buf: torch.Tensor, sources: list[torch.Tensor], staging: _Staging
               ) -> tuple[Any, Any]:
        """Copy ``sources`` into the device-side staging buffer (:meth:`_staging`) with one
        ``torch._foreach_copy_``, then into the slot with one copy per run of tensors that lie
        back to back in the slot (the slot's alignment padding between them is copied too,
        not zeroed), cut at the page-locked pieces, all on the side stream ``side``. The
        buffer is this checkpoint's only and goes back to the caching allocator
        (``record_stream``) as soon as the copy is done, so nothing stays reserved between
        checkpoints or after the tuner settles on ``inline`` (issue 18, item 5). Returns
        (gate: after the device-side copy, done: after the slot's)."""
        buffer = staging.buffer
        assert buffer is not None, "a staging buffer is used once"
        buffer.record_stream(side)  # reusable once the side stream is past it
        staging.buffer = None  # freed (to the allocator, after the side stream) on return
        with torch.cuda.stream(side):
            staged = [staged_view(buffer, off, s) for off, s in zip(staging.offsets, sources)]
            copy_all(staged, sources)
            gate = torch.cuda.Event()
            gate.record(side)  # the next step waits only for the device-side copy
            for slot_lo, slot_hi, stage_lo in staging.runs:  # one copy per pinned piece
                for lo, hi in cuda.split_at(slot_lo, slot_hi):
                    buf[lo:hi].copy_(buffer[stage_lo + lo - slot_lo:stage_lo + hi - slot_lo],
                                     non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return gate, done

    def wait_gates(self, *, timed: bool) -> list[tuple[Any, Any]]:
        """Make each device's current stream wait for the in-flight copy's gate (the host
        never blocks), then forget the gates. Training thread, at the next step's gate. With
        ``timed``, returns per device CUDA timing events recorded just before and just after
        the wait (:func:`device_wait_s` reads them later); else an empty list."""
        timed_pairs: list[tuple[Any, Any]] = []
        if self.gates:  # only at the step after a checkpoint of CUDA state
            for device, event in self.gates:
                stream = torch.cuda.current_stream(device)
                before = _timing_event(stream) if timed else None
                stream.wait_event(event)
                if before is not None:
                    timed_pairs.append((before, _timing_event(stream)))
            self.gates = []
        return timed_pairs

    def poll_gates(self, deadline: float) -> bool:
        """Wait on the host, polling, until every pending gate's event is complete or the
        ``time.monotonic()`` ``deadline`` passes, then forget the gates. Returns True when all
        completed in time (cfrun turning itself off: no step gate will wait for them)."""
        ok = True
        gates, self.gates = self.gates, []
        for _, event in gates:
            while ok and not event.query():
                if time.monotonic() > deadline:
                    ok = False
                time.sleep(0.001)
        return ok

    def copy_on_side_streams(self, pairs: Pairs) -> None:
        """Snapshot thread, slot not page-locked: copy each CUDA tensor into the slot on its
        device's side stream (non-blocking to the others; the thread's default stream is the
        legacy one, which the training thread's kernels would queue behind), waiting for each
        copy. The step and boundary events are complete already."""
        for dst, src in pairs:
            with torch.cuda.device(src.device), torch.cuda.stream(self.streams[src.device]):
                dst.copy_(src.detach())


@dataclass
class _Staging:
    """A checkpoint's device-side staging buffer (:meth:`CudaCopies._staging`) and where the
    tensors go in it (:func:`cfrun.rank.copyplan.run_layout`)."""

    buffer: torch.Tensor | None
    """The ``uint8`` buffer, until :meth:`CudaCopies._stage` lets it go."""
    offsets: list[int]
    """Each tensor's byte offset in the buffer."""
    runs: list[tuple[int, int, int]]
    """``(slot_start, slot_end, staging_start)`` of each run copied into the slot in one."""


def _timing_event(stream: Any) -> Any:
    """A CUDA event with timing, recorded on ``stream`` now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def device_wait_s(pairs: list[tuple[Any, Any]]) -> float | None:
    """Seconds the training streams sat at the step gate after a checkpoint (issue 23: on an
    H200 the step after a checkpoint took 33 ms longer than the others while the host-side
    stall said 15-27 ms; a device-side wait is one part of the difference no host clock
    sees). ``pairs``: per device, CUDA timing events recorded on the training stream just
    before and just after its ``wait_event`` on the copy (:meth:`CudaCopies.wait_gates`); the
    elapsed time between them is the wait (about 0 when the copy was done by then). Summed
    over devices. None when there is no pair, or when one has not completed yet (this never
    waits for the device; the caller then counts the host-side stall only). Never raises.
    An upper bound when the device runs ahead of a host-bound step (it would have idled
    anyway); the step's time when the device is the bottleneck, as in GPU-bound training."""
    if not pairs:
        return None
    total = 0.0
    try:
        for before, after in pairs:
            if not after.query():
                return None
            total += before.elapsed_time(after) / 1e3
    except Exception:  # the measurement never costs a checkpoint
        return None
    return total


def synchronize(events: DeviceEvents) -> None:
    """Wait on the host for each CUDA event, with its device current."""
    for device, event in events:
        with torch.cuda.device(device):
            event.synchronize()
