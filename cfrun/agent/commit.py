"""The agent's commit: a step counts once every rank's shard is durable and its manifest is in.

Runs in the persist agent (``cfrun.agent.server``). :meth:`Committer.add` collects the durable
shards of a step (:mod:`cfrun.agent.local`); on one node, the last rank's shard commits the step
(manifest last, atomic rename, directory fsync: :func:`cfrun.contract.checkpoints.commit`),
every rank gets its ``persisted`` reply, and retention runs after the reply (deleting is not
part of the persist gap time). With several nodes sharing the job dir each node's agent
publishes a *mark* (its files with their checksums) in the staging directory once its own ranks'
shards are durable, and whichever agent sees every node's mark first commits, under one file lock
for all of them (:meth:`cfrun.agent.marks.NodeMarks.try_commit`: the marks and that lock, what
the nodes share on disk, have a module of their own, :mod:`cfrun.agent.marks`). When this node's
ranks restart, the steps still waiting for other nodes are abandoned
(:meth:`Committer.abandon_waiting`), so every node's ranks see the same committed steps.

A step the ranks disagree on fails at once instead of waiting (issue 22: ranks that checkpointed
at different steps left every checkpoint waiting 600 s for shards that never came). A rank hands
off its checkpoints in step order, the next only after the previous one's reply, so a rank that
hands off step ``s2`` will never send a shard of an earlier step ``s``: a step still missing
that rank's shard is failed on the spot (:meth:`Committer.supersede`; a warning, a
``step_superseded`` event, a failure reply to the ranks waiting on it). With several nodes the
same holds per node: a node whose mark of a later step is in the job dir while its mark of
``s`` is not will never complete ``s`` (:class:`cfrun.agent.marks.Superseded`).
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from cfrun.agent.marks import NodeMarks, Superseded
from cfrun.contract import faults
from cfrun.contract.checkpoints import (
    FileEntry,
    apply_retention,
    commit,
    shard_names,
    staging_dir,
)
from cfrun.contract.config import job_identity
from cfrun.contract.jobdir import JobDir
from cfrun.contract.manifest import ManifestKeys
from cfrun.contract.messages import MAX_ERROR_CHARS, Persisted, PersistFailed, PersistRequest

logger = logging.getLogger("cfrun.agent")

Reply = Callable[[socket.socket, "Persisted | PersistFailed"], None]
"""``reply(conn, record)`` sends a record to a rank (errors ignored: the rank may be gone)."""


class Committer:
    """Collects durable shards per step and commits complete steps; replies to the ranks.

    Holds this agent's side in memory (the shards collected, the steps waiting, the replies);
    with several nodes what they share on disk is its :attr:`marks`
    (:class:`~cfrun.agent.marks.NodeMarks`).

    Args:
        jobdir: the job dir (its ``checkpoints/``).
        keep: committed checkpoints to keep (retention).
        nnodes, node_rank, local_world_size: several agents share the job dir when nnodes > 1.
        reply: sends a ``persisted`` record to a rank's connection.
    """

    def __init__(self, jobdir: JobDir, *, keep: int, nnodes: int, node_rank: int,
                 local_world_size: int | None, reply: Reply,
                 keys: ManifestKeys | None = None) -> None:
        self.jobdir = jobdir
        self.keys = keys
        """The job's manifest keys: every manifest committed here carries their MAC, and
        retention counts and deletes only the job's own checkpoints. None: neither."""
        self.jobdir_id = jobdir.dir_id()
        """The job dir at the agent's start: a commit into another one is refused."""
        self.keep = keep
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.local_world_size = local_world_size
        self.reply = reply
        self.pending: dict[int, dict[int, tuple[list[FileEntry], socket.socket,
                                                PersistRequest]]] = {}
        """step -> rank -> (its durable files, its connection, its request)."""
        self.waiting: dict[int, threading.Event] = {}
        """Multi-node: steps whose local shards are durable, waiting for the other nodes;
        setting the event abandons the wait."""
        self.last_committed = -1
        self.failed = 0
        """Steps whose write or commit failed here since the agent started."""
        identity = job_identity(jobdir.root)
        self.job_meta: dict[str, str] = identity.meta() if identity is not None else {}
        """The job's id and command fingerprint, in every manifest's ``meta``."""
        self.marks = NodeMarks(jobdir, nnodes=nnodes, node_rank=node_rank, keep=keep,
                               keys=keys)
        """Several nodes: the marks in the shared job dir and the commit they allow."""

    def committed(self, step: int) -> None:
        """Record that ``step`` counts (committed here, or protected in peer RAM)."""
        self.last_committed = max(self.last_committed, step)

    def world_sizes(self, step: int) -> set[int]:
        """The world sizes of the shards of ``step`` collected so far."""
        return {req.world_size for _, _, req in self.pending.get(step, {}).values()}

    # ------------------------------------------------------------------ one node

    def add(self, conn: socket.socket, req: PersistRequest, files: list[FileEntry],
            t0: float) -> None:
        """``req``'s shard is durable (``files``; its persist started at ``t0``, wall clock):
        commit the step if it was the last one (writer thread)."""
        step, rank, world_size = req.step, req.rank, req.world_size
        shard = self.pending.setdefault(step, {})
        shard[rank] = (files, conn, req)
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
        self.jobdir.check_same(self.jobdir_id)  # never into a job dir swapped meanwhile
        commit(self.jobdir.checkpoints, step, files, world_size=world_size,
               meta={**req.commit_meta(), **self.job_meta}, keys=self.keys,
               keep=None)  # retention after the ranks' reply: deleting is not part of the PGT
        t1 = time.time()
        self.committed(step)
        del self.pending[step]
        for old in [s for s in self.pending if s < step]:  # a rank died before its snapshot
            self._fail_superseded(old, step, req.rank)
        nbytes = sum(f.nbytes for f in files)
        t_trigger = min(r.trigger_or(t0) for _, _, r in shard.values())
        reply = Persisted(step, nbytes, "local", round(t1 - t0, 6), round(t1 - t_trigger, 6),
                          round(nbytes / max(t1 - t0, 1e-9)))
        self.jobdir.emit_event("commit", step=step, bytes=nbytes, persist_s=reply.persist_s,
                               pgt_s=reply.pgt_s, tier="local")
        for _, c, _ in shard.values():
            self.reply(c, reply)
        try:  # the step is committed and answered: a failed deletion must not undo that
            apply_retention(self.jobdir.checkpoints, self.keep, keys=self.keys)
        except OSError as e:
            logger.warning("cfrun agent: retention after step %d failed: %r", step, e)

    def supersede(self, req: PersistRequest) -> list[int]:
        """``req``'s rank hands off ``req.step`` (writer thread, under the agent's local lock,
        before its shard is written): every pending step before it that lacks this rank's shard
        can never complete, so it fails now (:meth:`_fail_superseded`). Returns those steps
        (the server refuses their later shards unwritten)."""
        doomed = sorted(s for s, shard in self.pending.items()
                        if s < req.step and req.rank not in shard)
        for step in doomed:
            self._fail_superseded(step, req.step, req.rank)
        return doomed

    def _fail_superseded(self, step: int, later_step: int, rank: int) -> None:
        """Fail the pending ``step``: ``rank`` went on to ``later_step`` without a shard of it
        (or ``later_step`` committed). Warning, ``step_superseded`` event, failure reply to
        every rank of the step, its staging files (this node's) removed. Never raises."""
        shard = self.pending.pop(step, {})
        world = {req.world_size for _, _, req in shard.values()} if self.nnodes == 1 else set()
        missing = sorted(set(range(max(world, default=0))) - set(shard))
        error = (f"step {step} superseded: rank {rank} handed off step {later_step} without a "
                 f"shard of step {step} (the ranks checkpointed at different steps)")
        logger.warning("cfrun agent: %s; failing it now", error)
        self.failed += 1
        self.jobdir.emit_event("step_superseded", step=step, later_step=later_step, rank=rank,
                               node=self.node_rank, **({"missing_ranks": missing} if missing
                                                       else {}))
        self._remove_shards(step, set(shard))
        failed = PersistFailed(step, error[:MAX_ERROR_CHARS])
        for _, c, _ in shard.values():
            self.reply(c, failed)

    def _remove_shards(self, step: int, ranks: set[int]) -> None:
        """Remove ``step``'s staging files: with one node the whole staging directory, with
        several ``ranks``' shards only (the other nodes' agents write there too)."""
        staging = staging_dir(self.jobdir.checkpoints, step)
        if self.nnodes == 1:
            shutil.rmtree(staging, ignore_errors=True)
            return
        for rank in ranks:
            for name in shard_names(rank):
                try:
                    (staging / name).unlink(missing_ok=True)
                except OSError:
                    pass

    def fail_step(self, conn: socket.socket, req: PersistRequest, error: str) -> None:
        """Writing or committing ``req``'s step failed (writer thread, under the agent's local
        lock): every rank of the step collected so far and ``conn`` get a failure reply, and
        the step's staging files are removed (with one node the whole staging directory, with
        several this node's shards only: the other nodes' agents write there too). Never
        raises."""
        self.failed += 1
        shard = self.pending.pop(req.step, {})
        conns = [c for _, c, _ in shard.values()]
        if conn not in conns:
            conns.append(conn)
        self._remove_shards(req.step, {req.rank, *shard})
        failed = PersistFailed(req.step, error[:MAX_ERROR_CHARS])
        for c in conns:
            self.reply(c, failed)

    # ------------------------------------------------------------------ several nodes

    def _node_done(self, step: int, world_size: int) -> None:
        """Every local rank's shard of ``step`` is durable: publish this node's mark (its files
        with their checksums), then commit if every node's mark is there, else wait for them on
        a thread of its own (the ranks get their reply once the step is committed)."""
        shard = self.pending.pop(step)
        files = [f for r in sorted(shard) for f in shard[r][0]]
        t_trigger = min(r.trigger_or(time.time()) for _, _, r in shard.values())
        conns = [c for _, c, _ in shard.values()]
        try:
            self.marks.publish(step, sorted(shard), files, t_trigger)
        except OSError:  # the caller fails the step (fail_step): every rank hears it
            self.pending[step] = shard
            raise
        meta = {**next(iter(shard.values()))[2].commit_meta(), **self.job_meta}
        abandon = threading.Event()
        self.waiting[step] = abandon
        threading.Thread(target=self._await_nodes, name=f"cfrun-await-{step}", daemon=True,
                         args=(step, world_size, meta, conns, t_trigger, abandon)).start()

    def _await_nodes(self, step: int, world_size: int, meta: dict[str, Any],
                     conns: list[socket.socket], t_trigger: float, abandon: threading.Event
                     ) -> None:
        t0 = time.time()
        error: str | None = None
        while True:
            try:
                outcome = self.marks.try_commit(step, world_size, meta, abandon)
            except Superseded as e:  # another node will never mark it: fail it now
                error = str(e)
                self.failed += 1
                logger.warning("cfrun agent: %s; failing it now", error)
                self.jobdir.emit_event("step_superseded", step=step, later_step=e.later_step,
                                       node=e.node)
                outcome = (False, 0, False)
                break
            except Exception as e:  # a full disk, a bad mark: the ranks hear it, we go on
                error = f"commit of step {step} failed: {e!r}"
                self.failed += 1
                logger.warning("cfrun agent: %s", error)
                self.jobdir.emit_event("persist_failed", step=step, error=repr(e))
                outcome = (False, 0, False)
                break
            if outcome is not None:
                break
            if abandon.wait(0.02):
                continue  # the next try_commit takes the abandon path under the lock
        self.waiting.pop(step, None)
        committed, nbytes, by_me = outcome
        t1 = time.time()
        reply: Persisted | PersistFailed
        if error is not None:
            reply = PersistFailed(step, error[:MAX_ERROR_CHARS])
        elif not committed:
            reply = PersistFailed(step, "abandoned: the ranks restarted before every node's "
                                  "shard arrived")
        else:
            self.committed(step)
            reply = Persisted(step, nbytes, "local", round(t1 - t0, 6), round(t1 - t_trigger, 6),
                              round(nbytes / max(t1 - t0, 1e-9)))
            if by_me:
                self.jobdir.emit_event("commit", step=step, bytes=nbytes, nodes=self.nnodes,
                                       persist_s=reply.persist_s, pgt_s=reply.pgt_s,
                                       tier="local")
        for c in conns:
            self.reply(c, reply)

    def abandon_waiting(self) -> None:
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

    def drop_own_marks(self) -> None:
        """At start (several nodes): remove this node's marks of steps not committed; they
        belong to an agent of this node that died."""
        self.marks.drop_own()
