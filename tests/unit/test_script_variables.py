"""Script variables of the types real scripts hold (issue 14, item 4): Enum members, dataclass
instances, namedtuples, ``collections`` containers, dates and paths round-trip through the JSON
tree without pickle; enums and classes by reference, looked up only in imported modules."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import json
import pathlib
import sys
import types

import pytest
import torch

from cfrun.codec.format import TypeRef, UnsupportedValueError, decode, encode, resolve


class Summary(enum.Enum):
    NONE = 0
    AVERAGE = 1


class Level(enum.IntEnum):
    LOW = 1


@dataclasses.dataclass(frozen=True)
class Config:
    lr: float
    kind: Summary
    tags: tuple[str, ...] = ()


Point = collections.namedtuple("Point", ["x", "y"])


class _Zone(datetime.tzinfo):
    def utcoffset(self, dt: object) -> datetime.timedelta:
        return datetime.timedelta(hours=1)


def _round_trip(value: object) -> object:
    tensors: list[torch.Tensor] = []
    tree = json.loads(json.dumps(encode(value, tensors, typed=True)))
    return resolve(decode(tree, tensors))


@pytest.mark.parametrize("value", [
    Summary.AVERAGE,
    Level.LOW,
    Config(0.1, Summary.NONE, ("a",)),
    Point(1, Summary.AVERAGE),
    collections.OrderedDict([("b", 1), ("a", 2)]),
    collections.defaultdict(list, {"x": [1, 2]}),
    collections.defaultdict(int, {3: 4}),
    collections.deque([1, 2, 3], maxlen=5),
    collections.Counter({"a": 3, "b": 1}),
    datetime.datetime(2026, 11, 24, 14, 0, 1, 5, tzinfo=datetime.timezone.utc),
    datetime.datetime(2026, 11, 24, 14, 0, 1),
    datetime.date(2026, 1, 2),
    datetime.timedelta(days=2, seconds=3, microseconds=4),
    pathlib.Path("/tmp/out/ckpt.pt"),
    pathlib.PurePosixPath("a/b"),
    {"meter": [Point(0.5, 2)], "when": datetime.date(2000, 1, 1)},
])
def test_round_trip_keeps_type_and_value(value: object) -> None:
    back = _round_trip(value)
    assert type(back) is type(value)
    assert back == value
    if isinstance(value, collections.defaultdict):
        assert back.default_factory is value.default_factory  # type: ignore[attr-defined]
    if isinstance(value, collections.deque):
        assert back.maxlen == value.maxlen  # type: ignore[attr-defined]
    if isinstance(value, Summary):
        assert back is value


def test_enum_is_stored_by_reference_not_by_value() -> None:
    tree = encode(Summary.AVERAGE, [], typed=True)
    assert tree == {"__enum__": [__name__, "Summary", "AVERAGE"]}


def test_module_state_dict_stays_a_plain_dict() -> None:
    tree = encode(torch.nn.Linear(2, 2).state_dict(), [])
    assert set(tree) == {"weight", "bias"}


@pytest.mark.parametrize("value", [
    collections.defaultdict(lambda: 0),
    datetime.datetime(2026, 1, 1, tzinfo=_Zone()),
])
def test_values_that_cannot_be_stored_are_refused(value: object) -> None:
    with pytest.raises((UnsupportedValueError, TypeError)):
        encode(value, [], typed=True)


def _crafted(tree: object) -> object:
    return resolve(decode(tree, []))


@pytest.mark.parametrize("tree, why", [
    ({"__enum__": ["json_never_imported_xyz", "X", "A"]}, "not imported"),
    ({"__enum__": ["os", "path", "sep"]}, "not a class"),
    ({"__enum__": [__name__, "Config", "lr"]}, "not an Enum"),
    ({"__enum__": [__name__, "Summary", "MISSING"]}, "no member"),
    ({"__enum__": [__name__, "Summary", "__class__"]}, "no member"),
    ({"__enum__": [__name__, "Summary.<locals>", "A"]}, "module-level"),
    ({"__enum__": ["os", "system"]}, "module, qualname"),
    ({"__nt__": [__name__, "Summary"], "v": [1, 2]}, "not a namedtuple"),
    ({"__nt__": [__name__, "Point"], "v": [1, 2, 3]}, "fields"),
    ({"__dc__": ["subprocess", "Popen"], "f": {}}, "not a dataclass"),
    ({"__dc__": [__name__, "Config"], "f": {"lr": 1.0}}, "fields"),
    ({"__dc__": [__name__, "Config"], "f": {"lr": 1, "kind": 0, "tags": [], "x": 1}}, "fields"),
    ({"__coll__": "defaultdict", "factory": "eval", "v": []}, "factory"),
    ({"__coll__": "UserDict", "v": []}, "collection"),
    ({"__coll__": "deque", "maxlen": -1, "v": []}, "maxlen"),
    ({"__time__": "tzinfo", "v": "x"}, "time type"),
    ({"__time__": "timedelta", "v": ["1", 2, 3]}, "timedelta"),
    ({"__path__": "Path", "v": "/x"}, "path type"),
])
def test_crafted_trees_are_refused(tree: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        _crafted(tree)


def test_decoding_imports_nothing() -> None:
    name = "cfrun_never_imported_module"
    assert name not in sys.modules
    ref = decode({"__enum__": [name, "E", "A"]}, [])
    assert isinstance(ref, TypeRef)
    with pytest.raises(ValueError, match="not imported"):
        resolve(ref)
    assert name not in sys.modules


def test_dataclass_is_built_without_running_init() -> None:
    calls = []

    @dataclasses.dataclass
    class Tracked:
        a: int

        def __post_init__(self) -> None:
            calls.append(self.a)

    mod = types.ModuleType("cfrun_test_dc_mod")
    mod.Tracked = Tracked  # type: ignore[attr-defined]
    Tracked.__qualname__ = "Tracked"
    Tracked.__module__ = mod.__name__
    sys.modules[mod.__name__] = mod
    try:
        obj = Tracked(1)
        back = _round_trip(obj)
    finally:
        del sys.modules[mod.__name__]
    assert back == obj and calls == [1]


def test_a_restored_variable_keeps_the_live_values_type() -> None:
    """Issue 24, item 2: a forged checkpoint turned the script's ``out_path`` into a
    ``PosixPath`` of its choosing and the script wrote there. A captured value replaces a live
    one only of its own type (numbers, arrays and tensors count as one kind; ``None`` either
    side is a value not set yet)."""
    import inspect as pyinspect

    from cfrun.rank.frames import code_key, restore_frames

    def frame_with_vars():
        out_path = "out.pt"  # noqa: F841 (read through the frame)
        total = 0  # noqa: F841
        best = None  # noqa: F841
        return pyinspect.currentframe()

    frame = frame_with_vars()
    values = {"out_path": {"kind": "value", "v": pathlib.PosixPath("/root/secret")},
              "total": {"kind": "value", "v": torch.tensor(3.0)},
              "best": {"kind": "value", "v": 0.5}}
    rec = {"code": list(code_key(frame.f_code)), "values": values}
    restored = restore_frames([rec], [rec], [frame])
    assert sorted(restored) == ["best", "total"]
    assert frame.f_locals["out_path"] == "out.pt"
    assert torch.equal(frame.f_locals["total"], torch.tensor(3.0)) and \
        frame.f_locals["best"] == 0.5
