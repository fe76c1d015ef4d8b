"""The agent's messages as typed records (cfrun.contract.messages), in process, and the shared
socket read (cfrun.contract.wire) and backoff (cfrun.contract.retry) over real sockets."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from cfrun.contract import ipc, messages, retry, wire
from cfrun.contract.messages import (
    Hello,
    MessageError,
    Persisted,
    PersistFailed,
    PersistRequest,
    Ready,
    parse_reply,
    parse_request,
)
from cfrun.peer.protocol import PeerError, recv_exact

DOC = {"format_version": 1, "rank": 0, "tree": {"best": float("inf")},
       "tensors": [{"offset": 0, "nbytes": 4096}], "meta": {"step": 5, "mode": "async"}}
REQUEST = PersistRequest(5, 0, 2, "/dev/shm/cfrun-x_y/rank00000-1-a.slot", 4096, DOC, 1.7e9)
RECORDS = [Hello(3), REQUEST, PersistRequest(0, 1, 2, "/s", 1, {}),
           Ready(-1), Ready(7), Persisted(5, 8192, "local", 0.25, 0.5, 32768),
           Persisted(6, 1, "peer", 0.0, 0.0, 0), PersistFailed(5, "refused: nbytes 0"),
           PersistFailed(None, "refused: step '5' is not an integer")]


def _wire(obj: dict) -> dict:
    """What the other end gets: through JSON, as ipc.send/recv carry it (NaN allowed, as
    json.loads allows it)."""
    return json.loads(json.dumps(obj))


@pytest.mark.parametrize("rec", RECORDS, ids=lambda r: type(r).__name__)
def test_every_op_round_trips(rec):
    obj = _wire(rec.to_json())
    parse = parse_request if isinstance(rec, (Hello, PersistRequest)) else parse_reply
    assert parse(obj) == rec
    assert type(rec).parse(obj) == rec


def test_persist_request_round_trips_over_the_agent_socket():
    a, b = socket.socketpair()
    with a, b:
        ipc.send(a, REQUEST.to_json())
        assert parse_request(ipc.recv(b)) == REQUEST
    assert REQUEST.commit_meta() == {"step": 5, "mode": "async", "epoch": None,
                                     "batches": None, "not_exact": None}
    assert REQUEST.trigger_or(1.0) == 1.7e9
    assert PersistRequest(5, 0, 1, "/s", 1, {}).trigger_or(1.0) == 1.0


def _refused(obj, parse=parse_request) -> str:
    with pytest.raises(MessageError) as e:
        parse(obj)
    text = str(e.value)
    assert "\n" not in text and text
    return text


@pytest.mark.parametrize(("change", "says"), [
    ({"extra": 1}, "unknown field(s) 'extra' in a 'persist' message"),
    ({"step": "5"}, "step '5' is not an integer"),
    ({"step": True}, "step True is not an integer"),
    ({"step": 5.0}, "step 5.0 is not an integer"),
    ({"step": -1}, "step -1 is outside 0..1000000000000"),
    ({"step": 10**12 + 1}, "step 1000000000001 is outside"),
    ({"rank": 2}, "rank 2 is outside 0..1"),
    ({"rank": 5, "world_size": 5}, "rank 5 is outside 0..4"),
    ({"world_size": 0}, "world_size 0 is outside"),
    ({"nbytes": 0}, "nbytes 0 is not a positive byte count"),
    ({"nbytes": -4096}, "nbytes -4096 is not a positive byte count"),
    ({"nbytes": 2**60}, "nbytes 1152921504606846976 is outside"),
    ({"slot": 7}, "slot 7 is not a string"),
    ({"slot": "/a\0b"}, "holds a NUL"),
    ({"doc": []}, "doc list is not a JSON object"),
    ({"doc": {"tree": {}, "payload": "x"}}, "unknown field(s) 'payload' in doc"),
    ({"doc": {"meta": [1]}}, "doc.meta list is not a JSON object"),
    ({"t_trigger_unix_s": float("nan")}, "t_trigger_unix_s nan is not a finite number"),
    ({"t_trigger_unix_s": float("inf")}, "t_trigger_unix_s inf is not a finite number"),
    ({"t_trigger_unix_s": -1.0}, "t_trigger_unix_s -1.0 is outside"),
    ({"t_trigger_unix_s": "now"}, "t_trigger_unix_s 'now' is not a number"),
    ({"op": "persit"}, "unknown op 'persit'"),
])
def test_persist_request_refuses_bad_fields_in_one_line(change, says):
    obj = _wire({**REQUEST.to_json(), **change})
    assert says in _refused(obj)


def test_nan_from_the_wire_is_refused():
    """json.loads (ipc.recv) accepts NaN and 1e999; the record does not."""
    raw = json.dumps(REQUEST.to_json()).replace("1700000000.0", "NaN")
    assert "finite" in _refused(json.loads(raw))
    raw = json.dumps(REQUEST.to_json()).replace("1700000000.0", "1e999")
    assert "finite" in _refused(json.loads(raw))


def test_missing_fields_and_non_objects_are_refused():
    obj = REQUEST.to_json()
    del obj["slot"]
    assert "lacks 'slot'" in _refused(obj)
    assert "unknown op None" in _refused([1, 2])
    assert "must be a JSON object" in _refused("x", PersistRequest.parse)
    assert "rank -1 is outside" in _refused({"op": "hello", "rank": -1})
    assert "unknown field(s) 'step'" in _refused({"op": "hello", "rank": 0, "step": 1})


def test_replies_are_checked_too():
    ok = Persisted(5, 8192, "local", 0.25, 0.5, 32768).to_json()
    assert "tier 'disk'" in _refused({**ok, "tier": "disk"}, parse_reply)
    assert "pgt_s nan is not a finite number" in _refused({**ok, "pgt_s": float("nan")},
                                                          parse_reply)
    assert "last_committed -2 is outside" in _refused({"op": "ready", "last_committed": -2},
                                                      parse_reply)
    assert "unknown field(s) 'bytes'" in _refused(
        {**PersistFailed(1, "x").to_json(), "bytes": 1}, parse_reply)
    assert PersistFailed.step_of({"step": 9}) == 9
    assert PersistFailed.step_of({"step": -1}) is None
    assert PersistFailed.step_of({"step": "9"}) is None
    assert PersistFailed.step_of("junk") is None


def test_records_are_checked_when_built():
    """The rank builds its hand-off with PersistRequest(...): a bad value fails there, not at
    the agent."""
    with pytest.raises(MessageError, match="rank 2 is outside 0..1"):
        PersistRequest(5, 2, 2, "/s", 1, {})
    with pytest.raises(MessageError, match="step -3"):
        Persisted(-3, 0, "local", 0.0, 0.0, 0)
    assert messages.MAX_STEP == 10**12


# ---------------------------------------------------------------------- wire and retry


def test_recv_exact_raises_the_callers_error_when_the_peer_closes():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"abc")
        a.shutdown(socket.SHUT_WR)
        assert wire.recv_exact(b, 2) == b"ab"
        with pytest.raises(ConnectionError) as e:
            wire.recv_exact(b, 2)
        assert type(e.value) is ConnectionError
    a, b = socket.socketpair()
    with a, b:
        a.close()
        with pytest.raises(PeerError):  # the peer tier's own type, through its wrapper
            recv_exact(b, 4)


def test_recv_exact_reads_across_chunks_and_keeps_its_deadline():
    a, b = socket.socketpair()
    with a, b:
        data = bytes(range(256)) * 64
        t = threading.Thread(target=lambda: [a.sendall(data[i:i + 1000]) or time.sleep(0.001)
                                             for i in range(0, len(data), 1000)])
        t.start()
        assert wire.recv_exact(b, len(data), chunk_bytes=777) == data
        t.join()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            wire.recv_exact(b, 1, time.monotonic() + 0.2)
        assert time.monotonic() - t0 < 5


def test_one_backoff_for_the_supervisor_and_the_peer_tier():
    from cfrun.agent import peertier
    from cfrun.supervisor import machine

    assert machine.backoff_delay_s is retry.backoff_delay_s
    assert [retry.backoff_delay_s(0.5, n) for n in (1, 2, 3, 7, 8, 60, 10**6)] == \
        [0.5, 1.0, 2.0, 30.0, 30.0, 30.0, 30.0]
    tier = peertier.PeerTier(("127.0.0.1", 9), b"k" * 32, "job", streams=1,
                             emit=lambda *a, **k: None, job_key=b"1" * 64)
    for failures in range(1, 10):  # the peer's n-th consecutive failure waits as long
        t0 = time.monotonic()
        tier.mark_down("down")
        assert tier.failures == failures
        wait_s = tier.next_try - t0
        assert retry.backoff_delay_s(peertier.PEER_BACKOFF_S, failures) <= wait_s <= \
            retry.backoff_delay_s(peertier.PEER_BACKOFF_S, failures) + 1.0
    tier.pool.shutdown()
