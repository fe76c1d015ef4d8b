"""DataLoader hooks: epoch counting, epoch-start RNG, sampler-level skip, worker RNG streams.

This module installs the hooks and starts each epoch (:func:`install`); what they record and
restore lives beside it: the epoch's identity, RNG, sampler attributes and skip in
:mod:`cfrun.rank.loader_epoch`, the workers' random streams in :mod:`cfrun.rank.loader_workers`,
what the other loaders carry across a checkpoint in :mod:`cfrun.rank.loader_carry`.

Installed by patching ``torch.utils.data.DataLoader`` at class level (``__init__``, ``__iter__``,
the ``_index_sampler`` property), ``_BaseDataLoaderIter.__next__`` and two methods of
``_MultiProcessingDataLoaderIter`` (``_try_put_index``, ``_process_data``). The user's loader
objects are not replaced, so ``isinstance``, ``len(loader)`` and subclasses keep working, and an
uninterrupted run draws every random number in the order the plain script does.

* Every loader gets a creation ordinal; the training loader is the one whose ``__next__`` ran
  between optimizer steps, recorded by ordinal and a fingerprint (dataset length, batch size).
* At each ``iter(loader)`` the global torch/python/numpy RNG states and the loader's and sampler's
  generators are recorded: the epoch's permutation and worker base seed are drawn from them
  (``_BaseDataLoaderIter.__init__`` draws the base seed, then ``RandomSampler`` its seed and
  permutation at the first index), so restoring them recreates the same epoch (CheckFreq §4.2,
  "resumable data iterator").
* The index sampler is wrapped so an iteration can start ``skip`` batches in without loading them.
  Its iterator stays lazy, as PyTorch's is: the permutation is drawn at the first index, after
  the base seed. Only a resumed epoch draws it at once, right after ``iter()`` returns (its RNG
  is restored for that moment; the checkpoint's RNG is put back afterwards).
* With workers, PyTorch seeds each worker as without cfrun (``base_seed + worker_id``, numpy from
  ``_generate_state``); each worker returns with every batch its torch/python/numpy RNG states
  taken right after the fetch (:class:`~cfrun.rank.loader_workers.WorkerBatch`), and the main
  process keeps, per iterator, each worker's states after its last *consumed* batch (workers
  run ``prefetch_factor * num_workers`` batches ahead; those do not count). The checkpoint
  stores them with the loader position. A resume at batch ``n`` starts PyTorch's round-robin at
  worker ``n % num_workers`` (the worker that loaded batch ``n`` in the original run) and gives
  each worker the states it had after its last consumed batch
  (:class:`~cfrun.rank.loader_workers.WorkerInit`), so per-sample random augmentation comes out
  as in the uninterrupted run and as without cfrun. The idea of snapshotting worker RNG state
  with the batches follows torchdata's ``StatefulDataLoader``.
* ``persistent_workers=True``: PyTorch starts the workers and draws their base seed at the
  loader's first ``iter()`` only; later epochs reuse them (``_reset`` does not reseed them), so
  each worker's random stream runs on across epochs. A resume into epoch E > 0 starts them anew:
  the training loader's base-seed draw is given back to its RNG before the permutation is drawn,
  the workers get the original run's base seed (``get_worker_info().seed``, which timm's
  ``worker_init_fn`` seeds from) and then their saved states. The other loaders (an eval loader)
  carry the same into their next epoch: each checkpoint stores their generators, their
  persistent workers' base seed and per-worker states
  (:func:`~cfrun.rank.loader_carry.carried_state`), and a resume gives them back
  (:func:`~cfrun.rank.loader_carry.set_carried_state`), their workers restarted the same way at
  their next ``iter()``. Restoring the states, rather than replaying the seeds, costs a few KiB per
  worker and no data loading; replaying would mean fetching every earlier epoch's samples again.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dl

from cfrun.rank.loader_epoch import IndexIter, ResumableIndexSampler, epoch_rng
from cfrun.rank.loader_workers import WorkerInit, seed_workers, worker_hooks


def install(guard: Any, *, register_loader: Callable[[DataLoader], int],
            on_loader_iter: Callable[[DataLoader, int, Callable[[], Any]], Any],
            on_loader_next: Callable[[Any, Any], None]) -> None:
    """Patch DataLoader so the rank's phases see loaders, epochs and batches.

    ``register_loader(loader)`` runs once per new loader and returns its creation ordinal
    (:meth:`cfrun.rank.discovery.Discovery.register_loader`); ``on_loader_iter(loader, n, start)``
    answers ``iter(loader)``, the ``n``-th call on it, where ``start()`` starts the epoch as
    without cfrun (:meth:`cfrun.rank.resume.Resume.on_loader_iter`); ``on_loader_next(iterator,
    caller_frame)`` runs before every ``next()``
    (:meth:`cfrun.rank.boundary.Boundary.on_loader_next`).
    Every patched method runs cfrun's part through ``guard`` (:class:`cfrun.rank.install.Guard`):
    after an internal error, and once ``guard.disabled``, the loaders behave as without cfrun.
    The hooks are built first and set all together, so a torch that lacks one of the patched
    methods leaves DataLoader as it was.
    """
    init, iter_ = _loader_hooks(guard, register_loader, on_loader_iter)
    index_sampler = _index_sampler_hook(guard)
    next_ = _position_hook(guard, on_loader_next)
    base_init, try_put_index, process_data = worker_hooks(guard)
    DataLoader.__init__ = init  # type: ignore[method-assign]
    DataLoader.__iter__ = iter_  # type: ignore[method-assign]
    DataLoader._index_sampler = index_sampler  # type: ignore[method-assign,assignment]
    _dl._BaseDataLoaderIter.__next__ = next_  # type: ignore[method-assign]
    _dl._BaseDataLoaderIter.__init__ = base_init  # type: ignore[method-assign]
    _dl._MultiProcessingDataLoaderIter._try_put_index = try_put_index  # type: ignore[method-assign]
    _dl._MultiProcessingDataLoaderIter._process_data = process_data  # type: ignore[method-assign]


def _loader_hooks(guard: Any, register_loader: Callable[[DataLoader], int],
                  on_loader_iter: Callable[[DataLoader, int, Callable[[], Any]], Any],
                  ) -> tuple[Callable[..., None], Callable[..., Any]]:
    """``DataLoader.__init__`` and ``__iter__`` as :func:`install` patches them: a new loader
    gets its creation ordinal, an ``iter()`` counter and, with workers, a
    :class:`~cfrun.rank.loader_workers.WorkerInit`; each ``iter(loader)`` is counted and handed
    to ``on_loader_iter`` with the start of the epoch (:func:`_start_epoch`). A loader made
    before :func:`install` (no ordinal) is left alone."""
    orig_init = DataLoader.__init__
    orig_iter = DataLoader.__iter__

    def register(self: DataLoader) -> None:
        object.__setattr__(self, "_cfrun_ordinal", register_loader(self))
        object.__setattr__(self, "_cfrun_iter_calls", 0)
        if self.num_workers > 0:
            self.worker_init_fn = WorkerInit(self.worker_init_fn)

    guarded_register = guard.wrap("DataLoader.__init__", register)

    @functools.wraps(orig_init)  # its signature: Lightning rebuilds loaders from it
    def __init__(self: DataLoader, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        if "_cfrun_ordinal" not in self.__dict__:
            guarded_register(self)

    def on_iter(self: DataLoader) -> Any:
        n = self.__dict__["_cfrun_iter_calls"]
        object.__setattr__(self, "_cfrun_iter_calls", n + 1)
        return on_loader_iter(self, n, lambda: _start_epoch(self, orig_iter))

    guarded_iter = guard.wrap("iter(DataLoader)", on_iter, fallback=orig_iter)

    def __iter__(self: DataLoader) -> Any:
        if "_cfrun_ordinal" not in self.__dict__ or guard.disabled:
            return orig_iter(self)
        return guarded_iter(self)

    return __init__, __iter__


def _start_epoch(loader: DataLoader, it_fn: Any, state: dict[str, Any] | None = None) -> Any:
    """Start an epoch of ``loader``: ``it_fn(loader)``, PyTorch's ``iter()``, with the RNG
    states it draws from recorded first (:func:`~cfrun.rank.loader_epoch.epoch_rng`, or
    ``state``). For the epoch a resume starts (``_cfrun_skip_done`` set by
    :class:`~cfrun.rank.resume.Resume`) or a loader whose carried state was put back
    (:func:`~cfrun.rank.loader_carry.set_carried_state`), its workers are seeded as in the
    original run (:func:`~cfrun.rank.loader_workers.seed_workers`) and, single-process, the
    permutation drawn at once from the epoch's RNG. Returns the iterator, which counts its
    consumed batches from the batches skipped and keeps its workers' RNG states."""
    state = state if state is not None else epoch_rng(loader)
    object.__setattr__(loader, "_cfrun_epoch_rng", state)
    resumed = "_cfrun_skip_done" in loader.__dict__  # set by Resume for the resumed epoch
    skip_done = loader.__dict__.pop("_cfrun_skip_done", 0)
    worker_rng = loader.__dict__.pop("_cfrun_worker_rng", None)
    base_seed = loader.__dict__.pop("_cfrun_saved_base_seed", None)
    carried = loader.__dict__.pop("_cfrun_carried", None)  # not the training loader
    workers = loader.num_workers > 0
    carried = carried if workers and loader._iterator is None else None
    init = loader.worker_init_fn
    if resumed and workers:
        seed_workers(loader, state, init, worker_rng, base_seed,
                     offset=skip_done % loader.num_workers)
    elif carried is not None:  # its first iter() since the resume (set_carried_state)
        worker_rng = carried["worker_rng"]
        seed_workers(loader, state, init, worker_rng, carried["base_seed"], offset=None)
    try:  # the multiprocessing iterator calls iter() on the sampler twice: both skip
        it = it_fn(loader)
    finally:
        for key in ("_cfrun_skip", "_cfrun_worker_offset", "_cfrun_rng_again",
                    "_cfrun_base_seed"):
            loader.__dict__.pop(key, None)
        if isinstance(init, WorkerInit):
            init.states = None
    if resumed and isinstance(getattr(it, "_sampler_iter", None), IndexIter):
        it._sampler_iter.prime()  # the permutation, from the epoch's RNG (single-process)
    it._cfrun_loader = loader
    it._cfrun_consumed = skip_done
    if workers and (resumed or carried is not None or "_cfrun_worker_rng" not in it.__dict__):
        it._cfrun_worker_rng = dict(worker_rng or {})  # persistent workers: kept
    return it


def _index_sampler_hook(guard: Any) -> property:
    """``DataLoader._index_sampler`` as :func:`install` patches it: a registered map-style
    loader's index sampler wrapped in :class:`~cfrun.rank.loader_epoch.ResumableIndexSampler`,
    so an iteration can start batches in."""
    orig_index_sampler = DataLoader._index_sampler

    def _index_sampler(self: DataLoader) -> Any:
        inner = orig_index_sampler.fget(self)  # type: ignore[attr-defined]
        if "_cfrun_ordinal" not in self.__dict__ or self._dataset_kind != _dl._DatasetKind.Map \
                or guard.disabled:
            return inner
        return ResumableIndexSampler(self, inner)

    return property(_index_sampler)


def _position_hook(guard: Any, on_loader_next: Callable[[Any, Any], None]) -> Callable[..., Any]:
    """``_BaseDataLoaderIter.__next__`` as :func:`install` patches it, the per-batch path: for
    an iterator cfrun started (:func:`_start_epoch`), ``on_loader_next`` with the caller's
    frame first, then the batch, counted in ``_cfrun_consumed``."""
    orig_next = _dl._BaseDataLoaderIter.__next__
    guarded_next = guard.wrap("next(DataLoader iterator)", on_loader_next)

    def __next__(self: Any) -> Any:
        if "_cfrun_loader" in self.__dict__ and not guard.disabled:
            guarded_next(self, sys._getframe(1))
            out = orig_next(self)
            self._cfrun_consumed += 1
            return out
        return orig_next(self)

    return __next__
