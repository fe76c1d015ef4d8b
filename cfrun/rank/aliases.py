"""Script variables that alias the live model and optimizer (issue 34, item 1).

``sd = model.state_dict()`` holds detached views of the parameters and buffers; ``views =
[p.detach().view(-1) for p in model.parameters()]``, ``row = model.fc.weight[1]`` and an
optimizer's ``state_dict()`` (its moments are the optimizer's own tensors) do too. Stored as
values, such a variable would come back after a resume as a copy of the checkpoint's step, and
then stay there while the model trains on (the script's ``torch.save(sd, ...)`` at its end
saved stale weights). Instead, at a checkpoint, a tensor of a script variable that shares its
storage with a tensor of the live models (their ``state_dict(keep_vars=True)``: parameters and
buffers), of the optimizers' parameters (fp32 master weights no module owns) or of their
per-parameter state is stored as a :class:`cfrun.codec.format.TensorAlias`: which tensor, and
where it lies in that tensor's storage (byte offset, shape, stride, dtype), whether it
required grad. At the resume, once the models and optimizers are loaded, it becomes the same
view of the restored tensor (:meth:`AliasIndex.place`); the very tensor object (an optimizer's
``exp_avg`` held in a variable, a buffer) becomes the restored object itself. A copy the
script made (``.clone()``, ``copy.deepcopy(model.state_dict())``) has storage of its own and
is stored as values.

A captured tensor whose storage is larger than the tensor itself, or shared with another
captured tensor, aliases something cfrun does not know: it is stored as values, marked
``shared`` (:func:`cfrun.rank.frames.capture_frames`: named at the checkpoint when the loops
assign it; the resume keeps the restarted script's own value when it holds the same bits).
"""

from __future__ import annotations

from typing import Any

import torch

from cfrun.codec.dtensor import is_dtensor
from cfrun.codec.format import _DTYPES, TensorAlias

Ref = tuple[str | int, ...]
StorageKey = tuple[str, int]

def storage_key(t: torch.Tensor) -> StorageKey | None:
    """``(device, data pointer)`` of ``t``'s storage: equal for two tensors that share it;
    None for a tensor without one of its own to compare (sparse, meta, a DTensor, empty)."""
    if t.layout is not torch.strided or t.device.type == "meta" or is_dtensor(t):
        return None
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
    except (RuntimeError, NotImplementedError):  # a functional or wrapper subclass
        return None
    return (str(t.device), ptr) if ptr and nbytes else None


def is_partial_view(t: torch.Tensor) -> bool:
    """``t`` uses only part of its storage (a slice, a row: what else lies there is held by
    some other tensor)."""
    try:
        return t.untyped_storage().nbytes() > t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):
        return False


class AliasIndex:
    """The live models' and optimizers' tensors by object, by storage and by reference.

    ``roots``: the models (:meth:`cfrun.rank.discovery.Discovery.model_roots`), ``opts``: the
    optimizers, in the order the checkpoint stores them; ``sds``: the models'
    ``state_dict(keep_vars=True)`` if the caller has them. Training thread; built at a
    checkpoint (capture: about 2 ms for 600 tensors, only when a script variable holds a
    tensor) or at the resume once the state is loaded (placement)."""

    def __init__(self, roots: list[torch.nn.Module], opts: list[torch.optim.Optimizer],
                 sds: list[Any] | None = None) -> None:
        self._by_ref: dict[Ref, torch.Tensor] = {}
        self._by_id: dict[int, Ref] = {}
        self._by_storage: dict[StorageKey, Ref] = {}
        if sds is None:
            sds = [m.state_dict(keep_vars=True) for m in roots]
        for i, sd in enumerate(sds):
            for key, t in sd.items():
                if isinstance(t, torch.Tensor):
                    self._add(("model", i, key), t)
        for j, o in enumerate(opts):
            flat = [p for g in o.param_groups for p in g["params"]]
            for k, p in enumerate(flat):
                self._add(("param", j, k), p)
                state = o.state.get(p)
                if isinstance(state, dict):
                    for key, v in state.items():
                        if isinstance(key, str) and isinstance(v, torch.Tensor):
                            self._add(("opt", j, k, key), v)

    def _add(self, ref: Ref, t: torch.Tensor) -> None:
        if is_dtensor(t):
            return
        self._by_ref.setdefault(ref, t)
        self._by_id.setdefault(id(t), ref)  # a tied weight: its first name
        key = storage_key(t)
        if key is not None:
            self._by_storage.setdefault(key, ref)

    def alias_of(self, t: torch.Tensor) -> TensorAlias | None:
        """``t`` as an alias of a known tensor, or None if it shares storage with none."""
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            return None
        ref = self._by_id.get(id(t))
        if ref is not None and self._by_ref[ref] is t:
            return TensorAlias(ref, dtype, tuple(t.shape), tuple(t.stride()), 0,
                               t.requires_grad, True)
        key = storage_key(t)
        ref = self._by_storage.get(key) if key is not None else None
        if ref is None:
            return None
        base = self._by_ref[ref]
        offset = int(t.storage_offset()) * t.element_size() \
            - int(base.storage_offset()) * base.element_size()
        return TensorAlias(ref, dtype, tuple(t.shape), tuple(t.stride()), offset,
                           t.requires_grad, False)

    def place(self, alias: TensorAlias) -> torch.Tensor:
        """The live tensor ``alias`` names (``same``) or the view of it it describes: the same
        byte offset from its storage offset, shape, stride and dtype; with its graph when it
        required grad (``as_strided`` of the parameter), detached otherwise.

        Raises:
            ValueError: the tensor it names is not there, or the view does not fit it.
        """
        base = self._by_ref.get(alias.ref)
        if base is None:
            raise ValueError(f"it aliases {_ref_name(alias.ref)}, which the restored job lacks")
        dtype = _DTYPES[alias.dtype]
        if alias.same:
            if base.dtype != dtype or tuple(base.shape) != alias.shape:
                raise ValueError(f"{_ref_name(alias.ref)} is now {base.dtype} "
                                 f"{tuple(base.shape)}, not {dtype} {alias.shape}")
            return base
        start = base.storage_offset() * base.element_size() + alias.offset
        if start < 0 or start % dtype.itemsize:
            raise ValueError(f"its offset in {_ref_name(alias.ref)} is not one of a {dtype}")
        try:
            if dtype == base.dtype:
                with torch.set_grad_enabled(alias.grad and base.requires_grad):
                    src = base if alias.grad else base.detach()
                    return src.as_strided(alias.shape, alias.stride, start // dtype.itemsize)
            out = torch.empty(0, dtype=dtype, device=base.device)
            return out.set_(base.untyped_storage(), start // dtype.itemsize, alias.shape,
                            alias.stride)
        except RuntimeError as e:  # out of the storage's bounds
            raise ValueError(f"its view no longer fits {_ref_name(alias.ref)} ({e})") from e


def _ref_name(ref: Ref) -> str:
    """A reference in the user's terms: ``model0.fc.weight``, ``optimizer0.param[3]``,
    ``optimizer0.state[3].exp_avg``."""
    if ref[0] == "model":
        return f"model{ref[1]}.{ref[2]}"
    if ref[0] == "param":
        return f"optimizer{ref[1]}.param[{ref[2]}]"
    return f"optimizer{ref[1]}.state[{ref[2]}].{ref[3] if len(ref) > 3 else '?'}"

