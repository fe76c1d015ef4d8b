"""The loader boundary: which DataLoader iterator is the training one, and its position at the
next ``next()`` after a trigger (:mod:`cfrun.rank.boundary`, loader loops).

The training loader is the one whose iteration interleaves with ``optimizer.step()``: the
iterator a ``next()`` was last called on before a step. At the boundary its position is read
whole: the loader, its epoch and the batches the script consumed, the epoch's RNG, the
workers', the epoch loop around it and its variable, the ``enumerate()`` count around it, the
state of library wrappers and the sampler, and what the other loaders carry into their next
epoch. A step loop that draws batches with ``next()`` from an iterator a script variable holds
(:mod:`cfrun.rank.frameworks`) is found here too, and its position read at the loop boundary
(:meth:`LoaderBoundary.held_position`).
"""

from __future__ import annotations

import os
import types
import weakref
from collections.abc import Callable
from typing import Any

from cfrun.rank import frames as F
from cfrun.rank import frameworks as FW
from cfrun.rank.adapters import accelerate as ACC
from cfrun.rank.adapters import hf as HF
from cfrun.rank.adapters import lightning as PL
from cfrun.rank.discovery import Discovery
from cfrun.rank.loader_carry import carried_state
from cfrun.rank.loader_epoch import inexact_reasons, loader_fingerprint, sampler_state
from cfrun.rank.loader_workers import worker_rng_of


class LoaderBoundary:
    """Which loader iterator trains, and its position at the boundary. Training thread.

    Args:
        script: the user's script (its frames are told from library frames by it).
        found: the live loaders (the others' carried state goes with the checkpoint).
        flag: says a reason the resume will not be exact.
    """

    def __init__(self, script: str, found: Discovery, flag: Callable[[str], None]) -> None:
        self.script = script
        self._found = found
        self._flag = flag
        self._last_next_iter: weakref.ref[Any] | None = None
        self._next_since_step = False
        self._step_open = False
        """A counted step came and the training loader's ``next()`` has not run since."""
        self.first_after_step = False
        """The ``next()`` under way is the training loader's first since a counted step: the
        loader boundary. A later one of the same step may follow a backward whose gradients
        no checkpoint holds (gradient accumulation: a checkpoint deferred there resumed the
        step without them, issue 36)."""
        self.train_iter: Callable[[], Any] | None = None
        """The training loader's iterator (a weakref.ref), once a step decided it."""
        self._next_outside_for = False
        self._held = False
        self._held_decided = False
        """A step loop that draws batches with next() from an iterator a script variable holds
        (:mod:`cfrun.rank.frameworks`): mode ``loop``, with the iterator's position."""
        self.progress: dict[str, int] | None = None
        """The last loader boundary's estimate of the batches done (:func:`_progress`)."""
        self._epoch_frame: types.FrameType | None = None
        self._enum_cache: tuple[weakref.ref[Any], Any, weakref.ref[Any], Any] | None = None
        """(training loader iterator, the enumerate around it or its wrapper or None, the
        loader), dropped at the loader's next epoch."""

    def on_next(self, it: Any, caller: types.FrameType) -> None:
        """Before every ``next()`` on a tracked loader iterator ``it`` (``caller``: the frame
        that called it): remember it as the one a step may train on."""
        cached = self._enum_cache
        if cached is not None and cached[2]() is it._cfrun_loader and (
                cached[0]() is not it or cached[3] != getattr(it, "_cfrun_iter_index", None)):
            self._enum_cache = None  # a new epoch: let the last one's wrappers go
        self._last_next_iter = weakref.ref(it)
        self._next_since_step = True
        self.first_after_step = self._step_open and self.is_training(it)
        if self.first_after_step:
            self._step_open = False
        if not self._held_decided:
            self._next_outside_for = FW.is_script_frame(caller, self.script) \
                and not is_for_header(caller)

    def is_training(self, it: Any) -> bool:
        """Whether ``it`` is the training loader's iterator."""
        return self.train_iter is not None and self.train_iter() is it

    def after_step(self, mode: str | None, frame: types.FrameType) -> str | None:
        """After a counted optimizer step (``frame``: the step's caller): the loader a
        ``next()`` was called on since the last step trains; the first such step decides
        whether a script variable holds its iterator. Returns the boundary's mode:
        ``loader`` (its ``next()``), ``loop`` (the head of the loop around the step), or
        ``mode`` unchanged."""
        if self._next_since_step and self._last_next_iter is not None:
            self.train_iter = self._last_next_iter
            if not self._held_decided:  # the first step decides (cfrun.rank.frameworks)
                self._held_decided = True
                self._held = self._next_outside_for and FW.held_by_script(
                    self.train_iter(), frame, self.script)
            mode = "loop" if self._held else "loader"
        elif mode is None:
            mode = "loop"
        self._next_since_step = False
        self._step_open = True
        return mode

    def position(self, it: Any, caller: types.FrameType) -> dict[str, Any]:
        """The training loader's position at its ``next()`` from ``caller``, the boundary of a
        loader loop: what a resume needs to put the loader, the epoch loop, the enumerate
        around it and the wrappers' state back. Flags what will not resume exactly."""
        loader = it._cfrun_loader
        framework = FW.framework_loop(caller, self.script)
        ahead, untested = ACC.read_ahead(caller)  # accelerate's DataLoaderShard
        if untested is not None:
            self._flag(untested)
        hf_loop = HF.capture(caller) if framework is FW.HF_TRAINER else None
        pl_loop = PL.capture(caller) if framework is FW.LIGHTNING_TRAINER else None
        if framework is not None and hf_loop is None and pl_loop is None:  # not the script's
            untested = HF.untested_reason() if framework is FW.HF_TRAINER else \
                PL.untested_reason() if framework is FW.LIGHTNING_TRAINER else None
            self._flag(framework.reason if untested is None  # (cfrun.rank.frameworks)
                       else f"{untested}: {framework.reason}")
        elif pl_loop is None and not (is_for_header(caller) or ACC.is_shard_iter(caller)):
            self._flag("the training DataLoader is advanced with next() outside a for "
                       "statement; its position resumes, the loop around it may not")
        consumer = F.consumer_frame(caller)
        epoch_loop, epoch_value = self._epoch_loop(consumer)
        data = {
            "loader": loader._cfrun_ordinal,
            "fingerprint": loader_fingerprint(loader),
            "iter_index": it._cfrun_iter_index,
            "batches": it._cfrun_consumed - ahead,  # the script's position
            "epoch_rng": loader._cfrun_epoch_rng,
            "worker_rng": worker_rng_of(it),
            # persistent workers were seeded from it at the loader's first iter()
            "base_seed": int(it._base_seed) if loader.num_workers > 0 else None,
            "epoch_loop": epoch_loop.to_json() if epoch_loop else None,
            "epoch_value": epoch_value,
            "enumerate": self._enumerate_index(it, caller, consumer),
            "wrapped": consumer is not caller,
            # a library wrapper's state (Fabric's iter() count, timm's prefetched batch)
            # and the sampler's epoch: a resume jumps the epoch loop and puts them back
            "wrappers": F.wrapper_state(caller, self.script),
            "sampler": sampler_state(loader),
            # what the other loaders (an eval loader) carry into their next epoch
            "loaders": self._carried(loader),
        }
        if hf_loop is not None:  # transformers.Trainer's loop (cfrun.rank.adapters.hf)
            data["hf"] = hf_loop  # its position: a resumed epoch iterates another loader
            data["iter_index"], data["batches"] = hf_loop["epoch"], hf_loop["batches"]
        if pl_loop is not None:  # Lightning's fit loop (cfrun.rank.adapters.lightning)
            data["lightning"] = pl_loop
        self.progress = _progress(loader, it._cfrun_consumed, epoch_loop, epoch_value,
                                  self._epoch_frame)
        self._flag_inexact(loader)
        return data

    def _flag_inexact(self, loader: Any) -> None:
        """Flag what keeps ``loader``'s position from resuming exactly."""
        for reason in inexact_reasons(loader):
            self._flag(reason)
        if loader._dataset_kind != 0:  # _DatasetKind.Iterable
            self._flag("the training DataLoader reads an IterableDataset; cfrun cannot skip "
                       "to the batch position inside an epoch")

    def held_position(self) -> dict[str, Any] | None:
        """The held iterator's position at the loop boundary (None when not such a loop)."""
        if not self._held:
            return None
        it = self.train_iter() if self.train_iter is not None else None
        data = FW.held_position(it) if it is not None else None
        if data is None:
            self._flag("the step loop draws batches with next() from a DataLoader iterator that "
                       "is not its loader's newest; the data position restarts")
        return data

    def _carried(self, train: Any) -> dict[str, Any]:
        """:func:`cfrun.rank.loader_carry.carried_state` of every live loader but ``train``, by
        creation ordinal (as a string)."""
        out: dict[str, Any] = {}
        for loader in self._found.loaders():
            if loader is not train and "_cfrun_ordinal" in loader.__dict__:
                state = carried_state(loader)
                if state is not None:
                    out[str(loader._cfrun_ordinal)] = state
        return out

    def _enumerate_index(self, it: Any, caller: types.FrameType,
                         consumer: types.FrameType) -> int | None:
        """The count of the ``enumerate()`` around the training loader or its wrapper, as it
        stands in the middle of that enumerate's ``next()`` (None without one). The enumerate
        is looked up once per epoch of a loader iterator (``persistent_workers=True`` reuses one
        iterator for every epoch, each in a new ``enumerate()``)."""
        cached = self._enum_cache
        epoch = getattr(it, "_cfrun_iter_index", None)
        if cached is None or cached[0]() is not it or cached[3] != epoch:
            cached = (weakref.ref(it), F.find_enumerate(it, caller, consumer),
                      weakref.ref(it._cfrun_loader), epoch)
            self._enum_cache = cached
        return F.enumerate_index(cached[1]) if cached[1] is not None else None

    def _epoch_loop(self, consumer: types.FrameType) -> tuple[F.LoopInfo | None, int | None]:
        """The loop around the training loader's ``for`` (the epoch loop) and its variable.

        ``consumer`` is the frame whose loop receives the batches (:func:`F.consumer_frame`:
        past the loader wrappers); the epoch loop encloses that loop in the same function, or
        the call of that function in one of its callers (a per-epoch ``train_one_epoch()``).
        """
        frames = F.script_frames(consumer, self.script)
        loop, frame = None, None
        if frames and frames[0] is consumer:
            loop, frame = F.find_loop(consumer, outside=True), consumer
        if loop is None:
            for f in frames[1:] if frames and frames[0] is consumer else frames:
                loop, frame = F.find_loop(f), f
                if loop is not None:
                    break
        self._epoch_frame = frame
        if loop is None or frame is None:
            return None, None
        value = frame.f_locals.get(loop.target) if loop.target else None
        if loop.kind == "for_range" and type(value) is not int:
            return F.LoopInfo(loop.code, loop.header_line, loop.body_line, "for_other",
                              loop.target), None
        return loop, value


def _progress(loader: Any, batches: int, loop: F.LoopInfo | None, value: Any,
              frame: types.FrameType | None) -> dict[str, int] | None:
    """``{"done_batches", "total_batches"}`` of the training loader over the whole epoch loop,
    for ``cfrun status``'s ETA, when the loader has a length and the epoch loop is a
    ``for ... in range(...)`` cfrun can read (:func:`cfrun.rank.frames.range_of`); else None."""
    try:
        per_epoch = len(loader)
    except TypeError:
        return None
    if loop is None or frame is None or type(value) is not int or per_epoch <= 0:
        return None
    epochs = F.range_of(frame, loop)
    if epochs is None or value not in epochs:
        return None
    index = epochs.index(value)
    return {"done_batches": index * per_epoch + batches,
            "total_batches": len(epochs) * per_epoch}


def is_for_header(frame: types.FrameType) -> bool:
    """Whether ``frame`` stands at a ``for`` statement's header line (its ``next()``)."""
    import ast

    tree = F._parse(os.path.realpath(frame.f_code.co_filename))
    if tree is None:
        return True
    return any(isinstance(n, ast.For) and n.lineno == frame.f_lineno for n in ast.walk(tree))
