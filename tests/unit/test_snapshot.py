"""Unit tests for cfrun.rank.snapshot against a real persist agent process: the staging layout, the
background thread's error handling, and (GPU only) the CUDA path's overlap and exactness."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bit_identical

from cfrun.codec.checkpoint import committed_steps, load_shard
from cfrun.codec.format import encode
from cfrun.contract import faults, ipc
from cfrun.contract.jobdir import step_dir_name
from cfrun.rank import copier as CP
from cfrun.rank import copyplan as P
from cfrun.rank import slot as SL
from cfrun.rank import snapshot as S

pytestmark = pytest.mark.timeout(120)


def needs_cuda(test):
    """Marks a CUDA test: selected by ``pytest -m gpu`` (issue 23, item 6), skipped without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.gpu(skip(test))


# ---------------------------------------------------------------- staging layout (pure)

def test_slot_ranges_are_cut_at_the_page_locked_pieces(monkeypatch):
    """Issue 23: the slot is page-locked in pieces; a copy into it never spans two. A CPU
    source is never cut (no CUDA copy), nor one inside a single piece."""
    from cfrun.rank import cuda as C

    assert C.split_at(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert C.split_at(5, 7, 4) == [(5, 7)]
    assert C.split_at(4, 8, 4) == [(4, 8)]
    assert C.split_at(3, 3, 4) == []
    assert C.split_at(0, 3 * C.PIN_CHUNK_BYTES + 1) == [
        (0, C.PIN_CHUNK_BYTES), (C.PIN_CHUNK_BYTES, 2 * C.PIN_CHUNK_BYTES),
        (2 * C.PIN_CHUNK_BYTES, 3 * C.PIN_CHUNK_BYTES),
        (3 * C.PIN_CHUNK_BYTES, 3 * C.PIN_CHUNK_BYTES + 1)]
    monkeypatch.setattr(C, "PIN_CHUNK_BYTES", 1 << 20)
    big = torch.arange(3 * (1 << 20) // 8, dtype=torch.float64)  # spans 3 or 4 pieces
    plan = P.CopyPlan([torch.ones(10), big], [True, True], False, 0)
    assert plan.crossing == {1}
    buf = torch.zeros(plan.total, dtype=torch.uint8)
    plan.bind(buf, 1)
    dsts, srcs = plan.pairs(buf, [0, 1], [torch.ones(10), big])
    assert len(dsts) == 2 and srcs[1] is big  # on the CPU: not cut


def test_staging_offsets_are_aligned_after_an_odd_bf16_tensor():
    """A bf16 tensor of odd element count over 64 KiB, then a float32 one: every staged view
    has its dtype (a running sum of byte counts would put the float32 at an offset 2 mod 4)."""
    odd = torch.arange(40_001, dtype=torch.float32).to(torch.bfloat16)  # 80,002 bytes
    f32 = torch.linspace(-1, 1, 1000, dtype=torch.float32)
    i64 = torch.arange(7, dtype=torch.int64)
    sources = [odd, f32, odd[:3], i64]
    offsets, total = P.staging_layout(sources)
    assert all(off % P.STAGING_ALIGN_BYTES == 0 for off in offsets)
    assert offsets == sorted(offsets) and total >= offsets[-1] + i64.numel() * 8
    buf = torch.zeros(total, dtype=torch.uint8)
    views = [P.staged_view(buf, off, s) for off, s in zip(offsets, sources)]
    for v, s in zip(views, sources):
        v.copy_(s)
    for off, s in zip(offsets, sources):  # no overlap: each range still holds its tensor
        assert_bit_identical(s, P.staged_view(buf, off, s))


# ---------------------------------------------------------------- against a real agent

@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A job dir served by a real ``python -m cfrun.agent`` process."""
    job_dir = tmp_path / "job"
    (job_dir / "checkpoints").mkdir(parents=True)
    # the slots on a tmpfs where there is one: a slot on a disk file system (ext4 under /tmp on
    # the GPU machines) cannot be page-locked, and the CUDA tests below need it page-locked
    shm = Path(tempfile.mkdtemp(prefix="cfrun-test-", dir="/dev/shm")) \
        if os.access("/dev/shm", os.W_OK) else tmp_path / "shm"
    monkeypatch.setenv(SL.ENV_SHM_DIR, str(shm))
    for name in (CP.ENV_SNAPSHOT_MODE, faults.ENV):
        monkeypatch.delenv(name, raising=False)
    faults.reset()
    agent = subprocess.Popen([sys.executable, "-m", "cfrun.agent", "--job-dir", str(job_dir),
                              "--keep", "100"])
    deadline = time.monotonic() + 30
    while True:
        try:
            ipc.connect(job_dir).close()
            break
        except OSError:
            assert agent.poll() is None and time.monotonic() < deadline, "agent did not start"
            time.sleep(0.05)
    yield job_dir
    agent.terminate()
    agent.wait(30)
    shutil.rmtree(shm, ignore_errors=True)


class Rank:
    """A Snapshotter as one rank uses it, recording what it reports."""

    def __init__(self, job_dir: Path) -> None:
        self.job_dir = job_dir
        self.events: list[dict[str, Any]] = []
        self.lost: list[tuple[int, str]] = []
        self.snap = S.Snapshotter(job_dir, 0, 1, 0, self.events.append,
                                  lambda step, error: self.lost.append((step, error)))
        assert self.snap.ready(timeout_s=30)
        self.handle: S.SnapshotHandle | None = None

    def start(self, step: int, state: dict[str, torch.Tensor], async_names: set[str]) -> float:
        """Snapshot ``state`` as the state after step ``step``; returns seconds start() took."""
        tensors: list[torch.Tensor] = []
        tree = encode(state, tensors)
        async_ids = {id(state[k]) for k in async_names}
        t0 = time.perf_counter()
        self.handle = self.snap.start(step, tree, tensors, async_ids, {"step": step}, time.time(),
                                      t0)
        return time.perf_counter() - t0

    def wait(self) -> None:
        assert self.snap.thread is not None and self.snap.thread.is_alive()
        assert self.snap.wait_idle(60)

    def committed(self, step: int) -> dict[str, torch.Tensor]:
        state, _ = load_shard(self.job_dir / "checkpoints" / step_dir_name(step), 0)
        return state


def test_handoff_error_is_reported_and_later_checkpoints_still_happen(job, monkeypatch):
    """An unexpected exception in the background thread (here from sending the hand-off) clears
    the in-flight flags, is reported once, is re-raised by the handle's wait(), and the next
    checkpoint commits."""
    rank = Rank(job)
    real_send = ipc.send
    calls = []

    def broken_send(sock, msg):
        calls.append(msg.get("op"))
        if msg.get("op") == "persist" and msg["step"] == 1:
            raise TypeError("Object of type device is not JSON serializable")
        real_send(sock, msg)

    monkeypatch.setattr(ipc, "send", broken_send)
    w = torch.randn(50_000)
    rank.start(1, {"w": w}, {"w"})
    rank.snap.gate()
    rank.wait()
    assert [s for s, _ in rank.lost] == [1] and "TypeError" in rank.lost[0][1]
    assert rank.snap.last_error is not None and "TypeError" in rank.snap.last_error
    assert rank.handle is not None and rank.handle.done()
    with pytest.raises(TypeError, match="not JSON serializable"):
        rank.handle.wait(5)
    w.add_(1.0)
    rank.start(2, {"w": w}, {"w"})
    assert rank.handle is not None and rank.handle.step == 2
    assert rank.handle.wait(60) is True  # committed
    rank.snap.gate()
    rank.wait()
    assert committed_steps(job / "checkpoints") == [2]
    assert_bit_identical(w, rank.committed(2)["w"])
    assert [e["step"] for e in rank.events] == [2] and len(rank.lost) == 1


def test_copy_error_is_reported_and_flags_cleared(job):
    """A failure in the copy itself (a source that cannot be copied) is reported, not silent."""
    rank = Rank(job)
    w = torch.randn(50_000)
    rank.start(1, {"w": w}, {"w"})
    rank.wait()
    bad_src = torch.randn(10)
    handle = S.SnapshotHandle(5)
    rank.snap._background(CP.CopyJob([(torch.empty(20), bad_src)], []),  # shape mismatch
                          {"step": 5}, handle)
    assert [s for s, _ in rank.lost] == [5] and "copy" in rank.lost[0][1]
    assert rank.snap.copier.copy_done.is_set() and not rank.snap.busy()
    with pytest.raises(RuntimeError):
        handle.wait(0)


def test_turning_cfrun_off_waits_for_the_copy_or_drops_the_snapshot(job):
    """Issue 18, item 2 (its CPU half): when cfrun turns itself off the step gate is gone, so
    Runtime.on_disabled -> quiesce() waits for the copy; a copy that does not finish in time
    is dropped, never handed off (the next step would tear it)."""
    rank = Rank(job)
    rank.snap.copier.copy_delay_s = 1.0  # a slow copy
    w = torch.randn(50_000)
    rank.start(1, {"w": w}, {"w"})
    assert not rank.snap.quiesce(0.05)
    w.add_(1)  # the next step, no longer gated, while the copy runs
    rank.wait()
    assert committed_steps(job / "checkpoints") == []
    assert [s for s, _ in rank.lost] == [1] and "turned off" in rank.lost[0][1]
    expected = w.clone()
    rank.start(2, {"w": w}, {"w"})
    assert rank.snap.quiesce(60.0)
    w.add_(1)
    rank.wait()
    assert committed_steps(job / "checkpoints") == [2]
    assert_bit_identical(expected, rank.committed(2)["w"])


# ---------------------------------------------------------------- CUDA (GPU only)

def _long_kernel() -> None:
    """Queue about a second of GPU work on the current stream."""
    torch.cuda._sleep(int(2e9))


@needs_cuda
@pytest.mark.parametrize("piece_bytes", [None, 1 << 20], ids=["pieces-128MiB", "pieces-1MiB"])
@pytest.mark.parametrize("mode", ["gpu", "host"])
def test_cuda_start_does_not_wait_for_the_queued_step_and_snapshot_is_exact(
        job, mode, piece_bytes, monkeypatch):
    """start() returns while a long kernel is still queued before the step's last update; the
    committed bytes equal the state right after that step, although the next forward (here an
    in-place change of a buffer) and the next step change it while the copy runs. Includes a
    bf16 tensor of odd element count followed by float32 (staging alignment in gpu mode).
    With the slot page-locked in 1 MiB pieces, the 4 MiB tensor and the runs span several:
    each copy stays inside one piece, asynchronous, and the bytes are the same."""
    from cfrun.rank import cuda as C

    if piece_bytes:
        monkeypatch.setattr(C, "PIN_CHUNK_BYTES", piece_bytes)
    rank = Rank(job)
    rank.snap.mode = mode
    dev = torch.device("cuda", torch.cuda.current_device())
    state = {
        "w": torch.randn(1 << 20, device=dev),                            # 4 MiB, async
        "odd": torch.randn(40_001, device=dev).to(torch.bfloat16),          # async, odd bf16
        "f32": torch.randn(30_000, device=dev),                            # async, after it
        "bn_mean": torch.randn(512, device=dev),                           # small buffer
        "big_buf": torch.randn(100_000, device=dev),                       # large buffer
        "cpu": torch.randn(100_000),                                       # CPU, async
    }
    rank.start(2, state, {"w", "odd", "f32", "cpu"})  # warm-up: slot, pinning, side stream
    rank.snap.gate()
    rank.wait()
    torch.cuda.synchronize()
    _long_kernel()  # the step's kernels are still running when start() is called
    for t in state.values():
        t.add_(1)
    expected = {k: v.clone() for k, v in state.items()}
    took_s = rank.start(3, state, {"w", "odd", "f32", "cpu"})
    assert took_s < 0.2, f"start() blocked for {took_s:.3f} s behind the queued step"
    state["bn_mean"].mul_(2)  # next forward: buffers change before the next step
    state["big_buf"].mul_(2)
    rank.snap.gate()          # next optimizer.step() (device-side wait)
    for k in ("w", "odd", "f32", "cpu"):
        state[k].mul_(3)
    rank.wait()
    got = rank.committed(3)
    assert_bit_identical({k: v.cpu() for k, v in expected.items()}, got)
    assert rank.snap.slot.pinned
    assert [e["step"] for e in rank.events] == [2, 3]
    assert rank.events[-1]["stall_s"] < 0.2


@needs_cuda
def test_the_device_wait_at_the_gate_counts_in_the_stall(job):
    """Issue 23: the step after a checkpoint waits on the device for the copy's tail, which the
    host-side stall does not see (33 ms more per checkpoint than ``stall_s`` said on an H200).
    Here the copy queues behind a ~1 s kernel on the side stream: the training stream's wait
    at the gate is ``gate_device_s`` and counts in ``stall_s``; without it the wait is ~0."""
    rank = Rank(job)
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(1 << 20, device=dev)
    rank.start(1, {"w": w}, {"w"})  # warm-up: slot, pinning, side stream
    rank.snap.gate()
    rank.wait()
    torch.cuda.synchronize()
    with torch.cuda.stream(rank.snap.copier.cuda.side_stream(dev)):
        _long_kernel()  # the copy of the next checkpoint queues behind it
    rank.start(2, {"w": w}, {"w"})
    rank.snap.gate()  # the training stream waits here for ~1 s (the host does not)
    w.add_(1)
    rank.wait()
    quick, slow = rank.events
    assert quick.get("gate_device_s", 0.0) < 0.1, quick
    assert slow["gate_device_s"] > 0.5, slow
    assert slow["stall_s"] >= slow["gate_device_s"] > 0.5, slow


@needs_cuda
def test_cuda_side_stream_is_created_once_and_reused(job):
    rank = Rank(job)
    w = torch.randn(1 << 18, device="cuda")
    for step in (1, 2, 3):
        w.add_(1)
        rank.start(step, {"w": w}, {"w"})
        rank.snap.gate()
        rank.wait()
        assert_bit_identical(w.cpu(), rank.committed(step)["w"])
    assert len(rank.snap.copier.cuda.streams) == 1


# ---------------------------------------------------------------- issue 18 (GPU only)

@needs_cuda
def test_failed_host_register_leaves_no_pending_cuda_error(job):
    """Item 1: a cudaHostRegister that fails (here: the range is registered already) must not
    leave its error pending for the next unrelated CUDA call (the user's next forward), and
    the slot then counts as unpinned, with the reason."""
    dev = torch.device("cuda", torch.cuda.current_device())
    slot = SL.SnapshotSlot(job, 0)
    buf = slot.ensure(1 << 20, pin=False)
    rc = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(rc) != 0:
        torch.cuda.cudart().cudaGetLastError()  # leave no error for the next test's CUDA call
    assert int(rc) == 0, f"the test's own cudaHostRegister of {slot.path} failed ({int(rc)})"
    try:
        slot.ensure(1 << 20, pin=True, device=dev)
        assert not slot.pinned and slot.pin_error
        x = torch.ones(1000, device=dev) * 2  # a kernel launch checks the pending error
        torch.cuda.synchronize()
        assert float(x.sum()) == 2000.0
    finally:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        slot.pinned = False
        slot.release()


@needs_cuda
def test_snapshot_thread_makes_the_state_device_current_before_waiting(job, monkeypatch):
    """Item 4: the snapshot thread sets its device before its first CUDA call (else its event
    wait creates a context on GPU 0 from every rank)."""
    calls: list[tuple[str, Any]] = []
    real = torch.cuda.set_device

    def recording(device):
        calls.append((threading.current_thread().name, device))
        real(device)

    monkeypatch.setattr(torch.cuda, "set_device", recording)
    rank = Rank(job)
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    w = torch.randn(1 << 18, device=dev)
    rank.start(1, {"w": w}, {"w"})
    rank.snap.gate()
    rank.wait()
    assert ("cfrun-snapshot", dev) in calls, calls
    assert_bit_identical(w.cpu(), rank.committed(1)["w"])


@needs_cuda
def test_turning_cfrun_off_waits_for_the_cuda_copies(job):
    """Item 2: Guard.disable (Runtime.on_disabled -> quiesce) waits for the pending CUDA copies
    too: the next step, no longer gated, then cannot tear the snapshot."""
    rank = Rank(job)
    rank.snap.mode = "host"
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(1 << 22, device=dev)
    rank.start(1, {"w": w}, {"w"})  # warm-up: slot, pinning, side stream
    rank.snap.gate()
    rank.wait()
    _long_kernel()
    w.add_(1)
    expected = w.clone()
    rank.start(2, {"w": w}, {"w"})
    assert rank.snap.quiesce(60.0)
    w.mul_(3)  # the next step, ungated
    rank.wait()
    assert_bit_identical(expected.cpu(), rank.committed(2)["w"])


@needs_cuda
def test_a_copy_still_running_when_cfrun_is_turned_off_is_dropped(job):
    """Item 2: if the copies do not finish within quiesce's time, the snapshot is not handed
    off (a torn snapshot must never be committed)."""
    rank = Rank(job)
    rank.snap.mode = "host"
    w = torch.randn(1 << 20, device="cuda")
    _long_kernel()
    rank.start(1, {"w": w}, {"w"})
    assert not rank.snap.quiesce(0.0)
    rank.wait()
    assert committed_steps(job / "checkpoints") == []
    assert [s for s, _ in rank.lost] == [1] and "turned off" in rank.lost[0][1]


@needs_cuda
def test_staging_buffer_is_returned_after_each_checkpoint(job):
    """Item 5: the device staging buffer is the checkpoint's alone: once the copy is done its
    memory is back with the caching allocator (a later, larger batch can use it)."""
    rank = Rank(job)
    rank.snap.mode = "gpu"
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(1 << 22, device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    for step in (1, 2):
        w.add_(1)
        rank.start(step, {"w": w}, {"w"})
        rank.snap.gate()
        rank.wait()
        torch.cuda.synchronize()
        probe = torch.empty(1, device=dev)  # the allocator sees the side stream is past it
        assert torch.cuda.memory_allocated(dev) <= base + 512
        del probe
        assert_bit_identical(w.cpu(), rank.committed(step)["w"])


@needs_cuda
def test_the_side_stream_copies_into_the_staging_buffer_only_after_its_fill(job, monkeypatch):
    """Issue 33: under ``torch.use_deterministic_algorithms(True)`` ``torch.empty`` fills the
    staging buffer (0xFF bytes: NaN as float32) with a kernel on the training stream. Here that
    stream is still busy when the buffer is taken (half a second of work queued first), and
    the side stream pauses a second between its copy into the buffer and its copy into the
    slot: a fill the side stream did not wait for lands in between, and the checkpoint holds
    NaN. The side stream waits for it: the bytes are the step's (every order, on a model of
    the streams: test_gpu_path.py)."""
    from cfrun.rank import cudacopy as CC

    rank = Rank(job)
    rank.snap.mode = "gpu"
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(1 << 20, device=dev)
    rank.start(2, {"w": w}, {"w"})  # warm-up: slot, pinning, side stream
    rank.snap.gate()
    rank.wait()
    torch.cuda.synchronize()
    real_empty, real_copy_all = torch.empty, CC.copy_all

    def empty_on_a_busy_stream(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
            torch.cuda._sleep(int(1e9))  # the step still runs: the fill is queued behind it
        return real_empty(*args, **kwargs)

    def copy_then_pause(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        real_copy_all(dsts, srcs)
        if dsts and dsts[0].is_cuda:  # into the staging buffer, on the side stream
            _long_kernel()

    monkeypatch.setattr(torch, "empty", empty_on_a_busy_stream)
    monkeypatch.setattr(CC, "copy_all", copy_then_pause)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        w.add_(1)
        expected = w.clone()
        rank.start(3, {"w": w}, {"w"})
        rank.snap.gate()
        w.mul_(3)  # the next step, after the gate
        rank.wait()
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
    assert_bit_identical(expected.cpu(), rank.committed(3)["w"])


@needs_cuda
def test_copy_is_ordered_after_a_step_on_another_stream(job):
    """Item 6: a loop body under ``with torch.cuda.stream(s)`` steps on ``s``; the boundary
    runs on the default stream. The copy waits for the event the step hook recorded on ``s``."""
    rank = Rank(job)
    rank.snap.mode = "host"
    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.nn.Parameter(torch.zeros(1 << 22, device=dev))
    opt = torch.optim.SGD([w], lr=1.0)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        _long_kernel()
        with torch.no_grad():
            w.add_(1)  # the step's update, on s, after a second of work
        rank.snap.after_step(opt)
    rank.start(1, {"w": w}, {"w"})
    rank.snap.gate()
    rank.wait()
    assert_bit_identical(torch.ones(1 << 22), rank.committed(1)["w"])


@needs_cuda
def test_unpinned_slot_copies_in_the_snapshot_thread(job, monkeypatch):
    """Item 7: when the slot cannot be page-locked the device-to-host copy runs in the
    snapshot thread after the step's event; start() does not wait for the queued step, and the
    next step's gate waits for the copy."""
    from cfrun.rank import cuda as C

    monkeypatch.setattr(C, "host_register", lambda buf, device, **kw: "injected failure")
    rank = Rank(job)
    rank.snap.mode = "host"
    w = torch.randn(1 << 22, device="cuda")
    rank.start(1, {"w": w}, {"w"})  # warm-up
    rank.snap.gate()
    rank.wait()
    assert not rank.snap.slot.pinned
    _long_kernel()
    w.add_(1)
    expected = w.clone()
    took_s = rank.start(2, {"w": w}, {"w"})
    assert took_s < 0.2, f"start() blocked for {took_s:.3f} s behind the queued step"
    rank.snap.gate()
    w.mul_(3)
    rank.wait()
    assert_bit_identical(expected.cpu(), rank.committed(2)["w"])


@needs_cuda
def test_side_stream_is_cfruns_own_not_from_the_pool(job):
    """Item 11: torch.cuda.Stream() hands out a small pool of streams round-robin; cfrun's side
    stream is none of them."""
    rank = Rank(job)
    dev = torch.device("cuda", torch.cuda.current_device())
    side = rank.snap.copier.cuda.side_stream(dev)
    pool = {torch.cuda.Stream(device=dev).cuda_stream for _ in range(80)}
    assert side.cuda_stream not in pool
    w = torch.randn(1 << 20, device=dev)
    rank.start(1, {"w": w}, {"w"})
    rank.snap.gate()
    rank.wait()
    assert_bit_identical(w.cpu(), rank.committed(1)["w"])


# ---------------------------------------------------------------- issue 23 (CPU parts)

def test_copy_plan_is_reused_while_the_layout_holds_and_rebuilt_when_it_changes(job):
    """The per-tensor work (slot layout, views, entry JSON) is done once per state layout;
    every checkpoint still holds its own step's values, and a changed shape makes a new plan."""
    rank = Rank(job)
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(100_000, generator=g), "b": torch.randn(10, generator=g),
             "m": torch.randn(50_000, generator=g).to(torch.bfloat16)}
    rank.start(1, state, {"w", "m"})
    rank.snap.gate()
    rank.wait()
    assert rank.snap.copier._plan is not None
    plan = rank.snap.copier._plan[1]
    for t in state.values():
        t.mul_(3)
    rank.start(2, state, {"w", "m"})
    rank.snap.gate()
    rank.wait()
    assert rank.snap.copier._plan[1] is plan
    for name, t in rank.committed(2).items():
        assert_bit_identical(state[name], t)
    state["m"] = torch.randn(70_001, generator=g)
    rank.start(3, state, {"w", "m"})
    rank.snap.gate()
    rank.wait()
    assert rank.snap.copier._plan[1] is not plan
    for name, t in rank.committed(3).items():
        assert_bit_identical(state[name], t)


def test_slot_is_prepared_off_the_training_thread_and_the_first_checkpoint_reuses_it(job):
    """The slot is allocated and written once on a background thread before the first
    checkpoint (issue 23: on the training thread this stalled the first checkpoint of every
    process for seconds); the checkpoint then uses that slot, no new one."""
    rank = Rank(job)
    state = {"w": torch.randn(300_000), "b": torch.randn(7)}
    main = threading.get_ident()
    seen: list[int] = []
    real = SL.SnapshotSlot._ensure

    def spy(self, *args, **kwargs):
        seen.append(threading.get_ident())
        return real(self, *args, **kwargs)

    SL.SnapshotSlot._ensure = spy  # type: ignore[method-assign]
    try:
        asked = rank.snap.prepare(list(state.values()))
        rank.snap.slot.wait_prepared()
        assert seen and seen[0] != main  # allocated on the slot thread
        path, generation = rank.snap.slot.path, rank.snap.slot.generation
        assert path is not None and asked >= 300_007 * 4
        assert path.stat().st_blocks * 512 >= asked  # every page written already
        rank.start(1, state, {"w"})
        rank.snap.gate()
        rank.wait()
    finally:
        SL.SnapshotSlot._ensure = real  # type: ignore[method-assign]
    assert (rank.snap.slot.path, rank.snap.slot.generation) == (path, generation)
    for name, t in rank.committed(1).items():
        assert_bit_identical(state[name], t)


def test_a_slot_off_tmpfs_is_not_page_locked_and_not_tried_again(tmp_path, monkeypatch):
    """Issue 23: cudaHostRegister of a file mapping on a disk file system (the
    ``<job_dir>/.slots`` fallback) fails and left a pending CUDA error. cfrun does not try it
    there (the reason names the file system), and after a failed try on tmpfs it does not try
    again for the same slot file."""
    from cfrun.contract import slots
    from cfrun.rank import cuda as C

    calls: list[int] = []

    def register(buf, device, **kw):
        calls.append(buf.numel())
        return "injected failure"

    monkeypatch.setattr(C, "host_register", register)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dev = torch.device("cuda", 0)
    (tmp_path / "job").mkdir(mode=0o700)
    slot = SL.SnapshotSlot(tmp_path / "job", 0)
    with monkeypatch.context() as m:
        if slots.fs_type(tmp_path) in slots.MEMORY_FS_TYPES:  # a /tmp in RAM: as if on a disk
            m.setattr(slots, "fs_type", lambda path: "ext4")
        try:
            slot.ensure(1 << 16, pin=True, device=dev)
            assert not slot.pinned and not calls
            assert slot.pin_error and "not tmpfs/hugetlbfs" in slot.pin_error
        finally:
            slot.release()
    if slots.fs_type("/dev/shm") != "tmpfs":
        return
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    monkeypatch.setattr(SL, "shm_dir", lambda job_dir, nbytes: shm)
    slot = SL.SnapshotSlot(tmp_path / "job", 0)
    try:
        slot.ensure(1 << 16, pin=True, device=dev)
        slot.ensure(1 << 16, pin=True, device=dev)
        assert calls == [1 << 16] and slot.pin_error == "injected failure"
        slot.ensure(1 << 17, pin=True, device=dev)  # a new file: tried once more
        assert calls == [1 << 16, 1 << 17]
    finally:
        slot.release()
        shutil.rmtree(shm, ignore_errors=True)


def test_slot_views_are_each_entrys_bytes_whatever_the_dtype_shape_and_offset():
    """The slot views (one ``as_strided`` per tensor over the slot viewed once per dtype) are
    exactly the byte ranges the layout gives, contiguous, in the tensor's dtype and shape:
    0-d, empty, bool, bfloat16, float64 and a transposed source, at slot offset 0 and at a
    page-aligned offset into a larger mapping. A copy through them lands where the file's
    reader looks."""
    from cfrun.codec.format import plan_layout

    tensors = [torch.randn(3, 5), torch.randn(()), torch.zeros(0, 4),
               torch.randn(7).to(torch.bfloat16), torch.randn(2, 3, 4).double(),
               torch.ones(5, dtype=torch.bool), torch.randn(4, 4).t()]
    entries, total = plan_layout(tensors)
    like = [(t.dtype, t.shape) for t in tensors]
    mapping = torch.zeros(total + 8192, dtype=torch.uint8)
    for buf in (mapping[:total], mapping[4096:4096 + total]):
        buf.zero_()
        views = P._views(buf, entries, like)
        for v, t, e in zip(views, tensors, entries):
            assert (v.dtype, v.shape) == (t.dtype, t.shape) and v.is_contiguous()
            v.copy_(t)
            raw = buf[e.offset:e.offset + e.nbytes]
            assert torch.equal(raw, t.contiguous().reshape(-1).view(torch.uint8)), e
