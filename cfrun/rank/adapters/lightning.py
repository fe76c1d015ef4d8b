"""``lightning.Trainer.fit()``: its loop state travels in cfrun's checkpoint.

Lightning's fit loop keeps its position in progress trackers (``fit_loop.epoch_progress``:
``current_epoch``; ``epoch_loop.batch_progress``: ``batch_idx``; the optimizer's step
progress: ``global_step``; the scheduler's and the validation loop's progress) and in
``_batches_that_stepped`` (the loggers' step); callbacks keep theirs in ``state_dict()``
(``ModelCheckpoint``: best and last paths, the top-k scores). ``fit(ckpt_path=...)`` puts these
back with ``fit_loop.load_state_dict`` and ``Callback.load_state_dict``, which mark the loops
as restarting, so that the fit loop continues mid-epoch without calling the epoch's start hooks
again and skips the sanity check.

At a checkpoint boundary (the training DataLoader's ``next()``, which
``_TrainingEpochLoop.advance`` calls through its data fetcher before the batch's step, after
the previous batch's validation, scheduler step and logging) :func:`capture` records
``fit_loop.state_dict()`` and the callbacks' states (JSON, no model tensors: cfrun's checkpoint
carries model, optimizer, scheduler and RNG). On resume, the user's ``trainer.fit(model,
loader)`` (no ``ckpt_path``) takes Lightning's own resume path, fed from cfrun's checkpoint:
``_CheckpointConnector.restore_training_state`` (a no-op without ``ckpt_path``) loads the loop
and callback states; the training DataLoader's first ``iter()`` (in ``FitLoop.setup_data``)
starts the checkpoint's epoch after its consumed batches (skipped at the sampler level, cfrun's
loader resume), where cfrun loads model, optimizer, scheduler, RNG and the script's variables.
Lightning's own resume restarts a plain DataLoader at the epoch's first batch and warns so;
cfrun resumes it at the checkpoint's batch, and that warning is silenced. The user's
``ModelCheckpoint`` files written after cfrun's checkpoint, by the steps a kill makes cfrun
compute again, are written again under the same names, not versioned ``-v1``
(:func:`_patch_model_checkpoint`; the checkpoint records the names in each directory). The
resumed epoch's ``CombinedLoader`` iterator counts batches from the epoch's start
(:func:`_patch_epoch_loop`), as in the uninterrupted run, so that the state cfrun records at
the next boundary (the loader wrappers' attributes) is the uninterrupted run's
(``cfrun verify`` compares it).

One difference from Lightning's checkpoints: those are written at ``on_train_batch_end`` or
``on_validation_end``; cfrun's boundary comes after the batch's ``on_advance_end``, where every
batch counter is complete, which Lightning reads as a checkpoint saved "on last" (its
``RESTARTED_ON_LAST``). When the batch before the boundary ran validation, Lightning's restart
then spends one loop iteration skipping that validation and counts ``_batches_that_stepped``
once more (a checkpoint saved during validation had not counted it yet): :func:`capture`
records it one lower there, so the restart arrives at the uninterrupted count.

Where the idea comes from: ``Trainer.fit(ckpt_path=...)`` (``_CheckpointConnector.restore_loops``,
``restore_callbacks``), whose state this module carries without its file. Tested with
lightning 2.6.6 (:data:`TESTED_VERSIONS`); another version, or the ``pytorch_lightning``
package, keeps cfrun's generic behaviour (not exact, said with the reason). Not carried, as in
Lightning's own resume: the running sums of values logged with ``on_epoch=True`` (an epoch
mean after a mid-epoch resume covers the batches since the resume).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types
import warnings
from typing import Any

import torch

from cfrun.rank.adapters import frame_of, untested, when_imported

TESTED_VERSIONS: tuple[str, ...] = ("2.6.6",)
"""lightning versions whose fit loop internals this adapter was tested against."""

_EPOCH_LOOP = "lightning.pytorch.loops.training_epoch_loop"
_MODEL_CHECKPOINT = "lightning.pytorch.callbacks.model_checkpoint"
_CONNECTOR = "lightning.pytorch.trainer.connectors.checkpoint_connector"
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"
"""Lightning's warning on a mid-epoch resume of a DataLoader without ``state_dict``: cfrun
resumes it at the checkpoint's batch."""


def untested_reason() -> str | None:
    """Why the adapter stays off for the installed lightning (None: a tested version)."""
    return untested("lightning", TESTED_VERSIONS, "Lightning Trainer adapter")


def _advance_frame(caller: types.FrameType | None) -> types.FrameType | None:
    return frame_of(caller, "advance", _EPOCH_LOOP)


def _encode(obj: Any) -> Any:
    """``obj`` as JSON values: a tensor becomes ``{"__tensor__": values, "dtype": name}``
    (a float32 value is a Python float exactly). Raises TypeError for anything else."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.detach().cpu().tolist(),
                "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("a dict with keys other than str")
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    raise TypeError(f"a {type(obj).__name__}")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def capture(caller: types.FrameType) -> dict[str, Any] | None:
    """The fit loop's and the callbacks' state at a checkpoint boundary, or None when
    ``caller`` (the frame calling the training DataLoader's ``next()``, training thread) is not
    under a tested Lightning's ``_TrainingEpochLoop.advance``, when the batches are not
    fetched one at a time (a loader without a length is read ahead; a ``training_step`` that
    takes the ``dataloader_iter``), or when a callback's state is not JSON-able (tensors are):
    the caller then flags the generic reason. JSON-ready."""
    frame = _advance_frame(caller)
    if frame is None or untested_reason() is not None:
        return None
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

    epoch_loop, fetcher = frame.f_locals["self"], frame.f_locals.get("data_fetcher")
    if fetcher is None or isinstance(fetcher, _DataLoaderIterDataFetcher) \
            or fetcher.length is None:
        return None
    trainer = epoch_loop.trainer
    loops = trainer.fit_loop.state_dict()
    if epoch_loop._should_check_val_fx(fetcher) and not epoch_loop._should_accumulate():
        # Lightning's restart counts this batch once more (module docstring)
        key = "epoch_loop.state_dict"
        loops[key] = dict(loops[key], _batches_that_stepped=epoch_loop._batches_that_stepped - 1)
    try:
        callbacks = {cb.state_key: _encode(state) for cb in trainer.callbacks
                     if (state := cb.state_dict())}
        return {"fit_loop": json.dumps(_encode(loops), sort_keys=True),
                "callbacks": json.dumps(callbacks, sort_keys=True),
                "files": json.dumps(_checkpoint_files(trainer), sort_keys=True)}
    except TypeError:
        return None


_PATH_FIELDS = ("best_model_path", "kth_best_model_path", "last_model_path")
"""``ModelCheckpoint`` state fields that name a file (its top-k eviction deletes them)."""


def _is_model_checkpoint(cb: Any) -> bool:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return isinstance(cb, ModelCheckpoint)


def checkpoint_paths_inside(state: dict[str, Any], dirpath: Any) -> dict[str, Any]:
    """A ``ModelCheckpoint`` state whose file paths all lie inside the callback's own
    ``dirpath`` (:func:`cfrun.rank.frames.path_within`): entries of ``best_k_models`` outside
    it are dropped and path fields outside it emptied (Lightning itself restores them only when
    the saved ``dirpath`` is the live one). Lightning's
    top-k eviction deletes the files these name, so a crafted state
    (``<dirpath>/../../x``) deleted a file outside it (issue 32, finding 3). ``dirpath`` None:
    no path is kept."""
    from cfrun.rank.frames import path_within

    out = dict(state)
    best = out.get("best_k_models")
    if isinstance(best, dict):
        out["best_k_models"] = {k: v for k, v in best.items()
                                if isinstance(k, str) and path_within(k, dirpath)}
    for name in _PATH_FIELDS:
        value = out.get(name)
        if value and not (isinstance(value, str) and path_within(value, dirpath)):
            out[name] = ""
    return out


def _checkpoint_files(trainer: Any) -> dict[str, list[str]]:
    """The files in each ``ModelCheckpoint``'s directory (names), by callback state key."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return {cb.state_key: sorted(os.listdir(cb.dirpath)) for cb in trainer.callbacks
            if isinstance(cb, ModelCheckpoint) and cb.dirpath and os.path.isdir(cb.dirpath)}


@dataclasses.dataclass
class _Pending:
    saved: dict[str, Any]
    loaded: bool = False
    started: bool = False
    """The resumed epoch's ``on_run_start`` ran (:func:`_patch_epoch_loop`)."""


_pending: _Pending | None = None


def arm(saved: dict[str, Any]) -> None:
    """Resume (called once, at install, by :class:`cfrun.rank.resume.Resume`): the next
    ``Trainer.fit()`` restores ``saved`` (:func:`capture`) where Lightning restores a
    checkpoint's loops and callbacks (``_CheckpointConnector.restore_training_state``, after the
    optimizers are made and before the sanity check, which a restarting loop skips). Model,
    optimizer, scheduler, RNG and the data position are cfrun's, restored at the training
    DataLoader's first ``iter()``. Patches ``restore_training_state`` once
    ``lightning.pytorch.trainer.connectors.checkpoint_connector`` is imported, and
    ``ModelCheckpoint``'s version counter (:func:`_patch_model_checkpoint`)."""
    global _pending
    _pending = _Pending(saved)
    when_imported(_CONNECTOR, _patch)


def _patch() -> None:
    connector_cls = sys.modules[_CONNECTOR]._CheckpointConnector
    restore = connector_cls.restore_training_state

    def restore_training_state(self: Any) -> None:
        restore(self)
        p = _pending
        if p is None or p.loaded or self._loaded_checkpoint or not self.trainer.training:
            return
        p.loaded = True
        _restore(self.trainer, p.saved)

    connector_cls.restore_training_state = restore_training_state
    when_imported(_MODEL_CHECKPOINT, _patch_model_checkpoint)
    when_imported(_EPOCH_LOOP, _patch_epoch_loop)


def _patch_epoch_loop() -> None:
    """The resumed epoch's ``CombinedLoader`` iterator counts its batches from the epoch's
    start, as in the uninterrupted run: Lightning's restart makes a new one whose batch counter
    (``_ModeIterator._idx``, "what would be batch_idx", which Lightning's training loop does not
    read) starts at 0 although the checkpoint's batches were consumed, and cfrun's checkpoint
    records that counter with the loader wrappers' state. ``_TrainingEpochLoop.on_run_start``
    adds the consumed batches to its data fetcher's ``fetched`` on a restart; the patched one
    adds them to that counter too, once, in the epoch the resume restored."""
    cls = sys.modules[_EPOCH_LOOP]._TrainingEpochLoop
    start = cls.on_run_start

    def on_run_start(self: Any, data_fetcher: Any) -> None:
        start(self, data_fetcher)
        p = _pending
        if p is None or not p.loaded or p.started:
            return
        p.started = True
        iterator: Any = getattr(getattr(data_fetcher, "iterator", None), "_iterator", None)
        if iterator is not None and type(getattr(iterator, "_idx", None)) is int:
            iterator._idx += self.batch_progress.current.ready

    cls.on_run_start = on_run_start


def _patch_model_checkpoint() -> None:
    """A step computed again after a kill writes its ``ModelCheckpoint`` file again under the
    same name, as in the uninterrupted run: a file written after cfrun's checkpoint, by the
    killed process, does not count as existing for the version counter (which would name the
    new one ``-v1``) until this process wrote it (rank 0 decides, as Lightning does)."""
    cls = sys.modules[_MODEL_CHECKPOINT].ModelCheckpoint
    save = cls._save_checkpoint

    def file_exists(self: Any, filepath: Any, trainer: Any) -> bool:
        local = trainer.is_global_zero and self._fs.exists(filepath) \
            and os.fspath(filepath) not in self.__dict__.get("_cfrun_stale", ())
        return bool(trainer.strategy.reduce_boolean_decision(local, all=False))

    def _save_checkpoint(self: Any, trainer: Any, filepath: str) -> None:
        save(self, trainer, filepath)
        self.__dict__.get("_cfrun_stale", set()).discard(os.fspath(filepath))

    cls.file_exists = file_exists
    cls._save_checkpoint = _save_checkpoint


def _restore(trainer: Any, saved: dict[str, Any]) -> None:
    """The fit loop's progress and the callbacks' states, as ``fit(ckpt_path=...)`` loads
    them (``restore_loops``, ``_call_callbacks_load_state_dict``)."""
    warnings.filterwarnings("ignore", message=_NOT_RESUMABLE)
    trainer.fit_loop.load_state_dict(_decode(json.loads(saved["fit_loop"])))
    states = _decode(json.loads(saved["callbacks"]))
    for cb in trainer.callbacks:
        state = states.get(cb.state_key)
        if state:
            cb.load_state_dict(checkpoint_paths_inside(state, getattr(cb, "dirpath", None))
                               if _is_model_checkpoint(cb) else state)
    then = json.loads(saved.get("files", "{}"))
    for key, now in _checkpoint_files(trainer).items():
        cb = next(c for c in trainer.callbacks if c.state_key == key)
        cb.__dict__["_cfrun_stale"] = {os.path.join(cb.dirpath, name)
                                       for name in set(now) - set(then.get(key, now))}
