"""The nodes' marks: how the agents of several nodes sharing one job dir commit a step together.

Runs in the persist agent (``cfrun.agent.server``) of a job with several nodes, on the threads
of :class:`cfrun.agent.commit.Committer`. Once its own ranks' shards of a step are durable, a
node's agent publishes a *mark* in the step's staging directory
(``checkpoints/.staging-step-NNNNNN/node-00001.json``: the node's ranks and its files with their
checksums, :meth:`NodeMarks.publish`); whichever agent then finds every node's mark commits the
step, under one file lock in ``checkpoints/`` for all of them (:meth:`NodeMarks.try_commit`).

A node whose mark of a later step is in the job dir while its mark of ``s`` is not will never
complete ``s`` (each rank hands off a checkpoint only after the previous one's reply): ``s``
fails at once (:class:`Superseded`) instead of waiting for a mark that never comes (issue 22).

What lives here is only what the nodes share on disk (the marks, the commit lock); the shards
collected in this agent's memory and the replies to its ranks stay with the
:class:`~cfrun.agent.commit.Committer`.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import filelock

from cfrun.contract.checkpoints import (
    FileEntry,
    commit,
    committed_steps,
    read_manifest,
    staging_dir,
)
from cfrun.contract.errors import CheckpointCorruptError, IncompatibleFormatError
from cfrun.contract.jobdir import (
    STAGING_PREFIX,
    JobDir,
    atomic_write_json,
    parse_step_dir_name,
    step_dir_name,
)
from cfrun.contract.manifest import ManifestKeys


class Superseded(RuntimeError):
    """A step waiting for other nodes can never commit: a node went past it (several nodes)."""

    def __init__(self, step: int, later_step: int, node: int) -> None:
        super().__init__(f"step {step} superseded: node {node} went on to step {later_step} "
                         f"without its shards of step {step} (the ranks checkpointed at "
                         "different steps)")
        self.step, self.later_step, self.node = step, later_step, node


def _staging_steps(checkpoints: Path) -> dict[int, Path]:
    """The staging directories in ``checkpoints`` (``.staging-step-NNNNNN``) by step."""
    out = {}
    try:
        for p in checkpoints.iterdir():
            step = parse_step_dir_name(p.name[len(STAGING_PREFIX):]) \
                if p.name.startswith(STAGING_PREFIX) else None
            if step is not None:
                out[step] = p
    except OSError:
        pass
    return out


def _manifest_bytes(step_dir: Path) -> int:
    try:
        return read_manifest(step_dir).nbytes
    except (CheckpointCorruptError, IncompatibleFormatError):
        return 0


class NodeMarks:
    """This node's view of the marks in the shared job dir, and the commit they allow.

    Not thread-safe by itself: every read and change of the marks that decides a commit is
    made under the commit lock (:meth:`commit_lock`), which all nodes' agents share.

    Args:
        jobdir: the job dir (its ``checkpoints/``), shared by every node.
        nnodes, node_rank: the job's nodes, and this agent's.
        keep: committed checkpoints to keep (retention, applied by the commit).
        keys: the job's manifest keys (every manifest committed carries their MAC), or None.
    """

    def __init__(self, jobdir: JobDir, *, nnodes: int, node_rank: int, keep: int,
                 keys: ManifestKeys | None) -> None:
        self.jobdir = jobdir
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.keep = keep
        self.keys = keys

    def path(self, step: int, node_rank: int | None = None) -> Path:
        """``node-NNNNN.json`` in ``step``'s staging directory: the mark of ``node_rank``
        (this node's when None)."""
        node = self.node_rank if node_rank is None else node_rank
        return staging_dir(self.jobdir.checkpoints, step) / f"node-{node:05d}.json"

    def commit_lock(self) -> filelock.FileLock:
        """One lock for every commit and abandon in the shared job dir (all nodes' agents)."""
        return filelock.FileLock(str(self.jobdir.commit_lock_path))

    def publish(self, step: int, ranks: list[int], files: list[FileEntry],
                t_trigger: float) -> None:
        """Write this node's mark of ``step`` (atomically): its ``ranks``, their durable
        ``files`` with checksums and the earliest trigger time (``t_trigger``, unix seconds).

        Raises:
            OSError: the mark could not be written (the caller fails the step).
        """
        atomic_write_json(self.path(step), {
            "node_rank": self.node_rank, "ranks": ranks,
            "files": [vars(f) for f in files], "t_trigger_unix_s": t_trigger})

    def try_commit(self, step: int, world_size: int, meta: dict[str, Any],
                   abandon: threading.Event) -> tuple[bool, int, bool] | None:
        """Under the commit lock: ``(True, bytes, by_me)`` once ``step`` is committed (by any
        node), ``(False, 0, False)`` when abandoned (this node's mark removed, so the step can
        never commit), ``None`` while other nodes' marks are missing.

        Raises:
            Superseded: this node's mark is gone (a later step committed) or another node
                went past ``step`` without marking it (this node's mark is then removed).
            RuntimeError: the marks do not hold ranks ``0..world_size-1``.
            OSError, CheckpointCorruptError, KeyError: the commit failed (a full disk) or a
                mark is bad; the caller fails the step.
        """
        checkpoints = self.jobdir.checkpoints
        final = checkpoints / step_dir_name(step)
        with self.commit_lock():
            if (final / "manifest.json").is_file():
                return True, _manifest_bytes(final), False
            if abandon.is_set():
                self.path(step).unlink(missing_ok=True)
                return False, 0, False
            if not self.path(step).is_file():  # a later step committed, and its
                # cleanup removed this staging dir: this step can never commit
                later = max(committed_steps(checkpoints), default=step)
                raise Superseded(step, later, self.node_rank)
            marks = []
            for node in range(self.nnodes):
                try:
                    marks.append(json.loads(self.path(step, node).read_text()))
                except (OSError, ValueError):
                    past = self._went_past(step, node)
                    if past is None:
                        return None
                    self.path(step).unlink(missing_ok=True)  # it can never commit
                    raise Superseded(step, past, node) from None
            files = [FileEntry.from_json(f, f"step {step} node mark") for m in marks
                     for f in m["files"]]
            ranks = sorted(r for m in marks for r in m["ranks"])
            if ranks != list(range(world_size)):
                raise RuntimeError(f"step {step}: the nodes' marks hold ranks {ranks}, not "
                                   f"0..{world_size - 1}")
            commit(checkpoints, step, files, world_size=world_size, meta=meta, keep=self.keep,
                   keys=self.keys)
            for old, p in _staging_steps(checkpoints).items():  # they can no longer complete
                if old < step:
                    shutil.rmtree(p, ignore_errors=True)
            return True, sum(f.nbytes for f in files), True

    def _went_past(self, step: int, node: int) -> int | None:
        """A later step than ``step`` that ``node`` has marked, still staging (under the commit
        lock): ``node``'s ranks went past ``step`` and will never mark it (each rank hands off
        a checkpoint only after the previous one's reply). None if there is none. Committed
        steps do not count: one newer than the resume step may be left from an earlier attempt
        (resumed from an older checkpoint), where staging marks are not (a node's agent
        removes its own at its ranks' hello and at its start)."""
        checkpoints = self.jobdir.checkpoints
        for s in sorted(_staging_steps(checkpoints)):
            if s > step and self.path(s, node).is_file():
                return s
        return None

    def drop_own(self) -> None:
        """At the agent's start: remove this node's marks of steps not committed (under the
        commit lock); they belong to an agent of this node that died."""
        checkpoints = self.jobdir.checkpoints
        if not checkpoints.is_dir():
            return
        with self.commit_lock():
            for p in checkpoints.iterdir():
                if p.name.startswith(STAGING_PREFIX):
                    (p / f"node-{self.node_rank:05d}.json").unlink(missing_ok=True)
