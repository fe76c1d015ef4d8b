"""The CUDA path's pieces that exist on CPU (issue 18): the coalesced staging layout, the
per-node /dev/shm room, the GradScaler state without a host sync. The CUDA-only items are in
test_snapshot.py (marked, skipped without a GPU)."""

from __future__ import annotations

import os
from pathlib import Path

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
