"""The agent keeps a slot mapped from one persist to the next (cfrun.agent.local.SlotMaps): what
it writes is still exactly the slot's current bytes, a replaced slot is mapped anew, and a
removed one is unmapped."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from cfrun.agent.local import LocalWriter
from cfrun.contract.jobdir import JobDir

NBYTES = (3 << 20) + 123  # not a multiple of 4 KiB: the unaligned tail path too


def _slot(directory: Path, data: bytes) -> Path:
    path = directory / "rank-0.slot"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    return path


def _rewrite(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, data, 0)
    os.close(fd)


def test_a_slot_stays_mapped_and_every_persist_writes_its_current_bytes(tmp_path: Path) -> None:
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir(mode=0o700)
    writer = LocalWriter(JobDir(tmp_path / "job"), [slot_dir], use_odirect=True)
    out = tmp_path / "out"
    out.mkdir()
    first, second, third = (os.urandom(NBYTES) for _ in range(3))
    slot = _slot(slot_dir, first)
    entry = writer.write_slot(out / "a.bin", slot, NBYTES, step=1)
    assert (out / "a.bin").read_bytes() == first
    assert entry.xxh3_64 == xxhash.xxh3_64_hexdigest(first) and entry.nbytes == NBYTES
    mapped = writer.maps._maps[str(slot)][1]

    _rewrite(slot, second)  # the rank's next snapshot into the same slot
    writer.write_slot(out / "b.bin", slot, NBYTES, step=2)
    assert (out / "b.bin").read_bytes() == second
    assert writer.maps._maps[str(slot)][1] is mapped  # no new mapping, no page faults again

    slot = _slot(slot_dir, third)  # a new attempt's slot under the same name: another inode
    writer.write_slot(out / "c.bin", slot, NBYTES, step=3)
    assert (out / "c.bin").read_bytes() == third
    assert mapped.closed and len(writer.maps) == 1

    slot.unlink()  # the rank's slot is gone: its memory is not held past the next look
    writer.maps.drop_stale()
    assert len(writer.maps) == 0
