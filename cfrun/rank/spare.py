"""A warm spare of a ``--launcher python`` rank: Python started, torch and cfrun imported, waiting
to become the next attempt's rank (issue 35, "a warm restart").

A restart after a rank's death used to start a new interpreter and import torch and cfrun before
the script's first line ran again: 1.5 s of a 5 s recovery here, 4.2 s of 23 s for the H100's
GPT. The supervisor (:class:`cfrun.supervisor.standby.Standby`) starts this module while the
attempt trains, as ``python -c ... cfrun.rank.spare FD`` with the attempt's environment less
the rank settings (so cfrun's hook does not arm); it imports what a rank imports, says
``ready`` on the socket ``FD``, and blocks. When the rank dies the supervisor sends the new
attempt's environment; this process then becomes the rank: it takes that environment, sets
``sys.argv``, ``sys.path[0]`` and a fresh ``__main__`` module as ``python SCRIPT ARGS`` (or
``python -m MODULE ARGS``) would, arms cfrun's hook (:func:`cfrun.rank.install.arm`: torch is
imported, so the runtime installs at once and the checkpoint's read starts before the script's
first line) and runs the script. An uncaught exception is printed by ``sys.excepthook`` without
this module's frames, and exits 1, as Python does. The socket closed before a go (the
supervisor gone or stopping the spare) ends the process with status 0.

No CUDA context is made (``import torch`` makes none): the spare holds no GPU memory while it
waits. Where the idea comes from: a zygote or hot-spare process (NVRx's in-process restart keeps
the process; Android's zygote keeps a warm interpreter); here only what is the same for every
attempt is done ahead.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import json
import os
import socket
import sys
import time
import types
from pathlib import Path
from typing import Any

go_unix_s: float | None = None
"""When this process became the rank (set on the importable module ``cfrun.rank.spare``, read
by the ``resumed`` event as the rank's start); None in a rank started cold."""

GO_MAX_BYTES = 4 << 20
"""The largest go message read (the new attempt's environment as JSON)."""

WARM_LAUNCHER_MODULES = ("torch", "torch.distributed.run")
"""What torchrun imports at its start, imported ahead by a launcher spare (``FD launcher``)."""

WARM_MODULES = ("torch", "torch.distributed", "torch.utils.data", "cfrun.rank.install",
                "cfrun.rank.runtime", "cfrun.rank.boundary", "cfrun.rank.resume",
                "cfrun.rank.snapshot", "cfrun.codec.checkpoint")
"""What a rank imports at its start, imported ahead by the spare (torch first; importing them
runs no hook: cfrun's install is armed only at the go)."""

WARM_DISTRIBUTED_MODULES = ("torch._dynamo",)
"""Imported ahead too by the spare of one of several ranks (``FD ranks``, a ``--launcher
python --nproc-per-node N`` job's): DistributedDataParallel's constructor imports
``torch._dynamo`` (torch 2.13, ``get_optimize_ddp_mode``), with sympy ~800 modules, 1.1-2.4 s
of every DDP rank's start here (1.1 s of DDP's 1.25 s). The import makes no CUDA call, starts
no thread and draws from no random generator (checked on torch 2.13); ~75 MB more per spare."""


def _recv_go(sock: socket.socket) -> dict[str, Any] | None:
    """The go message (one JSON object, the sender closes its side after it), or None when
    the socket closed without one."""
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            return None
        if not chunk:
            break
        size += len(chunk)
        if size > GO_MAX_BYTES:
            return None
        chunks.append(chunk)
    if not chunks:
        return None
    msg = json.loads(b"".join(chunks))
    return msg if isinstance(msg, dict) else None


def _fresh_main(path: str | None) -> types.ModuleType:
    """A ``__main__`` module as CPython makes for ``python PATH`` (``__file__`` absolute, a
    ``SourceFileLoader``, no spec, no package), installed in ``sys.modules``."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __spec__=None, __package__=None,
                         __cached__=None)
    if path is not None:
        main.__file__ = path
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    return main


def _arm() -> None:
    """cfrun's hook, as ``hooks/sitecustomize.py`` runs it at a rank's interpreter start
    (where the supervisor set the rank settings, as it does in every go)."""
    from cfrun.contract import settings as E

    if E.RANK_SETTINGS not in os.environ:
        return
    os.environ[E.HOOK_OWNER_PID] = str(os.getpid())
    try:
        from cfrun.rank.install import arm

        arm()
    except Exception as e:
        sys.stderr.write(f"[cfrun] WARNING: cfrun's hook failed ({e!r}); this job runs "
                         "UNPROTECTED: no checkpoints, no resume\n")


def _report(exc: BaseException, first_file: str | None) -> None:
    """Print an uncaught exception as Python would: through ``sys.excepthook`` (cfrun's, which
    records the rank's error), starting at the script's first frame (``first_file``), or at
    runpy's for ``-m`` as ``python -m`` shows it."""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if (first_file is not None and name == first_file) or (
                first_file is None and "runpy" in name):
            break
        tb = tb.tb_next
    if tb is not None:  # CPython prints the exception's own __traceback__, not the argument
        exc.__traceback__ = tb
    sys.excepthook(type(exc), exc, exc.__traceback__)


def become_rank(go: dict[str, Any]) -> None:
    """Take the go message's environment, ``argv`` and script (``script`` or ``module``) and run
    it as the rank. Returns when the script returns; raises SystemExit as the script does.

    Raises:
        SystemExit: the script's own, or 1 after an uncaught exception was printed.
    """
    import cfrun.rank.spare as this  # this file runs as __main__: its importable twin

    this.go_unix_s = time.time()
    env = go["env"]
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    args = [str(a) for a in go["args"]]
    module = go.get("module")
    if module:
        import runpy

        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()
        _arm()
        try:
            runpy._run_module_as_main(str(module), alter_argv=True)  # type: ignore[attr-defined]
        except SystemExit:
            raise
        except BaseException as e:
            _report(e, None)
            raise SystemExit(1) from None
        return
    script = str(go["script"])
    path = os.path.abspath(script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    main = _fresh_main(path)
    _arm()
    try:
        with io.open_code(path) as f:
            source = f.read()
        code = compile(source, path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        _report(e, path)
        raise SystemExit(1) from None


def become_launcher(go: dict[str, Any]) -> None:
    """Take the go message's environment and run its ``run_module`` (``MODULE ARGS...``) as
    ``python -m MODULE ARGS`` would, as the attempt's cold command would have: the supervisor
    sends torchrun's (:mod:`cfrun.supervisor.torchrun_log`), which starts the ranks, fresh
    processes that inherit this environment. Raises SystemExit as the module does."""
    import runpy

    import cfrun.rank.spare as this

    this.go_unix_s = time.time()
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in go["env"].items()})
    module, *args = [str(a) for a in go["run_module"]]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _import_ahead() -> None:
    """What the last rank of this node imported (:mod:`cfrun.rank.warm_imports`), unless
    ``CFRUN_STANDBY_IMPORTS=0``; the job dir and node come from the job's marks in this
    process's environment. Never raises."""
    from cfrun.contract import settings as E
    from cfrun.rank import warm_imports

    job_dir = os.environ.get(E.RANK_JOB_DIR)
    try:
        if not job_dir or not E.get_flag(E.STANDBY_IMPORTS):
            return
        node_rank = int(os.environ.get(E.NODE_RANK, "0"))
    except Exception:  # a bad value: the rank says so itself at the go
        return
    warm_imports.import_ahead(Path(job_dir), node_rank)


def _hold_at_go() -> None:
    """The fault point ``rank.spare_go_delay_s`` (the spare's environment is the job's: tests
    make a kill land in the hand-over)."""
    from cfrun.contract import faults

    delay_s = faults.value("rank.spare_go_delay_s")
    if delay_s:
        sys.stderr.write(f"[cfrun spare] took the go; holding it {delay_s} s (fault point)\n")
        sys.stderr.flush()
        time.sleep(float(delay_s))


def main(argv: list[str]) -> None:
    """``cfrun.rank.spare FD [launcher|ranks]``: warm up, say ready on socket FD, wait for the
    go, run the rank (or, with ``launcher``, torchrun, which starts the ranks; ``ranks``: one
    of several ranks, :data:`WARM_DISTRIBUTED_MODULES` imported too). Returns when
    stopped before a go, or when the script returns (the interpreter then ends as after
    ``python SCRIPT``: no ``sys.exit``, which cfrun's runtime notes as the script's)."""
    sock = socket.socket(fileno=int(argv[0]))
    launcher = argv[1:2] == ["launcher"]
    warm: tuple[str, ...] = WARM_LAUNCHER_MODULES if launcher else WARM_MODULES
    if argv[1:2] == ["ranks"]:
        warm += WARM_DISTRIBUTED_MODULES
    for name in warm:
        __import__(name)
    if not launcher:
        _import_ahead()
    sock.sendall(b"ready\n")
    go = _recv_go(sock)
    sock.close()
    if go is not None:
        _hold_at_go()
        if launcher:
            become_launcher(go)
        else:
            become_rank(go)


if __name__ == "__main__":
    main(sys.argv[1:])
