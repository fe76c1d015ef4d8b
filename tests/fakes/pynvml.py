"""A fake ``pynvml`` for machines without a GPU: the subset of NVML cfrun calls, driven by a JSON
file (``FAKE_NVML_STATE``) that a test edits while a job runs.

State: ``{"devices": [{"uuid", "name", "used", "total", "util", "ecc"}], "xids": [[device,
xid], ...]}``. ``ecc`` is the volatile uncorrected ECC count; an XID appended to ``xids`` after
an event set was created is delivered by ``nvmlEventSetWait``. Test code only: put this
directory first on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
nvmlEventTypeXidCriticalError = 8
NVML_ERROR_TIMEOUT = 10


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def _state() -> dict:
    path = os.environ.get("FAKE_NVML_STATE")
    if not path:
        raise NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED
    with open(path) as f:
        return json.load(f)


def nvmlInit() -> None:
    _state()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_state()["devices"])


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    return i


def _device(handle: int) -> dict:
    return _state()["devices"][handle]


def nvmlDeviceGetUUID(handle: int) -> str:
    return _device(handle)["uuid"]


def nvmlDeviceGetName(handle: int) -> str:
    return _device(handle)["name"]


def nvmlDeviceGetMemoryInfo(handle: int) -> SimpleNamespace:
    d = _device(handle)
    return SimpleNamespace(used=d["used"], total=d["total"], free=d["total"] - d["used"])


def nvmlDeviceGetUtilizationRates(handle: int) -> SimpleNamespace:
    return SimpleNamespace(gpu=_device(handle)["util"], memory=0)


def nvmlDeviceGetTotalEccErrors(handle: int, error_type: int, counter: int) -> int:
    return _device(handle)["ecc"]


class _EventSet:
    def __init__(self) -> None:
        self.seen = len(_state().get("xids", []))
        self.devices: set[int] = set()


def nvmlEventSetCreate() -> _EventSet:
    return _EventSet()


def nvmlDeviceRegisterEvents(handle: int, types: int, event_set: _EventSet) -> None:
    event_set.devices.add(handle)


def nvmlEventSetWait(event_set: _EventSet, timeout_ms: int) -> SimpleNamespace:
    xids = _state().get("xids", [])
    while event_set.seen < len(xids):
        device, xid = xids[event_set.seen]
        event_set.seen += 1
        if device in event_set.devices:
            return SimpleNamespace(device=device, eventData=xid,
                                   eventType=nvmlEventTypeXidCriticalError)
    raise NVMLError(NVML_ERROR_TIMEOUT)


def nvmlEventSetFree(event_set: _EventSet) -> None:
    pass
