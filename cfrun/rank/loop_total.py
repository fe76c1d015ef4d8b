"""The step a step loop ends at, read from the script's own bound (issue 37, item 5).

A step loop has no loader whose length says how far the run is (the epoch loop's estimate:
:func:`cfrun.rank.loader_boundary._progress`). Its bound is often in plain sight, as nanoGPT's::

    while True:
        ...
        iter_num += 1
        if iter_num > max_iters:
            break

This module reads it at a checkpoint's loop boundary, where the iteration's code has run: the
loop's counter and its bound are evaluated in the loop's frame, and the steps left are the
counter's distance to the bound, one optimizer step per iteration. Read, in order:

* ``while X < B`` / ``while X <= B`` / ``while X != B``: the loop's own test;
* in the body of a ``while`` loop, a statement ``if X > B: break`` (``>=``, ``==``);
* ``for X in range(...)`` (:func:`cfrun.rank.frames.range_of`): the iterations left.

``X`` is a plain name holding an int; ``B`` an expression of names, attributes, constants and
arithmetic (never a call), as :func:`cfrun.rank.frames.range_of` evaluates. Anything else (a
bound behind a call, gradient accumulation counted in the counter, a counter that is not an
int): no estimate, and ``--total-steps`` is the user's way to say it. An estimate is a guess
for an ETA, never used for anything but ``cfrun status`` and the progress line.
"""

from __future__ import annotations

import ast
import os
import types
from typing import Any

from cfrun.rank import frames as F

_STOP_OPS: dict[type, int] = {ast.Gt: 1, ast.GtE: 0, ast.Eq: 0}
"""``if X <op> B: break`` -> iterations still run once ``X`` reaches ``B`` (``>``: one more)."""
_GO_OPS: dict[type, int] = {ast.Lt: 0, ast.NotEq: 0, ast.LtE: 1}
"""``while X <op> B`` -> iterations still run once ``X`` reaches ``B`` (``<=``: one more)."""


def loop_progress(frame: types.FrameType, loop: F.LoopInfo,
                  step: int) -> dict[str, int] | None:
    """At the loop boundary of ``step`` (``frame``: the loop's frame, the iteration's code
    run), the checkpoint event's ``progress`` for a step loop: ``{"done_batches": step,
    "total_batches": T}``, one batch per optimizer step, ``T`` the step the loop ends at
    (:func:`cfrun.contract.progress.total_steps` reads ``T`` back). None where the bound cannot
    be read (the module's docstring). Training thread; never raises."""
    try:
        left = _steps_left(frame, loop)
    except Exception:  # an odd script: no estimate
        return None
    if left is None or left < 0 or step <= 0:
        return None
    return {"done_batches": step, "total_batches": step + left}


def _steps_left(frame: types.FrameType, loop: F.LoopInfo) -> int | None:
    """Iterations the loop still runs after the one that ended at ``frame``'s boundary."""
    if loop.kind == "for_range":
        r = F.range_of(frame, loop)
        value = frame.f_locals.get(loop.target) if loop.target else None
        if r is None or type(value) is not int or value not in r:
            return None
        return len(r) - r.index(value) - 1
    if loop.kind != "while":
        return None
    tree = F._parse(os.path.realpath(frame.f_code.co_filename))
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.While)
                 and n.lineno == loop.header_line), None) if tree is not None else None
    if node is None:
        return None
    bound = _bound(node)
    if bound is None:
        return None
    counter, limit, extra = bound
    value = frame.f_locals.get(counter, frame.f_globals.get(counter))
    end = _evaluate(limit, frame)
    if type(value) is not int or end is None:
        return None
    return end - value + extra


def _bound(node: ast.While) -> tuple[str, ast.expr, int] | None:
    """(counter, bound, extra iterations) of a ``while`` loop (the module's docstring)."""
    test = node.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name) \
            and type(test.ops[0]) in _GO_OPS:
        return test.left.id, test.comparators[0], _GO_OPS[type(test.ops[0])]
    for stmt in node.body:
        if not (isinstance(stmt, ast.If) and stmt.body and isinstance(stmt.body[0], ast.Break)):
            continue
        t = stmt.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.left, ast.Name) \
                and type(t.ops[0]) in _STOP_OPS:
            return t.left.id, t.comparators[0], _STOP_OPS[type(t.ops[0])]
    return None


def _evaluate(expr: ast.expr, frame: types.FrameType) -> int | None:
    """``expr`` evaluated in ``frame`` when it is names, attributes, constants and arithmetic
    (no call) and gives an int; else None."""
    tree = ast.Expression(expr)
    if not all(isinstance(n, F._SAFE_NODES) for n in ast.walk(tree)):
        return None
    value: Any = eval(compile(tree, "<cfrun loop bound>", "eval"),  # noqa: S307
                      frame.f_globals, dict(frame.f_locals))
    return value if type(value) is int else None
