"""Phase 1 of a checkpoint: copy the state into a reusable shared-memory slot, off the step path.

CheckFreq §4.3.1 (snapshot overlapped with compute; the next weight update waits for it),
ACUTE's Check-Mem, DeepFreeze's "blocking phase". One ``Snapshotter`` per rank:

* **Slot.** A file in shared memory (``/dev/shm``, or ``CFRUN_SHM_DIR``), mapped into the rank as
  a ``uint8`` tensor (``torch.from_file(shared=True)``) and read by the persist agent through
  ``mmap`` without any copy or unpickling. Allocated once, grown only if the state grows (never
  while the agent still reads it); on CUDA it is page-locked (``cudaHostRegister``) so device to
  host copies run asynchronously at full bandwidth. A copy into a reused buffer runs ~2.5x faster
  than into fresh memory on this class of machine (DCP stages into fresh memory each time).
* **What blocks the training loop.** At the boundary after step s, small tensors and module
  buffers (BatchNorm statistics change in the next forward) are copied on the training thread;
  parameters and optimizer state, which only the next ``optimizer.step()`` changes, are copied
  in the background (a CPU thread: ``copy_`` releases the GIL; on CUDA a side stream). The next
  ``optimizer.step()`` waits for that copy (:meth:`Snapshotter.gate`): on CPU by waiting for the
  thread, on CUDA by making the current stream wait for the copy's event (the host never blocks).
  With ``gpu`` mode, state is first copied device-to-device into a buffer allocated once when
  free memory allows (CheckFreq's GPU snapshot), so the step waits only for that fast copy.
* **Hand-off.** When the copy is complete the rank sends the agent one message (step, slot,
  bytes, the JSON tree); from then on the agent persists and commits it even if the rank dies.
* **At most one checkpoint in flight.** A checkpoint that comes due while the previous one is
  still being persisted is deferred to the next boundary (:meth:`busy`), never stalled on, so a
  failure rolls back at most one checkpoint and a slow disk costs frequency, not step time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cfrun import ipc
from cfrun.format import FORMAT_VERSION, TensorEntry, plan_layout

logger = logging.getLogger(__name__)

SLOT_ALIGN_BYTES = 4096
"""Slot sizes are multiples of this, so the agent can write them with O_DIRECT."""
SYNC_COPY_MAX_BYTES = 1 << 16
"""Tensors up to this size are copied on the training thread (cheaper than a hand-off)."""
ENV_SHM_DIR = "CFRUN_SHM_DIR"
ENV_SNAPSHOT_MODE = "CFRUN_SNAPSHOT_MODE"
"""``thread`` (default on CPU): background copy; ``inline``: copy on the training thread;
``gpu``/``host`` force or forbid the device-side first copy on CUDA (default: when it fits)."""
ENV_TEST_KILL_AFTER_SNAPSHOT = "CFRUN_TEST_KILL_AFTER_SNAPSHOT"
"""Testing aid: in attempt 0, SIGKILL the rank right after it handed the first checkpoint at or
after this step to the agent."""
ENV_TEST_KILL_BEFORE_HANDOFF = "CFRUN_TEST_KILL_BEFORE_COMMIT"
"""Testing aid: in attempt 0, SIGKILL the rank mid-snapshot (copied, not yet handed off) of
the first checkpoint at or after this step."""


def shm_dir(job_dir: Path, nbytes: int) -> Path:
    """Where snapshot slots live: ``$CFRUN_SHM_DIR``, else ``/dev/shm`` when it has room for
    twice ``nbytes``, else ``<job_dir>/.slots`` (still shared, but backed by the disk)."""
    env = os.environ.get(ENV_SHM_DIR)
    if env:
        return Path(env)
    dev_shm = Path("/dev/shm")
    if dev_shm.is_dir() and os.access(dev_shm, os.W_OK):
        st = os.statvfs(dev_shm)
        if st.f_bavail * st.f_frsize >= 2 * nbytes:
            return dev_shm
    return job_dir / ".slots"


def slot_prefix(job_dir: Path) -> str:
    """File-name prefix of a job's slots; the supervisor removes ``<prefix>*`` at the end."""
    from cfrun.env import node_suffix

    return "cfrun-" + hashlib.sha1(str(job_dir.absolute()).encode()).hexdigest()[:12] \
        + node_suffix()


class SnapshotSlot:
    """A shared-memory byte buffer that grows but is otherwise allocated once."""

    def __init__(self, job_dir: Path, rank: int) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.path: Path | None = None
        self.buf: torch.Tensor | None = None
        self.generation = 0
        self.pinned = False

    def ensure(self, nbytes: int, *, pin: bool) -> torch.Tensor:
        """A ``uint8`` tensor over the first ``nbytes`` of the slot, (re)allocating if needed.

        Call only when the agent is not reading the slot (no persist in flight).
        """
        if self.buf is None or self.buf.numel() < nbytes:
            self.release()
            directory = shm_dir(self.job_dir, nbytes)
            directory.mkdir(parents=True, exist_ok=True)
            self.generation += 1
            self.path = directory / (f"{slot_prefix(self.job_dir)}-rank{self.rank:05d}-"
                                     f"{os.getpid()}-{self.generation}.slot")
            with open(self.path, "wb") as f:
                f.truncate(nbytes)
            self.buf = torch.from_file(str(self.path), shared=True, size=nbytes,
                                       dtype=torch.uint8)
            if pin and torch.cuda.is_available():
                rc = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), nbytes, 0)
                self.pinned = int(rc) == 0
        return self.buf[:nbytes]

    def release(self) -> None:
        if self.buf is not None and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
        self.buf = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


class Snapshotter:
    """Rank-side two-phase checkpointing. Training-thread API: ``ready``, ``busy``, ``start``,
    ``gate``; a background thread per checkpoint does the copy hand-off and awaits the persist.

    Args:
        emit: called with a ``checkpoint`` event's fields when a checkpoint is committed and its
            stall is known (rank 0 writes it to events.jsonl).
        on_lost: called (background thread) with a step whose hand-off failed because the agent
            was unreachable or died; the next checkpoint reconnects.
    """

    def __init__(self, job_dir: Path, rank: int, world_size: int, attempt: int,
                 emit: Callable[[dict[str, Any]], None],
                 on_lost: Callable[[int, str], None] = lambda step, error: None) -> None:
        self.job_dir = job_dir
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.emit = emit
        self.on_lost = on_lost
        self.slot = SnapshotSlot(job_dir, rank)
        self.sock: socket.socket | None = None
        self.copy_done = threading.Event()
        self.copy_done.set()
        self.persist_done = threading.Event()
        self.persist_done.set()
        self.thread: threading.Thread | None = None
        self.mode = os.environ.get(ENV_SNAPSHOT_MODE, "thread")
        self.mode_is_forced = ENV_SNAPSHOT_MODE in os.environ
        self._inflight = -1
        self._cuda_gate: Any = None
        self._gpu_buf: torch.Tensor | None = None
        self._record: dict[str, Any] = {}
        self._record_lock = threading.Lock()
        self.last_error: str | None = None
        self.last_cost_s = 0.0
        """Seconds the last checkpoint took from snapshot start to commit (for the grace)."""
        self.last_committed = -1

    # ------------------------------------------------------------------ agent connection

    def ready(self, timeout_s: float = 120.0) -> bool:
        """Connect to the persist agent and wait until it has drained earlier work.

        Called before looking for checkpoints, so a snapshot handed off by a previous attempt
        of this rank is committed first. Returns False if no agent answers (then checkpoints
        are written synchronously by the caller).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = ipc.connect(self.job_dir)
                self.sock.settimeout(timeout_s)
                ipc.send(self.sock, {"op": "hello", "rank": self.rank})
                reply = ipc.recv(self.sock)
                self.sock.settimeout(None)
                return reply.get("op") == "ready"
            except OSError:
                self.sock = None
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.1)

    # ------------------------------------------------------------------ training thread

    def busy(self) -> bool:
        """True while the previous checkpoint is being copied or persisted."""
        return not self.persist_done.is_set()

    @property
    def inflight_step(self) -> int | None:
        """Step of the checkpoint being copied or persisted, if any."""
        return self._inflight if self.busy() else None

    def gate(self) -> float:
        """Block until the background copy no longer needs the live tensors. Returns seconds.

        Called from the optimizer step pre-hook on the training thread.
        """
        waited = 0.0
        if self._cuda_gate is not None:
            torch.cuda.current_stream().wait_event(self._cuda_gate)  # device-side wait only
            self._cuda_gate = None
        if not self.copy_done.is_set():
            t0 = time.perf_counter()
            self.copy_done.wait()
            waited = time.perf_counter() - t0
        if "gate_s" not in self._record and self._record:
            self._finish(gate_s=waited)
        return waited

    def start(self, step: int, tree: Any, tensors: list[torch.Tensor], async_ids: set[int],
              meta: dict[str, Any], t_trigger: float, t_boundary: float) -> None:
        """Copy ``tensors`` into the slot and hand the checkpoint to the agent.

        Small tensors and those not in ``async_ids`` are copied now; the rest in the
        background. Raises OSError/RuntimeError on failure (the caller logs it).
        """
        entries, total = plan_layout(tensors)
        total = max(SLOT_ALIGN_BYTES, -(-total // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES)
        has_cuda = any(t.is_cuda for t in tensors)
        buf = self.slot.ensure(total, pin=has_cuda)
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        for e, t in zip(entries, tensors):
            dst = _view(buf, e, t)
            if (id(t) in async_ids and e.nbytes > SYNC_COPY_MAX_BYTES and self.mode != "inline"):
                later.append((dst, t))
            else:
                dst.copy_(t.detach())
        done_event = None
        if has_cuda:
            later, done_event = self._enqueue_cuda(later)
        doc = {"format_version": FORMAT_VERSION, "rank": self.rank, "tree": tree,
               "tensors": [e.to_json() for e in entries], "meta": meta}
        msg = {"op": "persist", "step": step, "rank": self.rank, "world_size": self.world_size,
               "slot": str(self.slot.path), "nbytes": total, "doc": doc,
               "t_trigger_unix_s": t_trigger}
        self._inflight = step
        self.copy_done.clear()
        self.persist_done.clear()
        with self._record_lock:
            self._record = {"step": step, "boundary_s": time.perf_counter() - t_boundary}
        self.thread = threading.Thread(target=self._background, name="cfrun-snapshot",
                                       args=(later, done_event, msg), daemon=True)
        self.thread.start()
        if self.mode == "inline" or not later:
            self.copy_done.wait()

    def _enqueue_cuda(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
        """Queue device-to-host copies on a side stream; the step waits on the device only."""
        cuda = [(d, s) for d, s in pairs if s.is_cuda]
        cpu = [(d, s) for d, s in pairs if not s.is_cuda]
        if not cuda:
            return pairs, None
        ready = torch.cuda.Event()
        ready.record()
        side = torch.cuda.Stream()
        side.wait_event(ready)
        nbytes = sum(s.numel() * s.element_size() for _, s in cuda)
        use_gpu_buf = self.mode == "gpu" or (
            self.mode != "host" and torch.cuda.mem_get_info()[0] > 1.2 * nbytes + (256 << 20))
        with torch.cuda.stream(side):
            if use_gpu_buf:
                if self._gpu_buf is None or self._gpu_buf.numel() < nbytes:
                    self._gpu_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                staged = []
                off = 0
                for d, s in cuda:
                    n = s.numel() * s.element_size()
                    g = self._gpu_buf[off:off + n].view(s.dtype).view(s.shape)
                    g.copy_(s, non_blocking=True)
                    staged.append((d, g))
                    off += n
                d2d = torch.cuda.Event()
                d2d.record(side)
                self._cuda_gate = d2d
                for d, g in staged:
                    d.copy_(g, non_blocking=True)
            else:
                for d, s in cuda:
                    d.copy_(s, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        if not use_gpu_buf:
            self._cuda_gate = done
        return cpu, done

    # ------------------------------------------------------------------ background thread

    def _background(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], done_event: Any,
                    msg: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        try:
            for dst, src in pairs:
                dst.copy_(src.detach())
            if done_event is not None:
                done_event.synchronize()
        except Exception as e:
            self.last_error = repr(e)
            self.copy_done.set()
            self.persist_done.set()
            return
        snapshot_s = time.perf_counter() - t0
        self.copy_done.set()
        step = msg["step"]
        kill_at = os.environ.get(ENV_TEST_KILL_BEFORE_HANDOFF)
        if self.attempt == 0 and kill_at and step >= int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if self.sock is None and not self.ready(timeout_s=30.0):
                raise ConnectionError("no persist agent")
            assert self.sock is not None
            ipc.send(self.sock, msg)
            kill_after = os.environ.get(ENV_TEST_KILL_AFTER_SNAPSHOT)
            if self.attempt == 0 and kill_after and step >= int(kill_after):
                os.kill(os.getpid(), signal.SIGKILL)
            reply = ipc.recv(self.sock)
        except (OSError, AssertionError) as e:
            self.last_error = f"persist agent unavailable: {e!r}"
            self.on_lost(step, self.last_error)
            if self.sock is not None:
                self.sock.close()
            self.sock = None  # reconnect (to a restarted agent) next time
            self.persist_done.set()
            return
        if not reply.get("ok"):
            self.last_error = str(reply.get("error"))
        else:
            self.last_cost_s = snapshot_s + float(reply["persist_s"])
            self.last_committed = step
            self._finish(snapshot_s=snapshot_s, tier=reply.get("tier", "local"), **{
                k: reply[k] for k in ("bytes", "persist_s", "pgt_s", "bandwidth_bytes_per_s")})
        self.persist_done.set()

    def _finish(self, **fields: Any) -> None:
        """Merge measurements; emit the event once both the gate and the persist reported."""
        with self._record_lock:
            self._record.update(fields)
            rec = self._record
            if "gate_s" in rec and "persist_s" in rec:
                self._record = {}
                stall_s = rec["boundary_s"] + rec["gate_s"]
                self.emit({"step": rec["step"], "bytes": rec["bytes"],
                           "stall_s": round(stall_s, 6), "snapshot_s": round(rec["snapshot_s"], 6),
                           "persist_s": rec["persist_s"], "pgt_s": rec["pgt_s"],
                           "bandwidth_bytes_per_s": rec["bandwidth_bytes_per_s"],
                           "tier": rec.get("tier", "local")})

    def close(self, timeout_s: float = 60.0) -> None:
        """At exit: let the last hand-off and persist finish, then free the slot."""
        if self.thread is not None:
            self.thread.join(timeout_s)
        self.gate()
        if not self.busy():
            self.slot.release()


def _view(buf: torch.Tensor, e: TensorEntry, t: torch.Tensor) -> torch.Tensor:
    return buf[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape)


def remove_slots(job_dir: Path) -> int:
    """Delete a job's slot files (the supervisor calls this when the job ends)."""
    n = 0
    for directory in {Path(os.environ.get(ENV_SHM_DIR, "/dev/shm")), job_dir / ".slots"}:
        if directory.is_dir():
            for p in directory.glob(slot_prefix(job_dir) + "-*.slot"):
                p.unlink(missing_ok=True)
                n += 1
    if (job_dir / ".slots").is_dir():
        shutil.rmtree(job_dir / ".slots", ignore_errors=True)
    return n
