"""cfrun.rank.frameworks.framework_loop: which framework, if any, runs the training loop."""

from __future__ import annotations

import os
import sys
import types

import pytest

from cfrun.rank.frameworks import FRAMEWORK_LOOPS, framework_loop

HERE = os.path.realpath(__file__)  # plays the script


def _call_from(module: str, check: types.FunctionType) -> object:
    """``check(frame)`` called from a frame of a function of module ``module`` (a file of its
    own), which this test (the "script") calls."""
    ns: dict[str, object] = {"__name__": module, "sys": sys}
    code = compile("def loop(check):\n    return check(sys._getframe())\n",
                   f"/site-packages/{module.replace('.', '/')}.py", "exec")
    exec(code, ns)
    return ns["loop"](check)  # type: ignore[operator]


@pytest.mark.parametrize("module, name", [
    ("transformers.trainer", "transformers.Trainer"),
    ("lightning.pytorch.loops.training_epoch_loop", "Lightning Trainer"),
    ("pytorch_lightning.loops.fit_loop", "Lightning Trainer"),
])
def test_a_framework_frame_between_the_script_and_next_names_the_framework(module, name):
    fw = _call_from(module, lambda frame: framework_loop(frame, HERE))
    assert fw is not None and fw.name == name  # type: ignore[attr-defined]
    assert name in fw.reason and "outside the script's frames" in fw.reason  # type: ignore


@pytest.mark.parametrize("module", ["accelerate.data_loader", "lightning.fabric.wrappers",
                                    "transformers_extra.trainer", "mylib.transformers.trainer"])
def test_wrappers_and_lookalikes_are_not_framework_loops(module):
    """accelerate's and Fabric's loader wrappers run inside the script's own loop."""
    assert _call_from(module, lambda frame: framework_loop(frame, HERE)) is None


def test_the_walk_stops_at_the_script():
    """A framework frame outside (a caller of) the script's frame does not count."""
    assert framework_loop(sys._getframe(), HERE) is None


def test_every_reason_says_what_is_restored():
    for fw in FRAMEWORK_LOOPS:
        assert fw.reason.startswith(f"the training loop is {fw.name}'s, not the script's")
        assert "model, optimizer, scheduler, RNG" in fw.reason
