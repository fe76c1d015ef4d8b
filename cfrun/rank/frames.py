"""Progress kept in the script's own variables: capture it at a checkpoint, put it back on resume.

An unmodified script restarts from its first line, so counters, running sums, best-so-far values
and prefetched batches in its frames (``main()``'s locals, module globals) would start over. At
each checkpoint cfrun records the script frames on the stack (those whose code lives in the
script file) and, for each, the values it can store without pickle: Python scalars, containers
of them, tensors, ``torch.Generator``/``numpy`` generator states, ``nn.Module`` state dicts, and
the ``__dict__`` of plain objects of classes the script defines (``AverageMeter``...). On resume
the same frames, found by code identity (file, function, first line), get the values back.

Python 3.11/3.12 need ``PyFrame_LocalsToFast`` to write a function's locals; 3.13+ frames expose
a write-through ``f_locals`` (PEP 667).

The module also finds the loop around an optimizer step in the script's source (``ast``), which
the step-loop resume needs (README, "Resume semantics").
"""

from __future__ import annotations

import ast
import collections
import ctypes
import dataclasses
import datetime
import enum
import functools
import gc
import inspect
import io
import json
import logging
import os
import pathlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cfrun.codec.format import TensorAlias, UnsupportedValueError, encode, has_aliases, resolve
from cfrun.rank import liveness
from cfrun.rank.aliases import AliasIndex, is_partial_view, storage_key
from cfrun.rank.log import say

logger = logging.getLogger(__name__)

MAX_VALUE_JSON_BYTES = 4 << 20
"""A single variable larger than this (as JSON) is not captured; the resume is flagged inexact."""
MAX_FRAME_TENSOR_BYTES = 256 << 20
"""Tensors held in script variables beyond this total are not captured (flagged inexact)."""

_SKIP_TYPES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               type, types.GeneratorType, types.CodeType, types.FrameType)


def code_key(code: types.CodeType) -> list[Any]:
    """Identity of a function across runs: ``[file, name, first line]``."""
    return [os.path.realpath(code.co_filename), code.co_name, code.co_firstlineno]


def script_frames(start: types.FrameType | None, script_path: str) -> list[types.FrameType]:
    """Frames from ``start`` outwards whose code is in ``script_path``, innermost first."""
    out = []
    f = start
    while f is not None:
        if os.path.realpath(f.f_code.co_filename) == script_path:
            out.append(f)
        f = f.f_back
    return out


def _is_module_frame(frame: types.FrameType) -> bool:
    return frame.f_code.co_name == "<module>"


class FrameCapture:
    """Values of script variables prepared for the checkpoint tree.

    ``records`` is a JSON-able list (tensors appended to the caller's tensor list by ``encode``);
    ``skipped`` names variables that could not be stored (reported as inexact); ``unknown``
    those the loops assign (:func:`cfrun.rank.liveness.loop_assigned`) that hold a tensor
    sharing its storage with one cfrun does not know (a slice of some other tensor, or storage
    another stored variable shares): stored as values and marked ``shared``. So is such a
    variable the loops never assign, or one the analysis cannot tell, without a name here:
    the restarted script makes it again before the loop, and the resume keeps the script's own
    when it holds the same bits, or says so (:func:`restore_frames`).
    """

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.skipped: list[str] = []
        self.unknown: list[str] = []


AliasOf = Callable[[torch.Tensor], TensorAlias | None]
"""A tensor of a script variable as an alias of a live model or optimizer tensor, or None
(:meth:`cfrun.rank.aliases.AliasIndex.alias_of`)."""


def _encode_value(value: Any, tensors: list[torch.Tensor], budget: list[int],
                  saved_modules: set[int], alias: AliasOf | None = None,
                  kept: list[torch.Tensor] | None = None) -> tuple[str, Any] | None:
    """``(kind, encoded)`` for a capturable value, ``None`` to ignore it silently. A tensor
    ``alias`` recognises is stored as that alias; the others are cloned and appended to
    ``kept`` (as the script holds them).

    Raises:
        UnsupportedValueError: the value matters but cannot be stored.
    """
    if isinstance(value, _SKIP_TYPES):
        return None
    if isinstance(value, torch.nn.Module):
        if id(value) in saved_modules:
            return None
        local: list[torch.Tensor] = []
        enc = encode(value.state_dict(), local)
        return _with_tensors("module", enc, local, tensors, budget)
    if isinstance(value, torch.Generator):
        return _with_tensors("torch_generator", {"__t__": 0}, [value.get_state()], tensors, budget)
    if isinstance(value, np.random.Generator):
        return "np_generator", encode(value.bit_generator.state, tensors)
    if isinstance(value, (torch.optim.Optimizer, torch.utils.data.DataLoader)):
        return None
    if isinstance(value, torch.Tensor):
        if isinstance(value, torch.nn.Parameter):
            return None
        got = _detach_tree(value, alias, kept)
        if isinstance(got, TensorAlias):
            return "value", encode(got, [])
        return _with_tensors("value", {"__t__": 0}, [got], tensors, budget)
    if isinstance(value, io.IOBase) and not value.closed and not any(
            value is s for s in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__,
                                 sys.__stdout__, sys.__stderr__)):
        raise UnsupportedValueError("an open file: its position is not restored")
    if _is_script_object(value):
        local = []
        attrs = {k: v for k, v in vars(value).items()  # a loader wrapper keeps its loader
                 if not isinstance(v, _SKIP_TYPES + (torch.nn.Module, torch.utils.data.DataLoader,
                                                     torch.optim.Optimizer))}
        enc = encode(_detach_tree(attrs, alias, kept), local, typed=True)
        return _with_tensors("object", enc, local, tensors, budget)
    if _is_plain(value):
        local = []
        enc = encode(_detach_tree(value, alias, kept), local, typed=True)
        if len(json.dumps(enc)) > MAX_VALUE_JSON_BYTES:
            raise UnsupportedValueError("too large")
        return _with_tensors("value", enc, local, tensors, budget)
    return _helper_attrs(value)


def _is_script_object(value: Any) -> bool:
    """An object of a class the script defines, stored as its ``__dict__`` and restored in
    place (kind ``object``)."""
    return (type(value).__module__ == "__main__" and hasattr(value, "__dict__")
            and not isinstance(value, (torch.utils.data.Dataset, torch.utils.data.Sampler,
                                       enum.Enum)))


def _rebinds(value: Any) -> bool:
    """Whether restoring ``value`` only binds the variable's name again (kind ``value``: a
    tensor, a scalar, a container of them), with no effect on any object the script may hold
    elsewhere: then a dead variable (:mod:`cfrun.rank.liveness`) may go unstored, exactly.
    Modules, generators and objects restored in place are stored whatever their liveness."""
    if isinstance(value, torch.Tensor):
        return not isinstance(value, torch.nn.Parameter)
    if isinstance(value, (torch.nn.Module, torch.Generator, np.random.Generator, io.IOBase)) \
            or _is_script_object(value):
        return False
    return _is_plain(value)


_TRAINING_OBJECTS = (torch.nn.Module, torch.optim.Optimizer, torch.utils.data.DataLoader)


def _helper_attrs(value: Any) -> tuple[str, Any] | None:
    """``("attrs", ...)`` for an object of a library class that holds a model, an optimizer or a
    DataLoader as an attribute (timm's ``CheckpointSaver``, its ``PrefetchLoader``, Lightning
    Fabric's loader wrapper): its progress lives in attributes (the saver's best metric and
    kept files, the wrapper's ``iter()`` count), which the resume puts back. Only attributes
    that are simple and hold no tensor (:func:`_is_simple`) are kept; anything else of the
    object, and an object whose kept attributes are larger than
    :data:`MAX_VALUE_JSON_BYTES`, is left as the restarted script makes it (no flag: a
    library object's other state is the library's). ``None`` for any other object."""
    cls = type(value)
    attrs = getattr(value, "__dict__", None)
    if cls.__module__ in ("__main__", "builtins") or not isinstance(attrs, dict) or isinstance(
            value, (torch.utils.data.Dataset, torch.utils.data.Sampler, enum.Enum,
                    torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)) \
            or not any(isinstance(v, _TRAINING_OBJECTS) for v in attrs.values()):
        return None
    kept = {k: v for k, v in attrs.items()
            if not k.startswith("_cfrun") and _is_simple(v, tensors=False)}
    enc = encode(kept, [], typed=True)
    if len(json.dumps(enc)) > MAX_VALUE_JSON_BYTES:
        return None
    return "attrs", {"cls": _class_name(value), "attrs": enc}


def _is_plain(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, np.generic, enum.Enum,
                                           datetime.date, datetime.time, datetime.timedelta,
                                           pathlib.PurePath)):
        return True
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return True
    if depth > 4:
        return False
    if isinstance(value, (list, tuple, collections.deque)):
        return all(_is_plain(v, depth + 1) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_is_plain(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def _detach_tree(value: Any, alias: AliasOf | None = None,
                 kept: list[torch.Tensor] | None = None) -> Any:
    """``value`` with its tensors cloned (the script may change them in place after the
    checkpoint), or, those that ``alias`` recognises, as their :class:`TensorAlias`; the
    tensors cloned are appended to ``kept``."""
    if isinstance(value, torch.Tensor):
        got = alias(value) if alias is not None else None
        if got is not None:
            return got
        if kept is not None:
            kept.append(value)
        return value.detach().clone()
    if isinstance(value, list):
        return [_detach_tree(v, alias, kept) for v in value]
    if isinstance(value, tuple):  # a namedtuple keeps its type (stored by reference)
        items = [_detach_tree(v, alias, kept) for v in value]
        if hasattr(type(value), "_fields"):
            return tuple.__new__(type(value), items)
        return tuple(items)
    if type(value) is collections.deque:
        return collections.deque((_detach_tree(v, alias, kept) for v in value),
                                 maxlen=value.maxlen)
    if isinstance(value, dict):
        out = value.copy() if type(value) in (collections.defaultdict, collections.Counter,
                                              collections.OrderedDict) else {}
        for k, v in value.items():
            out[k] = _detach_tree(v, alias, kept)
        return out
    return value


def _with_tensors(kind: str, enc: Any, local: list[torch.Tensor], tensors: list[torch.Tensor],
                  budget: list[int]) -> tuple[str, Any]:
    nbytes = sum(t.numel() * t.element_size() for t in local)
    if nbytes > budget[0]:
        raise UnsupportedValueError(f"tensors too large ({nbytes} bytes)")
    budget[0] -= nbytes
    base = len(tensors)
    tensors.extend(local)
    return kind, _shift(enc, base)


def _shift(tree: Any, base: int) -> Any:
    if base == 0:
        return tree
    if isinstance(tree, list):
        return [_shift(v, base) for v in tree]
    if isinstance(tree, dict):
        if "__t__" in tree and len(tree) == 1:
            return {"__t__": tree["__t__"] + base}
        return {k: _shift(v, base) for k, v in tree.items()}
    return tree


def capture_frames(frames: list[types.FrameType], tensors: list[torch.Tensor],
                   saved_modules: set[int], exclude: set[str] | None = None,
                   known: Callable[[], AliasIndex] | None = None) -> FrameCapture:
    """Record the storable variables of ``frames`` (innermost first).

    Called on the training thread at a checkpoint boundary. Tensors are cloned (the script may
    reuse them in place) and appended to ``tensors``; modules already saved as models
    (``saved_modules``, by ``id``) are skipped, and so is a variable the script writes before
    reading it from every point where the resume puts the values back (dead there:
    :mod:`cfrun.rank.liveness`), when restoring it would only bind its name (a tensor, a
    number, a container of them): not stored, never reported as not storable. A tensor that
    shares its storage with a live model's or optimizer's (``known()``, called once, when a
    variable first holds a tensor: :mod:`cfrun.rank.aliases`) is stored as an alias of it.
    """
    cap = FrameCapture()
    budget = [MAX_FRAME_TENSOR_BYTES]
    index: list[AliasIndex] = []

    def alias(t: torch.Tensor) -> TensorAlias | None:
        if known is None:
            return None
        if not index:
            index.append(known())
        return index[0].alias_of(t)

    owners: dict[Any, Any] = {}  # storage of each tensor stored as values: its variable
    shared: list[tuple[types.FrameType, str]] = []
    records: dict[int, dict[str, Any]] = {}
    for frame in frames:
        values: dict[str, Any] = {}
        live = _live_names(frame)
        for name, value in list(frame.f_locals.items()):
            if name.startswith("__") or (exclude and name in exclude):
                continue
            if live is not None and name not in live and _rebinds(value):
                continue  # written before read from every resume point: nothing to store
            kept: list[torch.Tensor] = []
            try:
                got = _encode_value(value, tensors, budget, saved_modules, alias, kept)
            except (UnsupportedValueError, RuntimeError, ValueError, TypeError) as e:
                cap.skipped.append(f"{frame.f_code.co_name}:{name} ({e})")
                continue
            if got is not None:
                values[name] = {"kind": got[0], "v": got[1]}
                shared.extend(_shares_storage((frame, name), kept, owners))
        cap.records.append({"code": code_key(frame.f_code), "values": values})
        records[id(frame)] = values
    for frame, name in shared:  # a variable that aliases one cfrun does not know
        records[id(frame)][name]["shared"] = True
        assigned = _loop_assigned(frame)
        said = f"{frame.f_code.co_name}:{name}"
        if assigned is not None and name in assigned and said not in cap.unknown:
            cap.unknown.append(said)
    return cap


def _shares_storage(var: tuple[types.FrameType, str], kept: list[torch.Tensor],
                    owners: dict[Any, Any]) -> list[tuple[types.FrameType, str]]:
    """``var`` (and the variable it shares storage with) when a tensor of ``kept`` (those it
    stores as values) is part of a larger storage or shares its storage with a tensor another
    variable stores (``owners``: storage to variable, updated): restored as values, it no
    longer aliases that other tensor."""
    out = []
    for t in kept:
        key = storage_key(t)
        other = owners.get(key) if key is not None else None
        if is_partial_view(t) or other is not None:
            out.append(var)
        if other is not None and other != var:
            out.append(other)
        if key is not None:
            owners.setdefault(key, var)
    return out


def _live_names(frame: types.FrameType) -> frozenset[str] | None:
    """:func:`cfrun.rank.liveness.live_names`, None (all live) if the analysis fails."""
    try:
        return liveness.live_names(frame)
    except Exception as e:  # never lose a checkpoint to the analysis: store everything
        logger.debug("cfrun: liveness of %s failed: %r", frame.f_code.co_name, e)
        return None


def _loop_assigned(frame: types.FrameType) -> frozenset[str] | None:
    """:func:`cfrun.rank.liveness.loop_assigned`, None (restore all) if the analysis fails."""
    try:
        return liveness.loop_assigned(frame)
    except Exception as e:
        logger.debug("cfrun: loop writes of %s failed: %r", frame.f_code.co_name, e)
        return None


def _locals_to_fast(frame: types.FrameType) -> None:
    if sys.version_info < (3, 13) and not _is_module_frame(frame):
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


def restore_frames(records: list[dict[str, Any]], decoded: list[dict[str, Any]],
                   frames: list[types.FrameType], *, in_tracer: bool = False,
                   keep_invariants: bool = False,
                   aliases: Callable[[TensorAlias], torch.Tensor] | None = None) -> list[str]:
    """Put captured values back into the live ``frames`` with the same code identity.

    ``decoded`` is ``records`` with tensors decoded (see :func:`cfrun.codec.format.decode`). Objects
    that must keep their identity (generators, modules, script-class instances) are updated in
    place. Returns the names restored. ``in_tracer``: called from a trace function, which writes
    ``f_locals`` back itself on return. ``keep_invariants`` (a resume on another world size,
    :mod:`cfrun.codec.reshard`): a variable the frame holds already and its loops never assign
    (:func:`cfrun.rank.liveness.loop_assigned`) keeps the live value. ``aliases`` places a
    stored alias of a model or optimizer tensor (:meth:`cfrun.rank.aliases.AliasIndex.place`,
    on the loaded state); without it, a variable holding one is left for a later call.
    """
    restored = []
    live = {tuple(code_key(f.f_code)): f for f in reversed(frames)}
    for rec in decoded:
        frame = live.get(tuple(rec["code"]))
        if frame is None:
            continue
        restored += _FrameRestore(frame, keep_invariants, aliases).restore(rec["values"])
        if not in_tracer:
            _locals_to_fast(frame)
    return restored


class _FrameRestore:
    """:func:`restore_frames` in one frame: what it needs of the frame, read once (its
    ``f_locals``, the names it binds, those its loops assign, the directories its paths
    name), and the checks each captured variable passes before it is put back."""

    def __init__(self, frame: types.FrameType, keep_invariants: bool,
                 aliases: Callable[[TensorAlias], torch.Tensor] | None) -> None:
        self.frame = frame
        self.aliases = aliases
        self.f_locals = frame.f_locals
        self.assigned = _loop_assigned(frame) if keep_invariants else None
        self.bindable = bound_names(frame.f_code)
        self.anchors = path_anchors(self.f_locals)

    def restore(self, values: dict[str, Any]) -> list[str]:
        """Put the record's ``values`` back, by variable name: a name the frame never binds is
        refused, an invariant kept (``keep_invariants``), an alias left for a later call (no
        ``aliases``), any other value put back (:meth:`put`); one that no longer fits is
        left, with a warning. Returns the names restored."""
        restored = []
        f_locals, frame, aliases = self.f_locals, self.frame, self.aliases
        for name, item in values.items():
            if name not in self.bindable or name.startswith("__"):  # never captured: refused
                say(f"WARNING: checkpoint names a script variable {frame.f_code.co_name}:"
                    f"{str(name)[:60]} that {frame.f_code.co_name} never assigns; not set")
                continue
            if self.assigned is not None and name not in self.assigned and name in f_locals:
                continue
            kind, value = item["kind"], item["v"]
            current = f_locals.get(name)
            if aliases is None and has_aliases(value):
                continue  # placed once the models and optimizers are loaded
            try:
                # Enum members, namedtuples, dataclasses by reference; aliases of the models'
                # and optimizers' tensors as views of them
                value = resolve(value, aliases)
                if kind in _IN_PLACE_KINDS:
                    _update_in_place(kind, value, current)
                elif not self.put(name, value, current, shared=bool(item.get("shared"))):
                    continue
            except Exception as e:  # a value that no longer fits: leave it, say so
                logger.warning("cfrun: could not restore %s: %s", name, e)
                continue
            restored.append(name)
        return restored

    def put(self, name: str, value: Any, current: Any, *, shared: bool) -> bool:
        """Bind ``value`` (resolved) to ``name``, on the device of the ``current`` live
        value, unless ``shared`` (an alias of the script's own tensors) and ``current`` has
        the same bits already. False where refused: a path outside every directory the
        script's paths name, or a value of another kind than the live one."""
        where = self.frame.f_code.co_name
        if shared and _same_bits(value, current):
            pass  # the script's own (made again before the loop): its aliases stay
        elif isinstance(value, pathlib.PurePath) and not any(
                path_within(value, a) for a in self.anchors):
            say(f"WARNING: not restoring {where}:{name}: the checkpoint's path "
                f"{str(value)[:120]!r} lies outside the working directory and every "
                "directory the script's paths name")
            return False
        elif not _same_kind(value, current, name in self.f_locals):
            logger.warning("cfrun: not restoring %s: the checkpoint holds a %s where the "
                           "script has a %s", name, type(value).__name__,
                           type(current).__name__)
            return False
        else:
            self.f_locals[name] = _to_device_like(value, current)
            if shared and self.aliases is not None:  # the last call of a resume
                say(f"WARNING: script variable {where}:{name} shared its storage with a "
                    "tensor cfrun cannot tell; it is restored as a copy of its values, no "
                    "longer an alias")
        return True


_IN_PLACE_KINDS = ("module", "torch_generator", "np_generator", "attrs", "object")
"""Captured kinds of the objects that keep their identity (:func:`_update_in_place`)."""


def _update_in_place(kind: str, value: Any, current: Any) -> None:
    """Set the live object ``current`` from its captured ``value`` of ``kind``, keeping its
    identity (a module's state dict, a generator's state, an object's attributes); a live
    object of another type is left as it is."""
    if kind == "module":
        if isinstance(current, torch.nn.Module):
            current.load_state_dict(value)
    elif kind == "torch_generator":
        if isinstance(current, torch.Generator):
            current.set_state(value)
    elif kind == "np_generator":
        if isinstance(current, np.random.Generator):
            current.bit_generator.state = value
    elif kind == "attrs":
        if current is not None and _class_name(current) == value["cls"]:
            vars(current).update(value["attrs"])
    elif kind == "object":
        if current is not None and type(current).__module__ == "__main__":
            vars(current).update(_to_device_like(value, current))


_STORE_OPS = frozenset({"STORE_NAME", "STORE_GLOBAL"})


@functools.lru_cache(maxsize=256)
def bound_names(code: types.CodeType) -> frozenset[str]:
    """The names a frame of ``code`` may hold as its own variables, the only ones a resume
    sets (issue 32, finding 3: a checkpoint that set ``print`` in the module record
    crash-looped the job). A function: its locals, cells and free variables. A module: the
    names its code stores (assignments, ``for`` targets, imports, ``def``/``class``) and those
    its functions declare ``global`` and store; not a builtin it only calls, nor a name only
    ``globals()[...]`` writes (such a variable is not restored)."""
    if code.co_name != "<module>":
        return frozenset(code.co_varnames + code.co_cellvars + code.co_freevars)
    import dis

    names: set[str] = set()
    stack = [(code, True)]
    while stack:
        c, top = stack.pop()
        for ins in dis.get_instructions(c):
            if (ins.opname == "STORE_GLOBAL" or (top and ins.opname in _STORE_OPS)) \
                    and isinstance(ins.argval, str):
                names.add(ins.argval)
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                stack.append((const, False))
    return frozenset(names)


def path_within(value: Any, root: Any) -> bool:
    """Whether path ``value`` lies inside directory ``root`` (lexically, both made absolute
    against the working directory and normalized: no ``..`` escapes it); ``root`` None:
    never."""
    if root is None:
        return False
    try:
        v, r = os.path.abspath(os.fspath(value)), os.path.abspath(os.fspath(root))
    except (TypeError, ValueError):
        return False
    try:
        return os.path.commonpath([v, r]) == r
    except ValueError:
        return False


def path_anchors(f_locals: Any) -> list[str]:
    """The directories a restored path of a frame may lie in (:func:`path_within`): the
    working directory, and every path the frame holds before the restore (each one and its
    parent: ``out``, ``out / "best.pt"``). A checkpoint may move a script's path within the
    directories the script itself names (the epoch's file, the best model's), never elsewhere
    (issue 32, finding 3: a ``Path`` variable restored as another path made the script's
    ``torch.save`` overwrite a file outside them)."""
    out = [os.getcwd()]
    for value in list(f_locals.values()):
        if isinstance(value, pathlib.PurePath):
            out += [os.fspath(value), os.fspath(value.parent)]
    return out


_NUMBERS = (bool, int, float, np.integer, np.floating, np.ndarray, torch.Tensor)
"""Numeric values a script variable moves between (``total = 0; total += loss`` makes a
tensor of an int)."""


def _same_kind(value: Any, current: Any, live: bool) -> bool:
    """Whether a captured ``value`` may replace the live ``current`` of a script variable: it
    keeps the live value's type (a number, array or tensor stays one; ``None`` on either side
    is a value not set yet or no longer set). A checkpoint cannot turn the script's ``str`` into a
    ``PosixPath`` it then writes to (issue 24, item 2: a forged level-2 checkpoint did; the
    job seals keep forgeries out, this keeps a restored value within what the script holds).
    ``live``: the frame has the variable now (one not yet assigned takes any captured type)."""
    if not live or value is None or current is None:
        return True
    if isinstance(value, _NUMBERS) and isinstance(current, _NUMBERS):
        return True
    return type(value) is type(current)


def _same_bits(a: Any, b: Any, depth: int = 0) -> bool:
    """``a`` (a restored value) and ``b`` (the live one) hold the same bits: tensors of one
    dtype and shape (on any device), and lists, tuples and dicts of them and of equal
    scalars."""
    if isinstance(a, torch.Tensor):
        if not (type(b) is type(a) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        raw_a = a.detach().to(b.device).contiguous().reshape(-1).view(torch.uint8)
        return torch.equal(raw_a, b.detach().contiguous().reshape(-1).view(torch.uint8))
    if depth > 8 or type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_bits(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_bits(a[k], b[k], depth + 1) for k in a)
    try:
        return bool(a == b)
    except Exception:  # an ambiguous comparison: not the same
        return False


def _to_device_like(value: Any, current: Any) -> Any:
    if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
        return value.to(current.device)
    return value


def consumer_frame(caller: types.FrameType) -> types.FrameType:
    """The frame whose loop receives the batches that ``caller`` reads from a DataLoader.

    ``caller`` is the frame that called ``next()`` on the loader's iterator. Loader wrappers sit
    between it and the training loop: generator functions (a prefetcher's ``__iter__``, a device
    mover) and ``__next__`` methods, in the script or in a library. Their consumers are found
    through ``f_back`` (a running generator's ``f_back`` is the frame that called ``next()`` on
    it). Returns the first frame outwards that is neither (``caller`` itself when unwrapped).
    """
    f = caller
    while _is_wrapper_frame(f) and f.f_back is not None:
        f = f.f_back
    return f


def _is_wrapper_frame(f: types.FrameType) -> bool:
    return bool(f.f_code.co_flags & inspect.CO_GENERATOR) or f.f_code.co_name == "__next__"


def find_enumerate(iterator: Any, caller: types.FrameType,
                   consumer: types.FrameType) -> Any | None:
    """The ``enumerate`` object around the training loader's ``iterator`` or around one of the
    wrappers between ``caller`` and ``consumer`` (:func:`consumer_frame`); the outermost one
    if several. Training thread, at a checkpoint boundary or at the first ``next()`` after a
    resume (two ``gc.get_referrers`` scans: callers cache the answer per iterator)."""
    inner: list[Any] = [iterator]
    gen_frames = []
    f: types.FrameType | None = caller
    while f is not None and f is not consumer:
        if f.f_code.co_flags & inspect.CO_GENERATOR:
            gen_frames.append(f)
        elif f.f_code.co_name == "__next__" and "self" in f.f_code.co_varnames:
            inner.append(f.f_locals.get("self"))
        f = f.f_back
    if gen_frames:
        ids = {id(g) for g in gen_frames}
        gens = [g for g in gc.get_referrers(*gen_frames)
                if type(g) is types.GeneratorType and id(g.gi_frame) in ids]
        gens.sort(key=lambda g: [id(x) for x in gen_frames].index(id(g.gi_frame)))
        inner.extend(gens)
    order = {id(o): i for i, o in enumerate(inner) if o is not None}
    best: tuple[int, Any] | None = None
    for ref in gc.get_referrers(*[o for o in inner if o is not None]):
        if type(ref) is enumerate:
            sit = ref.__reduce__()[1][0]
            pos = order.get(id(sit))
            if pos is not None and (best is None or pos > best[0]):
                best = (pos, ref)
    return best[1] if best is not None else None


def enumerate_index(en: Any) -> int | None:
    """The next count an ``enumerate`` object yields (``None`` past ``sys.maxsize``)."""
    index = en.__reduce__()[1][1]
    return index if type(index) is int else None


def set_enumerate_index(en: Any, index: int) -> bool:
    """Make the ``enumerate`` object ``en`` count on from ``index``.

    ``for i, batch in enumerate(loader)`` restarts ``i`` at its start value when the loader (or
    a wrapper around it) resumes mid-epoch; scripts use ``i`` for logging, gradient
    accumulation and per-iteration LR schedules. CPython keeps the count in ``en_index`` right
    after the object header; the write is checked through ``__reduce__`` before and after.
    Returns whether it was set.
    """
    current = enumerate_index(en)
    if current is None:
        return False
    cell = ctypes.c_ssize_t.from_address(id(en) + object.__basicsize__)
    if cell.value != current:
        return False
    cell.value = index
    return enumerate_index(en) == index


def fix_enumerate(iterator: Any, consumed: int) -> bool:
    """Advance the counter of the ``enumerate`` object wrapping ``iterator`` by ``consumed``
    (checkpoints written before the counter itself was recorded). Returns whether an
    enumerate was found and fixed."""
    for ref in gc.get_referrers(iterator):
        if type(ref) is enumerate:
            reduced: Any = ref.__reduce__()
            sit, index = reduced[1]
            if sit is iterator and type(index) is int:
                return set_enumerate_index(ref, index + consumed)
    return False


@dataclass(frozen=True)
class LoopInfo:
    """The loop around a step in the script's source."""

    code: list[Any]
    """``code_key`` of the function holding the loop."""
    header_line: int
    body_line: int
    """Line of the first statement in the loop body."""
    kind: str
    """``while``, ``for_range`` (``for v in range(...)``), ``for_iter`` (a ``for`` over
    ``enumerate``/``zip`` of ``range``/``itertools.count``: see :data:`PURE_ITERABLES`) or
    ``for_other``."""
    target: str | None
    """Name of the ``for`` loop variable, if a plain name."""
    outer: str | None = None
    """``for_iter``: the name of the outermost call of the loop's iterable (``enumerate``...)."""
    names: Any = None
    """``for_iter``: the loop's target as nested lists of names (``[["i"], "batch"]`` is
    ``for (i,), batch in ...``; a plain name is a string)."""

    def to_json(self) -> dict[str, Any]:
        d = {"code": self.code, "header_line": self.header_line, "body_line": self.body_line,
             "kind": self.kind, "target": self.target}
        if self.kind == "for_iter":
            d.update(outer=self.outer, names=self.names)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LoopInfo:
        kind = str(d["kind"])
        outer, names = d.get("outer"), d.get("names")
        if kind == "for_iter" and (outer not in PURE_ITERABLES or not _valid_names(names)):
            raise ValueError(f"loop position: {outer!r} {names!r} is not a pure iterable loop")
        return cls(list(d["code"]), int(d["header_line"]), int(d["body_line"]), kind,
                   d.get("target"), outer, names)


PURE_ITERABLES = ("range", "enumerate", "zip")
"""Builtins a ``for_iter`` loop's iterable may be built from, with ``itertools.count`` inside:
iterating them runs no script code, so a resume can skip their first elements."""


def _valid_names(names: Any, depth: int = 0) -> bool:
    if isinstance(names, str):
        return True
    return (isinstance(names, list) and depth < 8 and bool(names)
            and all(_valid_names(n, depth + 1) for n in names))


def _target_names(node: ast.AST) -> Any:
    """A ``for`` target as nested lists of names, or None (starred, attribute, subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, (ast.Tuple, ast.List)):
        parts = [_target_names(e) for e in node.elts]
        return parts if parts and all(p is not None for p in parts) else None
    return None


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name):
            return node.func.id
        if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "itertools":
            return "itertools." + node.func.attr
    return None


def _is_pure_iterable(node: ast.AST, outer: str | None = None) -> bool:
    """``range(...)``, ``itertools.count(...)``/``count(...)`` with any arguments, or
    ``enumerate``/``zip`` of such (no keyword but ``start``; ``outer`` is not called again
    inside, so that a shim of it is used by the loop's call alone)."""
    name = _call_name(node)
    if name is None:
        return False
    assert isinstance(node, ast.Call)
    if name in ("range", "count", "itertools.count"):
        return True
    if name == "enumerate":
        inner = node.args[:1]
        extra_ok = len(node.args) <= 2 and all(k.arg == "start" for k in node.keywords)
    elif name == "zip":
        inner = node.args
        extra_ok = not node.keywords or all(k.arg == "strict" for k in node.keywords)
    else:
        return False
    return bool(inner) and extra_ok and all(
        _call_name(a) != outer and _is_pure_iterable(a, outer) for a in inner)


@functools.lru_cache(maxsize=8)
def _parse(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


_SAFE_NODES = (ast.Expression, ast.Name, ast.Attribute, ast.Constant, ast.BinOp, ast.UnaryOp,
               ast.Load, ast.operator, ast.unaryop)


def range_of(frame: types.FrameType, loop: LoopInfo) -> range | None:
    """The ``range`` a ``for ... in range(...)`` loop (``loop``, in ``frame``'s function)
    iterates, for a progress estimate: its arguments are evaluated in ``frame`` only when they
    are names, attributes, constants and arithmetic (``range(args.start_epoch, args.epochs)``),
    never a call; None otherwise or on any error."""
    if loop.kind != "for_range":
        return None
    tree = _parse(os.path.realpath(frame.f_code.co_filename))
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.AsyncFor) and node.lineno == loop.header_line:
            call = node.iter
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                    and call.func.id == "range" and not call.keywords
                    and 1 <= len(call.args) <= 3):
                return None
            try:
                args = []
                for arg in call.args:
                    expr = ast.Expression(arg)
                    if not all(isinstance(n, _SAFE_NODES) for n in ast.walk(expr)):
                        return None
                    value = eval(compile(expr, "<cfrun range>", "eval"),  # noqa: S307
                                 frame.f_globals, dict(frame.f_locals))
                    if type(value) is not int:
                        return None
                    args.append(value)
                return range(*args)
            except Exception:  # an attribute that is gone, a division by zero: no estimate
                return None
    return None


def find_loop(frame: types.FrameType, *, outside: bool = False,
              line: int | None = None) -> LoopInfo | None:
    """The innermost ``for``/``while`` loop of ``frame``'s function enclosing its current line
    (or ``line``).

    ``outside``: that line is a loop header; find the loop around that loop instead.
    """
    tree = _parse(os.path.realpath(frame.f_code.co_filename))
    if tree is None:
        return None
    line = frame.f_lineno if line is None else line
    first = frame.f_code.co_firstlineno
    best: ast.AST | None = None
    for node in ast.walk(tree):
        if (isinstance(node, (ast.For, ast.While))
                and (node.lineno < line if outside else node.lineno <= line)
                and line <= (node.end_lineno or 0)):
            if not _in_same_function(tree, node, first, frame.f_code.co_name):
                continue
            if best is None or node.lineno > best.lineno:  # type: ignore[attr-defined]
                best = node
    if best is None:
        return None
    body_line = best.body[0].lineno  # type: ignore[attr-defined]
    target = None
    outer, names = None, None
    if isinstance(best, ast.While):
        kind = "while"
    else:
        assert isinstance(best, ast.For)
        target = best.target.id if isinstance(best.target, ast.Name) else None
        it = best.iter
        is_range = (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                    and it.func.id == "range" and target is not None)
        kind = "for_range" if is_range else "for_other"
        outer, names = _call_name(it), _target_names(best.target)
        if not is_range and outer in PURE_ITERABLES and names is not None \
                and _is_pure_iterable(it, outer):
            kind = "for_iter"
        else:
            outer, names = None, None
    return LoopInfo(code_key(frame.f_code), best.lineno, body_line, kind, target, outer, names)


def enclosing_loops(frames: list[types.FrameType], inner: LoopInfo) -> list[LoopInfo]:
    """The loops around ``inner`` (a loop of ``frames[0]``), outermost first: those around it
    in its own function, then, in each caller among ``frames`` (script frames, innermost
    first), those around the call (a per-epoch ``train()`` called from an epoch loop)."""
    out: list[LoopInfo] = []
    line = inner.header_line
    for i, f in enumerate(frames):
        loop = find_loop(f, outside=True, line=line) if i == 0 else find_loop(f)
        while loop is not None:
            out.append(loop)
            loop = find_loop(f, outside=True, line=loop.header_line)
        line = -1
    return out[::-1]


def bind_names(names: Any, value: Any) -> dict[str, Any] | None:
    """Unpack ``value`` as a ``for`` statement would into ``names`` (:attr:`LoopInfo.names`);
    None if it does not unpack so."""
    if isinstance(names, str):
        return {names: value}
    if not isinstance(value, (tuple, list)) or len(value) != len(names):
        return None
    out: dict[str, Any] = {}
    for n, v in zip(names, value):
        got = bind_names(n, v)
        if got is None:
            return None
        out.update(got)
    return out


def _in_same_function(tree: ast.Module, node: ast.AST, firstlineno: int, name: str) -> bool:
    """True if ``node``'s innermost enclosing function is the one starting at ``firstlineno``."""
    owner: ast.AST | None = None
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if fn.lineno <= node.lineno <= (fn.end_lineno or 0):  # type: ignore[attr-defined]
                if owner is None or fn.lineno > owner.lineno:  # type: ignore[attr-defined]
                    owner = fn
    if owner is None:
        return name == "<module>"
    assert isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef))
    starts = {owner.lineno} | {d.lineno for d in owner.decorator_list}
    return owner.name == name and firstlineno in starts


def _is_simple(value: Any, depth: int = 0, *, tensors: bool = True) -> bool:
    """A value the checkpoint's data record stores and gives back as it was: ``None``, a
    bool/int/float/str, a tensor (unless not ``tensors``), or lists, tuples and str-keyed
    dicts of them."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if isinstance(value, torch.Tensor):
        return tensors and not isinstance(value, torch.nn.Parameter)
    if depth > 4 or type(value) not in (list, tuple, dict):
        return False
    if isinstance(value, dict):
        return all(type(k) is str and _is_simple(v, depth + 1, tensors=tensors)
                   for k, v in value.items())
    return all(_is_simple(v, depth + 1, tensors=tensors) for v in value)


def _library_wrapper_frames(start: types.FrameType | None,
                            script_path: str) -> list[types.FrameType]:
    """Frames of loader wrappers outside the script from ``start`` outwards (innermost first):
    generator functions and ``__next__`` methods (:func:`consumer_frame`), and ``__iter__``
    methods (a wrapper's ``iter()`` that calls the DataLoader's), up to the first other
    frame. ``start`` is the frame that called ``next()`` (at a checkpoint) or ``iter()`` (at
    the resume) on the training DataLoader."""
    out = []
    f = start
    while f is not None and (_is_wrapper_frame(f) or f.f_code.co_name == "__iter__"):
        if os.path.realpath(f.f_code.co_filename) != script_path:
            out.append(f)
        f = f.f_back
    return out


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def wrapper_state(caller: types.FrameType, script_path: str) -> list[dict[str, Any]]:
    """What the library loader wrappers between the training DataLoader and the script hold.

    Lightning Fabric's ``_FabricDataLoader`` counts its ``iter()`` calls (the count becomes the
    DistributedSampler's epoch); timm's ``PrefetchLoader`` holds the next batch in a local of
    its ``__iter__`` generator. A resume that jumps the epoch loop gives both back
    (:func:`restore_wrapper_state`) instead of replaying completed epochs through the wrapper.
    Wrappers the script defines are captured with the script's frames.

    Called on the training thread at a loader checkpoint boundary; ``caller`` is the frame that
    called ``next()`` on the training DataLoader's iterator. Returns, innermost first, one
    record per wrapper frame outside ``script_path``: its ``code_key``, its simple locals
    (``values``, in the shape :func:`restore_frames` takes) and, for a method, the class of
    ``self`` and its simple attributes (``attrs``); tensors are cloned (the wrapper may reuse
    them), values that are not simple (:func:`_is_simple`: loaders, devices, streams) are
    left out, as are cfrun's own attributes.
    """
    out = []
    for f in _library_wrapper_frames(caller, script_path):
        f_locals = f.f_locals
        values = {name: {"kind": "value", "v": _detach_tree(v)} for name, v in f_locals.items()
                  if name != "self" and not name.startswith("__") and _is_simple(v)}
        rec: dict[str, Any] = {"code": code_key(f.f_code), "values": values}
        owner = f_locals.get("self")
        if owner is not None and isinstance(getattr(owner, "__dict__", None), dict):
            rec["cls"] = _class_name(owner)
            rec["attrs"] = {k: _detach_tree(v) for k, v in vars(owner).items()
                            if not k.startswith("_cfrun") and _is_simple(v)}
        out.append(rec)
    return out


def restore_wrapper_state(saved: list[dict[str, Any]], caller: types.FrameType,
                          script_path: str) -> list[str]:
    """Put :func:`wrapper_state` back into the live wrappers at the resumed epoch's ``iter()``
    of the training DataLoader (``caller`` is the frame that called it: the wrapper's
    ``__iter__``, which has already run its own per-epoch code, such as Fabric's
    ``set_epoch``). Locals go to the frames of the same code, attributes to the ``self`` of
    the same class (a wrapper read through ``__next__`` is at its ``__iter__`` now). Training
    thread. Returns what was restored (local names, ``Class.__dict__`` for attributes)."""
    frames = _library_wrapper_frames(caller, script_path)
    restored = restore_frames(saved, saved, frames)
    owners = [f.f_locals.get("self") for f in frames]
    for rec in saved:
        attrs = rec.get("attrs")
        match = [o for o in owners if o is not None and _class_name(o) == rec.get("cls")]
        if match and attrs:
            current = vars(match[0])
            for k, v in attrs.items():
                current[k] = _to_device_like(v, current.get(k))
            restored.append(f"{type(match[0]).__name__}.__dict__")
    return restored
