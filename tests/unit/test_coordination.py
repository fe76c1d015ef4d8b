"""The coordination files (contract.coordination) and the events table (contract.events).

Real files in a temporary job dir; a malformed file must never be trusted, and every event kind
cfrun writes must be declared (and listed in the manual: README.md and docs/).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from conftest import manual_text

from cfrun.contract import coordination as co
from cfrun.contract import events
from cfrun.contract.jobdir import JobDir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("record", [
    co.StopRequest(deadline_unix_s=1.7e9, signal="SIGTERM"),
    co.StopStep(12),
    co.StopDecision(step=12, decision="take", need_s=0.25),
    co.StopDecision(step=0, decision="none"),
    co.Fatal(message="checkpoint step 4 does not fit", attempt=2, rank=1),
    co.RankError(type="RuntimeError", message="boom", step=3, t_unix_s=1.7e9,
                 traceback=["Traceback\n", "RuntimeError: boom\n"]),
    co.EndedMark(clean=True, step=40),
    co.PreemptedMark(step=9, final_checkpoint=8),
])
def test_every_record_round_trips_through_its_file(tmp_path, record):
    path = tmp_path / "sub" / "record.json"
    co.write(path, record, make_dir=True)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert co.read(path, type(record)) == record


@pytest.mark.parametrize("cls, doc, fault", [
    (co.StopRequest, {"deadline_unix_s": "soon", "signal": "SIGTERM"}, "not time"),
    (co.StopRequest, {"deadline_unix_s": math.inf, "signal": "SIGTERM"}, "finite"),
    (co.StopRequest, {"deadline_unix_s": 1.0}, "lacks fields"),
    (co.StopStep, {"step": -1}, ">= 0"),
    (co.StopStep, {"step": True}, "not step"),
    (co.StopStep, {"step": 3, "extra": 1}, "unknown fields"),
    (co.StopDecision, {"step": 3, "decision": "maybe"}, "not one of"),
    (co.Fatal, ["not", "an", "object"], "JSON object"),
    (co.RankError, {"type": "E", "message": "m", "traceback": "one string"}, "not lines"),
    (co.EndedMark, {"clean": "yes", "step": 1}, "not bool"),
])
def test_parse_refuses_what_the_record_is_not(cls, doc, fault):
    with pytest.raises(co.MalformedRecordError, match=fault):
        cls.parse(doc)


def test_a_malformed_file_reads_as_absent_and_is_reported(tmp_path, capsys):
    path = co.stop_request_path(tmp_path)
    path.write_text('{"deadline_unix_s": NaN, "signal": "SIGTERM"}')
    problems: list[str] = []
    assert co.read(path, co.StopRequest, problems=problems) is None
    assert problems and "malformed" in problems[0] and str(path) in problems[0]
    assert "ignoring malformed" in capsys.readouterr().err
    path.write_text("{not json")
    assert co.read(path, co.StopRequest) is None
    assert co.read(tmp_path / "missing.json", co.StopRequest) is None


def test_a_link_in_place_of_a_record_is_not_followed(tmp_path):
    secret = tmp_path / "elsewhere.json"
    co.write(secret, co.StopStep(5))
    link = co.stop_step_path(tmp_path)
    link.symlink_to(secret)
    assert co.read(link, co.StopStep) is None  # read_regular refuses the link
    assert co.exists(link)


def test_heartbeat_is_fixed_width_and_a_torn_or_foreign_one_is_not_trusted(tmp_path):
    path = co.heartbeat_path(tmp_path, 3)
    assert path.name == "heartbeat-rank-00003" and co.rank_of(path) == 3
    path.write_bytes(co.Heartbeat(7).to_bytes())
    assert len(co.Heartbeat(7).to_bytes()) == len(co.Heartbeat(10**12).to_bytes())
    assert co.Heartbeat.read(path) == co.Heartbeat(7)
    for bad in (b"", b"-4\n", b"12abc\n", b"\xff\xfe"):
        path.write_bytes(bad)
        assert co.Heartbeat.read(path) is None
    assert co.heartbeat_paths(tmp_path) == [path]


def test_marks_are_found_by_node_attempt_and_rank(tmp_path):
    for node, attempt, rank in [(0, 1, 0), (0, 1, 1), (1, 1, 2), (0, 2, 0)]:
        co.write(co.ended_path(tmp_path, node, attempt, rank), co.EndedMark(True, 4),
                 make_dir=True)
        co.write(co.preempted_path(tmp_path, node, attempt, rank), co.PreemptedMark(4),
                 make_dir=True)
        co.write(co.error_path(tmp_path, attempt, rank), co.RankError("E", "m"), make_dir=True)
    assert sorted(co.ended_of(tmp_path, 0, 1)) == [0, 1]
    assert sorted(co.preempted_of(tmp_path, 1, 1)) == [2]
    assert sorted(co.errors_of(tmp_path, 1)) == [0, 1, 2]
    assert sorted(co.errors_of(tmp_path, 2)) == [0]


# ---------------------------------------------------------------------------- events


def test_emit_event_refuses_an_undeclared_kind_or_field_under_test(tmp_path):
    jd = JobDir(tmp_path / "job")
    jd.create()
    jd.emit_event("attempt_start", attempt=1, argv=["x"])
    with pytest.raises(events.EventSchemaError, match="not declared"):
        jd.emit_event("no_such_event", step=1)
    with pytest.raises(events.EventSchemaError, match="undeclared fields"):
        jd.emit_event("attempt_start", attempt=1, argv=["x"], typo=2)
    with pytest.raises(events.EventSchemaError, match="lacks required"):
        jd.emit_event("attempt_end", attempt=1)
    lines = jd.events_path.read_text().splitlines()
    assert [json.loads(l)["event"] for l in lines] == ["attempt_start"]


def test_in_production_a_schema_problem_is_logged_and_the_event_kept(tmp_path, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr(events, "strict", lambda: False)
    jd = JobDir(tmp_path / "job")
    jd.create()
    jd.emit_event("no_such_event_in_production", step=1)
    assert "bug" in caplog.text
    assert json.loads(jd.events_path.read_text())["event"] == "no_such_event_in_production"


def test_every_event_cfrun_writes_is_declared_and_in_the_manual():
    written = set()
    for path in (ROOT / "cfrun").rglob("*.py"):
        written |= set(re.findall(r'emit_event\(\s*"([a-z_]+)"', path.read_text()))
    written |= set(re.findall(r'\(\s*"([a-z_]+)",\s*event\)',
                              (ROOT / "cfrun/supervisor/machine.py").read_text()))
    assert written - set(events.EVENTS) == set()
    manual = manual_text()  # README.md and every docs/ page (the list: docs/job-directory.md)
    missing = [k for k in events.EVENTS if f"`{k}`" not in manual]
    assert missing == []
