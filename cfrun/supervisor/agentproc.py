"""The node's persist agent as a process of the supervisor: started, checked, restarted, stopped.

The agent (:mod:`cfrun.agent`) persists the ranks' snapshots and commits them; it outlives rank
restarts (its own process group) and dies with the supervisor (a parent-death signal). Each
start gets a new random socket name, given in its environment (a command line is every user's),
and is in service once the process answering there is the one started (``SO_PEERCRED``) and
``agent.json`` names it. Called from the supervisor's main thread only (``PR_SET_PDEATHSIG`` is
tied to the thread that forks).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from cfrun.contract import ipc, slots
from cfrun.contract import settings as E
from cfrun.contract.config import Identity, RunConfig
from cfrun.contract.errors import FatalJobError
from cfrun.contract.jobdir import JobDir
from cfrun.contract.jobkey import ensure_job_key
from cfrun.supervisor.launcher import die_with_parent, module_argv
from cfrun.supervisor.machine import describe_returncode as _describe

logger = logging.getLogger("cfrun")


class AgentProcess:
    """The persist agent of one supervisor (node ``cfg.node_rank``).

    Args:
        cfg: the job's settings (keep, world size, peer, level-2 URL, nodes).
        jobdir: the job dir (its key, its slot directory, ``agent.json``).
    """

    def __init__(self, cfg: RunConfig, jobdir: JobDir) -> None:
        self.cfg = cfg
        self.jobdir = jobdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.slot_dir: Path | None = None
        """The job's private slot directory (:mod:`cfrun.contract.slots`)."""

    def start(self, identity: Identity | None) -> bytes:
        """Start the node's persist agent (its own process group: it outlives rank restarts;
        it is SIGKILLed when the supervisor dies). Main thread only (PR_SET_PDEATHSIG).

        Each start gets a new random socket name; the agent is in service once the process
        answering there is the one started (pid and uid, ``SO_PEERCRED``) and ``agent.json``
        names it. If another process answers (it took the name first), that is said in one
        line, the agent is stopped and started again under a new name (3 tries). Returns the
        job's key (``job.key``, made first if the job dir has none).

        Raises:
            FatalJobError: no agent came up.
            BadInputError: ``--job-key-file`` is not this job dir's key.
        """
        # every job dir has its own job.key: its manifests carry a MAC under it, which the
        # ranks check at resume (issue 32, finding 4); with --peer and no --job-key-file, seals
        # at the peer and level 2 are under the token (an older cfrun's job.key still counts)
        key = ensure_job_key(self.jobdir.root, self.cfg.job_key_file)
        if self.slot_dir is None:
            self.slot_dir = slots.create_dir(self.cfg.job_dir)
        for _ in range(3):
            address = ipc.new_agent_address()
            if self._launch(address, identity):
                return key
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        raise FatalJobError("the persist agent did not start (see its output above)")

    def _launch(self, address: str, identity: Identity | None) -> bool:
        """Start an agent at ``address``; True once it answers there and ``agent.json`` names
        it, False if it died or another process answers."""
        argv = [*module_argv("cfrun.agent"), "--job-dir", str(Path(self.cfg.job_dir).absolute()),
                "--keep", str(self.cfg.keep),
                "--world-size", str(self.cfg.nnodes * self.cfg.nproc_per_node)]
        # the address and the level-2 URL (it may hold a password) go in the environment,
        # which only this user reads: a command line is every user's (/proc/PID/cmdline), and
        # a local user who read the address there bound it first (issue 24, items 5 and 7)
        env = {**os.environ, E.AGENT_ADDRESS: address}
        env.pop(E.PERSIST_TO, None)
        if self.slot_dir is not None:
            argv += ["--slot-dir", str(self.slot_dir)]
        if self.cfg.peer:
            argv += ["--peer", self.cfg.peer, "--peer-token-file", str(self.cfg.peer_token_file),
                     "--peer-streams", str(self.cfg.peer_streams)]
            if self.cfg.job_key_file:
                argv += ["--per-job-key"]  # ensured in the job dir's job.key
        if identity is not None:
            argv += ["--peer-job", identity.job_name]
        if self.cfg.persist_to:
            env[E.PERSIST_TO] = self.cfg.persist_to
        if self.cfg.nnodes > 1:
            argv += ["--nnodes", str(self.cfg.nnodes), "--node-rank", str(self.cfg.node_rank),
                     "--local-world-size", str(self.cfg.nproc_per_node)]
        # dies with the supervisor: a SIGKILLed cfrun leaves no agent holding the socket
        self.proc = subprocess.Popen(argv, start_new_session=True, cwd="/",  # not the user's
                                      env=env, preexec_fn=die_with_parent())
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                ipc.connect(self.cfg.job_dir, timeout_s=1.0, address=address,
                            expect_pid=self.proc.pid).close()
            except ipc.RefusedPeer:
                return False  # another process answers there (said in one line)
            except OSError:
                time.sleep(0.05)
                continue
            try:
                if ipc.read_agent_record(self.cfg.job_dir).pid == self.proc.pid:
                    return True
            except OSError:
                pass  # not written yet (or an old one)
            time.sleep(0.05)
        return False

    def check(self, identity: Identity | None) -> None:
        """Restart the agent if it died; ranks reconnect at their next checkpoint."""
        if self.proc is None or self.proc.poll() is None:
            return
        rc = self.proc.returncode
        logger.warning("cfrun: the persist agent died (%s); restarting it", _describe(rc))
        self.jobdir.emit_event("agent_restart", returncode=rc)
        self.start(identity)

    def stop(self, deadline_s: float | None = None, *, second_signal: bool = False) -> None:
        """Let the agent finish queued persists (SIGTERM), then make sure it is gone.

        ``deadline_s`` (monotonic seconds; preemption): SIGKILL it if it is still running
        then; an unfinished checkpoint stays uncommitted (staging is never visible). After a
        second signal it is killed at once; otherwise it gets 120 s.
        """
        agent = self.proc
        if agent is not None and agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
            if second_signal:
                wait_s = 0.0
            elif deadline_s is not None:
                wait_s = max(0.0, deadline_s - time.monotonic())
            else:
                wait_s = 120.0
            try:
                agent.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                if deadline_s is not None and not second_signal:
                    logger.warning("cfrun: the persist agent did not finish by the grace "
                                   "deadline; killed it (what it was writing is not committed)")
                agent.kill()
                try:
                    agent.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    pass
        self.proc = None
        slots.remove_dirs(self.jobdir.root)
        self.slot_dir = None
