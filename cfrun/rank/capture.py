"""Phase 4: what a checkpoint holds, taken at the boundary after step s.

One JSON tree per rank (``modules``, ``optimizers``, ``opt_steps``, ``schedulers``, ``scalers``,
``rng``, ``data``: the training loader's position, ``script``: the script's own variables, and
with DDP the ``sharded`` layout), its tensors in a flat list (live, not copied: the snapshot
copies them), and which of those only ``optimizer.step()`` mutates (they may be copied after the
boundary, in the background). The codec (:mod:`cfrun.codec.format`) turns values into the tree;
:mod:`cfrun.rank.frames` reads the script's frames; :mod:`cfrun.rank.rng` the global RNGs.
"""

from __future__ import annotations

import operator
import os
import types
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from cfrun.codec.dtensor import is_dtensor, local_of
from cfrun.codec.format import UnsupportedValueError, encode
from cfrun.codec.sharding import shard_replicated
from cfrun.contract import settings as E
from cfrun.rank import frames as F
from cfrun.rank.aliases import AliasIndex
from cfrun.rank.discovery import Discovery
from cfrun.rank.log import say
from cfrun.rank.rng import get_global_rng
from cfrun.rank.settings import RankSettings


class Capture:
    """Turns the rank's live state into a checkpoint tree. Training thread only."""

    def __init__(self, settings: RankSettings, found: Discovery,
                 flag: Callable[[str], None]) -> None:
        self.s = settings
        self.found = found
        self._flag = flag
        self._modules = EncodeCache()
        """The models' state dicts as last encoded (:class:`EncodeCache`)."""
        self._opt_states: list[EncodeCache] = []
        """Per optimizer, its ``state_dict()["state"]`` as last encoded."""
        self._async_of: tuple[list[int], list[int], frozenset[int]] | None = None
        """The models' and optimizers' ids and the async ids computed for them."""
        self._unknown_said: set[str] = set()
        """Script variables said to alias a tensor cfrun cannot tell (once each)."""

    def _optimizer_sd(self, i: int, sd: Any, tensors: list[torch.Tensor]) -> tuple[Any, bool]:
        """``encode(sd, tensors)`` of optimizer ``i``'s ``state_dict()``, its ``state`` part
        from :class:`EncodeCache` (the per-parameter moments: most of its tensors); and
        whether that part was a hit. An unusual layout is encoded as it is, no cache."""
        while len(self._opt_states) <= i:
            self._opt_states.append(EncodeCache())
        if not isinstance(sd, dict) or list(sd) != ["state", "param_groups"]:
            return encode(sd, tensors), False
        state, hit = self._opt_states[i].encode(sd["state"], tensors)
        return {"state": state, "param_groups": encode(sd["param_groups"], tensors)}, hit

    def capture(self, frame: types.FrameType, data: dict[str, Any] | None, *,
                final: bool = False) -> tuple[dict[str, Any], list[torch.Tensor], set[int]]:
        """The rank's state right after the current step: a JSON tree, its tensors (live, not
        copied), and the ids of those only ``optimizer.step()`` mutates (parameters, optimizer
        state). ``frame`` is the innermost frame at the boundary (the script's frames are found
        from it outwards); ``data`` the training loader's position, or None in a step loop.
        ``final``: the checkpoint at the script's end, of the objects held since the last one
        (:meth:`Discovery.hold`; else they are let go first, so that what the script dropped
        since is not counted)."""
        if not final:
            self.found.release()
        roots = self.found.model_roots()
        opts = self.found.optimizers()
        self.found.hold()
        tensors: list[torch.Tensor] = []
        sds = [m.state_dict(keep_vars=True) for m in roots]
        modules, modules_hit = self._modules.encode(sds, tensors)
        optimizers = []
        opts_hit = True
        for i, o in enumerate(opts):
            sd, hit = self._optimizer_sd(i, o.state_dict(), tensors)
            optimizers.append(sd)
            opts_hit &= hit
        # only optimizer.step() changes these: they may be copied after the boundary (the same
        # set again while the models and optimizers hold the very same tensors)
        same = (modules_hit and opts_hit and self._async_of is not None
                and self._async_of[0] == [id(m) for m in roots]
                and self._async_of[1] == [id(o) for o in opts])
        if same and self._async_of is not None:
            async_ids = set(self._async_of[2])
        else:
            async_ids = {_stored_id(p) for m in roots for p in m.parameters()}
            async_ids |= {_stored_id(v) for o in opts for st in o.state.values()
                          for v in st.values() if isinstance(v, torch.Tensor)}
            self._async_of = ([id(m) for m in roots], [id(o) for o in opts],
                              frozenset(async_ids))
        tree: dict[str, Any] = {"modules": modules, "optimizers": optimizers}
        free = free_params(opts, roots)  # fp32 master weights no module owns (issue 18)
        async_ids |= {_stored_id(p) for per_opt in free for _, p in per_opt}
        tree.update({
            "free_params": encode([[{"index": k, "value": p} for k, p in per_opt]
                                   for per_opt in free], tensors),
            "model_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "opt_steps": [o.__dict__.get("_cfrun_steps", 0) for o in self.found.optimizers()],
            "rng": encode(get_global_rng(), tensors),
            "data": encode(data, tensors),
        })
        for kind, objs in (("schedulers", self.found.schedulers()),
                           ("scalers", self.found.scalers())):
            items = []
            for obj in objs:
                try:
                    sd = scaler_state(obj) if kind == "scalers" else obj.state_dict()
                    items.append(encode(sd, tensors))
                except UnsupportedValueError as e:
                    self._flag(f"{type(obj).__name__} state cannot be stored ({e})")
                    items.append(None)
            tree[kind] = items
        frames = F.script_frames(frame, self.s.script)
        saved = {id(m) for m in roots} | {id(m) for r in roots for m in r.modules()}
        saved |= {id(m) for m in self.found.outer_modules()}  # `model = DDP(net)` is saved
        cap = F.capture_frames(frames, tensors, saved, known=lambda: AliasIndex(roots, opts, sds))
        for name in cap.skipped:
            self._flag(f"script variable {name} cannot be stored")
        for name in cap.unknown:
            if name not in self._unknown_said:
                self._unknown_said.add(name)
                say(f"WARNING: script variable {name} shares its storage with a tensor cfrun "
                    "cannot tell (not a model's, nor an optimizer's): a resume gives it back "
                    "as a copy of its values, no longer an alias")
        tree["script"] = cap.records
        layout = self._shard(tensors, async_ids)
        if layout:
            tree["sharded"] = layout
        return tree, tensors, async_ids

    def model_tensors(self) -> list[torch.Tensor]:
        """The tensors a checkpoint of now would hold for the models, optimizers and fp32
        master weights (this rank's slices with DDP), without the script's variables, the RNG
        and the data position: what sizes the snapshot slot ahead of the first checkpoint
        (:meth:`cfrun.rank.snapshot.Snapshotter.prepare`). Training thread, after an optimizer
        step (an optimizer's state exists from its first step on)."""
        roots = self.found.model_roots()
        opts = self.found.optimizers()
        tensors: list[torch.Tensor] = []
        encode([m.state_dict(keep_vars=True) for m in roots], tensors)
        for o in opts:
            tensors.extend(v for st in o.state.values() for v in st.values()
                           if isinstance(v, torch.Tensor))
        tensors.extend(p for per_opt in free_params(opts, roots) for _, p in per_opt)
        tensors = [local_of(t) if is_dtensor(t) else t for t in tensors]
        self._shard(tensors, set())
        return tensors

    def _shard(self, tensors: list[torch.Tensor], async_ids: set[int]) -> list[dict[str, Any]]:
        """DeepFreeze 1/N (cfrun.codec.sharding): with DDP, keep only this rank's slice of each
        large parameter and of its optimizer state. ``CFRUN_SHARD=0`` turns it off (every rank
        then persists everything; ``rank0``: rank 0 persists the replicated tensors alone; both
        for bench/sharded_persist.py)."""
        replicated = self.found.replicated_params
        how = os.environ.get(E.SHARD, "1")
        if self.s.world_size < 2 or not replicated or how == "0":
            return []
        ids = set(replicated)
        for o in self.found.optimizers():
            for p, st in o.state.items():
                if id(p) in replicated:
                    ids |= {id(v) for v in st.values() if isinstance(v, torch.Tensor)}
        layout, views = shard_replicated(tensors, ids, self.s.rank, self.s.world_size,
                                         rank0_only=how == "rank0")
        async_ids |= {v for v, orig in views.items() if orig in async_ids}
        return layout


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class EncodeCache:
    """The encoded tree of one part of a checkpoint (the models' state dicts, an optimizer's
    per-parameter state), kept from one checkpoint to the next while the part holds the very
    same tensor objects (``is``) under the very same keys and starts at the same place of the
    tensor list: :func:`cfrun.codec.format.encode` would then return an equal tree. The part
    is then not walked again value by value (issue 23: the capture's encoding of ~900 tensors
    was most of a GPT checkpoint's 15-20 ms stall on an H200). Only parts whose leaves are all
    plain tensors are kept (a DTensor's placement, a float, an extra state may change without
    a new object). The tree is shared between checkpoints: nothing may change it. Training
    thread only."""

    def __init__(self) -> None:
        self.start = -1
        self.keys: Any = None
        self.leaves: list[torch.Tensor] = []
        self.tree: Any = None

    def encode(self, part: Any, tensors: list[torch.Tensor]) -> tuple[Any, bool]:
        """``(encode(part, tensors), hit)``: appends ``part``'s tensors to ``tensors`` either
        way. ``part``: a list of dicts of plain tensors (module state dicts) or a dict of such
        dicts (an optimizer's ``state``); anything else is encoded and not kept."""
        flat = _flat_leaves(part)
        if flat is not None and self.tree is not None and self.start == len(tensors) \
                and flat[0] == self.keys and len(flat[1]) == len(self.leaves) \
                and all(map(operator.is_, flat[1], self.leaves)):
            tensors.extend(self.leaves)
            return self.tree, True
        start = len(tensors)
        tree = encode(part, tensors)
        if flat is None or not all(type(v) in _PLAIN_TENSOR_TYPES for v in flat[1]):
            self.tree = None
            return tree, False
        self.start, self.keys, self.leaves, self.tree = start, flat[0], flat[1], tree
        return tree, False


def _flat_leaves(part: Any) -> tuple[Any, list[Any]] | None:
    """``(keys, leaves)`` of a list of dicts or a dict of dicts, in :func:`encode`'s order;
    None for another shape."""
    if isinstance(part, list) and all(type(d) in (dict, OrderedDict) for d in part):
        return (tuple(tuple(d) for d in part), [v for d in part for v in d.values()])
    if type(part) is dict and all(type(d) is dict for d in part.values()):
        return (tuple((k, tuple(d)) for k, d in part.items()),
                [v for d in part.values() for v in d.values()])
    return None


def _stored_id(t: torch.Tensor) -> int:
    """``id()`` of the tensor a checkpoint stores for ``t``: a DTensor's local shard
    (:func:`cfrun.codec.dtensor.local_of`), else ``t`` itself."""
    return id(local_of(t)) if is_dtensor(t) else id(t)


def free_params(opts: list[torch.optim.Optimizer], roots: list[torch.nn.Module]
                ) -> list[list[tuple[int, torch.Tensor]]]:
    """Per optimizer, ``(k, p)`` for each parameter ``p`` at position ``k`` of its flattened
    ``param_groups`` that no module in ``roots`` owns: the fp32 master weights of a
    mixed-precision script (``nn.Parameter(p.float())`` copies). An optimizer's
    ``state_dict()`` holds their moments, not their values, so the checkpoint stores them
    beside it (issue 18, item 3). Training thread, at the boundary and at the resume."""
    owned = {id(p) for m in roots for p in m.parameters()}
    out = []
    for o in opts:
        flat = [p for g in o.param_groups for p in g["params"]]
        out.append([(k, p) for k, p in enumerate(flat) if id(p) not in owned])
    return out


def scaler_state(scaler: Any) -> dict[str, Any]:
    """An AMP ``GradScaler``'s ``state_dict()`` with its scale and growth tracker as the live
    tensors (copied with the checkpoint, converted back to numbers at the resume:
    :func:`scaler_numbers`) instead of Python numbers: ``state_dict()`` calls ``.item()`` on
    them, a host sync that waits for the whole queued step at every checkpoint (issue 18, item
    8). A scaler whose class overrides ``state_dict``, or that is disabled or not yet used,
    gives its own ``state_dict()``."""
    if (type(scaler).state_dict is not torch.amp.GradScaler.state_dict
            or not getattr(scaler, "_enabled", False)
            or not isinstance(getattr(scaler, "_scale", None), torch.Tensor)
            or not isinstance(getattr(scaler, "_growth_tracker", None), torch.Tensor)):
        return dict(scaler.state_dict())
    return {"scale": scaler._scale, "growth_factor": scaler._growth_factor,
            "backoff_factor": scaler._backoff_factor,
            "growth_interval": scaler._growth_interval,
            "_growth_tracker": scaler._growth_tracker}


def scaler_numbers(sd: Any) -> Any:
    """A stored scaler state (:func:`scaler_state`) as ``GradScaler.load_state_dict`` takes
    it: ``scale`` a float, ``_growth_tracker`` an int (one-element CPU tensors at the resume;
    no device sync). Anything else is returned unchanged."""
    if not isinstance(sd, dict):
        return sd
    out = dict(sd)
    for key, kind in (("scale", float), ("_growth_tracker", int)):
        value = out.get(key)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = kind(value.reshape(-1)[0].item())
    return out
