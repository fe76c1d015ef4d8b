"""Tenants of one peer (issue 32): the token directory, the handshake, the namespaces, the slots.

A real ``PeerServer`` in this process, real sockets, real level-2 files. The attacks with real
processes (another tenant against a job that loses its node) are in
tests/integration/test_peer.py.
"""

from __future__ import annotations

import secrets
import socket
import threading
from pathlib import Path

import pytest
import xxhash

from cfrun.contract.errors import BadInputError
from cfrun.peer.gate import Gate
from cfrun.peer.protocol import (
    PeerAuthError,
    PeerClient,
    PeerError,
    handshake_mac,
    manifest_key,
    seal_tag,
)
from cfrun.peer.server import PeerServer
from cfrun.peer.tenants import (
    DEFAULT_TENANT,
    MAX_TENANTS,
    Tenant,
    read_tenants,
    slot_shares,
    split_key,
)
from cfrun.storage.tiers import LinkRefusedError, below, open_storage

A, B = b"a" * 32, b"b" * 32


def _token(path: Path, token: bytes | None = None) -> Path:
    path.write_bytes((token or secrets.token_hex(32).encode()) + b"\n")
    path.chmod(0o600)
    return path


def _dir(tmp_path: Path, *names: str) -> Path:
    d = tmp_path / "tokens"
    d.mkdir(mode=0o700)
    for name in names:
        _token(d / name)
    return d


# ---------------------------------------------------------------------- the token directory


def test_a_token_file_is_the_default_tenant_and_a_directory_one_tenant_per_file(tmp_path):
    [t] = read_tenants(str(_token(tmp_path / "token", A)))
    assert (t.name, t.token, t.level2_below, t.key("j")) == (DEFAULT_TENANT, A, (), "j")
    d = _dir(tmp_path, "team-b", "acme.token", "default")
    tenants = read_tenants(str(d))
    assert [t.name for t in tenants] == ["acme.token", "default", "team-b"]
    acme = tenants[0]
    assert acme.token == (d / "acme.token").read_bytes().strip()
    assert acme.level2_below == ("_tenants", "acme.token")
    assert acme.key("j") == "acme.token/j" and split_key(acme.key("j")) == ("acme.token", "j")
    assert tenants[1].key("j") == "j" and split_key("j") == (DEFAULT_TENANT, "j")
    assert "token=" not in repr(acme) and acme.token.decode() not in repr(acme)


def _refusal(path: Path) -> str:
    with pytest.raises(BadInputError) as e:
        read_tenants(str(path))
    msg = str(e.value)
    assert "\n" not in msg and BadInputError.exit_code == 2
    return msg


def test_the_token_directory_refuses_links_modes_bad_names_and_shared_tokens(tmp_path):
    d = _dir(tmp_path, "a", "b")
    (d / "evil").symlink_to(d / "a")  # a link in the directory: never followed
    assert "is a symbolic link" in _refusal(d)
    (d / "evil").unlink()
    (d / "b").chmod(0o644)
    assert "tokens/b' has mode 0644" in _refusal(d) and "chmod 600" in _refusal(d)
    (d / "b").chmod(0o640)
    assert "tokens/b' has mode 0640" in _refusal(d)
    (d / "b").chmod(0o600)
    for bad in (".hidden", "-x", "a b", "x" * 65, "é"):
        _token(d / bad)
        assert "cannot name a tenant" in _refusal(d), bad
        (d / bad).unlink()
    (d / "sub").mkdir()
    assert "not a regular file" in _refusal(d)
    (d / "sub").rmdir()
    _token(d / "twin", (d / "a").read_bytes().strip())
    assert "'a' and 'twin' hold the same token" in _refusal(d)
    (d / "twin").unlink()
    (d / "short").write_text("x" * 10)
    (d / "short").chmod(0o600)
    assert "too short" in _refusal(d)
    (d / "short").unlink()
    d.chmod(0o750)  # others could read the tokens' names or, 0770, add a tenant
    assert "chmod 700" in _refusal(d)
    d.chmod(0o700)
    assert [t.name for t in read_tenants(str(d))] == ["a", "b"]


def test_the_token_directory_itself_a_link_empty_or_too_full_is_refused(tmp_path):
    d = _dir(tmp_path, "a")
    link = tmp_path / "link"
    link.symlink_to(d)
    assert "is a symbolic link" in _refusal(link)
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    assert "holds no token files" in _refusal(empty)
    for i in range(MAX_TENANTS):
        _token(d / f"t{i}")
    assert f"at most {MAX_TENANTS} tenants" in _refusal(d)


def test_slots_are_shared_out_as_rings_of_their_own():
    assert slot_shares(2, [DEFAULT_TENANT]) == {DEFAULT_TENANT: 2}
    assert slot_shares(5, ["b", "a"]) == {"a": 3, "b": 2}
    with pytest.raises(BadInputError, match="--slots 2 is fewer than the 3 tenants"):
        slot_shares(2, ["a", "b", "c"])


def test_the_gate_finds_the_tenant_by_trying_every_key():
    tenants = [Tenant("a", A), Tenant("b", B)]
    with socket.create_server(("127.0.0.1", 0)) as sock:
        gate = Gate(sock, tenants, lambda *_: True)
        sn, cn = secrets.token_bytes(32), secrets.token_bytes(32)
        assert gate._tenant_of(handshake_mac(B, b"client", sn, cn), sn, cn) is tenants[1]
        assert gate._tenant_of(handshake_mac(A, b"client", sn, cn), sn, cn) is tenants[0]
        assert gate._tenant_of(handshake_mac(b"c" * 32, b"client", sn, cn), sn, cn) is None
        assert gate._tenant_of(handshake_mac(A, b"client", cn, sn), sn, cn) is None
        gate.close()
    with pytest.raises(ValueError, match="1 to 64"):
        Gate(socket.socket(), [], lambda *_: True)


# ---------------------------------------------------------------------- namespaces


@pytest.fixture
def peer(tmp_path):
    """Tenants ``default`` (token A) and ``b`` (token B), 4 slots: 2 each."""
    srv = PeerServer(("127.0.0.1", 0), open_storage(str(tmp_path / "l2")),
                     [Tenant(DEFAULT_TENANT, A), Tenant("b", B)], slots=4,
                     max_checkpoint_bytes=1 << 20, keep=2)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(10)


def _send(c: PeerClient, token: bytes, job: str, step: int, data: bytes, *,
          seal: bool = True, wait_s: float = 10.0) -> bool:
    c.put(job=job, step=step, world_size=1, name="rank-00000.bin", part=0, nparts=1 + (not seal),
          offset=0, file_bytes=len(data) * (1 + (not seal)), data=data, wait_s=wait_s)
    if not seal:
        return False
    files = [{"name": "rank-00000.bin", "nbytes": len(data),
              "xxh3_64": xxhash.xxh3_64_hexdigest(data)}]
    meta = {"step": step}
    tag = seal_tag(manifest_key(token, job), step=step, world_size=1, rank=0, files=files,
                   meta=meta)
    return c.seal(job=job, step=step, world_size=1, rank=0, meta=meta, files=files, tag=tag)


def test_a_tenant_sees_writes_and_flushes_only_its_own_jobs(peer, tmp_path):
    a, b = PeerClient(peer.address, A), PeerClient(peer.address, B)
    assert _send(a, A, "j", 10, b"A" * 1000)
    assert a.await_state("j", 10, "durable", 10)["state"] == "durable"
    assert b.list("j")["checkpoints"] == []  # the same job name, another tenant: nothing
    assert b.await_state("j", 10, "durable", 0)["state"] == "missing"
    with pytest.raises(PeerError, match="not complete in peer RAM"):
        b.get("j", 10, "rank-00000.bin", 1 << 20)
    # b writes "j" step 20: its own job j, which a never sees, flushed to b's own directory
    assert _send(b, B, "j", 20, b"B" * 1000)
    assert b.await_state("j", 20, "durable", 10)["state"] == "durable"
    assert [c["step"] for c in a.list("j")["checkpoints"]] == [10]
    assert [c["step"] for c in b.list("j")["checkpoints"]] == [20]
    assert bytes(a.get("j", 10, "rank-00000.bin", 1 << 20)) == b"A" * 1000
    l2 = tmp_path / "l2"
    assert a.list("j")["flush_to"] == str(l2)  # the default tenant: today's layout
    assert b.list("j")["flush_to"] == str(l2 / "_tenants" / "b")
    assert open_storage(str(l2)).list_steps("j") == [10]
    assert open_storage(str(l2 / "_tenants" / "b")).list_steps("j") == [20]
    # a seal under the other tenant's token is refused: the peer checks it with b's
    b.put(job="k", step=1, world_size=1, name="rank-00000.bin", part=0, nparts=1, offset=0,
          file_bytes=3, data=b"xyz")
    files = [{"name": "rank-00000.bin", "nbytes": 3, "xxh3_64": xxhash.xxh3_64_hexdigest(b"xyz")}]
    with pytest.raises(PeerError, match="does not match"):
        b.seal(job="k", step=1, world_size=1, rank=0, meta={}, files=files,
               tag=seal_tag(manifest_key(A, "k"), step=1, world_size=1, rank=0, files=files,
                            meta={}))
    with pytest.raises(PeerAuthError):
        PeerClient(peer.address, b"c" * 32)


def test_a_tenant_filling_its_slots_neither_evicts_nor_crowds_out_another(peer):
    a, b = PeerClient(peer.address, A), PeerClient(peer.address, B)
    assert _send(a, A, "j", 1, b"A" * 1000)
    assert a.await_state("j", 1, "durable", 10)["state"] == "durable"
    for step in range(1, 6):  # flushed checkpoints of b: its own ring recycles them
        assert _send(b, B, f"f{step}", step, b"B" * 1000)
        assert b.await_state(f"f{step}", step, "durable", 10)["state"] == "durable"
    for job in ("g1", "g2"):  # then b holds both its slots with partial checkpoints
        _send(b, B, job, 1, b"B" * 1000, seal=False)
    with pytest.raises(PeerError, match="all 2 slots"):
        _send(b, B, "g3", 1, b"B" * 1000, wait_s=0)
    assert [c["step"] for c in a.list("j")["checkpoints"]] == [1]  # never evicted
    assert _send(a, A, "j", 2, b"A" * 1000, wait_s=0)  # a's own slot, no wait
    assert a.await_state("j", 2, "durable", 10)["state"] == "durable"


def test_a_link_at_the_tenants_directory_is_never_followed(tmp_path):
    l2 = tmp_path / "l2"
    l2.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (l2 / "_tenants").symlink_to(elsewhere)
    store = below(open_storage(str(l2)), "_tenants", "b")
    with pytest.raises(LinkRefusedError, match="_tenants is a symbolic link"):
        store.begin("j", 1)
    with pytest.raises(LinkRefusedError):
        store.list_steps("j")
    assert list(elsewhere.iterdir()) == []
    with pytest.raises(ValueError):
        below(open_storage(str(l2)), "..")
    assert below(open_storage(f"file://{l2}"), "_tenants", "b").url == f"file://{l2}/_tenants/b"
