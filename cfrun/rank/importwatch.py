"""Run a function right after the script imports a module (torch, argparse), without importing
it first: a ``sys.meta_path`` finder that wraps the module's ``exec_module``. Used by
:mod:`cfrun.rank.install` (install cfrun once torch is imported) and :mod:`cfrun.rank.early`
(patch argparse); kept apart from both so that neither imports the other (issue 36: the
``early`` <-> ``install`` import circle). Imports nothing heavy.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


class ImportWatcher(importlib.abc.MetaPathFinder):
    """Calls ``then`` right after ``import NAME`` completes, and only then (removes itself
    from ``sys.meta_path`` at the first look-up of ``name``)."""

    def __init__(self, then: Callable[[], None], name: str) -> None:
        self.then = then
        self.name = name

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig_exec = loader.exec_module

        then = self.then

        def exec_module(module: Any) -> None:
            orig_exec(module)
            then()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def when_imported(name: str, then: Callable[[], None]) -> None:
    """Call ``then`` now if module ``name`` (top level) is already imported, else right after
    the script imports it."""
    if name in sys.modules:
        then()
    else:
        sys.meta_path.insert(0, ImportWatcher(then, name))
