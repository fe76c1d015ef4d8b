"""The resume plan: the newest usable checkpoint, and where the script must arrive to restore it
(:mod:`cfrun.rank.resume`). Pure: what a plan holds, and what every rank checks in every rank's
decoded tree before any rank loads it (:func:`check_state`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cfrun.rank import frames as F


@dataclass
class ResumePlan:
    """The newest verified checkpoint and where the script must arrive to restore it."""

    step: int
    state: dict[str, Any]
    meta: dict[str, Any]

    @property
    def mode(self) -> str:
        return str(self.meta.get("mode", "loader"))

    @property
    def resharded(self) -> bool:
        """Read from a checkpoint of another world size (``--reshard``)."""
        return isinstance(self.meta.get("resharded"), dict)


def check_state(state: Any, meta: dict[str, Any]) -> None:
    """What the resume will look up in a rank's decoded state is there, with its type.

    Called by every rank for every rank's tree of a checkpoint before any rank loads it
    (:func:`cfrun.codec.checkpoint.check_usable`, tensors on the ``meta`` device), so that a
    tree that would fail later (a missing key, a list where a dict belongs, a loop position that
    does not parse) is judged corrupt by all ranks alike, and all fall back together.

    Raises:
        ValueError, KeyError, TypeError: the first thing missing or of another type.
    """
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"the checkpoint's {what}")

    need(isinstance(state, dict), "state is not an object")
    for key in ("modules", "optimizers", "opt_steps", "schedulers", "scalers", "script"):
        need(isinstance(state.get(key), list), f"{key} is not a list")
    need(all(isinstance(m, dict) for m in state["modules"]), "model states are not objects")
    for o in state["optimizers"]:
        need(isinstance(o, dict) and isinstance(o.get("state"), dict)
             and isinstance(o.get("param_groups"), list)
             and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                     for g in o["param_groups"]), "optimizer state is not a state_dict")
    free = state.get("free_params", [])  # absent in checkpoints of an older cfrun
    need(isinstance(free, list) and all(
        isinstance(per, list) and all(isinstance(i, dict) and type(i.get("index")) is int
                                      and isinstance(i.get("value"), torch.Tensor) for i in per)
        for per in free), "free parameters (master weights) are not a list of index/value")
    need(len(state["opt_steps"]) == len(state["optimizers"])
         and all(type(n) is int for n in state["opt_steps"]), "optimizer step counts")
    rng = state.get("rng")
    need(isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor)
         and rng["torch"].dtype == torch.uint8 and isinstance(rng.get("random"), (list, tuple))
         and len(rng["random"]) == 3, "RNG state is not one cfrun writes")
    for rec in state["script"]:
        need(isinstance(rec, dict) and isinstance(rec.get("code"), list)
             and isinstance(rec.get("values"), dict)
             and all(isinstance(v, dict) and "kind" in v and "v" in v
                     for v in rec["values"].values()), "script variables")
    if str(meta.get("mode", "loader")) == "loop":
        if meta.get("loop"):
            F.LoopInfo.from_json(meta["loop"])
        need(isinstance(meta.get("outer_loops") or [], list), "outer loops are not a list")
        for d in meta.get("outer_loops") or []:
            F.LoopInfo.from_json(d)
        if state.get("data") is None:  # else a held iterator's position (cfrun.rank.frameworks)
            return
    data = state.get("data")
    need(isinstance(data, dict), "data loader position is missing")
    need(isinstance(data.get("fingerprint"), dict), "loader fingerprint is missing")
    for key in ("loader", "iter_index", "batches"):
        need(type(data.get(key)) is int, f"loader position has no integer {key}")
    need(isinstance(data.get("epoch_rng"), dict) and isinstance(data["epoch_rng"].get("global"),
                                                                dict), "epoch RNG state")
    if data.get("epoch_loop"):
        F.LoopInfo.from_json(data["epoch_loop"])
    wrappers = data.get("wrappers") or []  # absent in checkpoints of an older cfrun
    need(isinstance(wrappers, list) and all(
        isinstance(w, dict) and isinstance(w.get("code"), list)
        and isinstance(w.get("values"), dict) and isinstance(w.get("attrs", {}), dict)
        and all(isinstance(v, dict) and "kind" in v and "v" in v for v in w["values"].values())
        for w in wrappers), "loader wrapper state")
    sampler = data.get("sampler") or []
    need(isinstance(sampler, list) and all(isinstance(d, dict) for d in sampler),
         "sampler state")


def arming(plan: ResumePlan) -> tuple[Any, ...]:
    """What :meth:`cfrun.rank.resume.Resume._prepare` arms for ``plan``: the loops (or loader)
    the script must arrive at. Two plans alike here are restored at the same place."""
    if plan.mode == "loop":
        return ("loop", plan.meta.get("loop"), plan.meta.get("outer_loops") or [])
    data = plan.state.get("data") if isinstance(plan.state, dict) else None
    return ("loader", data.get("epoch_loop") if isinstance(data, dict) else None)
