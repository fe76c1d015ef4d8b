"""The ``checkpoint`` event of one committed checkpoint: its measurements, gathered from the
boundary and the next step's gate (training thread) and from the agent's reply (snapshot
thread), emitted once all three have reported (:class:`cfrun.rank.snapshot.Snapshotter`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from cfrun.rank.cudacopy import device_wait_s


class CheckpointEvent:
    """The measurements of the checkpoint in flight, until they make one event.

    Args:
        emit: called with a ``checkpoint`` event's fields when a checkpoint is committed and its
            stall is known (rank 0 writes it to events.jsonl): ``step``, ``bytes``, ``stall_s``,
            ``snapshot_s``, ``persist_s``, ``pgt_s``, ``bandwidth_bytes_per_s``, ``tier`` and
            ``t_trigger_unix_s`` (wall-clock time the snapshot started); with CUDA state also
            ``gate_device_s``, the seconds the training stream waited on the device for the
            copy at the next step (:func:`cfrun.rank.cudacopy.device_wait_s`), which
            ``stall_s`` includes (the boundary's host time + the gate's host wait + that); and
            the boundary's host time in two parts, ``capture_s`` (the state's capture) and
            ``enqueue_s`` (the slot, the copy plan, the copies started), when the caller
            measured the first.
    """

    def __init__(self, emit: Callable[[dict[str, Any]], None]) -> None:
        self.emit = emit
        self._fields: dict[str, Any] = {}
        self._lock = threading.Lock()

    def begin(self, step: int, t_trigger_unix_s: float, capture_s: float | None) -> None:
        """A checkpoint of ``step`` starts (training thread); what the last one left is gone."""
        with self._lock:
            self._fields = {"step": step, "t_trigger_unix_s": t_trigger_unix_s}
            if capture_s is not None:
                self._fields["capture_s"] = capture_s

    def awaiting_gate(self) -> bool:
        """True at the first step gate after a checkpoint began (training thread)."""
        return "gate_s" not in self._fields and bool(self._fields)

    def update(self, **fields: Any) -> None:
        """Merge measurements (any thread); emit the event once the boundary (``boundary_s``),
        the gate (``gate_s``) and the persist (``persist_s``) reported."""
        with self._lock:
            self._fields.update(fields)
            rec = self._fields
            if "gate_s" in rec and "persist_s" in rec and "boundary_s" in rec:
                self._fields = {}
                self.emit(_event(rec))


def _event(rec: dict[str, Any]) -> dict[str, Any]:
    """The ``checkpoint`` event's fields from the gathered measurements ``rec``."""
    device_s = device_wait_s(rec.get("gate_events") or [])
    stall_s = rec["boundary_s"] + rec["gate_s"] + (device_s or 0.0)
    more = {} if device_s is None else {"gate_device_s": round(device_s, 6)}
    if "capture_s" in rec:  # the boundary's host time: capture, then the rest
        more["capture_s"] = round(rec["capture_s"], 6)
        more["enqueue_s"] = round(rec["boundary_s"] - rec["capture_s"], 6)
    return {"step": rec["step"], "bytes": rec["bytes"],
            "stall_s": round(stall_s, 6), "snapshot_s": round(rec["snapshot_s"], 6),
            "persist_s": rec["persist_s"], "pgt_s": rec["pgt_s"],
            "bandwidth_bytes_per_s": rec["bandwidth_bytes_per_s"],
            "tier": rec.get("tier", "local"),
            "t_trigger_unix_s": round(rec["t_trigger_unix_s"], 6), **more}
