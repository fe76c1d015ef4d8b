"""Issue 23: the capture keeps the encoded models and optimizer state between checkpoints while
they hold the very same tensors (cfrun.rank.capture.EncodeCache). What it returns must equal a
fresh encode at every checkpoint: after steps (same objects, new values), after a parameter or
a buffer is replaced, after the optimizer gains state, when the list starts elsewhere, and never
for leaves that may change without a new object."""

from __future__ import annotations

import torch
import torch.nn as nn

from cfrun.codec.format import encode
from cfrun.rank.capture import EncodeCache


def _both(cache: EncodeCache, part, prefix: int = 0):
    fresh: list[torch.Tensor] = [torch.zeros(1)] * prefix
    want = encode(part, fresh)
    got_tensors: list[torch.Tensor] = [torch.zeros(1)] * prefix
    got, hit = cache.encode(part, got_tensors)
    assert got == want
    assert len(got_tensors) == len(fresh)
    assert all(a is b for a, b in zip(got_tensors[prefix:], fresh[prefix:]))
    return hit


def test_module_state_dicts_hit_while_the_tensors_are_the_same_objects():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cache = EncodeCache()
    sds = lambda: [model.state_dict(keep_vars=True)]  # noqa: E731
    assert not _both(cache, sds())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # new values, same objects
    assert _both(cache, sds())
    model[0].weight = nn.Parameter(torch.randn(8, 4))  # a replaced parameter
    assert not _both(cache, sds())
    assert _both(cache, sds())
    model[1].running_mean = torch.zeros(8)  # a replaced buffer
    assert not _both(cache, sds())
    assert not _both(cache, sds(), prefix=3)  # the list starts elsewhere: indices differ
    assert _both(cache, sds(), prefix=3)
    model.add_module("extra", nn.Linear(2, 2))  # new keys
    assert not _both(cache, sds(), prefix=3)


def test_optimizer_state_hits_once_it_exists_and_other_leaves_are_never_kept():
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    cache = EncodeCache()
    assert not _both(cache, opt.state_dict()["state"])  # empty before the first step
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert not _both(cache, opt.state_dict()["state"])  # now it has moments
    opt.step()
    assert _both(cache, opt.state_dict()["state"])
    floats = {0: {"step": 3.0, "exp_avg": torch.zeros(2)}}
    assert not _both(cache, floats)
    floats[0]["step"] = 4.0  # a float changes without a new object: never a hit
    assert not _both(cache, floats)
