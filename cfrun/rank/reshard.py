"""Resume on another world size (``--reshard``, issue 25 item 4): a checkpoint written by
``W_old`` ranks brought onto ``W_new`` ranks. Not bit-exact, and said so.

What each new rank ``r`` takes (:class:`ReshardRead`):

* **replicated state** (DDP's model, optimizer, scheduler, scaler; the step count): from old
  rank ``r % W_old``, whose copy every old rank holds alike (DeepFreeze's 1/N layout is put
  together from every old rank's slices by the same reader as a same-size resume);
* **DTensor state** (FSDP2, tensor parallelism): each stored local shard carries every old
  rank's shard of the same tensor (:attr:`cfrun.codec.dtensor.LocalShard.parts`); at the
  resume, where the live mesh is known, :func:`cfrun.codec.dtensor.reshard_local` cuts this
  rank's new local shard out of them by their global offsets (only the overlapping blocks are
  copied; no collective). This reads every old rank's file on every new rank: the host memory
  it takes is the whole checkpoint, not one shard (what DCP's planner would avoid);
* **RNG and script variables**: old rank ``r % W_old``'s; a variable the loops around the
  resume point never assign (``rank``, ``world_size``, ``device``: what the script computed for
  this world before its loop) keeps the live value (:func:`cfrun.rank.liveness.loop_assigned`);
* **the data position** (:func:`map_position`): the checkpoint's epoch goes on where the old
  world left it, counted in global samples: ``consumed = batches * batch_size * replicas``
  (``replicas``: the ``DistributedSampler``'s ``num_replicas``, 1 without one), and each new
  rank skips ``consumed // (batch_size' * replicas')`` batches of its new sampler. A
  ``DistributedSampler`` draws one permutation for every world size and gives rank ``q`` its
  positions ``q, q + W, ...``, so the first ``consumed`` positions are exactly the samples
  consumed: none is seen again and none is skipped when ``consumed`` divides; otherwise the
  remainder (fewer than one new global batch) is seen again, and the resume says how many.

The sampler's world-dependent attributes (``num_replicas``, ``rank``, ``num_samples``,
``total_size``) keep the live values; its ``epoch`` and ``seed`` come back.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cfrun.codec.dtensor import LocalShard, has_shards

WORLD_KEYS = frozenset({"num_replicas", "rank", "num_samples", "total_size"})
"""A sampler's attributes that belong to the world it was built for (a ``DistributedSampler``'s):
a resharded resume leaves the live ones alone."""


class ReshardRead:
    """New rank ``rank``'s state from a checkpoint of another world size, read and put
    together on the caller's thread (the same interface as
    :class:`cfrun.codec.checkpoint.ShardRead`: :attr:`state`, :attr:`meta`, :meth:`wait`).

    ``meta["resharded"]`` is ``{"from": W_old, "to": world_size, "source_rank": r % W_old}``.

    Raises:
        CheckpointCorruptError: an old rank's shard does not read, verify or decode.
    """

    def __init__(self, step_dir: Path, rank: int, world_size: int) -> None:
        from cfrun.codec.checkpoint import assemble_rank
        from cfrun.contract.manifest import read_manifest

        self.step_dir = step_dir
        self.start_unix_s = time.time()
        manifest = read_manifest(step_dir)
        self.saved_world_size = manifest.world_size
        source = rank % manifest.world_size
        docs: dict[int, Any] = {}
        state, meta = assemble_rank(step_dir, manifest, source, docs)
        if has_shards(state):
            others = [assemble_rank(step_dir, manifest, q, docs)[0]
                      for q in range(manifest.world_size)]
            attach_parts(state, others)
        docs.clear()
        self.state = state
        self.meta = {**meta, "resharded": {"from": manifest.world_size, "to": world_size,
                                           "source_rank": source}}
        self.read_s: float | None = time.time() - self.start_unix_s

    def done(self) -> bool:
        """Always True: the read ended in the constructor."""
        return True

    def wait(self) -> tuple[Any, dict[str, Any]]:
        """``(state, meta)``."""
        return self.state, self.meta


def attach_parts(tree: Any, others: list[Any]) -> None:
    """Give every :class:`LocalShard` of ``tree`` the shards of the same tensor in ``others``
    (every old rank's decoded tree, in rank order, ``tree``'s own rank among them), in place.

    Raises:
        ValueError: the old ranks' trees differ in layout where ``tree`` has a shard.
    """
    if isinstance(tree, dict):
        for k, v in tree.items():
            if has_shards(v):
                attach_parts(v, [_child(o, k) for o in others])
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            if has_shards(v):
                attach_parts(v, [_child(o, i) for o in others])
    elif isinstance(tree, LocalShard):
        if not all(isinstance(o, LocalShard) for o in others):
            raise ValueError("the old ranks' checkpoints disagree on which values are DTensors")
        tree.parts = list(others)


def _child(tree: Any, key: Any) -> Any:
    try:
        return tree[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"the old ranks' checkpoints disagree on the entry {str(key)[:60]}"
                         ) from None


def replicas_of(sampler_states: list[dict[str, Any]]) -> int:
    """The data-parallel replicas a loader's sampler was built for: the first sampler's
    ``num_replicas`` (a ``DistributedSampler``'s), else 1."""
    for st in sampler_states:
        n = st.get("num_replicas")
        if type(n) is int and n >= 1:
            return n
    return 1


def map_position(batches: int, batch_size: int, replicas: int, new_batch_size: int,
                 new_replicas: int) -> tuple[int, int]:
    """The resumed epoch's position on the new world: ``(batches to skip on each new rank,
    samples seen again)``, from ``batches`` consumed by each old rank of ``batch_size`` with
    ``replicas`` ranks sharing the sampler (see the module doc).

    >>> map_position(6, 8, 4, 16, 2)
    (6, 0)
    >>> map_position(3, 16, 2, 8, 4)
    (3, 0)
    >>> map_position(5, 4, 2, 4, 4)
    (2, 8)
    """
    consumed = batches * batch_size * replicas
    per_batch = max(1, new_batch_size * new_replicas)
    skip = consumed // per_batch
    return skip, consumed - skip * per_batch


def sampler_state_for_new_world(saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``saved`` (:func:`cfrun.rank.data.sampler_state`) without :data:`WORLD_KEYS`."""
    return [{k: v for k, v in st.items() if k not in WORLD_KEYS} for st in saved]
