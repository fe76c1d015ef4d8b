"""The one fault-injection seam: named points that tests arm, a no-op when nothing is armed.

Tests arm points through one variable, ``CFRUN_FAULTS``, holding a JSON object that maps a point's
name to its value, e.g. ``{"agent.kill_at_step": 40, "storage.throttle_bytes_per_s": 5e7}``.
Product code asks for a point's value at the place the fault belongs; when the variable is unset
(every real run) :func:`value` returns ``None`` after two dictionary lookups, so a point costs
nothing on a hot path. The variable travels to every process of the job (supervisor, agent,
torchrun, ranks) with the environment, so one setting reaches the process it names. The variable
is read once per process (:func:`reset` forgets it, for tests that change ``os.environ``).

Every point is declared here, in :data:`POINTS`, with what its value means; asking for or arming
an undeclared name raises (a typo must not make a fault test pass by testing nothing). The idea
is torchsnapshot's: faults are injected at a seam of the product, never by test variables read
across its modules.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from cfrun.contract import settings
from cfrun.contract.errors import BadInputError

ENV = settings.FAULTS

#: name -> meaning of its value. The prefix names the process the point runs in.
POINTS: dict[str, str] = {
    "agent.kill_at_step":
        "int STEP: the persist agent SIGKILLs itself half-way through writing the first "
        "checkpoint at a step >= STEP, once per job dir (a marker file in the job dir)",
    "agent.commit_delay_s":
        "float SECONDS: the persist agent sleeps this long before each commit (a slow disk)",
    "storage.throttle_bytes_per_s":
        "float BYTES_PER_S: every level-2 write (cfrun.storage.tiers) and every write of the "
        "persist agent in this process goes at most this fast, through one token bucket "
        "(simulated network storage; ACUTE measured EBS/EFS ~90% slower than a local SSD)",
    "supervisor.start_delay_s":
        "float SECONDS: the supervisor sleeps this long right before it installs its SIGTERM/"
        "SIGINT handlers (a slow start: a loaded machine, a slow job-dir filesystem)",
    "supervisor.finalizer_delay_s":
        "float SECONDS: right after it started an attempt, the supervisor's main thread runs a "
        "finalizer (a __del__) that sleeps this long: a stop signal landing there has its "
        "exception printed and dropped by Python",
    "supervisor.output_cap_bytes":
        "int BYTES: the most of one attempt's output kept in logs/attempt-N-output.log (a small "
        "cap, so a test can pass it)",
    "peer.flush_delay_s":
        "float SECONDS: the cfrun peer's flusher sleeps this long after the first file of each "
        "checkpoint (a slow level 2)",
    "rank.start_delay_s":
        "float SECONDS: each rank sleeps this long at install, before it checks the job dir's "
        "identity and reads anything of it (a slow import: the window in which a job dir "
        "could be swapped under a starting rank)",
    "rank.spare_go_delay_s":
        "float SECONDS: a warm spare sleeps this long right after it took the go, before it "
        "becomes the rank (a hand-over a kill can land in)",
    "rank.raise_in_step":
        "int STEP: cfrun's optimizer-step hook raises RuntimeError at this step (an internal "
        "error of cfrun: the Guard must keep the script running)",
    "rank.step_delay_s":
        "float SECONDS: cfrun's optimizer-step hook sleeps this long after every step (a slow "
        "step: a long job in wall time without more work, for storms and preemption tests)",
    "rank.checkpoint_stall_s":
        "'SECONDS@FIRST-LAST': every checkpoint taken at a step in [FIRST, LAST) holds the "
        "training thread SECONDS more (a checkpoint made expensive by outside pressure, e.g. a "
        "saturated disk: what the adaptive tuner must react to)",
    "rank.in_flight_at_step":
        "int STEP: in attempt 0, the first boundary at which a checkpoint is due while the "
        "step count is STEP finds the previous one still in flight, as a persist that ends "
        "right after that boundary would (the checkpoint is deferred to a later boundary: "
        "where a loaded machine's timing puts it)",
    "rank.kill_after_snapshot":
        "int STEP: in attempt 0, the rank SIGKILLs itself right after it handed the first "
        "checkpoint at or after STEP to the agent (the training thread takes that checkpoint "
        "without deferring and waits for it, so the kill lands before the next iteration)",
    "rank.kill_before_handoff":
        "int STEP: in attempt 0, the rank SIGKILLs itself mid-checkpoint at the first checkpoint "
        "at or after STEP: its snapshot copied, not yet handed to the agent (on the synchronous "
        "path: its shard written, the checkpoint not committed)",
    "rank.slot_ready_after_steps":
        "int STEPS: preparing the snapshot slot ahead of the first checkpoint does not end "
        "before the rank has taken STEPS optimizer steps in this process (or a checkpoint "
        "needs the slot), and counts as page-locking it (a large CUDA state, on a CPU "
        "machine): a one-rank job defers the checkpoints due meanwhile (issue 23)",
    "rank.snapshot_copy_delay_s":
        "float SECONDS: the background snapshot copy sleeps this long before it starts (a slow "
        "copy: the next optimizer.step() must wait for it at the gate)",
    "rank.sync_copy_max_bytes":
        "int BYTES: replaces cfrun.rank.copyplan.SYNC_COPY_MAX_BYTES, the largest tensor copied "
        "on the training thread (0: every tensor goes through the background copy)",
    "rank.read_delay_s":
        "float SECONDS: a rank's background read of its checkpoint shard at resume sleeps this "
        "long before it reads (a slow disk: the script's own start-up goes on meanwhile)",
    "rank.snapshot_handoff_error":
        "int STEP: in attempt 0, the background thread raises TypeError while handing off the "
        "first checkpoint at or after STEP (a bug there must not stop later checkpoints)",
}

_armed: dict[str, Any] | None = None


def _parse(env: Mapping[str, str]) -> dict[str, Any]:
    armed = settings.get_json(ENV, env) or {}
    unknown = sorted(set(armed) - set(POINTS))
    if unknown:
        raise BadInputError(f"{ENV} arms undeclared fault points {unknown}; use the names in "
                            "cfrun.contract.faults.POINTS")
    return armed


def _load() -> dict[str, Any]:
    global _armed
    if _armed is None:
        _armed = _parse(os.environ)
    return _armed


def check() -> dict[str, Any]:
    """The armed points of this process (``{}`` in a real run); the CLI calls it at start, so a
    malformed ``CFRUN_FAULTS`` stops ``cfrun`` with one line instead of failing in the agent.

    Raises:
        BadInputError: ``CFRUN_FAULTS`` is not a JSON object of declared points.
    """
    return dict(_load())


def value(name: str) -> Any:
    """The armed value of point ``name``, or ``None`` when it is not armed (any process).

    Raises:
        KeyError: ``name`` is not declared in :data:`POINTS` (a bug in the caller).
        BadInputError: ``CFRUN_FAULTS`` is not a JSON object of declared points.
    """
    if name not in POINTS:
        raise KeyError(f"fault point {name!r} is not declared in cfrun.contract.faults.POINTS")
    return _load().get(name)


def arm(env: dict[str, str], **points: Any) -> dict[str, str]:
    """Tests: a copy of ``env`` with ``points`` added to its ``CFRUN_FAULTS``.

    Pass names with their dots, ``arm(env, **{"agent.kill_at_step": 40})``, or with ``__`` for
    each dot, ``arm(env, agent__kill_at_step=40)``. Values must be JSON-serialisable.

    Raises:
        KeyError: a name not declared in :data:`POINTS`.
    """
    current = _parse(env)
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
