"""1/N persist of replicated state (DeepFreeze §IV-A d; DESIGN.md §7).

With data parallelism (DDP) every rank holds the same parameters and optimizer state after each
step, so writing all of it from every rank multiplies the bytes by the world size, and writing it
from rank 0 alone puts the whole cost on one rank. DeepFreeze splits each replicated tensor: rank
``r`` of ``N`` snapshots and persists only slice ``r`` along the tensor's largest dimension.

* :func:`shard_replicated` (each rank, at the checkpoint boundary, before the snapshot): replaces
  every large replicated tensor in the rank's tensor list by the rank's slice (a view: nothing is
  copied here) and returns the layout, stored in the rank's JSON tree under ``"sharded"``.
* :func:`reassemble` (each rank, checking every rank's tree before a resume): rebuilds the full
  tensors from every rank's slice (``meta`` tensors there; the load itself streams the slices
  straight into the full tensors, :func:`cfrun.codec.checkpoint.load_shard`).

What stays per rank, whole: tensors smaller than ``SHARD_MIN_BYTES`` and 0-d ones (optimizer step
counters), module buffers (BatchNorm statistics differ per rank between DDP's broadcasts), the RNG,
the data loader position and the script's variables. The split is ``torch.tensor_split``'s: the
first ``n % N`` slices get one row more.
"""

from __future__ import annotations

from typing import Any

import torch

SHARD_MIN_BYTES = 64 << 10
"""Replicated tensors below this size are saved whole by every rank (their slices would cost
more in bookkeeping than they save)."""


def split_ranges(n: int, world_size: int) -> list[list[int]]:
    """``[start, stop)`` of each rank's slice of ``n`` rows, as ``torch.tensor_split(n, N)``."""
    base, extra = divmod(n, world_size)
    out, start = [], 0
    for q in range(world_size):
        stop = start + base + (1 if q < extra else 0)
        out.append([start, stop])
        start = stop
    return out


def shard_replicated(tensors: list[torch.Tensor], replicated_ids: set[int], rank: int,
                     world_size: int, *, rank0_only: bool = False
                     ) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """Replace, in place, each large replicated tensor of ``tensors`` by this rank's slice.

    Called by every rank of a data-parallel job for the same step, with tensor lists built in
    the same order (so the k-th layout entry names the same tensor on every rank).

    Args:
        tensors: the rank's tensors (any device); entries are replaced by views.
        replicated_ids: ``id()`` of the tensors every rank holds identically (DDP parameters
            and their optimizer state).
        rank0_only: rank 0 keeps the whole tensor, the others an empty slice (the layout the
            usual "rank 0 saves the model" practice amounts to; for comparison).

    Returns:
        ``(layout, views)``: one ``{"index", "dim", "shape", "dtype", "ranges"}`` per sharded
        tensor, in order; and ``id(view) -> id(original)`` for the replaced entries.
    """
    layout: list[dict[str, Any]] = []
    views: dict[int, int] = {}
    if world_size < 2:
        return layout, views
    for i, t in enumerate(tensors):
        if (id(t) not in replicated_ids or t.dim() == 0
                or t.numel() * t.element_size() < SHARD_MIN_BYTES):
            continue
        dim = max(range(t.dim()), key=lambda d: t.shape[d])
        n = int(t.shape[dim])
        ranges = [[0, n]] + [[n, n]] * (world_size - 1) if rank0_only else \
            split_ranges(n, world_size)
        start, stop = ranges[rank]
        view = t.detach().narrow(dim, start, stop - start)
        views[id(view)] = id(t)
        tensors[i] = view
        layout.append({"index": i, "dim": dim, "shape": list(t.shape),
                       "dtype": str(t.dtype).removeprefix("torch."), "ranges": ranges})
    return layout, views


def reassemble(rank: int, tensors: list[torch.Tensor], layout: list[dict[str, Any]],
               others: dict[int, tuple[list[torch.Tensor], list[dict[str, Any]]]]) -> None:
    """Put the full tensors back into ``tensors`` (in place) from every rank's slices.

    Args:
        rank: this rank; its slices are in ``tensors`` at the layout's indexes.
        others: for every other rank ``q``, its decoded tensor list and its layout.

    Raises:
        ValueError: the ranks' layouts disagree (different tensors, shapes or splits).
    """
    world_size = len(others) + 1
    for k, ent in enumerate(layout):
        parts = []
        for q in range(world_size):
            if q == rank:
                parts.append(tensors[ent["index"]])
                continue
            q_tensors, q_layout = others[q]
            if k >= len(q_layout):
                raise ValueError(f"rank {q} has {len(q_layout)} sharded tensors, rank {rank} more")
            q_ent = q_layout[k]
            if (q_ent["shape"], q_ent["dim"], q_ent["ranges"]) != (
                    ent["shape"], ent["dim"], ent["ranges"]):
                raise ValueError(f"sharded tensor {k}: rank {q}'s layout {q_ent} differs from "
                                 f"rank {rank}'s {ent}")
            parts.append(q_tensors[q_ent["index"]])
        for q, part in enumerate(parts):
            start, stop = ent["ranges"][q]
            if part.shape[ent["dim"]] != stop - start:
                raise ValueError(f"sharded tensor {k}: rank {q}'s slice has "
                                 f"{part.shape[ent['dim']]} rows, not {stop - start}")
        shapes = {tuple(s for d, s in enumerate(p.shape) if d != ent["dim"]) for p in parts}
        rows = sum(int(p.shape[ent["dim"]]) for p in parts)
        got = list(parts[0].shape)
        got[ent["dim"]] = rows
        if len(shapes) != 1 or got != ent["shape"]:
            raise ValueError(f"sharded tensor {k}: its slices {[list(p.shape) for p in parts]} "
                             f"do not make {ent['shape']}")
        if all(p.is_meta for p in parts):  # a check (check_usable): no torch.cat, whose meta
            # kernel imports torch's Python decompositions (~75 MB resident, for nothing)
            tensors[ent["index"]] = torch.empty(got, dtype=parts[0].dtype, device="meta")
        else:
            tensors[ent["index"]] = torch.cat(parts, dim=ent["dim"])
