"""A run folder's JSON lines after a crash or a full disk cut a record mid-line: readers skip the torn line and
count it, writers start their next record on a line of its own (issue 52: a resumed learner's `up` event was
appended to a torn line, and the run said its learner never came up)."""

from __future__ import annotations

import json

from streamrl.engine.telemetry import EventLog, MetricsSink, MetricsTail, ending_torn, read_ending, read_jsonl

TORN = '{"t": 1796614544.07, "role": "lear'  # a record cut by a full disk: no end, no newline


def test_an_event_after_a_torn_line_starts_on_a_line_of_its_own(tmp_path):
    EventLog(tmp_path, "learner").emit("step", step=1)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(TORN)
    EventLog(tmp_path, "learner").emit("up")
    records, torn = read_jsonl(tmp_path / "events.jsonl")
    assert [r["event"] for r in records] == ["step", "up"] and torn == 1
    # the positive control: appended as before this fix, the event is lost inside the torn line
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write(TORN + json.dumps({"t": 1.0, "role": "learner", "event": "lost"}) + "\n")
    records, torn = read_jsonl(tmp_path / "events.jsonl")
    assert [r["event"] for r in records] == ["step", "up"] and torn == 2


def test_a_metrics_sink_opened_on_a_torn_file_starts_its_first_record_on_a_fresh_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 1.0}) + "\n" + TORN)
    sink = MetricsSink(tmp_path)
    sink.log(2, {"loss": 0.5})
    sink.log(3, {"loss": 0.25})
    sink.close()
    records, torn = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3] and torn == 1


def test_a_live_tail_waits_for_a_line_being_written_and_counts_only_what_cannot_be_a_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n\n[1, 2]\n{"step": 2')  # a blank line (a fresh start) is no record, nor torn
    tail = MetricsTail(path)
    assert [r["step"] for r in tail.poll()] == [1] and tail.skipped == 1  # [1, 2]: JSON, but not a record
    with open(path, "a") as f:
        f.write("}\n")  # the half-written line was only being written: it is a record
    assert [r["step"] for r in tail.poll()] == [2] and tail.skipped == 1


def test_a_torn_ending_reads_as_none_and_says_it_is_torn(tmp_path):
    assert read_ending(tmp_path) is None and not ending_torn(tmp_path)  # none at all: not torn
    (tmp_path / "end.json").write_text('{"ended": "finished", "exi')
    assert read_ending(tmp_path) is None and ending_torn(tmp_path)
    (tmp_path / "end.json").write_text('{"ended": "finished"}')  # JSON, but not an ending
    assert read_ending(tmp_path) is None and ending_torn(tmp_path)
    (tmp_path / "end.json").write_text('{"ended": "finished", "exit": 0, "time": 1.0, "detail": ""}')
    assert read_ending(tmp_path)["exit"] == 0 and not ending_torn(tmp_path)
