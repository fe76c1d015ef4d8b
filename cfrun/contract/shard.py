"""A rank's shard as its JSON document describes it: the tensor table, checked without torch.

``rank-NNNNN.json`` holds ``{"format_version", "rank", "tree", "tensors": [entry...], "meta"}``;
each entry says where one tensor's bytes lie in ``rank-NNNNN.bin`` (:class:`TensorEntry`). A
checksum proves the bytes are the ones the manifest's writer meant, not that the table tells
the truth, so a reader checks here what it can before a byte of tensor data is read: the JSON
is bounded (size, depth), each dtype comes from :data:`DTYPE_ITEMSIZE`, ``nbytes`` equals
elements times item size, shapes are non-negative and bounded, and the offsets are exactly the
writer's (aligned, in order, not overlapping, inside a file of the writer's size). Torch-free:
``cfrun ls`` runs these checks; :mod:`cfrun.codec.format` adds the torch side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfrun.contract.errors import CheckpointCorruptError
from cfrun.contract.manifest import FORMAT_VERSION, Manifest, loads_bounded, shard_names

ALIGN_BYTES = 64
FILE_PAD_BYTES = 4096
"""A ``.bin`` written from a snapshot slot is padded to a multiple of this (at least one), as
``cfrun.rank.slot.SLOT_ALIGN_BYTES``."""
MAX_DOC_BYTES = 256 << 20
"""Largest ``rank-NNNNN.json`` a reader parses (the tree holds numpy arrays as lists)."""
MAX_TREE_DEPTH = 100
"""Deepest nesting of a rank's JSON document a reader parses (a state is a few levels)."""
MAX_NDIM = 64
"""Most dimensions a stored tensor or array may have."""
MAX_DIM = 1 << 48
"""Largest single dimension a stored tensor or array may have."""
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "uint16": 2, "uint32": 4, "uint64": 8,
}
"""The dtypes a checkpoint may hold (torch names without ``torch.``) and their item sizes."""


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
        if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype {str(dtype)[:40]!r} is not one cfrun stores "
                             f"({', '.join(sorted(DTYPE_ITEMSIZE))})")
        shape_t = check_shape(shape)
        if type(offset) is not int or offset < 0 or offset % ALIGN_BYTES:
            raise ValueError(f"offset {offset!r} is not a non-negative multiple of "
                             f"{ALIGN_BYTES}")
        expected = math.prod(shape_t) * DTYPE_ITEMSIZE[dtype]
        if type(nbytes) is not int or nbytes != expected:
            raise ValueError(f"nbytes {nbytes!r} is not {expected} (shape {list(shape_t)} of "
                             f"{dtype})")
        if not isinstance(device, str) or len(device) > 64:
            raise ValueError(f"device {str(device)[:80]!r} is not a device name")
        return cls(dtype, shape_t, offset, nbytes, device)


def check_shape(shape: Any) -> tuple[int, ...]:
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


def read_doc(step_dir: Path, manifest: Manifest, rank: int
             ) -> tuple[dict[str, Any], list[TensorEntry]]:
    """Rank ``rank``'s verified JSON document and its checked tensor table.

    Reads only ``rank-NNNNN.json`` (a regular file of the manifest's size and checksum, at
    most :data:`MAX_DOC_BYTES`); the ``.bin`` is judged by its manifest size, not read.

    Raises:
        CheckpointCorruptError: any check above fails, in one line naming the file.
    """
    bin_name, json_name = shard_names(rank)
    where = f"{step_dir.name}/{json_name}"
    if manifest.entry(json_name).nbytes > MAX_DOC_BYTES:
        raise CheckpointCorruptError(f"{where}: {manifest.entry(json_name).nbytes} bytes, more "
                                     f"than the {MAX_DOC_BYTES} a shard document may have")
    bin_nbytes = manifest.entry(bin_name).nbytes
    raw = manifest.read_file(step_dir, json_name)
    try:
        doc = loads_doc(raw)
        entries = [TensorEntry.from_json(e) for e in doc["tensors"]]
        check_layout(entries, bin_nbytes)
    except ValueError as e:
        raise CheckpointCorruptError(f"{where}: {e}") from None
    return doc, entries


def check_docs(step_dir: Path, manifest: Manifest) -> None:
    """Every rank's document and tensor table is one the writer makes (:func:`read_doc`).

    Raises:
        CheckpointCorruptError: the first that is not.
    """
    for rank in range(manifest.world_size):
        read_doc(step_dir, manifest, rank)
