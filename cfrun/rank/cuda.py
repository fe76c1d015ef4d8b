"""CUDA runtime calls the snapshot needs and torch does not expose (issue 18).

``torch.cuda.cudart()`` binds ``cudaHostRegister``/``cudaHostUnregister``, ``cudaStreamCreate``
(a *blocking* stream: it would serialize with the legacy default stream torch computes on) and
little else: no ``cudaGetLastError`` and no ``cudaStreamCreateWithFlags``. torch's wheels link
the CUDA runtime dynamically (``libcudart.so.12``); :func:`runtime_library` opens that same,
already loaded library again with ``ctypes`` (``RTLD_NOLOAD``), so the calls below act on
torch's runtime instance and its per-thread error state. Where it cannot be found (a build
that links the runtime statically) each function falls back to what torch offers, as its
docstring says. Called from a rank's training thread, and :func:`host_register` also from the
slot's preparing thread (the CUDA error state is per thread: each clears its own).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import torch

CUDA_HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the page-locked range counts as pinned for every CUDA context
(every device of the process), as torch's own pinned host allocator registers memory."""
CUDA_STREAM_NON_BLOCKING = 1
"""``cudaStreamNonBlocking``: the stream does not synchronize with the legacy default stream."""

_lib: ctypes.CDLL | None = None
_looked = False


def runtime_library() -> ctypes.CDLL | None:
    """The CUDA runtime library torch has loaded (``libcudart.so*``, found in
    ``/proc/self/maps``), opened again without loading anything new; None when none is loaded.
    Looked up once per process."""
    global _lib, _looked
    if _looked:
        return _lib
    _looked = True
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if not os.path.basename(path).startswith("libcudart.so"):
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL | os.RTLD_NOLOAD)
        except OSError:
            continue
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        lib.cudaThreadExchangeStreamCaptureMode.restype = ctypes.c_int
        lib.cudaThreadExchangeStreamCaptureMode.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaStreamCreateWithFlags.restype = ctypes.c_int
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                                  ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        _lib = lib
        break
    return _lib


def clear_error(device: torch.device) -> None:
    """Consume the CUDA runtime's pending error on this thread, so that it does not surface in
    the next unrelated CUDA call (the user's next forward, whose kernel-launch check would
    raise it). Uses ``cudaGetLastError``; without the library, one tiny kernel whose launch
    check consumes the error, which is swallowed here."""
    lib = runtime_library()
    if lib is not None:
        lib.cudaGetLastError()
        return
    try:
        with torch.cuda.device(device):
            torch.empty(1, device=device).zero_()
    except RuntimeError:
        pass


PIN_CHUNK_BYTES = 128 << 20
"""Bytes page-locked by one ``cudaHostRegister`` call (issue 23). One call for a 4.4 GB slot
held the training thread for 1.5-2 s on an H200: the registration pins every page inside the
driver, and the training thread's own CUDA calls wait meanwhile. In pieces of this size, with
a pause between them (:func:`host_register`'s ``pause_s``), a step waits for one piece at
most. A copy never spans two pieces (:func:`split_at`)."""


def _register(ptr: int, nbytes: int) -> int:
    """``cudaHostRegister`` (portable flag) of ``nbytes`` at ``ptr``; its return code. Through
    ctypes where the runtime library is found (the GIL is released for the call), else
    through ``torch.cuda.cudart()``."""
    lib = runtime_library()
    if lib is not None:
        return int(lib.cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))


def _unregister(ptr: int) -> int:
    lib = runtime_library()
    if lib is not None:
        return int(lib.cudaHostUnregister(ptr))
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def _error_name(rc: int) -> str:
    try:
        return str(torch.cuda.cudart().cudaGetErrorString(rc))
    except Exception:
        return f"CUDA error {rc}"


def host_register(buf: torch.Tensor, device: torch.device, *,
                  chunk_bytes: int | None = None, pause_s: float = 0.0) -> str | None:
    """Page-lock the host memory of the CPU tensor ``buf`` (``cudaHostRegister``, portable
    flag, with ``device`` current) so that device-to-host copies into it run asynchronously:
    in pieces of ``chunk_bytes`` from its start (:data:`PIN_CHUNK_BYTES`), sleeping
    ``pause_s`` seconds between pieces (the slot's preparing thread: the training thread's
    CUDA calls get through in between).

    Returns None when every piece worked, else the CUDA error's name; then the pieces done are
    unregistered again and the runtime's pending error is cleared (:func:`clear_error`), so
    nothing is left half page-locked and no later CUDA call picks the error up. Never raises
    for a CUDA error. Undo with :func:`host_unregister` and the same ``chunk_bytes``.
    """
    chunk_bytes = chunk_bytes or PIN_CHUNK_BYTES
    nbytes = buf.numel() * buf.element_size()
    base = buf.data_ptr()
    done: list[int] = []
    with torch.cuda.device(device):
        for lo in range(0, nbytes, chunk_bytes):
            if done and pause_s:
                time.sleep(pause_s)
            rc = _register(base + lo, min(chunk_bytes, nbytes - lo))
            if rc != 0:
                clear_error(device)
                for ptr in done:
                    _unregister(ptr)
                clear_error(device)
                return _error_name(rc)
            done.append(base + lo)
    return None


def host_unregister(buf: torch.Tensor, *, chunk_bytes: int | None = None) -> None:
    """Undo :func:`host_register` (an error is cleared, never raised: the slot goes anyway)."""
    chunk_bytes = chunk_bytes or PIN_CHUNK_BYTES
    nbytes = buf.numel() * buf.element_size()
    failed = False
    for lo in range(0, nbytes, chunk_bytes):
        failed |= _unregister(buf.data_ptr() + lo) != 0
    if failed:
        clear_error(torch.device("cuda", torch.cuda.current_device()))


def split_at(lo: int, hi: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    """The byte range ``[lo, hi)`` of a slot cut at multiples of ``chunk_bytes``: one copy per
    piece keeps every copy inside one ``cudaHostRegister`` range (:func:`host_register`), as
    the driver needs to treat the destination as page-locked."""
    chunk_bytes = chunk_bytes or PIN_CHUNK_BYTES
    pieces = []
    while lo < hi:
        end = min(hi, (lo // chunk_bytes + 1) * chunk_bytes)
        pieces.append((lo, end))
        lo = end
    return pieces


def dedicated_stream(device: torch.device) -> Any:
    """A CUDA stream of ``device`` that belongs to cfrun alone: created with
    ``cudaStreamCreateWithFlags(cudaStreamNonBlocking)`` and wrapped as a
    ``torch.cuda.ExternalStream`` (never destroyed: one per device for the process's life).
    ``torch.cuda.Stream()`` hands out one of a small pool of streams that NCCL and the user's
    own streams draw from too, so cfrun's copy could queue behind them or they behind it.
    Falls back to ``torch.cuda.Stream(device)`` when the runtime library is not reachable or
    the call fails."""
    lib = runtime_library()
    if lib is not None:
        handle = ctypes.c_void_p()
        with torch.cuda.device(device):
            rc = lib.cudaStreamCreateWithFlags(ctypes.byref(handle), CUDA_STREAM_NON_BLOCKING)
            if rc == 0 and handle.value:
                return torch.cuda.ExternalStream(handle.value, device=device)
            clear_error(device)
    return torch.cuda.Stream(device=device)


CUDA_STREAM_CAPTURE_MODE_RELAXED = 2
"""``cudaStreamCaptureModeRelaxed``: this thread's calls are not checked against captures."""


def relax_capture_mode() -> None:
    """Let this thread (the snapshot thread) wait on CUDA events while the training thread
    captures a CUDA graph (``torch.cuda.graph`` captures in the global mode by default, in which
    an event wait from any other thread fails and can invalidate the capture). Safe here: the
    snapshot thread waits only on events of copies queued before, on streams not captured.
    Without the runtime library, nothing changes."""
    lib = runtime_library()
    if lib is not None:
        mode = ctypes.c_int(CUDA_STREAM_CAPTURE_MODE_RELAXED)
        lib.cudaThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def is_capturing() -> bool:
    """True while the current CUDA stream is being captured into a CUDA graph (no CUDA call
    of cfrun's may then run on it); False without CUDA."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and \
        torch.cuda.is_current_stream_capturing()
