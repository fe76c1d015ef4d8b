"""The resume's restore: put a read checkpoint into the live objects, the RNG and the script's
frames where the script arrived at its boundary (:mod:`cfrun.rank.resume`).

Restoring first checks that the checkpoint fits the live job
(:func:`cfrun.codec.checkpoint.check_fits`: a mismatch stops the job with exit 5, nothing
changed), then loads models, optimizers, schedulers, scalers, RNG and the script's variables
into the live objects and frames. A failure after that point (part of the state may be in the
live objects) moves the checkpoint aside and restarts the attempt
(:func:`cfrun.rank.resume_read.unusable`).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from cfrun.codec.checkpoint import JobMismatchError, check_fits, check_free_params
from cfrun.codec.dtensor import (
    MeshMismatchError,
    dtensor_class,
    has_shards,
    live_meshes,
    to_dtensors,
)
from cfrun.contract.jobdir import JobDir
from cfrun.rank import frames as F
from cfrun.rank.aliases import AliasIndex
from cfrun.rank.capture import free_params, scaler_numbers
from cfrun.rank.discovery import Discovery
from cfrun.rank.resume_plan import ResumePlan
from cfrun.rank.resume_read import unusable
from cfrun.rank.rng import set_global_rng


class Restore:
    """Loads a plan's state into the live objects the rank found (:class:`Discovery`).
    Training thread, once per process.

    Args:
        script: the user's script (its frames get their variables back).
        fatal: stops the job for good (the checkpoint does not fit this job).
    """

    def __init__(self, jobdir: JobDir, script: str, found: Discovery,
                 fatal: Callable[[str], NoReturn]) -> None:
        self.jobdir = jobdir
        self.script = script
        self.found = found
        self._fatal = fatal

    def apply(self, plan: ResumePlan, frame: types.FrameType, *, in_tracer: bool,
              wrapper_caller: types.FrameType | None) -> list[str]:
        """Check that ``plan`` fits the live job, then load it into the live objects, RNG and
        the script frames outwards of ``frame`` (``in_tracer``: called from a line tracer;
        ``wrapper_caller``: the frame of a library wrapper of the training loader, whose state
        goes back too). The loaded tensors are freed from the plan. Returns the script
        variables restored.

        Raises:
            SystemExit: the checkpoint does not fit (``fatal``), or loading it failed
                (:func:`cfrun.rank.resume_read.unusable`).
        """
        st = plan.state
        roots = self.found.model_roots()
        opts = self.found.optimizers()
        schedulers, scalers = self.found.schedulers(), self.found.scalers()
        try:  # before anything is applied: a checksum cannot tell a changed layer width
            _place_shards(st, roots, opts)
            check_fits(st, roots, opts, schedulers, scalers)
            check_free_params(st.get("free_params"), free_params(opts, roots))
        except (JobMismatchError, MeshMismatchError) as e:
            self._fatal(f"checkpoint step {plan.step} does not fit this job: {e}; to go on, "
                        "start a new --job-dir (the checkpoints are kept), or restore the "
                        "script and model the checkpoint was written with and resume")
        try:
            restored = self._load(plan, frame, roots, opts, schedulers, scalers,
                                  in_tracer=in_tracer, wrapper_caller=wrapper_caller)
        except Exception as e:  # part of it may be in the live objects: restart
            unusable(self.jobdir, plan.step, e)
        for key in ("modules", "optimizers", "free_params"):  # loaded: free their tensors
            st[key] = []  # (held for the whole run otherwise: a second copy of the state)
        return restored

    def _load(self, plan: ResumePlan, frame: types.FrameType, roots: list[Any],
              opts: list[Any], schedulers: list[Any], scalers: list[Any], *,
              in_tracer: bool, wrapper_caller: types.FrameType | None) -> list[str]:
        """Put the checked state into the live objects, RNG and frames; returns the script
        variables restored."""
        st = plan.state
        with torch.no_grad():
            for m, sd in zip(roots, st["modules"]):
                m.load_state_dict(sd)
        for o, sd, count in zip(opts, st["optimizers"], st["opt_steps"]):
            o.load_state_dict(sd)
            o.__dict__["_cfrun_steps"] = count
        with torch.no_grad():  # fp32 master weights no module owns (check_fits matched them)
            for live, saved in zip(free_params(opts, roots), st.get("free_params") or []):
                flat = dict(live)
                for item in saved:
                    flat[item["index"]].copy_(item["value"])
        for objs, sds in ((schedulers, st["schedulers"]),
                          (scalers, [scaler_numbers(sd) for sd in st["scalers"]])):
            for obj, sd in zip(objs, sds):
                if sd is not None:
                    obj.load_state_dict(sd)
        set_global_rng(st["rng"])
        index = AliasIndex(roots, opts)  # the loaded tensors script variables may alias
        restored = F.restore_frames(st["script"], st["script"],
                                    F.script_frames(frame, self.script), in_tracer=in_tracer,
                                    keep_invariants=plan.resharded, aliases=index.place)
        data = st.get("data")
        if isinstance(data, dict) and data.get("wrappers") and wrapper_caller is not None:
            restored += F.restore_wrapper_state(data["wrappers"], wrapper_caller, self.script)
        return restored


def process_timing() -> dict[str, Any]:
    """When this process started (unix s, ``process_start_unix_s``), for the ``resumed``
    event: a warm spare's go (:mod:`cfrun.rank.spare`; then also ``warm``), else the process's
    creation; empty when psutil is missing or /proc unreadable."""
    import sys

    spare = sys.modules.get("cfrun.rank.spare")
    go_unix_s = getattr(spare, "go_unix_s", None)
    if go_unix_s is not None:  # a warm spare: this process became the rank at its go
        return {"process_start_unix_s": round(go_unix_s, 3), "warm": True}
    try:
        import psutil

        return {"process_start_unix_s": round(psutil.Process().create_time(), 3)}
    except Exception:  # the breakdown lacks one line
        return {}


def _place_shards(st: dict[str, Any], roots: list[Any], opts: list[Any]) -> None:
    """Make the checkpoint's DTensor local shards (:class:`cfrun.codec.dtensor.LocalShard`)
    DTensors again on the live job's device meshes, in place in ``st``, before it is checked
    and applied (issue 25). Nothing to do in a job without DTensors.

    Raises:
        MeshMismatchError: a shard's mesh is not the live job's.
    """
    if dtensor_class() is None:
        return
    meshes = live_meshes([*roots, *opts])
    for key in ("modules", "optimizers", "free_params", "script"):
        if key in st and has_shards(st[key]):
            st[key] = to_dtensors(st[key], meshes)
