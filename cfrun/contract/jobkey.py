"""The job's own secret when it has a key of its own: ``--job-key-file`` or ``job.key``.

A checkpoint that comes back from outside the job dir (the peer's RAM, a level-2 store written
by the peer's flush) is installed only when every rank's part carries this job's seal: an
HMAC-SHA256 over the rank's files, their sizes and SHA-256 digests and the checkpoint's meta
(:mod:`cfrun.peer.protocol`, ``job_seal_tag``) under the job's seal key, which a writer of the
level-2 store (the bucket, the NFS directory) does not hold (issue 24, item 2).

By default, with ``--peer``, the seal key derives from the peer token and the job's name
(:func:`cfrun.peer.protocol.token_seal_key`): a new machine holding the same token file and
running the same command resumes from the peer or level 2 with nothing else (issue 32). Every
holder of that token (the peer, another job given it) can then seal for the job too.

With ``--job-key-file F`` (``CFRUN_JOB_KEY_FILE``) the seal key derives from that per-job key
instead (:func:`cfrun.peer.protocol.job_seal_key`), and token-derived seals are refused: not
even the peer or another holder of the token can make a checkpoint the job installs (issue 24,
item 4). The key is then copied into the job dir (``job.key``, 0600, created exclusively and
never through a link) and must be given again on a machine without the job dir, beside the
peer token or as a Kubernetes Secret. A job with a level-2 store and no peer (``--persist-to``
alone) seals nothing and checks seals under ``job.key``, made with the job. A ``job.key`` left
in the job dir by an older cfrun keeps its checkpoints installable where it is.

Every job dir has a ``job.key`` (made by the supervisor before the agent starts, random unless
``--job-key-file`` gives it): the MAC of each manifest in ``checkpoints/`` derives from it
(:class:`cfrun.contract.manifest.ManifestKeys`, issue 32, finding 4). Nothing has to carry it
to a new machine: a new job dir makes its own, and checkpoints come back from the peer or level
2 under the seals above. Torch-free.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from cfrun.contract.errors import BadInputError
from cfrun.contract.fsio import UnsafeFileError, open_new, read_regular

JOB_KEY_FILE = "job.key"
KEY_HEX_CHARS = 64
"""A job key as written: 32 random bytes in hex."""


def read_key_file(path: Path | str, *, option: str = "--job-key-file") -> bytes:
    """The key in ``path``: a regular file of ours (not a link), no group or other bits, 64 hex
    digits (surrounding whitespace ignored).

    Raises:
        BadInputError: missing, a link, someone else's, readable by others, or not a key; one
            line naming the file and the fix.
    """
    try:
        raw = bytes(read_regular(path, max_bytes=4096))
        st = os.lstat(path)
    except (UnsafeFileError, OSError) as e:
        raise BadInputError(f"{option} {str(path)!r} cannot be read ({e}); give the job's "
                            f"{JOB_KEY_FILE} (a regular file of yours, `chmod 600`)") from None
    if st.st_uid != os.getuid():
        raise BadInputError(f"{option} {str(path)!r} is owned by uid {st.st_uid}, not by you; "
                            "copy it and `chmod 600` the copy")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise BadInputError(f"{option} {str(path)!r} is readable by other users; run "
                            f"`chmod 600 {path}`")
    key = raw.strip()
    try:
        bytes.fromhex(key.decode("ascii"))
        ok = len(key) == KEY_HEX_CHARS
    except (UnicodeDecodeError, ValueError):
        ok = False
    if not ok:
        raise BadInputError(f"{option} {str(path)!r} holds no job key (64 hex digits); give the "
                            f"{JOB_KEY_FILE} of the job's first job dir")
    return key


def ensure_job_key(job_dir: Path | str, given: Path | str | None = None) -> bytes:
    """The job's key, from ``<job_dir>/job.key``; made there first if the job dir has none
    (from ``given``, the user's ``--job-key-file``, else 32 fresh random bytes). Called by the
    supervisor before it starts the agent, and by the agent (a job dir of an older cfrun).
    Two nodes that make it at once keep one (``O_EXCL``).

    Raises:
        BadInputError: ``given`` is unusable, or differs from the job dir's key (this job dir
            belongs to another job: give its own key or another --job-dir).
    """
    path = Path(job_dir) / JOB_KEY_FILE
    want = read_key_file(given) if given is not None else None
    if not os.path.lexists(path):
        try:
            fd = open_new(path)
        except FileExistsError:
            pass  # another node made it first: read theirs
        else:
            try:
                os.write(fd, (want or secrets.token_hex(32).encode()) + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
    key = read_key_file(path, option="the job key")
    if want is not None and not secrets.compare_digest(want, key):
        raise BadInputError(f"--job-key-file {str(given)!r} differs from {str(path)!r}: the job "
                            "dir holds another job's key; give that job's key, or a new "
                            "--job-dir")
    return key


def existing_job_key(job_dir: Path | str) -> bytes | None:
    """The key in ``<job_dir>/job.key`` if the job dir holds one (an older cfrun made it with
    the job, or ``--job-key-file`` put it there), else None; never made here.

    Raises:
        BadInputError: it exists but is unusable (a link, someone else's, readable by others,
            not a key); one line naming it and the fix.
    """
    path = Path(job_dir) / JOB_KEY_FILE
    if not os.path.lexists(path):
        return None
    return read_key_file(path, option="the job key")
