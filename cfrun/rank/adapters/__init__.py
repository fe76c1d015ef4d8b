"""One adapter per training framework whose library code sits between the script and cfrun.

Each adapter names the framework versions it was tested against and, for any other version,
falls back to cfrun's generic behaviour and says why (a ``not_exact`` reason): the library
internals it relies on may have changed.
"""

from __future__ import annotations

import importlib.metadata


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (``"accelerate"``), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
