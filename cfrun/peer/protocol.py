"""The peer tier's wire protocol: handshake, session keys, authenticated frames, limits, client.

Imported by the ``cfrun peer`` server (:mod:`cfrun.peer.server`) and by the persist agent
(:mod:`cfrun.agent.peertier`), never by a rank. Torch-free.

**Handshake** (challenge-response on the shared token, both sides prove it)::

    server -> client  "CFPH" v  server_nonce(32)
    client -> server  "CFPC" v  client_nonce(32)  HMAC(token, "cfrun-peer/2 client" sn cn)
    server -> client  "CFPY"    HMAC(token, "cfrun-peer/2 server" cn sn)      ("CFPN": refused,
                                                                               "CFPB": busy)

With several tenants (:mod:`cfrun.peer.tenants`) the server checks the client's proof against
every tenant's token (:class:`cfrun.peer.gate.Gate`) and answers with the one that matched; the
client's side is unchanged: it knows only its own token.

**Session keys.** Both nonces and the token go through HKDF-SHA256 (RFC 5869; salt = sn || cn,
info names the protocol) into one key per direction. A relay that forwards the handshake learns
the nonces but not the token, so it cannot compute the keys.

**Frames** after the handshake: a fixed 20-byte header (magic, version, op, flags, JSON length
<= 64 KiB, payload length) + the JSON header + a 32-byte tag, then, if the payload is sent, the
payload + a second 32-byte tag::

    tag_h = HMAC-SHA256(k_dir, seq || header || json)
    tag_p = HMAC-SHA256(k_dir, seq || header || json || payload)

``seq`` counts frames per direction (8 bytes, from 0), so a frame cannot be injected, replayed,
reordered, cut or answered by anyone without the token. The header tag is checked before the
JSON is parsed or any payload byte is accepted; the payload tag before the payload is used.
A PUT's payload follows only after the server's ``go`` (the space is reserved first); a GET's
follows its reply header. Any tag mismatch closes the connection.

Why HMAC frames and not TLS with the token as pre-shared key: Python's :mod:`ssl` offers PSK
only from 3.13 (cfrun supports 3.10+), and TLS would encrypt what the peer tier only needs
authenticated (checkpoints are the job's own data on a private network; run a tunnel for
secrecy). Everything here is stdlib ``hmac``/``hashlib``/``secrets`` (HMAC-SHA256, HKDF built
from it exactly as RFC 5869 specifies, ``hmac.compare_digest``); no new dependency for a
torch-free process. Cost: one HMAC-SHA256 pass per byte sent (~1.8 GB/s per core with SHA-NI).

**Manifests** are authenticated end to end by the agents that wrote them: each SEAL carries
``tag = HMAC(K_job, canonical JSON of {job, step, world_size, rank, files, meta (rank 0)})`` with
``K_job = HKDF(token, info="cfrun-peer/2 manifest" job)``; the peer keeps the tags in the
manifest it builds (``"seals": [{rank, tag}]``, also in its level-2 flush), and an agent
fetching a checkpoint back checks every rank's tag (:func:`verify_manifest`) before it trusts
the checksums inside. The key comes from the same token: it proves the manifest was written by
a holder of the token for this job, not by a relay, a writer of the level-2 store, or bit rot.

**Limits** (DESIGN.md §9): JSON headers at most 64 KiB, parsed with non-finite numbers refused
(``NaN``, ``Infinity``, ``1e999``), every numeric field range-checked; payloads bounded by the
slot size (PUT) or by what the client asked for (GET); the whole handshake within
:data:`HANDSHAKE_DEADLINE_S`; at most :data:`MAX_UNAUTHENTICATED` connections mid-handshake
(:data:`MAX_UNAUTHENTICATED_PER_ADDRESS` per address), the oldest evicted for a new one.

Requests (client -> server; every request gets one response, ``op | 0x80``)::

    PUT   {job, step, world_size, name, part, nparts, offset, file_bytes, xxh3_64, wait_s}
          -> {ok, go}  then the client sends the payload -> {ok}
    SEAL  {job, step, world_size, rank, files: [{name, nbytes, xxh3_64}], meta, tag, job_tag}
          -> {ok, state, complete}
    AWAIT {job, step, state: protected|durable, timeout_s} -> {ok, state}
    LIST  {job} -> {ok, flush_to, checkpoints: [{step, world_size, state, bytes}]}
    GET   {job, step, name, max_bytes} -> {ok, nbytes} + payload (``manifest.json`` is built
          from the seals)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import socket
import stat
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import xxhash

from cfrun.contract import wire
from cfrun.contract.errors import BadInputError, CheckpointCorruptError, ForeignCheckpointError
from cfrun.contract.jobkey import ensure_job_key, existing_job_key
from cfrun.storage.tiers import FILE_RE, MANIFEST

PROTOCOL_VERSION = 2
NONCE_BYTES = 32
MAC_BYTES = 32
KEY_BYTES = 32
SERVER_HELLO = b"CFPH"
CLIENT_HELLO = b"CFPC"
AUTH_OK = b"CFPY"
AUTH_NO = b"CFPN"
AUTH_BUSY = b"CFPB"
SERVER_HELLO_BYTES = 5 + NONCE_BYTES
CLIENT_HELLO_BYTES = 5 + NONCE_BYTES + MAC_BYTES
FRAME_MAGIC = b"CFPF"
FRAME = struct.Struct("!4sBBHIQ")
"""magic, version, op, flags (0), JSON header bytes, payload bytes: 20 bytes."""
SEQ = struct.Struct("!Q")
MAX_JSON_BYTES = 64 << 10
MAX_PARTS = 64
MAX_RANKS = 1 << 16
MAX_STEP = 10 ** 12
MAX_SEAL_FILES = 8
HANDSHAKE_DEADLINE_S = 5.0
"""The whole handshake (every byte of it) must complete within this many seconds."""
MAX_UNAUTHENTICATED = 16
"""Connections mid-handshake at once; a new one evicts the oldest (slow clients cannot lock
out a valid one)."""
MAX_UNAUTHENTICATED_PER_ADDRESS = 8
"""Of those, from one address (its own oldest is evicted first)."""
HANDSHAKE_TRIES = 3
"""A client whose handshake was cut (evicted under a flood) tries this often in all."""
IDLE_TIMEOUT_S = 900.0
IO_TIMEOUT_S = 60.0
MAX_AWAIT_S = 3600.0
MAX_RESERVE_WAIT_S = 60.0
MAX_CONNECTIONS = 256
"""Authenticated connections at once."""
MAX_MANIFEST_BYTES = 16 << 20
MAX_FETCH_BYTES = 1 << 40
"""Hard cap on one fetched file, whatever an (authenticated) manifest says."""
IO_CHUNK_BYTES = 4 << 20
_TAG_RE = re.compile(r"^[0-9a-f]{64}$")


class Op(enum.IntEnum):
    """Request codes; a response carries ``op | RESPONSE``."""

    PUT = 1
    SEAL = 2
    AWAIT = 3
    LIST = 4
    GET = 5


RESPONSE = 0x80


class PeerError(ConnectionError):
    """The peer is unreachable, refused a request, or broke the protocol."""


class PeerAuthError(PeerError):
    """The handshake failed: wrong token on one side."""


class ProtocolError(PeerError):
    """A malformed, oversized, out-of-range or unauthenticated frame."""


class HandshakeClosedError(PeerError):
    """The peer closed the connection mid-handshake without an answer (evicted while it was
    flooded with unauthenticated connections, or restarting): worth one more try."""


# ---------------------------------------------------------------------- tokens and addresses


def parse_address(text: str, *, option: str = "--listen") -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[v6]:PORT`` for IPv6). Port 0 asks the OS for a free port.

    Raises:
        BadInputError: malformed, or a port outside 0..65535.
    """
    host, sep, port_s = text.strip().rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_s)
    except ValueError:
        port = -1
    if not sep or not host or not 0 <= port <= 65535:
        raise BadInputError(f"{option} {text!r} is not HOST:PORT; give e.g. {option} "
                            "10.0.0.5:7077")
    return host, port


MIN_TOKEN_BYTES = 32
"""A token's least length: ``openssl rand -hex 16`` (128 bits of entropy in 32 characters).
16 bytes were accepted before, 64 bits when written as hex (issue 24, item 10)."""


def read_token(path: str, *, option: str = "--token-file", dir_fd: int | None = None) -> bytes:
    """Read the shared secret from ``path`` (surrounding whitespace stripped).

    The file must be a regular file (a symbolic link is not followed), owned by the calling
    user, with no group or other permission bits, holding :data:`MIN_TOKEN_BYTES` to 4096 bytes.
    ``dir_fd``: ``path`` is a name in that open directory (a token directory of ``cfrun peer``,
    :func:`cfrun.peer.tenants.read_tenants`); messages then name ``path`` as given.

    Raises:
        BadInputError: missing, unreadable, a link or not a regular file, owned by someone
            else, group/other bits set, or empty/too short. One line naming the file and the fix.
    """
    fix = f"`openssl rand -hex 32 > {path} && chmod 600 {path}`"
    where = Path(path).expanduser() if dir_fd is None else Path(path).name
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        try:
            is_link = stat.S_ISLNK(os.stat(where, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise BadInputError(f"{option} {path!r} is a symbolic link; give the token file "
                                f"itself (a regular file of yours, `chmod 600 {path}`)") from None
        raise BadInputError(f"{option} {path!r} cannot be read ({e.strerror}); create it with "
                            f"{fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInputError(f"{option} {path!r} is not a regular file; create one with {fix}")
        if st.st_uid != os.getuid():
            raise BadInputError(f"{option} {path!r} is owned by uid {st.st_uid}, not by you "
                                f"(uid {os.getuid()}); use a token file of your own, "
                                f"`chmod 600 {path}`")
        if st.st_mode & 0o077:
            raise BadInputError(f"{option} {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: "
                                f"readable by other users; run `chmod 600 {path}`")
        data = os.read(fd, 4097).strip()
    except OSError as e:
        raise BadInputError(f"{option} {path!r} cannot be read ({e.strerror}); create it with "
                            f"{fix}") from None
    finally:
        os.close(fd)
    if len(data) < MIN_TOKEN_BYTES or len(data) > 4096:
        what = "no" if not data else "a too short" if len(data) < MIN_TOKEN_BYTES else "a too long"
        raise BadInputError(f"{option} {path!r} holds {what} token ({len(data)} bytes; "
                            f"{MIN_TOKEN_BYTES} to 4096 needed); create one with {fix}")
    return data


# ---------------------------------------------------------------------- keys and MACs


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int) -> bytes:
    """HKDF with HMAC-SHA256 (RFC 5869 §2.2 extract, §2.3 expand), from stdlib ``hmac``.

    Checked against RFC 5869's test vectors in tests/unit/test_peer_unit.py.
    """
    if not 0 < length <= 255 * 32:
        raise ValueError(f"HKDF length {length} outside 1..8160")
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    out, block = b"", b""
    for i in range(1, -(-length // 32) + 1):
        block = hmac.new(prk, block + info + bytes([i]), hashlib.sha256).digest()
        out += block
    return out[:length]


def handshake_mac(token: bytes, label: bytes, *nonces: bytes) -> bytes:
    """The handshake's proofs: ``HMAC-SHA256(token, "cfrun-peer/2 " label || nonces)``."""
    return hmac.new(token, b"cfrun-peer/2 " + label + b"".join(nonces), hashlib.sha256).digest()


def session_keys(token: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """``(client->server key, server->client key)`` of one connection (HKDF, 32 bytes each)."""
    okm = hkdf_sha256(token, salt=server_nonce + client_nonce, info=b"cfrun-peer/2 session",
                      length=2 * KEY_BYTES)
    return okm[:KEY_BYTES], okm[KEY_BYTES:]


def manifest_key(token: bytes, job: str) -> bytes:
    """The key with which a job's agents authenticate their seals (HKDF of token and job)."""
    return hkdf_sha256(token, salt=b"", info=b"cfrun-peer/2 manifest " + job.encode(),
                       length=KEY_BYTES)


def seal_tag(key: bytes, *, step: int, world_size: int, rank: int,
             files: list[dict[str, Any]], meta: dict[str, Any] | None) -> str:
    """Hex HMAC-SHA256 of one rank's seal (canonical JSON); ``meta`` counts for rank 0 only.

    Called by the agent when it seals a rank's files, and by :func:`verify_manifest`.
    ``files``: ``[{name, nbytes, xxh3_64}]`` in the order the manifest lists them.
    """
    record = {"v": PROTOCOL_VERSION, "step": step, "world_size": world_size, "rank": rank,
              "files": [{"name": f["name"], "nbytes": f["nbytes"], "xxh3_64": f["xxh3_64"]}
                        for f in files],
              "meta": meta if rank == 0 else None}
    data = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def job_seal_key(job_key: bytes, job: str) -> bytes:
    """The key of a job's own seals under a per-job key (``--job-key-file``: HKDF of the job's
    secret, :mod:`cfrun.contract.jobkey`, and its name): neither the peer nor a level-2 store
    nor another holder of the peer token holds it."""
    return hkdf_sha256(job_key, salt=b"", info=b"cfrun-job-seal/1 " + job.encode(),
                       length=KEY_BYTES)


def token_seal_key(token: bytes, job: str) -> bytes:
    """The key of a job's own seals under the peer token (the default with ``--peer``: HKDF of
    the token and the job's name, ``cfrun-job-seal/2 <job>``). The job's name follows from
    ``--job-name`` or the job dir's path (:func:`cfrun.contract.config.default_job_name`),
    never from the job dir's contents, so a new machine holding the same token file and
    running the same command derives the same key: nothing else has to survive the node.
    Every holder of the token (the peer, another job given the same token) can derive it too:
    the token is the tenant's secret (issue 32)."""
    return hkdf_sha256(token, salt=b"", info=b"cfrun-job-seal/2 " + job.encode(),
                       length=KEY_BYTES)


JOB_KEY_HINT = ("a job moved to a new job dir needs its key: --job-key-file with the old job "
                "dir's job.key")
TOKEN_HINT = ("sealed under another peer token or a per-job key: give the job's own "
              "--peer-token-file, or --job-key-file with the job.key of the job dir that sealed "
              "it")


@dataclass(frozen=True)
class SealKeys:
    """The keys of a job's own seals: ``seal`` seals its checkpoints; a checkpoint from the
    peer or level 2 is installed only when each rank's seal matches one of ``accept`` (the
    seal key first). ``hint`` ends a refusal: what would make the checkpoint installable."""

    seal: bytes
    accept: tuple[bytes, ...]
    hint: str = JOB_KEY_HINT

    @classmethod
    def of_job_key(cls, job_key: bytes, job: str) -> SealKeys:
        """Sealed and checked under the per-job key only (``--job-key-file``, or a job dir's
        ``job.key`` without a peer token)."""
        key = job_seal_key(job_key, job)
        return cls(key, (key,), JOB_KEY_HINT)

    @classmethod
    def of_token(cls, token: bytes, job: str, old_job_key: bytes | None = None) -> SealKeys:
        """Sealed under the peer token (:func:`token_seal_key`); checkpoints sealed by an older
        cfrun under the job dir's ``job.key`` (``old_job_key``) are still installed where that
        key is."""
        key = token_seal_key(token, job)
        old = (job_seal_key(old_job_key, job),) if old_job_key is not None else ()
        return cls(key, (key, *old), TOKEN_HINT)


def job_seal_keys(job_dir: Path, job: str, *, token: bytes | None,
                  per_job_key: bool = False) -> SealKeys:
    """The keys of the job's own seals (issue 32): under the job dir's ``job.key`` alone when
    the job has a key of its own (``per_job_key``: ``--job-key-file``, which the supervisor
    copied there); else under the peer token (``token``, with ``--peer``: a new machine with the
    same token and command derives the same key), also installing seals of the job dir's
    ``job.key`` where an older cfrun left one; else (no peer: level 2 alone) under the job
    dir's ``job.key``.

    Raises:
        BadInputError: the job dir's ``job.key`` is unusable.
    """
    if per_job_key or token is None:
        return SealKeys.of_job_key(ensure_job_key(job_dir), job)
    return SealKeys.of_token(token, job, existing_job_key(job_dir))


def job_seal_tag(key: bytes, *, step: int, world_size: int, rank: int,
                 files: list[dict[str, Any]], meta: dict[str, Any] | None) -> str:
    """Hex HMAC-SHA256 of one rank's part of a checkpoint under its job's seal key
    (:func:`token_seal_key` or :func:`job_seal_key`).

    ``files``: ``[{name, nbytes, sha256}]``, SHA-256 of each file's bytes (xxh3, the manifest's
    checksum against bit rot, is no defence against a writer who chooses the bytes). ``meta``
    (the job id, the command, the script's variables' record) counts for rank 0 only. Called by
    the agent when it seals a rank's files (:class:`cfrun.agent.peertier.PeerTier`) and by
    :func:`verify_job_seals` on the bytes it fetched.
    """
    record = {"v": 1, "step": step, "world_size": world_size, "rank": rank,
              "files": [{"name": f["name"], "nbytes": f["nbytes"], "sha256": f["sha256"]}
                        for f in files],
              "meta": meta if rank == 0 else None}
    data = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def verify_job_seals(key: bytes | SealKeys, manifest: Any, step: int, *, job: str,
                     sha256: dict[str, str]) -> None:
    """Check that every rank's files in ``manifest`` carry this job's seal (``job_tag``) under
    one of its keys (``key``: one key, or :class:`SealKeys`), over the SHA-256 digests
    ``sha256`` (file name -> hex) of the bytes actually fetched. The agent calls it on a
    checkpoint from the peer or level 2 after writing its files to staging and before
    committing them; the files' sizes were bounded by the manifest meanwhile.

    Raises:
        ForeignCheckpointError: a rank's seal does not match over ``sha256`` (written under
            another key: another tenant's token, another job's key, a forger, a moved job
            without its ``--job-key-file``); one line. A subclass of:
        CheckpointCorruptError: not a manifest of ``step``, a rank without a job seal, a file
            of no rank. One line.
    """
    keys = key if isinstance(key, SealKeys) else SealKeys(key, (key,))

    def refuse(why: str, error: type[CheckpointCorruptError] = CheckpointCorruptError
               ) -> CheckpointCorruptError:
        return error(
            f"{job} step {step} is not sealed by this job ({why}); not installed: {keys.hint}")

    if not isinstance(manifest, dict) or manifest.get("step") != step:
        raise refuse("not a manifest of this step")
    world_size, files, seals = (manifest.get("world_size"), manifest.get("files"),
                                manifest.get("seals"))
    if not (is_int(world_size) and 1 <= world_size <= MAX_RANKS and isinstance(files, list)
            and isinstance(seals, list)):
        raise refuse("bad world_size, files or seals")
    by_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world_size)}
    for f in files:
        name = f.get("name") if isinstance(f, dict) else None
        if not (isinstance(name, str) and FILE_RE.match(name) and name in sha256
                and int(name[5:10]) in by_rank):
            raise refuse(f"file entry {name!r} belongs to no rank or was not fetched")
        by_rank[int(name[5:10])].append({"name": name, "nbytes": f.get("nbytes"),
                                         "sha256": sha256[name]})
    tags = {s.get("rank"): s.get("job_tag") for s in seals if isinstance(s, dict)}
    for rank in by_rank:
        tag = tags.get(rank)
        if not isinstance(tag, str):
            raise refuse(f"rank {rank} has no job seal")
        if not any(hmac.compare_digest(tag, job_seal_tag(
                k, step=step, world_size=world_size, rank=rank, files=by_rank[rank],
                meta=manifest.get("meta"))) for k in keys.accept):
            raise refuse(f"rank {rank}'s job seal does not match", ForeignCheckpointError)


def verify_job_seals_before_read(key: bytes | SealKeys, manifest: Any, step: int, *,
                                 job: str) -> dict[str, str]:
    """Check this job's seals over the SHA-256 digests the manifest's seals declare
    (``seals[].sha256``, one per file of the rank, in the manifest's order), before any file
    the manifest names is read; return those digests (file name -> hex), which every file
    fetched must then match (issue 32, finding 4: a level-2 writer made the agent read, hash
    and stage attacker-sized files before a seal was checked). A manifest sealed by an older
    cfrun declares no digests: it cannot be authenticated before its files are read, and is
    refused (a level-2 writer could strip them to reach that path).

    Raises:
        CheckpointCorruptError: declared digests missing or malformed, a seal that does not
            match (:func:`verify_job_seals`); one line.
    """
    keys = key if isinstance(key, SealKeys) else SealKeys(key, (key,))
    if not isinstance(manifest, dict):
        raise CheckpointCorruptError(f"{job} step {step}: not a manifest; not installed")
    files, seals = manifest.get("files"), manifest.get("seals")
    if not isinstance(files, list) or not isinstance(seals, list):
        raise CheckpointCorruptError(f"{job} step {step} is not sealed by this job (no files or "
                                     f"seals); not installed: {keys.hint}")
    by_rank: dict[Any, list[str]] = {}
    for f in files:
        name = f.get("name") if isinstance(f, dict) else None
        if isinstance(name, str) and FILE_RE.match(name):
            by_rank.setdefault(int(name[5:10]), []).append(name)
    declared: dict[str, str] = {}
    for s in seals:
        rank = s.get("rank") if isinstance(s, dict) else None
        digests = s.get("sha256") if isinstance(s, dict) else None
        names = by_rank.get(rank, [])
        if not (isinstance(digests, list) and len(digests) == len(names)
                and all(isinstance(d, str) and _TAG_RE.match(d) for d in digests)):
            raise CheckpointCorruptError(
                f"{job} step {step}: rank {rank}'s seal declares no SHA-256 of its files (sealed "
                "by a cfrun before issue 32, or stripped): it cannot be checked before its files "
                "are read; not installed")
        declared.update(zip(names, digests))
    verify_job_seals(keys, manifest, step, job=job, sha256=declared)
    return declared


def verify_manifest(key: bytes, manifest: Any, step: int, *, job: str) -> None:
    """Check that every rank's files in ``manifest`` carry its agent's seal (agent, on fetch).

    Runs before any checksum of the manifest is trusted; a manifest from peer RAM or from the
    peer's level-2 flush alike.

    Raises:
        CheckpointCorruptError: not a manifest of ``step``, a rank without a seal, or a seal
            that does not match (forged, altered, or written with another token or job).
    """
    def refuse(why: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"manifest of {job} step {step} is not authenticated by this job's agents ({why}); "
            "not installed")

    if not isinstance(manifest, dict):
        raise refuse("not a JSON object")
    world_size, files, seals = (manifest.get("world_size"), manifest.get("files"),
                                manifest.get("seals"))
    if manifest.get("step") != step or not is_int(step):
        raise refuse(f"it names step {manifest.get('step')!r}")
    if not (is_int(world_size) and 1 <= world_size <= MAX_RANKS and isinstance(files, list)):
        raise refuse("bad world_size or files")
    if not isinstance(seals, list) or len(seals) != world_size:
        raise refuse("no seal for every rank")
    by_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world_size)}
    for f in files:
        name = f.get("name") if isinstance(f, dict) else None
        if not (isinstance(name, str) and FILE_RE.match(name)
                and int(name[5:10]) in by_rank):
            raise refuse(f"file entry {name!r} belongs to no rank")
        by_rank[int(name[5:10])].append(f)
    seen = set()
    for s in seals:
        rank, tag = (s.get("rank"), s.get("tag")) if isinstance(s, dict) else (None, None)
        if not (is_int(rank) and rank in by_rank and rank not in seen and isinstance(tag, str)):
            raise refuse("malformed seal list")
        seen.add(rank)
        want = seal_tag(key, step=step, world_size=world_size, rank=rank, files=by_rank[rank],
                        meta=manifest.get("meta"))
        if not hmac.compare_digest(tag, want):
            raise refuse(f"rank {rank}'s seal does not match")


# ---------------------------------------------------------------------- JSON and numbers


def _refuse_constant(name: str) -> Any:
    raise ProtocolError(f"JSON header holds the non-finite number {name}")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ProtocolError(f"JSON header holds the non-finite number {text}")
    return x


def loads_json(raw: bytes | bytearray) -> Any:
    """Parse bounded JSON from the network: ``NaN``/``Infinity``/``1e999`` refused.

    Raises:
        ProtocolError: it does not parse, or holds a non-finite number.
    """
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("frame JSON header does not parse") from None


def dumps_json(obj: Any) -> bytes:
    """Compact JSON; a non-finite number raises ``ValueError`` (never sent)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def is_int(x: Any) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(x, int) and not isinstance(x, bool)


def number(h: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    """``h[key]`` (``default`` if absent) as a finite number within ``lo..hi``.

    Raises:
        ProtocolError: not a number, or outside the range (NaN and infinities included).
    """
    x = h.get(key, default)
    if not (isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            and lo <= x <= hi):
        raise ProtocolError(f"{key} {x!r} is not a number within {lo:g}..{hi:g}")
    return float(x)


# ---------------------------------------------------------------------- sockets and frames


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; with ``deadline`` (monotonic) the whole read must end by then
    (:func:`cfrun.contract.wire.recv_into`).

    Raises:
        PeerError: the connection closed first.
        TimeoutError: the socket's timeout or the deadline passed.
    """
    wire.recv_into(sock, view, deadline, closed=PeerError, chunk_bytes=IO_CHUNK_BYTES)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes (see :func:`recv_into`)."""
    return wire.recv_exact(sock, n, deadline, closed=PeerError, chunk_bytes=IO_CHUNK_BYTES)


class Channel:
    """One authenticated connection after the handshake: frames with a MAC and a sequence number.

    Used by both sides (the server's connection threads, :class:`PeerClient`). Not thread-safe.

    Args:
        sock: the connected socket (blocking, with a timeout).
        send_key, recv_key: this side's direction keys (:func:`session_keys`).
    """

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self.send_key = send_key
        self.recv_key = recv_key
        self.send_seq = 0
        self.recv_seq = 0
        self._tx: tuple[Any, int] | None = None  # the last frame's MAC and payload length
        self._rx: tuple[Any, int] | None = None

    def send_header(self, op: int, header: dict[str, Any], payload_len: int = 0) -> None:
        """Send one frame's header and JSON (tagged); its payload, if any, is
        :meth:`send_payload` (or never, when the other side declined it)."""
        data = dumps_json(header)
        if len(data) > MAX_JSON_BYTES:
            raise ProtocolError(f"JSON header of {len(data)} bytes exceeds {MAX_JSON_BYTES}")
        fixed = FRAME.pack(FRAME_MAGIC, PROTOCOL_VERSION, op, 0, len(data), payload_len)
        mac = hmac.new(self.send_key, SEQ.pack(self.send_seq) + fixed + data, "sha256")
        self.send_seq += 1
        self.sock.sendall(fixed + data + mac.copy().digest())
        self._tx = (mac, payload_len) if payload_len else None

    def send_payload(self, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        """Send the last header's payload (exactly its length), then its tag."""
        if self._tx is None:  # an empty payload is never sent (no tag either)
            if any(len(memoryview(part)) for part in parts):
                raise ProtocolError("no payload is due")
            return
        mac, left = self._tx
        self._tx = None
        for part in parts:
            view = memoryview(part).cast("B")
            for off in range(0, len(view), IO_CHUNK_BYTES):
                chunk = view[off:off + IO_CHUNK_BYTES]
                left -= len(chunk)
                if left < 0:
                    raise ProtocolError("payload longer than its header says")
                mac.update(chunk)
                self.sock.sendall(chunk)
        if left:
            raise ProtocolError("payload shorter than its header says")
        self.sock.sendall(mac.digest())

    def recv_header(self, max_payload: int) -> tuple[int, dict[str, Any], int]:
        """Read one frame's header and JSON and check its tag; the payload stays in the socket.

        Returns:
            ``(op, header, payload_len)``.

        Raises:
            ProtocolError: bad magic/version, a length over its bound, a tag that does not
                match (tampered, injected, replayed, reordered), JSON that does not parse, holds
                a non-finite number or is not an object.
            PeerError: the connection closed.
        """
        fixed = recv_exact(self.sock, FRAME.size)
        magic, version, op, flags, json_len, payload_len = FRAME.unpack(fixed)
        if magic != FRAME_MAGIC or version != PROTOCOL_VERSION or flags:
            raise ProtocolError(f"bad frame header (magic {magic!r}, version {version})")
        if json_len > MAX_JSON_BYTES:
            raise ProtocolError(f"JSON header of {json_len} bytes exceeds {MAX_JSON_BYTES}")
        if payload_len > max_payload:
            raise ProtocolError(f"payload of {payload_len} bytes exceeds {max_payload}")
        raw = recv_exact(self.sock, json_len + MAC_BYTES)
        data, tag = raw[:json_len], raw[json_len:]
        mac = hmac.new(self.recv_key, SEQ.pack(self.recv_seq) + fixed + data, "sha256")
        self.recv_seq += 1
        if not hmac.compare_digest(mac.copy().digest(), tag):
            raise ProtocolError("frame failed authentication (MAC mismatch: tampered, injected "
                                "or replayed on the way, or a relay without the token)")
        header = loads_json(data)
        if not isinstance(header, dict):
            raise ProtocolError("frame JSON header is not an object")
        self._rx = (mac, payload_len) if payload_len else None
        return op, header, payload_len

    def recv_payload_into(self, view: memoryview) -> None:
        """Receive the last header's payload into ``view`` (exactly its length) and check its tag.

        Raises:
            ProtocolError: no payload due, a wrong length, or a tag that does not match.
        """
        if self._rx is None and not len(view):
            return  # an empty payload is never sent
        if self._rx is None or self._rx[1] != len(view):
            raise ProtocolError("payload length differs from its header")
        mac, _ = self._rx
        self._rx = None
        for off in range(0, len(view), IO_CHUNK_BYTES):
            chunk = view[off:off + IO_CHUNK_BYTES]
            recv_into(self.sock, chunk)
            mac.update(chunk)
        if not hmac.compare_digest(mac.digest(), recv_exact(self.sock, MAC_BYTES)):
            raise ProtocolError("payload failed authentication (MAC mismatch: tampered on the "
                                "way, or a relay without the token)")

    def drop_payload(self) -> None:
        """The last frame's payload was declined (PUT refused or already complete): not sent."""
        self._tx = self._rx = None


def client_handshake(sock: socket.socket, token: bytes, who: str,
                     deadline_s: float = HANDSHAKE_DEADLINE_S) -> Channel:
    """Run the client's side of the handshake on a connected ``sock`` (whole of it within
    ``deadline_s``) and return the authenticated channel.

    Raises:
        PeerAuthError: the peer refused our token or could not prove it knows it.
        PeerError: not a cfrun peer of this protocol, busy, closed or too slow.
    """
    deadline = time.monotonic() + deadline_s
    try:
        hello = recv_exact(sock, SERVER_HELLO_BYTES, deadline)
    except PeerError:
        raise HandshakeClosedError(f"{who} closed the connection before its greeting") from None
    except TimeoutError:
        raise PeerError(f"{who} sent no cfrun peer greeting in {deadline_s:g} s") from None
    if hello[:4] != SERVER_HELLO or hello[4] != PROTOCOL_VERSION:
        raise PeerError(f"{who} is not a cfrun peer of protocol {PROTOCOL_VERSION}")
    server_nonce = hello[5:]
    nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(CLIENT_HELLO + bytes([PROTOCOL_VERSION]) + nonce
                 + handshake_mac(token, b"client", server_nonce, nonce))
    try:
        code = recv_exact(sock, 4, deadline)
        if code == AUTH_NO:
            raise PeerAuthError(f"peer {who} refused the token")
        if code == AUTH_BUSY:
            raise PeerError(f"peer {who} is busy (too many connections)")
        proof = recv_exact(sock, MAC_BYTES, deadline) if code == AUTH_OK else b""
    except TimeoutError:
        raise PeerError(f"{who} did not finish the handshake in {deadline_s:g} s") from None
    except PeerAuthError:
        raise
    except PeerError:
        raise HandshakeClosedError(f"{who} closed the connection mid-handshake") from None
    if not hmac.compare_digest(proof, handshake_mac(token, b"server", nonce, server_nonce)):
        raise PeerAuthError(f"peer {who} refused the token, or does not know it")
    client_key, server_key = session_keys(token, server_nonce, nonce)
    return Channel(sock, client_key, server_key)


def fmt_address(addr: Any) -> str:
    """``host:port`` of a socket address."""
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


# ---------------------------------------------------------------------- client


class PeerClient:
    """One authenticated connection to a peer. Not thread-safe: one per thread/stream.

    Used by the persist agent (send shards, await protected/durable, fetch for a resume).

    Raises (every method):
        PeerAuthError: the token does not match the peer's.
        ProtocolError: a frame failed authentication or broke the protocol (closes the stream).
        PeerError: unreachable, closed, refused.
    """

    def __init__(self, address: tuple[str, int], token: bytes, *,
                 connect_timeout_s: float = 3.0, io_timeout_s: float = IO_TIMEOUT_S) -> None:
        self.address = address
        self.who = fmt_address(address)
        self.io_timeout_s = io_timeout_s
        for attempt in range(HANDSHAKE_TRIES):
            last = attempt == HANDSHAKE_TRIES - 1
            try:
                self.sock = socket.create_connection(address, timeout=connect_timeout_s)
            except ConnectionResetError as e:  # reset by the listener (its queue full)
                if last:
                    raise PeerError(f"cannot connect to peer {self.who}: {e}") from None
                continue
            except OSError as e:
                raise PeerError(f"cannot connect to peer {self.who}: {e}") from None
            try:
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.ch = client_handshake(self.sock, token, self.who,
                                           max(connect_timeout_s, HANDSHAKE_DEADLINE_S))
                self.sock.settimeout(io_timeout_s)
                return
            except (HandshakeClosedError, ConnectionResetError, BrokenPipeError) as e:
                # closed or reset before the handshake ended (evicted, restarting): once more
                self.sock.close()
                if last:
                    raise HandshakeClosedError(f"peer {self.who} closed the connection in "
                                               f"the handshake: {e}") from None
            except PeerError:
                self.sock.close()
                raise
            except OSError as e:
                self.sock.close()
                raise PeerError(f"peer {self.who}: {e}") from None

    def close(self) -> None:
        self.sock.close()

    def _reply(self, op: Op, max_payload: int = 0) -> tuple[dict[str, Any], int]:
        rop, reply, n = self.ch.recv_header(max_payload)
        if rop != op | RESPONSE:
            raise ProtocolError(f"unexpected response op {rop} to {op.name}")
        if not reply.get("ok"):
            raise PeerError(f"peer refused {op.name}: {reply.get('error')}")
        return reply, n

    def _request(self, op: Op, header: dict[str, Any], *, timeout_s: float | None = None
                 ) -> dict[str, Any]:
        try:
            self.sock.settimeout(timeout_s or self.io_timeout_s)
            self.ch.send_header(op, header)
            return self._reply(op)[0]
        except PeerError as e:
            if isinstance(e, ProtocolError):
                raise ProtocolError(f"peer {self.who}: {e}") from None
            raise
        except OSError as e:
            raise PeerError(f"peer {self.who}: {e}") from None

    def put(self, *, job: str, step: int, world_size: int, name: str, part: int, nparts: int,
            offset: int, file_bytes: int, data: memoryview | bytes, wait_s: float = 10.0) -> None:
        """Send one byte range of one file (the caller's buffer, not copied).

        ``wait_s``: how long the peer may hold the request while its RAM is full (0..60 s).
        """
        number({"wait_s": wait_s}, "wait_s", 0.0, MAX_RESERVE_WAIT_S, 0.0)
        header = {"job": job, "step": step, "world_size": world_size, "name": name,
                  "part": part, "nparts": nparts, "offset": offset, "file_bytes": file_bytes,
                  "xxh3_64": xxhash.xxh3_64_hexdigest(data), "wait_s": wait_s}
        try:
            self.sock.settimeout(max(self.io_timeout_s, wait_s + 5))
            self.ch.send_header(Op.PUT, header, len(data))
            reply, _ = self._reply(Op.PUT)
            if not reply.get("go"):
                self.ch.drop_payload()
                return
            self.sock.settimeout(self.io_timeout_s)
            self.ch.send_payload([data])
            self._reply(Op.PUT)
        except ProtocolError as e:
            raise ProtocolError(f"peer {self.who}: {e}") from None
        except PeerError:
            raise
        except OSError as e:
            raise PeerError(f"peer {self.who}: {e}") from None

    def seal(self, *, job: str, step: int, world_size: int, rank: int,
             files: list[dict[str, Any]], meta: dict[str, Any], tag: str,
             job_tag: str | None = None, sha256: list[str] | None = None) -> bool:
        """Declare one rank's files complete, with the agent's ``tag`` (:func:`seal_tag`, which
        the peer checks) and ``job_tag`` (:func:`job_seal_tag`, which the peer keeps in the
        manifest for the job's agents: it cannot check it) over ``sha256``, the files' SHA-256
        in ``files``' order, which the peer keeps beside it so that a fetching agent checks
        the job seal before it reads a file (:func:`verify_job_seals_before_read`).

        Returns True once the whole step is protected.
        """
        header = {"job": job, "step": step, "world_size": world_size, "rank": rank,
                  "files": files, "meta": meta, "tag": tag}
        if job_tag is not None:
            header["job_tag"] = job_tag
        if sha256 is not None:
            header["sha256"] = list(sha256)
        reply = self._request(Op.SEAL, header)
        return bool(reply.get("complete"))

    def await_state(self, job: str, step: int, state: str, timeout_s: float) -> dict[str, Any]:
        """Block until the step reaches ``state`` (or times out; 0..3600 s).

        Returns:
            ``{state, flush_to, error}``: the step's state now (``missing`` if not in RAM).
        """
        return self._request(Op.AWAIT, {"job": job, "step": step, "state": state,
                                        "timeout_s": timeout_s}, timeout_s=timeout_s + 30)

    def list(self, job: str) -> dict[str, Any]:
        """``{flush_to, checkpoints: [{step, world_size, state, bytes}]}``, newest first.

        Raises:
            ProtocolError: an entry with a step or state out of range.
        """
        reply = self._request(Op.LIST, {"job": job})
        cks = reply.get("checkpoints")
        if not isinstance(cks, list) or not all(
                isinstance(c, dict) and is_int(c.get("step")) and 0 <= c["step"] <= MAX_STEP
                and c.get("state") in ("filling", "protected", "flushing", "durable")
                for c in cks):
            raise ProtocolError(f"peer {self.who}: malformed LIST reply")
        return reply

    def get(self, job: str, step: int, name: str, max_bytes: int, *,
            exact: bool = False) -> bytearray:
        """One file of a complete checkpoint in peer RAM (``manifest.json`` included).

        ``max_bytes``: the most this fetch accepts (the manifest's size for a file, capped by
        :data:`MAX_FETCH_BYTES`); with ``exact`` the file must have exactly this size.

        Raises:
            ProtocolError: the reply announces more bytes than ``max_bytes`` (or not exactly
                them), or fails authentication.
        """
        if not (is_int(max_bytes) and 0 <= max_bytes <= MAX_FETCH_BYTES):
            raise ValueError(f"max_bytes {max_bytes!r} outside 0..{MAX_FETCH_BYTES}")
        try:
            self.sock.settimeout(self.io_timeout_s)
            self.ch.send_header(Op.GET, {"job": job, "step": step, "name": name,
                                         "max_bytes": max_bytes})
            reply, n = self._reply(Op.GET, max_bytes)
            if reply.get("nbytes") != n or (exact and n != max_bytes):
                raise ProtocolError(f"GET of {name} announces {n} bytes, expected "
                                    f"{max_bytes if exact else reply.get('nbytes')}")
            buf = bytearray(n)
            if n:
                self.ch.recv_payload_into(memoryview(buf))
        except ProtocolError as e:
            raise ProtocolError(f"peer {self.who}: {e}") from None
        except PeerError:
            raise
        except OSError as e:
            raise PeerError(f"peer {self.who}: {e}") from None
        return buf


def check_get_name(name: Any) -> bool:
    """A name GET may ask for: the manifest or a shard file (never a path)."""
    return isinstance(name, str) and (name == MANIFEST or bool(FILE_RE.match(name)))


def check_tag(tag: Any) -> TypeGuard[str]:
    """A seal tag as sent: 64 lowercase hex digits."""
    return isinstance(tag, str) and bool(_TAG_RE.match(tag))

