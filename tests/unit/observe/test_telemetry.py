"""The structured event log: JSON lines appended by every process of a run."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from unbroken.observe.events import KINDS, EventLog, read_events


def test_an_event_log_without_a_path_is_a_disabled_no_op(tmp_path):
    log = EventLog(None, "worker:a")
    assert not log.enabled
    log.emit("step", step=1)
    log.close()
    assert list(tmp_path.iterdir()) == []
    assert not EventLog.for_run_dir(None, "coordinator").enabled


def test_events_are_json_lines_with_time_kind_source_and_fields(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), "launcher:n1")
    assert log.enabled
    before = time.time()
    log.emit("worker_exit", member="n1.w0.r0", code=-9, how="killed by SIGKILL")
    log.emit("generation", generation=2, members=["a", "b"])
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert before <= first["t"] <= time.time()
    assert {k: v for k, v in first.items() if k != "t"} == {
        "kind": "worker_exit", "source": "launcher:n1", "member": "n1.w0.r0", "code": -9, "how": "killed by SIGKILL"
    }
    assert (second["kind"], second["generation"], second["members"]) == ("generation", 2, ["a", "b"])


def test_values_json_cannot_encode_are_written_as_text(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), "worker:a")
    log.emit("heal", where=Path("/some/dir"), error=ValueError("boom"))
    log.close()
    (event,) = read_events(str(path))[0]
    assert (event["where"], event["error"]) == ("/some/dir", "boom")


def test_for_run_dir_creates_the_directory_and_writes_events_jsonl(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    log = EventLog.for_run_dir(str(run_dir), "coordinator")
    log.emit("coordinator_start", port=1)
    log.close()
    events, bad = read_events(str(run_dir / "events.jsonl"))
    assert bad == []
    assert [(e["kind"], e["source"], e["port"]) for e in events] == [("coordinator_start", "coordinator", 1)]


def test_several_writers_append_to_one_file_without_losing_or_mixing_lines(tmp_path):
    path = str(tmp_path / "events.jsonl")
    logs = [EventLog(path, f"worker:{i}") for i in range(3)]
    payload = "x" * 2000  # long lines would show interleaving at once

    def write(log: EventLog) -> None:
        for n in range(100):
            log.emit("step", step=n, pad=payload)

    threads = [threading.Thread(target=write, args=(log,)) for log in logs for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for log in logs:
        log.close()
    events, bad = read_events(path)
    assert bad == []
    assert len(events) == 600
    for i in range(3):
        steps = sorted(e["step"] for e in events if e["source"] == f"worker:{i}")
        assert steps == sorted(list(range(100)) * 2)


def test_the_log_appends_to_an_existing_file_and_ignores_events_after_close(tmp_path):
    path = str(tmp_path / "events.jsonl")
    first = EventLog(path, "a")
    first.emit("one")
    first.close()
    first.close()  # closing twice is harmless
    first.emit("lost")
    second = EventLog(path, "b")
    second.emit("two")
    second.close()
    events, _ = read_events(path)
    assert [(e["kind"], e["source"]) for e in events] == [("one", "a"), ("two", "b")]


def test_read_events_reports_the_numbers_of_lines_it_cannot_parse(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "a"}\nnot json\n[1, 2]\n{"kind": "b"}\n{"kind": "trunc\n"plain string"\n')
    events, bad = read_events(str(path))
    assert [e["kind"] for e in events] == ["a", "b"]
    assert bad == [2, 3, 5, 6]


def test_read_events_survives_bytes_that_are_not_utf8(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"kind": "a"}\n\xff\xfe garbage\n{"kind": "b"}\n')
    events, bad = read_events(str(path))
    assert [e["kind"] for e in events] == ["a", "b"]
    assert bad == [2]


def test_emit_refuses_fields_that_would_replace_the_common_ones(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"), "worker:a")
    for name in ("source", "t"):
        with pytest.raises(ValueError, match="common fields"):
            log.emit("heal", **{name: "x"})
    log.close()
    assert (tmp_path / "events.jsonl").read_text() == ""


def test_every_kind_written_is_listed_and_documented():
    root = Path(__file__).resolve().parents[3]
    written = set()
    for path in (root / "unbroken").rglob("*.py"):
        written |= set(re.findall(r'\bemit\(\s*"(\w+)"', path.read_text()))
    assert written == set(KINDS)
    docs = (root / "docs" / "events.md").read_text()
    assert {kind for kind in KINDS if f"| `{kind}` |" in docs} == set(KINDS)
