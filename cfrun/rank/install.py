"""Phase 1: install cfrun's hooks into a rank process, and keep cfrun's failures out of it.

``hooks/sitecustomize.py`` calls :func:`arm` at interpreter start in rank processes only;
:func:`arm` waits for the script to import torch and then calls :func:`install`, which builds
the :class:`~cfrun.rank.runtime.Runtime` and patches torch: the ``__init__`` of optimizers,
LR schedulers and AMP scalers (:mod:`cfrun.rank.discovery`), the global optimizer step hooks
(:mod:`cfrun.rank.boundary`), DataLoader (:mod:`cfrun.rank.data`), ``torch.save`` (silent while
fast-forwarding), ``sys.excepthook``, ``sys.exit`` and an ``atexit`` handler (the marks of
:mod:`cfrun.rank.preemption`). Nothing here may break the user's script: any failure leaves the
job running unprotected, with a loud warning. Imports nothing heavy at module level.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from cfrun.rank.importwatch import ImportWatcher, when_imported

_runtime: Any = None
_guard: Any = None
loaded = False


class Guard:
    """Keeps cfrun's own failures out of the user's script, after :func:`install` as well.

    Every hook cfrun puts into the script's path (optimizer step hooks, DataLoader hooks,
    ``__init__`` registration, the checkpoint boundary) runs through :meth:`wrap`. The first
    ``Exception`` raised inside one turns cfrun off for the rest of this process: one loud
    ``UNPROTECTED`` warning on stderr, an ``unprotected`` event, and from then on every hook
    does what it would do without cfrun. ``SystemExit`` and ``KeyboardInterrupt`` (cfrun's
    deliberate stops, the user's Ctrl-C) pass through unchanged. Training thread only.
    """

    def __init__(self) -> None:
        self.rt: Any = None
        self.disabled = False

    def attach(self, rt: Any) -> None:
        """The :class:`~cfrun.rank.runtime.Runtime` that :meth:`disable` turns off."""
        self.rt = rt

    def wrap(self, where: str, fn: Callable[..., Any],
             fallback: Callable[..., Any] | None = None) -> Callable[..., Any]:
        """``fn`` guarded: after a failure (or once disabled) ``fallback(*args)`` runs
        instead, or nothing (``None``) when there is no fallback."""

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if not self.disabled:
                try:
                    return fn(*args, **kwargs)
                except Exception as e:
                    self.disable(where, e)
            return fallback(*args, **kwargs) if fallback is not None else None

        return guarded

    def disable(self, where: str, error: BaseException) -> None:
        """Turn cfrun off in this process and say so, loudly, once. Never raises."""
        if self.disabled:
            return
        self.disabled = True
        rt = self.rt
        try:
            rt.on_disabled()
        except Exception:
            pass
        step = getattr(rt, "step", None)
        try:
            sys.__stderr__.write(  # type: ignore[union-attr]
                f"[cfrun rank {os.environ.get('RANK', '?')}] WARNING: cfrun failed inside "
                f"{where} at step {step} ({error!r}); this job now runs UNPROTECTED: no more "
                "checkpoints in this attempt, the script goes on without cfrun\n")
            sys.__stderr__.flush()  # type: ignore[union-attr]
        except Exception:
            pass
        try:
            rt.jobdir.emit_event(
                "unprotected", where=where, error=repr(error), step=step,
                rank=rt.s.rank, attempt=rt.s.attempt,
                traceback=traceback.format_exception(type(error), error,
                                                     error.__traceback__)[-6:])
        except Exception:
            pass


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
        if _guard is not None:  # hooks already in place do nothing from now on
            _guard.disabled = True
        sys.stderr.write(f"[cfrun] WARNING: cfrun's runtime failed to start ({e!r}); "
                         "this job runs UNPROTECTED: no checkpoints, no resume\n")


def _install() -> Any:
    """Build this rank's :class:`~cfrun.rank.runtime.Runtime` from its settings (the
    ``CFRUN_*`` environment, :meth:`~cfrun.rank.settings.RankSettings.from_env`) with the
    :class:`Guard` around it, put cfrun's hooks into torch (:func:`_hook_torch`) and into the
    process's ways out (:func:`_hook_exits`), then start the Runtime: the job dir's identity
    checked, the persist agent connected, the plan read. Returns the Runtime."""
    from cfrun.contract import faults
    from cfrun.rank.runtime import Runtime
    from cfrun.rank.settings import RankSettings

    global _guard
    guard = _guard = Guard()
    rt = Runtime(RankSettings.from_env(), guard.wrap)
    guard.attach(rt)
    _hook_torch(rt, guard)
    _hook_exits(rt)
    start_delay_s = faults.value("rank.start_delay_s")
    if start_delay_s:
        time.sleep(float(start_delay_s))
    rt.check_job_dir()
    rt.connect_agent()
    rt.load_plan()
    return rt


def _hook_torch(rt: Any, guard: Guard) -> None:
    """Patch torch so ``rt``'s phases see the training, each hook through ``guard``: the
    ``__init__`` of optimizers, LR schedulers and AMP scalers (registered with
    :class:`~cfrun.rank.discovery.Discovery`), the global optimizer step hooks
    (:class:`~cfrun.rank.boundary.Boundary`, :func:`_step_hook`), DataLoader
    (:func:`cfrun.rank.data.install`), and ``torch.save``, silent while a resume
    fast-forwards (the script's own per-epoch checkpoint of a skipped epoch)."""
    import torch
    import torch.optim.lr_scheduler as lrs
    from torch.optim.optimizer import (
        Optimizer,
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from cfrun.rank import data

    found, boundary, resume = rt.found, rt.boundary, rt.resume

    def on_optimizer(opt: Any) -> None:
        found.register_optimizer(opt)
        boundary.on_optimizer_created(opt)

    _wrap_init(Optimizer, guard.wrap("Optimizer.__init__", on_optimizer))
    _wrap_init(lrs.LRScheduler, guard.wrap("LRScheduler.__init__", found.register_scheduler))
    if not issubclass(lrs.ReduceLROnPlateau, lrs.LRScheduler):
        _wrap_init(lrs.ReduceLROnPlateau,
                   guard.wrap("ReduceLROnPlateau.__init__", found.register_scheduler))
    _wrap_init(torch.amp.GradScaler, guard.wrap("GradScaler.__init__", found.register_scaler))
    register_optimizer_step_pre_hook(guard.wrap("the optimizer step pre-hook",
                                                boundary.on_before_step))
    register_optimizer_step_post_hook(guard.wrap("the optimizer step hook",
                                                 _step_hook(boundary)))
    data.install(guard, register_loader=found.register_loader,
                 on_loader_iter=resume.on_loader_iter, on_loader_next=boundary.on_loader_next)

    orig_save = torch.save

    def save(*args: Any, **kwargs: Any) -> Any:
        if resume.fast_forwarding:  # the script's own per-epoch checkpoint of a skipped epoch
            return None
        return orig_save(*args, **kwargs)

    torch.save = save


def _step_hook(boundary: Any) -> Callable[..., None]:
    """The optimizer step post-hook, on every step: ``boundary``'s
    :meth:`~cfrun.rank.boundary.Boundary.on_optimizer_step` itself, or, where the fault points
    ``rank.step_delay_s`` or ``rank.raise_in_step`` are armed, a layer around it that sleeps
    after each step or raises an internal error at the given step."""
    from cfrun.contract import faults

    raise_at = int(faults.value("rank.raise_in_step") or 0)
    step_delay_s = float(faults.value("rank.step_delay_s") or 0.0)
    if not (raise_at or step_delay_s):  # the fault points' extra layer only where armed
        return boundary.on_optimizer_step

    def on_step(opt: Any, args: Any, kwargs: Any) -> None:
        boundary.on_optimizer_step(opt, args, kwargs)
        if step_delay_s:
            time.sleep(step_delay_s)
        if raise_at and boundary.step == raise_at:
            raise RuntimeError(f"injected internal error at step {raise_at} "
                               "(fault point rank.raise_in_step)")

    return on_step


def _hook_exits(rt: Any) -> None:
    """Hook the ways the script's process ends, for ``rt`` (the marks of
    :mod:`cfrun.rank.preemption`): ``sys.excepthook`` (an uncaught error; one that only
    reports another rank's death printed as one line, :func:`_transport_note`), ``sys.exit``
    (the script's exit code, for the end-of-script mark) and an ``atexit`` handler (the end
    mark, the last hand-off), which runs when cfrun is disabled too."""
    import atexit

    from cfrun.rank.log import say

    orig_hook = sys.excepthook

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        note = None
        try:
            rt.on_uncaught(exc_type, exc, tb)
            note = _transport_note(rt, exc_type, exc)
        except Exception:
            pass
        finally:
            if note is not None:
                say(note)
            else:
                orig_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    orig_exit = sys.exit

    def exit(status: Any = None) -> Any:  # the script's exit code, for the end-of-script mark
        try:
            rt.marks.note_exit(status)
        except Exception:
            pass
        return orig_exit(status)

    sys.exit = exit

    done: list[bool] = []

    def at_exit() -> None:  # runs when disabled too: the end mark, the last hand-off
        if done:
            return
        done.append(True)
        try:
            rt.at_exit()
        except Exception as e:
            sys.stderr.write(f"[cfrun] WARNING: cfrun's exit handler failed ({e!r})\n")

    atexit.register(at_exit)
    _END_HANDLER[:] = [at_exit]


_END_HANDLER: list[Any] = []
"""cfrun's end-of-script handler once installed (:func:`_hook_exits`), for
:func:`script_ended`."""


def script_ended() -> None:
    """Run cfrun's end-of-script handler now, once (the ``atexit`` one then does nothing): the
    end mark, the final checkpoint, the last hand-off. A rank started as a warm spare
    (:func:`cfrun.rank.spare.become_rank`) calls it when the script's code returns or raises
    SystemExit: there cfrun's ``atexit`` handler was registered before any of the script's,
    so it would run after them all, after one that ends the process too (``os.abort``: torch
    and gloo's destructors sometimes do), where ``python SCRIPT`` runs it before those the
    script registered before its ``import torch``. No-op before cfrun is installed."""
    for handler in _END_HANDLER:
        handler()


_REGISTERED: dict[int, Any] = {}
"""Objects already handed to ``register``, by ``id``: a weak reference each (removed when the
object dies), or the object itself where it takes no weak reference. Kept here, not as an
attribute on the object, so nothing of cfrun reaches the user's ``state_dict()`` or saved files
(an LR scheduler's ``state_dict()`` is its ``__dict__``)."""


def _transport_note(rt: Any, exc_type: Any, exc: Any) -> str | None:
    """The one line a rank prints instead of its traceback for an uncaught error that only
    reports another rank's death (:func:`cfrun.contract.coordination.is_transport_error`: gloo's
    "Connection reset by peer" after a rank was killed), naming the error record in the job
    dir's ``errors/`` that keeps the traceback (issue 27, item 5); None for any other error,
    or where the record was not written (the traceback is printed then)."""
    from cfrun.contract import coordination as co

    message = str(exc)
    if rt.marks.s.world_size < 2:  # no other rank: the script's own connection failed
        return None  # (issue 37, item 7)
    if not co.is_transport_error(getattr(exc_type, "__name__", None), message):
        return None
    path = co.error_path(rt.marks.jobdir.root, rt.marks.s.attempt, rt.marks.s.rank)
    if not path.is_file():
        return None
    import re

    first = re.sub(r"^\[[^\]]*\]\s*", "", (message.strip().splitlines() or [""])[0])
    return (f"{exc_type.__name__}: {clip_words(first, 120)} (a consequence of another rank's "
            f"failure; traceback in {path})")


def clip_words(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters at a word's end, with `` ...`` where it
    was cut (gloo's error was cut mid-word: issue 37, item 7); a first word longer than that
    is cut inside it."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = text[:max_chars - 4]
    if text[max_chars - 4] != " " and " " in head:
        head = head.rsplit(" ", 1)[0]
    return head.rstrip(" ,;:") + " ..."


def _mark_registered(obj: Any) -> bool:
    """Remember ``obj`` as registered; False if it already was (a subclass's ``__init__`` calling
    its wrapped base's). Called on the thread that builds the object."""
    key = id(obj)
    held = _REGISTERED.get(key)
    if held is not None and (held() if isinstance(held, weakref.ref) else held) is obj:
        return False
    try:
        _REGISTERED[key] = weakref.ref(obj, functools.partial(_forget, key))
    except TypeError:  # no weak references (``__slots__`` without ``__weakref__``): keep it
        _REGISTERED[key] = obj
    return True


def _forget(key: int, ref: Any) -> None:
    if _REGISTERED.get(key) is ref:
        del _REGISTERED[key]


def _wrap_init(cls: type, register: Any) -> None:
    """Wrap ``cls.__init__`` so that every object built is handed to ``register`` once. A
    warning the original ``__init__`` gives with ``stacklevel=2`` names this wrapper's line,
    not the caller's (nanoGPT's own GradScaler warning read ``cfrun/rank/install.py``: issue
    37, item 7): :func:`_warn_as_the_caller` gives it the caller's file and line back."""
    orig = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        caught: list[warnings.WarningMessage] | None = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # the user's filters act when given again
                orig(self, *args, **kwargs)
        finally:
            _warn_as_the_caller(caught, sys._getframe(1))
        if _mark_registered(self):
            register(self)

    cls.__init__ = __init__  # type: ignore[misc]


def _warn_as_the_caller(caught: list[warnings.WarningMessage] | None,
                        caller: types.FrameType) -> None:
    """Give the warnings ``caught`` during a wrapped ``__init__`` again, through the user's
    filters and the caller's registry: one that names this module (the wrapper's frame) as
    the caller's line (``caller``: the wrapper's caller), any other as it was."""
    here = _warn_as_the_caller.__code__.co_filename
    for w in caught or ():
        if w.filename == here:
            where: Any = caller.f_globals
            filename, lineno = caller.f_code.co_filename, caller.f_lineno
        else:
            where, filename, lineno = None, w.filename, w.lineno
        warnings.warn_explicit(w.message, w.category, filename, lineno, source=w.source,
                               registry=where.setdefault("__warningregistry__", {})
                               if where is not None else None,
                               module_globals=where)


def when_torch_imported(then: Callable[[], None]) -> None:
    """Call ``then`` now if torch is already imported, else right after the script imports it
    (``cfrun verify``'s observer of a plain run, :func:`cfrun.rank.verify.observe`)."""
    when_imported("torch", then)


def arm() -> None:
    """Install now if torch is already imported, else as soon as the script imports it; a
    failure of the script before that is recorded all the same (:mod:`cfrun.rank.early`)."""
    from cfrun.rank import early

    early.install()
    if "torch" in sys.modules:
        install()
    elif not any(isinstance(f, ImportWatcher) and f.name == "torch" for f in sys.meta_path):
        sys.meta_path.insert(0, ImportWatcher(install, "torch"))
