"""The persist agent: one long-lived process per node that makes snapshots durable (phase 2).

Started by the supervisor, it outlives restarts of the ranks (DeepFreeze §IV-A's separate
backend process, like VELOC), so a snapshot a rank finished just before it crashed is still
persisted and committed. Ranks copy their state into a shared-memory slot (``snapshot.py``) and
send one message per checkpoint: step, slot path, byte count and the shard's JSON tree. The agent
writes the slot's bytes to ``rank-NNNNN.bin`` straight from the shared mapping (no unpickling,
no re-serialization: ACUTE's Check-Pack), computes the xxh3-64 checksum, fsyncs, and once every
rank's shard of that step is durable it commits the step (manifest last, atomic rename, directory
fsync, retention) and answers each rank ``persisted``.

It runs at low CPU and I/O priority (it competes with training on small machines) and writes in
large aligned chunks, with ``O_DIRECT`` where the file system allows it, so the page cache is not
filled with checkpoint bytes.

Messages (``cfrun.contract.ipc``):

* ``{"op": "hello", "rank": r}`` -> ``{"op": "ready"}`` once every earlier persist of the queue is
  done (a restarted rank waits for it before it looks for checkpoints or reuses its slot);
* ``{"op": "persist", "step", "rank", "world_size", "slot", "nbytes", "doc", "t_trigger_unix_s"}``
  -> ``{"op": "persisted", "step", "ok", "persist_s", "pgt_s", "bytes", "error"}``.

With ``--peer HOST:PORT`` (ACUTE's remote-memory tier, :mod:`cfrun.peer.server`) a persist goes to the
peer's RAM instead of the job dir: each rank's shard is sent on its own thread, in ``--peer-streams``
parallel parts straight from the slot (:mod:`cfrun.agent.peertier`); once every rank's shard is in peer
RAM the checkpoint is *protected* (event ``protected``; ``pgt_s`` ends there) and the ranks get
their reply; the peer flushes it to level 2 and the agent records ``durable``. If the peer cannot
take a checkpoint (down, wrong token, full), that checkpoint goes to the job dir (the path above)
and the peer is retried with backoff. On a rank's ``hello`` (every start or restart of the ranks)
the agent first installs the newest complete checkpoint found in peer RAM or at level 2
(``--persist-to``) into the job dir, if it is newer than the job dir's own, after checking every
file against its manifest; the ranks then restore from the job dir as usual.

Only the job's user talks to it (issue 12, the local trust boundary): it listens on the random
abstract name the supervisor gives it (``--address``) and records it with its pid in
``agent.json`` (0600); it closes every connection from another uid (``SO_PEERCRED``), saying so
once per uid in one line and in an ``agent_refused`` event. A ``persist`` is refused (``ok:
false``, event ``persist_refused``) unless its step, rank, world size and byte count are sane for
the job and its slot is a regular file of the job's user, inside the job's private slot
directory (``--slot-dir``, or ``<job_dir>/.slots``), opened without following links
(:mod:`cfrun.contract.slots`).

Run as ``python -m cfrun.agent.server --job-dir DIR --keep N [--address NAME --slot-dir DIR
--world-size W] [--peer HOST:PORT --peer-token-file F --peer-streams S --peer-job NAME]
[--persist-to URL]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import errno
import json
import logging
import math
import mmap
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import filelock
import xxhash

from cfrun.contract import faults, ipc, slots
from cfrun.contract.checkpoints import (
    FileEntry,
    apply_retention,
    commit,
    committed_steps,
    read_manifest,
    remove_staging,
    shard_names,
    staging_dir,
)
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.fsio import open_new, write_atomic
from cfrun.contract.jobdir import STAGING_PREFIX, JobDir, atomic_write_json, step_dir_name
from cfrun.contract.manifest import dumps_json
from cfrun.storage.tiers import throttle

if TYPE_CHECKING:
    from cfrun.agent.peertier import PeerTier
    from cfrun.storage.tiers import Storage

logger = logging.getLogger("cfrun.agent")

WRITE_CHUNK_BYTES = 16 << 20
"""Bytes per ``write()``: large and 4 KiB-aligned (a multiple of any O_DIRECT block size)."""
MAX_STEP = 10**12
"""A step number above this is refused (no job takes 10^12 optimizer steps)."""

def _manifest_bytes(step_dir: Path) -> int:
    try:
        return read_manifest(step_dir).nbytes
    except (CheckpointCorruptError, IncompatibleFormatError):
        return 0


def _lower_priority() -> None:
    try:
        os.nice(10)
    except OSError:
        pass
    try:
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except Exception:
        pass


@dataclass
class _PeerStep:
    """One step on its way to the peer: the ranks' messages and their transfers' outcomes."""

    world_size: int
    msgs: dict[int, tuple[socket.socket, dict[str, Any]]] = field(default_factory=dict)
    errors: dict[int, BaseException | None] = field(default_factory=dict)
    complete: bool = False
    t0: float = field(default_factory=time.time)


class PersistAgent:
    """Serves one job dir's ranks on this node. Thread-safe; call :meth:`serve`.

    Args:
        peer: the peer tier (level 1 in a peer's RAM), or None for the job dir only.
        level2: the level-2 store that a resume also searches (``--persist-to``), or None.
    """

    def __init__(self, job_dir: Path, *, keep: int, use_odirect: bool = True,
                 peer: PeerTier | None = None, level2: Storage | None = None,
                 job: str | None = None, nnodes: int = 1, node_rank: int = 0,
                 local_world_size: int | None = None, address: str | None = None,
                 slot_dir: Path | None = None, world_size: int | None = None) -> None:
        self.jobdir = JobDir(job_dir)
        self.address = address or ipc.new_agent_address()
        self.slot_dir = slot_dir
        self.slot_dirs = [d for d in (slot_dir, slots.fallback_dir(self.jobdir.root)) if d]
        """Where a slot may be: the job's private slot directory, or ``<job_dir>/.slots``."""
        self.world_size = world_size
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.local_world_size = local_world_size
        self.waiting: dict[int, threading.Event] = {}
        """Multi-node: steps whose local shards are durable, waiting for the other nodes;
        setting the event abandons the wait."""
        self.keep = keep
        self.use_odirect = use_odirect
        self.peer = peer
        self.level2 = level2
        self.job = job or self.jobdir.root.name
        self.peer_steps: dict[int, _PeerStep] = {}
        self.peer_futures: set[cf.Future[None]] = set()
        self.step_lock = threading.Lock()
        self.local_lock = threading.Lock()
        self.rank_pool = cf.ThreadPoolExecutor(max_workers=64, thread_name_prefix="cfrun-rank")
        self.jobs: queue.Queue[tuple[str, socket.socket, dict[str, Any]] | None] = queue.Queue()
        self.pending: dict[int, dict[int, tuple[list[FileEntry], socket.socket, dict[str, Any]]]] = {}
        self.stopping = threading.Event()
        self.last_committed = -1

    # ------------------------------------------------------------------ connections

    def serve(self) -> None:
        """Listen, read messages on per-connection threads, write on one writer thread."""
        if self.nnodes > 1:  # other nodes' agents write here too: drop only this node's marks
            self._drop_own_marks()
        else:
            remove_staging(self.jobdir.checkpoints)  # this agent is now the only writer
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind("\0" + self.address)  # EADDRINUSE: another process holds it; main() says so
        srv.listen(64)
        srv.settimeout(0.2)
        ipc.write_agent_record(self.jobdir.root, ipc.AgentRecord(
            os.getpid(), self.address, str(self.slot_dir) if self.slot_dir else None))
        writer = threading.Thread(target=self._writer, name="cfrun-persist", daemon=True)
        writer.start()
        self.jobdir.emit_event("agent_start", pid=os.getpid())
        while not self.stopping.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            if not self._same_user(conn):
                conn.close()
                continue
            threading.Thread(target=self._reader, args=(conn,), daemon=True).start()
        srv.close()
        ipc.remove_agent_record(self.jobdir.root, os.getpid())
        self.jobs.put(None)  # drain what was queued, then stop
        writer.join()
        self._drain_peer()
        if self.peer is not None:
            self.peer.join_watchers(60.0)  # the last checkpoints' `durable`, if it comes soon

    def _same_user(self, conn: socket.socket) -> bool:
        """True if the connecting process runs as the agent's uid; else say so (once per uid,
        one line and an ``agent_refused`` event) and refuse it."""
        try:
            pid, uid, _ = ipc.peer_credentials(conn)
        except OSError:
            return False
        if uid == os.getuid():
            return True
        if ipc.say_refused_once("agent", uid, f"cfrun: refused a connection to the agent from "
                                f"uid {uid} (pid {pid}): only uid {os.getuid()} may use it"):
            self.jobdir.emit_event("agent_refused", uid=uid, pid=pid)
        return False

    def _check_persist(self, msg: dict[str, Any]) -> None:
        """Refuse a ``persist`` message that does not fit this job.

        Raises:
            ValueError: a field has the wrong type or range, the world size is not the job's,
                or the slot is not a private slot of this job (:class:`slots.SlotRefused`).
        """
        for name in ("step", "rank", "world_size", "nbytes"):
            if type(msg.get(name)) is not int:
                raise ValueError(f"{name} {msg.get(name)!r} is not an integer")
        step, rank, world_size = int(msg["step"]), int(msg["rank"]), int(msg["world_size"])
        nbytes = int(msg["nbytes"])
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"step {step} is outside 0..{MAX_STEP}")
        if world_size < 1 or (self.world_size is not None and world_size != self.world_size):
            raise ValueError(f"world_size {world_size} is not this job's ({self.world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        if nbytes < 1:
            raise ValueError(f"nbytes {nbytes} is not a positive byte count")
        others = self.pending.get(step, {})
        if any(int(m["world_size"]) != world_size for _, _, m in others.values()):
            raise ValueError(f"world_size {world_size} differs from the other ranks' of step "
                             f"{step}")
        t = msg.get("t_trigger_unix_s", 0.0)
        if not isinstance(msg.get("doc"), dict) or not isinstance(msg.get("slot"), str) \
                or type(t) not in (int, float) or not math.isfinite(t):
            raise ValueError("doc, slot or t_trigger_unix_s has the wrong type")
        os.close(slots.open_slot(msg["slot"], self.slot_dirs, nbytes))

    def _reader(self, conn: socket.socket) -> None:
        try:
            while True:
                msg = ipc.recv(conn)
                op = msg.get("op")
                if op in ("hello", "persist"):
                    self.jobs.put((op, conn, msg))
                else:
                    logger.warning("cfrun agent: unknown message %r", op)
        except (ConnectionError, OSError):
            pass

    @staticmethod
    def _reply(conn: socket.socket, msg: dict[str, Any]) -> None:
        try:
            ipc.send(conn, msg)
        except OSError:
            pass  # the rank is gone; the checkpoint still counts

    # ------------------------------------------------------------------ writing

    def _writer(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            op, conn, msg = job
            if op == "hello":
                self._abandon_waiting()
                self._drain_peer()
                if self.peer is not None or self.level2 is not None:
                    try:
                        self._install_newest()
                    except Exception as e:  # resume from the job dir then
                        logger.warning("cfrun agent: looking for newer checkpoints failed: %r", e)
                self._reply(conn, {"op": "ready", "last_committed": self.last_committed})
                continue
            try:
                self._check_persist(msg)
            except ValueError as e:
                logger.warning("cfrun agent: refused a persist: %s", e)
                self.jobdir.emit_event("persist_refused", error=str(e))
                self._reply(conn, {"op": "persisted", "step": msg.get("step"), "ok": False,
                                   "error": f"refused: {e}"})
                continue
            if self.peer is not None and (self.peer.available()
                                          or int(msg["step"]) in self.peer_steps):
                self._peer_submit(conn, msg)
                continue
            self._persist_local(conn, msg)

    def _persist_local(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        try:
            with self.local_lock:
                self._persist(conn, msg)
        except Exception as e:  # one bad checkpoint must not stop the agent
            logger.warning("cfrun agent: persist of step %s failed: %r", msg.get("step"), e)
            self.jobdir.emit_event("persist_failed", step=msg.get("step"),
                                   rank=msg.get("rank"), error=repr(e))
            self._reply(conn, {"op": "persisted", "step": msg.get("step"), "ok": False,
                               "error": repr(e)})

    # ------------------------------------------------------------------ peer tier

    def _drain_peer(self) -> None:
        """Wait until every transfer to the peer (and its fallback) has finished."""
        while True:
            with self.step_lock:
                futures = list(self.peer_futures)
            if not futures:
                return
            cf.wait(futures)
            with self.step_lock:
                self.peer_futures.difference_update(futures)

    def _peer_submit(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        """Start sending one rank's shard to the peer on a thread of its own (Check-Trans)."""
        step, rank = int(msg["step"]), int(msg["rank"])
        with self.step_lock:
            st = self.peer_steps.setdefault(step, _PeerStep(int(msg["world_size"])))
            st.msgs[rank] = (conn, msg)
            fut = self.rank_pool.submit(self._peer_send_rank, step, rank)
            self.peer_futures.add(fut)

    def _peer_send_rank(self, step: int, rank: int) -> None:
        assert self.peer is not None
        with self.step_lock:
            st = self.peer_steps[step]
            conn, msg = st.msgs[rank]
        error: BaseException | None = None
        complete = False
        try:
            meta = msg["doc"].get("meta", {})
            complete = self.peer.send_shard(
                step=step, world_size=st.world_size, rank=rank, slot=Path(msg["slot"]),
                nbytes=int(msg["nbytes"]), doc=dumps_json(msg["doc"]),
                meta={k: meta.get(k) for k in ("step", "mode", "epoch", "batches", "not_exact")},
                die_mid_transfer=self._test_kill_mid_transfer(step))
        except Exception as e:
            error = e
        with self.step_lock:
            st.errors[rank] = error
            st.complete = st.complete or complete
            if len(st.errors) < st.world_size:
                return
            del self.peer_steps[step]
        self._peer_finish(step, st)

    def _test_kill_mid_transfer(self, step: int) -> Any:
        kill_at = faults.value("agent.kill_at_step")
        marker = self.jobdir.root / ".agent-kill-done"
        if kill_at is None or step < int(kill_at) or marker.exists():
            return None

        def die() -> None:
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return die

    def _peer_finish(self, step: int, st: _PeerStep) -> None:
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
                self._persist_local(*st.msgs[rank])
            return
        self.peer.mark_up()
        t1 = time.time()
        nbytes = sum(int(m["nbytes"]) + len(dumps_json(m["doc"])) for _, m in st.msgs.values())
        t_trigger = min(float(m.get("t_trigger_unix_s", st.t0)) for _, m in st.msgs.values())
        reply = {"op": "persisted", "step": step, "ok": True, "bytes": nbytes, "tier": "peer",
                 "persist_s": round(t1 - st.t0, 6), "pgt_s": round(t1 - t_trigger, 6),
                 "bandwidth_bytes_per_s": round(nbytes / max(t1 - st.t0, 1e-9))}
        self.jobdir.emit_event("protected", step=step, bytes=nbytes, tier="peer",
                               persist_s=reply["persist_s"], pgt_s=reply["pgt_s"],
                               streams=self.peer.streams)
        self.last_committed = max(self.last_committed, step)
        for c, _ in st.msgs.values():
            self._reply(c, reply)
        self.peer.watch_durable(step, t_trigger)

    def _install_newest(self) -> None:
        """Install the newest complete checkpoint of peer RAM / level 2 if newer than ours."""
        from cfrun.agent.peertier import manifest_files_to

        local = committed_steps(self.jobdir.checkpoints)
        newest_local = local[0] if local else -1
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
                logger.warning("cfrun agent: cannot list %s: %r", self.level2.url, e)
        for step, _, source in sorted(candidates, reverse=True):
            t0 = time.monotonic()
            staging = staging_dir(self.jobdir.checkpoints, step)
            shutil.rmtree(staging, ignore_errors=True)
            try:
                if source == "peer":
                    assert self.peer is not None
                    files, manifest = self.peer.fetch(step, staging)
                else:
                    assert self.level2 is not None
                    store = self.level2
                    manifest = store.read_manifest(self.job, step)
                    if self.peer is not None:  # the peer's flush: sealed by this job's agents
                        self.peer.verify_manifest(manifest, step)
                    files = manifest_files_to(
                        staging, manifest, lambda name, n: store.read_file(self.job, step, name))
                commit(self.jobdir.checkpoints, step, files,
                       world_size=int(manifest["world_size"]), meta=manifest.get("meta") or {},
                       keep=self.keep)
            except Exception as e:
                shutil.rmtree(staging, ignore_errors=True)
                logger.warning("cfrun agent: checkpoint step %d from %s is unusable: %r", step,
                               source, e)
                self.jobdir.emit_event("fetch_failed", step=step, source=source, error=repr(e))
                continue
            nbytes = sum(f.nbytes for f in files)
            logger.warning("cfrun agent: installed checkpoint step %d from %s (%d bytes, newer "
                           "than the job dir's step %d)", step, source, nbytes, newest_local)
            self.jobdir.emit_event("fetched", step=step, source=source, bytes=nbytes,
                                   fetch_s=round(time.monotonic() - t0, 6))
            return

    def _persist(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        step, rank, world_size = int(msg["step"]), int(msg["rank"]), int(msg["world_size"])
        t0 = time.time()
        staging = staging_dir(self.jobdir.checkpoints, step)
        staging.mkdir(parents=True, exist_ok=True)
        bin_name, json_name = shard_names(rank)
        for stale in (bin_name, json_name):  # from an attempt that died before this step committed
            (staging / stale).unlink(missing_ok=True)
        bin_entry = self._write_slot(staging / bin_name, Path(msg["slot"]), int(msg["nbytes"]),
                                     step)
        json_entry = self._write_bytes(staging / json_name, dumps_json(msg["doc"]))
        shard = self.pending.setdefault(step, {})
        shard[rank] = ([bin_entry, json_entry], conn, msg)
        if self.nnodes > 1:
            if len(shard) >= (self.local_world_size or world_size):
                self._node_done(step, world_size)
            return
        if len(shard) < world_size:
            return
        delay_s = faults.value("agent.commit_delay_s")
        if delay_s:
            time.sleep(float(delay_s))
        files = [f for r in sorted(shard) for f in shard[r][0]]
        meta = msg["doc"].get("meta", {})
        commit(self.jobdir.checkpoints, step, files, world_size=world_size,
               meta={k: meta.get(k) for k in ("step", "mode", "epoch", "batches", "not_exact")},
               keep=None)  # retention after the ranks' reply: deleting is not part of the PGT
        t1 = time.time()
        self.last_committed = max(self.last_committed, step)
        del self.pending[step]
        for old in [s for s in self.pending if s < step]:  # a rank died before its snapshot
            del self.pending[old]
            remove_dir = staging_dir(self.jobdir.checkpoints, old)
            shutil.rmtree(remove_dir, ignore_errors=True)
        nbytes = sum(f.nbytes for f in files)
        t_trigger = min(float(m.get("t_trigger_unix_s", t0)) for _, _, m in shard.values())
        reply = {"op": "persisted", "step": step, "ok": True, "bytes": nbytes, "tier": "local",
                 "persist_s": round(t1 - t0, 6), "pgt_s": round(t1 - t_trigger, 6),
                 "bandwidth_bytes_per_s": round(nbytes / max(t1 - t0, 1e-9))}
        self.jobdir.emit_event("commit", step=step, bytes=nbytes, persist_s=reply["persist_s"],
                               pgt_s=reply["pgt_s"], tier="local")
        for _, c, _ in shard.values():
            self._reply(c, reply)
        apply_retention(self.jobdir.checkpoints, self.keep)

    # ------------------------------------------------------------------ several nodes

    def _mark_path(self, step: int, node_rank: int | None = None) -> Path:
        node = self.node_rank if node_rank is None else node_rank
        return staging_dir(self.jobdir.checkpoints, step) / f"node-{node:05d}.json"

    def _commit_lock(self) -> filelock.FileLock:
        """One lock for every commit and abandon in the shared job dir (all nodes' agents)."""
        return filelock.FileLock(str(self.jobdir.checkpoints / ".commit.lock"))

    def _node_done(self, step: int, world_size: int) -> None:
        """Every local rank's shard of ``step`` is durable: publish this node's mark (its files
        with their checksums), then commit if every node's mark is there, else wait for them on
        a thread of its own (the ranks get their reply once the step is committed)."""
        shard = self.pending.pop(step)
        files = [f for r in sorted(shard) for f in shard[r][0]]
        t_trigger = min(float(m.get("t_trigger_unix_s", time.time())) for _, _, m in shard.values())
        atomic_write_json(self._mark_path(step), {
            "node_rank": self.node_rank, "ranks": sorted(shard),
            "files": [vars(f) for f in files], "t_trigger_unix_s": t_trigger})
        meta = next(iter(shard.values()))[2]["doc"].get("meta", {})
        conns = [c for _, c, _ in shard.values()]
        abandon = threading.Event()
        self.waiting[step] = abandon
        threading.Thread(target=self._await_nodes, name=f"cfrun-await-{step}", daemon=True,
                         args=(step, world_size, meta, conns, t_trigger, abandon)).start()

    def _await_nodes(self, step: int, world_size: int, meta: dict[str, Any],
                     conns: list[socket.socket], t_trigger: float, abandon: threading.Event
                     ) -> None:
        t0 = time.time()
        while True:
            outcome = self._try_commit(step, world_size, meta, abandon)
            if outcome is not None:
                break
            if abandon.wait(0.02):
                continue  # the next _try_commit takes the abandon path under the lock
        self.waiting.pop(step, None)
        committed, nbytes, by_me = outcome
        t1 = time.time()
        if not committed:
            reply = {"op": "persisted", "step": step, "ok": False,
                     "error": "abandoned: the ranks restarted before every node's shard arrived"}
        else:
            self.last_committed = max(self.last_committed, step)
            reply = {"op": "persisted", "step": step, "ok": True, "bytes": nbytes,
                     "tier": "local", "persist_s": round(t1 - t0, 6),
                     "pgt_s": round(t1 - t_trigger, 6),
                     "bandwidth_bytes_per_s": round(nbytes / max(t1 - t0, 1e-9))}
            if by_me:
                self.jobdir.emit_event("commit", step=step, bytes=nbytes, nodes=self.nnodes,
                                       persist_s=reply["persist_s"], pgt_s=reply["pgt_s"],
                                       tier="local")
        for c in conns:
            self._reply(c, reply)

    def _try_commit(self, step: int, world_size: int, meta: dict[str, Any],
                    abandon: threading.Event) -> tuple[bool, int, bool] | None:
        """Under the commit lock: ``(True, bytes, by_me)`` once ``step`` is committed (by any
        node), ``(False, 0, False)`` when abandoned (this node's mark removed, so the step can
        never commit), ``None`` while other nodes' marks are missing."""
        checkpoints = self.jobdir.checkpoints
        final = checkpoints / step_dir_name(step)
        staging = staging_dir(checkpoints, step)
        with self._commit_lock():
            if (final / "manifest.json").is_file():
                return True, _manifest_bytes(final), False
            if abandon.is_set():
                self._mark_path(step).unlink(missing_ok=True)
                return False, 0, False
            marks = []
            for node in range(self.nnodes):
                try:
                    marks.append(json.loads(self._mark_path(step, node).read_text()))
                except (OSError, ValueError):
                    return None
            files = [FileEntry.from_json(f, f"step {step} node mark") for m in marks
                     for f in m["files"]]
            ranks = sorted(r for m in marks for r in m["ranks"])
            if ranks != list(range(world_size)):
                raise RuntimeError(f"step {step}: the nodes' marks hold ranks {ranks}, not "
                                   f"0..{world_size - 1}")
            commit(checkpoints, step, files, world_size=world_size,
                   meta={k: meta.get(k) for k in ("step", "mode", "epoch", "batches",
                                                  "not_exact")}, keep=self.keep)
            for p in checkpoints.iterdir():  # older steps can no longer complete
                if p.name.startswith(STAGING_PREFIX) and p != staging:
                    try:
                        if int(p.name[len(STAGING_PREFIX):]) < step:
                            shutil.rmtree(p, ignore_errors=True)
                    except ValueError:
                        continue
            return True, sum(f.nbytes for f in files), True

    def _abandon_waiting(self) -> None:
        """A rank said hello: this node's ranks restarted, so every step still waiting for
        other nodes belongs to the old run. Abandon them (under the commit lock, so a step is
        either committed by then, and counts, or can never commit) before the ranks look for
        the newest checkpoint: every node's ranks then see the same committed steps."""
        for step in list(self.pending):  # local shards of a step that never completed here
            del self.pending[step]
        events = list(self.waiting.items())
        for _, ev in events:
            ev.set()
        deadline = time.monotonic() + 30.0
        while any(s in self.waiting for s, _ in events) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _drop_own_marks(self) -> None:
        """At start (several nodes): remove this node's marks of steps not committed; they
        belong to an agent of this node that died."""
        checkpoints = self.jobdir.checkpoints
        if not checkpoints.is_dir():
            return
        with self._commit_lock():
            for p in checkpoints.iterdir():
                if p.name.startswith(STAGING_PREFIX):
                    (p / f"node-{self.node_rank:05d}.json").unlink(missing_ok=True)

    def _open(self, path: Path) -> tuple[int, bool]:
        if self.use_odirect and hasattr(os, "O_DIRECT"):
            try:
                return open_new(path, direct=True), True
            except OSError:
                pass
        return open_new(path), False

    def _write_slot(self, path: Path, slot: Path, nbytes: int, step: int) -> FileEntry:
        """Write ``nbytes`` of the shared-memory slot to ``path``, fsynced, with its checksum."""
        kill_at = faults.value("agent.kill_at_step")
        marker = self.jobdir.root / ".agent-kill-done"
        kill = kill_at is not None and step >= int(kill_at) and not marker.exists()
        th = throttle()  # testing aid: simulated network storage
        with os.fdopen(slots.open_slot(str(slot), self.slot_dirs, nbytes), "rb") as f, \
                mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            try:
                digest = xxhash.xxh3_64_hexdigest(view)
                fd, direct = self._open(path)
                try:
                    chunk = WRITE_CHUNK_BYTES
                    if kill:
                        chunk = max(4096, nbytes // 2 // 4096 * 4096)  # die half-way through
                    for start in range(0, nbytes, chunk):
                        if kill and start > 0:
                            marker.touch()
                            os.kill(os.getpid(), signal.SIGKILL)
                        piece = view[start:start + chunk]
                        if th is not None:
                            th.take(len(piece))
                        if direct and len(piece) % 4096:
                            os.close(fd)  # the unaligned tail goes through the page cache
                            fd, direct = os.open(path, os.O_WRONLY | os.O_NOFOLLOW), False
                            os.lseek(fd, start, os.SEEK_SET)
                        while piece:
                            piece = piece[os.write(fd, piece):]
                        piece.release()
                    os.fsync(fd)
                finally:
                    os.close(fd)
            finally:
                piece = None
                view.release()
        return FileEntry(path.name, nbytes, digest)

    @staticmethod
    def _write_bytes(path: Path, data: bytes) -> FileEntry:
        th = throttle()
        nbytes, digest = write_atomic(path, [data], sync_dir=False,
                                      before_chunk=None if th is None else th.take)
        return FileEntry(path.name, nbytes, digest)


def main(argv: list[str] | None = None) -> None:
    """``python -m cfrun.agent.server --job-dir DIR --keep N``; SIGTERM drains the queue and exits."""
    p = argparse.ArgumentParser(prog="cfrun.agent")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--no-odirect", action="store_true")
    p.add_argument("--peer", default=None, help="HOST:PORT of a `cfrun peer`")
    p.add_argument("--peer-token-file", default=None)
    p.add_argument("--peer-streams", type=int, default=4)
    p.add_argument("--peer-job", default=None)
    p.add_argument("--persist-to", default=None, help="level-2 directory or URL to resume from")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--local-world-size", type=int, default=None)
    p.add_argument("--address", default=None, help="abstract socket name (default: random)")
    p.add_argument("--slot-dir", default=None, help="the job's private slot directory "
                   "(default: a new one, removed at exit)")
    p.add_argument("--world-size", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[cfrun agent] %(message)s")
    _lower_priority()
    jd = JobDir(Path(args.job_dir))
    job = args.peer_job or jd.root.name
    peer = None
    if args.peer:
        from cfrun.peer.protocol import parse_address, read_token
        from cfrun.agent.peertier import PeerTier

        peer = PeerTier(parse_address(args.peer, option="--peer"),
                        read_token(args.peer_token_file, option="--peer-token-file"), job,
                        streams=args.peer_streams, emit=jd.emit_event)
    level2 = None
    if args.persist_to:
        from cfrun.storage.tiers import open_storage

        level2 = open_storage(args.persist_to)
    own_slot_dir = None if args.slot_dir else slots.create_dir(jd.root)
    agent = PersistAgent(Path(args.job_dir), keep=args.keep, use_odirect=not args.no_odirect,
                         peer=peer, level2=level2, job=job, nnodes=args.nnodes,
                         node_rank=args.node_rank, local_world_size=args.local_world_size,
                         address=args.address, world_size=args.world_size,
                         slot_dir=Path(args.slot_dir) if args.slot_dir else own_slot_dir)
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to cfrun, which stops us
    try:
        agent.serve()
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        logger.warning("cfrun agent: another process holds the address %s; not serving",
                       agent.address)
        sys.exit(3)
    finally:
        if own_slot_dir is not None:
            slots.remove_dir(own_slot_dir)
    sys.exit(0)


if __name__ == "__main__":
    main()
