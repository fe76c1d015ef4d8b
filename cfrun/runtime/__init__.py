"""Code that runs inside the training (rank) processes.

``hooks/sitecustomize.py`` calls :func:`arm` at interpreter start in rank processes only;
:func:`arm` waits for the script to import torch and then calls :func:`install`. Nothing here
may break the user's script: any failure leaves the job running unprotected, with a loud warning.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_runtime: Any = None
loaded = False


def install() -> None:
    """Install every hook once (idempotent). Never raises."""
    global _runtime, loaded
    if _runtime is not None:
        return
    try:
        _runtime = _install()
        loaded = True
    except Exception as e:  # the user's job must run even if cfrun cannot protect it
        loaded = False
        sys.stderr.write(f"[cfrun] WARNING: cfrun's runtime failed to start ({e!r}); "
                         "this job runs UNPROTECTED: no checkpoints, no resume\n")


def _install() -> Any:
    import atexit

    import torch
    import torch.optim.lr_scheduler as lrs
    from torch.optim.optimizer import (
        Optimizer,
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from cfrun.runtime import data
    from cfrun.runtime.core import RankSettings, Runtime

    rt = Runtime(RankSettings.from_env())

    _wrap_init(Optimizer, rt.register_optimizer)
    _wrap_init(lrs.LRScheduler, rt.register_scheduler)
    if not issubclass(lrs.ReduceLROnPlateau, lrs.LRScheduler):
        _wrap_init(lrs.ReduceLROnPlateau, rt.register_scheduler)
    _wrap_init(torch.amp.GradScaler, rt.register_scaler)
    register_optimizer_step_pre_hook(rt.on_before_step)
    register_optimizer_step_post_hook(rt.on_optimizer_step)
    data.install(rt)

    orig_save = torch.save

    def save(*args: Any, **kwargs: Any) -> Any:
        if rt.fast_forwarding:  # the script's own per-epoch checkpoint of a skipped epoch
            return None
        return orig_save(*args, **kwargs)

    torch.save = save

    orig_hook = sys.excepthook

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            rt.on_uncaught(exc_type, exc, tb)
        finally:
            orig_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    orig_exit = sys.exit

    def exit(status: Any = None) -> Any:  # the script's exit code, for the end-of-script mark
        rt.note_exit(status)
        return orig_exit(status)

    sys.exit = exit
    atexit.register(rt.at_exit)
    rt.connect_agent()
    rt.load_plan()
    return rt


def _wrap_init(cls: type, register: Any) -> None:
    orig = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        if "_cfrun_registered" not in self.__dict__:
            self.__dict__["_cfrun_registered"] = True
            register(self)

    cls.__init__ = __init__  # type: ignore[misc]


class _TorchWatcher(importlib.abc.MetaPathFinder):
    """Calls :func:`install` right after ``import torch`` completes, and only then."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig_exec = loader.exec_module  # type: ignore[attr-defined]

        def exec_module(module: Any) -> None:
            orig_exec(module)
            install()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def arm() -> None:
    """Install now if torch is already imported, else as soon as the script imports it."""
    if "torch" in sys.modules:
        install()
    elif not any(isinstance(f, _TorchWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchWatcher())
