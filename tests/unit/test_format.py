"""Unit tests for cfrun.codec.format: the pickle-free tree encoding and the tensor byte layout."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch

from cfrun.codec.format import (
    ALIGN_BYTES,
    DTYPE_ITEMSIZE,
    FILE_PAD_BYTES,
    TensorEntry,
    UnsupportedValueError,
    check_layout,
    decode,
    dumps_json,
    encode,
    plan_layout,
    tensor_bytes,
    tensor_from_buffer,
)


def _round_trip_tree(obj: Any) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """encode -> canonical JSON bytes -> parse -> tensors via one buffer -> decode.

    Returns the decoded object, the tensors as collected by encode, and as rebuilt.
    """
    tensors: list[torch.Tensor] = []
    tree = encode(obj, tensors)
    tree = json.loads(dumps_json(tree))  # what write_shard/load_shard do
    entries, total = plan_layout(tensors)
    buf = bytearray(total)
    for entry, t in zip(entries, tensors):
        raw = tensor_bytes(t).numpy().tobytes()
        assert len(raw) == entry.nbytes
        buf[entry.offset:entry.offset + entry.nbytes] = raw
    entries = [TensorEntry.from_json(json.loads(json.dumps(e.to_json()))) for e in entries]
    check_layout(entries, total)  # what the writer makes, the reader accepts
    rebuilt = [tensor_from_buffer(buf, e) for e in entries]
    return decode(tree, rebuilt), tensors, rebuilt


def _assert_same(a: Any, b: Any, path: str = "$") -> None:
    """Deep equality that also checks types, dtypes, shapes and NaN bit patterns."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                           b.reshape(-1).view(torch.uint8) if b.numel() else b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        # key order is not compared here (see test_string_key_order_survives_json)
        assert len(a) == len(b) and set(a) == set(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(3, 5, generator=g)
    f32[0, 0] = float("nan")
    f32[0, 1] = float("inf")
    f32[0, 2] = -0.0
    return {
        "f32": f32,
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "bf16": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "i64": torch.randint(-2**62, 2**62, (4, 2), generator=g, dtype=torch.int64),
        "bool": torch.rand(11, generator=g) > 0.5,
        "u8": torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8),
        "scalar0d": torch.tensor(3.25),
        "scalar0d_i64": torch.tensor(-7, dtype=torch.int64),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty2d": torch.empty(0, 3, dtype=torch.bfloat16),
        "noncontig": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "grad": torch.ones(2, requires_grad=True),
    }


def test_nested_round_trip_all_types() -> None:
    tensors = _sample_tensors()
    obj = {
        "model": tensors,
        "optimizer": {
            "state": {0: {"step": 3, "exp_avg": torch.zeros(5)}, 1: {"step": 3}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "tuple": (1, "two", None, (3.0, [4, 5])),
        "list": [True, False, None, 0, -1, 2**70, 1.5, "s"],
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 1e-300],
        "np": {
            "u32": np.arange(6, dtype=np.uint32).reshape(2, 3),
            "f64": np.array([1.5, np.nan, np.inf, -np.inf]),
            "u32_max": np.array([2**32 - 1], dtype=np.uint32),
            "empty": np.zeros((0, 4), dtype=np.float64),
            "zero_dim": np.array(2.5),
            "bool": np.array([True, False]),
        },
        "npscalars": [np.float32(1.25), np.float64(np.nan), np.int64(-5), np.uint32(7),
                      np.bool_(True), np.int8(-128)],
        "mixed_keys": {1: "a", "1": "b", (2, 3): "c", None: "d", 2.5: "e"},
        "rng": (np.uint32(5), np.arange(4, dtype=np.uint32), 624, 0, 0.0),
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
    }
    decoded, collected, rebuilt = _round_trip_tree(obj)
    # encode collects tensors, it does not copy or convert them
    assert any(c is tensors["f32"] for c in collected)
    assert set(decoded["model"]) == set(tensors)
    for name, t in tensors.items():
        got = decoded["model"][name]
        assert got.dtype == t.dtype, name
        assert got.shape == t.shape, name
        # bit-exact (NaN payloads included)
        assert tensor_bytes(got).tolist() == tensor_bytes(t).tolist(), name
        if t.dtype.is_floating_point:
            assert torch.equal(torch.nan_to_num(got.detach()), torch.nan_to_num(t.detach())), name
        else:
            assert torch.equal(got, t), name
        assert not got.requires_grad
    assert decoded["model"]["scalar0d"].dim() == 0
    assert decoded["model"]["empty2d"].shape == (0, 3)
    rest_in = {k: v for k, v in obj.items() if k != "model"}
    rest_out = {k: v for k, v in decoded.items() if k != "model"}
    _assert_same(rest_in, rest_out)
    assert isinstance(decoded["tuple"], tuple)
    assert isinstance(decoded["tuple"][3], tuple)
    assert isinstance(decoded["tuple"][3][1], list)
    assert set(decoded["optimizer"]["state"]) == {0, 1}
    assert isinstance(decoded["npscalars"][0], np.float32)
    assert decoded["np"]["u32"].dtype == np.uint32


def test_tensors_round_trip_bit_exact_via_one_buffer() -> None:
    tensors = list(_sample_tensors().values())
    entries, total = plan_layout(tensors)
    assert len(entries) == len(tensors)
    assert total % ALIGN_BYTES == 0
    prev_end = 0
    for e, t in zip(entries, tensors):
        assert e.offset % ALIGN_BYTES == 0
        assert e.offset >= prev_end  # no overlap
        assert e.nbytes == t.numel() * t.element_size()
        assert e.shape == tuple(t.shape)
        assert e.dtype == str(t.dtype).removeprefix("torch.")
        assert e.device == "cpu"
        prev_end = e.offset + e.nbytes
    assert total >= prev_end
    buf = bytearray(total)
    for e, t in zip(entries, tensors):
        buf[e.offset:e.offset + e.nbytes] = tensor_bytes(t).numpy().tobytes()
    for e, t in zip(entries, tensors):
        got = tensor_from_buffer(buf, e)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert tensor_bytes(got).tolist() == tensor_bytes(t).tolist()
        if not (t.dtype.is_floating_point and torch.isnan(t).any()):
            assert torch.equal(got, t.detach())


def test_tensor_from_buffer_copies() -> None:
    t = torch.arange(4, dtype=torch.int32)
    (e,), total = plan_layout([t])
    buf = bytearray(total)
    buf[: e.nbytes] = tensor_bytes(t).numpy().tobytes()
    got = tensor_from_buffer(buf, e)
    buf[:] = bytes(total)  # clobber the buffer
    assert torch.equal(got, t)


def test_plan_layout_offsets() -> None:
    ts = [torch.zeros(1, dtype=torch.uint8), torch.zeros(65, dtype=torch.uint8),
          torch.zeros(0), torch.zeros(16, dtype=torch.float32)]
    entries, total = plan_layout(ts)
    assert [e.offset for e in entries] == [0, 64, 192, 192]
    assert [e.nbytes for e in entries] == [1, 65, 0, 64]
    assert total == 256
    assert plan_layout([]) == ([], 0)


def test_tensor_bytes_is_row_major_uint8() -> None:
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()  # non-contiguous
    raw = tensor_bytes(t)
    assert raw.dtype == torch.uint8 and raw.dim() == 1
    assert raw.numpy().tobytes() == t.contiguous().numpy().tobytes()


@pytest.mark.parametrize("bad", [lambda x: x, object(), {"f": print}, [1, {2: object()}],
                                 (1, type), b"bytes", 1 + 2j, {1, 2}])
def test_encode_unsupported(bad: Any) -> None:
    with pytest.raises(UnsupportedValueError):
        encode(bad, [])


def test_encode_numpy_object_array_unsupported() -> None:
    with pytest.raises(UnsupportedValueError):
        encode(np.array([object()], dtype=object), [])


@pytest.mark.parametrize(
    "obj",
    [
        {"__t__": 0},
        {"__t__": 5, "x": 1},
        {"__tuple__": [1, 2]},
        {"__dict__": [[1, 2]]},
        {"__nd__": "<f8", "shape": [1], "data": [1.0]},
        {"__np__": "<i8", "v": 3},
        {"a": {"__t__": "not a tensor index"}},
    ],
)
def test_reserved_keys_round_trip_unchanged(obj: dict[str, Any]) -> None:
    sentinel = torch.tensor([99.0])
    tensors: list[torch.Tensor] = []
    tree = encode(obj, tensors)
    assert tensors == []
    out = decode(json.loads(dumps_json(tree)), [sentinel] * 8)
    assert out == obj
    assert type(out) is dict


def test_decode_plain_values_pass_through() -> None:
    for v in (None, True, 3, 2.5, "s"):
        assert decode(encode(v, []), []) == v
    assert type(decode(encode(True, []), [])) is bool


def test_encode_normalises_int_and_float_subclasses() -> None:
    import enum

    class Color(enum.IntEnum):
        RED = 1

    tree = encode({"c": Color.RED}, [])
    assert tree == {"c": 1}
    assert type(tree["c"]) is int
    json.loads(dumps_json(tree))


def test_tensor_from_buffer_unknown_dtype() -> None:
    e = TensorEntry("float128", (1,), 0, 16, "cpu")
    with pytest.raises(ValueError, match="float128"):
        tensor_from_buffer(bytearray(64), e)


@pytest.mark.parametrize(("offset", "nbytes"), [(64, 8), (0, 65), (60, 8), (128, 0)])
def test_tensor_from_buffer_out_of_range(offset: int, nbytes: int) -> None:
    e = TensorEntry("uint8", (nbytes,), offset, nbytes, "cpu")
    with pytest.raises(ValueError):
        tensor_from_buffer(bytearray(64), e)


def test_tensor_from_buffer_last_byte_in_range() -> None:
    buf = bytearray(range(64))
    got = tensor_from_buffer(buf, TensorEntry("uint8", (4,), 60, 4, "cpu"))
    assert got.tolist() == [60, 61, 62, 63]


def test_dumps_json_canonical() -> None:
    assert dumps_json({"b": 1, "a": [1, 2]}) == b'{"b":1,"a":[1,2]}'


@pytest.mark.parametrize("obj", [np.array([1 + 2j]), np.complex128(1 + 2j)])
def test_complex_numpy_is_rejected_or_round_trips(obj: Any) -> None:
    try:
        tree = encode(obj, [])
    except UnsupportedValueError:
        return
    out = decode(json.loads(dumps_json(tree)), [])
    _assert_same(obj, out)


def test_non_string_key_order_survives_json() -> None:
    obj = {3: "c", 1: "a", 2: "b"}
    out = decode(json.loads(dumps_json(encode(obj, []))), [])
    assert list(out) == [3, 1, 2]


def test_string_key_order_survives_json() -> None:
    obj = {"zeta": 1, "alpha": 2, "mid": {"y": 1, "x": 2}}
    out = decode(json.loads(dumps_json(encode(obj, []))), [])
    assert list(out) == ["zeta", "alpha", "mid"]
    assert list(out["mid"]) == ["y", "x"]


def test_every_dtype_the_writer_stores_is_allowed_with_its_item_size() -> None:
    from cfrun.codec.format import _DTYPES

    for name, dtype in _DTYPES.items():
        assert DTYPE_ITEMSIZE[name] == dtype.itemsize, name


@pytest.mark.parametrize("shapes", [[], [(0,)], [(3,)], [(4, 3), (0, 5), (7,)], [(1000,)]])
def test_layout_check_accepts_what_the_writer_makes(shapes: list[tuple[int, ...]]) -> None:
    tensors = [torch.zeros(s) for s in shapes]
    entries, total = plan_layout(tensors)
    check_layout(entries, total)  # rank's synchronous path: exactly the table
    padded = max(FILE_PAD_BYTES, -(-total // FILE_PAD_BYTES) * FILE_PAD_BYTES)
    check_layout(entries, padded)  # agent: a whole snapshot slot
    for wrong in {total + 1, padded + FILE_PAD_BYTES} - {total, padded}:
        with pytest.raises(ValueError, match="shard file has"):
            check_layout(entries, wrong)


def test_tensor_from_buffer_refuses_a_size_that_does_not_hold_the_shape() -> None:
    entry = TensorEntry("float32", (200_000_000,), 0, 0, "cpu")  # built past from_json
    with pytest.raises(ValueError, match="does not hold"):
        tensor_from_buffer(bytearray(64), entry)
