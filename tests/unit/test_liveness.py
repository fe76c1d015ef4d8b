"""Liveness of script variables at a checkpoint (issue 27, item 7): a variable the loop writes
before reading it from every point where the resume puts the values back is dead there; only
live ones are stored and reported when they cannot be."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from cfrun.rank import frames as F
from cfrun.rank import liveness


def _capture_at_grab(tmp_path: Path, source: str) -> tuple[frozenset[str] | None, F.FrameCapture]:
    """Run ``source`` (a script that calls ``grab()`` as the first statement of a loop body,
    where a ``while True`` step loop's boundary is) and capture its frame at the second
    ``grab()`` (the loop's variables are bound then): the frame's live names and
    :func:`cfrun.rank.frames.capture_frames`."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    got: list[tuple[frozenset[str] | None, F.FrameCapture]] = []
    calls = []

    def grab() -> None:
        calls.append(1)
        if len(calls) == 2:
            frame = sys._getframe(1)
            got.append((liveness.live_names(frame), F.capture_frames([frame], [], set())))

    exec(compile(path.read_text(), str(path), "exec"), {"grab": grab, "__name__": "__main__"})
    return got[0]


def _live_at_loop_head(tmp_path: Path, source: str, name: str = "<module>",
                       first: int = 1) -> frozenset[str] | None:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    header = next(i for i, line in enumerate(path.read_text().splitlines(), 1)
                  if line.strip().startswith(("for ", "while ")) and "# head" in line)
    return liveness._live_at(str(path.resolve()), name, first, header, ())


MODULE_LOOP = """
best = 0.0
def report():
    print(best)
carry = 0
for step in range(5):  # head
    logits = step * 2
    loss = logits + carry
    carry = loss
    report()
    best = max(best, loss)
    if loss > 3:
        seen = loss
print(step, seen)
"""


def test_a_module_loops_temporaries_are_dead_and_carried_values_live(tmp_path: Path) -> None:
    live = _live_at_loop_head(tmp_path, MODULE_LOOP)
    assert live is not None
    assert "logits" not in live and "loss" not in live
    assert {"carry", "step", "seen"} <= live  # read across steps, the loop target, after it
    assert "best" in live  # written in the loop, but report() reads the global first


FUNCTION_LOOPS = """
def train(loader, model):
    total = 0
    for epoch in range(3):  # outer
        lr = 0.1 * epoch
        print(scale)
        for i, (x, y) in enumerate(loader):  # head
            out = model(x) * lr
            total += 1
            tmp = out * 2
            later = lambda: tmp
            scale = 2
    return total
"""


def test_a_function_keeps_what_its_outer_loop_and_closures_read(tmp_path: Path) -> None:
    live = _live_at_loop_head(tmp_path, FUNCTION_LOOPS, "train", 2)
    assert live is not None
    assert "out" not in live and "later" not in live
    assert {"total", "lr", "epoch", "i", "x"} <= live  # read on; the loops' targets
    assert "tmp" in live  # a lambda reads it at any time
    assert "scale" in live  # the outer loop's body reads it before the inner loop writes it


def test_a_handler_or_finally_that_reads_a_variable_keeps_it_live(tmp_path: Path) -> None:
    source = """
    def f(n):
        while n:  # head
            try:
                e = n
                n -= 1
            finally:
                print(e)
    """
    live = _live_at_loop_head(tmp_path, source, "f", 2)
    assert live is not None and {"e", "n"} <= live


@pytest.mark.parametrize("call", ["locals()", "eval('x')", "sys._getframe()"])
def test_code_that_reads_frames_gives_no_answer(tmp_path: Path, call: str) -> None:
    source = f"""
    import sys
    for i in range(3):  # head
        x = i
        {call}
    """
    assert _live_at_loop_head(tmp_path, source) is None


def test_a_point_inside_the_loop_body_gives_no_answer(tmp_path: Path) -> None:
    path = tmp_path / "script.py"
    path.write_text("for i in range(3):\n    x = i\n    y = x + 1\n")
    assert liveness._live_at(str(path.resolve()), "<module>", 1, 3, ()) is None
    assert liveness._live_at(str(path.resolve()), "<module>", 1, 2, ()) is not None


def test_a_dead_temporary_is_not_stored_and_a_live_one_too_large_is_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capture of a frame at its loop head: the dead ``logits`` is neither stored nor
    reported, though larger than the limit; the live ``carry`` of the same size is reported."""
    monkeypatch.setattr(F, "MAX_FRAME_TENSOR_BYTES", 1000)
    live, cap = _capture_at_grab(tmp_path, """
    import torch
    carry = torch.zeros(400)
    for step in range(2):
        grab()
        logits = torch.zeros(400)
        carry += logits
    """)
    assert live is not None and "carry" in live and "logits" not in live
    assert [s.split(" ")[0] for s in cap.skipped] == ["<module>:carry"]
    assert "logits" not in cap.records[0]["values"]
    assert "step" in cap.records[0]["values"]


def test_warm_at_the_first_step_caches_the_answer_the_first_checkpoint_needs(
        tmp_path: Path) -> None:
    """Issue 23: the first checkpoint paid the script's parse, its symbol table and the
    analysis (16-23 ms of stall on this machine; ~1 ms each later one). ``warm`` at the first
    optimizer step (a frame inside a function called from the loop, and the loop's frame at
    the call) works out the answers at the loop heads, so the checkpoint's ``live_names`` at
    the step loop's header and at its first body line only hits the cache."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent("""
        def step_fn(grab):
            grab()  # the optimizer step
        def main(grab):
            for epoch in range(2):
                for step in range(3):  # head
                    x = step * 2
                    step_fn(grab)
        main(grab)
    """))
    lines = path.read_text().splitlines()
    header = next(i for i, line in enumerate(lines, 1) if "# head" in line)
    warmed: list[int] = []

    def grab() -> None:
        if not warmed:
            frames = F.script_frames(sys._getframe(1), str(path.resolve()))
            assert [f.f_code.co_name for f in frames] == ["step_fn", "main", "<module>"]
            liveness._live_at.cache_clear()
            liveness._source.cache_clear()
            warmed.append(liveness.warm(frames))

    exec(compile(path.read_text(), str(path), "exec"), {"grab": grab, "__name__": "__main__"})
    assert warmed[0] >= 4  # step_fn's line, main's two loops (headers, first body lines)
    before = liveness._live_at.cache_info()
    live_head = liveness._live_at(str(path.resolve()), "main", 4, header, ())
    live_body = liveness._live_at(str(path.resolve()), "main", 4, header + 1, ())
    after = liveness._live_at.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 0)
    assert live_head is not None and "x" not in live_head and "step" in live_head
    assert live_body is not None
