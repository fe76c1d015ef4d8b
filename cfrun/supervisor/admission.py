"""Whether and how a run may take its job dir: the job's identity, checked before anything is
written, then recorded once the lock is held.

A job dir belongs to the command that started it (:class:`cfrun.contract.config.Identity`: the
script's hash, its arguments, the world size). A run with another command is refused (exit 2,
nothing touched), goes on with ``--accept-changed-command`` (a ``command_changed`` event), or,
when the job had finished, starts over at step 0 with the finished run's checkpoints set aside
(issue 37, item 2); a finished job run again with the same command has nothing to do
(``--rerun`` runs it again). Checkpoints of another job found in ``checkpoints/`` are set aside,
never resumed from. ``cfrun --dry-run`` says what a run would do (:func:`dry_run_outcome`).
Supervisor's main thread; reads only until :meth:`Admission.take`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from cfrun.contract import coordination
from cfrun.contract.checkpoints import committed_steps, is_final
from cfrun.contract.config import (
    ACCEPTED,
    FINISHED,
    Command,
    Identity,
    RunConfig,
    WorldSizeRefusedError,
    check_identity,
    resume_command,
)
from cfrun.contract.errors import (
    BadInputError,
    ChangedCommandError,
    FatalJobError,
    JobDirLockedError,
)
from cfrun.contract.jobdir import (
    FOREIGN_PREFIX,
    PREVIOUS_CHECKPOINTS_PREFIX,
    JobDir,
    atomic_write_json,
    step_dir_name,
)
from cfrun.contract.manifest import read_manifest
from cfrun.supervisor.machine import SupervisorState

logger = logging.getLogger("cfrun")


def dry_run_outcome(cfg: RunConfig, *, accept_changed_command: bool = False,
                    rerun: bool = False) -> str:
    """What a run of ``cfg`` would do with its job dir, for ``cfrun --dry-run`` (issue 27,
    item 8): ``new``, ``resume from step N``, ``start over`` (no checkpoint), ``finished``
    (nothing to do), ``refused`` (a changed command, exit 2) or ``locked`` (exit 3), with the
    reason. Reads only, as :meth:`Supervisor.run` decides before it writes anything."""
    jd = JobDir(cfg.job_dir)
    if not jd.root.exists():
        return "new: the job dir does not exist yet; the job starts at step 0"
    steps = committed_steps(jd.checkpoints)
    try:
        _, changes, _ = check_identity(
            jd.identity_path, Command.of(cfg), job_name=cfg.job_name,
            accept_changed=accept_changed_command, nnodes=cfg.nnodes, resumable=bool(steps),
            reshard=cfg.reshard)
    except BadInputError as e:
        fresh = finished_changed(jd, cfg, e)
        if fresh is not None:
            return (f"start at step 0: the job finished {fresh} and its command changed; its "
                    f"checkpoints would be moved to {jd.root / PREVIOUS_CHECKPOINTS_PREFIX}"
                    "<UTC time>")
        return f"refused (exit 2): {e}"
    except WorldSizeRefusedError as e:
        return f"refused (exit 5): {e}"
    finished = None if changes or rerun else finished_at(jd, cfg.node_rank)
    if finished is not None:
        return f"finished {finished}: nothing to do (exit 0; --rerun runs it again)"
    if jd.is_locked():
        return "locked (exit 3): another cfrun runs this job"
    resumable = [s for s in steps if not is_final(jd.checkpoints / step_dir_name(s))]
    if resumable:  # a resume never starts from the final checkpoint (issue 27, item 2)
        why = " (changed command accepted)" if changes else ""
        try:
            saved = read_manifest(jd.checkpoints / step_dir_name(resumable[0])).world_size
        except Exception:  # unreadable: the ranks judge it
            saved = None
        world = cfg.nproc_per_node * cfg.nnodes
        if saved is not None and saved != world:
            why = (f" resharded from {saved} to {world} ranks (--reshard; not bit-exact)"
                   if cfg.reshard else "")
            if not cfg.reshard:
                return (f"refused (exit 5): checkpoint step {resumable[0]} was written by "
                        f"{saved} ranks and this run has {world}; add --reshard")
        return f"resume from the checkpoint of step {resumable[0]}" + why
    return "start at step 0: the job dir holds no checkpoint"


def finished_changed(jd: JobDir, cfg: RunConfig, refusal: BadInputError) -> str | None:
    """``"at step N on DATE"`` where ``refusal`` refused a changed command (the script edited,
    other arguments) in the job dir of a job that finished (:func:`finished_at`) on one node,
    and no ``--accept-changed-command`` asked to go on from its checkpoints: such a run starts
    over, from step 0, with the finished run's checkpoints set aside (issue 37, item 2). None:
    the refusal stands (an unfinished job's checkpoints are work to go on from). Reads only."""
    if not isinstance(refusal, ChangedCommandError) or cfg.nnodes != 1:
        return None
    return finished_at(jd, cfg.node_rank)


def finished_at(jd: JobDir, node_rank: int) -> str | None:
    """``"at step N on DATE"`` when this node's last attempt of the job in ``jd`` succeeded
    (its last ``state`` event is ``succeeded`` and no attempt started since) and the job
    committed a checkpoint, else None: a run that never committed one (``cfrun profile``, a
    script's ``-h``) did no training to protect, so its command runs again.

    The step is the newest any rank's heartbeat reached (the script's end), else the newest
    committed checkpoint; the date is the event's, in UTC. Reads only; never raises for a
    missing or unreadable events file (None).
    """
    last_state: dict[str, Any] | None = None
    if not committed_steps(jd.checkpoints):
        return None
    try:
        events = jd.read_events()
    except Exception:  # unreadable: not known to be finished
        return None
    for e in events:
        if e.get("node", 0) != node_rank:
            continue
        if e.get("event") == "state":
            last_state = e
        elif e.get("event") == "attempt_start":
            last_state = None
    if last_state is None or last_state.get("state") != SupervisorState.SUCCEEDED.value:
        return None
    beat = coordination.newest_heartbeat_step(jd.root)
    steps = [beat] if beat is not None else committed_steps(jd.checkpoints)[:1]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(last_state.get("t_unix_s",
                                                                                   0))))
    return f"at step {max(steps)} on {when}" if steps else f"on {when}"


def drop_untrained(jd: JobDir, cfg: RunConfig, state: SupervisorState,
                   made: list[Path]) -> None:
    """After a run that created its default job dir (no ``--job-dir``; ``made``: the
    directories it created, outermost first), in ``state``: remove them again when no rank
    made an optimizer step (no heartbeat, no checkpoint, no ``unprotected`` record of a
    script cfrun could not see train) and the run ended by itself (succeeded, failed, fatal;
    a preempted one keeps its resume line), saying so in one line. A ``-h``, an argparse
    typo, a script that fails at its import leave nothing behind; a job dir is there only
    for runs that trained (issue 37, item 4). One node only (several share it)."""
    import shutil

    if cfg.nnodes != 1 or state not in (
            SupervisorState.SUCCEEDED, SupervisorState.FAILED, SupervisorState.FATAL):
        return
    if coordination.heartbeat_paths(jd.root) or committed_steps(jd.checkpoints) \
            or jd.is_locked():
        return
    try:  # a script without a torch optimizer trains unseen: its record stays
        if any(e.get("event") == "unprotected" for e in jd.read_events()):
            return
    except Exception:  # unreadable: keep it
        return
    shutil.rmtree(jd.root, ignore_errors=True)
    for d in reversed(made[:-1]):  # ./cfrun-jobs when this run made it and it is empty
        try:
            d.rmdir()
        except OSError:
            pass
    logger.info("cfrun: no optimizer step was made, so job dir %s is removed (cfrun keeps "
                "the default job dirs of runs that trained; --job-dir keeps one anyway)",
                jd.root)


class Admission:
    """The job's identity on its job dir for one run of ``cfg`` (:meth:`check`, then
    :meth:`take` with the lock held).

    Args:
        cfg: the run's settings (its command, job name, nodes, ``--reshard``).
        jobdir: the job dir.
        accept_changed: ``--accept-changed-command``.
        rerun: ``--rerun`` (a finished job's command runs again).
    """

    def __init__(self, cfg: RunConfig, jobdir: JobDir, *, accept_changed: bool,
                 rerun: bool) -> None:
        self.cfg = cfg
        self.jobdir = jobdir
        self.accept_changed = accept_changed
        self.rerun = rerun
        self.identity: Identity | None = None
        self.changes: list[str] = []
        self._write = False
        self._fresh: str | None = None  # a finished job whose command changed: "at step N ..."

    def check(self) -> bool:
        """Check the command against the job dir's identity (reads only: a refused command
        changes nothing). Returns True when the job finished and has nothing to do (said in
        one line, with the ``--rerun`` command).

        Raises:
            BadInputError: a changed command (exit 2).
            JobDirLockedError: the job runs under another cfrun (exit 3).
            WorldSizeRefusedError: another world size without ``--reshard`` (exit 5).
        """
        jd, cfg = self.jobdir, self.cfg
        command = Command.of(cfg)
        try:
            self.identity, self.changes, self._write = check_identity(
                jd.identity_path, command, job_name=cfg.job_name,
                accept_changed=self.accept_changed, nnodes=cfg.nnodes,
                resumable=bool(committed_steps(jd.checkpoints)), reshard=cfg.reshard)
        except BadInputError as e:
            if jd.is_locked():  # the job runs: that is the news (exit 3)
                raise JobDirLockedError(
                    f"job dir {str(jd.root)!r} is in use by another cfrun") from None
            self._fresh = finished_changed(jd, cfg, e)
            if self._fresh is None:
                raise
            self.identity, self.changes, self._write = check_identity(
                jd.identity_path, command, job_name=cfg.job_name, accept_changed=False,
                nnodes=cfg.nnodes, resumable=False, why=FINISHED)
        finished = None if self.changes or self.rerun else finished_at(jd, cfg.node_rank)
        if finished is None:
            return False
        resumable = [s for s in committed_steps(jd.checkpoints)
                     if not is_final(jd.checkpoints / step_dir_name(s))]
        rerun_from = f"from its checkpoint of step {resumable[0]}" if resumable \
            else "from step 0"
        logger.info("cfrun: job %s finished %s; nothing to do. An edited script or "
                    "other arguments start a new run (its checkpoints kept aside), so "
                    "does a new --job-dir; to run it again %s: %s", jd.root, finished,
                    rerun_from, resume_command(jd.root, cfg.node_rank, "--rerun"))
        return True

    def take(self) -> Identity | None:
        """With the lock held: a finished job with a changed command starts over (its
        checkpoints set aside), the identity is recorded, other jobs' checkpoints are set
        aside. Returns the job's identity (None for ``cfrun profile``, which has none).

        Raises:
            OSError: the job dir cannot be written.
            FatalJobError: another job's checkpoint cannot be moved aside.
        """
        previous = self._start_over(self._fresh, self.changes) if self._fresh is not None \
            else None
        if self.identity is not None:
            self._take_identity(self.identity, self.changes, self._write, previous)
        return self.identity

    def _start_over(self, finished: str, changes: list[str]) -> Path:
        """With the lock held: a finished job's command changed (``finished``: when it
        finished). Its ``checkpoints/`` go aside (:meth:`JobDir.set_aside_checkpoints`), its
        heartbeats (the old run's steps) are removed, and one line says so; returns where the
        checkpoints went."""
        previous = self.jobdir.set_aside_checkpoints()
        for hb in coordination.heartbeat_paths(self.jobdir.root):
            hb.unlink(missing_ok=True)
        logger.info("cfrun: job %s finished %s and its command changed (%s): a new run starts "
                    "at step 0; the finished run's checkpoints are kept in %s", self.jobdir.root,
                    finished, "; ".join(changes), previous)
        return previous

    def _take_identity(self, identity: Identity, changes: list[str], write: bool,
                       previous: Path | None = None) -> None:
        """With the lock held: record the job's identity (new, or a change accepted with
        ``--accept-changed-command``: a ``command_changed`` event and a warning; or a finished
        job started over, its checkpoints set aside in ``previous``: the event) and set aside
        checkpoints of another job found in ``checkpoints/`` (never resumed from)."""
        if write:
            atomic_write_json(self.jobdir.identity_path, identity.to_json())
        if changes:
            why = identity.changes[-1].get("why", ACCEPTED)
            if previous is None:  # a started-over job said so already (_start_over)
                logger.warning("cfrun: going on with a changed command (%s): %s", why,
                               "; ".join(changes))
            self.jobdir.emit_event(
                "command_changed", changed=changes, fingerprint=identity.command.fingerprint,
                why=why, **({"previous_checkpoints": str(previous)} if previous else {}))
        self._set_aside_foreign(identity)

    def _set_aside_foreign(self, identity: Identity) -> None:
        """Move committed checkpoints whose manifest names another job id aside
        (``foreign-step-N-<ms>``), with a ``foreign_checkpoint`` event each. Checkpoints without
        a job id (an older cfrun wrote them into this job dir) stay."""
        checkpoints = self.jobdir.checkpoints
        for step in committed_steps(checkpoints):
            src = checkpoints / step_dir_name(step)
            try:
                job_id = read_manifest(src).meta.get("job_id")
            except Exception:  # an unreadable one is the resume's to judge and set aside
                continue
            if job_id is None or identity.owns(job_id):
                continue
            dst = checkpoints / f"{FOREIGN_PREFIX}{src.name}-{int(time.time() * 1000)}"
            try:
                os.rename(src, dst)
            except FileNotFoundError:  # another node's supervisor moved it
                continue
            except OSError as e:
                raise FatalJobError(f"checkpoint {src} is another job's (job id {job_id}) and "
                                    f"cannot be moved aside ({e.strerror}); remove it") from None
            logger.warning("cfrun: %s is another job's checkpoint (job id %s, this job %s); "
                           "moved aside to %s, never resumed from", src, job_id,
                           identity.job_id, dst.name)
            self.jobdir.emit_event("foreign_checkpoint", step=step, job_id=str(job_id),
                                   path=str(dst))
