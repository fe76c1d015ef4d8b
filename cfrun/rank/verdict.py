"""The copy verdict: did the script write a tensor the in-flight checkpoint copies after its
boundary before that copy was known to be complete? (DESIGN 9b; issue 33.)

Parameters and optimizer state are copied after the boundary, in the background, because only
the next ``optimizer.step()`` is expected to change them. A script may change them earlier:
weights clamped or decayed under ``no_grad`` after the step, an EMA written into the model, a
manual update of a parameter. Each such write bumps the tensor's version counter
(``Tensor._version``; on CUDA at the moment the kernel is queued, so a write queued before the
side stream's copy ran is seen too). The verdict compares the counters at the boundary with
those at the next step's gate (or wherever the training thread waits for the checkpoint): a
checkpoint with a written tensor is dropped (:class:`TornSnapshotError`), and the written
tensors are copied at the boundary from then on (:attr:`Verdict.written_positions`). A write
through ``.data`` bumps no counter and is not seen (README, "Resume semantics").
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class TornSnapshotError(RuntimeError):
    """The script wrote a tensor between a checkpoint's boundary and the end of its background
    copy (:meth:`Verdict.give`): the checkpoint is dropped, never committed."""


class Verdict:
    """The version counters of one in-flight checkpoint's late copies and the verdict on them.

    Training thread: :meth:`watch` at the boundary, :meth:`give` at the next step's gate or
    whenever it waits for the checkpoint. Snapshot thread: :meth:`check`, which waits for the
    verdict before the hand-off.
    """

    def __init__(self) -> None:
        self._watch: list[tuple[int, torch.Tensor, int]] | None = None
        """(position, live tensor, its version counter at the boundary) of each tensor the
        in-flight checkpoint copies after the boundary, until :meth:`give` checks them."""
        self._given = threading.Event()
        """Set once :meth:`give` has checked the in-flight checkpoint's late copies; the
        snapshot thread hands the checkpoint off only then."""
        self._given.set()
        self.torn: list[int] = []
        """Positions of the late-copied tensors the script wrote before the copy was known to
        be complete (the in-flight checkpoint is dropped)."""
        self.written_positions: set[int] = set()
        """Positions (in the capture's tensor list) of tensors the script writes between a
        checkpoint's boundary and the next step's gate: copied at the boundary from then on."""
        self._training_thread: int | None = None

    @property
    def pending(self) -> bool:
        """True while a checkpoint's late copies wait for :meth:`give`."""
        return self._watch is not None

    def watch(self, late: list[int], tensors: list[torch.Tensor]) -> None:
        """Boundary (training thread): remember the version counters of ``tensors`` at the
        positions ``late`` (those copied after the boundary); none: the verdict is given."""
        self._training_thread = threading.get_ident()
        if late:  # checked at the next step's gate (give) before the hand-off
            self._watch = [(i, tensors[i], tensors[i]._version) for i in late]
            self._given.clear()
        else:
            self._watch = None
            self._given.set()

    def give(self) -> list[int]:
        """Check that the script wrote none of the watched tensors, and let the snapshot thread
        hand the checkpoint off, or drop it. Training thread only, once every write the script
        made since the boundary has been issued. Returns the positions found written (empty:
        the checkpoint is exact); they join :attr:`written_positions`."""
        watch, self._watch = self._watch, None
        torn: list[int] = []
        if watch is not None:
            torn = [i for i, t, version in watch if t._version != version]
            self.written_positions.update(torn)
        self.torn = torn
        self._given.set()
        return torn

    def give_if_training_thread(self) -> None:
        """:meth:`give`, when one is pending and the caller is the training thread (another
        thread cannot know that the script has issued its writes)."""
        if self._watch is not None and self._training_thread in (None, threading.get_ident()):
            self.give()

    def check(self, step: int, msg: dict[str, Any]) -> None:
        """Snapshot thread: wait for the verdict on step ``step``'s checkpoint (its hand-off
        message ``msg`` names the tensors).

        Raises:
            TornSnapshotError: the script wrote a late-copied tensor before the copy was done.
        """
        self._given.wait()
        if self.torn:
            raise TornSnapshotError(
                f"the script wrote {len(self.torn)} of the tensors copied after step "
                f"{step}'s boundary (e.g. {describe(self.torn[0], msg)}) before "
                "the copy was complete: dropped; they are copied at the step from now on")


def describe(position: int, msg: dict[str, Any]) -> str:
    """The tensor at ``position`` of a hand-off message ``msg``, by dtype and shape."""
    try:
        entry = msg["doc"]["tensors"][position]
        return f"a {entry.get('dtype')} tensor of shape {list(entry.get('shape', []))}"
    except (KeyError, IndexError, TypeError):
        return f"tensor {position}"
