"""Code that runs inside the training (rank) processes, one module per phase.

Read in this order (a step meets them in this order too):

1. :mod:`~cfrun.rank.install`: the hook (``hooks/sitecustomize.py`` calls ``arm()``); patches
   torch once the script imports it; ``Guard`` keeps cfrun's failures out of the script.
2. :mod:`~cfrun.rank.discovery`: the script's optimizers, schedulers, scalers, loaders, models.
3. :mod:`~cfrun.rank.boundary`: step counting, the trigger, the boundary where a checkpoint is
   taken (the training loader's ``next()`` or the head of the step loop).
4. :mod:`~cfrun.rank.capture`: what a checkpoint holds (state dicts, RNG, frames, data position).
5. :mod:`~cfrun.rank.snapshot`: the copy into a shared-memory slot and the hand-off to the node's
   persist agent (:mod:`cfrun.agent`), which writes and commits; ``start()`` returns a handle.
6. :mod:`~cfrun.rank.resume`: on a restart, load the newest checkpoint and fast-forward to it.
7. :mod:`~cfrun.rank.preemption`: stop requests and decisions, heartbeats, end and error marks.
8. :mod:`~cfrun.rank.tuner`: the checkpoint interval and the copy mode.

Wiring: :mod:`~cfrun.rank.runtime` (one ``Runtime`` per rank holds the phase objects) and
:mod:`~cfrun.rank.settings` (``RankSettings``: what the supervisor tells the rank). Helpers:
:mod:`~cfrun.rank.data` (DataLoader hooks), :mod:`~cfrun.rank.frames` (script variables and
loops), :mod:`~cfrun.rank.rng`, :mod:`~cfrun.rank.log`.

This package's ``__init__`` imports nothing: the supervisor imports :mod:`cfrun.rank.settings`
without torch.
"""
