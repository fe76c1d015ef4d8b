"""Training loops that live in a framework, not in the script: recognise them, say what is lost.

cfrun resumes a script exactly by arriving at the checkpoint's boundary in the script's own
frames: the epoch loop is jumped, the script's variables come back, the training loader skips
its consumed batches (README, "Resume semantics"). Some frameworks run the training loop
themselves, and the script only calls ``trainer.train()`` / ``trainer.fit(...)``: the loop
counters, the step count that drives logging, evaluation and stopping, and the framework's own
running sums are attributes of the framework's objects and locals of its frames, which cfrun
neither captures nor puts back. Resuming such a run restores the model, optimizer, scheduler,
RNG and the loader's position in the epoch, but the framework's loop starts over from its
first epoch with its counters at zero, so the computation after a resume differs.

:func:`framework_loop` recognises such a loop from the frames that call the training loader's
``next()`` at a checkpoint boundary (:meth:`cfrun.rank.boundary.Boundary.on_loader_next`), and
names the framework and what it keeps, for the ``not_exact`` warning. ``transformers.Trainer``
and Lightning's ``Trainer`` on a version :mod:`cfrun.rank.adapters.hf` /
:mod:`cfrun.rank.adapters.lightning` was tested with are the exceptions: those adapters carry
the loop state in the checkpoint and resume it exactly. Frameworks whose loop is
written in the script (``accelerate.Accelerator``, Lightning ``Fabric``) are not listed: their
loader and optimizer wrappers are ordinary wrappers, resumed like any other.

Where the idea comes from: each framework documents its own resume (``Trainer.train(
resume_from_checkpoint=...)`` restores ``TrainerState`` and skips batches; Lightning's
``fit(ckpt_path=...)`` restores ``trainer.fit_loop.state_dict()``); this module records which
state that is, so the warning can say exactly what cfrun does not restore.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Any

from cfrun.rank import frames as F
from cfrun.rank.loader_epoch import loader_fingerprint, set_epoch_rng


@dataclass(frozen=True)
class FrameworkLoop:
    """A framework that owns the training loop."""

    name: str
    """How users know it (``transformers.Trainer``)."""
    modules: tuple[str, ...]
    """``__name__`` prefixes of the modules whose frames run the loop."""
    state: str
    """The loop state that lives in the framework's objects and frames, in the user's words."""

    @property
    def reason(self) -> str:
        """The ``not_exact`` reason (:class:`cfrun.rank.log.NotExact`): what is restored and
        what is not, and why."""
        return (f"the training loop is {self.name}'s, not the script's: {self.state} live in "
                f"{self.name}, outside the script's frames, and start over on a resume; model, "
                "optimizer, scheduler, RNG and the loader's position in the epoch are restored")


HF_TRAINER = FrameworkLoop(
    "transformers.Trainer", ("transformers.trainer",),
    "its epoch loop, TrainerState (global_step, epoch, log_history) and loss sums")
"""Resumed exactly by :mod:`cfrun.rank.adapters.hf` on a tested transformers version."""

LIGHTNING_TRAINER = FrameworkLoop(
    "Lightning Trainer", ("lightning.pytorch.loops", "pytorch_lightning.loops"),
    "its fit loop's progress (current_epoch, global_step, batch_idx)")
"""Resumed exactly by :mod:`cfrun.rank.adapters.lightning` on a tested lightning version."""

FRAMEWORK_LOOPS: tuple[FrameworkLoop, ...] = (HF_TRAINER, LIGHTNING_TRAINER)
"""The frameworks recognised, in the order they are looked for."""


def framework_loop(caller: types.FrameType | None, script_path: str) -> FrameworkLoop | None:
    """The framework whose loop called the training loader's ``next()``, if any.

    Walks from ``caller`` (the frame that called ``next()``) outwards and stops at the first
    frame of the script (``script_path``, a real path): a framework frame found on the way means
    the loop is the framework's. Cheap (no source parsing); called on the training thread at a
    checkpoint boundary only. Returns None for loops written in the script, including ones
    that iterate a framework's loader wrapper.
    """
    f = caller
    while f is not None:
        if os.path.realpath(f.f_code.co_filename) == script_path:
            return None
        module = f.f_globals.get("__name__")
        if isinstance(module, str):
            for fw in FRAMEWORK_LOOPS:
                if any(module == m or module.startswith(m + ".") for m in fw.modules):
                    return fw
        f = f.f_back
    return None


# ---------------------------------------------------------------------- next() from a held iterator
#
# A step loop that draws batches with ``next(it)`` from a DataLoader iterator the script keeps in
# a variable (``it = iter(loader)`` before the loop, ``it = iter(loader)`` again on StopIteration;
# the Hugging Face Trainer does the same inside itself): the position in the data is the
# iterator's (which epoch of the loader, how many batches it has handed out), and the loop around
# ``optimizer.step()`` is an ordinary step loop. Such a run checkpoints as a step loop (the
# boundary is the loop head, :meth:`cfrun.rank.boundary.Boundary._arm_loop_boundary`) and also
# records the held iterator's position; on resume, at the loop head, the script's variable gets
# an iterator of the same epoch, same permutation, started after the consumed batches.


def held_by_script(it: Any, frame: types.FrameType | None, script_path: str) -> bool:
    """Whether DataLoader iterator ``it`` is the value of a variable of a script frame (from
    ``frame`` outwards) and is the newest iterator of its loader (so the loader's recorded
    epoch RNG is this iterator's). Called once, at the first optimizer step, on the training
    thread; the first step decides whether the run is a held-iterator step loop. A loader of
    an ``IterableDataset`` is not (no sampler position to skip to): it stays a loader loop,
    flagged inexact."""
    loader = it.__dict__.get("_cfrun_loader") if hasattr(it, "__dict__") else None
    if loader is None or it.__dict__.get("_cfrun_iter_index") != \
            loader.__dict__.get("_cfrun_iter_calls", 0) - 1:
        return False
    if loader._dataset_kind != 0:  # an IterableDataset: no sampler to skip in (a loader loop)
        return False
    return _holder(it, frame, script_path) is not None


def _holder(it: Any, frame: types.FrameType | None,
            script_path: str) -> tuple[types.FrameType, str] | None:
    for f in F.script_frames(frame, script_path):
        for name, value in f.f_locals.items():
            if value is it:
                return f, name
    return None


def held_position(it: Any) -> dict[str, Any] | None:
    """The position of held iterator ``it`` for the checkpoint (the keys a loader-loop
    checkpoint's ``data`` has), or None if it is no longer the newest iterator of its loader.
    Training thread, at the loop boundary."""
    loader = it.__dict__.get("_cfrun_loader")
    if loader is None or it.__dict__.get("_cfrun_iter_index") != \
            loader.__dict__.get("_cfrun_iter_calls", 0) - 1:
        return None
    return {"loader": loader._cfrun_ordinal, "fingerprint": loader_fingerprint(loader),
            "iter_index": it._cfrun_iter_index, "batches": it._cfrun_consumed,
            "epoch_rng": loader._cfrun_epoch_rng, "held": True}


def resume_held_iterator(data: dict[str, Any], frame: types.FrameType,
                         script_path: str) -> str | None:
    """Resume, at the step loop head (``frame``): give the script's variable that holds an
    iterator of the checkpoint's training loader an iterator of the checkpoint's epoch, its
    permutation drawn from the epoch's recorded RNG, started after ``data["batches"]`` batches
    (skipped at the sampler level, not loaded). Sets the global RNG to the epoch's start: call it
    before the checkpoint's RNG is restored. Returns None, or why it could not (no such
    variable, or the loader changed: the caller stops the job)."""
    for f in F.script_frames(frame, script_path):
        for name, value in list(f.f_locals.items()):
            loader = getattr(value, "__dict__", {}).get("_cfrun_loader")
            if loader is None or loader.__dict__.get("_cfrun_ordinal") != data["loader"]:
                continue
            got = loader_fingerprint(loader)
            if got != data["fingerprint"]:
                return f"changed: {data['fingerprint']} -> {got}"
            set_epoch_rng(loader, data["epoch_rng"])
            object.__setattr__(loader, "_cfrun_iter_calls", int(data["iter_index"]))
            loader.__dict__["_cfrun_skip"] = int(data["batches"])
            loader.__dict__["_cfrun_skip_done"] = int(data["batches"])
            f.f_locals[name] = iter(loader)
            F._locals_to_fast(f)
            return None
    return "is held by no variable of the script at the loop head"


def is_script_frame(frame: types.FrameType, script_path: str) -> bool:
    """Whether ``frame`` runs code of the script (``script_path``, a real path)."""
    return os.path.realpath(frame.f_code.co_filename) == script_path
