"""Tenants of one ``cfrun peer``: one token each, each its own namespace (issue 32).

ACUTE (IEEE Access'24, §IV-A) puts one reliable peer beside many spot VMs; the VMs of teams or
projects that must not trust each other share that peer only as *tenants*. ``--token-file PATH``
names either one token file (one tenant, :data:`DEFAULT_TENANT`) or a directory of token files,
one per tenant, the file's name being the tenant's name (:func:`read_tenants`). The server
(:mod:`cfrun.peer.server`) learns a connection's tenant from the token its handshake proved
(:mod:`cfrun.peer.gate`, every tenant's key tried, constant work whichever matched), and then
names every job of that connection inside the tenant's namespace:

* **RAM**: each tenant has a ring of slots of its own (:func:`slot_shares`), a
  :class:`~cfrun.peer.buffer.RamBuffer` keyed by :meth:`Tenant.key`; one tenant can neither
  list, read, seal, await nor evict another's checkpoints, nor take its slots.
* **Level 2**: the default tenant keeps the layout of a single-token peer,
  ``<flush>/<job>/step-N`` (existing data and its seals stay valid); every other tenant writes
  ``<flush>/_tenants/<tenant>/<job>/step-N`` (:data:`TENANTS_DIR`). A job name starts with a
  letter or digit (:func:`cfrun.storage.tiers.check_job_name`), so ``_tenants`` is no job of the
  default tenant, and a tenant's name is a single path component below it: no name of one
  tenant can reach another's directory.
* **Seals**: the agents key their seals with their tenant's token and the job's name
  (:func:`cfrun.peer.protocol.token_seal_key`), so a checkpoint sealed by another tenant is
  refused at install even if it were placed under this job's name.

Called by ``serve_main`` in the ``cfrun peer`` process only. Torch-free.
"""

from __future__ import annotations

import errno
import hmac
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from cfrun.contract.errors import BadInputError
from cfrun.peer.protocol import read_token

DEFAULT_TENANT = "default"
"""The tenant of a single token file, and the directory entry that keeps its layout."""
TENANTS_DIR = "_tenants"
"""Level 2 of the other tenants: ``<flush>/_tenants/<tenant>/<job>``."""
MAX_TENANTS = 64
"""Token files in a directory at most: the handshake tries every tenant's key (an HMAC each,
~2 us), so this bounds what an unauthenticated connection costs the peer."""
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Tenant:
    """One tenant of a peer: its name and token (never printed)."""

    name: str
    token: bytes = field(repr=False)

    @property
    def level2_below(self) -> tuple[str, ...]:
        """Directories between ``--flush-to`` and this tenant's jobs
        (:func:`cfrun.storage.tiers.below`): none for :data:`DEFAULT_TENANT`."""
        return () if self.name == DEFAULT_TENANT else (TENANTS_DIR, self.name)

    def key(self, job: str) -> str:
        """The name under which ``job`` (as its agents name it) is kept in this tenant's ring
        and logged: the job's name for :data:`DEFAULT_TENANT`, ``<tenant>/<job>`` otherwise.
        Neither a job name nor a tenant name holds a ``/``, so :func:`split_key` inverts it."""
        return job if self.name == DEFAULT_TENANT else f"{self.name}/{job}"


def split_key(key: str) -> tuple[str, str]:
    """``(tenant, job)`` of a :meth:`Tenant.key` (the flusher's way back to level 2)."""
    tenant, sep, job = key.partition("/")
    return (tenant, job) if sep else (DEFAULT_TENANT, key)


def check_tenant_name(name: str, where: str) -> str:
    """``name`` if it may name a tenant: 1 to 64 of ``[A-Za-z0-9._-]``, a letter or digit
    first, no ``..``.

    Raises:
        BadInputError: anything else (``where`` names the file in the one-line message).
    """
    if not TENANT_RE.match(name) or ".." in name:
        raise BadInputError(f"--token-file {where!r}: {name!r} cannot name a tenant (1 to 64 "
                            "of A-Z a-z 0-9 . _ -, a letter or digit first, no '..'): rename "
                            "it, or move it out of the directory")
    return name


def read_tenants(path: str, *, option: str = "--token-file") -> list[Tenant]:
    """The tenants of ``cfrun peer --token-file PATH``, sorted by name.

    ``path`` a token file (:func:`cfrun.peer.protocol.read_token`): one tenant,
    :data:`DEFAULT_TENANT`. ``path`` a directory: one tenant per file in it, named by the file
    (:func:`check_tenant_name`); the directory must be the peer user's, not a link, with no
    group or other permission bits (``chmod 700``), hold 1 to :data:`MAX_TENANTS` entries, each
    a token file as ``read_token`` demands (a regular 0600 file of the peer's user, opened
    relative to the directory without following a link), and no two tenants may share a token
    (a handshake would not tell them apart).

    Raises:
        BadInputError: any of the above, in one line naming the file and the fix (exit 2).
    """
    p = Path(path).expanduser()
    try:
        st = os.lstat(p)
    except OSError:
        st = None
    if st is None or not stat.S_ISDIR(st.st_mode):
        return [Tenant(DEFAULT_TENANT, read_token(path, option=option))]
    try:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        why = "was swapped for a link" if e.errno in (errno.ELOOP, errno.ENOTDIR) \
            else e.strerror
        raise BadInputError(f"{option} {path!r} cannot be opened as a directory ({why})") \
            from None
    try:
        _check_dir(fd, path, option)
        names = sorted(os.listdir(fd))
        if not names:
            raise BadInputError(f"{option} {path!r} holds no token files; add one per tenant: "
                                f"`openssl rand -hex 32 > {path}/NAME && chmod 600 "
                                f"{path}/NAME`")
        if len(names) > MAX_TENANTS:
            raise BadInputError(f"{option} {path!r} holds {len(names)} entries; a peer serves "
                                f"at most {MAX_TENANTS} tenants: run another peer for the rest")
        tenants = [Tenant(check_tenant_name(name, f"{path}/{name}"),
                          read_token(f"{path}/{name}", option=option, dir_fd=fd))
                   for name in names]
    finally:
        os.close(fd)
    for i, a in enumerate(tenants):
        for b in tenants[i + 1:]:
            if hmac.compare_digest(a.token, b.token):
                raise BadInputError(f"{option} {path!r}: tenants {a.name!r} and {b.name!r} "
                                    "hold the same token; give each its own "
                                    "(`openssl rand -hex 32`)")
    return tenants


def _check_dir(fd: int, path: str, option: str) -> None:
    """The token directory is the peer user's and closed to everyone else."""
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        raise BadInputError(f"{option} {path!r} is owned by uid {st.st_uid}, not by you "
                            f"(uid {os.getuid()}); use a directory of your own, "
                            f"`chmod 700 {path}`")
    if st.st_mode & 0o077:
        raise BadInputError(f"{option} {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: "
                            "other users could read or add tenants; run "
                            f"`chmod 700 {path}`")


def slot_shares(slots: int, names: list[str]) -> dict[str, int]:
    """How ``slots`` are shared: each tenant gets a ring of its own of ``slots // n`` slots,
    the first ``slots % n`` tenants by name one more. A fixed share (a cap with nothing
    borrowed) is the simple rule that makes filling slots useless against another tenant: a
    tenant's new step can only ever take or evict a slot of its own ring, and the peer's RAM
    stays within ``slots x max_checkpoint_bytes``. The cost: a busy tenant cannot use an idle
    tenant's slots (give the peer more ``--slots``).

    Raises:
        BadInputError: fewer slots than tenants.
    """
    n = len(names)
    if slots < n:
        raise BadInputError(f"--slots {slots} is fewer than the {n} tenants of --token-file: "
                            f"each tenant needs a slot of its own; give --slots {n} or more")
    return {name: slots // n + (i < slots % n) for i, name in enumerate(sorted(names))}
