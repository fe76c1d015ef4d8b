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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cfrun.contract.manifest import FORMAT_VERSION, dumps_json, loads_bounded

__all__ = ["ALIGN_BYTES", "FILE_PAD_BYTES", "FORMAT_VERSION", "MAX_DOC_BYTES", "MAX_NDIM", "MAX_TREE_DEPTH",
           "TensorEntry", "UnsupportedValueError", "check_layout", "decode", "dumps_json",
           "encode", "loads_doc", "plan_layout", "tensor_bytes", "tensor_from_buffer"]

ALIGN_BYTES = 64
FILE_PAD_BYTES = 4096
"""A ``.bin`` written from a snapshot slot is padded to a multiple of this (at least one), as
``cfrun.rank.snapshot.SLOT_ALIGN_BYTES``."""
MAX_DOC_BYTES = 256 << 20
"""Largest ``rank-NNNNN.json`` a reader parses (the tree holds numpy arrays as lists)."""
MAX_TREE_DEPTH = 100
"""Deepest nesting of a rank's JSON document a reader parses (a state is a few levels)."""
MAX_NDIM = 64
"""Most dimensions a stored tensor or array may have."""
MAX_DIM = 1 << 48
"""Largest single dimension a stored tensor or array may have."""
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

_RESERVED = ("__t__", "__tuple__", "__dict__", "__nd__", "__np__")


class UnsupportedValueError(TypeError):
    """A value in the state cannot be stored without pickle (e.g. a lambda or a custom object)."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes live in a ``.bin`` file."""

    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``float32``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the ``.bin`` file, a multiple of ``ALIGN_BYTES``."""
    nbytes: int
    device: str
    """Device the tensor came from, e.g. ``cpu`` or ``cuda:0``."""

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "device": self.device}

    @classmethod
    def from_json(cls, d: Any) -> TensorEntry:
        """A checked entry: known dtype, non-negative bounded shape, ``nbytes`` equal to the
        number of elements times the item size, aligned non-negative offset.

        Raises:
            ValueError: anything else, naming the value.
        """
        if not isinstance(d, dict) or set(d) != {"dtype", "shape", "offset", "nbytes", "device"}:
            raise ValueError(f"tensor entry {str(d)[:120]} does not have exactly the fields "
                             "dtype, shape, offset, nbytes, device")
        dtype, shape, offset, nbytes, device = (d["dtype"], d["shape"], d["offset"],
                                                d["nbytes"], d["device"])
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ValueError(f"dtype {str(dtype)[:40]!r} is not one cfrun stores "
                             f"({', '.join(sorted(_DTYPES))})")
        shape_t = _check_shape(shape)
        if type(offset) is not int or offset < 0 or offset % ALIGN_BYTES:
            raise ValueError(f"offset {offset!r} is not a non-negative multiple of "
                             f"{ALIGN_BYTES}")
        expected = math.prod(shape_t) * _DTYPES[dtype].itemsize
        if type(nbytes) is not int or nbytes != expected:
            raise ValueError(f"nbytes {nbytes!r} is not {expected} (shape {list(shape_t)} of "
                             f"{dtype})")
        if not isinstance(device, str) or len(device) > 64:
            raise ValueError(f"device {str(device)[:80]!r} is not a device name")
        return cls(dtype, shape_t, offset, nbytes, device)


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
            type(x) is int and 0 <= x <= MAX_DIM for x in shape):
        raise ValueError(f"shape {str(shape)[:120]} is not a list of at most {MAX_NDIM} "
                         f"integers in [0, {MAX_DIM}]")
    return tuple(shape)


def check_layout(entries: list[TensorEntry], file_bytes: int) -> None:
    """The tensors lie where the writer (:func:`plan_layout`) puts them: in table order, each at
    the next aligned offset after the previous one (so no two overlap), and the ``.bin`` file is
    exactly as long as a writer makes it (``file_bytes``: the manifest's size, checked before
    the file is read): the table's end, or that rounded up to :data:`FILE_PAD_BYTES` (the
    agent writes whole snapshot slots).

    Raises:
        ValueError: an entry elsewhere, or a file of another size, naming it.
    """
    expected = 0
    for i, e in enumerate(entries):
        if e.offset != expected:
            raise ValueError(f"tensor {i} at offset {e.offset}, the writer puts it at {expected}")
        end = e.offset + e.nbytes
        if end > file_bytes:
            raise ValueError(f"tensor {i} ends at byte {end}, the shard file has {file_bytes}")
        expected = (end + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
    padded = max(FILE_PAD_BYTES, -(-expected // FILE_PAD_BYTES) * FILE_PAD_BYTES)
    if file_bytes not in (expected, padded):
        raise ValueError(f"the shard file has {file_bytes} bytes, its tensor table {expected} "
                         f"(padded: {padded})")


def loads_doc(raw: bytes | bytearray) -> dict[str, Any]:
    """Parse a rank's ``rank-NNNNN.json`` document, bounded (:data:`MAX_DOC_BYTES`,
    :data:`MAX_TREE_DEPTH`) before it is parsed (``inf``/``NaN`` kept: they are user values).

    Raises:
        ValueError: oversized, too deep, not JSON, or not an object with ``tree`` and
            ``tensors`` (a list).
    """
    doc = loads_bounded(raw, max_bytes=MAX_DOC_BYTES, max_depth=MAX_TREE_DEPTH, allow_nan=True)
    if not isinstance(doc, dict) or "tree" not in doc or not isinstance(doc.get("tensors"), list):
        raise ValueError("not a shard document (an object with tree and tensors)")
    if doc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"shard format_version {str(doc.get('format_version'))[:20]!r}, this "
                         f"cfrun reads {FORMAT_VERSION}")
    if not isinstance(doc.get("meta", {}), dict):
        raise ValueError("shard meta is not an object")  # noqa: TRY004 (the loader's contract)
    return doc


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
        return obj if type(obj) in (int, float) else (int(obj) if isinstance(obj, int) else float(obj))
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
        shape, data = _check_shape(tree["shape"]), tree["data"]
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
