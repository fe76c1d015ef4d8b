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
"""Imported ahead too by a rank's spare: always by the spare of one of several ranks (``FD
ranks``, a ``--launcher python --nproc-per-node N`` job's), whose DistributedDataParallel
constructor imports ``torch._dynamo`` (torch 2.13, ``get_optimize_ddp_mode``); by the one
rank's unless ``CFRUN_STANDBY_IMPORTS=0`` (:func:`_import_ahead`), since the first optimizer
imports it too. With sympy ~800 modules: 1.1-2.4 s of every rank's start here. The import makes
no CUDA call, starts no thread and draws from no random generator (checked on torch 2.13);
~75 MB more per spare, shared with the spares forked from it."""


def _recv_go(sock: socket.socket) -> tuple[dict[str, Any] | None, int | None]:
    """The go message (one JSON object, the sender closes its side after it), or None when
    the socket closed without one; and the descriptor that came with its first bytes (the
    socket of the next spare to fork, :func:`_fork_next_spare`), or None."""
    chunks: list[bytes] = []
    size = 0
    next_fd: int | None = None
    while True:
        try:
            if chunks or next_fd is not None:
                chunk = sock.recv(1 << 16)
            else:
                chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, 1)
                for fd in fds[1:]:
                    os.close(fd)
                next_fd = fds[0] if fds else None
        except OSError:
            break
        if not chunk:
            break
        size += len(chunk)
        if size > GO_MAX_BYTES:
            break
        chunks.append(chunk)
    try:
        msg = json.loads(b"".join(chunks)) if chunks and size <= GO_MAX_BYTES else None
    except ValueError:
        msg = None
    if not isinstance(msg, dict):
        if next_fd is not None:
            os.close(next_fd)
        return None, None
    return msg, next_fd


def _threads() -> int:
    """This process's threads, native ones included (``/proc/self/task``); 0 where unknown."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _fork_next_spare(next_fd: int) -> socket.socket | None:
    """Fork the next warm spare from this one at its go, before it becomes the rank: a copy
    made before anything of the job ran, with torch and cfrun imported, so the next restart
    costs a fork instead of an interpreter's start and import (~5 CPU-s here).

    Returns None in this process (it goes on to become the rank), and in the new spare the
    socket ``next_fd`` on which it said ``ready PID`` (it then waits for its own go). The new
    spare is forked twice over and starts a session of its own, so it is no child of the rank
    (a script's ``os.wait`` never sees it) and no signal to the rank's group reaches it; the
    supervisor, a child subreaper (``PR_SET_CHILD_SUBREAPER``), becomes its parent and reaps
    it (:class:`cfrun.supervisor.standby.AdoptedProcess`). It says ready only once it is the
    supervisor's child, and gets the supervisor's death signal as a spare started by
    ``Popen`` does. Nothing is forked where the process runs a second thread (a fork keeps
    only the calling one): the supervisor then starts the next spare cold, as before.

    Where the idea comes from: Android's zygote, CPython's ``forkserver`` start method.
    """
    supervisor_pid = os.getppid()
    for stream in (sys.stdout, sys.stderr):  # no buffered bytes written twice
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if _threads() != 1:
        os.close(next_fd)
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(next_fd)
        return None
    if pid:
        os.close(next_fd)
        try:
            os.waitpid(pid, 0)  # the go-between, which exits at once
        except ChildProcessError:
            pass
        return None
    try:  # the go-between
        if os.fork():
            os._exit(0)
    except BaseException:
        os._exit(1)
    try:  # the new spare
        os.setsid()
        deadline_s = time.monotonic() + 5.0
        while os.getppid() != supervisor_pid:  # re-parented once the go-between exits
            if time.monotonic() > deadline_s:  # not a subreaper: nobody would reap us
                os._exit(0)
            time.sleep(0.001)
        from cfrun.contract.lifetime import die_with

        die_with(supervisor_pid, orphan_exit_code=0)  # the supervisor's death signal
        _import_ahead()  # what the ranks imported since (only what is not imported yet)
        sock = socket.socket(fileno=next_fd)
        sock.sendall(b"ready %d\n" % os.getpid())
        return sock
    except BaseException:
        os._exit(1)


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
    A go with ``cold`` came before the spare was ready (a cold attempt's rank started as a
    spare, :meth:`cfrun.supervisor.standby.Standby.start_rank`): no warm start, so
    :data:`go_unix_s` stays None and the ``resumed`` event says neither ``warm`` nor the go.

    Raises:
        SystemExit: the script's own, or 1 after an uncaught exception was printed.
    """
    import cfrun.rank.spare as this  # this file runs as __main__: its importable twin

    if not go.get("cold"):  # a cold rank's spare imported after its go: not a warm start
        this.go_unix_s = time.time()
    try:
        _run_script(go)
    finally:
        try:
            _join_threads()  # as the interpreter does at its end, before any atexit handler
        finally:  # cfrun's end mark before the script's own atexit handlers, as in a cold rank
            from cfrun.rank import install

            install.script_ended()


def _join_threads() -> None:
    """Wait for every non-daemon thread but this one, as CPython does at its end before the
    ``atexit`` handlers run: ``threading._shutdown`` itself (it first runs the threading
    ``atexit`` calls, so an idle ``ThreadPoolExecutor``'s workers exit instead of being waited
    for forever, and it does nothing when called again at the interpreter's end). A script
    whose main thread returns while a thread it started still trains then ends when that
    thread does, and cfrun's end mark (:func:`cfrun.rank.install.script_ended`) comes after
    the training and runs in the state it has in a cold rank. Main thread only."""
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
        return
    me = threading.current_thread()  # an interpreter without it: join them one by one
    while True:
        alive = [t for t in threading.enumerate()
                 if t is not me and not t.daemon and t.is_alive()]
        if not alive:
            return
        for t in alive:
            t.join()


def _run_script(go: dict[str, Any]) -> None:
    """The body of :func:`become_rank`: the go's environment, ``argv``, ``sys.path[0]``,
    ``__main__`` and cfrun's hook, then the script."""
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
    """Unless ``CFRUN_STANDBY_IMPORTS=0``: ``torch._dynamo``, which the first optimizer a
    script constructs imports (torch 2.13's ``_disable_dynamo`` wrappers; with sympy ~800
    modules, 2.4 CPU-s here), and what the last rank of this node imported
    (:mod:`cfrun.rank.warm_imports`; the job dir and node come from the job's marks in this
    process's environment). Importing ``torch._dynamo`` makes no CUDA call, starts no thread
    and draws from no random generator (checked on torch 2.13). Never raises."""
    from cfrun.contract import settings as E
    from cfrun.rank import warm_imports

    job_dir = os.environ.get(E.RANK_JOB_DIR)
    try:
        if not E.get_flag(E.STANDBY_IMPORTS):
            return
        node_rank = int(os.environ.get(E.NODE_RANK, "0"))
    except Exception:  # a bad value: the rank says so itself at the go
        return
    for name in WARM_DISTRIBUTED_MODULES:
        try:
            __import__(name)
        except Exception:
            pass
    if job_dir:
        warm_imports.import_ahead(Path(job_dir), node_rank)


def _hold_at_go(go: dict[str, Any]) -> None:
    """The fault point ``rank.spare_go_delay_s`` (the spare's environment is the job's: tests
    make a kill land in the hand-over): at a warm go (not a cold rank's), once per job dir
    (the spares forked from this one inherit the environment; the file ``spare-go-held`` in
    the job dir says it held)."""
    from cfrun.contract import faults
    from cfrun.contract import settings as E

    delay_s = faults.value("rank.spare_go_delay_s")
    job_dir = os.environ.get(E.RANK_JOB_DIR)
    if not delay_s or go.get("cold") or not job_dir:
        return
    try:
        os.close(os.open(os.path.join(job_dir, "spare-go-held"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    except OSError:  # held once already
        return
    sys.stderr.write(f"[cfrun spare] took the go; holding it {delay_s} s (fault point)\n")
    sys.stderr.flush()
    time.sleep(float(delay_s))


def main(argv: list[str]) -> None:
    """``cfrun.rank.spare FD [launcher|ranks] [-- SCRIPT ARGS]``: warm up, say ready on socket
    FD, wait for the go, run the rank (or, with ``launcher``, torchrun, which starts the ranks;
    ``ranks``: one of several ranks, :data:`WARM_DISTRIBUTED_MODULES` imported too); a rank's
    spare forks the next spare at its go (:func:`_fork_next_spare`). Returns when stopped
    before a go, or when the script returns (the interpreter then ends as after ``python
    SCRIPT``: no ``sys.exit``, which cfrun's runtime notes as the script's). What follows
    ``--`` is only shown (``ps``): the go message says what to run."""
    sock = socket.socket(fileno=int(argv[0]))
    launcher = argv[1:2] == ["launcher"]
    warm: tuple[str, ...] = WARM_LAUNCHER_MODULES if launcher else WARM_MODULES
    if argv[1:2] == ["ranks"]:
        warm += WARM_DISTRIBUTED_MODULES
    for name in warm:
        __import__(name)
    if not launcher:
        _import_ahead()
    try:
        sock.sendall(b"ready\n")
    except OSError:  # a go sent at once (a cold rank's spare) and its sender's side closed
        pass
    while True:
        go, next_fd = _recv_go(sock)
        sock.close()
        if go is None:
            return
        if next_fd is not None and not launcher:
            new_spare = _fork_next_spare(next_fd)
            if new_spare is not None:  # this process is the next spare: wait for its go
                sock = new_spare
                continue
        elif next_fd is not None:
            os.close(next_fd)
        _hold_at_go(go)
        if launcher:
            become_launcher(go)
        else:
            become_rank(go)
        return


if __name__ == "__main__":
    main(sys.argv[1:])
