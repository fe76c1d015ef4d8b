"""Where a checkpoint's tensors go in the snapshot slot and in a device-side staging buffer,
and the batched copies that move them (:mod:`cfrun.rank.snapshot`'s copy plan).

The slot layout, the slot views, the entries' JSON and the copy groups of a state are worked out
once per layout (:class:`CopyPlan`); each group is one ``torch._foreach_copy_`` call (issue 23:
~640 tensors cost ~25 ms of Python per checkpoint). Pure tensor arithmetic: no thread, no
stream, no file.
"""

from __future__ import annotations

from typing import Any

import torch

from cfrun.codec.format import TensorEntry, plan_layout
from cfrun.contract.shard import ALIGN_BYTES as FORMAT_ALIGN_BYTES
from cfrun.rank import cuda
from cfrun.rank.slot import SLOT_ALIGN_BYTES

SYNC_COPY_MAX_BYTES = 1 << 16
"""Tensors up to this size are copied on the training thread (cheaper than a hand-off)."""
STAGING_ALIGN_BYTES = 256
"""Offsets in the device-side staging buffer are multiples of this (any dtype can view them)."""


def staging_layout(sources: list[torch.Tensor],
                   align_bytes: int = STAGING_ALIGN_BYTES) -> tuple[list[int], int]:
    """Byte offsets of ``sources`` packed into one device-side staging buffer, and its size.

    Every offset is a multiple of ``align_bytes`` (256: a multiple of every element size), so a
    ``uint8`` slice at it can be viewed as the tensor's dtype. A plain running sum of byte
    counts is not enough: after a bf16 tensor with an odd element count, a float32 tensor
    would start at an offset that is not a multiple of 4, and ``.view(torch.float32)`` raises.
    """
    offsets = []
    offset = 0
    for s in sources:
        offsets.append(offset)
        offset += -(-(s.numel() * s.element_size()) // align_bytes) * align_bytes
    return offsets, offset


def staged_view(buf: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of the ``uint8`` tensor ``buf`` at byte ``offset`` with ``like``'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return buf[offset:offset + nbytes].view(like.dtype).view(like.shape)


class CopyPlan:
    """Where each tensor of a checkpoint goes in the slot and which copy moves it, worked out
    once per state layout and reused by every checkpoint with that layout (issue 23: with
    ~640 tensors, a ResNet-50, per-tensor Python at each checkpoint cost ~25 ms of the step
    where the copy itself took 4 ms). Holds the slot layout (:func:`plan_layout`), the entries'
    JSON, the slot views (rebuilt when the slot is reallocated) and the tensor positions of
    each copy group: ``now`` (on the training thread: small tensors, those the next forward
    may change, everything in ``inline`` mode), ``later_cpu`` (snapshot thread) and
    ``later_cuda`` (side streams). Training thread only."""

    def __init__(self, tensors: list[torch.Tensor], async_flags: list[bool], inline: bool,
                 sync_max_bytes: int) -> None:
        self.entries, total = plan_layout(tensors)
        self.total = max(SLOT_ALIGN_BYTES, -(-total // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES)
        self.entry_docs = [e.to_json() for e in self.entries]
        self.devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
        self.now: list[int] = []
        self.later_cpu: list[int] = []
        self.later_cuda: list[int] = []
        for i, (e, t, later) in enumerate(zip(self.entries, tensors, async_flags)):
            if inline or not later or e.nbytes <= sync_max_bytes:
                self.now.append(i)
            else:
                (self.later_cuda if t.is_cuda else self.later_cpu).append(i)
        self._like = [(t.dtype, t.shape) for t in tensors]
        self._views: list[torch.Tensor] = []
        self._generation = -1
        self.crossing = {i for i, e in enumerate(self.entries)
                         if len(cuda.split_at(e.offset, e.offset + e.nbytes)) > 1}
        """Positions of the tensors whose slot range spans two page-locked pieces of the slot
        (:func:`cfrun.rank.cuda.split_at`): their CUDA copies are cut there (:meth:`pairs`)."""

    def bind(self, buf: torch.Tensor, generation: int) -> None:
        """Make the slot views over ``buf``, the slot's mapping of ``generation`` (kept until
        the slot is reallocated)."""
        if generation != self._generation:
            self._views = _views(buf, self.entries, self._like)
            self._generation = generation

    def dsts(self, idx: list[int]) -> list[torch.Tensor]:
        """The slot views of the tensors at positions ``idx`` (after :meth:`bind`)."""
        views = self._views
        return [views[i] for i in idx]

    def pairs(self, buf: torch.Tensor, idx: list[int], tensors: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(slot views, sources) of the tensors at positions ``idx`` of ``tensors``, for the
        copies from CUDA into the page-locked slot ``buf``: a contiguous CUDA tensor whose
        range spans two page-locked pieces is copied as one byte slice per piece (a copy
        across two ``cudaHostRegister`` ranges may not count as page-locked)."""
        dsts = self.dsts(idx)
        srcs = [tensors[i] for i in idx]
        if not self.crossing.intersection(idx):
            return dsts, srcs
        return split_pairs(buf, dsts, srcs, [self.entries[i] for i in idx])


def _views(buf: torch.Tensor, entries: list[TensorEntry],
           like: list[tuple[torch.dtype, torch.Size]]) -> list[torch.Tensor]:
    """Contiguous tensors of each entry's dtype and shape over its byte range of ``buf`` (a
    ``uint8`` tensor): one ``as_strided`` each over ``buf`` viewed once per dtype (a third of
    what a slice and two views each cost: ~900 tensors took 10 ms at the first checkpoint).
    Every offset is a multiple of ``ALIGN_BYTES`` and so of every item size."""
    base = buf.storage_offset()
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for e, (dtype, shape) in zip(entries, like):
        size = dtype.itemsize
        if e.nbytes == 0 or (base + e.offset) % size or buf.numel() % size:
            out.append(buf[e.offset:e.offset + e.nbytes].view(dtype).view(shape))
            continue
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buf.view(dtype)
        out.append(torch.as_strided(whole, shape, _contiguous_strides(shape),
                                    (base + e.offset) // size))
    return out


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def split_pairs(buf: torch.Tensor, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                entries: list[TensorEntry]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dsts, srcs)`` with every contiguous CUDA source whose slot range (its entry in
    ``entries``) spans two page-locked pieces of the slot ``buf`` replaced by one byte-slice
    pair per piece (:func:`cfrun.rank.cuda.split_at`): a copy across two ``cudaHostRegister``
    ranges may not count as page-locked, and would then block the host."""
    out_d: list[torch.Tensor] = []
    out_s: list[torch.Tensor] = []
    for d, t, e in zip(dsts, srcs, entries):
        pieces = cuda.split_at(e.offset, e.offset + e.nbytes)
        if len(pieces) == 1 or not t.is_cuda or not t.is_contiguous():
            out_d.append(d)
            out_s.append(t)
            continue
        flat = t.detach().reshape(-1).view(torch.uint8)
        for lo, hi in pieces:
            out_d.append(buf[lo:hi])
            out_s.append(flat[lo - e.offset:hi - e.offset])
    return out_d, out_s


def plan_key(tensors: list[torch.Tensor], async_flags: list[bool]) -> tuple[Any, ...]:
    """What a :class:`CopyPlan` depends on in a checkpoint's tensors: each one's dtype, shape,
    device and whether it may be copied later (one tuple per tensor, no Python objects kept)."""
    return tuple((t.dtype, t.shape, t.device, a) for t, a in zip(tensors, async_flags))


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src, non_blocking=True)`` for each pair, in one ``torch._foreach_copy_``
    call where torch has it (one call, one GIL release and, on one device, one launch for
    many tensors; issue 18, item 11, issue 23); if torch refuses the lists (devices it does not
    take together), one ``copy_`` each."""
    if not dsts:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dsts, srcs, non_blocking=True)
            return
        except (RuntimeError, TypeError, NotImplementedError):
            pass  # copying a pair again is harmless
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


def run_layout(entries: list[TensorEntry], align_bytes: int = STAGING_ALIGN_BYTES
               ) -> tuple[list[int], list[tuple[int, int, int]], int]:
    """The staging layout of tensors that go to the slot places ``entries`` (in slot order):
    each run of entries that lie back to back in the slot (only alignment padding between
    them) is staged as one block with the slot's spacing, so one copy moves the whole run
    into the slot; runs start at multiples of ``align_bytes``.

    Returns each entry's staging offset, the runs as ``(slot_start, slot_end,
    staging_start)`` byte positions, and the staging size in bytes.
    """
    offsets: list[int] = []
    runs: list[tuple[int, int, int]] = []
    size = 0
    run_slot = run_stage = run_end = -1
    for e in entries:
        if run_end < 0 or e.offset != -(-run_end // FORMAT_ALIGN_BYTES) * FORMAT_ALIGN_BYTES:
            if run_end >= 0:
                runs.append((run_slot, run_end, run_stage))
            run_slot, run_stage = e.offset, size
        offsets.append(run_stage + e.offset - run_slot)
        run_end = e.offset + e.nbytes
        size = -(-(run_stage + run_end - run_slot) // align_bytes) * align_bytes
    if run_end >= 0:
        runs.append((run_slot, run_end, run_stage))
    return offsets, runs, size

