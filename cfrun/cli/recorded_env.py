"""The environment a job dir records (config.json's ``env``) and what ``cfrun resume`` takes
back from it: tuning knobs only, never an interpreter or loader variable (code to run), and a
credential's name without its value. config.json is data: nothing in it may choose code."""

from __future__ import annotations

import os
import re
from typing import Any

from cfrun.contract import settings as E

_RECORDED_ENV_PREFIXES = ("CFRUN_", "CUDA_", "OMP_", "NCCL_", "MKL_")
_CODE_ENV_PREFIXES = ("PYTHON", "LD_", "DYLD_")
"""Interpreter and loader variables: never recorded, never taken back by ``cfrun resume``."""
_CODE_ENV_WORDS = ("PYTHON", "PRELOAD", "PLUGIN", "INJECTION", "LIBRARY_PATH")
"""Variables naming code to load (``NCCL_NET_PLUGIN``, ``CUDA_INJECTION64_PATH``): the same."""
_SECRET_ENV_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH",
                     "SESSION")
_URL_WITH_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^/@\s:]*:[^/@\s]*@", re.IGNORECASE)
WITHHELD = "<not recorded: looks like a credential>"
"""The value config.json holds for a recorded variable that looks like a credential."""


def _is_code_env(name: str) -> bool:
    """True for a variable that makes the interpreter or the loader run code of its choosing."""
    return name.upper().startswith(_CODE_ENV_PREFIXES) or \
        any(w in name.upper() for w in _CODE_ENV_WORDS)


def _looks_secret(name: str, value: str) -> bool:
    """True for a credential by its name (KEY, SECRET, TOKEN, PASSWORD, PASSWD, CREDENTIAL,
    AUTH, SESSION) or its value (a URL with a password: ``s3://user:pw@host``)."""
    return any(w in name.upper() for w in _SECRET_ENV_WORDS) or \
        _URL_WITH_PASSWORD.search(value) is not None


def recorded_env() -> dict[str, str]:
    """The environment config.json keeps for ``cfrun resume`` (the ``cfrun run`` process):
    variables with the ``CFRUN_``, ``CUDA_``, ``OMP_``, ``NCCL_`` or ``MKL_`` prefixes, except
    the ranks' own and interpreter or loader variables; a credential's name is kept with
    :data:`WITHHELD` instead of its value."""
    return {k: WITHHELD if _looks_secret(k, v) else v for k, v in os.environ.items()
            if k.startswith(_RECORDED_ENV_PREFIXES) and not k.startswith("CFRUN_RANK_")
            and not _is_code_env(k)}


_RESUMABLE_ENV = frozenset({
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_SCHEDULE", "OMP_DYNAMIC",
    "OMP_WAIT_POLICY", "OMP_MAX_ACTIVE_LEVELS", "OMP_STACKSIZE", "MKL_NUM_THREADS",
    "MKL_DYNAMIC", "MKL_CBWR", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
    "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS"})
"""Thread, device and ordering knobs ``cfrun resume`` sets again; values, never code or paths."""
_NOT_A_KNOB = re.compile(
    r"FILE|PATH|DIR|CONF|PLUGIN|LIB|DUMP|TOOL|URL|ENDPOINT|SOCKET|HOST|ADDR|COMM_ID")
"""A name of these words names something to load, write or reach, not a tuning value
(``NCCL_COMM_ID`` and ``NCCL_RAS_ADDR`` are addresses: issue 32, finding 6)."""


def _resumable_name(name: str) -> bool:
    """An allowlist (issue 24, item 8): the knobs of :data:`_RESUMABLE_ENV`, NCCL's tuning
    variables (not one naming a file, path, plugin, library or address: ``NCCL_CONF_FILE``,
    ``NCCL_DEBUG_FILE``, ``NCCL_TOPO_DUMP_FILE`` chose code and targets), and cfrun's own
    user settings of value types (``CFRUN_FAULTS``, ``CFRUN_S3_ENDPOINT_URL``,
    ``CFRUN_SHM_DIR`` are json, url and path: refused)."""
    if name in _RESUMABLE_ENV:
        return True
    if name.startswith("NCCL_"):
        return re.fullmatch(r"NCCL_[A-Z0-9_]+", name) is not None \
            and not _NOT_A_KNOB.search(name[5:])
    setting = E.SETTINGS.get(name)
    return setting is not None and setting.set_by == "user" \
        and setting.type not in ("path", "url", "json", "address")


def resumable_env(env: dict[str, Any]) -> tuple[dict[str, str], list[str], list[str]]:
    """Split a recorded environment into what ``cfrun resume`` sets again, the names it
    refuses (interpreter or loader variables, other prefixes than cfrun records, values that
    are not strings) and the names whose value was withheld. config.json is data: nothing in
    it may choose code to run."""
    keep: dict[str, str] = {}
    refused: list[str] = []
    withheld: list[str] = []
    for k, v in env.items():
        if isinstance(k, str) and v == WITHHELD and k.startswith(_RECORDED_ENV_PREFIXES):
            withheld.append(k)  # only named in a note: nothing is set
        elif not isinstance(k, str) or not isinstance(v, str) or _is_code_env(k) or "=" in k \
                or "\0" in k + v or not _resumable_name(k):
            refused.append(str(k))
        else:
            keep[k] = v
    return keep, sorted(refused), sorted(withheld)
