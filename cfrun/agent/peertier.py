"""The persist agent's side of the peer tier: parallel shard transfer, reconnects, fetch.

Runs inside the persist agent (``cfrun.agent.peerpath``), never in a rank. For each rank's
checkpoint the
agent hands this module the rank's shared-memory snapshot slot; the slot's bytes are split into
``streams`` contiguous byte ranges and sent concurrently, each over its own authenticated
connection, straight from the ``mmap`` (no copy, no re-serialization: ACUTE §IV-B Check-Trans and
§IV-C Check-Pack). Connections are pooled and reused across checkpoints.

When the peer cannot be reached (down, wrong token, full), :meth:`PeerTier.mark_down` starts an
exponential backoff (0.5 s doubling up to 30 s) during which the agent persists to the job dir
instead; the first failure of an outage is logged once. After the backoff the next checkpoint
tries the peer again, so a restarted peer is used again without any action.

Every seal carries two tags over the rank's files: the token's
(:func:`cfrun.peer.protocol.seal_tag`, which the peer checks: only token holders seal), and the
job's own (:func:`cfrun.peer.protocol.job_seal_tag`, over the files' SHA-256, under the job's
seal key: by default derived from the peer token and the job's name, with ``--job-key-file``
from that per-job key, :mod:`cfrun.contract.jobkey`), which the peer keeps in the manifest it
serves and flushes. For a resume, :meth:`PeerTier.fetch` copies one complete
checkpoint from peer RAM into a staging directory, each file with exactly the size the manifest
gives, then checks the job's seals over the SHA-256 of what it fetched
(:func:`fetch_verified`, also applied to a checkpoint read from level 2). A relay or a writer
of the level-2 store can thus neither forge nor alter a checkpoint that this job installs; with
a per-job key, neither can the peer nor another job holding the same peer token.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import functools
import hashlib
import hmac
import logging
import mmap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from cfrun.contract.checkpoints import write_file
from cfrun.contract.config import redact_url
from cfrun.contract.errors import CheckpointCorruptError
from cfrun.contract.manifest import FileEntry, Manifest, shard_names
from cfrun.contract.retry import backoff_delay_s
from cfrun.peer.protocol import (
    MAX_FETCH_BYTES,
    MAX_MANIFEST_BYTES,
    PeerClient,
    PeerError,
    SealKeys,
    job_seal_tag,
    loads_json,
    manifest_key,
    seal_tag,
    verify_job_seals_before_read,
)
from cfrun.storage.tiers import MANIFEST

logger = logging.getLogger("cfrun.agent")

PEER_BACKOFF_S = 0.5
"""The wait after the first failure of an outage; doubled per failure, at most 30 s."""
PART_ALIGN_BYTES = 4096
MIN_PART_BYTES = 1 << 20
"""Shards smaller than streams x this are sent in fewer parts (tiny parts cost more than
they gain)."""


def split_parts(nbytes: int, streams: int) -> list[tuple[int, int]]:
    """``[(offset, length)]``: ``nbytes`` in at most ``streams`` 4 KiB-aligned ranges (pure)."""
    n = max(1, min(streams, nbytes // MIN_PART_BYTES))
    size = -(-nbytes // n // PART_ALIGN_BYTES) * PART_ALIGN_BYTES or nbytes
    out = []
    for off in range(0, nbytes, size):
        out.append((off, min(size, nbytes - off)))
    return out or [(0, 0)]


class PeerTier:
    """Connections to one ``cfrun peer`` for one job. Thread-safe.

    Args:
        address: the peer's ``(host, port)``.
        token: shared secret (:func:`cfrun.peer.protocol.read_token`).
        job: the job's name at the peer (one prefix per job at level 2).
        streams: parallel connections per rank shard (ACUTE's sharding degree), 1..64.
        emit: ``emit(event, **fields)`` appends to the job's events.jsonl.
    """

    def __init__(self, address: tuple[str, int], token: bytes, job: str, *, streams: int,
                 emit: Callable[..., None], job_key: bytes | None = None,
                 seal_keys: SealKeys | None = None) -> None:
        self.address = address
        self.token = token
        self.job = job
        self.manifest_key = manifest_key(token, job)
        if seal_keys is None:
            seal_keys = SealKeys.of_job_key(job_key, job) if job_key is not None \
                else SealKeys.of_token(token, job)
        self.seal_keys = seal_keys
        """The job's own seal keys (:func:`cfrun.agent.peerpath.job_seal_keys`; given
        ``job_key`` alone: that per-job key; neither: the token's)."""
        self.streams = max(1, min(64, streams))
        self.emit = emit
        self.lock = threading.Lock()
        self.idle: list[PeerClient] = []
        self.pool = cf.ThreadPoolExecutor(max_workers=64, thread_name_prefix="cfrun-peer-send")
        self.failures = 0
        self.next_try = 0.0
        self.is_down = False
        self.watchers: list[threading.Thread] = []

    # ------------------------------------------------------------------ connections

    def _acquire(self) -> PeerClient:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return PeerClient(self.address, self.token)

    def _release(self, client: PeerClient, ok: bool) -> None:
        if not ok:
            client.close()
            return
        with self.lock:
            self.idle.append(client)

    def _call(self, fn: Callable[[PeerClient], Any]) -> Any:
        client = self._acquire()
        ok = False
        try:
            result = fn(client)
            ok = True
            return result
        finally:
            self._release(client, ok)

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for c in idle:
            c.close()

    def available(self) -> bool:
        """False while backing off after a failure (then the job dir takes checkpoints)."""
        return not self.is_down or time.monotonic() >= self.next_try

    def mark_down(self, error: BaseException | str) -> None:
        """Record a failure: back off, drop pooled connections, warn once per outage."""
        self.close()
        with self.lock:
            self.failures += 1
            self.next_try = time.monotonic() + backoff_delay_s(PEER_BACKOFF_S, self.failures)
            first = not self.is_down
            self.is_down = True
        if first:
            logger.warning("WARNING: peer %s:%d unavailable (%s); checkpoints go to the job dir "
                           "until it is back", *self.address, error)
            self.emit("peer_unavailable", peer=f"{self.address[0]}:{self.address[1]}",
                      error=str(error))

    def mark_up(self) -> None:
        """Record a success; logs the reconnection after an outage."""
        with self.lock:
            was_down, self.is_down, self.failures = self.is_down, False, 0
        if was_down:
            logger.warning("peer %s:%d reachable again; checkpoints go to peer RAM",
                           *self.address)
            self.emit("peer_reconnected", peer=f"{self.address[0]}:{self.address[1]}")

    # ------------------------------------------------------------------ persist

    def send_shard(self, *, step: int, world_size: int, rank: int, slot: Path, nbytes: int,
                   doc: bytes, meta: dict[str, Any], wait_s: float = 10.0,
                   die_mid_transfer: Callable[[], None] | None = None) -> bool:
        """Send one rank's shard (slot bytes + JSON tree) in parallel parts, then seal it.

        Called by the agent, one thread per rank; the rank does not touch its slot until the
        agent replies. Returns True when this seal completed the step (all ranks protected).

        Raises:
            PeerError: any part or the seal failed; the step is then not protected.
        """
        bin_name, json_name = shard_names(rank)
        with open(slot, "rb") as f, mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            slices: list[memoryview] = []
            futures: list[cf.Future[Any]] = []
            try:
                parts = split_parts(nbytes, self.streams)
                for i, (off, length) in enumerate(parts):
                    piece = view[off:off + length]
                    slices.append(piece)
                    futures.append(self.pool.submit(self._call, functools.partial(
                        PeerClient.put, job=self.job, step=step, world_size=world_size,
                        name=bin_name, part=i, nparts=len(parts), offset=off,
                        file_bytes=nbytes, data=piece, wait_s=wait_s)))
                futures.append(self.pool.submit(self._call, lambda c: c.put(
                    job=self.job, step=step, world_size=world_size, name=json_name, part=0,
                    nparts=1, offset=0, file_bytes=len(doc), data=doc, wait_s=wait_s)))
                if die_mid_transfer is not None:
                    cf.wait(futures[:1])
                    die_mid_transfer()
                digest = xxhash.xxh3_64_hexdigest(view)  # meanwhile, for the manifest
                sha256 = hashlib.sha256(view).hexdigest()  # and for the job's seal
            finally:
                cf.wait(futures)  # no send may still use the mapping when it is closed
                for piece in slices:
                    piece.release()
                view.release()
        for fut in futures:
            fut.result()  # the first failure, if any
        files = [{"name": bin_name, "nbytes": nbytes, "xxh3_64": digest},
                 {"name": json_name, "nbytes": len(doc),
                  "xxh3_64": xxhash.xxh3_64_hexdigest(doc)}]
        tag = seal_tag(self.manifest_key, step=step, world_size=world_size, rank=rank,
                       files=files, meta=meta)
        digests = [sha256, hashlib.sha256(doc).hexdigest()]
        job_tag = job_seal_tag(self.seal_keys.seal, step=step, world_size=world_size, rank=rank,
                               files=[{**f, "sha256": d} for f, d in zip(files, digests)],
                               meta=meta)
        return bool(self._call(lambda c: c.seal(job=self.job, step=step, world_size=world_size,
                                                rank=rank, files=files, meta=meta, tag=tag,
                                                job_tag=job_tag, sha256=digests)))

    def await_state(self, step: int, state: str, timeout_s: float) -> dict[str, Any]:
        """Block until the step is ``protected``/``durable`` at the peer (or the timeout).

        Returns:
            ``{state, flush_to, error}`` (:meth:`cfrun.peer.protocol.PeerClient.await_state`).
        """
        client = PeerClient(self.address, self.token)
        try:
            return client.await_state(self.job, step, state, timeout_s)
        finally:
            client.close()

    def watch_durable(self, step: int, t_trigger_unix_s: float, timeout_s: float = 3600.0
                      ) -> None:
        """In a thread: emit ``durable`` once the peer flushed ``step`` to level 2."""
        def run() -> None:
            try:
                reply = self.await_state(step, "durable", timeout_s)
            except PeerError as e:
                self.emit("durable_unknown", step=step, error=str(e))
                return
            if reply.get("state") == "durable":
                self.emit("durable", step=step, tier="peer", url=redact_url(reply.get("flush_to")),
                          durable_s=round(time.time() - t_trigger_unix_s, 6))
            else:
                self.emit("durable_unknown", step=step, state=reply.get("state"),
                          error=reply.get("error"))

        t = threading.Thread(target=run, name=f"cfrun-durable-{step}", daemon=True)
        with self.lock:
            self.watchers = [w for w in self.watchers if w.is_alive()] + [t]
        t.start()

    def join_watchers(self, timeout_s: float) -> None:
        """Wait (bounded) for outstanding ``durable`` notifications, e.g. at agent exit."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            watchers = list(self.watchers)
        for t in watchers:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ resume

    def list(self) -> dict[str, Any]:
        """The peer's view of this job: ``{flush_to, checkpoints: [{step, state, ...}]}``."""
        return dict(self._call(lambda c: c.list(self.job)))

    def fetch(self, step: int, staging: Path) -> tuple[builtins.list[FileEntry], dict[str, Any]]:
        """Copy a complete checkpoint from peer RAM into ``staging`` (files fsynced, verified
        by :func:`fetch_verified`: sizes as the manifest gives, never more than
        :data:`MAX_FETCH_BYTES`, then this job's seals over their SHA-256).

        Returns:
            The files written and the peer's manifest.

        Raises:
            PeerError: unreachable, the step is gone, or a frame failed authentication.
            CheckpointCorruptError: the manifest is not sealed by this job, or a file does not
                match it.
        """
        raw = self._call(lambda c: c.get(self.job, step, MANIFEST, MAX_MANIFEST_BYTES))
        try:
            manifest = loads_json(raw)
        except PeerError as e:
            raise CheckpointCorruptError(f"manifest of step {step} from the peer: {e}") from None
        return fetch_verified(staging, manifest, step, job=self.job, seal_key=self.seal_keys,
                              read=lambda name, nbytes: self._call(
                                  lambda c: c.get(self.job, step, name, nbytes, exact=True))
                              ), manifest


def fetch_verified(staging: Path, manifest: Any, step: int, *, job: str,
                   seal_key: bytes | SealKeys,
                   read: Callable[[str, int], bytes | bytearray]) -> list[FileEntry]:
    """Write every file ``manifest`` (JSON, from the peer or level 2) lists into ``staging``,
    each read with ``read(name, nbytes)`` at the size the manifest gives and checked against
    it. This job's seals are checked first, over the SHA-256 digests the manifest declares
    (:func:`cfrun.peer.protocol.verify_job_seals_before_read`), before any file is read or
    staged, and each file's bytes must then have its declared digest. Called by the agent
    before it commits a checkpoint from outside the job dir; the caller removes ``staging``
    when this raises.

    Raises:
        CheckpointCorruptError: not a manifest of ``step``, a size or checksum mismatch, or a
            missing or wrong job seal (one line).
    """
    parsed = Manifest.from_json(manifest, f"manifest of step {step}")
    if parsed.step != step:
        raise CheckpointCorruptError(f"manifest of step {step} is for step {parsed.step}")
    declared = verify_job_seals_before_read(seal_key, manifest, step, job=job)
    sha256: dict[str, str] = {}
    files = manifest_files_to(staging, parsed, read, sha256=sha256)
    for name, digest in sha256.items():  # the bytes are the ones the job sealed
        if not hmac.compare_digest(digest, declared.get(name, "")):
            raise CheckpointCorruptError(f"{job} step {step}: fetched {name} is not the file "
                                         "its job seal covers; not installed")
    return files


def manifest_files_to(staging: Path, manifest: Manifest | dict[str, Any],
                      read: Callable[[str, int], bytes | bytearray], *,
                      sha256: dict[str, str] | None = None) -> list[FileEntry]:
    """Write every file ``manifest`` lists into ``staging``, checked against the manifest.

    ``read(name, nbytes)`` returns a file's bytes (from peer RAM or level 2); ``sha256``, when
    given, gets each file's SHA-256 (hex) by name.

    Raises:
        CheckpointCorruptError: unknown format, a bad file name, a size or checksum mismatch.
    """
    if not isinstance(manifest, Manifest):
        manifest = Manifest.from_json(manifest, "fetched manifest")
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = []
    for f in manifest.files:  # names and sizes checked by Manifest.parse
        if f.nbytes > MAX_FETCH_BYTES:
            raise CheckpointCorruptError(f"fetched manifest lists {f.name} of {f.nbytes} bytes, "
                                         f"more than {MAX_FETCH_BYTES}")
        data = read(f.name, f.nbytes)
        if len(data) != f.nbytes or xxhash.xxh3_64_hexdigest(data) != f.xxh3_64:
            raise CheckpointCorruptError(f"fetched {f.name} does not match its manifest")
        if sha256 is not None:
            sha256[f.name] = hashlib.sha256(data).hexdigest()
        out.append(write_file(staging / f.name, [data]))
    return out
