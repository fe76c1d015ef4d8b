"""Loop shapes the resume can jump (cfrun.rank.frames, cfrun.rank.resume): which ``for``
statements are pure-iterable loops, the loops around a loop through the call chain, skipping an
``enumerate``/``zip`` to a saved element, and the ``enumerate()`` around a loader wrapper."""

from __future__ import annotations

import itertools
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

import pytest

from cfrun.rank import frames as F
from cfrun.rank.resume_loops import _skip_to


def _at_grab(tmp_path, source: str, look: Callable[[list[types.FrameType]], Any]) -> Any:
    """Run ``source`` (a script file); at its first ``grab()`` call, return ``look(frames)``
    of the script frames there, innermost first (frames move on once it returns)."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    got: list[Any] = []

    def grab() -> None:
        if not got:
            got.append(look(F.script_frames(sys._getframe(1), str(path.resolve()))))

    code = compile(path.read_text(), str(path), "exec")
    exec(code, {"grab": grab, "__name__": "script", "itertools": itertools})
    return got[0]


@pytest.mark.parametrize("header, kind, outer, names", [
    ("for i in range(0, 20, 7):", "for_range", None, None),
    ("for batch, i in enumerate(range(0, 20, 7)):", "for_iter", "enumerate", ["batch", "i"]),
    ("for b, i in zip(itertools.count(), range(20)):", "for_iter", "zip", ["b", "i"]),
    ("for b, (i, j) in enumerate(zip(range(3), range(3)), start=1):", "for_iter", "enumerate",
     ["b", ["i", "j"]]),
    ("for i in [0, 7, 14]:", "for_other", None, None),
    ("for b, x in enumerate(data):", "for_other", None, None),
    ("for b, x in enumerate(enumerate(range(3))):", "for_other", None, None),
])
def test_for_shapes(tmp_path, header, kind, outer, names):
    loop = _at_grab(tmp_path, f"""
        data = [1, 2, 3]
        def train():
            {header}
                grab()
        train()
    """, lambda frames: F.find_loop(frames[0]))
    assert loop is not None
    assert (loop.kind, loop.outer, loop.names) == (kind, outer, names)
    assert F.LoopInfo.from_json(loop.to_json()) == loop


def test_loops_around_a_step_loop_through_the_call_chain(tmp_path):
    def look(frames: list[types.FrameType]) -> tuple[Any, list[F.LoopInfo]]:
        step_loop = F.find_loop(frames[1])
        return step_loop, F.enclosing_loops(frames[1:], step_loop) if step_loop else []

    step_loop, outer = _at_grab(tmp_path, """
        def step():
            grab()
        def train(epoch):
            for batch, i in enumerate(range(0, 9, 3)):
                step()
        for epoch in range(2):
            while True:
                train(epoch)
                break
    """, look)
    assert step_loop is not None and step_loop.kind == "for_iter"
    assert [lp.kind for lp in outer] == ["for_range", "while"]
    assert [lp.code[1] for lp in outer] == ["<module>", "<module>"]


def test_a_crafted_loop_position_is_refused():
    good = {"code": ["f", "train", 1], "header_line": 2, "body_line": 3, "kind": "for_iter",
            "target": None, "outer": "enumerate", "names": ["b", "i"]}
    F.LoopInfo.from_json(good)
    for bad in ({"outer": "open"}, {"names": []}, {"names": [1]}):
        with pytest.raises(ValueError):
            F.LoopInfo.from_json({**good, **bad})


@pytest.mark.parametrize("inclusive, first", [(False, (3, 21)), (True, (2, 14))])
def test_skip_to_the_saved_element_and_count_on(inclusive, first):
    got, found = _skip_to(enumerate(range(0, 50, 7)), ["batch", "i"], {"batch": 2, "i": 14},
                          inclusive)
    assert found and next(iter(got)) == first
    got, found = _skip_to(zip(itertools.count(), range(5)), ["b", "i"], {"b": 3}, inclusive)
    assert found and list(got) == ([(3, 3), (4, 4)] if inclusive else [(4, 4)])


def test_skip_to_a_position_that_is_gone_keeps_every_element():
    got, found = _skip_to(enumerate(range(3)), ["b", "i"], {"b": 7}, False)
    assert not found and list(got) == [(0, 0), (1, 1), (2, 2)]
    assert F.bind_names(["a", ["b", "c"]], (1, (2, 3))) == {"a": 1, "b": 2, "c": 3}
    assert F.bind_names(["a", "b"], (1, 2, 3)) is None


def test_the_enumerate_around_a_generator_wrapper_is_found_and_set():
    class Inner:
        def __init__(self) -> None:
            self.seen: list[object] = []

        def __iter__(self):
            return self

        def __next__(self):
            frame = sys._getframe(1)  # the wrapper generator, as the DataLoader hook sees it
            self.seen.append(F.find_enumerate(self, frame, F.consumer_frame(frame)))
            if len(self.seen) > 4:
                raise StopIteration
            return len(self.seen)

    inner = Inner()

    def wrapper(it):  # reads one ahead
        prev = None
        for x in it:
            if prev is not None:
                yield prev
            prev = x

    counts = []
    en = enumerate(wrapper(inner), start=10)
    for count, _ in en:
        counts.append(count)
        if count == 11:
            assert F.set_enumerate_index(en, 20)
    assert counts == [10, 11, 20]
    assert all(e is en for e in inner.seen)
    assert F.consumer_frame(sys._getframe()) is sys._getframe()
