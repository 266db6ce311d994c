"""Contract of the record store.

- Records appended are read back, by probe id; the CSV holds the same rows.
- A last line cut off mid-write is dropped (and the file repaired so later
  appends stay readable); an unreadable line elsewhere is one error naming it.
- A directory holding a scan with other settings is refused; --fresh clears it.
"""

from __future__ import annotations

import csv
import dataclasses

import pytest

from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.records import Record, RecordStore

SETTINGS = {"model": "m", "hop": 4, "seed": 0}


def _record(i: int, correct: bool = True) -> Record:
    return Record(f"needle:0:{i}", "needle", None, 0, 8 + 4 * i, 0, 100, "tokens", "v1", " v1", correct, f"cmpl-{i}", 1, 0.01)


def test_roundtrip_and_csv(tmp_path):
    store = RecordStore(tmp_path)
    store.prepare(SETTINGS)
    records = [_record(i, i % 2 == 0) for i in range(3)]
    for record in records:
        store.append(record)
    store.close()
    assert list(store.load().values()) == records
    store.write_csv(records)
    rows = list(csv.DictReader(open(store.csv)))
    assert [row["probe_id"] for row in rows] == [r.probe_id for r in records]
    assert [row["correct"] for row in rows] == ["True", "False", "True"]


def test_truncated_last_line_is_dropped_and_repaired(tmp_path):
    store = RecordStore(tmp_path)
    store.prepare(SETTINGS)
    store.append(_record(0))
    store.close()
    with open(store.jsonl, "a") as handle:
        handle.write('{"probe_id": "needle:0:1", "pro')
    assert list(store.load()) == ["needle:0:0"]
    store.append(_record(2))
    store.close()
    assert list(store.load()) == ["needle:0:0", "needle:0:2"]


def test_unreadable_middle_line_is_an_error(tmp_path):
    store = RecordStore(tmp_path)
    store.prepare(SETTINGS)
    store.jsonl.write_text('{"probe_id": "x"}\n' + '{"bad": 1}\n')
    with pytest.raises(ScanError, match=r"records.jsonl:1: not a scan record"):
        store.load()


def test_other_settings_are_refused_and_fresh_clears(tmp_path):
    store = RecordStore(tmp_path)
    store.prepare(SETTINGS)
    store.append(_record(0))
    store.close()
    store.prepare(dict(SETTINGS))  # same settings: resume
    with pytest.raises(ScanError, match=r"hop 4 -> 8.*--fresh"):
        store.prepare({**SETTINGS, "hop": 8})
    store.prepare({**SETTINGS, "hop": 8}, fresh=True)
    assert store.load() == {}


def test_record_fields_are_the_csv_header(tmp_path):
    store = RecordStore(tmp_path)
    store.prepare(SETTINGS)
    store.write_csv([])
    header = open(store.csv).readline().strip().split(",")
    assert header == [f.name for f in dataclasses.fields(Record)]
