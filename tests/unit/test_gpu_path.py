"""The CUDA path's pieces that exist on CPU (issue 18): the coalesced staging layout, the
per-node /dev/shm room, the GradScaler state without a host sync. The CUDA-only items are in
test_snapshot.py (marked, skipped without a GPU)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bit_identical

from cfrun.codec.format import plan_layout
from cfrun.rank import copyplan as P
from cfrun.rank import slot as SL
from cfrun.rank.capture import scaler_numbers, scaler_state


def test_back_to_back_tensors_are_staged_as_one_run_copied_in_one_piece():
    """Tensors that lie back to back in the slot form one run (one device-to-host copy); a
    tensor between them that is copied elsewhere splits the run. Every staged view keeps its
    dtype's alignment, and copying each run in one piece puts every tensor where the slot's
    layout has it (CPU stands in for the device)."""
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(1001, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
               torch.randint(0, 9, (33,), generator=g), torch.randn(5, 5, generator=g),
               torch.randn(300, generator=g).to(torch.float64)]
    entries, total = plan_layout(tensors)
    later = [0, 1, 3, 4]  # tensor 2 is copied on the training thread (a "small" one)
    offsets, runs, size = P.run_layout([entries[i] for i in later])
    assert [(lo, hi) for lo, hi, _ in runs] == [
        (entries[0].offset, entries[1].offset + entries[1].nbytes),
        (entries[3].offset, entries[4].offset + entries[4].nbytes)]
    assert all(off % 64 == 0 for off in offsets) and runs[1][2] % P.STAGING_ALIGN_BYTES == 0
    staging = torch.zeros(size, dtype=torch.uint8)
    sources = [tensors[i] for i in later]
    P.copy_all([P.staged_view(staging, off, s) for off, s in zip(offsets, sources)], sources)
    slot = torch.zeros(total, dtype=torch.uint8)
    slot[entries[2].offset:entries[2].offset + entries[2].nbytes].copy_(
        tensors[2].view(torch.uint8))
    for lo, hi, stage in runs:
        slot[lo:hi].copy_(staging[stage:stage + hi - lo])
    for e, t in zip(entries, tensors):
        got = slot[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape)
        assert_bit_identical(t, got)


def test_shm_room_counts_every_local_rank_less_the_slots_already_written(tmp_path: Path,
                                                                          monkeypatch):
    """Issue 18, item 11: 8 ranks of a node need room for 8 slots, not each for its own; the
    slot files already written there are already out of the free count."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert SL.node_room_bytes(tmp_path, 100 << 20) == 2 * 8 * (100 << 20)
    with open(tmp_path / "rank1.slot", "wb") as f:
        f.write(os.urandom(1 << 20))
        os.fsync(f.fileno())
    written = (tmp_path / "rank1.slot").stat().st_blocks * 512
    assert written >= 1 << 20
    assert SL.node_room_bytes(tmp_path, 100 << 20) == 2 * 8 * (100 << 20) - written
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert SL.node_room_bytes(tmp_path, 100 << 20) == 2 * (100 << 20)


def test_grad_scaler_state_is_taken_without_item_and_loads_back(monkeypatch):
    """Issue 18, item 8: GradScaler.state_dict() calls .item() (on CUDA a host sync that waits
    for the queued step, at every checkpoint). The checkpoint takes the scale and growth
    tracker as tensors; the resume turns them back into the numbers load_state_dict takes."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(4):
        opt.zero_grad()
        scaler.scale((w * 2).sum()).backward()
        scaler.step(opt)
        scaler.update()
    expected = scaler.state_dict()

    def no_sync(*args, **kwargs):
        raise AssertionError("the checkpoint called .item() on the scaler's state")

    monkeypatch.setattr(type(scaler), "get_scale", no_sync)
    monkeypatch.setattr(type(scaler), "_get_growth_tracker", no_sync)
    sd = scaler_state(scaler)
    assert isinstance(sd["scale"], torch.Tensor) and sd["scale"] is scaler._scale
    monkeypatch.undo()
    stored = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    fresh = torch.amp.GradScaler("cpu")
    fresh.scale(torch.ones(()))  # its _scale exists, as in a resumed script's first step
    fresh.load_state_dict(scaler_numbers(stored))
    assert fresh.state_dict() == expected
    assert scaler_numbers(None) is None and scaler_numbers({}) == {}


def test_a_disabled_scaler_gives_its_own_state_dict():
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    assert scaler_state(scaler) == {}


# ------------------------------------------- the side stream's order, on a model of CUDA streams

class _Stream:
    """A CUDA stream as a list of operations in queue order: ``("run", fn)``, or ``("wait",
    (stream, n))`` (an event wait: the first ``n`` operations of ``stream`` must have run)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[tuple[str, Any]] = []

    def wait_event(self, event: _Event) -> None:
        self.ops.append(("wait", event.at))


class _Event:
    """A CUDA event: recorded on a stream, complete once what was queued there before it ran."""

    def __init__(self, **kwargs: Any) -> None:
        self.at: tuple[_Stream, int] | None = None

    def record(self, stream: _Stream) -> None:
        self.at = (stream, len(stream.ops))


class _Cuda:
    """The part of ``torch.cuda`` :mod:`cfrun.rank.cudacopy` calls, over :class:`_Stream`s."""

    Event = _Event

    def __init__(self, training: _Stream) -> None:
        self.current = training

    def current_stream(self, device: Any = None) -> _Stream:
        return self.current

    def device(self, device: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def stream(self, stream: _Stream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return 1 << 40, 1 << 40


class _Device(torch.Tensor):
    """Memory only the streams write (device memory, the page-locked slot): a copy into it or
    a fill of it is queued on the current stream (:class:`_Cuda`), to run later."""

    cuda: _Cuda | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if cls.cuda is not None and func in (torch.Tensor.copy_, torch.Tensor.fill_,
                                             torch._foreach_copy_):
            with torch._C.DisableTorchFunctionSubclass():
                plain = [[t.as_subclass(torch.Tensor) for t in a] if isinstance(a, list)
                         else a.as_subclass(torch.Tensor) if isinstance(a, torch.Tensor) else a
                         for a in args]
            cls.cuda.current.ops.append(("run", lambda: func(*plain, **kwargs)))
            return args[0]
        return super().__torch_function__(func, types, args, kwargs)

    def record_stream(self, stream: Any) -> None:  # type: ignore[override]
        """The caching allocator's bookkeeping: nothing to model."""


class _Torch:
    """``torch`` as :mod:`cfrun.rank.cudacopy` sees it here: :class:`_Cuda`, and ``empty``
    handing out :class:`_Device` memory as CUDA's does: under
    ``torch.use_deterministic_algorithms(True)`` (with
    ``torch.utils.deterministic.fill_uninitialized_memory``, its default) filled on the
    current stream (0xFF bytes: NaN as float32)."""

    def __init__(self, cuda: _Cuda) -> None:
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def empty(self, *size: Any, dtype: Any = None, device: Any = None) -> torch.Tensor:
        out = torch.zeros(*size, dtype=dtype).as_subclass(_Device)
        if torch.are_deterministic_algorithms_enabled() \
                and torch.utils.deterministic.fill_uninitialized_memory:
            out.fill_(255)
        return out


def _schedules(streams: list[_Stream]) -> Iterator[list[int]]:
    """Every order in which the streams' operations may run: each stream in its own order, an
    event wait only once what it waits for has run."""
    def walk(done: list[int], order: list[int]) -> Iterator[list[int]]:
        if all(n == len(s.ops) for n, s in zip(done, streams)):
            yield order
            return
        for k, s in enumerate(streams):
            if done[k] == len(s.ops):
                continue
            kind, what = s.ops[done[k]]
            if kind == "wait" and done[streams.index(what[0])] < what[1]:
                continue
            done[k] += 1
            yield from walk(done, order + [k])
            done[k] -= 1

    yield from walk([0] * len(streams), [])


@pytest.mark.parametrize("mode", ["gpu", "thread"])
def test_the_side_stream_copies_into_the_staging_buffer_only_after_its_fill(monkeypatch, mode):
    """Issue 33 (the thread mode once in five rounds on an H200: a resumed run whose GradScaler
    found inf at every step). The staging buffer comes from the training stream's caching
    allocator, and under ``torch.use_deterministic_algorithms(True)`` (train_cuda_amp.py, and
    any script that wants bit-exact runs) ``torch.empty`` fills it there: a kernel queued on
    the training stream after the step. The side stream copies the state into that buffer and
    from it into the slot; had it waited only for an event recorded before the allocation, the
    fill could run between its two copies and the checkpoint would hold 0xFF bytes (NaN) in
    the parameters and the optimizer state. Here every order the two streams may run in (a
    model of CUDA's streams and events; the step's own update queued first) must leave the
    slot with the state as the step left it."""
    from cfrun.rank import cudacopy as CC

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        # the premise, on the real torch: new memory comes filled, NaN as float32
        assert torch.empty(2, dtype=torch.uint8).view(torch.int16).eq(-1).all()
        assert torch.empty(2, dtype=torch.float32).isnan().all()
        training, side = _Stream("training"), _Stream("side")
        cuda = _Cuda(training)
        monkeypatch.setattr(CC, "torch", _Torch(cuda))
        monkeypatch.setattr(_Device, "cuda", cuda)
        g = torch.Generator().manual_seed(0)
        before = [torch.randn(3000, generator=g), torch.randn(17, 33, generator=g)]
        after = [t + 1 for t in before]  # what the step's last update leaves
        live = [t.clone() for t in before]
        training.ops.append(("run", lambda: [d.copy_(s) for d, s in zip(live, after)]))
        entries, total = plan_layout(live)
        slot = torch.zeros(total, dtype=torch.uint8).as_subclass(_Device)
        views = [slot[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape)
                 for e, t in zip(entries, live)]
        copies = CC.CudaCopies()
        device = torch.device("cpu")  # stands in for the CUDA device
        copies.streams[device] = side
        copies.enqueue(slot, list(zip(views, live)), entries, [device], mode=mode)
        monkeypatch.setattr(_Device, "cuda", None)
        assert any(op[0] == "run" for op in side.ops), "no copy was queued on the side stream"
        assert len(training.ops) == 2, "the staging buffer was not allocated on the step's stream"
        plain_slot = slot.as_subclass(torch.Tensor)
        orders = 0
        for order in _schedules([training, side]):
            orders += 1
            for t, b in zip(live, before):
                t.copy_(b)
            plain_slot.fill_(0)
            done = [0, 0]
            for k in order:
                kind, fn = (training, side)[k].ops[done[k]]
                done[k] += 1
                if kind == "run":
                    fn()
            for e, t in zip(entries, after):
                got = plain_slot[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape)
                assert torch.equal(got, t), \
                    f"stream order {order}: the slot holds {got.flatten()[:3].tolist()}"
        assert orders >= 1
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
