"""One adapter per training framework whose library code sits between the script and cfrun.

Each adapter names the framework versions it was tested against and, for any other version,
falls back to cfrun's generic behaviour and says why (a ``not_exact`` reason): the library
internals it relies on may have changed.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any


@functools.cache
def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (``"accelerate"``), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def untested(dist: str, tested: tuple[str, ...], adapter: str) -> str | None:
    """Why ``adapter`` stays off for the installed ``dist`` (None: a version in ``tested``)."""
    version = installed_version(dist)
    if version in tested:
        return None
    return (f"{dist} {version} is not a version cfrun's {adapter} was tested against "
            f"({', '.join(tested)})")


def frame_of(caller: types.FrameType | None, function: str, module: str
             ) -> types.FrameType | None:
    """The nearest frame of ``module``'s ``function`` at or above ``caller``, or None."""
    f = caller
    while f is not None:
        if f.f_code.co_name == function and f.f_globals.get("__name__") == module:
            return f
        f = f.f_back
    return None


def when_imported(module: str, fn: Callable[[], None]) -> None:
    """Call ``fn()`` once ``module`` is imported: now if it already is, else right after its
    import (a ``sys.meta_path`` finder that wraps the module's loader). Used to patch a
    framework class before the script that imports it calls into it."""
    if module in sys.modules:
        fn()
        return
    sys.meta_path.insert(0, _AfterImport(module, fn))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of one module so that ``fn`` runs after it."""

    def __init__(self, module: str, fn: Callable[[], None]) -> None:
        self.module, self.fn = module, fn

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, fn = spec.loader, self.fn

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                fn()

        spec.loader = _Loader()
        return spec
