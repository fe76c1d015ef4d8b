"""What the last rank imported, imported ahead by the next warm spare (issue 35, "a warm restart").

A rank's start-up is not only ``import torch``: the script's first ``torch.optim.Adam(...)``
imports ``torch._dynamo`` and with it ~800 modules (sympy, mpmath, ...), 1.0 s here of a
2.3 s start-up, and DDP, the data loader's workers and ``torch.distributed`` import more.
A spare (:mod:`cfrun.rank.spare`) that imported only what every rank imports left all of that
on the recovery path. So a rank, at its first step, records the modules it has imported from
installed code (:func:`record`); the next spare imports the same ones before it says ready
(:func:`import_ahead`), in the order the rank imported them.

Only installed code is imported ahead, and by default only the standard library and torch's
own stack (:data:`AHEAD_ROOTS`): they do not touch the GPU at import (no CUDA context: the spare
holds no GPU memory), read no rank variable, and print nothing. The script's own modules never
are (their import runs the user's code, which must run once, in the rank). A module whose import
fails is skipped (the script imports it itself). ``CFRUN_STANDBY_IMPORTS=0`` turns this off.

Where it comes from: a zygote's preloaded classes (Android preloads what apps load at their
start, recorded from real starts); here the list is the job's own previous attempt.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from pathlib import Path

from cfrun.contract import coordination as co
from cfrun.contract.fsio import atomic_write_json, read_regular

MAX_MODULES = 20000
"""Most module names recorded or imported ahead (a large HF job imports ~6000)."""
MAX_BYTES = 4 << 20
"""The largest record read."""

AHEAD_ROOTS = frozenset({"torch", "torchgen", "functorch", "numpy", "sympy", "mpmath",
                         "networkx", "jinja2", "markupsafe", "filelock", "fsspec",
                         "typing_extensions"})
"""Top-level packages imported ahead besides the standard library: torch and what torch
imports lazily (``torch._dynamo`` brings sympy and mpmath; ``torch.distributed`` fsspec)."""

NEVER_AHEAD = frozenset({"__main__", "__mp_main__", "sitecustomize", "usercustomize",
                         "antigravity", "this", "__hello__", "__phello__", "idlelib",
                         "turtledemo", "cfrun"})
"""Top-level names never imported ahead: the script itself, the start-up hooks, cfrun (the
spare imported its own), and standard modules whose import acts (opens a browser, prints)."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _installed_dirs() -> tuple[str, ...]:
    """The directories installed code lives in: the standard library and site-packages."""
    paths = sysconfig.get_paths()
    dirs = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib")
            if k in paths}
    dirs.update(os.path.realpath(p) for p in sys.path
                if p.endswith(("site-packages", "dist-packages")))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def installed_modules() -> list[str]:
    """The names in ``sys.modules``, in import order, of modules that are installed code (a
    file under the standard library or site-packages, or built in), at most
    :data:`MAX_MODULES`; the script's own modules, whatever their directory, are left out."""
    dirs = _installed_dirs()
    names: list[str] = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".")[0] in NEVER_AHEAD:
            continue
        path = getattr(module, "__file__", None)
        if path is None:
            if name not in sys.builtin_module_names:
                continue  # a namespace package or a module made at run time
        elif not os.path.realpath(path).startswith(dirs):
            continue
        names.append(name)
        if len(names) >= MAX_MODULES:
            break
    return names


def record(job_dir: Path, node_rank: int) -> None:
    """Write this rank's :func:`installed_modules` to ``warm-imports-node-N.json`` (atomic,
    0600, never through a link). A node's local rank 0 calls it once, at its first step, on the
    heartbeat thread (not the training thread).

    Raises:
        OSError: the write failed (the caller counts it; the next spare then imports less).
    """
    atomic_write_json(co.warm_imports_path(job_dir, node_rank),
                      {"modules": installed_modules()})


def ahead_names(job_dir: Path, node_rank: int) -> list[str]:
    """The names :func:`import_ahead` imports: the node's record, validated (dotted
    identifiers, at most :data:`MAX_MODULES`), its top-level package in :data:`AHEAD_ROOTS` or
    the standard library and not in :data:`NEVER_AHEAD`. Empty when the record is missing,
    unreadable or malformed."""
    try:
        doc = json.loads(read_regular(co.warm_imports_path(job_dir, node_rank),
                                      max_bytes=MAX_BYTES))
    except (OSError, ValueError):
        return []
    names = doc.get("modules") if isinstance(doc, dict) else None
    if not isinstance(names, list):
        return []
    out: list[str] = []
    for name in names[:MAX_MODULES]:
        if not isinstance(name, str) or len(name) > 256 or not _NAME.fullmatch(name):
            continue
        root = name.split(".")[0]
        if root in NEVER_AHEAD:
            continue
        if root in AHEAD_ROOTS or root in sys.stdlib_module_names:
            out.append(name)
    return out


def import_ahead(job_dir: Path, node_rank: int) -> int:
    """Import :func:`ahead_names` in order (spare process, before it says ready); a module
    whose import fails is skipped. Returns how many are imported now (were not before)."""
    imported = 0
    for name in ahead_names(job_dir, node_rank):
        if name in sys.modules:
            continue
        try:
            __import__(name)
        except (Exception, SystemExit):  # the script imports it itself, and sees its error
            continue
        imported += 1
    return imported
