"""DTensor state (FSDP2's ``fully_shard``, tensor parallelism, 2-D meshes), checkpointed as it
lies (issue 25, item 1; DESIGN.md §7).

A DTensor is a rank's *local* tensor plus where it lies in the global one: the device mesh, one
placement per mesh dimension (``Shard(d)``, ``Replicate()``, ...), the global shape and stride.
Each rank of a sharded job already holds a distinct part of the state, so each rank snapshots and
persists its own local shards whole: no all-gather, no full state dict, the host memory a
checkpoint costs a rank is its local shards' bytes. (With DDP every rank holds the same state and
persists 1/N of it, :mod:`cfrun.codec.sharding`.)

* :func:`placement_meta` (each rank, at the checkpoint boundary, through
  :func:`cfrun.codec.format.encode`): the JSON metadata stored beside the local tensor, under the
  ``__dt__`` tag: ``mesh`` (the mesh's global ranks, nested as the mesh), ``dims`` (its
  dimension names or None), ``placements``, ``shape`` and ``stride`` (global), ``offset`` (the
  local shard's offset in the global tensor; for resharding and export).
* :class:`LocalShard` (what :func:`cfrun.codec.format.decode` returns for that tag): the local
  tensor and its checked metadata.
* :func:`to_dtensors` (each rank, at the resume, before anything is applied): rebuilds the
  DTensors on the live job's device meshes (``DTensor.from_local``, no communication); a mesh
  the live job does not have (another world size, another layout) is a job mismatch.

Idea: torch.distributed.checkpoint's sharded state dicts (each rank saves its local shards with
their chunk metadata), without DCP's planning collectives on the training process group.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

_KINDS = ("shard", "replicate", "partial", "strided_shard")
"""Placements cfrun stores, by name."""
_REDUCE_OPS = ("sum", "avg", "max", "min", "product")
_ARITY = {"shard": 2, "replicate": 1, "partial": 2, "strided_shard": 3}
"""The length of each kind's stored form (:func:`_placement_json`)."""


def dtensor_class() -> Any:
    """``torch.distributed.tensor.DTensor`` if the process imported it (a script with DTensors
    did), else None; never imports it (a plain job pays nothing)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(obj: Any) -> bool:
    """``obj`` is a DTensor (a parameter made one by FSDP2 or TP counts)."""
    cls = dtensor_class()
    return cls is not None and isinstance(obj, cls)


def local_of(t: Any) -> torch.Tensor:
    """The rank's local tensor of the DTensor ``t``: the very tensor the DTensor wraps (the
    same object at every call, so the snapshot copies the live shard and may do so after the
    boundary, as for a plain parameter), never a copy or a gather."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    with torch.no_grad():
        return t.to_local()


def _placement_json(p: Any) -> list[Any]:
    name = type(p).__name__
    if name == "_StridedShard":
        return ["strided_shard", int(p.dim), int(p.split_factor)]
    if name == "Shard":
        return ["shard", int(p.dim)]
    if name == "Replicate":
        return ["replicate"]
    if name == "Partial":
        return ["partial", str(p.reduce_op)]
    raise ValueError(f"DTensor placement {p!r} is not one cfrun stores")


_META_CACHE: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}
"""(mesh id, placements, shape, stride) -> (the mesh, its metadata): a DTensor's placement is
the same at every checkpoint, and computing it (the mesh's ranks, the local offset) costs about
250 us a tensor, 150 ms at each boundary for 600 parameters and moments; the key about 2 us."""
_META_CACHE_MAX = 1 << 16


def placement_meta(t: Any) -> dict[str, Any]:
    """The JSON metadata that places the local shard of the DTensor ``t`` again (see the
    module doc). Any rank, at the boundary (training thread); no communication. Cached by
    mesh, placements, shape and stride (:data:`_META_CACHE`); the dict returned is shared:
    callers must not change it.

    Raises:
        ValueError: a placement cfrun does not store (a custom one).
    """
    mesh = t.device_mesh
    placements = tuple(t.placements)
    key = (id(mesh), placements, tuple(t.shape), t.stride())
    hit = _META_CACHE.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    if len(_META_CACHE) >= _META_CACHE_MAX:
        _META_CACHE.clear()
    meta = _placement_meta(t, mesh, placements)
    _META_CACHE[key] = (mesh, meta)
    return meta


def _placement_meta(t: Any, mesh: Any, placements: tuple[Any, ...]) -> dict[str, Any]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    return {"mesh": mesh.mesh.tolist(),
            "dims": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "placements": [_placement_json(p) for p in placements],
            "shape": [int(s) for s in t.shape], "stride": [int(s) for s in t.stride()],
            "offset": [int(o) for o in offset]}


@dataclasses.dataclass
class LocalShard:
    """A rank's stored local shard of a DTensor, as decoded from a checkpoint (before the live
    mesh is known): :func:`to_dtensors` turns it back into a DTensor."""

    local: torch.Tensor
    """The rank's local tensor, as it was at the checkpoint."""
    meta: dict[str, Any]
    """:func:`placement_meta`'s fields, checked by :func:`check_meta`."""
    parts: list[LocalShard] | None = None
    """A resume on another world size (:mod:`cfrun.codec.reshard`): every old rank's shard of
    this tensor, from which :func:`reshard_local` cuts this rank's new one; None otherwise."""
    load: Callable[[], torch.Tensor] | None = None
    """Another old rank's shard not read yet (:attr:`local` is then a ``meta`` tensor of its
    dtype and shape): reads its bytes, called by :func:`reshard_local` only where it overlaps
    the new shard."""

    @property
    def shape(self) -> torch.Size:
        """The global shape (what the live DTensor's ``shape`` is compared with)."""
        return torch.Size(self.meta["shape"])

    @property
    def dtype(self) -> torch.dtype:
        """The local tensor's dtype (a DTensor's)."""
        return self.local.dtype


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"DTensor {what} {str(value)[:60]} is not a list of ints >= 0")
    return value


def check_meta(meta: Any, local: torch.Tensor | None = None) -> dict[str, Any]:
    """``meta`` is :func:`placement_meta`'s form (a checkpoint's data is checked beyond its
    checksum, DESIGN.md §9); returns it. Each placement's dimension is one of the shape's
    (a bad one made DTensor's own code raise past the refusal: issue 32, finding 6), and
    ``local`` (the stored shard) has the shape's dimensions and lies inside it at ``offset``
    (unless a placement is ``strided_shard``, whose shard is no one block).

    Raises:
        ValueError: the first field that is not.
    """
    if not isinstance(meta, dict):
        raise ValueError("DTensor metadata is not an object")
    try:
        mesh = torch.tensor(meta.get("mesh"))  # nested lists of ints, or this raises
    except (TypeError, ValueError, RuntimeError):
        mesh = torch.empty(0)
    if mesh.dtype != torch.int64 or mesh.dim() < 1 or mesh.numel() < 1:
        raise ValueError(f"DTensor mesh {str(meta.get('mesh'))[:60]} is not ranks")
    dims = meta.get("dims")
    if dims is not None and (not isinstance(dims, list) or len(dims) != mesh.dim()
                             or not all(isinstance(d, str) for d in dims)):
        raise ValueError(f"DTensor mesh dimension names {str(dims)[:60]} do not fit the mesh")
    placements = meta.get("placements")
    if not isinstance(placements, list) or len(placements) != mesh.dim():
        raise ValueError("DTensor placements do not fit the mesh")
    shape = _ints(meta.get("shape"), "shape")
    for p in placements:
        if not isinstance(p, list) or not p or p[0] not in _KINDS or len(p) != _ARITY[p[0]]:
            raise ValueError(f"DTensor placement {str(p)[:40]} is not one cfrun stores")
        if p[0] in ("shard", "strided_shard") and not (type(p[1]) is int
                                                       and 0 <= p[1] < len(shape)):
            raise ValueError(f"DTensor placement {str(p)[:40]} names no dimension of its "
                             f"shape {shape[:8]}")
        if p[0] == "strided_shard" and not (type(p[2]) is int and p[2] >= 1):
            raise ValueError(f"DTensor placement {str(p)[:40]} has no split factor >= 1")
        if p[0] == "partial" and p[1] not in _REDUCE_OPS:
            raise ValueError(f"DTensor partial reduce op {str(p[1])[:20]} is not one of "
                             f"{_REDUCE_OPS}")
    for key in ("stride", "offset"):
        if len(_ints(meta.get(key), key)) != len(shape):
            raise ValueError(f"DTensor {key} does not fit its shape {shape}")
    strided = any(p[0] == "strided_shard" for p in placements)  # no one block: no offset
    if local is not None and (local.dim() != len(shape) or not strided and any(
            o + n > s for o, n, s in zip(meta["offset"], local.shape, shape))):
        raise ValueError(f"DTensor shard {list(local.shape)[:8]} at {meta['offset'][:8]} lies "
                         f"outside its shape {shape[:8]}")
    return meta


def _placement(p: list[Any]) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    kind = p[0]
    if kind == "replicate":
        return Replicate()
    if kind == "partial":
        if p[1] not in _REDUCE_OPS:
            raise ValueError(f"DTensor partial reduce op {str(p[1])[:20]} is not one of "
                             f"{_REDUCE_OPS}")
        return Partial(p[1])
    if type(p[1]) is not int:
        raise ValueError(f"DTensor placement {str(p)[:40]} names no dimension")
    if kind == "shard":
        return Shard(p[1])
    return _StridedShard(p[1], split_factor=int(p[2]))


def live_meshes(objects: list[Any]) -> dict[tuple[Any, ...], Any]:
    """The device meshes of the live DTensors among ``objects`` (modules: their parameters and
    buffers; optimizers: their parameters), by :func:`mesh_key`. Training thread."""
    out: dict[tuple[Any, ...], Any] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            tensors: list[Any] = [*obj.parameters(), *obj.buffers()]
        else:
            tensors = [p for g in getattr(obj, "param_groups", ()) for p in g["params"]]
        for t in tensors:
            if is_dtensor(t):
                mesh = t.device_mesh
                names = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
                out.setdefault(mesh_key(mesh.mesh.tolist(), names), mesh)
    return out


def mesh_key(ranks: Any, names: list[str] | None) -> tuple[Any, ...]:
    """A mesh's identity: its global ranks (nested as the mesh) and dimension names."""
    return (repr(ranks), tuple(names) if names is not None else None)


class MeshMismatchError(ValueError):
    """A stored shard's mesh is not one of the live job's (another world size or layout)."""


def to_dtensors(tree: Any, meshes: dict[tuple[Any, ...], Any]) -> Any:
    """``tree`` with every :class:`LocalShard` made a DTensor again on the live mesh of the
    same ranks and dimension names (``DTensor.from_local`` with the stored placements, global
    shape and stride; no communication, the local tensor itself is wrapped). Each rank, at the
    resume, before the state is checked against the live job and applied.

    Raises:
        MeshMismatchError: a shard's mesh is not among ``meshes`` (names the mesh).
    """
    if isinstance(tree, LocalShard):
        meta = tree.meta
        mesh = meshes.get(mesh_key(meta["mesh"], meta["dims"]))
        if tree.parts is not None:
            return reshard_local(tree, _mesh_like(meta, meshes))
        if mesh is None:
            raise MeshMismatchError(
                f"a DTensor was saved on the device mesh {meta['mesh']} "
                f"(dimensions {meta['dims']}), which the live job does not have")
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(tree.local, mesh, [_placement(p) for p in meta["placements"]],
                                  run_check=False, shape=torch.Size(meta["shape"]),
                                  stride=tuple(meta["stride"]))
    if isinstance(tree, dict):
        return {k: to_dtensors(v, meshes) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_dtensors(v, meshes) for v in tree]
    if isinstance(tree, tuple):
        return tuple(to_dtensors(v, meshes) for v in tree)
    return tree


def _mesh_like(meta: dict[str, Any], meshes: dict[tuple[Any, ...], Any]) -> Any:
    """The live mesh that takes the place of a stored shard's mesh on another world size: the
    one with the same dimension names (or, unnamed, the only one of as many dimensions).

    Raises:
        MeshMismatchError: none, or more than one, fits.
    """
    ndim = len(meta["placements"])
    fits = [m for (ranks, names), m in meshes.items()
            if m.ndim == ndim and (names == (tuple(meta["dims"]) if meta["dims"] else None))]
    if len(fits) != 1:
        raise MeshMismatchError(
            f"a DTensor was saved on a mesh of dimensions {meta['dims']} "
            f"({len(meta['mesh'])} ranks along the first), and the live job has "
            f"{'no' if not fits else len(fits)} such mesh to reshard it onto")
    return fits[0]


def reshard_local(shard: LocalShard, mesh: Any) -> Any:
    """The DTensor of this rank on the live ``mesh`` (another world size) with the stored
    placements, global shape and stride, its local tensor cut from every old rank's shard
    (:attr:`LocalShard.parts`) by their global offsets: only the blocks that overlap this
    rank's new one are copied (``compute_local_shape_and_global_offset`` gives it, as FSDP2
    and DTensor place it). Each rank at a resharded resume; no communication.

    Raises:
        MeshMismatchError: a placement is ``strided_shard`` (FSDP2 over tensor parallelism)
            or ``partial``, or the old shards do not cover the new one.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    meta, parts = shard.meta, shard.parts or []
    kinds = {p[0] for part in parts for p in part.meta["placements"]}
    if kinds & {"strided_shard", "partial"}:
        raise MeshMismatchError(f"a DTensor placed {meta['placements']} cannot be resharded "
                                "from its shards (FSDP2 over tensor parallelism, or a "
                                "partial sum); resume on the world size it was written with")
    placements = [_placement(p) for p in meta["placements"]]
    shape = torch.Size(meta["shape"])
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    if math.prod(local_shape) > sum(part.local.numel() for part in parts):  # before allocating
        raise MeshMismatchError(f"the old ranks' shards do not cover this rank's new shard of "
                                f"a DTensor of shape {list(shape)[:8]}")
    local = torch.empty(local_shape, dtype=shard.local.dtype)
    covered = torch.zeros(local_shape, dtype=torch.bool)
    for part in parts:
        if part.meta["shape"] != meta["shape"] or part.local.dtype != local.dtype:
            raise MeshMismatchError(f"the old ranks' shards of one DTensor disagree: "
                                    f"{meta['shape']} and {part.meta['shape']}")
        src, dst = [], []
        for o_new, n_new, o_old, n_old in zip(offset, local_shape, part.meta["offset"],
                                               part.local.shape):
            lo, hi = max(o_new, o_old), min(o_new + n_new, o_old + n_old)
            if hi <= lo:
                break
            src.append(slice(lo - o_old, hi - o_old))
            dst.append(slice(lo - o_new, hi - o_new))
        else:
            old = part.local
            if old.is_meta and part.load is not None:
                old = part.load()  # read now, only because it overlaps; freed after the copy
                if old.shape != part.local.shape or old.dtype != part.local.dtype:
                    raise MeshMismatchError("an old rank's shard read back with another shape")
            local[tuple(dst)] = old[tuple(src)]
            covered[tuple(dst)] = True
    if local.numel() and not bool(covered.all()):
        raise MeshMismatchError(f"the old ranks' shards do not cover this rank's new shard of "
                                f"a DTensor of shape {list(shape)}")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=tuple(meta["stride"]))


def has_shards(tree: Any) -> bool:
    """``tree`` holds a :class:`LocalShard` (a checkpoint of a sharded job)."""
    if isinstance(tree, LocalShard):
        return True
    if isinstance(tree, dict):
        return any(has_shards(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(has_shards(v) for v in tree)
    return False


def gather_full(parts: list[Any]) -> Any:
    """The full tensor of one DTensor from every rank's :class:`LocalShard` of it, placed by
    each shard's global offset (``cfrun export``: one process, offline; the only place cfrun
    builds a full tensor from shards). A replicated block held by several ranks is the same
    bytes on each, written once per holder.

    Raises:
        ValueError: the shards disagree on the global shape or dtype, a placement is
            ``strided_shard`` (a local shard that is not one block of the global tensor: FSDP2
            over tensor parallelism) or ``partial`` (not yet reduced), or the shards do not
            cover the tensor.
    """
    first = parts[0]
    shape, dtype = first.meta["shape"], first.local.dtype
    if math.prod(shape) > sum(part.local.numel() for part in parts):  # before allocating
        raise ValueError(f"the ranks' shards do not cover a DTensor of shape {shape[:8]}")
    full = torch.empty(shape, dtype=dtype)
    covered = torch.zeros(shape, dtype=torch.bool)
    for part in parts:
        kinds = {p[0] for p in part.meta["placements"]}
        if kinds & {"strided_shard", "partial"}:
            raise ValueError(f"a DTensor placed {part.meta['placements']} cannot be exported "
                             "from its shards alone (FSDP2 over tensor parallelism, or a "
                             "partial sum)")
        if part.meta["shape"] != shape or part.local.dtype != dtype:
            raise ValueError(f"the ranks' shards of one DTensor disagree: {shape} "
                             f"{dtype} and {part.meta['shape']} {part.local.dtype}")
        index = tuple(slice(o, o + n) for o, n in zip(part.meta["offset"], part.local.shape))
        full[index] = part.local
        covered[index] = True
    if not bool(covered.all()):
        raise ValueError(f"the ranks' shards do not cover a DTensor of shape {shape}")
    return full
