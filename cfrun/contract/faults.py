"""The one fault-injection seam: named points that tests arm, a no-op when nothing is armed.

Tests arm points through one variable, ``CFRUN_FAULTS``, holding a JSON object that maps a point's
name to its value, e.g. ``{"agent.kill_at_step": 40, "storage.throttle_bytes_per_s": 5e7}``.
Product code asks for a point's value at the place the fault belongs; when the variable is unset
(every real run) :func:`value` returns ``None`` after one dictionary lookup, so a point costs
nothing on a hot path. The variable travels to every process of the job (supervisor, agent,
torchrun, ranks) with the environment, so one setting reaches the process it names.

Every point is declared here, in :data:`POINTS`, with what its value means; asking for or arming
an undeclared name raises (a typo must not make a fault test pass by testing nothing).
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "CFRUN_FAULTS"

#: name -> meaning of its value. The prefix names the process the point runs in.
POINTS: dict[str, str] = {
    "rank.raise_in_step": "STEP: the optimizer step hook raises an internal error right after "
                          "this step (cfrun must turn itself off, the script go on)",
    "rank.checkpoint_stall_s": "'SECONDS@FIRST-LAST': every checkpoint taken at a step in "
                               "[FIRST, LAST) holds the training thread SECONDS more",
    "rank.kill_after_snapshot": "STEP: in attempt 0, SIGKILL the rank right after it handed the "
                                "first checkpoint at or after STEP to the agent",
    "rank.kill_before_handoff": "STEP: in attempt 0, SIGKILL the rank mid-snapshot (copied, not "
                                "yet handed off) of the first checkpoint at or after STEP",
    "rank.snapshot_copy_delay_s": "SECONDS: the background copy sleeps this long before it starts",
    "rank.sync_copy_max_bytes": "BYTES: tensors up to this size are copied on the training "
                                "thread (0: every parameter goes through the background copy)",
    "rank.snapshot_handoff_error": "STEP: in attempt 0, the hand-off of the first checkpoint at "
                                   "or after STEP raises TypeError (later ones must still commit)",
}

_armed: dict[str, Any] | None = None


def _load() -> dict[str, Any]:
    global _armed
    if _armed is None:
        raw = os.environ.get(ENV, "")
        armed = json.loads(raw) if raw else {}
        if not isinstance(armed, dict):
            raise ValueError(f"{ENV} must be a JSON object of point -> value, got {raw!r}")
        _armed = armed
    return _armed


def value(name: str) -> Any:
    """The armed value of point ``name``, or ``None`` when it is not armed (any process).

    Raises:
        KeyError: ``name`` is not declared in :data:`POINTS` (checked only when something is
            armed, so an unarmed run pays one lookup).
    """
    armed = _load()
    if not armed:
        return None
    if name not in POINTS:
        raise KeyError(f"fault point {name!r} is not declared in cfrun.contract.faults.POINTS")
    return armed.get(name)


def arm(env: dict[str, str], **points: Any) -> dict[str, str]:
    """Tests: ``env`` with ``points`` added to its ``CFRUN_FAULTS`` (names use ``.`` for ``__``)."""
    current = json.loads(env.get(ENV) or "{}")
    named = {k.replace("__", "."): v for k, v in points.items()}
    unknown = sorted(set(named) - set(POINTS))
    if unknown:
        raise KeyError(f"undeclared fault points {unknown}")
    current.update(named)
    out = dict(env)
    out[ENV] = json.dumps(current)
    return out


def reset() -> None:
    """Forget the cached variable (tests that change ``os.environ`` in-process)."""
    global _armed
    _armed = None
