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

import collections
import dataclasses
import datetime
import enum
import math
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cfrun.codec.dtensor import LocalShard, check_meta, is_dtensor, local_of, placement_meta
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
           "MAX_DOC_BYTES", "MAX_NDIM", "MAX_TREE_DEPTH", "TensorAlias", "TensorEntry", "TypeRef",
           "UnsupportedValueError", "check_layout", "decode", "dumps_json", "encode",
           "has_aliases", "loads_doc", "meta_tensor", "plan_layout", "resolve", "tensor_bytes",
           "tensor_from_buffer"]

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

_RESERVED = ("__t__", "__dt__", "__tuple__", "__dict__", "__nd__", "__np__", "__enum__",
             "__nt__", "__dc__", "__coll__", "__time__", "__path__", "__alias__")

_FACTORIES: dict[str, type] = {t.__name__: t for t in (list, int, float, dict, str, tuple)}
"""``defaultdict`` factories stored by name (a lambda or a custom factory is not stored)."""
_PATHS: dict[str, type] = {t.__name__: t for t in (pathlib.PosixPath, pathlib.WindowsPath,
                                                   pathlib.PurePosixPath, pathlib.PureWindowsPath)}
_TIMES: dict[str, type] = {t.__name__: t for t in (datetime.datetime, datetime.date,
                                                   datetime.time, datetime.timedelta)}
_MAX_NAME = 512


@dataclasses.dataclass(frozen=True)
class TypeRef:
    """A decoded value whose type is named by reference (an ``Enum`` member, a ``namedtuple``, a
    dataclass instance): the type is looked up by :func:`resolve` only when the value is put back,
    since a script's own classes do not exist yet when a rank decodes its checkpoint at install.
    ``payload``: the member name, the tuple's items or the fields by name (already decoded)."""

    tag: str
    module: str
    qualname: str
    payload: Any


@dataclasses.dataclass(frozen=True)
class TensorAlias:
    """A tensor of a script variable that shares its storage with a tensor of the live model or
    optimizer (:mod:`cfrun.rank.aliases`), stored as where it lies in that tensor's storage
    instead of its values: put back, it is a view of the restored tensor (or, ``same``, that
    tensor itself), so that ``sd = model.state_dict()`` goes on following the model.

    ``ref``: the tensor it aliases (``["model", i, key]``, ``["param", j, k]``,
    ``["opt", j, k, key]``); ``offset``: its storage offset in bytes from that tensor's;
    ``grad``: it required grad (a view with its graph, not a detached one)."""

    ref: tuple[str | int, ...]
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    grad: bool
    same: bool

    def to_json(self) -> dict[str, Any]:
        return {"ref": list(self.ref), "dtype": self.dtype, "shape": list(self.shape),
                "stride": list(self.stride), "offset": self.offset, "grad": self.grad,
                "same": self.same}

    @classmethod
    def from_json(cls, d: Any) -> TensorAlias:
        """Raises:
            ValueError: a tree :meth:`to_json` does not write."""
        if not isinstance(d, dict) or set(d) != {"ref", "dtype", "shape", "stride", "offset",
                                                 "grad", "same"}:
            raise ValueError("a tensor alias is not {ref, dtype, shape, stride, offset, ...}")
        ref, shape, stride = d["ref"], d["shape"], d["stride"]
        if not (isinstance(ref, list) and 0 < len(ref) <= 4
                and all(type(r) in (int, str) and len(str(r)) <= _MAX_NAME for r in ref)):
            raise ValueError(f"tensor alias reference {str(ref)[:60]!r} is not one cfrun writes")
        if d["dtype"] not in _DTYPES or not isinstance(stride, list) \
                or not all(type(n) is int for n in stride) or type(d["offset"]) is not int \
                or type(d["grad"]) is not bool or type(d["same"]) is not bool:
            raise ValueError("a tensor alias's dtype, stride, offset or flags")
        shape = check_shape(shape)
        if len(stride) != len(shape):
            raise ValueError("a tensor alias's stride does not match its shape")
        return cls(tuple(ref), d["dtype"], tuple(shape), tuple(stride), d["offset"], d["grad"],
                   d["same"])


class UnsupportedValueError(TypeError):
    """A value in the state cannot be stored without pickle (e.g. a lambda or a custom object)."""


def encode(obj: Any, tensors: list[torch.Tensor], *, typed: bool = False) -> Any:
    """Turn ``obj`` into a JSON-able tree, appending its tensors to ``tensors``.

    Tuples, dicts with non-string keys and numpy values are tagged so :func:`decode` rebuilds
    them with their types. Tensors are referenced by index and not copied here. So are
    ``deque``/``defaultdict``/``Counter``, ``datetime``/``date``/``time``/``timedelta`` and
    ``pathlib`` paths. With ``typed`` (script variables, put back through :func:`resolve`):
    ``OrderedDict`` too, and ``Enum`` members, namedtuples and dataclass instances by reference
    to their type (module, qualified name; see :class:`TypeRef`). Without it a module's
    ``state_dict()`` stays a plain dict, an ``IntEnum`` its int, a namedtuple a tuple. A
    DTensor (FSDP2, tensor parallelism) is its local shard (the tensor it wraps, appended to
    ``tensors``) with its placement metadata (:mod:`cfrun.codec.dtensor`); :func:`decode`
    gives it back as a :class:`~cfrun.codec.dtensor.LocalShard`.

    Raises:
        UnsupportedValueError: ``obj`` holds something else (functions, custom objects...).
    """
    if typed and isinstance(obj, enum.Enum):  # before str/int: StrEnum, IntEnum
        cls = type(obj)
        return {"__enum__": [cls.__module__, cls.__qualname__, obj.name]}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, TensorAlias):
        return {"__alias__": obj.to_json()}
    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):  # its local shard, with the metadata to place it again (issue 25)
            tensors.append(local_of(obj))
            return {"__dt__": len(tensors) - 1, "meta": placement_meta(obj)}
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
    tagged = _encode_typed(obj, tensors, typed)
    if tagged is not None:
        return tagged
    if isinstance(obj, list):
        return [encode(v, tensors, typed=typed) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, tensors, typed=typed) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in _RESERVED for k in obj):
            return {k: encode(v, tensors, typed=typed) for k, v in obj.items()}
        return {"__dict__": [[encode(k, tensors, typed=typed), encode(v, tensors, typed=typed)]
                             for k, v in obj.items()]}
    raise UnsupportedValueError(f"cannot store a {type(obj).__name__} without pickle")


def _encode_typed(obj: Any, tensors: list[torch.Tensor], typed: bool) -> Any:
    """The tagged form of a namedtuple, dataclass instance, ``collections`` container, date/time
    or path; None for anything else (including ``OrderedDict`` unless ``typed``)."""
    cls = type(obj)
    if not typed:  # by reference only for script variables, resolved when put back
        pass
    elif isinstance(obj, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return {"__nt__": [cls.__module__, cls.__qualname__],
                "v": [encode(v, tensors, typed=typed) for v in obj]}
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"__dc__": [cls.__module__, cls.__qualname__],
                "f": {f.name: encode(getattr(obj, f.name), tensors, typed=typed)
                      for f in dataclasses.fields(obj)}}
    if cls is collections.deque:
        return {"__coll__": "deque", "maxlen": obj.maxlen,
                "v": [encode(v, tensors, typed=typed) for v in obj]}
    if cls is collections.defaultdict:
        factory = obj.default_factory
        if factory is not None and _FACTORIES.get(getattr(factory, "__name__", "")) is not factory:
            raise UnsupportedValueError(f"a defaultdict with factory {factory!r} (only "
                                        f"{', '.join(_FACTORIES)} or None are stored)")
        return {"__coll__": "defaultdict", "factory": factory and factory.__name__,
                "v": _pairs(obj, tensors, typed)}
    if cls is collections.Counter or (typed and cls is collections.OrderedDict):
        return {"__coll__": cls.__name__, "v": _pairs(obj, tensors, typed)}
    if cls in (datetime.datetime, datetime.time) and not (
            obj.tzinfo is None or type(obj.tzinfo) is datetime.timezone):
        raise UnsupportedValueError(f"a {cls.__name__} with time zone {obj.tzinfo!r} (only "
                                    "fixed offsets are stored)")
    if cls is datetime.timedelta:
        return {"__time__": "timedelta", "v": [obj.days, obj.seconds, obj.microseconds]}
    if cls in (datetime.datetime, datetime.date, datetime.time):
        return {"__time__": cls.__name__, "v": obj.isoformat(), "fold": getattr(obj, "fold", 0)}
    if _PATHS.get(cls.__name__) is cls:
        return {"__path__": cls.__name__, "v": str(obj)}
    return None


def _pairs(obj: dict[Any, Any], tensors: list[torch.Tensor], typed: bool) -> list[list[Any]]:
    return [[encode(k, tensors, typed=typed), encode(v, tensors, typed=typed)]
            for k, v in obj.items()]


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
    if "__dt__" in tree and set(tree) == {"__dt__", "meta"}:
        local = decode({"__t__": tree["__dt__"]}, tensors)
        return LocalShard(local, check_meta(tree["meta"], local))
    if "__tuple__" in tree and len(tree) == 1:
        return tuple(decode(v, tensors) for v in tree["__tuple__"])
    if "__alias__" in tree and len(tree) == 1:
        return TensorAlias.from_json(tree["__alias__"])
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
    for tag in ("__enum__", "__nt__", "__dc__"):
        if tag in tree:
            return _decode_ref(tag, tree, tensors)
    if "__coll__" in tree:
        return _decode_coll(tree, tensors)
    if "__time__" in tree:
        return _decode_time(tree["__time__"], tree["v"], tree.get("fold", 0))
    if "__path__" in tree:
        cls = _PATHS.get(tree["__path__"]) if isinstance(tree["__path__"], str) else None
        if cls is None or not isinstance(tree["v"], str):
            raise ValueError(f"path type {str(tree['__path__'])[:40]!r} is not one cfrun stores")
        return cls(tree["v"])
    return {k: decode(v, tensors) for k, v in tree.items()}


def _decode_ref(tag: str, tree: dict[str, Any], tensors: list[torch.Tensor]) -> TypeRef:
    """A :class:`TypeRef` from a tagged tree; checks the names' shape only (no lookup here)."""
    names = tree[tag]
    if not (isinstance(names, list) and len(names) == (3 if tag == "__enum__" else 2)
            and all(isinstance(n, str) and 0 < len(n) <= _MAX_NAME for n in names)):
        raise ValueError(f"{tag} reference {str(names)[:60]!r} is not [module, qualname...]")
    if not all(p.isidentifier() for p in names[0].split(".") + names[1].split(".")):
        raise ValueError(f"{tag} reference {names[0]}:{names[1]} is not a module-level type")
    if tag == "__enum__":
        return TypeRef(tag, names[0], names[1], names[2])
    if tag == "__nt__":
        if not isinstance(tree["v"], list):
            raise ValueError("namedtuple items are not a list")
        return TypeRef(tag, names[0], names[1], [decode(v, tensors) for v in tree["v"]])
    if not isinstance(tree["f"], dict):
        raise ValueError("dataclass fields are not an object")
    return TypeRef(tag, names[0], names[1], {k: decode(v, tensors) for k, v in tree["f"].items()})


def _decode_coll(tree: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    kind, items = tree["__coll__"], tree["v"]
    if not isinstance(items, list):
        raise ValueError("collection items are not a list")
    if kind == "deque":
        maxlen = tree.get("maxlen")
        if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
            raise ValueError(f"deque maxlen {str(maxlen)[:20]} is not a count")
        return collections.deque((decode(v, tensors) for v in items), maxlen=maxlen)
    pairs = [(_hashable(decode(k, tensors)), decode(v, tensors)) for k, v in items]
    if kind == "defaultdict":
        name = tree.get("factory")
        factory = None if name is None else _FACTORIES.get(name) if isinstance(name, str) else None
        if name is not None and factory is None:
            raise ValueError(f"defaultdict factory {str(name)[:40]!r} is not one cfrun stores")
        return collections.defaultdict(factory, pairs)
    if kind == "Counter":
        return collections.Counter(dict(pairs))
    if kind == "OrderedDict":
        return collections.OrderedDict(pairs)
    raise ValueError(f"collection {str(kind)[:40]!r} is not one cfrun stores")


def _decode_time(kind: Any, value: Any, fold: Any) -> Any:
    cls = _TIMES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"time type {str(kind)[:40]!r} is not one cfrun stores")
    if cls is datetime.timedelta:
        if not (isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value)):
            raise ValueError("timedelta is not [days, seconds, microseconds]")
        return datetime.timedelta(*value)
    if not isinstance(value, str) or len(value) > 64 or fold not in (0, 1):
        raise ValueError(f"{kind} {str(value)[:40]!r} is not an ISO format string")
    out = cls.fromisoformat(value)  # type: ignore[attr-defined]
    return out.replace(fold=fold) if cls is not datetime.date else out


def resolve(value: Any, aliases: Callable[[TensorAlias], torch.Tensor] | None = None) -> Any:
    """``value`` with each :class:`TypeRef` inside replaced by the object it names, and each
    :class:`TensorAlias` by ``aliases(alias)`` (the view of the live tensor it aliases).

    Called on the training thread when script variables are put back (the script's classes
    exist by then). Types are looked up only among modules already imported in this process
    (``sys.modules``, through their ``__dict__``: no import, no module ``__getattr__``) and must
    be an ``Enum`` (the member by name), a namedtuple (items count checked) or a dataclass
    (exactly its fields; built without calling ``__init__``), so a crafted checkpoint runs no
    code of its choosing.

    Raises:
        ValueError: a type that is missing or not of the kind stored, a member or field that
            does not exist; a tensor alias without ``aliases`` (or one it cannot place).
    """
    if isinstance(value, TypeRef):
        return _resolve_ref(value, aliases)
    if isinstance(value, TensorAlias):
        if aliases is None:
            raise ValueError("an alias of a model or optimizer tensor, not placed here")
        return aliases(value)
    if isinstance(value, list):
        return [resolve(v, aliases) for v in value]
    if isinstance(value, tuple):  # a namedtuple here is a script value already restored
        items = [resolve(v, aliases) for v in value]
        return tuple(items) if type(value) is tuple else value
    if isinstance(value, collections.deque):
        return collections.deque((resolve(v, aliases) for v in value), maxlen=value.maxlen)
    if isinstance(value, dict):
        out = value.copy() if type(value) in (collections.defaultdict, collections.Counter,
                                              collections.OrderedDict) else {}
        for k, v in value.items():
            out[resolve(k, aliases)] = resolve(v, aliases)
        return out
    return value


def has_aliases(value: Any) -> bool:
    """``value`` (a decoded tree) holds a :class:`TensorAlias`."""
    if isinstance(value, TensorAlias):
        return True
    if isinstance(value, TypeRef):
        return has_aliases(value.payload)
    if isinstance(value, dict):
        return any(has_aliases(v) for v in value.values())
    if isinstance(value, (list, tuple, collections.deque)):
        return any(has_aliases(v) for v in value)
    return False


def _lookup(ref: TypeRef) -> type:
    obj: Any = sys.modules.get(ref.module)
    if obj is None:
        raise ValueError(f"module {ref.module!r} of a stored {ref.qualname} is not imported")
    for part in ref.qualname.split("."):
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            raise ValueError(f"{ref.module}.{ref.qualname} no longer exists")
    if not isinstance(obj, type):
        raise ValueError(f"{ref.module}.{ref.qualname} is not a class")
    return obj


def _resolve_ref(ref: TypeRef, aliases: Callable[[TensorAlias], torch.Tensor] | None) -> Any:
    cls = _lookup(ref)
    name = f"{ref.module}.{ref.qualname}"
    if ref.tag == "__enum__":
        if not issubclass(cls, enum.Enum):
            raise ValueError(f"{name} is not an Enum")
        member = cls.__members__.get(ref.payload) if isinstance(ref.payload, str) else None
        if member is None:
            raise ValueError(f"{name} has no member {str(ref.payload)[:40]!r}")
        return member
    if ref.tag == "__nt__":
        fields = getattr(cls, "_fields", None)
        if not (issubclass(cls, tuple) and isinstance(fields, tuple)):
            raise ValueError(f"{name} is not a namedtuple")
        if len(fields) != len(ref.payload):
            raise ValueError(f"{name} has {len(fields)} fields, the checkpoint "
                             f"{len(ref.payload)}")
        return tuple.__new__(cls, [resolve(v, aliases) for v in ref.payload])
    if not dataclasses.is_dataclass(cls):
        raise ValueError(f"{name} is not a dataclass")
    names = {f.name for f in dataclasses.fields(cls)}
    if set(ref.payload) != names:
        raise ValueError(f"{name} has fields {sorted(names)}, the checkpoint "
                         f"{sorted(ref.payload)[:20]}")
    obj = object.__new__(cls)
    for k, v in ref.payload.items():
        object.__setattr__(obj, k, resolve(v, aliases))
    return obj


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
