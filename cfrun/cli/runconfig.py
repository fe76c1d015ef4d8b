"""A job's :class:`~cfrun.contract.config.RunConfig` from the words of ``cfrun run``,
``profile`` and ``verify``: every value checked (one line naming it and the fix, exit 2)
before anything is created, paths made absolute, the environment recorded."""

from __future__ import annotations

from pathlib import Path

from cfrun.cli.recorded_env import recorded_env
from cfrun.contract import settings as E
from cfrun.contract.config import (
    RunConfig,
    check_job_name,
    default_job_dir,
    parse_inject_crash,
    parse_interval,
    parse_overhead,
    parse_positive_int,
    resolve_launcher,
)
from cfrun.contract.errors import BadInputError
from cfrun.policy import parse_duration


def _resolve_script(script: str) -> Path:
    path = Path(script)
    if not path.exists():
        raise BadInputError(f"script {script!r} does not exist; give the path of a Python "
                            "training script, e.g. cfrun train.py")
    if path.is_dir():
        raise BadInputError(f"script {script!r} is a directory; give the path of a Python "
                            "training script inside it")
    return path.resolve()


def _script_path(script: str, module: bool) -> Path:
    """The script's file: ``script`` itself, or with ``module`` (``-m``) the file of the
    module of that name, found without running it
    (:func:`cfrun.contract.pymodule.find_module_file`)."""
    if module:
        from cfrun.contract.pymodule import find_module_file

        return find_module_file(script, Path.cwd())
    return _resolve_script(script)


def _job_name(job_name: str | None) -> str | None:
    """``--job-name``, else ``CFRUN_PEER_JOB`` (the older name of ``CFRUN_JOB_NAME``), checked."""
    option = "--job-name"
    if job_name is None and E.get_str(E.PEER_JOB):  # the older name of CFRUN_JOB_NAME
        job_name, option = E.get_str(E.PEER_JOB), E.PEER_JOB
    if job_name is not None:
        check_job_name(job_name, option)
    return job_name


def _parse_seconds(name: str, text: str, example: str) -> float:
    """A DURATION option: plain seconds (``25``, ``0``) or a number with a unit (``30s``,
    ``2m``, ``1h``, :func:`cfrun.policy.parse_duration`)."""
    try:
        value = float(text)
    except ValueError:
        value = parse_duration(name, text) if text.strip()[-1:].isalpha() else -1.0
    if not value >= 0:
        raise BadInputError(f"{name} {text!r} is not a duration; give seconds or a number with "
                            f"s, m, h or d, e.g. {name} {example}")
    return value


def _peer_token_path(peer: str | None, peer_token_file: str | None) -> str | None:
    """``--peer-token-file``, read (the token must be usable) and made absolute; None without
    ``--peer``.

    Raises:
        BadInputError: ``--peer`` has port 0 or no token file, or the token is unusable.
    """
    if not peer:
        return None
    from cfrun.peer.protocol import parse_address, read_token

    if parse_address(peer, option="--peer")[1] == 0:
        raise BadInputError(f"--peer {peer!r} has port 0; give the port the peer listens on")
    if not peer_token_file:
        raise BadInputError("--peer needs --peer-token-file F, the file with the peer's "
                            "shared secret")
    read_token(peer_token_file, option="--peer-token-file")
    return str(Path(peer_token_file).expanduser().absolute())


def _persist_to(persist_to: str | None) -> str | None:
    """``--persist-to``, opened once (the store must be usable), a directory made absolute.

    Raises:
        BadInputError: as :func:`cfrun.storage.tiers.open_storage`.
    """
    if persist_to:
        from cfrun.storage.tiers import open_storage

        open_storage(persist_to)
        if "://" not in persist_to:
            persist_to = str(Path(persist_to).expanduser().absolute())
    return persist_to


def job_key_path(path: str | None) -> str | None:
    """``--job-key-file``, checked now (one line, exit 2) and made absolute.

    Raises:
        BadInputError: as :func:`cfrun.contract.jobkey.read_key_file`.
    """
    if not path:
        return None
    from cfrun.contract.jobkey import read_key_file

    read_key_file(path)
    return str(Path(path).expanduser().absolute())


def build_config(script: str, script_args: list[str] | None, job_dir: str | None,
                 interval: str | None, overhead: str, nproc_per_node: str, max_restarts: str,
                 keep: str, grace: str, mtbf: str | None, hang_timeout: str, crash_loop: str,
                 inject_crash: str, *, profile_only: bool, peer: str | None = None,
                 peer_token_file: str | None = None, peer_streams: str = "4",
                 persist_to: str | None = None, nnodes: str = "1", node_rank: str = "0",
                 rdzv_endpoint: str | None = None, rdzv_id: str | None = None,
                 job_name: str | None = None, launcher: str = "auto",
                 metrics: str | None = None, local_addr: str | None = None,
                 module: bool = False) -> RunConfig:
    """The run's :class:`RunConfig` from the command line's words; ``module`` (``-m``):
    ``script`` is a module name, whose file is found without running it
    (:func:`cfrun.contract.pymodule.find_module_file`). Checks everything before anything is
    created.

    Raises:
        BadInputError: a value is invalid (one line naming it and the fix).
    """
    script_path = _script_path(script, module)
    job_name = _job_name(job_name)
    cwd = Path.cwd()
    nproc_n = parse_positive_int("--nproc-per-node", nproc_per_node, minimum=1)
    nnodes_n = parse_positive_int("--nnodes", nnodes, minimum=1)
    jd = Path(job_dir).expanduser().absolute() if job_dir else \
        default_job_dir(str(script_path), cwd, script_args or [], nproc_n, nnodes_n,
                        module=script if module else None)
    parse_inject_crash(inject_crash)  # validate now: the ranks parse it again
    grace_s = _parse_seconds("--grace", grace, "25")
    hang_timeout_s = _parse_seconds("--hang-timeout", hang_timeout, "600")
    token_path = _peer_token_path(peer, peer_token_file)
    if metrics:
        from cfrun.peer.protocol import parse_address

        parse_address(metrics, option="--metrics")
    persist_to = _persist_to(persist_to)
    return RunConfig(
        script=str(script_path),
        script_args=list(script_args or []),
        job_dir=str(jd),
        cwd=str(cwd),
        interval=parse_interval(interval) if interval is not None else None,
        overhead=parse_overhead(overhead),
        nproc_per_node=nproc_n,
        launcher=resolve_launcher(launcher, nnodes_n),
        max_restarts=parse_positive_int("--max-restarts", max_restarts, minimum=0),
        keep=parse_positive_int("--keep", keep, minimum=1),
        grace_s=grace_s,
        hang_timeout_s=hang_timeout_s,
        mtbf_s=parse_duration("--mtbf", mtbf) if mtbf else None,
        profile_only=profile_only,
        crash_loop_limit=parse_positive_int("--crash-loop", crash_loop, minimum=0),
        inject_crash=inject_crash,
        nnodes=nnodes_n,
        node_rank=parse_positive_int("--node-rank", node_rank, minimum=0),
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id or jd.name,
        peer=peer or None,
        peer_token_file=token_path,
        peer_streams=parse_positive_int("--peer-streams", peer_streams, minimum=1),
        persist_to=persist_to or None,
        job_name=job_name,
        metrics=metrics or None,
        local_addr=local_addr or None,
        env=recorded_env(),
        module=script if module else None,
    )
