"""DataLoader hooks: epoch counting, epoch-start RNG, sampler-level skip, worker RNG streams.

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
  taken right after the fetch (:class:`WorkerBatch`), and the main process keeps, per iterator,
  each worker's states after its last *consumed* batch (workers run ``prefetch_factor *
  num_workers`` batches ahead; those do not count). The checkpoint stores them with the loader
  position. A resume at batch ``n`` starts PyTorch's round-robin at worker ``n % num_workers``
  (the worker that loaded batch ``n`` in the original run) and gives each worker the states it
  had after its last consumed batch (:class:`WorkerInit`), so per-sample random augmentation
  comes out as in the uninterrupted run and as without cfrun. The idea of snapshotting worker
  RNG state with the batches follows torchdata's ``StatefulDataLoader``.
* ``persistent_workers=True``: PyTorch starts the workers and draws their base seed at the
  loader's first ``iter()`` only; later epochs reuse them (``_reset`` does not reseed them), so
  each worker's random stream runs on across epochs. A resume into epoch E > 0 starts them anew:
  the training loader's base-seed draw is given back to its RNG before the permutation is drawn,
  the workers get the original run's base seed (``get_worker_info().seed``, which timm's
  ``worker_init_fn`` seeds from) and then their saved states. The other loaders (an eval loader)
  carry the same into their next epoch: each checkpoint stores their generators, their
  persistent workers' base seed and per-worker states (:func:`carried_state`), and a resume
  gives them back (:func:`set_carried_state`), their workers restarted the same way at their
  next ``iter()``. Restoring the states, rather than replaying the seeds, costs a few KiB per
  worker and no data loading; replaying would mean fetching every earlier epoch's samples again.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dl
from torch.utils.data._utils import fetch as _fetch


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


class ResumableIndexSampler:
    """Wraps a loader's index sampler so an iteration can start ``skip`` batches in.

    ``loader._cfrun_skip`` is set around one ``iter(loader)`` call and read at ``iter()``.
    """

    def __init__(self, loader: DataLoader, inner: Any) -> None:
        self.loader = loader
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> IndexIter:
        return IndexIter(iter(self.inner), self.loader.__dict__.get("_cfrun_skip", 0))


class IndexIter:
    """The index iterator of one iteration: as lazy as the wrapped sampler's own (nothing is
    drawn before the first index), ``skip`` batches dropped at the first draw."""

    def __init__(self, it: Iterator[Any], skip: int) -> None:
        self._it = it
        self._skip = skip
        self._first: Any = _NONE

    def prime(self) -> None:
        """Drop the skipped batches and draw the first index now (a resumed epoch, whose RNG is
        restored only until ``iter()`` returns)."""
        if self._skip < 0:
            return
        skip, self._skip = self._skip, -1
        for _ in range(skip):
            if next(self._it, _END) is _END:
                self._first = _END
                return
        self._first = next(self._it, _END)

    def __iter__(self) -> IndexIter:
        return self

    def __next__(self) -> Any:
        if self._skip >= 0:
            self.prime()
        first = self._first
        if first is _NONE:
            return next(self._it)
        if first is _END:
            raise StopIteration
        self._first = _NONE
        return first


_END = object()
_NONE = object()


def inexact_reasons(loader: DataLoader) -> list[str]:
    """Why a resume of ``loader``'s epoch cannot equal the plain script's run (main process)."""
    if loader.num_workers > 0 and not getattr(loader, "in_order", True):
        return ["the training DataLoader has in_order=False: the order batches arrive in "
                "depends on worker timing, with or without cfrun"]
    return []


def worker_rng_of(it: Any) -> dict[str, Any] | None:
    """The per-worker RNG states after each worker's last consumed batch of iterator ``it``
    (checkpoint form, by worker id as a string), or None without workers. Main process."""
    states = it.__dict__.get("_cfrun_worker_rng")
    if states is None:
        return None
    return {k: v if isinstance(v["torch"], torch.Tensor) else rng_state_for_checkpoint(v)
            for k, v in states.items()}


def carried_state(loader: DataLoader) -> dict[str, Any] | None:
    """What ``loader``, a loader *other than the training one* (an eval loader), carries from
    one of its epochs to the next, for the checkpoint (main process, at a loader boundary);
    None when nothing:

    * its ``generator=`` and its sampler's generator (each ``iter()`` draws from them);
    * with ``persistent_workers=True``, once its workers run: their base seed (PyTorch drew it
      at the loader's first ``iter()`` only, maybe epochs before the checkpoint) and each
      worker's RNG states after its last consumed batch (its random stream goes on from there
      in the next epoch: workers are not reseeded at ``_reset``).

    A resume puts them back (:func:`set_carried_state`). Without it, the resumed run's first
    ``iter()`` of such a loader (an eval loader, after the resumed epoch) started workers anew
    and drew a base seed from the global torch RNG that the uninterrupted run had drawn only in
    its first epoch: one draw more, so the next epoch's shuffle (``RandomSampler`` seeds itself
    from the global RNG) and everything after it differed (issue 34).
    """
    state: dict[str, Any] = {}
    if loader.generator is not None:
        state["generator"] = loader.generator.get_state()
    sampler_gen = getattr(loader.sampler, "generator", None)
    if isinstance(sampler_gen, torch.Generator) and sampler_gen is not loader.generator:
        state["sampler_generator"] = sampler_gen.get_state()
    it = loader.__dict__.get("_iterator")
    if loader.num_workers > 0 and loader.persistent_workers and it is not None \
            and hasattr(it, "_base_seed"):
        state["base_seed"] = int(it._base_seed)
        state["worker_rng"] = worker_rng_of(it) or {}
    if not state:
        return None
    state["fingerprint"] = loader_fingerprint(loader)
    return state


def set_carried_state(loader: DataLoader, state: dict[str, Any]) -> str | None:
    """Inverse of :func:`carried_state`, at the resume (after the training loader's epoch
    started, so a generator shared with it ends as at the checkpoint). The generators are set
    at once. Persistent workers are (re)started at the loader's next ``iter()`` with the
    checkpoint's base seed and each worker's states (:class:`WorkerInit`), and the base seed
    this run draws there is given back to the RNG it came from (the original run drew none):
    workers the script already started before the resume point (a validation before the epoch
    loop) are shut down first. Returns why the loader could not be restored, or None."""
    if state.get("fingerprint") != loader_fingerprint(loader):
        return "a DataLoader other than the training one changed since the checkpoint; its " \
            "generator and persistent workers restart from their seeds"
    if "generator" in state and loader.generator is not None:
        loader.generator.set_state(state["generator"])
    sampler_gen = getattr(loader.sampler, "generator", None)
    if "sampler_generator" in state and isinstance(sampler_gen, torch.Generator):
        sampler_gen.set_state(state["sampler_generator"])
    if "base_seed" in state and loader.num_workers > 0 and loader.persistent_workers:
        it = loader.__dict__.get("_iterator")
        if it is not None:
            it._shutdown_workers()
            loader._iterator = None
        loader.__dict__["_cfrun_carried"] = {"base_seed": state["base_seed"],
                                             "worker_rng": state.get("worker_rng") or {}}
    return None


def loader_fingerprint(loader: DataLoader) -> dict[str, Any]:
    """What must match for a loader of a resumed run to be the same training loader."""
    try:
        n = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        n = None
    return {"dataset_len": n, "batch_size": loader.batch_size,
            "dataset_type": type(loader.dataset).__name__}


def _samplers(loader: DataLoader) -> list[Any]:
    out: list[Any] = []
    for obj in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if obj is not None and isinstance(getattr(obj, "__dict__", None), dict) \
                and all(obj is not o for o in out):
            out.append(obj)
    return out


def sampler_state(loader: DataLoader) -> list[dict[str, Any]]:
    """The scalar attributes (int, float, bool, str) of ``loader``'s sampler and of its batch
    sampler's sampler: a ``DistributedSampler``'s ``epoch``, which ``set_epoch()`` sets
    before each epoch (the script's call, or a wrapper's: Lightning Fabric's counts its
    ``iter()`` calls). Main process, at a loader checkpoint boundary."""
    return [{k: v for k, v in vars(obj).items()
             if type(v) in (bool, int, float, str) and not k.startswith("_cfrun")}
            for obj in _samplers(loader)]


def set_sampler_state(loader: DataLoader, state: list[dict[str, Any]]) -> None:
    """Inverse of :func:`sampler_state`, before the resumed epoch's ``iter()`` draws its
    order: attributes the live samplers have, with values of the same type, are set."""
    for obj, saved in zip(_samplers(loader), state):
        current = vars(obj)
        for k, v in saved.items():
            if k in current and type(current[k]) is type(v):
                current[k] = v


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
    base_init, try_put_index, process_data = _worker_hooks(guard)
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
    gets its creation ordinal, an ``iter()`` counter and, with workers, a :class:`WorkerInit`;
    each ``iter(loader)`` is counted and handed to ``on_loader_iter`` with the start of the
    epoch (:func:`_start_epoch`). A loader made before :func:`install` (no ordinal) is left
    alone."""
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
    states it draws from recorded first (:func:`epoch_rng`, or ``state``). For the epoch a
    resume starts (``_cfrun_skip_done`` set by :class:`~cfrun.rank.resume.Resume`) or a loader
    whose carried state was put back (:func:`set_carried_state`), its workers are seeded as in
    the original run (:func:`_seed_workers`) and, single-process, the permutation drawn at once
    from the epoch's RNG. Returns the iterator, which counts its consumed batches from the
    batches skipped and keeps its workers' RNG states."""
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
        _seed_workers(loader, state, init, worker_rng, base_seed,
                      offset=skip_done % loader.num_workers)
    elif carried is not None:  # its first iter() since the resume (set_carried_state)
        worker_rng = carried["worker_rng"]
        _seed_workers(loader, state, init, worker_rng, carried["base_seed"], offset=None)
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


def _seed_workers(loader: DataLoader, state: dict[str, Any], init: Any,
                  worker_rng: dict[str, Any] | None, base_seed: int | None, *,
                  offset: int | None) -> None:
    """Make the workers that ``iter(loader)`` is about to start load as in the original run:
    the resumed epoch's, whose round-robin starts at worker ``offset``, or (``offset`` None)
    those of a loader's first ``iter()`` since its carried state was put back. Flags on the
    loader, read by the worker hooks (:func:`_worker_hooks`) during that ``iter()`` and
    removed after it: the worker offset and, where the original run reused persistent workers
    and so drew no base seed now, the epoch's RNG ``state`` to put back after this run's draw
    and the workers' ``base_seed``. Each worker gets its states from ``worker_rng`` through
    ``init`` (:class:`WorkerInit`)."""
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


def _index_sampler_hook(guard: Any) -> property:
    """``DataLoader._index_sampler`` as :func:`install` patches it: a registered map-style
    loader's index sampler wrapped in :class:`ResumableIndexSampler`, so an iteration can
    start batches in."""
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


def _worker_hooks(guard: Any) -> tuple[Callable[..., Any], Callable[..., Any],
                                       Callable[..., Any]]:
    """The iterators' methods that seed the workers and keep their RNG states, as
    :func:`install` patches them: ``_BaseDataLoaderIter.__init__`` (the base seed
    :func:`_seed_workers` set, before the workers start), and
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
