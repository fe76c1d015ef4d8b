"""Script variables that alias the live model and optimizer (issue 34, item 1), in-process: a
capture stores them as aliases (no bytes), a restore makes them views of the loaded objects;
copies stay values; an alias of a tensor cfrun does not know is named."""

from __future__ import annotations

import copy
import inspect
import json
import types
from typing import Any

import pytest
import torch

from cfrun.codec.format import TensorAlias, decode, encode
from cfrun.rank.aliases import AliasIndex
from cfrun.rank.frames import capture_frames, restore_frames


def _job() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _frame(model: torch.nn.Module, opt: torch.optim.Optimizer, empty: bool = False
           ) -> types.FrameType:
    """A frame holding the variables (``empty``: all None, a restarted script's)."""
    def holder():
        if empty:
            sd = row = flat = moments = mean = copied = cloned = None  # noqa: F841
            return inspect.currentframe()
        sd = model.state_dict()  # noqa: F841 (read through the frame)
        row = model[0].weight[1]  # noqa: F841
        flat = model[0].weight.detach().view(-1)[2:]  # noqa: F841
        moments = opt.state_dict()  # noqa: F841
        mean = model[1].running_mean  # noqa: F841
        copied = copy.deepcopy(model.state_dict())  # noqa: F841
        cloned = model[0].bias.detach().clone()  # noqa: F841
        return inspect.currentframe()

    frame = holder()
    assert frame is not None
    return frame


def _capture(frame: types.FrameType, model: torch.nn.Module, opt: torch.optim.Optimizer
             ) -> tuple[list[dict], list[torch.Tensor], list[str]]:
    tensors: list[torch.Tensor] = []
    cap = capture_frames([frame], tensors, {id(m) for m in model.modules()},
                         known=lambda: AliasIndex([model], [opt]))
    records = json.loads(json.dumps(cap.records))  # as the checkpoint holds them
    return decode(records, tensors), tensors, cap.unknown


def test_aliases_are_stored_without_bytes_and_restored_as_views() -> None:
    model, opt = _job()
    decoded, tensors, unknown = _capture(_frame(model, opt), model, opt)
    values = decoded[0]["values"]
    assert isinstance(values["sd"]["v"]["0.weight"], TensorAlias)
    assert values["moments"]["v"]["state"][0]["exp_avg"].same
    assert isinstance(values["cloned"]["v"], torch.Tensor)
    assert isinstance(values["copied"]["v"]["0.weight"], torch.Tensor)
    # only the copies' bytes are stored: `copied`'s 7 (0.weight, 0.bias, 1.weight, 1.bias,
    # running_mean, running_var, num_batches_tracked) and `cloned`
    assert len(tensors) == 8 and unknown == []

    other, other_opt = _job()  # the restarted script's objects, then the checkpoint loaded
    other_opt.load_state_dict(opt.state_dict())
    fresh = _frame(other, other_opt, empty=True)
    first = restore_frames(decoded, decoded, [fresh])  # no placement yet: the aliases wait
    assert set(first) - {"empty"} == {"cloned", "copied"} and fresh.f_locals["sd"] is None
    index = AliasIndex([other], [other_opt])
    restored = restore_frames(decoded, decoded, [fresh], aliases=index.place)
    assert set(restored) - {"empty"} == {"sd", "row", "flat", "moments", "mean", "copied",
                                         "cloned"}
    got = fresh.f_locals
    w = other[0].weight
    assert all(got["sd"][k].data_ptr() == v.data_ptr() for k, v in other.state_dict().items())
    assert not got["sd"]["0.weight"].requires_grad
    assert got["row"].data_ptr() == w[1].data_ptr() and got["row"].grad_fn is not None
    assert got["flat"].storage_offset() == 2 and got["flat"].data_ptr() == w.view(-1)[2:].data_ptr()
    assert got["moments"]["state"][0]["exp_avg"] is other_opt.state[w]["exp_avg"]
    assert got["mean"] is other[1].running_mean
    assert got["copied"]["0.weight"].data_ptr() != w.data_ptr()
    with torch.no_grad():
        w.add_(1.0)
    assert torch.equal(got["sd"]["0.weight"], w.detach())  # it follows the model


def test_a_view_of_a_tensor_cfrun_does_not_know_is_named() -> None:
    """Named (and marked ``shared``) when the loops may assign it."""
    model, opt = _job()
    buf = torch.arange(10.0)

    def holder():  # suspended in its loop (a frame the liveness analysis reads)
        for _ in range(1):
            head = buf[:4]  # noqa: F841 (a part of a storage no stored variable holds whole)
            whole = buf  # noqa: F841
            same = buf.view(2, 5)  # noqa: F841 (the storage `whole` holds)
            own = torch.ones(3)  # noqa: F841
            yield

    gen = holder()
    next(gen)
    frame = gen.gi_frame
    tensors: list[torch.Tensor] = []
    cap = capture_frames([frame], tensors, set(), known=lambda: AliasIndex([model], [opt]))
    # buf is a free variable: assigned elsewhere, as far as the analysis knows
    assert sorted(cap.unknown) == ["holder:buf", "holder:head", "holder:same", "holder:whole"]
    values = cap.records[0]["values"]
    assert sorted(n for n, v in values.items() if v.get("shared")) == \
        ["buf", "head", "same", "whole"]


def _invariants(data: torch.Tensor) -> tuple[Any, types.FrameType]:
    """A script's setup before its loop (a text and its splits, slices of it), suspended in
    its loop: the generator (keep it) and its frame."""
    def script(data):
        train, val = data[:6], data[6:]
        for _ in range(1):
            yield train.sum() + val.sum() + data.sum()  # all three read in the loop: stored

    gen = script(data)
    next(gen)
    return gen, gen.gi_frame


def test_a_variable_made_again_before_the_loop_keeps_its_aliases(
        capfd: pytest.CaptureFixture[str]) -> None:
    """steploop_train.py's ``train_data, val_data = data[:n], data[n:]``: not named at the
    checkpoint; at the resume the restarted script's own views stay, holding the same bits."""
    model, opt = _job()
    _gen, frame = _invariants(torch.arange(10.0))
    tensors: list[torch.Tensor] = []
    cap = capture_frames([frame], tensors, set(), known=lambda: AliasIndex([model], [opt]))
    assert cap.unknown == []
    decoded = decode(json.loads(json.dumps(cap.records)), tensors)
    index = AliasIndex([model], [opt])

    _gen2, fresh = _invariants(torch.arange(10.0))
    before = {n: fresh.f_locals[n] for n in ("data", "train", "val")}
    restored = restore_frames(decoded, decoded, [fresh], aliases=index.place)
    assert {"data", "train", "val"} <= set(restored)
    assert all(fresh.f_locals[n] is t for n, t in before.items())
    assert "WARNING" not in capfd.readouterr().err

    _gen3, changed = _invariants(torch.arange(10.0) * 2)  # changed after the checkpoint
    restore_frames(decoded, decoded, [changed], aliases=index.place)
    got = changed.f_locals
    assert torch.equal(got["train"], torch.arange(6.0))
    assert got["train"].data_ptr() != got["data"].data_ptr()  # copies now
    assert "script variable script:train shared its storage" in capfd.readouterr().err


@pytest.mark.parametrize("alias, why", [
    ({"ref": ["model", 0, "w"], "dtype": "object", "shape": [1], "stride": [1], "offset": 0,
      "grad": False, "same": False}, "dtype"),
    ({"ref": [], "dtype": "float32", "shape": [1], "stride": [1], "offset": 0,
      "grad": False, "same": False}, "reference"),
    ({"ref": ["model", 0, "w"], "dtype": "float32", "shape": [1, 2], "stride": [1],
      "offset": 0, "grad": False, "same": False}, "stride"),
    ({"ref": ["model", 0, "w"]}, "tensor alias"),
])
def test_crafted_aliases_are_refused(alias: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        decode({"__alias__": alias}, [])


def test_an_alias_that_no_longer_fits_is_not_placed() -> None:
    model, opt = _job()
    alias = AliasIndex([model], [opt]).alias_of(model[0].weight.detach()[2])
    assert alias is not None
    smaller = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.BatchNorm1d(1))
    with pytest.raises(ValueError, match="no longer fits"):
        AliasIndex([smaller], []).place(alias)
    with pytest.raises(ValueError, match="lacks"):
        AliasIndex([], []).place(alias)
    assert decode(encode(alias, []), []) == alias
