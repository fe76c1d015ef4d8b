"""GPUs through NVML (``nvidia-ml-py``'s ``pynvml``): which devices, how busy, and hardware faults.

Torch-free: the supervisor and ``cfrun status`` use it to sample memory and utilisation
(``status``, metrics, ``cfrun profile``), and to tell a hardware fault from the script's own
failure: an attempt during which NVML reported a critical XID event or during which a device's
uncorrected ECC error count rose failed because of the hardware, so the restart does not count
towards ``--crash-loop`` and the failure's cause says which GPU and which error. The ranks use
:func:`device_uuids` for the profile cache's fingerprint (the same script on other GPUs is
profiled again).

Everything here is best effort: no NVML library, no driver, no GPU or any NVML error gives an
empty answer, never an exception (a CPU machine has none of them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuSample:
    """One device at one moment (NVML)."""

    index: int
    uuid: str
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_pct: int
    """GPU utilisation over NVML's last sample period, 0..100."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml() -> Any:
    """``pynvml``, initialised, or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # no library, no driver, no device: no NVML
        return None


def _visible(nvml: Any) -> list[tuple[int, Any]]:
    """(index, handle) of the devices NVML sees, limited to ``CUDA_VISIBLE_DEVICES`` when it
    lists indices or UUIDs (the devices the ranks can use)."""
    out = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(nvml.nvmlDeviceGetCount())]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return out
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    kept = []
    for i, handle in out:
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        if str(i) in wanted or uuid in wanted or any(uuid.startswith(w) for w in wanted
                                                     if w.startswith("GPU-")):
            kept.append((i, handle))
    return kept


def samples() -> list[GpuSample]:
    """Memory and utilisation of each visible device; empty without NVML."""
    nvml = _nvml()
    if nvml is None:
        return []
    try:
        out = []
        for i, handle in _visible(nvml):
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:  # not supported on this device
                util = 0
            out.append(GpuSample(i, _text(nvml.nvmlDeviceGetUUID(handle)),
                                 _text(nvml.nvmlDeviceGetName(handle)), int(memory.used),
                                 int(memory.total), util))
        return out
    except Exception:
        return []


def device_uuids() -> list[str]:
    """UUIDs of the visible devices (the profile fingerprint); empty without NVML."""
    return [s.uuid for s in samples()]


class FaultWatch:
    """Hardware faults of the visible GPUs during one attempt (the supervisor's thread only).

    :meth:`start` at the attempt's start registers for NVML's critical XID events and reads
    each device's volatile uncorrected ECC count; :meth:`poll` (housekeeping) collects XID
    events; :meth:`faults` at the end adds devices whose ECC count rose. Inert without NVML.
    """

    def __init__(self) -> None:
        self._nvml: Any = None
        self._events: Any = None
        self._devices: list[tuple[int, Any, str]] = []
        self._ecc: dict[str, int] = {}
        self._found: list[str] = []

    def _ecc_count(self, handle: Any) -> int | None:
        nvml = self._nvml
        try:
            return int(nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
        except Exception:  # ECC off or unsupported
            return None

    def start(self) -> None:
        self._found = []
        self._nvml = _nvml()
        if self._nvml is None:
            return
        nvml = self._nvml
        try:
            self._devices = [(i, h, _text(nvml.nvmlDeviceGetUUID(h))) for i, h in _visible(nvml)]
            self._ecc = {uuid: n for _, h, uuid in self._devices
                         if (n := self._ecc_count(h)) is not None}
            if self._events is None:
                self._events = nvml.nvmlEventSetCreate()
                for _, handle, _ in self._devices:
                    try:
                        nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError,
                                                      self._events)
                    except Exception:  # events unsupported on this device
                        continue
        except Exception:
            self._nvml = None

    def _describe(self, handle: Any) -> str:
        for i, h, uuid in self._devices:
            if h == handle:
                return f"GPU {i} ({uuid})"
        return "a GPU"

    def poll(self) -> None:
        """Collect the XID events NVML has queued (never waits)."""
        if self._nvml is None or self._events is None:
            return
        nvml = self._nvml
        for _ in range(64):
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: nothing queued
                return
            self._found.append(f"XID {int(event.eventData)} on {self._describe(event.device)}")

    def faults(self) -> list[str]:
        """The hardware faults seen since :meth:`start`: XID events, then ECC counts that rose
        (``ECC: 2 uncorrected errors on GPU 1 (GPU-...)``)."""
        if self._nvml is None:
            return []
        self.poll()
        out = list(self._found)
        for i, handle, uuid in self._devices:
            before = self._ecc.get(uuid)
            now = self._ecc_count(handle)
            if before is not None and now is not None and now > before:
                out.append(f"ECC: {now - before} uncorrected errors on GPU {i} ({uuid})")
        return out
