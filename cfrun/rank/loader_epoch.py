"""A DataLoader epoch as a checkpoint records it and a resume starts it again: which loader it
is (:func:`loader_fingerprint`), the RNG states its order and worker seeds are drawn from
(:func:`epoch_rng`), its samplers' scalar attributes (:func:`sampler_state`: a
``DistributedSampler``'s ``epoch``), and the index sampler that starts an iteration ``skip``
batches in without loading them (:class:`ResumableIndexSampler`). Main process; the hooks that
use them are in :mod:`cfrun.rank.data`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader


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
