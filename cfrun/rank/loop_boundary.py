"""The loop boundary: the next arrival at the head of the loop around ``optimizer.step()``, found
with a line tracer (:mod:`cfrun.rank.boundary`, step loops).

After a trigger, the loop of the script that encloses the optimizer step is looked up from the
step's frames; a line tracer on that loop's frame then calls the boundary when execution next
reaches the loop's header or the first line of its body, with the iteration's remaining code
run and the next forward not. No other tracer may be active (a debugger's, coverage's): then
the boundary is taken at the step itself, and script variables are captured there.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from cfrun.rank import frames as F
from cfrun.rank.loop_total import loop_progress


class LoopBoundary:
    """The loop around ``optimizer.step()`` (:attr:`loop`) and the loops around it
    (:attr:`outer_loops`), found at the last trigger; a checkpoint's metadata names them so a
    resume can jump them. Training thread.

    Args:
        script: the user's script (its frames are told from library frames by it).
        flag: says a reason the resume will not be exact.
    """

    def __init__(self, script: str, flag: Callable[[str], None]) -> None:
        self.script = script
        self._flag = flag
        self.loop: F.LoopInfo | None = None
        """The loop around the optimizer step (None: not found)."""
        self.outer_loops: list[F.LoopInfo] = []
        """The loops around :attr:`loop`, outermost first (an epoch loop)."""

    def arm(self, caller: types.FrameType,
            at_boundary: Callable[[types.FrameType, dict[str, Any] | None], None],
            position: Callable[[], dict[str, Any] | None]) -> None:
        """A trigger at a step called from ``caller``: call ``at_boundary(frame, position())``
        at the next arrival at the head of the loop around the step, or right away when no
        such loop is found (or another tracer is active)."""
        frames = F.script_frames(caller, self.script)
        loop_frame, loop = None, None
        for f in frames:
            loop = F.find_loop(f)
            if loop is not None:
                loop_frame = f
                break
        if loop_frame is None or loop is None or sys.gettrace() is not None:
            self._flag("no loop around optimizer.step() was found in the script (or a tracer "
                       "is active); script variables are captured at the step")
            self.loop = None
            at_boundary(frames[0] if frames else caller, None)
            return
        self.loop = loop
        self.outer_loops = F.enclosing_loops(frames[frames.index(loop_frame):], loop)
        targets = (loop.header_line, loop.body_line)

        def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno in targets:
                sys.settrace(None)
                frame.f_trace = None
                at_boundary(frame, position())
                return None
            return tracer

        sys.settrace(_ignore_calls)
        loop_frame.f_trace = tracer
        loop_frame.f_trace_lines = True

    def progress(self, frame: types.FrameType, step: int) -> dict[str, int] | None:
        """At this loop's boundary of ``step`` (``frame``: the loop's), the step the loop
        ends at as a checkpoint's ``progress`` (:func:`cfrun.rank.loop_total.loop_progress`);
        None without a loop or a bound cfrun can read."""
        if self.loop is None or F.code_key(frame.f_code) != self.loop.code:
            return None
        return loop_progress(frame, self.loop, step)

    def meta(self) -> dict[str, Any]:
        """The loops, for a checkpoint's metadata (``loop``, ``outer_loops``)."""
        return {"loop": self.loop.to_json() if self.loop else None,
                "outer_loops": [lp.to_json() for lp in self.outer_loops] if self.loop else []}


def _ignore_calls(frame: types.FrameType, event: str, arg: Any) -> None:
    return None
