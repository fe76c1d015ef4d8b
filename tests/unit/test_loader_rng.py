"""The pure parts of the DataLoader hooks (cfrun.rank.loader_epoch, cfrun.rank.loader_workers):
the lazy skipping index iterator, the worker RNG states and their checkpoint form, the batch
wrapper, and a worker restarted from recorded states."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

from cfrun.codec.format import decode, encode
from cfrun.rank.loader_epoch import IndexIter, inexact_reasons
from cfrun.rank.loader_workers import (
    WorkerBatch,
    WorkerInit,
    rng_state_for_checkpoint,
    set_worker_rng_state,
    worker_rng_of,
    worker_rng_state,
)


def _batches(n: int = 10, size: int = 3) -> BatchSampler:
    return BatchSampler(RandomSampler(range(n)), size, drop_last=False)


def test_index_iter_draws_nothing_before_its_first_index():
    """As PyTorch's own: RandomSampler draws its seed from the global RNG at the first index,
    so the DataLoader's base seed (drawn after iter()) comes first."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    it = IndexIter(iter(_batches()), skip=2)
    assert torch.equal(torch.get_rng_state(), before)
    next(it)
    assert not torch.equal(torch.get_rng_state(), before)


def test_index_iter_skips_and_primes():
    torch.manual_seed(3)
    plain = list(_batches())
    torch.manual_seed(3)
    assert list(IndexIter(iter(_batches()), skip=0)) == plain
    torch.manual_seed(3)
    it = IndexIter(iter(_batches()), skip=2)
    it.prime()  # drawn now, from this RNG state
    torch.manual_seed(99)  # a later RNG change does not reach the primed permutation
    assert list(it) == plain[2:]
    torch.manual_seed(3)
    it = IndexIter(iter(_batches()), skip=9)
    it.prime()
    assert list(it) == [] and list(it) == []
    with pytest.raises(StopIteration):
        next(it)


def test_worker_rng_state_round_trips_through_the_checkpoint_codec():
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    state = worker_rng_state()
    want = (torch.rand(3), random.random(), np.random.rand())
    tensors: list[torch.Tensor] = []
    tree = encode({"0": rng_state_for_checkpoint(state)}, tensors)
    back = decode(tree, tensors)["0"]
    torch.manual_seed(6)
    random.seed(6)
    np.random.seed(6)
    set_worker_rng_state(back)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    set_worker_rng_state(state)  # the raw form a worker sends works too
    assert torch.equal(torch.rand(3), want[0])


class _Pinnable:
    def __init__(self) -> None:
        self.pinned = False

    def pin_memory(self) -> _Pinnable:
        out = _Pinnable()
        out.pinned = True
        return out


def test_worker_batch_pickles_and_pins_the_batch_inside():
    b = pickle.loads(pickle.dumps(WorkerBatch([torch.ones(2), 3], {"torch": b"x"})))
    assert type(b) is WorkerBatch and torch.equal(b.data[0], torch.ones(2)) and b.data[1] == 3
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = pin_memory(WorkerBatch({"x": _Pinnable()}, {}))  # what the pin-memory thread does
    assert type(pinned) is WorkerBatch and pinned.data["x"].pinned


def test_worker_rng_of_gives_the_checkpoint_form():
    class It:
        pass

    it = It()
    assert worker_rng_of(it) is None  # no workers
    it._cfrun_worker_rng = {"1": worker_rng_state()}  # type: ignore[attr-defined]
    got = worker_rng_of(it)
    assert got is not None and got["1"]["torch"].dtype == torch.uint8


def test_in_order_false_is_said_not_exact():
    ds = list(range(8))
    assert inexact_reasons(DataLoader(ds, num_workers=2)) == []
    assert inexact_reasons(DataLoader(ds, num_workers=0, in_order=False)) == []
    assert "in_order=False" in inexact_reasons(DataLoader(ds, num_workers=2, in_order=False))[0]


class _Noisy(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(torch.rand(())), random.random(), float(np.random.rand())])


def _worker_batches(init: WorkerInit) -> list[WorkerBatch]:
    g = torch.Generator().manual_seed(11)  # the same base seed in both runs
    loader = DataLoader(_Noisy(), batch_size=2, num_workers=1, worker_init_fn=init, generator=g)
    return list(loader)  # without cfrun's hooks nothing unwraps: WorkerBatch objects


def test_a_worker_given_the_states_after_batch_k_continues_with_batch_k_plus_1():
    """Real worker processes: PyTorch's own seeding is kept (batch 0 is the plain run's), and a
    worker started with the states recorded after batch 1 produces batches 2 and 3 again."""
    run = _worker_batches(WorkerInit(None))
    assert [type(b) for b in run] == [WorkerBatch] * 4
    plain = list(DataLoader(_Noisy(), batch_size=2, num_workers=1,
                            generator=torch.Generator().manual_seed(11)))
    assert all(torch.equal(b.data, p) for b, p in zip(run, plain))
    init = WorkerInit(None)
    init.states = {"0": rng_state_for_checkpoint(run[1].rng)}
    again = _worker_batches(init)
    assert torch.equal(again[0].data, run[2].data) and torch.equal(again[1].data, run[3].data)
