"""Bounded map from request id to the phase of that request, shared by the
stat logger (which writes it) and the feedback route (which reads it).

A record is written when vLLM reports a request finished; the feedback route
later claims it once (a second claim reports "already rated"). The map keeps
the newest `capacity` records and drops the oldest.

Two stores, picked by `get_phase_registry()`:

- `MemoryPhaseRegistry`: an ordered dict in this process. Used with one API
  server, where the stat logger and the routes live in the same process.
- `SqlitePhaseRegistry`: one SQLite file shared by every process on the host.
  Used when vLLM runs several API server processes (`--api-server-count N`),
  because a client's feedback post may reach a different API server process
  than the one that served (and recorded) its completion. vLLM then sets
  `PROMETHEUS_MULTIPROC_DIR` before starting the API servers; the file lives
  in a `chunked_kv/` folder inside it, so vLLM's cleanup of that directory
  removes it too. `CHUNKED_KV_PHASE_DB` names another file explicitly.

Environment: `CHUNKED_KV_PHASE_DB` (path), `CHUNKED_KV_PHASE_CAPACITY`
(records kept, default 100000).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

DEFAULT_CAPACITY = 100_000
ENV_DB = "CHUNKED_KV_PHASE_DB"
ENV_CAPACITY = "CHUNKED_KV_PHASE_CAPACITY"


@dataclass(frozen=True)
class PhaseRecord:
    """What the feedback route needs to label an outcome."""

    request_id: str
    model_name: str
    engine: str
    phase: int


class Claim(Enum):
    CLAIMED = "claimed"
    UNKNOWN = "unknown"
    ALREADY_RATED = "already_rated"


class MemoryPhaseRegistry:
    """In-process store: an LRU-ordered dict of the newest `capacity` records."""

    kind = "memory"

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self._records: OrderedDict[str, tuple[PhaseRecord, bool]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, records: Iterable[PhaseRecord]) -> None:
        with self._lock:
            for record in records:
                self._records[record.request_id] = (record, False)
                self._records.move_to_end(record.request_id)
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)

    def claim(self, request_id: str) -> tuple[Claim, PhaseRecord | None]:
        """Mark the record rated; report whether it existed and was unrated."""
        with self._lock:
            entry = self._records.get(request_id)
            if entry is None:
                return Claim.UNKNOWN, None
            record, rated = entry
            if rated:
                return Claim.ALREADY_RATED, record
            self._records[request_id] = (record, True)
            return Claim.CLAIMED, record

    def __len__(self) -> int:
        return len(self._records)


class SqlitePhaseRegistry:
    """Store shared between processes through one SQLite file (WAL mode)."""

    kind = "sqlite"

    def __init__(self, path: str | os.PathLike, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: autocommit; transactions are explicit below.
        self._conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA busy_timeout = 10000")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = OFF")  # the data is disposable
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS phases ("
                " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                " request_id TEXT NOT NULL UNIQUE,"
                " model_name TEXT NOT NULL,"
                " engine TEXT NOT NULL,"
                " phase INTEGER NOT NULL,"
                " rated INTEGER NOT NULL DEFAULT 0)"
            )

    def add(self, records: Iterable[PhaseRecord]) -> None:
        rows = [(r.request_id, r.model_name, r.engine, r.phase) for r in records]
        if not rows:
            return
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                self._conn.executemany(
                    "INSERT OR REPLACE INTO phases (request_id, model_name, engine, phase, rated)"
                    " VALUES (?, ?, ?, ?, 0)",
                    rows,
                )
                # seq only grows, so the newest `capacity` rows are the top seqs.
                self._conn.execute(
                    "DELETE FROM phases WHERE seq <= (SELECT MAX(seq) FROM phases) - ?", (self.capacity,)
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def claim(self, request_id: str) -> tuple[Claim, PhaseRecord | None]:
        with self._lock:
            changed = self._conn.execute(
                "UPDATE phases SET rated = 1 WHERE request_id = ? AND rated = 0", (request_id,)
            ).rowcount
            row = self._conn.execute(
                "SELECT model_name, engine, phase FROM phases WHERE request_id = ?", (request_id,)
            ).fetchone()
        if row is None:
            return Claim.UNKNOWN, None
        record = PhaseRecord(request_id, row[0], row[1], int(row[2]))
        return (Claim.CLAIMED if changed else Claim.ALREADY_RATED), record

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM phases").fetchone()[0])


PhaseRegistry = MemoryPhaseRegistry | SqlitePhaseRegistry

_registry: PhaseRegistry | None = None
_registry_lock = threading.Lock()


def shared_db_path() -> Path | None:
    """The SQLite file to share between processes, or None for in-memory."""
    explicit = os.environ.get(ENV_DB)
    if explicit:
        return Path(explicit)
    multiproc_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if multiproc_dir:
        return Path(multiproc_dir) / "chunked_kv" / "phases.sqlite3"
    return None


def get_phase_registry() -> PhaseRegistry:
    """This process's registry (created on first use from the environment)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            capacity = int(os.environ.get(ENV_CAPACITY, DEFAULT_CAPACITY))
            path = shared_db_path()
            _registry = MemoryPhaseRegistry(capacity) if path is None else SqlitePhaseRegistry(path, capacity)
        return _registry
