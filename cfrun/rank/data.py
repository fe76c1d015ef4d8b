"""DataLoader hooks: epoch counting, epoch-start RNG, sampler-level skip, per-batch worker seeds.

Installed by patching ``torch.utils.data.DataLoader`` at class level (``__init__``, ``__iter__``,
the ``_index_sampler`` property) and ``_BaseDataLoaderIter.__next__``. The user's loader objects
are not replaced, so ``isinstance``, ``len(loader)`` and subclasses keep working.

* Every loader gets a creation ordinal; the training loader is the one whose ``__next__`` ran
  between optimizer steps, recorded by ordinal and a fingerprint (dataset length, batch size).
* At each ``iter(loader)`` the global torch/python/numpy RNG states and the loader's and sampler's
  generators are recorded: the epoch's permutation and worker base seed are drawn from them
  (``RandomSampler.__iter__``, ``_BaseDataLoaderIter.__init__``), so restoring them recreates the
  same epoch (CheckFreq §4.2, "resumable data iterator").
* The index sampler is wrapped so an iteration can start ``skip`` batches in without loading them,
  and so the first batch of indices is drawn at ``iter()`` time in every run (single-process
  loaders otherwise draw the permutation at the first ``next()``).
* With workers, each batch of indices carries a seed derived from the epoch's RNG state and the
  batch number; the worker reseeds torch/random/numpy from it before fetching. Random per-sample
  augmentation then depends only on (epoch, batch), not on which worker got which batch, so a
  resumed epoch produces the same samples. This changes the augmentation stream relative to a run
  without cfrun (README, "Resume semantics").
"""

from __future__ import annotations

import functools
import hashlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dl
from torch.utils.data._utils import fetch as _fetch


class TaggedBatch(list):
    """A batch of dataset indices that carries the seed its worker must use."""

    cfrun_seed: int

    def __reduce__(self) -> tuple[Any, ...]:
        return (_make_tagged, (list(self), self.cfrun_seed))


def _make_tagged(items: list[Any], seed: int) -> TaggedBatch:
    b = TaggedBatch(items)
    b.cfrun_seed = seed
    return b


def batch_seed(epoch_seed: int, batch_no: int) -> int:
    """A 63-bit seed for batch ``batch_no`` of an epoch whose RNG hashed to ``epoch_seed``."""
    h = hashlib.blake2b(f"{epoch_seed}:{batch_no}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def _reseed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (2**32))


_orig_map_fetch = _fetch._MapDatasetFetcher.fetch


def _seeded_fetch(self: Any, possibly_batched_index: Any) -> Any:
    if isinstance(possibly_batched_index, TaggedBatch):
        _reseed(possibly_batched_index.cfrun_seed)
    return _orig_map_fetch(self, possibly_batched_index)


class WorkerInit:
    """``worker_init_fn`` wrapper: enables per-batch seeding in the worker, then the user's fn.

    Picklable (spawn/forkserver workers) as long as the user's function is.
    """

    def __init__(self, user_fn: Any) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        _fetch._MapDatasetFetcher.fetch = _seeded_fetch  # type: ignore[method-assign]
        if self.user_fn is not None:
            self.user_fn(worker_id)


class ResumableIndexSampler:
    """Wraps a loader's index sampler: skip, eager first draw, batch tagging.

    ``loader._cfrun_skip`` is set around one ``iter(loader)`` call and read at ``iter()``.
    """

    def __init__(self, loader: DataLoader, inner: Any) -> None:
        self.loader = loader
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        skip = loader.__dict__.get("_cfrun_skip", 0)
        seed = loader.__dict__.get("_cfrun_epoch_seed")
        tag = seed is not None and loader.num_workers > 0 and loader.batch_sampler is not None
        it = iter(self.inner)
        for _ in range(skip):
            if next(it, _END) is _END:
                return iter(())
        first = next(it, _END)  # draw the permutation now, in every run
        if first is _END:
            return iter(())
        return self._generate(first, it, skip, seed if tag else None)

    @staticmethod
    def _generate(first: Any, it: Iterator[Any], batch_no: int, seed: int | None) -> Iterator[Any]:
        batch = first
        while True:
            if seed is not None and type(batch) is list:
                batch = _make_tagged(batch, batch_seed(seed, batch_no))
            yield batch
            batch_no += 1
            batch = next(it, _END)
            if batch is _END:
                return


_END = object()


def loader_fingerprint(loader: DataLoader) -> dict[str, Any]:
    """What must match for a loader of a resumed run to be the same training loader."""
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        n = None
    return {"dataset_len": n, "batch_size": loader.batch_size,
            "dataset_type": type(loader.dataset).__name__}


def epoch_rng(loader: DataLoader) -> dict[str, Any]:
    """RNG states an epoch of ``loader`` draws its order and worker seeds from."""
    from cfrun.rank.rng import get_global_rng

    state: dict[str, Any] = {"global": get_global_rng()}
    if loader.generator is not None:
        state["loader_generator"] = loader.generator.get_state()
    sampler_gen = getattr(loader.sampler, "generator", None)
    if isinstance(sampler_gen, torch.Generator):
        state["sampler_generator"] = sampler_gen.get_state()
    return state


def set_epoch_rng(loader: DataLoader, state: dict[str, Any]) -> None:
    """Inverse of :func:`epoch_rng`."""
    from cfrun.rank.rng import set_global_rng

    set_global_rng(state["global"])
    if "loader_generator" in state and loader.generator is not None:
        loader.generator.set_state(state["loader_generator"])
    sampler_gen = getattr(loader.sampler, "generator", None)
    if "sampler_generator" in state and isinstance(sampler_gen, torch.Generator):
        sampler_gen.set_state(state["sampler_generator"])


def epoch_seed_of(state: dict[str, Any]) -> int:
    """Hash of an epoch's RNG states (consumes no randomness)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(state["global"]["torch"].numpy().tobytes())
    for key in ("loader_generator", "sampler_generator"):
        if key in state:
            h.update(state[key].numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


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
    """
    orig_init = DataLoader.__init__
    orig_iter = DataLoader.__iter__
    orig_index_sampler = DataLoader._index_sampler
    orig_next = _dl._BaseDataLoaderIter.__next__

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

    def _start_epoch(loader: DataLoader, it_fn: Any, state: dict[str, Any] | None = None) -> Any:
        state = state if state is not None else epoch_rng(loader)
        object.__setattr__(loader, "_cfrun_epoch_rng", state)
        object.__setattr__(loader, "_cfrun_epoch_seed", epoch_seed_of(state))
        try:  # the multiprocessing iterator calls iter() on the sampler twice: both skip
            it = it_fn(loader)
        finally:
            loader.__dict__.pop("_cfrun_skip", None)
        it._cfrun_loader = loader
        it._cfrun_consumed = loader.__dict__.get("_cfrun_skip_done", 0)
        loader.__dict__.pop("_cfrun_skip_done", None)
        return it

    def _index_sampler(self: DataLoader) -> Any:
        inner = orig_index_sampler.fget(self)  # type: ignore[attr-defined]
        if "_cfrun_ordinal" not in self.__dict__ or self._dataset_kind != _dl._DatasetKind.Map \
                or guard.disabled:
            return inner
        return ResumableIndexSampler(self, inner)

    guarded_next = guard.wrap("next(DataLoader iterator)", on_loader_next)

    def __next__(self: Any) -> Any:
        if "_cfrun_loader" in self.__dict__ and not guard.disabled:
            guarded_next(self, sys._getframe(1))
            out = orig_next(self)
            self._cfrun_consumed += 1
            return out
        return orig_next(self)

    DataLoader.__init__ = __init__  # type: ignore[method-assign]
    DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    DataLoader._index_sampler = property(_index_sampler)  # type: ignore[method-assign,assignment]
    _dl._BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
