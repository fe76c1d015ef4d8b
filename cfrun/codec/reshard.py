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
  copied; no collective). Of the old ranks other than ``r % W_old`` only the shards that
  overlap this rank's new ones are read (:func:`_lazy_tree`: each one's bytes alone, by its
  table entry), one at a time, as DCP's planner reads only the slices a rank needs;
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

import functools
import os
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
            others = [state if q == source else _lazy_tree(step_dir, manifest, q, docs)
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


def _lazy_tree(step_dir: Path, manifest: Any, rank: int, docs: dict[int, Any]) -> Any:
    """Old rank ``rank``'s decoded tree with no tensor bytes read: every tensor a ``meta``
    tensor, every DTensor shard (:class:`LocalShard`) with a :attr:`LocalShard.load` that reads
    its bytes alone from the rank's ``.bin`` (``pread`` at its table entry's offset), so a new
    rank reads of the other old ranks only the shards that overlap its own. A rank with a
    1/N layout (replicated tensors in slices) is read whole.

    The files were verified whole by every rank at install
    (:func:`cfrun.codec.checkpoint.check_usable`); the bytes read here are checked against
    their table entry's size.

    Raises:
        CheckpointCorruptError: the rank's document does not read or decode.
    """
    from cfrun.codec.checkpoint import assemble_rank
    from cfrun.codec.format import decode, meta_tensor
    from cfrun.contract.errors import CheckpointCorruptError
    from cfrun.contract.shard import read_doc, shard_names

    doc, entries = read_doc(step_dir, manifest, rank)
    tree = doc["tree"]
    if isinstance(tree, dict) and tree.get("sharded"):
        return assemble_rank(step_dir, manifest, rank, docs)[0]
    try:
        metas = [meta_tensor(e) for e in entries]
        decoded = decode(tree, metas)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointCorruptError(f"{step_dir.name}: rank {rank}'s shard does not decode "
                                     f"({type(e).__name__}: {str(e)[:200]})") from None
    entry_of = {id(t): e for t, e in zip(metas, entries)}
    bin_path = step_dir / shard_names(rank)[0]
    shards = _shards(decoded)
    if any(id(shard.local) not in entry_of for shard in shards):  # not one table entry each
        return assemble_rank(step_dir, manifest, rank, docs)[0]
    for shard in shards:
        shard.load = functools.partial(_read_entry, bin_path, entry_of[id(shard.local)])
    return decoded


def _shards(tree: Any) -> list[LocalShard]:
    if isinstance(tree, LocalShard):
        return [tree]
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _shards(v)]
    if isinstance(tree, (list, tuple)):
        return [s for v in tree for s in _shards(v)]
    return []


def _read_entry(bin_path: Path, entry: Any) -> Any:
    """One tensor's bytes from a shard file (a regular file, no link followed), as a tensor.

    Raises:
        CheckpointCorruptError: the file is shorter than the entry says, or not a regular file.
    """
    import dataclasses

    from cfrun.codec.format import tensor_from_buffer
    from cfrun.contract.errors import CheckpointCorruptError
    from cfrun.contract.fsio import open_regular

    try:
        fd, size = open_regular(bin_path, max_bytes=1 << 62)
    except OSError as e:  # UnsafeFileError (a link, not a regular file) is one
        raise CheckpointCorruptError(f"{bin_path.name}: {e}") from None
    try:
        if entry.offset + entry.nbytes > size:
            raise CheckpointCorruptError(f"{bin_path.name}: shorter than its table says")
        buf = bytearray(entry.nbytes)
        view, got = memoryview(buf), 0
        while got < entry.nbytes:
            n = os.preadv(fd, [view[got:]], entry.offset + got)
            if n <= 0:
                raise CheckpointCorruptError(f"{bin_path.name}: shorter than its table says")
            got += n
    finally:
        os.close(fd)
    return tensor_from_buffer(buf, dataclasses.replace(entry, offset=0))


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
    """``saved`` (:func:`cfrun.rank.loader_epoch.sampler_state`) without :data:`WORLD_KEYS`."""
    return [{k: v for k, v in st.items() if k not in WORLD_KEYS} for st in saved]
