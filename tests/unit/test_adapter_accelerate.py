"""cfrun.rank.adapters.accelerate.read_ahead: the batch DataLoaderShard holds beyond the script."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from cfrun.rank.adapters import accelerate as ACC


def _shard_frame():
    """The frame of a real ``DataLoaderShard.__iter__`` generator, suspended at its first
    yield (it has read one batch ahead)."""
    data_loader = pytest.importorskip("accelerate.data_loader")
    shard = data_loader.DataLoaderShard(TensorDataset(torch.arange(6.0)), batch_size=2)
    gen = iter(shard)
    next(gen)
    return gen, gen.gi_frame


def test_a_tested_version_corrects_one_batch():
    gen, frame = _shard_frame()
    assert ACC.read_ahead(frame) == (1, None)
    assert ACC.is_shard_iter(frame)


def test_an_untested_version_falls_back_and_says_why(monkeypatch):
    gen, frame = _shard_frame()
    monkeypatch.setattr(ACC, "installed_version", lambda dist: "0.0.1")
    ahead, why = ACC.read_ahead(frame)
    assert ahead == 0
    assert why is not None and why.startswith("accelerate 0.0.1 is not a version") \
        and "1.15.0" in why


def test_other_callers_are_left_alone():
    assert ACC.read_ahead(sys._getframe()) == (0, None)
    assert not ACC.is_shard_iter(sys._getframe())
