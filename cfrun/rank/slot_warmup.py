"""The snapshot slot made ready ahead of the first checkpoint, off the training thread (issue
23): from the first optimizer's construction (one rank) or the first counted step of each
process (:meth:`cfrun.rank.snapshot.Snapshotter.prepare`), so that the first checkpoint does not
allocate and page-lock it on the training thread."""

from __future__ import annotations

import torch

from cfrun.contract import faults
from cfrun.rank.capture import Capture
from cfrun.rank.log import say
from cfrun.rank.settings import RankSettings
from cfrun.rank.snapshot import Snapshotter

OPT_STATE_COPIES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "SGD": 1,
                    "Adagrad": 1, "RMSprop": 1, "Adadelta": 2}
"""Tensors of a parameter's size that an optimizer of this class keeps per parameter (its
state); 2 for any other (:meth:`SlotWarmup.on_optimizer_created`'s slot size)."""


class SlotWarmup:
    """Whether the slot was prepared in this process (:attr:`prepared`), and the fault point
    ``rank.slot_ready_after_steps`` that holds the preparation back. Training thread."""

    def __init__(self, settings: RankSettings, snap: Snapshotter, capture: Capture) -> None:
        self.s = settings
        self._snap = snap
        self._capture = capture
        self.prepared = False
        """The snapshot slot was prepared at a counted step (:meth:`at_first_step`)."""
        # a fault point (cfrun.contract.faults), read once: None in every real run
        ready_after = faults.value("rank.slot_ready_after_steps")
        self._ready_after = int(ready_after) if ready_after is not None else None
        self._steps_here = 0

    def on_optimizer_created(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer was constructed (its ``__init__`` hook), one rank alone: start
        preparing the snapshot slot right away, sized from its parameters and the state its
        kind keeps per parameter (:data:`OPT_STATE_COPIES`), so the slot is ready even for a
        checkpoint due at the first step (``--interval 1``; issue 23). With several ranks
        the first step prepares it (DDP's 1/N shards are known then). Never raises."""
        if self.prepared or self.s.world_size != 1:
            return
        try:
            params = [p for g in opt.param_groups for p in g["params"]
                      if isinstance(p, torch.Tensor)]
            copies = OPT_STATE_COPIES.get(type(opt).__name__, 2)
            if type(opt).__name__ == "SGD" and not opt.defaults.get("momentum"):
                copies = 0
            nbytes = sum(p.numel() * p.element_size() for p in params) * (1 + copies)
            devices = sorted({p.device for p in params if p.is_cuda}, key=str)
            self._snap.prepare_bytes(nbytes, devices)
        except Exception as e:
            say(f"WARNING: could not prepare the snapshot slot ahead ({e!r})")

    def at_first_step(self) -> None:
        """At this process's first counted step (a fresh start or after a resume): prepare
        the snapshot slot for the models' and optimizers' state on a background thread
        (:meth:`Snapshotter.prepare`), so that the first checkpoint does not allocate and
        page-lock it on the training thread (issue 23). A failure only leaves that to the
        first checkpoint."""
        self.prepared = True
        self._capture.found.hold()  # for the final checkpoint (Discovery.hold)
        try:
            self._snap.prepare(self._capture.model_tensors())
        except Exception as e:
            say(f"WARNING: could not prepare the snapshot slot ahead ({e!r}); the first "
                "checkpoint allocates it")

    def after_step(self) -> None:
        """After each counted step: the fault point lets the preparation go on at its step."""
        if self._ready_after is not None:  # a fault point: None in every real run
            self._steps_here += 1
            if self._steps_here >= self._ready_after:
                self._snap.slot.hold.set()
