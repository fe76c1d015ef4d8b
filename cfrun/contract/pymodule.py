"""``cfrun -m MODULE``: the file a module name stands for, found as ``python -m`` would find it,
without running anything.

``python -m pkg.train`` puts the working directory first on ``sys.path``, imports the parent
package ``pkg`` and runs ``pkg/train.py`` as ``__main__`` (a package named alone runs its
``__main__`` submodule). cfrun records and hashes that file like a script (the job's identity,
:class:`cfrun.contract.config.Command`), and the ranks' liveness analysis reads its source, so
the file is found here first: each part of the dotted name is looked up with the import
system's finders (``sys.meta_path``) in its parent's search locations, so the parent packages'
``__init__`` code, which may import torch or have side effects, never runs in cfrun's own
process. Torch-free.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cfrun.contract.errors import BadInputError


def _find_spec(name: str, path: list[str] | None) -> Any:
    """The spec of ``name`` from the first finder of ``sys.meta_path`` that has one (what
    ``importlib`` does once the parent package is imported); None: no finder has it."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, path)
        except (ImportError, ValueError, OSError):
            continue
        if spec is not None:
            return spec
    return None


def find_module_file(name: str, cwd: Path) -> Path:
    """The source file ``python -m NAME`` run in ``cwd`` would run: ``cwd`` first on
    ``sys.path``, then the rest of this interpreter's path; a package's ``__main__``
    submodule. Nothing is imported or run (the parent packages' ``__init__`` neither).

    Raises:
        BadInputError: not a dotted module name, not found, or not a Python source file (one
            line naming the value and the fix).
    """
    fix = ("give a module importable from the working directory, e.g. cfrun -m pkg.train, "
           "or the path of a script file")
    parts = name.split(".")
    if not name or not all(p.isidentifier() for p in parts):
        hint = f" (without .py: -m {name[:-3].replace('/', '.')})" \
            if name.endswith(".py") else ""
        raise BadInputError(f"-m {name!r} is not a module name{hint}; {fix}")
    saved = list(sys.path)
    sys.path[:] = [str(cwd), *(p for p in saved if p)]  # as python -m's sys.path[0]
    try:
        spec: Any = None
        search: list[str] | None = None
        for i in range(len(parts)):
            full = ".".join(parts[:i + 1])
            spec = _find_spec(full, search)
            if spec is None:
                where = f"package {'.'.join(parts[:i])!r}" if i else str(cwd)
                raise BadInputError(f"-m {name!r}: no module {full!r} found from {where}; "
                                    f"{fix}")
            if i < len(parts) - 1:
                if spec.submodule_search_locations is None:
                    raise BadInputError(f"-m {name!r}: {full!r} is a module, not a package; "
                                        f"{fix}")
                search = list(spec.submodule_search_locations)
        if spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = _find_spec(f"{name}.__main__", list(spec.submodule_search_locations))
            if spec is None:
                raise BadInputError(f"-m {name!r} is a package without a __main__ module; "
                                    f"give the module to run, e.g. cfrun -m {name}.train")
    finally:
        sys.path[:] = saved
    origin = getattr(spec, "origin", None)
    if not getattr(spec, "has_location", False) or not origin or \
            not str(origin).endswith(".py") or not Path(origin).is_file():
        raise BadInputError(f"-m {name!r} is not a Python source file ({origin or 'built in'}); "
                            "cfrun reads and hashes the script's source: give a module "
                            "written in Python, or the path of a script file")
    return Path(origin).resolve()
