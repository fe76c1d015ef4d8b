"""``transformers.Trainer.train()``: its loop state travels in cfrun's checkpoint.

The Trainer runs the training loop itself: ``TrainerState`` (``global_step``, ``epoch``,
``log_history``, best metric...), the loss it sums between two logging steps
(``Trainer._tr_loss``, ``_total_loss_scalar``, ``_globalstep_last_logged``), its FLOs count, its
``TrainerControl`` and the state of its ``ExportableState`` callbacks live in the Trainer, and
the epoch and batch counters in locals of ``_inner_training_loop`` / ``_run_epoch``.

At a checkpoint boundary (the training DataLoader's ``next()``, which ``_run_epoch`` calls right
after an optimizer step and its logging, saving and evaluation) :func:`capture` records all of
that (JSON, no tensors). On resume, the user's ``trainer.train()`` (no arguments) takes the
Trainer's own resume path, fed from cfrun's checkpoint instead of a checkpoint directory:
``_init_training_state`` gets the saved ``TrainerState`` and returns the epochs and batches
trained, computed as the Trainer computes them from ``global_step``, so its epoch loop starts
at the checkpoint's epoch and ``_run_epoch`` skips the consumed batches with accelerate's
``skip_first_batches`` (sampler level, no data loaded); at the first ``_run_epoch``, after the
Trainer created its optimizer and scheduler, cfrun loads model, optimizer, scheduler, RNG and
the script's variables, then the logging sums, control and callback states. Nothing is read
from or written to ``output_dir``: the user's own ``save_steps`` checkpoints are written by the
Trainer as in an uninterrupted run (a step computed again writes its checkpoint again, with the
same content).

Where the idea comes from: ``Trainer.train(resume_from_checkpoint=...)`` (``_init_training_state``,
``_run_epoch``'s ``skip_first_batches``), whose state this module carries without its files.
Tested with transformers 5.24.0 (:data:`TESTED_VERSIONS`); another version keeps cfrun's
generic behaviour (not exact, said with the reason).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from cfrun.rank.adapters import frame_of, untested, when_imported

TESTED_VERSIONS: tuple[str, ...] = ("5.24.0",)
"""transformers versions whose Trainer internals this adapter was tested against."""

_MODULE = "transformers.trainer"
_NO_FILES = "/nonexistent/cfrun-resume"
"""The ``resume_from_checkpoint`` ``_run_epoch`` gets on resume: it makes the Trainer skip the
consumed batches; no RNG file exists there (cfrun restores the RNG itself)."""


def untested_reason() -> str | None:
    """Why the adapter stays off for the installed transformers (None: a tested version)."""
    return untested("transformers", TESTED_VERSIONS, "Trainer adapter")


def _run_epoch_frame(caller: types.FrameType | None) -> types.FrameType | None:
    return frame_of(caller, "_run_epoch", _MODULE)


def _stateful(trainer: Any) -> list[Any]:
    from transformers.trainer_callback import ExportableState

    return [cb for cb in trainer.callback_handler.callbacks + [trainer.control]
            if isinstance(cb, ExportableState)]


def capture(caller: types.FrameType) -> dict[str, Any] | None:
    """The Trainer's loop state at a checkpoint boundary, or None when ``caller`` (the frame
    calling the training DataLoader's ``next()``, training thread) is not under a tested
    Trainer's ``_run_epoch``. JSON-ready; the loss sum is kept exactly (a float32 value is
    a Python float exactly). ``epoch`` and ``batches`` are the Trainer's position, counted
    from the epoch's start also in a resumed epoch (whose loader skipped the batches before)."""
    frame = _run_epoch_frame(caller)
    if frame is None or untested_reason() is not None:
        return None
    trainer, local = frame.f_locals["self"], frame.f_locals
    tr_loss = trainer._tr_loss
    return {
        "epoch": int(local["epoch"]),
        "batches": int(local["step"]) + 1,  # the epoch's batches the Trainer consumed
        "state": json.dumps(dataclasses.asdict(trainer.state), sort_keys=True),
        "tr_loss": float(tr_loss.item()),
        "tr_loss_dtype": str(tr_loss.dtype).removeprefix("torch."),
        "total_loss_scalar": trainer._total_loss_scalar,
        "globalstep_last_logged": trainer._globalstep_last_logged,
        "initial_global_step": trainer._initial_global_step,
        "initial_tokens": trainer._initial_num_input_tokens_seen,
        "current_flos": trainer.current_flos,
        "callbacks": [[type(cb).__name__, cb.state()] for cb in _stateful(trainer)],
    }


@dataclasses.dataclass
class _Pending:
    saved: dict[str, Any]
    apply: Callable[[types.FrameType], None]
    set_rng: Callable[[], None]
    state_loaded: bool = False
    applied: bool = False


_pending: _Pending | None = None


def arm(saved: dict[str, Any], apply: Callable[[types.FrameType], None],
        set_rng: Callable[[], None]) -> None:
    """Resume (called once, at install, by :class:`cfrun.rank.resume.Resume`): the next
    ``Trainer.train()`` continues from ``saved`` (:func:`capture`); ``apply(frame)`` loads
    cfrun's checkpoint (model, optimizer, scheduler, RNG, the script variables of the script
    frames around ``frame``); ``set_rng()`` sets the checkpoint's RNG state again where the
    Trainer's own resume loads its RNG file: after ``_run_epoch`` made its epoch iterator and
    drew the skipped epoch's first batches (the DataLoader iterator draws its base seed from
    the global RNG, as it did at the epoch's start before the checkpoint). Patches
    ``Trainer._init_training_state``, ``_run_epoch`` and ``_load_rng_state`` once
    ``transformers.trainer`` is imported."""
    global _pending
    _pending = _Pending(saved, apply, set_rng)
    when_imported(_MODULE, _patch)


def _patch() -> None:
    trainer_cls = sys.modules[_MODULE].Trainer
    init_state, run_epoch = trainer_cls._init_training_state, trainer_cls._run_epoch
    load_rng = trainer_cls._load_rng_state

    def _init_training_state(self: Any, max_steps: int, steps_per_epoch: int, epochs: Any,
                             resume_from_checkpoint: Any, trial: Any) -> tuple[int, int]:
        out = init_state(self, max_steps, steps_per_epoch, epochs, resume_from_checkpoint, trial)
        p = _pending
        if p is None or p.state_loaded or resume_from_checkpoint is not None:
            return out
        p.state_loaded = True
        self.state = trainer_state(self.state, json.loads(p.saved["state"]))
        self.state.init_training_references(self, max_steps, epochs, trial)
        step = self.state.global_step  # as the Trainer's own resume computes them
        return step // steps_per_epoch, \
            (step % steps_per_epoch) * self.args.gradient_accumulation_steps

    def _run_epoch(self: Any, *args: Any, **kwargs: Any) -> Any:
        p = _pending
        if p is not None and p.state_loaded and not p.applied:
            p.applied = True
            p.apply(sys._getframe())
            _restore_loop(self, p.saved)
            kwargs["resume_from_checkpoint"] = _NO_FILES
        return run_epoch(self, *args, **kwargs)

    def _load_rng_state(self: Any, checkpoint: Any) -> None:
        if checkpoint == _NO_FILES and _pending is not None:
            _pending.set_rng()
            return
        load_rng(self, checkpoint)

    trainer_cls._init_training_state = _init_training_state
    trainer_cls._load_rng_state = _load_rng_state
    trainer_cls._run_epoch = _run_epoch


def _restore_loop(trainer: Any, saved: dict[str, Any]) -> None:
    """The Trainer's logging sums, FLOs, control and callback states, after
    ``_inner_training_loop`` set them for a fresh start."""
    device = trainer._tr_loss.device
    trainer._tr_loss = torch.tensor(saved["tr_loss"], dtype=getattr(torch, saved["tr_loss_dtype"]),
                                    device=device)
    trainer._total_loss_scalar = saved["total_loss_scalar"]
    trainer._globalstep_last_logged = saved["globalstep_last_logged"]
    trainer._initial_global_step = saved["initial_global_step"]
    trainer._initial_num_input_tokens_seen = saved["initial_tokens"]
    trainer.current_flos = saved["current_flos"]
    live = _stateful(trainer)
    for (name, state), cb in zip(saved["callbacks"], live):
        if type(cb).__name__ == name:
            for attr, value in state.get("attributes", {}).items():
                if _fits(attr, value, cb):
                    setattr(cb, attr, value)


def _fits(name: Any, value: Any, live: Any) -> bool:
    """Whether a saved field ``name`` may be set on ``live`` (a callback, the control, the
    state): a public attribute it has already, the saved value of the live value's type (a
    number stays a number; None on either side: not set yet). What the checkpoint did not
    capture from such an object is never created on it (issue 32, finding 3)."""
    if not isinstance(name, str) or name.startswith("_") or not hasattr(live, name):
        return False
    current = getattr(live, name)
    if callable(current) and not isinstance(current, type(value)):
        return False
    if value is None or current is None:
        return True
    numbers = (bool, int, float)
    if isinstance(value, numbers) and isinstance(current, numbers):
        return True
    return type(value) is type(current)


def trainer_state(live: Any, saved: Any) -> Any:
    """A new ``TrainerState`` of ``live``'s class holding ``saved``'s fields (as
    :func:`_fits` allows: the dataclass's own fields, of the live value's type), the others
    ``live``'s: never ``TrainerState(**saved)`` with whatever names the checkpoint lists."""
    if not isinstance(saved, dict):
        return live
    kept = {f.name: getattr(live, f.name) for f in dataclasses.fields(live) if f.init}
    for f in dataclasses.fields(live):
        if f.init and f.name in saved and _fits(f.name, saved[f.name], live):
            kept[f.name] = saved[f.name]
    return type(live)(**kept)
