"""The agent's peer-tier path: persists that go to a peer's RAM, and installs from it at resume.

Runs in the persist agent (``cfrun.agent.server``) started with ``--peer`` (ACUTE's remote-memory
tier, :mod:`cfrun.peer.server`) or ``--persist-to``. :meth:`PeerPath.submit` sends each rank's
shard on a thread of its own, in parallel parts straight from the slot
(:class:`cfrun.agent.peertier.PeerTier`); once every rank's shard of a step is in peer RAM,
:meth:`PeerPath._finish` replies to the ranks (the checkpoint is *protected*, event
``protected``; ``pgt_s`` ends there) and watches for the peer's flush to level 2 (``durable``).
If the peer cannot take the step (down, wrong token, full), the step's shards go to the job dir
instead (the agent's local path) and the peer is retried after a backoff.
:meth:`PeerPath.install_newest` (on every rank's ``hello``) installs the newest complete
checkpoint found in peer RAM or at level 2 into the job dir, if it is newer than the job dir's
own, after checking every file against its sealed manifest.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfrun.contract import faults
from cfrun.contract.checkpoints import commit, committed_steps, staging_dir
from cfrun.contract.config import job_identity
from cfrun.contract.errors import CheckpointCorruptError, ForeignCheckpointError
from cfrun.contract.jobdir import JobDir
from cfrun.contract.manifest import FileEntry, ManifestKeys, dumps_json
from cfrun.contract.messages import Persisted, PersistFailed, PersistRequest
from cfrun.peer.protocol import SealKeys, job_seal_keys  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from cfrun.agent.peertier import PeerTier
    from cfrun.storage.tiers import Storage

logger = logging.getLogger("cfrun.agent")


MAX_INSTALL_CANDIDATES = 16
"""Checkpoints of the peer and level 2 a hello examines at most, newest first: each costs a
manifest read and a seal check before any file (issue 32, finding 4: 1000 planted tiny steps
made 1000 lines and events)."""


class ForeignCheckpoint(Exception):
    """A checkpoint at the peer or at level 2 is not this job's; the message says why."""


@dataclass
class _PeerStep:
    """One step on its way to the peer: the ranks' requests and their transfers' outcomes."""

    world_size: int
    msgs: dict[int, tuple[socket.socket, PersistRequest]] = field(default_factory=dict)
    errors: dict[int, BaseException | None] = field(default_factory=dict)
    complete: bool = False
    t0: float = field(default_factory=time.time)


class PeerPath:
    """Persists to the peer tier and installs from it. Thread-safe.

    Args:
        jobdir, job, keep: the job dir, the job's name at the peer and level 2, retention.
        peer: the peer tier (level 1 in a peer's RAM), or None.
        level2: the level-2 store that a resume also searches (``--persist-to``), or None.
        reply: sends a ``persisted`` record to a rank's connection.
        persist_local: the fallback, ``persist_local(conn, request)`` into the job dir.
        committed: ``committed(step)`` records a protected step as the newest that counts.
    """

    def __init__(self, jobdir: JobDir, *, job: str, keep: int, peer: PeerTier | None,
                 level2: Storage | None,
                 reply: Callable[[socket.socket, Persisted | PersistFailed], None],
                 persist_local: Callable[[socket.socket, PersistRequest], None],
                 committed: Callable[[int], None],
                 seal_keys: SealKeys | None = None,
                 manifest_keys: ManifestKeys | None = None) -> None:
        self.jobdir = jobdir
        self.job = job
        self.keep = keep
        self.peer = peer
        self.level2 = level2
        self.reply = reply
        self.persist_local = persist_local
        self.committed = committed
        self.peer_steps: dict[int, _PeerStep] = {}
        self.peer_futures: set[cf.Future[None]] = set()
        self.step_lock = threading.Lock()
        self.rank_pool = cf.ThreadPoolExecutor(max_workers=64, thread_name_prefix="cfrun-rank")
        self.identity = job_identity(jobdir.root)
        """The job's identity (``identity.json``): its id and command go into every manifest;
        only checkpoints that carry them are installed. None: ``cfrun profile``."""
        self.job_meta: dict[str, str] = self.identity.meta() if self.identity else {}
        if seal_keys is None and peer is not None:
            seal_keys = peer.seal_keys
        if seal_keys is None and level2 is not None:
            seal_keys = job_seal_keys(jobdir.root, job, token=None)
        self.seal_keys = seal_keys
        """The keys of this job's own seals (:func:`job_seal_keys`): a checkpoint from the
        peer or level 2 is installed only with them."""
        self.manifest_keys = manifest_keys
        """The job dir's manifest keys: an installed checkpoint is committed under them."""

    def takes(self, step: int) -> bool:
        """True if a persist of ``step`` goes to the peer: it is up (or its backoff is over),
        or other ranks of the step already went there."""
        return self.peer is not None and (self.peer.available() or step in self.peer_steps)

    def drain(self) -> None:
        """Wait until every transfer to the peer (and its fallback) has finished."""
        while True:
            with self.step_lock:
                futures = list(self.peer_futures)
            if not futures:
                return
            cf.wait(futures)
            with self.step_lock:
                self.peer_futures.difference_update(futures)

    def submit(self, conn: socket.socket, req: PersistRequest) -> None:
        """Start sending one rank's shard to the peer on a thread of its own (Check-Trans)."""
        step, rank = req.step, req.rank
        with self.step_lock:
            st = self.peer_steps.setdefault(step, _PeerStep(req.world_size))
            st.msgs[rank] = (conn, req)
            fut = self.rank_pool.submit(self._send_rank, step, rank)
            self.peer_futures.add(fut)

    def _send_rank(self, step: int, rank: int) -> None:
        assert self.peer is not None
        with self.step_lock:
            st = self.peer_steps[step]
            _, req = st.msgs[rank]
        error: BaseException | None = None
        complete = False
        try:
            complete = self.peer.send_shard(
                step=step, world_size=st.world_size, rank=rank, slot=Path(req.slot),
                nbytes=req.nbytes, doc=dumps_json(req.doc),
                meta={**req.commit_meta(), **self.job_meta},
                die_mid_transfer=self._test_kill_mid_transfer(step))
        except Exception as e:
            error = e
        with self.step_lock:
            st.errors[rank] = error
            st.complete = st.complete or complete
            if len(st.errors) < st.world_size:
                return
            del self.peer_steps[step]
        self._finish(step, st)

    def _test_kill_mid_transfer(self, step: int) -> Any:
        kill_at = faults.value("agent.kill_at_step")
        marker = self.jobdir.root / ".agent-kill-done"
        if kill_at is None or step < int(kill_at) or marker.exists():
            return None

        def die() -> None:
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return die

    def _finish(self, step: int, st: _PeerStep) -> None:
        """All local ranks' shards were sent: protected -> reply; else persist in the job dir."""
        assert self.peer is not None
        error = next((e for e in st.errors.values() if e is not None), None)
        if error is None and not st.complete:  # other nodes' ranks still sending
            try:
                state = self.peer.await_state(step, "protected", 120.0).get("state")
                if state not in ("protected", "flushing", "durable"):
                    error = RuntimeError(f"step {step} is {state} at the peer")
            except Exception as e:
                error = e
        if error is not None:
            self.peer.mark_down(error)
            for rank in sorted(st.msgs):
                self.persist_local(*st.msgs[rank])
            return
        self.peer.mark_up()
        t1 = time.time()
        nbytes = sum(r.nbytes + len(dumps_json(r.doc)) for _, r in st.msgs.values())
        t_trigger = min(r.trigger_or(st.t0) for _, r in st.msgs.values())
        reply = Persisted(step, nbytes, "peer", round(t1 - st.t0, 6), round(t1 - t_trigger, 6),
                          round(nbytes / max(t1 - st.t0, 1e-9)))
        self.jobdir.emit_event("protected", step=step, bytes=nbytes, tier="peer",
                               persist_s=reply.persist_s, pgt_s=reply.pgt_s,
                               streams=self.peer.streams)
        self.committed(step)
        for c, _ in st.msgs.values():
            self.reply(c, reply)
        self.peer.watch_durable(step, t_trigger)

    def _refusal(self, manifest: Any) -> str | None:
        """Why ``manifest`` (a dict) is not this job's checkpoint, None when it is
        (:meth:`cfrun.contract.config.Identity.refusal`; no identity: no check)."""
        if self.identity is None:
            return None
        meta = manifest.get("meta") if isinstance(manifest, dict) else None
        return self.identity.refusal(meta)

    def install_newest(self) -> str | None:
        """Install the newest complete checkpoint of peer RAM / level 2 if newer than ours.

        A checkpoint of another job (another job id in its manifest, none, or a command this
        job never ran) is skipped with a warning and a ``fetch_failed`` event naming the
        reason; the next older one is tried. A final checkpoint (taken at the script's end,
        ``meta.final``: no position to resume at, issue 27 item 2) is installed and the next
        older one too, the newest a resume can start from. Listing (:meth:`_candidates`) ->
        fetching and checking one (:meth:`_fetch`) -> committing it into the job dir.

        Returns why the job must not start over, or None: the job dir has no checkpoint, none
        a resume can start from was installed, and one or more of this job's checkpoints were
        refused for a seal under another key (:class:`ForeignCheckpointError`: the job moved
        to a new machine without its ``--job-key-file``, or with one it never used). Starting
        over would crowd them out of the peer's retention and silently redo the training they
        hold; the caller stops the job (``fatal.json``, exit 5) with this one line, which names
        the fix."""
        local = committed_steps(self.jobdir.checkpoints)
        newest_local = local[0] if local else -1
        installed: int | None = None
        refused = 0
        unsealed: list[int] = []  # steps sealed under another key
        for step, _, source in self._candidates(newest_local):
            if step == installed:
                continue  # the final one, installed from the other source
            t0 = time.monotonic()
            staging = staging_dir(self.jobdir.checkpoints, step)
            shutil.rmtree(staging, ignore_errors=True)
            try:
                files, manifest = self._fetch(step, source, staging)
                commit(self.jobdir.checkpoints, step, files,
                       world_size=int(manifest["world_size"]), meta=manifest.get("meta") or {},
                       keep=self.keep, keys=self.manifest_keys)
            except Exception as e:
                shutil.rmtree(staging, ignore_errors=True)
                error = str(e) if isinstance(e, (ForeignCheckpoint, CheckpointCorruptError)) \
                    else repr(e)
                if not refused:  # the first in full; the others folded into one line
                    logger.warning("cfrun agent: checkpoint step %d from %s is unusable: %s",
                                   step, source, error)
                refused += 1
                self.jobdir.emit_event("fetch_failed", step=step, source=source, error=error)
                if isinstance(e, ForeignCheckpointError):
                    unsealed.append(step)
                continue
            nbytes = sum(f.nbytes for f in files)
            logger.warning("cfrun agent: installed checkpoint step %d from %s (%d bytes, newer "
                           "than the job dir's step %d)", step, source, nbytes, newest_local)
            self.jobdir.emit_event("fetched", step=step, source=source, bytes=nbytes,
                                   fetch_s=round(time.monotonic() - t0, 6))
            if (manifest.get("meta") or {}).get("final") is not True:
                return None  # a resume starts from it
            installed = step
        if refused > 1:
            logger.warning("cfrun agent: %d more checkpoints from the peer or level 2 were "
                           "refused (each a fetch_failed event in events.jsonl)", refused - 1)
        if newest_local >= 0 or not unsealed:
            return None
        hint = self.seal_keys.hint if self.seal_keys is not None else "--job-key-file"
        return (f"not starting over beside {len(unsealed)} checkpoint(s) of job {self.job} at "
                f"the peer or level 2 (the newest step {unsealed[0]}) that this job cannot "
                f"verify ({hint}); or give another --job-name to train from scratch beside them")

    def _candidates(self, newest_local: int) -> list[tuple[int, int, str]]:
        """``(step, 1 for the peer or 0 for level 2, source)`` of the complete checkpoints at
        the peer and level 2 newer than ``newest_local``, newest first (the peer's first on a
        tie), at most :data:`MAX_INSTALL_CANDIDATES`. A peer that cannot list is marked down,
        a level 2 that cannot is logged; neither raises."""
        candidates: list[tuple[int, int, str]] = []
        if self.peer is not None and self.peer.available():
            try:
                listing = self.peer.list()
                candidates += [(int(c["step"]), 1, "peer") for c in listing["checkpoints"]
                               if c["state"] != "filling" and int(c["step"]) > newest_local]
                self.peer.mark_up()
            except Exception as e:
                self.peer.mark_down(e)
        if self.level2 is not None:
            try:
                candidates += [(s, 0, "level2") for s in self.level2.list_steps(self.job)
                               if s > newest_local]
            except Exception as e:
                logger.warning("cfrun agent: cannot list %s: %r", self.level2.shown, e)
        ordered = sorted(candidates, reverse=True)
        if len(ordered) > MAX_INSTALL_CANDIDATES:
            logger.warning("cfrun agent: %d checkpoints at the peer and level 2 are newer than "
                           "the job dir's; only the newest %d are examined", len(ordered),
                           MAX_INSTALL_CANDIDATES)
            ordered = ordered[:MAX_INSTALL_CANDIDATES]
        return ordered

    def _fetch(self, step: int, source: str, staging: Path
               ) -> tuple[list[FileEntry], dict[str, Any]]:
        """Copy checkpoint ``step`` from ``source`` (``"peer"`` or ``"level2"``) into
        ``staging``, every file checked against the job's seals; returns its files and its
        manifest (a dict), not yet committed.

        Raises:
            ForeignCheckpoint: its manifest is not this job's (checked before any file).
            CheckpointCorruptError: a file or a seal does not match.
            Exception: whatever the peer or the store raised (the caller skips the step).
        """
        if source == "peer":
            assert self.peer is not None
            files, manifest = self.peer.fetch(step, staging)
            if (why := self._refusal(manifest)) is not None:
                raise ForeignCheckpoint(why)
            return files, manifest
        from cfrun.agent.peertier import fetch_verified

        assert self.level2 is not None
        store = self.level2
        manifest = store.read_manifest(self.job, step)
        if (why := self._refusal(manifest)) is not None:
            raise ForeignCheckpoint(why)
        assert self.seal_keys is not None
        files = fetch_verified(
            staging, manifest, step, job=self.job, seal_key=self.seal_keys,
            read=lambda name, n: store.read_file(self.job, step, name, n))
        return files, manifest
