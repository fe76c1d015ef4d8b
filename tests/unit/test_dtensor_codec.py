"""DTensor state in the checkpoint format (issue 25, item 1; cfrun.codec.dtensor): a DTensor
is stored as its local shard plus placement metadata, decoded as a LocalShard and rebuilt on
the live mesh; crafted metadata is refused as a corrupt tree, a mesh the live job lacks as a
mismatch. In-process, on a 1-rank gloo group over a HashStore."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cfrun.codec.dtensor import LocalShard, MeshMismatchError, live_meshes, to_dtensors
from cfrun.codec.format import decode, encode


@pytest.fixture
def mesh(one_rank_mesh: Any) -> Any:
    return one_rank_mesh


def test_a_dtensor_is_its_local_shard_with_placement_and_comes_back(mesh):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    param = torch.nn.Parameter(distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh,
                                                 [Shard(0)]))
    tensors: list[torch.Tensor] = []
    tree = encode({"w": param, "plain": torch.ones(2)}, tensors)
    assert tensors[0] is param._local_tensor  # the live shard itself, not a copy
    assert tree["w"]["meta"] == {"mesh": [0], "dims": ["dp"], "placements": [["shard", 0]],
                                 "shape": [4, 3], "stride": [3, 1], "offset": [0, 0]}
    got = decode(tree, [t.clone() for t in tensors])
    assert isinstance(got["w"], LocalShard) and got["w"].shape == torch.Size([4, 3])
    back = to_dtensors(got, live_meshes([torch.nn.Linear(1, 1), _Holder(param)]))
    assert isinstance(back["w"], DTensor) and back["w"].placements == (Shard(0),)
    assert torch.equal(back["w"].full_tensor(), param.full_tensor())
    assert torch.equal(back["plain"], torch.ones(2))
    with pytest.raises(MeshMismatchError, match=r"device mesh \[0\]"):
        to_dtensors(got, {})  # the live job has no such mesh


class _Holder(torch.nn.Module):
    def __init__(self, p: torch.nn.Parameter) -> None:
        super().__init__()
        self.p = p


_GOOD = {"mesh": [0, 1], "dims": ["dp"], "placements": [["shard", 0]], "shape": [4, 3],
         "stride": [3, 1], "offset": [2, 0]}


@pytest.mark.parametrize("field,value", [
    ("mesh", [[0, 1], [2]]), ("mesh", "0"), ("dims", ["a", "b"]), ("placements", [["bogus"]]),
    ("placements", []), ("shape", [-1, 3]), ("stride", [1]), ("offset", "x")])
def test_crafted_dtensor_metadata_does_not_decode(field, value):
    """What check_usable turns into a corrupt checkpoint (a ValueError while decoding)."""
    meta = dict(_GOOD, **{field: value})
    with pytest.raises(ValueError):
        decode({"__dt__": 0, "meta": meta}, [torch.zeros(2, 3)])
    assert isinstance(decode({"__dt__": 0, "meta": dict(_GOOD)}, [torch.zeros(2, 3)]),
                      LocalShard)


def test_cfrun_verify_compares_stored_shards_by_placement_and_bits():
    """cfrun verify's comparison (cfrun.codec.compare) of two checkpoints of a sharded job."""
    from cfrun.codec.compare import differences

    def state(value: float, offset: int) -> dict[str, Any]:
        shard = LocalShard(torch.full((2, 3), value), dict(_GOOD, offset=[offset, 0]))
        return {"modules": [{"w": shard}]}

    assert list(differences(state(1.0, 2), state(1.0, 2))) == []
    [bits] = differences(state(1.0, 2), state(0.5, 2))
    assert "values differ" in bits.detail
    [placed] = differences(state(1.0, 2), state(1.0, 0))
    assert placed.detail.startswith("placed")


@pytest.mark.parametrize("field,value", [
    ("placements", [["shard", 2]]), ("placements", [["shard", -1]]),
    ("placements", [["strided_shard", 7, 2]]), ("placements", [["strided_shard", 0, 0]]),
    ("placements", [["partial", "xor"]]), ("placements", [["replicate", 1]]),
    ("offset", [3, 0]), ("shape", [4, 2])])
def test_a_bad_placement_dimension_or_a_shard_outside_its_shape_does_not_decode(field, value):
    """Issue 32, finding 6: ``Shard(2)`` of a 2-D tensor decoded, then DTensor's own code
    raised an IndexError past the refusal at resume (cfrun stopped instead of refusing the
    checkpoint); a shard placed outside its shape did too. Now both are decode errors, which
    check_usable turns into a corrupt checkpoint."""
    meta = dict(_GOOD, **{field: value})
    with pytest.raises(ValueError):
        decode({"__dt__": 0, "meta": meta}, [torch.zeros(2, 3)])


def test_export_refuses_a_crafted_shape_before_allocating_it():
    """Issue 32, finding 6: crafted DTensor metadata (a global shape of 2**40 elements over
    one 2 x 3 shard) made ``cfrun export`` allocate by the JSON's shape before the coverage
    check. Now the shards' elements are counted first: refused, nothing allocated."""
    from cfrun.codec.dtensor import gather_full

    huge = LocalShard(torch.zeros(2, 3), dict(_GOOD, shape=[1 << 39, 3], offset=[0, 0]))
    with pytest.raises(ValueError, match="do not cover"):
        gather_full([huge])
    whole = LocalShard(torch.ones(2, 3), dict(_GOOD, shape=[2, 3], offset=[0, 0]))
    assert torch.equal(gather_full([whole]), torch.ones(2, 3))
