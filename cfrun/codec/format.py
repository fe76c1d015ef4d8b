"""The checkpoint format: a JSON tree with tensors stored as raw bytes beside it. No pickle.

A rank's state (nested dicts/lists/tuples of Python scalars, numpy arrays and tensors) becomes

* ``rank-NNNNN.json``: the tree, with every tensor replaced by ``{"__t__": i}``, plus a table of
  tensors (dtype, shape, byte offset, byte count), and
* ``rank-NNNNN.bin``: the tensors' bytes, each at a 64-byte aligned offset, in table order.

Loading parses JSON and reinterprets bytes (``torch.frombuffer``); it never runs code from the file,
unlike ``torch.load`` without ``weights_only`` (DESIGN.md §9). ``manifest.json`` (written last)
lists every file with its size and xxh3-64 checksum; a checkpoint without a valid manifest does not
exist. Idea: DeepFreeze §IV-A ("lightweight, label-free serialization"); safetensors' layout.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from cfrun.contract.manifest import FORMAT_VERSION, dumps_json
from cfrun.contract.shard import (
    ALIGN_BYTES,
    DTYPE_ITEMSIZE,
    FILE_PAD_BYTES,
    MAX_DIM,
    MAX_DOC_BYTES,
    MAX_NDIM,
    MAX_TREE_DEPTH,
    TensorEntry,
    check_layout,
    check_shape,
    loads_doc,
)

__all__ = ["ALIGN_BYTES", "DTYPE_ITEMSIZE", "FILE_PAD_BYTES", "FORMAT_VERSION", "MAX_DIM",
           "MAX_DOC_BYTES", "MAX_NDIM", "MAX_TREE_DEPTH", "TensorEntry", "UnsupportedValueError",
           "check_layout", "decode", "dumps_json", "encode", "loads_doc", "meta_tensor",
           "plan_layout", "tensor_bytes", "tensor_from_buffer"]

_NP_KINDS = "biuf"

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)
if any(DTYPE_ITEMSIZE.get(k) != d.itemsize for k, d in _DTYPES.items()):  # pragma: no cover
    raise ImportError("cfrun.contract.shard.DTYPE_ITEMSIZE disagrees with this torch")

_RESERVED = ("__t__", "__tuple__", "__dict__", "__nd__", "__np__")


class UnsupportedValueError(TypeError):
    """A value in the state cannot be stored without pickle (e.g. a lambda or a custom object)."""


def encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Turn ``obj`` into a JSON-able tree, appending its tensors to ``tensors``.

    Tuples, dicts with non-string keys and numpy values are tagged so :func:`decode` rebuilds
    them with their types. Tensors are referenced by index and not copied here.

    Raises:
        UnsupportedValueError: ``obj`` holds something else (functions, custom objects...).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"__t__": len(tensors) - 1}
    if isinstance(obj, np.generic):
        if obj.dtype.kind not in "biuf":
            raise UnsupportedValueError(f"numpy {obj.dtype} values are not supported")
        return {"__np__": obj.dtype.str, "v": obj.item()}
    if isinstance(obj, (int, float)):
        if type(obj) in (int, float):
            return obj
        return int(obj) if isinstance(obj, int) else float(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise UnsupportedValueError(f"numpy {obj.dtype} arrays are not supported")
        return {"__nd__": obj.dtype.str, "shape": list(obj.shape), "data": obj.ravel().tolist()}
    if isinstance(obj, list):
        return [encode(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _RESERVED for k in obj):
            return {k: encode(v, tensors) for k, v in obj.items()}
        return {"__dict__": [[encode(k, tensors), encode(v, tensors)] for k, v in obj.items()]}
    raise UnsupportedValueError(f"cannot store a {type(obj).__name__} without pickle")


def decode(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`encode`.

    Raises:
        ValueError, TypeError, IndexError, KeyError: a tree :func:`encode` does not write (a
            tensor index out of range, a numpy dtype outside ``biuf``, data that does not fill
            its shape...); the loader reports any of them as a corrupt checkpoint.
    """
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__t__" in tree and len(tree) == 1:
        i = tree["__t__"]
        if type(i) is not int or not 0 <= i < len(tensors):
            raise IndexError(f"tensor reference {str(i)[:20]} is not one of {len(tensors)}")
        return tensors[i]
    if "__tuple__" in tree and len(tree) == 1:
        return tuple(decode(v, tensors) for v in tree["__tuple__"])
    if "__dict__" in tree and len(tree) == 1:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in tree["__dict__"]}
    if "__nd__" in tree:
        dtype = _np_dtype(tree["__nd__"])
        shape, data = check_shape(tree["shape"]), tree["data"]
        if not isinstance(data, list) or len(data) != math.prod(shape):
            raise ValueError(f"numpy array data does not fill its shape {list(shape)}")
        return np.array(data, dtype=dtype).reshape(shape)
    if "__np__" in tree:
        return _np_dtype(tree["__np__"]).type(tree["v"])
    return {k: decode(v, tensors) for k, v in tree.items()}


def _np_dtype(name: Any) -> np.dtype[Any]:
    """A numpy dtype of kind bool/int/uint/float from its ``dtype.str`` (e.g. ``<f8``)."""
    if not isinstance(name, str) or len(name) > 8:
        raise ValueError(f"numpy dtype {str(name)[:20]!r} is not a dtype string")
    dtype = np.dtype(name)
    if dtype.kind not in _NP_KINDS or dtype.itemsize > 16:
        raise ValueError(f"numpy dtype {name!r} is not one cfrun stores (kinds {_NP_KINDS})")
    return dtype


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def plan_layout(tensors: list[torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Assign each tensor an aligned byte range. Returns the entries and the total bytes."""
    entries = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset,
                                   nbytes, str(t.device)))
        offset += (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
    return entries, offset


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 CPU view (or copy) of ``t``'s elements in row-major order."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def tensor_from_buffer(buf: memoryview | bytearray | bytes, entry: TensorEntry) -> torch.Tensor:
    """A fresh CPU tensor holding ``entry``'s bytes from ``buf`` (copied, so ``buf`` may go).

    Raises:
        ValueError: unknown dtype, ``nbytes`` other than elements times item size, or a byte
            range outside ``buf``.
    """
    dtype = _DTYPES.get(entry.dtype)
    if dtype is None:
        raise ValueError(f"unknown dtype {entry.dtype!r} in checkpoint")
    if entry.nbytes != math.prod(entry.shape) * dtype.itemsize:
        raise ValueError(f"nbytes {entry.nbytes} does not hold shape {list(entry.shape)} of "
                         f"{entry.dtype}")
    if entry.offset < 0 or entry.offset + entry.nbytes > len(buf):
        raise ValueError("tensor bytes lie outside the shard file")
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
    return raw.clone().view(dtype).reshape(entry.shape)


def meta_tensor(entry: TensorEntry) -> torch.Tensor:
    """A tensor of ``entry``'s dtype and shape on the ``meta`` device: no bytes allocated or
    read. Lets a rank decode another rank's tree and check its structure for the cost of its
    JSON (:func:`cfrun.codec.checkpoint.check_usable`).

    Raises:
        ValueError: unknown dtype.
    """
    dtype = _DTYPES.get(entry.dtype)
    if dtype is None:
        raise ValueError(f"unknown dtype {entry.dtype!r} in checkpoint")
    return torch.empty(entry.shape, dtype=dtype, device="meta")
