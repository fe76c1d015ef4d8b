"""Arrival at a loop head: a tracer waits for the script to reach the head of a loop the
checkpoint names, and the loop is made to start at the checkpoint's iteration
(:mod:`cfrun.rank.resume`: step loops, and the epoch loop of a loader loop that jumps).

The global tracer only looks at the code object of new frames and hands line events of the one
matching function to a local tracer; a loop at module level gets its local tracer at once (its
frame is already running). A ``for ... in range()`` loop's ``range()`` is cut; a ``for`` over
an ``enumerate``/``zip`` skips its elements up to the checkpoint's; a ``while`` loop's position
is its restored variables.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

from cfrun.rank import frames as F
from cfrun.rank.resume_read import PlanRead, unusable

MAX_SKIP_ELEMENTS = 10_000_000
"""A ``for_iter`` loop's iterable is searched this far for the checkpoint's element."""

Arrive = Callable[[types.FrameType, F.LoopInfo], None]
"""Called with the frame at a loop's head and the loop."""


class LoopArrival:
    """Arms the arrival at loop heads of the plan (:attr:`PlanRead.plan`) and jumps the loops
    there. Training thread (and its line tracers).

    Args:
        script: the user's script.
        read: the plan and its read, waited for at the arrival.
        flag: says a reason the resume will not be exact.
    """

    def __init__(self, script: str, read: PlanRead, flag: Callable[[str], None]) -> None:
        self.script = script
        self._read = read
        self._flag = flag

    def arm(self, loop: F.LoopInfo, arrive: Arrive) -> None:
        """Call ``arrive(frame, loop)`` when the script first reaches the head of ``loop``,
        once the plan's read is done (no plan left: never). Uses ``sys.settrace`` until then,
        and ``threading.settrace`` for the threads started meanwhile (a script whose loop runs
        in a thread of its own: the first thread to arrive is the one restored; the others
        drop the tracer at their next call), unless another tracer is set for new threads.
        A failure of ``arrive`` makes the checkpoint unusable (:func:`unusable`)."""
        key = tuple(loop.code)
        targets = (loop.header_line, loop.body_line)
        read = self._read
        arrived: list[bool] = []
        # a thread the script starts before the arrival (one that runs the training loop)
        # gets the global tracer too, unless someone else's tracer is set for new threads
        for_threads = threading.gettrace() is None

        def local(frame: types.FrameType, event: str, arg: Any) -> Any:
            if arrived:
                return None
            if event == "line" and frame.f_lineno in targets:
                arrived.append(True)
                sys.settrace(None)
                if for_threads and threading.gettrace() is global_tracer:
                    threading.settrace(None)
                frame.f_trace = None
                if not read.await_read():
                    return None
                try:
                    arrive(frame, loop)
                except Exception as e:
                    assert read.plan is not None
                    unusable(read.jobdir, read.plan.step, e)
                return frame.f_trace  # the next loop of a chain in this frame, if armed
            return local

        def global_tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
            if arrived:  # another thread arrived: this thread's tracer goes at its next call
                sys.settrace(None)
                return None
            code = frame.f_code
            if event == "call" and code.co_name == key[1] and code.co_firstlineno == key[2] \
                    and os.path.realpath(code.co_filename) == key[0]:
                return local
            return None

        sys.settrace(global_tracer)
        if for_threads:
            threading.settrace(global_tracer)
        f: types.FrameType | None = sys._getframe()
        while f is not None:  # a loop at module level: its frame is already running
            code = f.f_code
            if code.co_name == key[1] and code.co_firstlineno == key[2] \
                    and os.path.realpath(code.co_filename) == key[0]:
                f.f_trace = local
                f.f_trace_lines = True
            f = f.f_back

    def arm_chain(self, chain: list[F.LoopInfo], arrive_last: Arrive) -> None:
        """Step loops: arrive at each loop of ``chain`` in turn, outermost first. An outer loop
        (the epoch loop around a per-epoch ``train()``, or around the step loop in the same
        function) gets its frame's variables back and jumps to the checkpoint's iteration; the
        last one, the loop around ``optimizer.step()``, is ``arrive_last``'s."""
        if len(chain) == 1:
            self.arm(chain[0], arrive_last)
            return

        def arrive_outer(frame: types.FrameType, loop: F.LoopInfo) -> None:
            plan = self._read.plan
            assert plan is not None
            records = [r for r in plan.state["script"] if r["code"] == loop.code]
            F.restore_frames(records, records, [frame], in_tracer=True,
                             keep_invariants=plan.resharded)
            if loop.kind == "for_other":
                self._flag("a loop around the step loop is a for loop over something other "
                           "than range(); its position restarts")
            else:
                self.jump(frame, loop, inclusive=True)
            self.arm_chain(chain[1:], arrive_last)

        self.arm(chain[0], arrive_outer)

    def jump(self, frame: types.FrameType, loop: F.LoopInfo, *, inclusive: bool,
             value: Any = None) -> None:
        """Make ``loop`` (whose head ``frame`` is at) start at the checkpoint's iteration
        (``inclusive``: an outer loop, whose iteration was in progress) or right after it (the
        step loop, whose iteration was complete). ``for_range``: the loop's ``range()`` is cut
        (``value``, else the loop variable's saved value, is the checkpoint's); ``for_iter``:
        the loop's iterable skips its elements up to the one that unpacks to the saved loop
        variables; ``while``: the restored variables are the position."""
        if loop.kind == "for_range":
            done = value if value is not None else self._saved_value(loop)
            drop = 0 if inclusive else 1

            def cut(r: Any) -> Any:
                return r[r.index(done) + drop:] if done in r else None

            self._install_shim(frame, "range", cut)
        elif loop.kind == "for_iter":
            assert loop.outer is not None
            saved = self._saved_values(loop)
            if not saved:
                self._flag("the step loop's variables were not stored; its position restarts")
                return

            def skip(obj: Any) -> Any:
                got, found = _skip_to(obj, loop.names, saved, inclusive)
                if not found:
                    self._flag(f"the loop's {loop.outer}() no longer holds the checkpoint's "
                               "position; the loop restarts")
                return got

            self._install_shim(frame, loop.outer, skip)

    def _saved_value(self, loop: F.LoopInfo) -> Any:
        plan = self._read.plan
        assert plan is not None
        for rec in plan.state["script"]:
            if rec["code"] == loop.code and loop.target in rec["values"]:
                return rec["values"][loop.target]["v"]
        return None

    def _saved_values(self, loop: F.LoopInfo) -> dict[str, Any]:
        """The saved scalar values of ``loop``'s target names (what identifies the element)."""
        plan = self._read.plan
        assert plan is not None
        names = set(_flat_names(loop.names))
        out: dict[str, Any] = {}
        for rec in plan.state["script"]:
            if rec["code"] == loop.code:
                for name in names:
                    item = rec["values"].get(name)
                    if item and item["kind"] == "value" and type(item["v"]) in (int, float,
                                                                               str, bool):
                        out[name] = item["v"]
        return out

    def _install_shim(self, frame: types.FrameType, name: str,
                      cut: Callable[[Any], Any]) -> None:
        """Make the next call of the builtin ``name`` (``range``, ``enumerate``, ``zip``) in
        ``frame``'s module return ``cut(builtin(...))``.

        Installed at the loop head before its iterable is evaluated; removes itself on first
        use. If ``cut`` returns ``None`` (the saved position is not in the iterable), the loop
        runs unchanged and the resume is flagged.
        """
        import builtins

        g = frame.f_globals
        if name in g:
            self._flag(f"the script defines its own {name}(); the loop position restarts")
            return
        make = getattr(builtins, name)

        def shim(*args: Any, **kwargs: Any) -> Any:
            g.pop(name, None)
            got = cut(make(*args, **kwargs))
            if got is None:
                self._flag(f"the loop's {name}() changed since the checkpoint")
                return make(*args, **kwargs)
            return got

        g[name] = shim


def _flat_names(names: Any) -> list[str]:
    if isinstance(names, str):
        return [names]
    return [n for part in names or [] for n in _flat_names(part)]


def _skip_to(obj: Any, names: Any, saved: dict[str, Any], inclusive: bool) -> tuple[Any, bool]:
    """``obj`` (an ``enumerate``/``zip`` of ranges and counts) advanced past the first element
    that unpacks into ``names`` with the ``saved`` values (to that element if ``inclusive``),
    and True; ``obj``'s elements from the first, and False, if none within
    :data:`MAX_SKIP_ELEMENTS` does. An ``enumerate``'s count goes on from the element."""
    probe, rest = itertools.tee(obj)
    for k, element in enumerate(itertools.islice(probe, MAX_SKIP_ELEMENTS)):
        bound = F.bind_names(names, element)
        if bound is not None and all(bound.get(n) == v and type(bound.get(n)) is type(v)
                                     for n, v in saved.items()):
            del probe
            return itertools.islice(rest, k if inclusive else k + 1, None), True
    return rest, False
