"""``accelerate``: the batch ``DataLoaderShard`` reads ahead of the script.

``accelerator.prepare(loader)`` returns a ``DataLoaderShard`` whose ``__iter__`` generator
draws one batch ahead from the torch DataLoader it wraps, to know before it yields a batch
whether it is the epoch's last one (``GradientState.end_of_dataloader``, which makes
``accelerator.accumulate`` step the optimizer at an epoch's end with
``gradient_accumulation_steps`` > 1). At cfrun's loader boundary (the wrapped DataLoader's
``next()``, called from that generator) the DataLoader has therefore handed out one batch
more than the script received: the batch the generator holds in ``current_batch``. The
checkpoint records the script's position (one batch fewer); a resume skips that many batches
at the sampler level and the new generator reads the held batch again, as it reads every
batch, so the resumed epoch yields exactly the batches the original run yielded.

The rest of accelerate's loop state needs nothing of cfrun's: the checkpoint boundary follows
an optimizer step, where ``Accelerator.step`` (the accumulation counter) is a multiple of
``gradient_accumulation_steps`` or was reset at the previous epoch's end, as in a fresh
``Accelerator``; the ``AcceleratedScheduler`` counts skipped steps in the torch scheduler's
``_step_count``, which the checkpoint carries.

Where the idea comes from: accelerate's own ``DataLoaderAdapter.adjust_state_dict_for_prefetch``
corrects its ``state_dict()`` for the same read-ahead. Limit: a dataset that draws from the
global RNG in the main process (``num_workers=0``) draws again for the batch read twice.
"""

from __future__ import annotations

import types

from cfrun.rank.adapters import installed_version

TESTED_VERSIONS: tuple[str, ...] = ("1.15.0",)
"""accelerate versions whose ``DataLoaderShard.__iter__`` this adapter was tested against."""

_READ_AHEAD_BATCHES = 1
_SHARD_ITER = ("accelerate.data_loader", "__iter__")


def read_ahead(caller: types.FrameType) -> tuple[int, str | None]:
    """How many batches the library generator ``caller`` holds beyond the script's position,
    and, for an accelerate version not tested, why that is not corrected.

    ``caller`` is the frame that calls ``next()`` on the training DataLoader's iterator at a
    checkpoint boundary (training thread). Returns ``(1, None)`` for ``DataLoaderShard.__iter__``
    of a tested version; ``(0, reason)`` for it on another version (cfrun's generic position,
    one batch too far); ``(0, None)`` for any other caller.
    """
    if (caller.f_globals.get("__name__"), caller.f_code.co_name) != _SHARD_ITER or \
            "current_batch" not in caller.f_code.co_varnames:
        return 0, None
    version = installed_version("accelerate")
    if version not in TESTED_VERSIONS:
        return 0, (f"accelerate {version} is not a version cfrun's accelerate adapter was "
                   f"tested against ({', '.join(TESTED_VERSIONS)}): its DataLoaderShard reads "
                   "a batch ahead, and the resumed position may be one batch too far")
    return _READ_AHEAD_BATCHES, None


def is_shard_iter(caller: types.FrameType) -> bool:
    """Whether ``caller`` is ``DataLoaderShard.__iter__`` (any version): its ``next()`` calls
    are the library's, not a loop of the script's."""
    return (caller.f_globals.get("__name__"), caller.f_code.co_name) == _SHARD_ITER
