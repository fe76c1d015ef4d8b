"""DataLoader workers' random streams: each worker's torch/python/numpy RNG states travel back
with every batch it loads (:class:`WorkerBatch`), the main process keeps each worker's states
after its last consumed batch (:func:`worker_rng_of`, for the checkpoint), and a resumed epoch's
workers start from them (:class:`WorkerInit`, :func:`seed_workers`) with PyTorch's round-robin
at the worker that loaded the next batch in the original run (:func:`worker_hooks`). The
overview is in :mod:`cfrun.rank.data`.

:class:`WorkerInit` and :class:`WorkerBatch` cross into and out of the worker processes by
pickling (spawn/forkserver workers unpickle them by this module's path).
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dl
from torch.utils.data._utils import fetch as _fetch

from cfrun.rank.loader_epoch import set_epoch_rng


def worker_rng_state() -> dict[str, Any]:
    """This process's torch CPU, python ``random`` and (when imported) numpy global RNG states,
    as plain picklable values (the torch state as ``bytes``: no shared-memory tensor per batch).
    Called in a DataLoader worker after each fetch."""
    np = sys.modules.get("numpy")
    t = torch.get_rng_state()
    state: dict[str, Any] = {"torch": t.numpy().tobytes() if np is not None else bytes(t.tolist()),
                             "random": random.getstate()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def rng_state_for_checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    """A :func:`worker_rng_state` value in the form the checkpoint codec stores (torch state as
    a uint8 tensor, as :func:`cfrun.rank.rng.get_global_rng` has it). Main process."""
    out = dict(state)
    out["torch"] = torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8)
    return out


def set_worker_rng_state(state: dict[str, Any]) -> None:
    """Put back a worker's RNG states (a :func:`worker_rng_state` or its checkpoint form, as
    decoded: tuples may have become lists). Called in the worker, after ``worker_init_fn``."""
    t = state["torch"]
    t = torch.frombuffer(bytearray(t), dtype=torch.uint8) if isinstance(t, bytes) else t
    torch.set_rng_state(t)
    rnd = state["random"]
    random.setstate((rnd[0], tuple(rnd[1]), rnd[2]))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))


class WorkerBatch:
    """A worker's batch with the worker's RNG states right after the fetch.

    Travels through the result queue (picklable) and the pin-memory thread (``pin_memory()``
    pins the batch inside); the main process unwraps it before the batch reaches the script.
    """

    __slots__ = ("data", "rng")

    def __init__(self, data: Any, rng: dict[str, Any]) -> None:
        self.data = data
        self.rng = rng

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerBatch, (self.data, self.rng))

    def pin_memory(self, device: Any = None) -> WorkerBatch:
        """The same wrapper around the pinned batch (PyTorch's pin-memory thread calls it)."""
        from torch.utils.data._utils.pin_memory import pin_memory
        return WorkerBatch(pin_memory(self.data, device), self.rng)


_orig_map_fetch = _fetch._MapDatasetFetcher.fetch


def _fetch_with_rng(self: Any, possibly_batched_index: Any) -> Any:
    return WorkerBatch(_orig_map_fetch(self, possibly_batched_index), worker_rng_state())


class WorkerInit:
    """``worker_init_fn`` wrapper, run in each DataLoader worker: the user's fn first, then the
    worker's RNG states of a resumed epoch (:attr:`states`, by worker id as a string; a worker
    without an entry keeps PyTorch's own seeding), then batches are returned as
    :class:`WorkerBatch`. Picklable (spawn/forkserver workers) as long as the user's fn is.
    """

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn
        self.states: dict[str, Any] | None = None
        """Set by the main process around the ``iter()`` that starts a resumed epoch."""

    def __call__(self, worker_id: int) -> None:
        if self.user_fn is not None:
            self.user_fn(worker_id)
        if self.states and str(worker_id) in self.states:
            set_worker_rng_state(self.states[str(worker_id)])
        _fetch._MapDatasetFetcher.fetch = _fetch_with_rng  # type: ignore[method-assign]


def worker_rng_of(it: Any) -> dict[str, Any] | None:
    """The per-worker RNG states after each worker's last consumed batch of iterator ``it``
    (checkpoint form, by worker id as a string), or None without workers. Main process."""
    states = it.__dict__.get("_cfrun_worker_rng")
    if states is None:
        return None
    return {k: v if isinstance(v["torch"], torch.Tensor) else rng_state_for_checkpoint(v)
            for k, v in states.items()}


def seed_workers(loader: DataLoader, state: dict[str, Any], init: Any,
                 worker_rng: dict[str, Any] | None, base_seed: int | None, *,
                 offset: int | None) -> None:
    """Make the workers that ``iter(loader)`` is about to start load as in the original run:
    the resumed epoch's, whose round-robin starts at worker ``offset``, or (``offset`` None)
    those of a loader's first ``iter()`` since its carried state was put back
    (:func:`cfrun.rank.loader_carry.set_carried_state`). Called by
    :func:`cfrun.rank.data._start_epoch` just before that ``iter()``. Flags on the loader, read
    by the worker hooks (:func:`worker_hooks`) during that ``iter()`` and removed after it:
    the worker offset and, where the original run reused persistent workers and so drew no
    base seed now, the epoch's RNG ``state`` to put back after this run's draw and the
    workers' ``base_seed``. Each worker gets its states from ``worker_rng`` through ``init``
    (:class:`WorkerInit`)."""
    again = True  # the original run reused its persistent workers: it drew no base seed now
    if offset is not None:
        loader.__dict__["_cfrun_worker_offset"] = offset
        again = loader.persistent_workers and loader._iterator is None \
            and loader.__dict__.get("_cfrun_iter_calls", 0) > 1
    if again:
        loader.__dict__["_cfrun_rng_again"] = state
        if base_seed is not None:  # the workers' seed, as the original run drew it
            loader.__dict__["_cfrun_base_seed"] = base_seed
    if isinstance(init, WorkerInit):
        init.states = worker_rng


def worker_hooks(guard: Any) -> tuple[Callable[..., Any], Callable[..., Any],
                                      Callable[..., Any]]:
    """The iterators' methods that seed the workers and keep their RNG states, as
    :func:`cfrun.rank.data.install` patches them: ``_BaseDataLoaderIter.__init__`` (the base
    seed :func:`seed_workers` set, before the workers start), and
    ``_MultiProcessingDataLoaderIter._try_put_index`` (the first index of an iteration) and
    ``_process_data`` (per batch: its worker's states after it, the batch unwrapped)."""
    orig_base_init = _dl._BaseDataLoaderIter.__init__

    @functools.wraps(orig_base_init)
    def _base_init(self: Any, loader: DataLoader, *args: Any, **kwargs: Any) -> None:
        orig_base_init(self, loader, *args, **kwargs)
        seed = getattr(loader, "__dict__", {}).get("_cfrun_base_seed")
        if seed is not None:  # before the workers start: they are seeded from it
            self._base_seed = seed

    orig_put = _dl._MultiProcessingDataLoaderIter._try_put_index
    orig_process = _dl._MultiProcessingDataLoaderIter._process_data
    guarded_first_index = guard.wrap("the DataLoader's first index", _first_index)

    def _try_put_index(self: Any) -> None:
        if self._send_idx == 0 and self.__dict__.get("_cfrun_cycle") is not \
                self._worker_queue_idx_cycle:  # the first index of an iteration
            guarded_first_index(self)
        orig_put(self)

    def _process_data(self: Any, data: Any, worker_idx: int) -> Any:
        if type(data) is WorkerBatch:  # a batch being consumed: its worker's RNG after it
            states = self.__dict__.get("_cfrun_worker_rng")
            if states is not None:
                states[str(worker_idx)] = data.rng
            data = data.data
        return orig_process(self, data, worker_idx)

    return _base_init, _try_put_index, _process_data


def _first_index(it: Any) -> None:
    """Before the first index of an iteration: a resumed epoch's round-robin starts at the
    worker that loaded its next batch in the original run; with persistent workers the
    original run drew no base seed this epoch, so the epoch's RNG is put back after this
    run's draw, before the permutation's."""
    it._cfrun_cycle = it._worker_queue_idx_cycle
    loader = getattr(it._index_sampler, "loader", None)
    if loader is not None:
        again = loader.__dict__.get("_cfrun_rng_again")
        if again is not None:
            set_epoch_rng(loader, again)
        for _ in range(loader.__dict__.get("_cfrun_worker_offset", 0)):
            next(it._worker_queue_idx_cycle)
