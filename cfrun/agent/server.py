"""The persist agent's socket server: one long-lived process per node makes snapshots durable.

Started by the supervisor, the agent outlives restarts of the ranks (DeepFreeze §IV-A's separate
backend process, like VELOC), so a snapshot a rank finished just before it crashed is still
persisted and committed. Ranks copy their state into a shared-memory slot (``cfrun.rank.snapshot``)
and send one message per checkpoint (:mod:`cfrun.contract.messages`). The flow through the
agent, one module per job:

* this module, :class:`PersistAgent`: accept connections, refuse other users (``SO_PEERCRED``),
  read and parse each message on a thread per connection, run them in order on one writer
  thread, reply;
* :mod:`cfrun.agent.local`: slot -> ``O_DIRECT`` write -> fsync -> :class:`FileEntry`;
* :mod:`cfrun.agent.commit`: once every rank's shard of a step is durable, commit it (node marks
  and the wait for the other nodes with several nodes), reply ``persisted``, apply retention;
* :mod:`cfrun.agent.peerpath`: with ``--peer``, the shards go to a peer's RAM instead
  (:mod:`cfrun.agent.peertier`), and at every rank's ``hello`` the newest checkpoint of peer RAM
  or level 2 (``--persist-to``) is installed into the job dir if newer;
* :mod:`cfrun.agent.main`: ``python -m cfrun.agent`` argv parsing.

It runs at low CPU and I/O priority (it competes with training on small machines).

It always answers and keeps serving (issue 13, "a full disk"): a persist that cannot be written
or committed gets a failure reply for every rank of its step, its staging files are removed and
the rest of the step's shards are refused without a write; a step that does not fit in the job
dir's free space is skipped the same way (:class:`cfrun.agent.local.SpaceGuard`); an error
anywhere in handling a message is answered, never the end of the writer thread. Its events are
best effort (:meth:`cfrun.contract.jobdir.JobDir.emit_event`). At its end it says on stderr, in
one line and a ``persist_summary`` event, how many checkpoints failed or were skipped.

Messages (:mod:`cfrun.contract.messages`):

* ``hello`` -> ``ready`` once every earlier persist of the queue is done (a restarted rank waits
  for it before it looks for checkpoints or reuses its slot);
* ``persist`` -> ``persisted`` (ok with ``persist_s``, ``pgt_s``, ``bytes``, ``tier``; or an
  ``error``). A ``persist`` of a later step fails, at once, every earlier step still missing
  that rank's shard (:meth:`cfrun.agent.commit.Committer.supersede`): ranks that disagree on
  the checkpoint steps never leave a step waiting for shards that will not come.

Only the job's user talks to it (issue 12, the local trust boundary): it listens on the random
abstract name the supervisor gives it (``--address``) and records it with its pid in
``agent.json`` (0600); it closes every connection from another uid (``SO_PEERCRED``), saying so
once per uid in one line and in an ``agent_refused`` event. A ``persist`` is refused (``ok:
false``, event ``persist_refused``) unless it parses (:class:`cfrun.contract.messages.
PersistRequest`: known fields, types, ranges), its world size is the job's, and its slot is a
regular file of the job's user, inside the job's private slot directory (``--slot-dir``, or
``<job_dir>/.slots``), opened without following links (:mod:`cfrun.contract.slots`).

Run as ``python -m cfrun.agent --job-dir DIR --keep N [--address NAME --slot-dir DIR
--world-size W] [--peer HOST:PORT --peer-token-file F --peer-streams S --peer-job NAME]
[--persist-to URL]``.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfrun.agent.commit import Committer
from cfrun.agent.local import (  # noqa: F401  (WRITE_CHUNK_BYTES re-exported)
    WRITE_CHUNK_BYTES,
    LocalWriter,
    SpaceGuard,
)
from cfrun.agent.peerpath import PeerPath
from cfrun.contract import coordination as co
from cfrun.contract import ipc, slots
from cfrun.contract.checkpoints import remove_staging
from cfrun.contract.jobdir import JobDir, best_effort
from cfrun.contract.manifest import ManifestKeys
from cfrun.contract.messages import (
    MAX_ERROR_CHARS,
    MAX_STEP,  # noqa: F401  (re-exported)
    Hello,
    MessageError,
    Persisted,
    PersistFailed,
    PersistRequest,
    Ready,
    parse_request,
)

if TYPE_CHECKING:
    from cfrun.agent.peertier import PeerTier
    from cfrun.storage.tiers import Storage

logger = logging.getLogger("cfrun.agent")

_Job = tuple[socket.socket, "Hello | PersistRequest | tuple[dict[str, Any], str]"]
"""A writer-queue item: a connection and its parsed request, or a persist that did not parse
(the raw message and why)."""


class PersistAgent:
    """Serves one job dir's ranks on this node. Thread-safe; call :meth:`serve`.

    Args:
        peer: the peer tier (level 1 in a peer's RAM), or None for the job dir only.
        level2: the level-2 store that a resume also searches (``--persist-to``), or None.
        world_size: the job's world size (a persist of another is refused), None: not checked.
    """

    def __init__(self, job_dir: Path, *, keep: int, use_odirect: bool = True,
                 peer: PeerTier | None = None, level2: Storage | None = None,
                 job: str | None = None, nnodes: int = 1, node_rank: int = 0,
                 local_world_size: int | None = None, address: str | None = None,
                 slot_dir: Path | None = None, world_size: int | None = None,
                 manifest_keys: ManifestKeys | None = None) -> None:
        self.jobdir = JobDir(job_dir)
        self.address = address or ipc.new_agent_address()
        self.slot_dir = slot_dir
        self.slot_dirs = [d for d in (slot_dir, slots.fallback_dir(self.jobdir.root)) if d]
        """Where a slot may be: the job's private slot directory, or ``<job_dir>/.slots``."""
        self.world_size = world_size
        self.nnodes = nnodes
        self.peer = peer
        self.level2 = level2
        self.job = job or self.jobdir.root.name
        self.local = LocalWriter(self.jobdir, self.slot_dirs, use_odirect=use_odirect)
        self.manifest_keys = manifest_keys
        """The job dir's manifest keys (``job.key``): every commit here carries their MAC."""
        self.commits = Committer(self.jobdir, keep=keep, nnodes=nnodes, node_rank=node_rank,
                                 local_world_size=local_world_size, reply=self._reply,
                                 keys=manifest_keys)
        self.peer_path = PeerPath(self.jobdir, job=self.job, keep=keep, peer=peer,
                                  level2=level2, reply=self._reply,
                                  persist_local=self._persist_local,
                                  committed=self.commits.committed,
                                  manifest_keys=manifest_keys)
        self.space = SpaceGuard(self.jobdir)
        self.dropped: dict[int, str] = {}
        """Steps failed or skipped here -> why: their later shards are refused unwritten."""
        self.local_lock = threading.Lock()
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.stopping = threading.Event()

    # ------------------------------------------------------------------ connections

    def serve(self) -> None:
        """Listen, read messages on per-connection threads, write on one writer thread."""
        if self.nnodes > 1:  # other nodes' agents write here too: drop only this node's marks
            self.commits.drop_own_marks()
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
            except TimeoutError:
                if not writer.is_alive():  # it never returns on its own: answer nobody again?
                    srv.close()
                    ipc.remove_agent_record(self.jobdir.root, os.getpid())
                    logger.warning("cfrun agent: the writer thread died; exiting so that the "
                                   "supervisor starts a new agent")
                    raise SystemExit(1) from None
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
        self.peer_path.drain()
        if self.peer is not None:
            self.peer.join_watchers(60.0)  # the last checkpoints' `durable`, if it comes soon
        self._summary()

    def _summary(self) -> None:
        """At the agent's end: how many checkpoints failed or were skipped (one line on stderr
        and a ``persist_summary`` event), when any did."""
        failed, skipped = self.commits.failed, self.space.skipped
        dropped = best_effort.failed.get("events", 0)
        if not (failed or skipped or dropped):
            return
        logger.warning("cfrun agent: %d checkpoint(s) failed and %d were skipped for lack of "
                       "space in the job dir%s", failed, skipped,
                       f"; {dropped} event(s) could not be written" if dropped else "")
        self.jobdir.emit_event("persist_summary", failed=failed, skipped=skipped,
                               events_dropped=dropped)

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
                                f"uid {uid} (pid {pid}): only uid {os.getuid()} may use it; the "
                                "job is unaffected"):
            self.jobdir.emit_event("agent_refused", uid=uid, pid=pid)
        return False

    def _reader(self, conn: socket.socket) -> None:
        """One connection's thread: parse each message and queue it for the writer."""
        try:
            while True:
                msg = ipc.recv(conn)
                op = msg.get("op")
                if op not in (Hello.OP, PersistRequest.OP):
                    logger.warning("cfrun agent: unknown message %r", op)
                    continue
                try:
                    self.jobs.put((conn, parse_request(msg)))
                except MessageError as e:
                    if op == PersistRequest.OP:  # refused in order, by the writer
                        self.jobs.put((conn, (msg, str(e))))
                    else:
                        logger.warning("cfrun agent: refused a %s: %s", op, e)
        except (ConnectionError, OSError):
            pass

    @staticmethod
    def _reply(conn: socket.socket, rec: Ready | Persisted | PersistFailed) -> None:
        try:
            ipc.send(conn, rec.to_json())
        except OSError:
            pass  # the rank is gone; the checkpoint still counts

    def _check_job(self, req: PersistRequest) -> None:
        """Refuse a ``persist`` that parsed but does not fit this job.

        Raises:
            ValueError: the world size is not the job's or not the other ranks' of the step,
                or the slot is not a private slot of this job (:class:`slots.SlotRefused`).
        """
        if self.world_size is not None and req.world_size != self.world_size:
            raise ValueError(f"world_size {req.world_size} is not this job's ({self.world_size})")
        if self.commits.world_sizes(req.step) - {req.world_size}:
            raise ValueError(f"world_size {req.world_size} differs from the other ranks' of step "
                             f"{req.step}")
        os.close(slots.open_slot(req.slot, self.slot_dirs, req.nbytes))

    def _refuse(self, conn: socket.socket, step: int | None, error: str) -> None:
        logger.warning("cfrun agent: refused a persist: %s", error)
        self.jobdir.emit_event("persist_refused", error=error)
        self._reply(conn, PersistFailed(step, f"refused: {error}"[:MAX_ERROR_CHARS]))

    # ------------------------------------------------------------------ the writer thread

    def _writer(self) -> None:
        """The writer thread: handle each queued message in order. Whatever goes wrong with
        one is answered (a failure reply, or ``ready``) and logged; the thread goes on."""
        while True:
            job = self.jobs.get()
            if job is None:
                return
            conn, req = job
            try:
                self._handle(conn, req)
            except Exception as e:  # a bug or an I/O error outside the persist path
                logger.warning("cfrun agent: handling a %s failed: %r",
                               type(req).__name__, e)
                if isinstance(req, Hello):
                    self._reply(conn, Ready(self.commits.last_committed))
                else:
                    step = req.step if isinstance(req, PersistRequest) else None
                    self._reply(conn, PersistFailed(step, f"agent error: {e!r}"[
                        :MAX_ERROR_CHARS]))

    def _handle(self, conn: socket.socket, req: Hello | PersistRequest
                | tuple[dict[str, Any], str]) -> None:
        if isinstance(req, Hello):
            try:
                self.dropped.clear()  # restarted ranks may take the same steps again
                self.commits.abandon_waiting()
                self.peer_path.drain()
                if self.peer is not None or self.level2 is not None:
                    try:
                        refusal = self.peer_path.install_newest()
                    except Exception as e:  # resume from the job dir then
                        logger.warning("cfrun agent: looking for newer checkpoints failed: %r",
                                       e)
                    else:
                        if refusal is not None:
                            self._stop_the_job(refusal)
            finally:
                self._reply(conn, Ready(self.commits.last_committed))
            return
        if isinstance(req, tuple):  # did not parse
            raw, error = req
            self._refuse(conn, PersistFailed.step_of(raw), error)
            return
        try:
            self._check_job(req)
        except ValueError as e:
            self._refuse(conn, req.step, str(e))
            return
        with self.local_lock:  # earlier steps this rank went past can never complete
            for step in self.commits.supersede(req):
                self._drop(step, f"step {step} superseded by rank {req.rank}'s step {req.step}")
        if self.peer_path.takes(req.step):
            self.peer_path.submit(conn, req)
            return
        self._persist_local(conn, req)

    def _stop_the_job(self, message: str) -> None:
        """``fatal.json`` with ``message``: the rank that sent the ``hello`` reads it before its
        first step and stops the job (exit 5). A write the disk refuses is said once and
        dropped (:data:`best_effort`): the job then starts over, as without the refusal; it
        never raises, so the ``hello`` is answered once."""
        path = co.fatal_path(self.jobdir.root)
        try:
            co.write(path, co.Fatal(message=message))
        except OSError as e:
            best_effort.failure("fatal", path, e)

    def _persist_local(self, conn: socket.socket, req: PersistRequest) -> None:
        """Write ``req``'s shard into the job dir and commit its step when complete (the writer
        thread, or a peer thread falling back); a failure is replied to every rank of the step
        and logged, its staging files removed, never raised.

        The step's first shard here is checked against the free space first
        (:meth:`SpaceGuard.admit`); a step failed or skipped earlier is refused unwritten."""
        with self.local_lock:
            if req.step in self.dropped:
                self._reply(conn, PersistFailed(req.step, self.dropped[req.step]))
                return
            if req.step not in self.commits.pending:
                skipped = self.space.admit(req)
                if skipped is not None:
                    self._drop(req.step, skipped)
                    self._reply(conn, PersistFailed(req.step, skipped[:MAX_ERROR_CHARS]))
                    return
            try:
                t0 = time.time()
                files = self.local.write_shard(req)
                self.commits.add(conn, req, files, t0)
            except Exception as e:  # one bad checkpoint must not stop the agent
                error = f"persist of step {req.step} failed: {e!r}"
                logger.warning("cfrun agent: %s", error)
                self._drop(req.step, error)
                self.jobdir.emit_event("persist_failed", step=req.step, rank=req.rank,
                                       error=repr(e))
                self.commits.fail_step(conn, req, error)

    def _drop(self, step: int, why: str) -> None:
        """Remember that ``step`` will not be committed here (its later shards are refused);
        only the newest few such steps are kept."""
        self.dropped[step] = why[:MAX_ERROR_CHARS]
        for old in sorted(self.dropped)[:-8]:
            del self.dropped[old]

