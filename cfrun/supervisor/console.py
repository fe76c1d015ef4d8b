"""The ranks' console, kept in the job dir: ``logs/attempt-N-output.log`` (issue 37).

torchrun and ``python`` leave a rank's output on the console alone: once the terminal is closed,
the pod restarted or the scroll-back gone, nothing tells what the script printed before it died.
torchrun's own ``--tee``/``--redirects`` keep it, but they make the rank's stdout a file (no
longer a terminal: progress bars and colours change) and prefix every line on the console.

Here each of cfrun's two console streams (its stdout and stderr, which the ranks would inherit)
is given to the ranks through a tap of the same kind: a pseudo-terminal where cfrun's stream is
a terminal (so ``isatty()``, the window size and Python's line buffering are what the plain run
has; one pseudo-terminal for both streams when both are the same terminal, so their order is the
terminal's), a pipe where it is a file or a pipe (block-buffered in the rank either way). One
thread per stream copies what the ranks write, byte for byte, to cfrun's stream and, line by
line (so stdout's and stderr's lines do not cut into each other), to the attempt's output file
(mode 0600, never through a link, at most :data:`OUTPUT_CAP_BYTES` per attempt so a chatty
script cannot fill the disk the checkpoints need). When the console's reader is gone (``cfrun
train.py | head``) the tap's read end is closed, so the rank meets the same ``BrokenPipeError``
it would meet without cfrun. A full disk or an unwritable file only stops the keeping (said
once), never the ranks. ``CFRUN_CONSOLE_LOG=0`` turns the tap off.

Called by the supervisor's main thread (:class:`cfrun.supervisor.core.Supervisor`), which opens
the tap once per run, names each attempt's file (:meth:`ConsoleTap.keep_in`) and drains the tap
when an attempt ends, so the ranks' last lines reach the console before the supervisor's own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import stat
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfrun.contract import faults

logger = logging.getLogger("cfrun")

OUTPUT_CAP_BYTES = 64 << 20
"""The most of one attempt's output kept in its file (the console gets all of it)."""

_POLL_MS = 50
_PARTIAL_MAX_BYTES = 1 << 16
"""The most of an unfinished line held back from the file (longer: kept as it is)."""
_WINSIZE_EVERY_S = 0.5


@dataclass(eq=False)
class _Stream:
    """One console stream's tap: ``console_fd`` is cfrun's (1 or 2), ``child_fd`` what the
    ranks get as theirs, ``read_fd`` where the pump reads it."""

    console_fd: int
    read_fd: int
    child_fd: int
    is_pty: bool
    asked: int = 0
    """Drain requests so far."""
    idle_at: int = -1
    """The request count the pump last found the tap empty at."""
    done: bool = False
    partial: bytes = b""
    """The end of a line not yet kept (the file gets whole lines, so two streams' lines do
    not cut into each other there; kept as it is once the stream is quiet)."""
    thread: threading.Thread | None = field(default=None, repr=False)


def _same_terminal(a: int, b: int) -> bool:
    try:
        return os.isatty(a) and os.isatty(b) and os.fstat(a).st_rdev == os.fstat(b).st_rdev
    except OSError:
        return False


def _copy_winsize(src_fd: int, dst_fd: int) -> None:
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(src_fd, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(dst_fd, termios.TIOCSWINSZ, size)


def _open_pty(console_fd: int) -> tuple[int, int]:
    """A pseudo-terminal like ``console_fd``'s terminal (its modes, its window size) but with
    output processing off, so the bytes read are the bytes the rank wrote (the real terminal
    still turns ``\\n`` into ``\\r\\n``)."""
    master, slave = os.openpty()
    try:
        attrs = termios.tcgetattr(console_fd)
    except termios.error:
        attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    with contextlib.suppress(termios.error):
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
    _copy_winsize(console_fd, slave)
    return master, slave


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:  # a console left non-blocking by someone: wait, then go on
            select.select([], [fd], [], 1.0)
            continue
        view = view[n:]


class ConsoleTap:
    """The taps of cfrun's stdout and stderr for one supervisor run (module docstring).

    Use: :meth:`open`, then hand :meth:`popen_kwargs` to each ``Popen`` of a rank's process
    (torchrun, a ``--launcher python`` rank, the warm spare), :meth:`keep_in` at each attempt's
    start, :meth:`drain` at its end, :meth:`close` at the run's end. A stream that is closed or
    not a file, pipe, socket or terminal is left alone (the ranks inherit it as before).
    """

    def __init__(self) -> None:
        self._streams: list[_Stream] = []
        self._child: dict[int, int] = {}  # 1/2 -> the fd the ranks get
        self._cond = threading.Condition()
        self._log_lock = threading.Lock()
        self._log_fd: int | None = None
        self._log_path: Path | None = None
        self._log_bytes = 0
        self._cap_bytes = int(faults.value("supervisor.output_cap_bytes") or OUTPUT_CAP_BYTES)
        self._closing = False

    def open(self) -> ConsoleTap:
        """Make the taps and start their pumps. Raises nothing: a tap that cannot be made
        (no pseudo-terminal left, no fds) leaves that stream alone, said at debug level."""
        if self._streams:
            return self
        for fd in (1, 2):
            try:
                st = os.fstat(fd)
            except OSError:
                continue
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode)
                    or stat.S_ISSOCK(st.st_mode) or stat.S_ISCHR(st.st_mode)):
                continue
            if fd == 2 and 1 in self._child and _same_terminal(1, 2):
                self._child[2] = self._child[1]  # one terminal: one pty, the terminal's order
                continue
            try:
                if os.isatty(fd):
                    read_fd, child_fd = _open_pty(fd)
                    is_pty = True
                else:
                    read_fd, child_fd = os.pipe()
                    is_pty = False
            except OSError as e:
                logger.debug("cfrun: the ranks' fd %d is not kept (%s)", fd, e)
                continue
            s = _Stream(fd, read_fd, child_fd, is_pty)
            s.thread = threading.Thread(target=self._pump, args=(s,), daemon=True,
                                        name=f"cfrun-console-{fd}")
            self._streams.append(s)
            self._child[fd] = child_fd
            s.thread.start()
        return self

    def popen_kwargs(self) -> dict[str, Any]:
        """``stdout``/``stderr`` for ``subprocess.Popen`` of a rank's process: the taps' ends
        ({} when the tap is off or not open)."""
        names = {1: "stdout", 2: "stderr"}
        return {names[fd]: child for fd, child in self._child.items()}

    def keep_in(self, path: Path | None) -> None:
        """From now on, the ranks' output also goes to ``path`` (created 0600, appended to,
        never through a symbolic link; None: nowhere). The output before it is drained into
        the file before (:meth:`drain`). No-op on a tap not opened or with no stream."""
        if path is not None and not self._streams:
            return
        self.drain()
        with self._log_lock:
            if self._log_fd is not None:
                os.close(self._log_fd)
                self._log_fd = None
            self._log_path, self._log_bytes = path, 0
            if path is None:
                return
            try:
                self._log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND
                                       | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                self._log_bytes = os.fstat(self._log_fd).st_size
            except OSError as e:
                logger.warning("cfrun: the ranks' output is not kept in %s: %s", path, e)

    def drain(self, timeout_s: float = 1.0) -> bool:
        """Wait until each pump has copied everything the ranks wrote before this call (at most
        ``timeout_s`` seconds). Returns whether it did in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            targets = []
            for s in self._streams:
                s.asked += 1
                targets.append((s, s.asked))
            for s, target in targets:
                while not (s.done or s.idle_at >= target):
                    left_s = deadline - time.monotonic()
                    if left_s <= 0:
                        return False
                    self._cond.wait(left_s)
        return True

    def close(self) -> None:
        """Drain, stop the pumps, close every fd of the tap and the output file."""
        self.drain()
        self._closing = True
        for s in self._streams:
            if s.thread is not None:
                s.thread.join(timeout=1.0)
        for s in self._streams:
            for fd in {s.read_fd, s.child_fd}:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._streams.clear()
        self._child.clear()
        self.keep_in(None)

    # ------------------------------------------------------------------ the pump thread

    def _pump(self, s: _Stream) -> None:
        poller = select.poll()
        poller.register(s.read_fd, select.POLLIN)
        winsize_at = time.monotonic()
        try:
            while not self._closing:
                asked = s.asked  # read before looking: what is there now was written before
                if s.is_pty and time.monotonic() - winsize_at > _WINSIZE_EVERY_S:
                    _copy_winsize(s.console_fd, s.child_fd)
                    winsize_at = time.monotonic()
                if not poller.poll(_POLL_MS):
                    if s.partial:
                        self._keep(s.partial)
                        s.partial = b""
                    with self._cond:
                        s.idle_at = asked
                        self._cond.notify_all()
                    continue
                try:
                    data = os.read(s.read_fd, 1 << 16)
                except OSError as e:
                    if e.errno in (errno.EAGAIN, errno.EINTR):
                        continue
                    data = b""
                if not data:  # cannot happen while the tap holds the child's end: stop
                    return
                whole, newline, s.partial = (s.partial + data).rpartition(b"\n")
                if newline:
                    self._keep(whole + newline)
                if len(s.partial) > _PARTIAL_MAX_BYTES:  # a writer without newlines
                    self._keep(s.partial)
                    s.partial = b""
                try:
                    _write_all(s.console_fd, data)
                except OSError:  # the console's reader is gone: the ranks meet that too
                    with contextlib.suppress(OSError):
                        os.close(s.read_fd)
                    s.read_fd = -1
                    return
        finally:
            with self._cond:
                s.done = True
                self._cond.notify_all()

    def _keep(self, data: bytes) -> None:
        with self._log_lock:
            if self._log_fd is None or self._log_bytes >= self._cap_bytes:
                return
            room = self._cap_bytes - self._log_bytes
            chunk = data[:room]
            try:
                _write_all(self._log_fd, chunk)
                self._log_bytes += len(chunk)
                if len(chunk) < len(data):
                    _write_all(self._log_fd, f"\n[cfrun: this attempt's output passed "
                               f"{self._cap_bytes} bytes; the rest went to the console "
                               f"only]\n".encode())
            except OSError as e:  # a full disk: stop keeping, never stop the ranks
                logger.warning("cfrun: the ranks' output is no longer kept in %s: %s",
                               self._log_path, e)
                os.close(self._log_fd)
                self._log_fd = None
