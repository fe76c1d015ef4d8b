"""Phase 2 (after install): what the script built, found without its help.

The install phase wraps the ``__init__`` of torch's ``Optimizer``, ``LRScheduler``,
``ReduceLROnPlateau`` and ``GradScaler`` and of ``DataLoader`` (:mod:`cfrun.rank.data`); each new
object registers here, in creation order (the same in every run of the same script). The models
are not registered: they are found when a checkpoint needs them, as the outermost modules that
own the optimizers' parameters (:meth:`Discovery.model_roots`).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch


class Discovery:
    """The script's optimizers, schedulers, AMP scalers, DataLoaders and models, weakly held.

    Training thread only. ``flag`` reports a reason the resume may not be exact
    (:meth:`cfrun.rank.log.NotExact.flag`).
    """

    def __init__(self, flag: Callable[[str], None]) -> None:
        self._flag = flag
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._schedulers: list[weakref.ref[Any]] = []
        self._scalers: list[weakref.ref[Any]] = []
        self._loaders: list[weakref.ref[Any]] = []
        self._roots: list[torch.nn.Module] = []
        self._roots_key: int = -1
        self.replicated_params: set[int] = set()
        """ids of the parameters of DistributedDataParallel models (every rank holds them
        identically: DeepFreeze 1/N sharding applies). Set by :meth:`model_roots`."""
        self._held: list[Any] = []
        """The optimizers, schedulers and scalers alive at the last checkpoint (or the first
        step), strongly held so that the final checkpoint at the script's end finds them
        (:meth:`hold`)."""
        self.outer: list[weakref.ref[torch.nn.Module]] = []
        """The outermost modules, DDP and ``torch.compile`` wrappers included (a script's
        ``model = DDP(net)`` counts as saved), weakly. Set by :meth:`model_roots`."""

    # ---------------------------------------------------------------- registration (__init__)

    def register_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self._optimizers.append(weakref.ref(opt))

    def register_scheduler(self, sched: Any) -> None:
        self._schedulers.append(weakref.ref(sched))

    def register_scaler(self, scaler: Any) -> None:
        self._scalers.append(weakref.ref(scaler))

    def register_loader(self, loader: Any) -> int:
        """Returns the loader's creation ordinal (its name in checkpoints)."""
        self._loaders.append(weakref.ref(loader))
        return len(self._loaders) - 1

    # ---------------------------------------------------------------- the live objects

    def loaders(self) -> list[Any]:
        """The live DataLoaders, in creation order (each has its ordinal, ``_cfrun_ordinal``)."""
        return _alive(self._loaders)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The live optimizers, in creation order."""
        return _alive(self._optimizers)

    def schedulers(self) -> list[Any]:
        """The live LR schedulers, in creation order."""
        return _alive(self._schedulers)

    def scalers(self) -> list[Any]:
        """The live AMP GradScalers, in creation order."""
        return _alive(self._scalers)

    def hold(self) -> None:
        """Hold the live optimizers, schedulers and scalers strongly until the next
        :meth:`hold` or :meth:`release`: a script whose training objects are locals of its
        ``main()`` drops them before the process's end, where the final checkpoint is taken
        (:meth:`cfrun.rank.boundary.Boundary.final_checkpoint`; the models stay held as
        :meth:`model_roots`). Called at the first step and at every checkpoint, each time
        after :meth:`release` and the capture, so an object the script dropped since is never
        kept into the next checkpoint."""
        self._held = [*self.optimizers(), *self.schedulers(), *self.scalers()]

    def release(self) -> None:
        """Drop what :meth:`hold` held (before a capture counts the live objects)."""
        self._held = []

    def outer_modules(self) -> list[torch.nn.Module]:
        """The outermost modules found by the last :meth:`model_roots` (wrappers not
        unwrapped) that are still alive."""
        return _alive(self.outer)

    def model_roots(self) -> list[torch.nn.Module]:
        """Modules that own the optimizers' parameters, outermost only, unwrapped from DDP.

        Ordered by the position of their first parameter in the optimizers' param groups, which
        is the same in every run of the same script. Found once by a scan of live objects
        (``gc.get_objects``) and cached until the optimizers' parameters change.
        """
        order: dict[int, int] = {}
        for opt in self.optimizers():
            for group in opt.param_groups:
                for p in group["params"]:
                    order.setdefault(id(p), len(order))
        key = hash(tuple(order))
        if key == self._roots_key:
            return self._roots
        with warnings.catch_warnings():  # isinstance() on deprecated torch proxies warns
            warnings.simplefilter("ignore")
            # filter with the C-level instance check: ~40% less than a Python loop over the
            # ~200k objects a torch process holds (0.1-0.5 s at the first step)
            mods = [m for m in filter(torch.nn.Module.__instancecheck__, gc.get_objects())
                    if type(m) not in _PROXIES]  # a weak proxy is its module a second time
        children = {id(c) for m in mods for c in m._modules.values() if c is not None}
        ranked = []
        for m in mods:
            if id(m) in children:
                continue
            first = min((order[id(p)] for p in m.parameters() if id(p) in order), default=None)
            if first is not None:
                ranked.append((first, m))
        ranked.sort(key=lambda x: x[0])
        # data-parallel replicas: every rank holds these parameters identically (DeepFreeze 1/N)
        self.replicated_params = {id(p) for _, m in ranked
                                  if type(m).__name__ == "DistributedDataParallel"
                                  for p in m.parameters()}
        self.outer = [weakref.ref(m) for _, m in ranked]  # DDP / torch.compile wrappers too
        self._roots = [_unwrap(m) for _, m in ranked]
        self._roots_key = key
        return self._roots


_PROXIES = (weakref.ProxyType, weakref.CallableProxyType)
"""``weakref.proxy`` objects pass ``isinstance(p, nn.Module)`` for the module they stand for
(Lightning's Trainer holds one of its LightningModule): counted as a root of its own they made
every checkpoint hold that model twice."""


def _alive(refs: list[weakref.ref[Any]]) -> list[Any]:
    return [o for o in (r() for r in refs) if o is not None]


def _unwrap(m: torch.nn.Module) -> torch.nn.Module:
    while True:
        inner = getattr(m, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, torch.nn.Module):
            m = inner
            continue
        if type(m).__name__ in ("DistributedDataParallel", "DataParallel") and isinstance(
                getattr(m, "module", None), torch.nn.Module):
            m = m.module  # type: ignore[assignment]
            continue
        return m


def uncheckpointable(found: Discovery) -> str | None:
    """Why cfrun cannot checkpoint this rank's state, in one line, or None.

    * **FSDP1** (``FullyShardedDataParallel``): its ``state_dict()`` all-gathers the whole
      model on the training process group at every boundary, and its flat parameters are not
      the model's; checkpointing its sharded state dict (per-parameter shards cut from the
      flat parameters) exactly is not done. cfrun refuses it and names FSDP2's
      ``fully_shard``, its successor, whose DTensor state it checkpoints as it lies (issue 25,
      item 3; :mod:`cfrun.codec.dtensor`).

    DTensor parameters (FSDP2, tensor parallelism) are checkpointed (issue 25).

    Called once, at the first optimizer step (training thread); costs one scan of the live
    modules (:meth:`Discovery.model_roots`, cached for the first checkpoint).
    """
    opts = found.optimizers()
    params = [p for o in opts for g in o.param_groups for p in g["params"]]
    if any(type(p).__name__ == "FlatParameter" for p in params) or any(
            type(m).__name__ == "FullyShardedDataParallel" for m in _outer_modules(found)):
        return ("the model is wrapped in FSDP1 (FullyShardedDataParallel), which cfrun cannot "
                "checkpoint (its state_dict() all-gathers the model at every checkpoint); "
                "shard it with FSDP2's torch.distributed.fsdp.fully_shard instead, whose "
                "state cfrun checkpoints shard by shard")
    return None


def _outer_modules(found: Discovery) -> list[torch.nn.Module]:
    """The outermost modules owning the optimizers' parameters, wrappers not unwrapped."""
    found.model_roots()  # the one scan of live objects; its outermost modules are kept
    return found.outer_modules()
