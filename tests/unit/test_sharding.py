"""DeepFreeze 1/N sharded persist: split, real files, reassembly, corruption."""

from __future__ import annotations

import pytest
import torch

from cfrun.codec.checkpoint import commit, load_newest, load_shard, staging_dir, write_shard
from cfrun.codec.format import encode
from cfrun.codec.sharding import SHARD_MIN_BYTES, shard_replicated, split_ranges
from cfrun.contract.errors import CheckpointCorruptError


def test_split_ranges_match_torch_tensor_split():
    for n in (1, 5, 7, 64, 1000):
        for world in (1, 2, 3, 4, 8):
            ranges = split_ranges(n, world)
            sizes = [len(c) for c in torch.tensor_split(torch.arange(n), world)]
            assert [b - a for a, b in ranges] == sizes
            assert ranges[0][0] == 0 and ranges[-1][1] == n


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 130, generator=g),  # largest dim 0
        "v": torch.randn(17, 999, generator=g),  # largest dim 1, uneven split
        "small": torch.randn(8, generator=g),  # below SHARD_MIN_BYTES: whole on every rank
        "step": torch.tensor(12.0),  # 0-d: whole
    }


def _write(tmp_path, world: int, step: int, replicated: dict, per_rank: list[dict]):
    ckpts = tmp_path / "checkpoints"
    files = []
    for rank in range(world):
        tensors: list[torch.Tensor] = []
        tree = {"modules": encode(replicated, tensors), "rng": encode(per_rank[rank], tensors)}
        ids = {id(t) for t in replicated.values()}
        layout, _ = shard_replicated(tensors, ids, rank, world)
        tree["sharded"] = layout
        files += write_shard(staging_dir(ckpts, step), rank, tree, tensors, {"step": step})
    commit(ckpts, step, files, world_size=world, meta={"step": step}, keep=5)
    return ckpts


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_rank_writes_its_slice_and_loading_reassembles_bit_for_bit(tmp_path, world):
    full = _state(0)
    per_rank = [{"seed": torch.tensor([r, r + 1])} for r in range(world)]
    ckpts = _write(tmp_path, world, 10, full, per_rank)
    step_dir = ckpts / "step-000010"
    whole = sum(t.numel() * t.element_size() for t in full.values())
    bins = [(step_dir / f"rank-{r:05d}.bin").stat().st_size for r in range(world)]
    assert max(bins) < whole / world + 2 * SHARD_MIN_BYTES  # about 1/N each, not the whole
    for rank in range(world):
        state, _ = load_shard(step_dir, rank)
        for k, t in full.items():
            got = state["modules"][k]
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k
        assert torch.equal(state["rng"]["seed"], per_rank[rank]["seed"])  # per rank, its own
        assert len(state["sharded"]) == 2


@pytest.mark.parametrize("chunk_bytes", [4096, 1000, 7])
def test_loading_streams_every_file_through_chunks_smaller_than_one_tensor(tmp_path,
                                                                           monkeypatch,
                                                                           chunk_bytes):
    """Issue 18, item 10: each rank streams the shard files through a small buffer straight
    into the full tensors (slices along dim 0 in place, along dim 1 through one temporary);
    tensors cross chunk boundaries at any byte."""
    import cfrun.codec.checkpoint as C

    monkeypatch.setattr(C, "LOAD_CHUNK_BYTES", chunk_bytes)
    world = 3
    full = _state(5) if chunk_bytes > 7 else {"w": _state(5)["w"], "e": torch.empty(0, 3)}
    per_rank = [{"seed": torch.tensor([r, r + 1]), "none": torch.empty(0)} for r in range(world)]
    ckpts = _write(tmp_path, world, 10, full, per_rank)
    for rank in range(world):
        state, _ = load_shard(ckpts / "step-000010", rank)
        for k, t in full.items():
            got = state["modules"][k]
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), k
        assert torch.equal(state["rng"]["seed"], per_rank[rank]["seed"])
        assert state["rng"]["none"].shape == (0,)


def test_one_rank_slice_corrupt_makes_every_rank_skip_the_checkpoint(tmp_path):
    world = 2
    per_rank = [{"x": torch.tensor([r])} for r in range(world)]
    ckpts = _write(tmp_path, world, 10, _state(1), per_rank)
    _write(tmp_path, world, 20, _state(2), per_rank)
    bin1 = ckpts / "step-000020" / "rank-00001.bin"
    raw = bytearray(bin1.read_bytes())
    raw[100] ^= 0xFF  # same size: only the checksum can tell
    bin1.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError):
        load_shard(ckpts / "step-000020", 0)  # rank 0 needs rank 1's slices too
    step, state, _ = load_newest(ckpts, 0)
    assert step == 10 and torch.equal(state["modules"]["w"], _state(1)["w"])


def test_a_missing_shard_file_is_skipped_by_every_rank_without_reading_it(tmp_path):
    world = 2
    per_rank = [{"x": torch.tensor([r])} for r in range(world)]
    ckpts = _write(tmp_path, world, 10, _state(1), per_rank)
    _write(tmp_path, world, 20, _state(2), per_rank)
    (ckpts / "step-000020" / "rank-00001.json").unlink()
    for rank in range(world):
        step, _, _ = load_newest(ckpts, rank)
        assert step == 10
