"""What a DataLoader other than the training one (an eval loader) carries from one of its
epochs to the next across a checkpoint (issue 34): its generators and, with
``persistent_workers=True``, its workers' base seed and RNG states. :func:`carried_state` reads
them for the checkpoint, :func:`set_carried_state` puts them back at a resume; the loader's next
``iter()`` (:mod:`cfrun.rank.data`) restarts its workers with them. Main process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from cfrun.rank.loader_epoch import loader_fingerprint
from cfrun.rank.loader_workers import worker_rng_of


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
    checkpoint's base seed and each worker's states
    (:class:`~cfrun.rank.loader_workers.WorkerInit`), and the base seed this run draws there is
    given back to the RNG it came from (the original run drew none): workers the script
    already started before the resume point (a validation before the epoch loop) are shut
    down first. Returns why the loader could not be restored, or None."""
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
