"""Code that runs inside the training (rank) processes, one module per phase.

Read in this order (a step meets them in this order too):

1. :mod:`~cfrun.rank.install`: the hook (``hooks/sitecustomize.py`` calls ``arm()``); patches
   torch once the script imports it; ``Guard`` keeps cfrun's failures out of the script.
2. :mod:`~cfrun.rank.discovery`: the script's optimizers, schedulers, scalers, loaders, models.
3. :mod:`~cfrun.rank.boundary`: step counting and the checkpoint at the boundary. What is due
   after a step and its deferral while another is in flight: :mod:`~cfrun.rank.trigger`; the
   boundary itself: the training loader's ``next()`` (:mod:`~cfrun.rank.loader_boundary`) or
   the head of the step loop (:mod:`~cfrun.rank.loop_boundary`); the checkpoint at the
   script's end: :mod:`~cfrun.rank.final`; whether checkpoints are taken at all:
   :mod:`~cfrun.rank.unprotected`; the slot made ready ahead: :mod:`~cfrun.rank.slot_warmup`.
4. :mod:`~cfrun.rank.capture`: what a checkpoint holds (state dicts, RNG, frames, data position).
5. :mod:`~cfrun.rank.snapshot`: the checkpoint in flight; ``start()`` returns a handle. Its
   copy goes into a shared-memory slot (:mod:`~cfrun.rank.slot`) by a plan
   (:mod:`~cfrun.rank.copyplan`), partly after the boundary (:mod:`~cfrun.rank.copier`, on
   CUDA :mod:`~cfrun.rank.cudacopy`), judged by the verdict (:mod:`~cfrun.rank.verdict`), then
   handed off to the node's persist agent (:mod:`~cfrun.rank.handoff`; :mod:`cfrun.agent`
   writes and commits); its measurements make one event
   (:mod:`~cfrun.rank.checkpoint_event`).
6. :mod:`~cfrun.rank.resume`: on a restart, load the newest checkpoint and fast-forward to it:
   the plan (:mod:`~cfrun.rank.resume_plan`), its read (:mod:`~cfrun.rank.resume_read`), the
   arrival at loop heads (:mod:`~cfrun.rank.resume_loops`) or at the training loader
   (:mod:`~cfrun.rank.resume_loader`), replayed epochs (:mod:`~cfrun.rank.fast_forward`), the
   restore (:mod:`~cfrun.rank.restore`).
7. :mod:`~cfrun.rank.preemption`: stop requests and decisions, heartbeats, end and error marks.
8. :mod:`~cfrun.rank.tuner`: the checkpoint interval and the copy mode.

Wiring: :mod:`~cfrun.rank.runtime` (one ``Runtime`` per rank holds the phase objects) and
:mod:`~cfrun.rank.settings` (``RankSettings``: what the supervisor tells the rank). Helpers:
:mod:`~cfrun.rank.data` (DataLoader hooks; the epoch they record and restart:
:mod:`~cfrun.rank.loader_epoch`, the workers' RNG streams: :mod:`~cfrun.rank.loader_workers`,
the other loaders' carried state: :mod:`~cfrun.rank.loader_carry`), :mod:`~cfrun.rank.frames`
(script variables and loops), :mod:`~cfrun.rank.rng`, :mod:`~cfrun.rank.log`.

This package's ``__init__`` imports nothing: the supervisor imports :mod:`cfrun.rank.settings`
without torch.
"""
