"""Contract of `vllm_chunked_kv.serving.phase_registry`: both stores keep the newest
`capacity` records and drop the oldest; a record is claimed once (a second
claim says "already rated", an absent id "unknown"); the SQLite store is
shared by separate OS processes (one API server records, another claims);
`get_phase_registry` picks SQLite exactly when vLLM's multiprocess
directory (or CHUNKED_KV_PHASE_DB) is set."""

from __future__ import annotations

import multiprocessing

import pytest

from vllm_chunked_kv.serving import phase_registry
from vllm_chunked_kv.serving.phase_registry import (
    Claim,
    MemoryPhaseRegistry,
    PhaseRecord,
    SqlitePhaseRegistry,
)


def _record(i: int, phase: int | None = None) -> PhaseRecord:
    return PhaseRecord(f"cmpl-{i}-0", "m", str(i % 2), i % 4 if phase is None else phase)


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request, tmp_path):
    def make(capacity: int):
        if request.param == "memory":
            return MemoryPhaseRegistry(capacity)
        return SqlitePhaseRegistry(tmp_path / "sub" / "phases.sqlite3", capacity)

    return make


def test_claim_once_then_already_rated(make_store):
    store = make_store(10)
    store.add([_record(1, phase=3)])
    claim, record = store.claim("cmpl-1-0")
    assert claim is Claim.CLAIMED and record == _record(1, phase=3)
    assert store.claim("cmpl-1-0")[0] is Claim.ALREADY_RATED
    assert store.claim("cmpl-2-0") == (Claim.UNKNOWN, None)


def test_keeps_newest_capacity_records(make_store):
    store = make_store(5)
    for start in range(0, 12, 3):  # several batches, as several engine steps would add them
        store.add([_record(i) for i in range(start, start + 3)])
    assert len(store) == 5
    kept = [i for i in range(12) if store.claim(f"cmpl-{i}-0")[0] is Claim.CLAIMED]
    assert kept == [7, 8, 9, 10, 11]


def test_re_adding_an_id_refreshes_it(make_store):
    store = make_store(2)
    store.add([_record(1), _record(2)])
    store.add([_record(1, phase=0)])  # same id again: newest now
    store.add([_record(3)])
    assert store.claim("cmpl-2-0")[0] is Claim.UNKNOWN
    assert store.claim("cmpl-1-0") == (Claim.CLAIMED, _record(1, phase=0))


def test_empty_add_is_harmless(make_store):
    store = make_store(3)
    store.add([])
    assert len(store) == 0


def test_capacity_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        MemoryPhaseRegistry(0)
    with pytest.raises(ValueError):
        SqlitePhaseRegistry(tmp_path / "x.sqlite3", 0)


def _writer(path: str, ids: list[str]) -> None:
    SqlitePhaseRegistry(path, 100).add([PhaseRecord(i, "m", "0", n % 3) for n, i in enumerate(ids)])


def _claimer(path: str, ids: list[str], out) -> None:
    store = SqlitePhaseRegistry(path, 100)
    out.put([(store.claim(i)[0].value) for i in ids])


def test_sqlite_store_is_shared_between_processes(tmp_path):
    path = str(tmp_path / "phases.sqlite3")
    ids = [f"chatcmpl-{n}" for n in range(6)]
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(target=_writer, args=(path, ids))
    writer.start()
    writer.join(60)
    assert writer.exitcode == 0
    out = ctx.Queue()
    claimers = [ctx.Process(target=_claimer, args=(path, ids, out)) for _ in range(2)]
    for proc in claimers:
        proc.start()
    results = [out.get(timeout=60) for _ in claimers]
    for proc in claimers:
        proc.join(60)
    # Each id is claimed exactly once across the two processes.
    for n in range(len(ids)):
        assert sorted(r[n] for r in results) == ["already_rated", "claimed"]


def test_get_phase_registry_picks_store_from_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(phase_registry, "_registry", None)
    monkeypatch.delenv(phase_registry.ENV_DB, raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(phase_registry.ENV_CAPACITY, "7")
    store = phase_registry.get_phase_registry()
    assert store.kind == "memory" and store.capacity == 7
    assert phase_registry.get_phase_registry() is store

    monkeypatch.setattr(phase_registry, "_registry", None)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    store = phase_registry.get_phase_registry()
    assert store.kind == "sqlite"
    # Not a *.db file at the top: prometheus_client's collector reads those.
    assert store.path.parent == tmp_path / "chunked_kv"

    monkeypatch.setattr(phase_registry, "_registry", None)
    monkeypatch.setenv(phase_registry.ENV_DB, str(tmp_path / "explicit.sqlite3"))
    assert phase_registry.get_phase_registry().path == tmp_path / "explicit.sqlite3"
    monkeypatch.setattr(phase_registry, "_registry", None)
