"""Level 2 is never written, read or deleted through a link (issue 32, item 1).

A holder of the peer token who could write the flush dir planted ``ln -s <victim job
dir>/checkpoints <flush>/evil``, sent a step under the name ``evil`` and the peer wrote
``step-000999`` into the victim's checkpoints; retention through the same link deleted the
victim's steps. A real ``PeerServer`` in this process, real agents' tiers, real links.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from pathlib import Path

import pytest

from cfrun.agent.peertier import PeerTier
from cfrun.contract.errors import CheckpointCorruptError
from cfrun.peer.server import PeerServer
from cfrun.storage.tiers import LinkRefusedError, open_storage

TOKEN = b"t" * 32


@pytest.fixture
def peer(tmp_path):
    """A peer flushing to ``tmp_path / "l2"``, keeping 2 steps per job."""
    srv = PeerServer(("127.0.0.1", 0), open_storage(str(tmp_path / "l2")), TOKEN, slots=6,
                     max_checkpoint_bytes=1 << 20, keep=2)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(10)


def _send(srv: PeerServer, job: str, step: int, slot: Path, job_id: str) -> PeerTier:
    tier = PeerTier(srv.address, TOKEN, job, streams=1, emit=lambda *a, **k: None)
    assert tier.send_shard(step=step, world_size=1, rank=0, slot=slot,
                           nbytes=slot.stat().st_size, doc=b'{"a": 1}',
                           meta={"step": step, "job_id": job_id})
    return tier


def _tree(root: Path) -> list[tuple[str, bytes]]:
    """Every file under ``root`` with its bytes (links not followed)."""
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            out.append((str(p.relative_to(root)), p.read_bytes()))
    return sorted(out)


def _state(tier: PeerTier, step: int, timeout_s: float) -> str:
    return str(tier.await_state(step, "durable", timeout_s)["state"])


def _failures(caplog: pytest.LogCaptureFixture, path: Path) -> list[str]:
    return [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]


def test_a_link_planted_at_a_job_s_level2_dir_is_not_written_read_or_pruned_through(
        tmp_path, peer, caplog):
    """``<flush>/evil`` -> another job's level-2 steps (the victim's checkpoints, reachable by
    the link): the flush of ``evil`` step 999 fails with one line naming the link, nothing is
    written or deleted behind it, and another job's checkpoint is flushed meanwhile."""
    caplog.set_level(logging.WARNING, logger="cfrun.peer.server")
    slot = tmp_path / "slot"
    slot.write_bytes(secrets.token_bytes(4096))
    victim_id = "v" * 32
    for step in (70, 80):  # the victim's own steps, at level 2 under its own name
        tier = _send(peer, "victim", step, slot, victim_id)
        assert _state(tier, step, 10) == "durable"
        tier.close()
    victim = tmp_path / "l2" / "victim"
    before = _tree(victim)
    evil_link = tmp_path / "l2" / "evil"
    os.symlink(victim, evil_link)
    evil = _send(peer, "evil", 999, slot, victim_id)  # the victim's job id: derivable
    good = _send(peer, "good", 5, slot, "g" * 32)
    try:
        assert _state(good, 5, 10) == "durable"  # not held back by evil's failing flush
        assert _state(evil, 999, 1) != "durable"
        assert _tree(victim) == before  # nothing written, nothing deleted through the link
        assert not (victim / "step-000999").exists()
        assert evil_link.is_symlink()
        [line] = _failures(caplog, evil_link)
        assert "symbolic link" in line and "\n" not in line
        time.sleep(2.5)  # a retry: no second line for the same outage
        assert len(_failures(caplog, evil_link)) == 1
        storage = open_storage(str(tmp_path / "l2"))
        with pytest.raises(LinkRefusedError, match="evil is a symbolic link"):
            storage.list_steps("evil")  # a resume reading level 2 refuses it too
        with pytest.raises(CheckpointCorruptError, match="symbolic link"):
            storage.read_manifest("evil", 80)
        with pytest.raises(LinkRefusedError):
            storage.delete("evil", 70)
        assert _tree(victim) == before
        os.unlink(evil_link)  # the operator removes it: the next retry flushes
        assert _state(evil, 999, 10) == "durable"
        assert (tmp_path / "l2" / "evil").is_dir() and not (tmp_path / "l2" / "evil").is_symlink()
    finally:
        evil.close()
        good.close()


def test_a_link_planted_at_a_step_dir_is_neither_replaced_through_nor_pruned(tmp_path, peer,
                                                                             caplog):
    """``<flush>/j/step-000007`` -> a directory outside: the flush of step 7 fails naming it,
    and the directory's files stay; ``<flush>/j/step-000003`` -> a real step moved outside
    (a manifest of the same job id): retention after later flushes never deletes through it."""
    caplog.set_level(logging.WARNING, logger="cfrun.peer.server")
    slot = tmp_path / "slot"
    slot.write_bytes(secrets.token_bytes(4096))
    job_id = "j" * 32
    tier = _send(peer, "j", 3, slot, job_id)
    try:
        assert _state(tier, 3, 10) == "durable"
        level2 = tmp_path / "l2" / "j"
        outside = tmp_path / "outside-3"
        shutil.move(str(level2 / "step-000003"), str(outside))
        os.symlink(outside, level2 / "step-000003")
        kept = _tree(outside)
        assert any(name == "manifest.json" for name, _ in kept)
        precious = tmp_path / "outside-7"
        precious.mkdir()
        (precious / "manifest.json").write_text("precious")
        os.symlink(precious, level2 / "step-000007")
        _send(peer, "j", 7, slot, job_id)
        assert _state(tier, 7, 2) != "durable"
        [line] = _failures(caplog, level2 / "step-000007")
        assert "symbolic link" in line
        assert _tree(precious) == [("manifest.json", b"precious")]
        os.unlink(level2 / "step-000007")  # removed: step 7 flushes, then 9 and 11
        for step in (9, 11):
            _send(peer, "j", step, slot, job_id)
        assert _state(tier, 11, 10) == "durable"
        assert _tree(outside) == kept  # retention (keep 2) never deleted through the link
        assert (level2 / "step-000003").is_symlink()
        assert open_storage(str(tmp_path / "l2")).list_steps("j") == [11, 9]
    finally:
        tier.close()
