"""The parts of a resume on another world size (issue 25, item 4; cfrun.codec.reshard): the data
position in global samples, a DTensor's new local shard cut from the old ranks' shards, and
the script variables a resharded resume leaves live. The end-to-end runs are in
tests/integration/test_reshard.py."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from cfrun.codec.dtensor import LocalShard, MeshMismatchError, mesh_key, to_dtensors
from cfrun.codec.reshard import attach_parts, map_position, sampler_state_for_new_world
from cfrun.rank import liveness


@pytest.mark.parametrize("old,new,want", [
    ((6, 8, 4), (16, 2), (6, 0)),    # 4 -> 2 ranks, the global batch kept
    ((3, 16, 2), (8, 4), (3, 0)),    # 2 -> 4
    ((6, 16, 2), (16, 4), (3, 0)),   # 2 -> 4 ranks, the per-rank batch kept: half the batches
    ((5, 4, 2), (4, 4), (2, 8)),     # 40 samples, 16 a new global batch: 8 seen again
    ((7, 10, 1), (10, 1), (7, 0)),   # no DistributedSampler: one replica either way
])
def test_the_position_is_the_samples_consumed_in_new_batches(old, new, want):
    assert map_position(*old, *new) == want


def test_the_samplers_world_attributes_keep_the_live_values():
    saved = [{"epoch": 3, "seed": 7, "shuffle": True, "num_replicas": 4, "rank": 3,
              "num_samples": 96, "total_size": 384, "drop_last": False}]
    assert sampler_state_for_new_world(saved) == [
        {"epoch": 3, "seed": 7, "shuffle": True, "drop_last": False}]


@pytest.fixture
def mesh(one_rank_mesh: Any) -> Any:
    return one_rank_mesh


def _old_shards(full: torch.Tensor, ranks: int) -> list[LocalShard]:
    """``full`` as FSDP2 on ``ranks`` ranks stores it: dim-0 chunks with their offsets."""
    out, offset = [], 0
    for chunk in torch.chunk(full, ranks, 0):
        out.append(LocalShard(chunk.clone(), {
            "mesh": list(range(ranks)), "dims": ["dp"], "placements": [["shard", 0]],
            "shape": list(full.shape), "stride": list(full.stride()),
            "offset": [offset] + [0] * (full.dim() - 1)}))
        offset += chunk.shape[0]
    return out


def test_a_dtensor_of_3_ranks_is_cut_again_for_the_live_mesh(mesh):
    from torch.distributed.tensor import DTensor, Shard

    full = torch.arange(35.0).reshape(7, 5)  # uneven: chunks of 3, 3, 1 rows
    shards = _old_shards(full, 3)
    tree = {"w": shards[1]}
    attach_parts(tree, [{"w": s} for s in shards])
    live = {mesh_key(mesh.mesh.tolist(), ["dp"]): mesh}
    got = to_dtensors(tree, live)["w"]
    assert isinstance(got, DTensor) and got.placements == (Shard(0),)
    assert torch.equal(got.to_local(), full)  # one rank now: all of it
    assert torch.equal(got.full_tensor(), full)


def test_shards_that_do_not_cover_the_new_one_are_refused(mesh):
    full = torch.arange(12.0).reshape(4, 3)
    shards = _old_shards(full, 2)
    tree = {"w": shards[0]}
    attach_parts(tree, [{"w": shards[0]}, {"w": shards[0]}])  # rank 1's rows missing
    live = {mesh_key(mesh.mesh.tolist(), ["dp"]): mesh}
    with pytest.raises(MeshMismatchError, match="do not cover"):
        to_dtensors(tree, live)
    tree = {"w": shards[0]}
    attach_parts(tree, [{"w": s} for s in shards])
    with pytest.raises(MeshMismatchError, match="no such mesh"):
        to_dtensors(tree, {mesh_key([0], ["tp"]): mesh})  # no live mesh named dp


def test_a_strided_shard_is_refused_not_cut_wrong(mesh):
    shard = _old_shards(torch.zeros(4, 2), 2)[0]
    shard.meta = {**shard.meta, "placements": [["strided_shard", 0, 2]]}
    tree = {"w": shard}
    attach_parts(tree, [{"w": shard}, {"w": shard}])
    with pytest.raises(MeshMismatchError, match="cannot be resharded"):
        to_dtensors(tree, {mesh_key(mesh.mesh.tolist(), ["dp"]): mesh})


def test_old_ranks_that_disagree_on_the_layout_are_refused():
    shard = _old_shards(torch.zeros(4, 2), 2)[0]
    with pytest.raises(ValueError, match="disagree"):
        attach_parts({"w": shard}, [{"w": shard}, {"v": shard}])
    with pytest.raises(ValueError, match="disagree"):
        attach_parts({"w": shard}, [{"w": shard}, {"w": torch.zeros(2)}])


def test_what_the_loops_never_assign_keeps_its_live_value(tmp_path: Path):
    """``rank`` and ``world`` are computed before the loop: a resharded resume keeps the new
    world's; ``step`` and a global a function assigns come from the checkpoint."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent("""\
        rank, world = 3, 4
        best = 0.0
        def bump():
            global best
            best += 1
        step = 0
        for epoch in range(2):
            for i in range(3):
                loss = i / world
                step += 1
                bump()
    """))
    # the inner loop's head (line 8) and the epoch loop's (line 7)
    for line in (7, 8):
        got = liveness._assigned_at(str(path), "<module>", 1, line, ())
        assert got is not None
        assert {"step", "loss", "epoch", "i", "best"} <= got, got
        assert not {"rank", "world"} & got, got


def test_an_old_shard_is_read_only_where_it_overlaps_the_new_one(mesh):
    """A new rank reads the other old ranks' shards lazily (:attr:`LocalShard.load`), each
    where it overlaps its new one: on a 1-rank live mesh every one, once each, and the new
    shard is whole. (Which are skipped on a larger mesh: the FSDP2 run of
    tests/integration/test_reshard.py, 4 -> 2 ranks.)"""
    full = torch.arange(24.0).reshape(6, 4)
    shards = _old_shards(full, 3)
    reads: list[int] = []
    lazy = []
    for i, s in enumerate(shards):
        real = s.local
        s.local = torch.empty(real.shape, dtype=real.dtype, device="meta")
        s.load = (lambda i=i, real=real: (reads.append(i), real)[1])
        lazy.append(s)
    tree = {"w": lazy[0]}
    attach_parts(tree, [{"w": s} for s in lazy])
    got = to_dtensors(tree, {mesh_key(mesh.mesh.tolist(), ["dp"]): mesh})["w"]
    assert torch.equal(got.to_local(), full) and sorted(reads) == [0, 1, 2]
