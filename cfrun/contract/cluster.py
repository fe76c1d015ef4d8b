"""Where the job runs: defaults for nodes, node rank and rendezvous from the launcher around cfrun.

cfrun replaces ``torchrun`` in a command line, an sbatch script or a pod spec, so it takes the
defaults those places already provide:

* **torchrun's own variables** (``PET_*``): torchrun reads ``PET_<OPTION>`` for each of its
  options; Kubeflow's PyTorchJob and other operators set ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` or ``PET_RDZV_ENDPOINT``,
  ``PET_RDZV_ID``, ``PET_MAX_RESTARTS``.
* **SLURM** under ``srun`` (one cfrun per node, ``--ntasks-per-node=1``): ``SLURM_NNODES``
  (nodes), ``SLURM_NODEID`` (this node), the first host of ``SLURM_JOB_NODELIST`` as the
  rendezvous host, port ``MASTER_PORT`` or ``20000 + SLURM_JOB_ID mod 20000`` (two jobs sharing
  a node do not collide), rendezvous id ``slurm-<SLURM_JOB_ID>``, and ranks per node from
  ``SLURM_GPUS_ON_NODE`` when SLURM allotted GPUs.

Precedence, per option: a flag > its ``CFRUN_*`` variable > ``PET_*`` > SLURM > cfrun's
default. Only the launcher's environment is read; nothing here runs a command.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from cfrun.contract.errors import BadInputError

SLURM_PORT_BASE = 20000
"""Rendezvous port under SLURM without ``MASTER_PORT``: ``SLURM_PORT_BASE + job id mod 20000``."""


@dataclass(frozen=True)
class ClusterDefaults:
    """Option defaults found in the environment: option name (``nnodes``, ``node_rank``,
    ``rdzv_endpoint``, ``rdzv_id``, ``nproc_per_node``, ``max_restarts``, ``local_addr``) ->
    (text value,
    the variable it came from)."""

    values: dict[str, tuple[str, str]] = field(default_factory=dict)

    def get(self, option: str) -> tuple[str, str] | None:
        return self.values.get(option)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``node[07-09,12],gpu1`` -> ``node07``.

    Raises:
        BadInputError: an empty or malformed list.
    """
    m = re.match(r"^\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if m is None:
        raise BadInputError(f"SLURM_JOB_NODELIST {nodelist!r} is not a SLURM host list; give "
                            "--rdzv-endpoint HOST:PORT")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first.isdigit():
        raise BadInputError(f"SLURM_JOB_NODELIST {nodelist!r} is not a SLURM host list; give "
                            "--rdzv-endpoint HOST:PORT")
    return prefix + first


def _fixed_nnodes(text: str, name: str) -> str:
    """``"2"`` or ``"2:2"`` -> ``"2"``; an elastic range (``1:4``) is refused: cfrun's world
    size is fixed (a changed world size would not resume)."""
    lo, _, hi = text.partition(":")
    if hi and lo.strip() != hi.strip():
        raise BadInputError(f"{name}={text!r} asks for an elastic node count; cfrun runs a fixed "
                            f"number of nodes: set {name}={hi.strip()} or give --nnodes")
    return lo.strip()


def cluster_defaults(environ: Mapping[str, str]) -> ClusterDefaults:
    """The defaults of :mod:`this module <cfrun.contract.cluster>` found in ``environ``.

    Raises:
        BadInputError: an elastic ``PET_NNODES`` range, or a malformed SLURM host list.
    """
    out: dict[str, tuple[str, str]] = {}

    def put(option: str, value: str | None, source: str) -> None:
        if value is not None and value.strip() and option not in out:
            out[option] = (value.strip(), source)

    env = {k: v for k, v in environ.items() if v.strip()}
    if "PET_NNODES" in env:
        put("nnodes", _fixed_nnodes(env["PET_NNODES"], "PET_NNODES"), "PET_NNODES")
    put("nproc_per_node", env.get("PET_NPROC_PER_NODE"), "PET_NPROC_PER_NODE")
    put("node_rank", env.get("PET_NODE_RANK"), "PET_NODE_RANK")
    put("rdzv_endpoint", env.get("PET_RDZV_ENDPOINT"), "PET_RDZV_ENDPOINT")
    if "PET_MASTER_ADDR" in env:
        port = env.get("PET_MASTER_PORT", "29500")
        put("rdzv_endpoint", f"{env['PET_MASTER_ADDR']}:{port}", "PET_MASTER_ADDR")
    put("rdzv_id", env.get("PET_RDZV_ID"), "PET_RDZV_ID")
    put("max_restarts", env.get("PET_MAX_RESTARTS"), "PET_MAX_RESTARTS")
    put("local_addr", env.get("PET_LOCAL_ADDR"), "PET_LOCAL_ADDR")

    if "SLURM_JOB_ID" in env and ("SLURM_NNODES" in env or "SLURM_JOB_NUM_NODES" in env):
        nnodes_var = "SLURM_NNODES" if "SLURM_NNODES" in env else "SLURM_JOB_NUM_NODES"
        put("nnodes", env[nnodes_var], nnodes_var)
        put("node_rank", env.get("SLURM_NODEID"), "SLURM_NODEID")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodelist:
            job_id = env["SLURM_JOB_ID"]
            port = env.get("MASTER_PORT") or str(
                SLURM_PORT_BASE + (int(job_id) if job_id.isdigit() else 0) % 20000)
            put("rdzv_endpoint", f"{first_host(nodelist)}:{port}", "SLURM_JOB_NODELIST")
        put("rdzv_id", f"slurm-{env['SLURM_JOB_ID']}", "SLURM_JOB_ID")
        gpus = env.get("SLURM_GPUS_ON_NODE", "")
        if gpus.isdigit() and int(gpus) > 0:
            put("nproc_per_node", gpus, "SLURM_GPUS_ON_NODE")
    return ClusterDefaults(out)


def fixed_nnodes(text: str) -> str:
    """``--nnodes``: ``"2"`` or ``"2:2"`` -> ``"2"``; torchrun's elastic ``MIN:MAX`` range is
    refused in one line, as ``PET_NNODES``'s (:func:`_fixed_nnodes`).

    Raises:
        BadInputError: an elastic range.
    """
    lo, _, hi = text.partition(":")
    if hi and lo.strip() != hi.strip():
        raise BadInputError(f"drop the range of --nnodes={text}: cfrun keeps a fixed world size "
                            f"(a changed one would not resume); give --nnodes={hi.strip()}")
    return lo.strip()


def visible_gpu_count() -> int:
    """GPUs the ranks can use: NVML's devices within ``CUDA_VISIBLE_DEVICES``
    (:func:`cfrun.contract.gpus.samples`); 0 without NVML or without a GPU. torch is not
    imported (``cfrun --dry-run`` stays fast)."""
    from cfrun.contract.gpus import samples

    return len(samples())


def resolve_nproc_per_node(text: str) -> str:
    """torchrun's ``--nproc-per-node`` words as torchrun reads them: ``gpu`` -> the visible
    GPUs (an error without one, as torchrun's), ``auto`` -> the visible GPUs, else the CPU
    count; a number is returned unchanged (checked later).

    Raises:
        BadInputError: ``gpu`` on a machine without a visible GPU.
    """
    word = text.strip().lower()
    if word not in ("gpu", "auto"):
        return text
    count = visible_gpu_count()
    if word == "gpu" and count == 0:
        raise BadInputError("--nproc-per-node gpu: no GPU is visible on this machine (torchrun "
                            "refuses it too); give a number, e.g. --nproc-per-node 1, or auto")
    import os

    return str(count or os.cpu_count() or 1)


DROPPED_TORCHRUN_OPTIONS = {
    "--tee": "each rank's output reaches the console as the script prints it, and the job "
             "dir keeps cfrun's records",
    "-t": "each rank's output reaches the console as the script prints it, and the job dir "
          "keeps cfrun's records",
    "--redirects": "the ranks' output goes to the console and their failures to the job dir",
    "-r": "the ranks' output goes to the console and their failures to the job dir",
    "--log-dir": "torchrun's logs go to the job dir (give --job-dir to place it)",
    "--log_dir": "torchrun's logs go to the job dir (give --job-dir to place it)",
    "--logs-specs": "torchrun's logs go to the job dir (give --job-dir to place it)",
    "--local-ranks-filter": "each rank's output reaches the console as the script prints it",
    "--monitor-interval": "it watches the ranks itself (heartbeats, --hang-timeout)",
    "--monitor_interval": "it watches the ranks itself (heartbeats, --hang-timeout)",
    "--role": "every rank runs the one script (one role)",
    "--no-python": "it runs a Python training script, whose state it checkpoints",
    "--no_python": "it runs a Python training script, whose state it checkpoints",
    "--run-path": "it runs the script as python SCRIPT does",
    "--run_path": "it runs the script as python SCRIPT does",
    "--start-method": "torchrun starts each rank as its own process (spawn)",
    "--start_method": "torchrun starts each rank as its own process (spawn)",
}
"""torchrun options that have no meaning under cfrun -> why (``drop X: cfrun does it
because ...``, exit 2)."""


def check_dropped_option(word: str) -> None:
    """Refuse one of :data:`DROPPED_TORCHRUN_OPTIONS` (``--tee``, ``--tee=3``) in one line.

    Raises:
        BadInputError: ``word`` names such an option.
    """
    name = word.split("=", 1)[0]
    why = DROPPED_TORCHRUN_OPTIONS.get(name)
    if why is not None:
        raise BadInputError(f"drop {name}: cfrun does it because {why}")
