"""Every ``CFRUN_*`` environment variable, in one place.

Precedence of ``cfrun [run]``'s settings: command-line flag > environment variable > default.
``cfrun resume JOBDIR`` takes every setting from the job dir's ``config.json`` instead (the
variables below do not change a resumed job; only ``--node-rank``/``CFRUN_NODE_RANK`` picks
the node); it sets the environment variables recorded there (prefixes ``CFRUN_``, ``CUDA_``,
``OMP_``, ``PYTHON``, ``NCCL_``, ``MKL_``) where the current environment lacks them, and runs the
script in the recorded working directory. The launcher passes the resolved values to the ranks
through the ``CFRUN_RANK_*`` variables below; users do not set those.
"""

from __future__ import annotations

# User-facing settings (each is also a flag of `cfrun`).
JOB_DIR = "CFRUN_JOB_DIR"
INTERVAL = "CFRUN_INTERVAL"
OVERHEAD = "CFRUN_OVERHEAD"
MTBF = "CFRUN_MTBF"
NPROC_PER_NODE = "CFRUN_NPROC_PER_NODE"
MAX_RESTARTS = "CFRUN_MAX_RESTARTS"
KEEP = "CFRUN_KEEP"
GRACE = "CFRUN_GRACE"
INJECT_CRASH = "CFRUN_INJECT_CRASH"
HANG_TIMEOUT = "CFRUN_HANG_TIMEOUT"
CRASH_LOOP = "CFRUN_CRASH_LOOP"
DEBUG = "CFRUN_DEBUG"
SHARD = "CFRUN_SHARD"
"""``0``: every data-parallel rank persists its whole state; ``rank0``: rank 0 alone persists
the replicated tensors; default ``1``: each rank persists 1/N of them (DeepFreeze)."""
EVENTS_ALL_RANKS = "CFRUN_EVENTS_ALL_RANKS"
"""``1``: ranks other than 0 also log each checkpoint (``checkpoint_rank`` events)."""
NNODES = "CFRUN_NNODES"
NODE_RANK = "CFRUN_NODE_RANK"
"""This node's index in a multi-node job (torchrun ``--node-rank``); also names this node's
config, lock, agent socket and snapshot slots in the shared job dir."""
RDZV_ENDPOINT = "CFRUN_RDZV_ENDPOINT"
RDZV_ID = "CFRUN_RDZV_ID"
PEER = "CFRUN_PEER"
"""``HOST:PORT`` of a ``cfrun peer``: checkpoints go to its RAM (ACUTE level 1)."""
PEER_TOKEN_FILE = "CFRUN_PEER_TOKEN_FILE"
"""File holding the peer's shared secret (``cfrun --peer-token-file`` and ``cfrun peer
--token-file``)."""
PEER_STREAMS = "CFRUN_PEER_STREAMS"
PEER_JOB = "CFRUN_PEER_JOB"
"""The job's name at the peer and at level 2 (default: the job dir's name)."""
PERSIST_TO = "CFRUN_PERSIST_TO"
PEER_LISTEN = "CFRUN_PEER_LISTEN"
PEER_FLUSH_TO = "CFRUN_PEER_FLUSH_TO"
PEER_SLOTS = "CFRUN_PEER_SLOTS"
PEER_MAX_CHECKPOINT_BYTES = "CFRUN_PEER_MAX_CHECKPOINT_BYTES"
PEER_KEEP = "CFRUN_PEER_KEEP"
FF_EVAL = "CFRUN_FF_EVAL"
TEST_KILL_BEFORE_COMMIT = "CFRUN_TEST_KILL_BEFORE_COMMIT"
TEST_CKPT_STALL = "CFRUN_TEST_CKPT_STALL"
"""Testing aid, ``SECONDS@FIRST-LAST``: every checkpoint taken at a step in [FIRST, LAST) holds
the training thread for SECONDS more (a checkpoint made expensive by outside pressure, e.g. a
saturated disk, at chosen steps: what the adaptive tuner must react to)."""
"""Testing aid: in attempt 0, SIGKILL the rank after its shard of this step is written and
before the checkpoint commits (a crash in the middle of a checkpoint)."""

# Set by the launcher for the ranks (the hook activates only where ACTIVE is set).
RANK_ACTIVE = "CFRUN_RANK_ACTIVE"
RANK_SETTINGS = "CFRUN_RANK_SETTINGS"
RANK_JOB_DIR = "CFRUN_RANK_JOB_DIR"
RANK_INTERVAL = "CFRUN_RANK_INTERVAL"
RANK_KEEP = "CFRUN_RANK_KEEP"
RANK_OVERHEAD = "CFRUN_RANK_OVERHEAD"
RANK_MTBF_S = "CFRUN_RANK_MTBF_S"
RANK_PROFILE_ONLY = "CFRUN_RANK_PROFILE_ONLY"
RANK_SCRIPT = "CFRUN_RANK_SCRIPT"
RANK_ATTEMPT = "CFRUN_RANK_ATTEMPT"
RANK_INJECT_CRASH = "CFRUN_RANK_INJECT_CRASH"
RANK_FF_EVAL = "CFRUN_RANK_FF_EVAL"
RANK_AGENT = "CFRUN_RANK_AGENT"
"""``1`` when the supervisor runs a persist agent for this job (two-phase checkpoints)."""
RANK_SUPERVISOR_PID = "CFRUN_RANK_SUPERVISOR_PID"
"""Pid of the supervisor that started this torchrun; marks every process of the job (inherited
by ranks, workers and their children) so that none outlives the supervisor
(cfrun.supervisor.launcher.kill_job_processes)."""
HOOK_OWNER_PID = "CFRUN_HOOK_OWNER_PID"
"""Pid of the rank process whose hook is live; children that inherit it stay inert."""
PREV_SITECUSTOMIZE_PATH = "CFRUN_PREV_PYTHONPATH"
"""The PYTHONPATH the user had, so the hook can chain the user's own sitecustomize."""


def node_rank() -> int:
    """This process's node in a multi-node job (``CFRUN_NODE_RANK``; 0 when unset)."""
    import os

    try:
        return max(0, int(os.environ.get(NODE_RANK, "0") or 0))
    except ValueError:
        return 0


def node_suffix() -> str:
    """``""`` on node 0 (or a single-node job), ``"-node<R>"`` on node R > 0: keeps the names of
    per-node things apart when several nodes share one job dir (or one machine, in tests)."""
    node = node_rank()
    return f"-node{node}" if node > 0 else ""
