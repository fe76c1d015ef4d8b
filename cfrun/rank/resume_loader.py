"""Arrival at the training loader: a loader loop's resume restores at the training DataLoader's
``iter()`` of the checkpoint's epoch, which skips the consumed batches without loading them
(:mod:`cfrun.rank.resume`, "loader loops").

Completed epochs either never run (the epoch loop jumped: ``jump``) or run without loading data
(``replay``, :class:`cfrun.rank.fast_forward.FastForward`); a ``transformers.Trainer`` skips to
its position itself (``hf``). At the checkpoint's epoch the loader gets its epoch RNG and
sampler state, its skip count and its workers' RNG, the other loaders what they carried into
their next epoch, and the script's ``enumerate()`` around it its count at the first ``next()``.
"""

from __future__ import annotations

import itertools
import os
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from cfrun.codec import reshard as RS
from cfrun.rank import frames as F
from cfrun.rank.discovery import Discovery
from cfrun.rank.fast_forward import FastForward
from cfrun.rank.loader_carry import set_carried_state
from cfrun.rank.loader_epoch import (
    loader_fingerprint,
    sampler_state,
    set_epoch_rng,
    set_sampler_state,
)
from cfrun.rank.log import say
from cfrun.rank.resume_plan import ResumePlan
from cfrun.rank.resume_read import PlanRead
from cfrun.rank.settings import RankSettings

Apply = Callable[..., None]
"""``Resume._apply(plan, frame, *, in_tracer, wrapper_caller)``: restore the plan there."""


class LoaderArrival:
    """How completed epochs pass (:attr:`kind`), whether the epoch loop jumped
    (:attr:`jumped`), and the ``enumerate()`` count to put back at the restored iterator's
    first ``next()``. Training thread.

    Args:
        read: the plan and its read.
        ff: the fast-forward of replayed epochs.
        apply: restores the plan at a frame.
        resumed: whether the plan was restored already.
        flag: says a reason the resume will not be exact.
        fatal: stops the job for good (the checkpoint's loader is not in this run).
    """

    def __init__(self, settings: RankSettings, found: Discovery, read: PlanRead,
                 ff: FastForward, apply: Apply, resumed: Callable[[], bool],
                 flag: Callable[[str], None], fatal: Callable[[str], NoReturn]) -> None:
        self.s = settings
        self.found = found
        self._read = read
        self._ff = ff
        self._apply = apply
        self._resumed = resumed
        self._flag = flag
        self._fatal = fatal
        self.kind = "replay"
        """``replay``: completed epochs run without data; ``jump``: the epoch loop jumps to
        the checkpoint's epoch; ``hf``: the Trainer skips to its position itself."""
        self.jumped = False
        """The epoch loop jumped to the checkpoint's epoch (or Lightning's loops resumed)."""
        self.fixing_enumerate = False
        """True until the first ``next()`` on the restored loader iterator (:meth:`on_next`)."""
        self._enum_fix: tuple[weakref.ref[Any], int | None, int] | None = None
        """(restored loader iterator, the enumerate count at the checkpoint, batches consumed)"""

    def on_loader_iter(self, loader: Any, n: int, start: Callable[[], Any]) -> Any:
        """Called for ``iter(loader)``; ``n`` counts earlier ``iter()`` calls on this loader;
        ``start()`` starts the epoch as without cfrun (:mod:`cfrun.rank.data`)."""
        if self.kind == "hf":  # the Trainer skips to its position itself
            return _started(start, n)
        plan = self._read.plan
        if self._read.reading and plan is not None and plan.mode == "loader" \
                and self.kind == "replay":
            self._read.await_read()  # before any epoch is skipped
        plan = self._read.plan
        if plan is not None and not self._resumed() and plan.mode == "loader" \
                and self.kind == "jump":
            saved = plan.state["data"]["fingerprint"]
            got = loader_fingerprint(loader)
            if plan.resharded:  # the batch size may follow the world (a global batch kept)
                saved = {**saved, "batch_size": got["batch_size"]}
            if self.jumped and got == saved:
                return self._resume_at_loader(plan, loader, n, sys._getframe(2), start)
            if self.jumped and loader._cfrun_ordinal == plan.state["data"]["loader"] and (
                    got["dataset_len"] == saved["dataset_len"]
                    or got["batch_size"] == saved["batch_size"]):
                self._loader_changed(saved, got)
        elif plan is not None and not self._resumed() and plan.mode == "loader":
            data = plan.state["data"]
            if loader._cfrun_ordinal == data["loader"]:
                return self._replay_iter(plan, loader, n, sys._getframe(2), start)
            if self._ff.active and self._ff.ff_eval == "one":
                return itertools.islice(_started(start, n), 1)  # one batch: cheap, and no
                # division by an empty count
        return _started(start, n)

    def _replay_iter(self, plan: ResumePlan, loader: Any, n: int, caller: types.FrameType,
                     start: Callable[[], Any]) -> Any:
        """``iter()`` of the training loader in a replayed resume: nothing (or one batch) in a
        completed epoch, the restore at the checkpoint's."""
        data = plan.state["data"]
        got = loader_fingerprint(loader)
        if got != data["fingerprint"] and not (
                plan.resharded and {**data["fingerprint"], "batch_size": got["batch_size"]} == got):
            self._loader_changed(data["fingerprint"], got)
        if n < data["iter_index"]:
            self._ff.enter(data["iter_index"], one_batch=bool(data.get("wrapped")))
            if data.get("wrapped"):
                # a wrapper (a prefetcher) may assume one batch at least: give it one;
                # the step it takes is not counted and the state is restored anyway
                return itertools.islice(_started(start, n), 1)
            return iter(())
        if n == data["iter_index"]:
            return self._resume_at_loader(plan, loader, n, caller, start)
        return _started(start, n)

    def on_next(self, it: Any, caller: types.FrameType) -> None:
        """Before a ``next()`` while :attr:`fixing_enumerate`: the first one on the restored
        iterator gives the script's ``enumerate()`` (around the loader or around a wrapper of
        it, :func:`F.find_enumerate`) the count it had at the checkpoint's boundary, which was
        in the middle of that enumerate's ``next()`` as this one is."""
        if self._enum_fix is not None and self._enum_fix[0]() is it:
            saved, consumed = self._enum_fix[1], self._enum_fix[2]
            self._enum_fix = None
            self.fixing_enumerate = False
            if saved is not None:
                en = F.find_enumerate(it, caller, F.consumer_frame(caller))
                if en is not None and F.enumerate_index(en) != saved:
                    F.set_enumerate_index(en, saved)
            elif consumed and "enumerate" not in self._read.plan.state["data"]:  # type: ignore[union-attr]
                F.fix_enumerate(it, consumed)  # a checkpoint without the count

    def loader_missing(self) -> NoReturn:
        """An optimizer step after the jump to the checkpoint's epoch, before the training
        loader's ``iter()``: the checkpoint's loader is not in this run. Stops the job."""
        assert self._read.plan is not None
        self._loader_changed(self._read.plan.state["data"]["fingerprint"], None)

    def _loader_changed(self, saved: dict[str, Any] | None,
                        got: dict[str, Any] | None) -> NoReturn:
        """Stop (exit 5): the checkpoint's training DataLoader is not in this run."""
        if got is None:
            what = "was not iterated in the checkpoint's epoch before an optimizer step"
        else:
            what = "changed: " + ", ".join(
                f"{k} {saved.get(k)} -> {v}" for k, v in got.items()
                if saved is not None and saved.get(k) != v)
        step = self._read.plan.step if self._read.plan is not None else "?"
        self._fatal(f"the training DataLoader of checkpoint step {step} {what}; resume with the "
                    "same script and arguments, or a new --job-dir")

    def _resume_at_loader(self, plan: ResumePlan, loader: Any, n: int, caller: types.FrameType,
                          start: Callable[[], Any]) -> Any:
        data = plan.state["data"]
        if plan.resharded and not data.get("mapped"):
            self._map_position(data, loader)
        set_epoch_rng(loader, data["epoch_rng"])
        set_sampler_state(loader, data.get("sampler") or [])  # before the order is drawn
        wrapper_caller = _outside_cfrun(caller)
        n = data["iter_index"]  # epochs keep their numbers after a jump
        object.__setattr__(loader, "_cfrun_iter_calls", n + 1)
        loader.__dict__["_cfrun_skip"] = data["batches"]
        loader.__dict__["_cfrun_skip_done"] = data["batches"]
        loader.__dict__["_cfrun_worker_rng"] = data.get("worker_rng")
        loader.__dict__["_cfrun_saved_base_seed"] = data.get("base_seed")
        if loader.num_workers > 0 and not isinstance(data.get("worker_rng"), dict):
            self._flag("the checkpoint has no DataLoader worker RNG states (written by an older "
                       "cfrun): the workers' random augmentation restarts from their seeds")
        it = _started(start, n)
        self._restore_other_loaders(loader, data.get("loaders") or {})
        self._apply(plan, caller, in_tracer=False, wrapper_caller=wrapper_caller)
        saved_count = data.get("enumerate")
        self._enum_fix = (weakref.ref(it), saved_count if type(saved_count) is int else None,
                          data["batches"])
        self.fixing_enumerate = True
        return it

    def _restore_other_loaders(self, train: Any, saved: dict[str, Any]) -> None:
        """The loaders other than the training one (an eval loader) get what they carried
        into their next epoch at the checkpoint (:func:`cfrun.rank.loader_carry.set_carried_state`:
        generators, persistent workers' seed and streams), matched by creation ordinal."""
        for loader in self.found.loaders():
            state = saved.get(str(loader.__dict__.get("_cfrun_ordinal")))
            if loader is not train and state is not None:
                why = set_carried_state(loader, state)
                if why is not None:
                    self._flag(why)

    def _map_position(self, data: dict[str, Any], loader: Any) -> None:
        """A resharded resume: the checkpoint's position in its epoch, counted in global
        samples, as batches of this world's loader (:func:`cfrun.codec.reshard.map_position`);
        the sampler's world-dependent attributes keep the live values."""
        saved_sampler = data.get("sampler") or []
        new_sampler = sampler_state(loader)
        skip, again = RS.map_position(
            int(data["batches"]), int(data["fingerprint"].get("batch_size") or 1),
            RS.replicas_of(saved_sampler), int(loader.batch_size or 1),
            RS.replicas_of(new_sampler))
        if type(data.get("enumerate")) is int:
            data["enumerate"] = data["enumerate"] - data["batches"] + skip
        data["batches"] = skip
        data["sampler"] = RS.sampler_state_for_new_world(saved_sampler)
        data["mapped"] = True
        data["worker_rng"] = {}  # the old world's workers' streams: each new one seeds itself
        data["base_seed"] = None
        data["loaders"] = {}
        if again and self.s.rank == 0:
            say(f"the resharded epoch goes on at batch {skip} of each rank: {again} samples "
                "consumed before the checkpoint do not fill a global batch of this world and "
                "are seen again")


def _started(start: Callable[[], Any], n: int) -> Any:
    """``start()``'s iterator, numbered as the loader's ``n``-th ``iter()``."""
    it = start()
    it._cfrun_iter_index = n
    return it


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _outside_cfrun(frame: types.FrameType | None) -> types.FrameType | None:
    """``frame`` or the first frame outwards whose code is not cfrun's (the caller of a patched
    DataLoader method)."""
    while frame is not None and os.path.realpath(frame.f_code.co_filename).startswith(
            _PACKAGE_DIR + os.sep):
        frame = frame.f_back
    return frame
