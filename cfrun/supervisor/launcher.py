"""Build the torchrun command line and the ranks' environment (pure), then start torchrun.

With ``--launcher python`` the one rank is the script run as ``python SCRIPT ARGS`` instead
(:func:`build_launch_argv`): the attempt's process *is* the rank, with torchrun's variables
kept out of its environment; everything else below holds for it too. With ``--launcher python
--nproc-per-node N`` (one node) the supervisor starts N such processes itself, each with the
variables ``torchrun --standalone`` gives its workers (:func:`local_rank_env`;
:mod:`cfrun.supervisor.local_ranks`).

The ranks run as ``python -m torch.distributed.run --standalone ... SCRIPT ARGS`` (one node;
torchrun under :mod:`cfrun.supervisor.torchrun_log`, which keeps the script's ARGS from
torchrun's parser) or
with torchrun's c10d rendezvous (``--nnodes N``) with the same
interpreter as cfrun. cfrun restarts torchrun itself (``--max-restarts 0`` to torchrun) so that
it can apply its own policy and keep the persist agent across restarts.

Nothing of a job outlives its supervisor, even one killed by SIGKILL: torchrun and the persist
agent get a parent-death signal (``PR_SET_PDEATHSIG``, :func:`die_with_parent`); torchrun's ranks
(their own sessions; torchrun does not kill them when it is SIGKILLed) and their workers carry
``CFRUN_RANK_SUPERVISOR_PID`` in their environment, and a small reaper process
(:func:`start_reaper`) SIGKILLs every process carrying it when the supervisor is gone. A new
supervisor on the same job dir also kills leftovers of a dead one (:func:`kill_leftovers`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cfrun
from cfrun.contract import lifetime
from cfrun.contract import settings as E
from cfrun.contract.config import RunConfig
from cfrun.supervisor.torchrun_log import TORCHRUN

TORCHRUN_LOG = "cfrun.supervisor.torchrun_log"
"""The module a torchrun attempt's command runs (:func:`build_torchrun_argv`)."""

def hooks_dir() -> Path:
    """Directory holding cfrun's ``sitecustomize.py``: in the wheel, or in a source checkout."""
    pkg = Path(cfrun.__file__).resolve().parent
    for candidate in (pkg / "_hooks", pkg.parent / "hooks"):
        if (candidate / "sitecustomize.py").is_file():
            return candidate
    raise FileNotFoundError(f"cfrun's hooks/sitecustomize.py is missing next to {pkg}")


_RUN_MODULE = ("import sys; del sys.path[0]; sys.path.insert(0, sys.argv[1]); import runpy; "
               "del sys.argv[:2]; runpy.run_module(sys.argv[0], run_name='__main__', "
               "alter_sys=True)")


def module_argv(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """``python -m MODULE ARGS`` for one of cfrun's own processes (the persist agent, the
    torchrun wrapper), without the current directory on ``sys.path``.

    ``python -m`` and ``python -c`` put the working directory first on ``sys.path``: a user who
    can write the directory cfrun is started from (a shared project dir, /tmp) planted
    ``argparse.py`` there and it ran in the agent, the reaper and the wrapper with the job's
    uid (issue 24, item 1). Here ``-c`` drops that entry before anything is imported (``sys``
    is built in), puts cfrun's own tree first, then runs the module as ``-m`` would
    (:func:`runpy.run_module`, ``sys.argv[0]`` its file). ``-P`` would do the first part, from
    Python 3.11 only. The ranks are not started this way: they run the user's script as
    ``python SCRIPT`` does, its own directory first on ``sys.path`` (``python -m MODULE`` with
    ``-m``: the working directory first, as Python puts it).
    """
    pkg_parent = str(Path(cfrun.__file__).resolve().parent.parent)
    return [python, "-c", _RUN_MODULE, pkg_parent, module, *args]


def build_torchrun_argv(cfg: RunConfig, *, python: str = sys.executable,
                        log_path: str | None = None, log_dir: str | None = None) -> list[str]:
    """The torchrun command for one attempt (no I/O).

    One node: ``--standalone``. Several: torchrun's c10d rendezvous at ``--rdzv-endpoint``
    (torchrun ``--rdzv-backend c10d``; node 0 hosts its store, ``is_host``), with a fixed node
    count, so the world size cannot change between restarts. torchrun runs under
    :mod:`cfrun.supervisor.torchrun_log`, whose parser of torchrun's options never sees the
    script's arguments; ``log_path``: torchrun's own output is appended there (the ranks'
    output stays on the console); ``log_dir``: torchrun's ``--log-dir`` (else it leaves a
    ``torchelastic_*`` directory in /tmp per attempt). Each of torchrun's options is one word
    (``--name=value``): the first word that is no option is the script
    (:func:`cfrun.supervisor.torchrun_log.split_script`). With ``-m MODULE``
    (:attr:`RunConfig.module`) torchrun's own ``--module`` flag precedes the module's name:
    each rank runs ``python -m MODULE ARGS``.
    """
    if cfg.nnodes > 1:
        # node 0 hosts the rendezvous store: torchrun's own guess (the endpoint names this
        # machine's host name) misses an IP address or a Kubernetes Service name
        launch = [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id={cfg.rdzv_id}",
                  f"--rdzv-conf=is_host={'true' if cfg.node_rank == 0 else 'false'}"]
    else:
        launch = ["--standalone"]
    return module_argv(
        TORCHRUN_LOG, log_path or "-", TORCHRUN,
        *launch,
        f"--nproc-per-node={cfg.nproc_per_node}",
        "--max-restarts=0",
        "--monitor-interval=0.1",
        *([f"--log-dir={log_dir}"] if log_dir is not None else []),
        *([f"--local-addr={cfg.local_addr}"] if cfg.local_addr else []),
        *(["--module", cfg.module] if cfg.module else [cfg.script]), *cfg.script_args,
        python=python)


def build_launch_argv(cfg: RunConfig, *, python: str = sys.executable,
                      log_path: str | None = None, log_dir: str | None = None) -> list[str]:
    """The command of one attempt (no I/O): :func:`build_torchrun_argv`, or with
    ``--launcher python`` the script itself, ``python SCRIPT ARGS`` (``python -m MODULE ARGS``
    with ``-m``), as its user would run it: each rank's command (:class:`RunConfig` refuses it
    with several nodes)."""
    if cfg.starts_ranks:
        return [python, *(["-m", cfg.module] if cfg.module else [cfg.script]), *cfg.script_args]
    return build_torchrun_argv(cfg, python=python, log_path=log_path, log_dir=log_dir)


TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
"""What torchrun sets in its ranks' environment (and every ``TORCHELASTIC_*``): kept out of a
``--launcher python`` script's environment, where a script reads them as "go distributed"
(several ranks get cfrun's own values, :func:`local_rank_env`)."""

LOCAL_MASTER_ADDR = "localhost"
"""``MASTER_ADDR`` of a ``--launcher python`` job's ranks: what ``torchrun --standalone``
sets (torch 2.13)."""


def local_rank_env(env: dict[str, str], *, local_rank: int, nproc_per_node: int,
                   master_port: int, run_id: str) -> dict[str, str]:
    """The environment of local rank ``local_rank`` of a ``--launcher python --nproc-per-node
    N`` attempt (no I/O): ``env`` (:func:`build_worker_env`'s) with the variables
    ``torchrun --standalone --nproc-per-node N`` gives its worker of that local rank, from
    torch 2.13's ``LocalElasticAgent._start_workers``: ``RANK``/``LOCAL_RANK``/``ROLE_RANK``
    the local rank (one node), ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/``ROLE_WORLD_SIZE`` N,
    ``GROUP_RANK`` 0 of ``GROUP_WORLD_SIZE`` 1, ``ROLE_NAME`` ``default``, ``MASTER_ADDR``
    :data:`LOCAL_MASTER_ADDR`, ``MASTER_PORT`` ``master_port`` (chosen per attempt,
    :func:`free_port`), ``TORCHELASTIC_RUN_ID`` ``run_id``, ``TORCHELASTIC_RESTART_COUNT`` and
    ``TORCHELASTIC_MAX_RESTARTS`` 0 (cfrun restarts, as under its torchrun, ``--max-restarts
    0``), ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` as torchrun (1 unless set).

    Where it differs from torchrun: ``TORCHELASTIC_USE_AGENT_STORE`` is ``False`` (there is no
    agent: rank 0 hosts the ``env://`` store at ``MASTER_PORT``, as torch does for any launcher
    without one), and ``TORCHELASTIC_ERROR_FILE`` is not set (torch's ``@record`` then logs the
    error; cfrun keeps each rank's error itself, ``errors/``).
    """
    n = str(nproc_per_node)
    return {**env,
            "RANK": str(local_rank), "LOCAL_RANK": str(local_rank),
            "ROLE_RANK": str(local_rank), "GROUP_RANK": "0", "ROLE_NAME": "default",
            "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "ROLE_WORLD_SIZE": n,
            "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": LOCAL_MASTER_ADDR, "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def free_port() -> int:
    """A TCP port free on this machine now (the kernel's choice), for one attempt's
    ``MASTER_PORT``: rank 0 binds it a moment later (a race with another program, as any
    ``--master-port`` choice has; a new one per attempt, so no port of a killed attempt's
    store, still in TIME_WAIT, is reused)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def build_worker_env(cfg: RunConfig, attempt: int, base: dict[str, str] | None = None, *,
                     mtbf_s: float | None = None, manifest_keys: tuple[str, ...] = (),
                     job_dir_id: tuple[int, int] | None = None) -> dict[str, str]:
    """The environment of torchrun and its ranks for attempt ``attempt`` (no I/O). With
    ``--launcher python`` the script's own, without any of :data:`TORCHRUN_VARIABLES` (with
    several ranks, each rank's are added by :func:`local_rank_env`; ``OMP_NUM_THREADS`` is 1
    where it is not set, as torchrun sets it for several ranks, before the warm spares import
    torch).

    torchrun's ``PET_*`` variables are dropped (cfrun read them: :mod:`cfrun.contract.cluster`,
    and passes its choices as flags). ``hooks/`` goes first on PYTHONPATH (ranks only: cfrun's
    own process is untouched). The
    ranks' settings travel as one JSON value, ``CFRUN_RANK_SETTINGS``
    (:class:`cfrun.rank.settings.RankSettings`), whose presence also arms the hook; they
    include the job dir's manifest keys (``manifest_keys``, hex) and identity (``job_dir_id``):
    the environment is this user's alone, as the agent's address is.
    ``CFRUN_RANK_JOB_DIR``, ``CFRUN_RANK_SUPERVISOR_PID`` and ``CFRUN_NODE_RANK`` mark every
    process of the job for :func:`job_processes` (the ranks do not read the first two).

    Raises:
        BadInputError: a setting the ranks would refuse (e.g. ``CFRUN_FF_EVAL``).
    """
    from cfrun.contract.config import parse_inject_crash
    from cfrun.rank.settings import RankSettings

    env = dict(os.environ if base is None else base)
    env.pop(E.HOOK_OWNER_PID, None)
    if cfg.starts_ranks:  # cfrun itself may run under torchrun: none of it leaks
        for name in [k for k in env if k in TORCHRUN_VARIABLES or k.startswith("TORCHELASTIC_")]:
            del env[name]
    for name in [k for k in env if k.startswith("PET_")]:
        del env[name]  # torchrun reads PET_* as its options' defaults: cfrun chose them already
    if cfg.starts_ranks and cfg.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torch.distributed.run's, for several ranks
    old = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks_dir()), old) if p)
    settings = RankSettings(
        job_dir=Path(cfg.job_dir), script=cfg.script, attempt=attempt, interval=cfg.interval,
        overhead=cfg.overhead, mtbf_s=mtbf_s or None, profile_only=cfg.profile_only,
        inject_crash=tuple(parse_inject_crash(cfg.inject_crash)),
        ff_eval=env.get(E.FF_EVAL, "one"), supervisor_pid=os.getpid(),
        node_rank=cfg.node_rank, launcher=cfg.launcher, nproc_per_node=cfg.nproc_per_node,
        verify=cfg.verify,
        verify_stop_step=cfg.verify_stop_step,
        verify_kills=tuple(tuple(k) for k in cfg.verify_kills),  # type: ignore[misc]
        reshard=cfg.reshard, manifest_keys=manifest_keys, job_dir_id=job_dir_id,
        world_size=cfg.nproc_per_node if cfg.starts_ranks else 1)  # checked, not sent
    env.update({
        E.RANK_SETTINGS: settings.to_json(),
        E.RANK_JOB_DIR: cfg.job_dir,
        E.RANK_SUPERVISOR_PID: str(os.getpid()),
        E.NODE_RANK: str(cfg.node_rank),
    })
    return env


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies
    (:func:`cfrun.contract.lifetime.die_with`; a child whose parent already died exits 1).

    Linux sends it when the *thread* that forked the child exits, so call ``Popen`` with it only
    from a thread that lives as long as the parent (the supervisor's main thread: the supervisor
    runs no other threads). libc is looked up here, in the parent; the child only calls
    ``prctl``. No-op where ``prctl`` is missing (not Linux).
    """
    parent_pid = os.getpid()
    fn = lifetime.prctl()
    if fn is None:
        return lambda: None

    def preexec() -> None:
        lifetime.die_with(parent_pid, orphan_exit_code=1, sig=sig, prctl_fn=fn)

    return preexec


def spawn(argv: list[str], env: dict[str, str], cwd: str, **stdio: Any
          ) -> subprocess.Popen[bytes]:
    """Start torchrun in its own process group (so signals reach the whole tree); it is SIGKILLed
    if the supervisor dies (:func:`die_with_parent`). ``stdio``: ``stdout``/``stderr`` for
    ``Popen`` (the console tap's ends, :meth:`cfrun.supervisor.console.ConsoleTap.popen_kwargs`).
    Call from the supervisor's main thread."""
    return subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True,
                            preexec_fn=die_with_parent(), **stdio)


def job_processes(job_dir: str, node_rank: int, *, supervisor_pid: int | None = None,
                  exclude_supervisor_pid: int | None = None) -> list[Any]:
    """Live processes started for ``job_dir``'s node ``node_rank`` (torchrun, ranks, their
    workers and children): those whose environment holds that job dir, node and supervisor pid
    (:func:`build_worker_env`). ``supervisor_pid`` keeps only one supervisor's;
    ``exclude_supervisor_pid`` leaves one out. Processes of other users are skipped.
    Returns psutil.Process objects; never raises for a process that vanishes."""
    import psutil

    out = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get(E.RANK_JOB_DIR) != job_dir or env.get(E.NODE_RANK, "0") != str(node_rank):
            continue
        owner = env.get(E.RANK_SUPERVISOR_PID)
        if supervisor_pid is not None and owner != str(supervisor_pid):
            continue
        if exclude_supervisor_pid is not None and owner == str(exclude_supervisor_pid):
            continue
        out.append(p)
    return out


def kill_job_processes(job_dir: str, node_rank: int, *, supervisor_pid: int | None = None,
                       exclude_supervisor_pid: int | None = None,
                       timeout_s: float = 5.0) -> list[int]:
    """SIGKILL :func:`job_processes` until none is left (a rank may fork a worker meanwhile),
    for at most ``timeout_s`` seconds. Returns the pids killed."""
    import psutil

    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = job_processes(job_dir, node_rank, supervisor_pid=supervisor_pid,
                              exclude_supervisor_pid=exclude_supervisor_pid)
        if not procs:
            break
        for p in procs:
            try:
                p.kill()
                killed.append(p.pid)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=0.5)
    return killed


def leftover_agent_pid(job_dir: str) -> int | None:
    """Pid of a persist agent answering at the address in ``job_dir``'s ``agent.json`` (this
    node's), else None.

    Called by a supervisor that holds the job dir's lock: any agent found then is a leftover of
    a supervisor that died without stopping it. The pid comes from ``SO_PEERCRED`` and must be
    the one the record names; a process of another user there is refused (one line), never
    killed."""
    from cfrun.contract import ipc

    try:
        record = ipc.read_agent_record(job_dir)
        sock = ipc.connect(job_dir, timeout_s=1.0, address=record.address,
                           expect_pid=record.pid)
    except OSError:
        return None
    try:
        pid = ipc.peer_credentials(sock)[0]
    finally:
        sock.close()
    return pid if pid > 0 else None


def start_reaper(job_dir: str, node_rank: int) -> subprocess.Popen[bytes]:
    """Start the reaper of this supervisor's processes (call from the supervisor).

    The reaper blocks reading its stdin, a pipe whose write end only the supervisor holds. When
    the supervisor is gone (killed by SIGKILL too) or closes it, it SIGKILLs every process of
    :func:`job_processes` started by this supervisor and exits. It runs in a session of its own
    (a terminal's Ctrl-C is cfrun's to handle) and ignores SIGINT.
    """
    pkg_parent = str(Path(cfrun.__file__).resolve().parent.parent)
    code = ("import sys; del sys.path[0]; sys.path.insert(0, sys.argv[1]); "
            "from cfrun.supervisor.launcher import reaper_main; reaper_main(sys.argv[2:])")
    return subprocess.Popen(  # in /, the working directory off sys.path (module_argv)
        [sys.executable, "-c", code, pkg_parent, job_dir, str(node_rank),
         str(os.getpid())], stdin=subprocess.PIPE, start_new_session=True, cwd="/")


def reaper_main(argv: list[str]) -> None:
    """Body of the reaper process (:func:`start_reaper`): ``JOB_DIR NODE_RANK SUPERVISOR_PID``."""
    job_dir, node_rank, supervisor_pid = argv[0], int(argv[1]), int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        while sys.stdin.buffer.read(4096):
            pass
    except OSError:
        pass
    kill_job_processes(job_dir, node_rank, supervisor_pid=supervisor_pid)
