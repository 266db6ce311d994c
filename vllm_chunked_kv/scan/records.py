"""One record per probe on disk, and resuming from it.

A scan directory holds:

- `run.json`: the settings that decide which prompts are sent and how they
  are judged; a re-run into the same directory must match them;
- `records.jsonl`: one JSON object per answered probe, appended and flushed
  as answers arrive, so a run that dies keeps what it got;
- `records.csv`: the same records as a table, written at the end of a run.

A re-run reads `records.jsonl` and sends only the probes not in it. A last
line cut off mid-write (the process was killed) is dropped; any other
unreadable line is an error naming the line.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from vllm_chunked_kv.scan.errors import ScanError


@dataclass(frozen=True)
class Record:
    probe_id: str
    probe: str  # "offset" | "needle" | "length"
    offset: int | None
    planned_phase: int | None
    position: int  # target position in units (0 = first unit sent)
    phase: int  # position mod hop
    prompt_units: int
    units: str  # "tokens" | "chars"
    answer: str
    completion: str
    correct: bool
    request_id: str
    attempts: int
    latency_s: float
    distance: int | None = None  # units after the target's last unit (scan/placement.py); None in old runs
    extra: int | None = None  # length probe: filler units added after the record

    def length_phase(self, hop: int) -> int:
        """Where the prompt's end falls on the grid: prompt length mod hop."""
        return self.prompt_units % hop


FIELDS = [f.name for f in fields(Record)]


class RecordStore:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.jsonl = self.directory / "records.jsonl"
        self.csv = self.directory / "records.csv"
        self.meta = self.directory / "run.json"
        self._handle = None

    def prepare(self, settings: dict, fresh: bool = False) -> None:
        """Create the directory; refuse to mix runs with different settings."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ScanError(f"cannot create {self.directory}: {exc.strerror}") from None
        if fresh:
            for path in (self.jsonl, self.csv, self.meta):
                path.unlink(missing_ok=True)
        if self.meta.exists() and self.jsonl.exists():
            try:
                previous = json.loads(self.meta.read_text())
            except (OSError, json.JSONDecodeError):
                raise ScanError(f"{self.meta} is unreadable: remove it or pass --fresh") from None
            changed = [
                f"{key} {previous.get(key)!r} -> {settings.get(key)!r}"
                for key in sorted(set(previous) | set(settings))
                if previous.get(key) != settings.get(key)
            ]
            if changed:
                raise ScanError(
                    f"{self.directory} holds a scan with other settings ({'; '.join(changed)}): "
                    "use another --out or pass --fresh"
                )
        self.meta.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

    def load(self) -> dict[str, Record]:
        """Records already on disk, by probe id."""
        if not self.jsonl.exists():
            return {}
        lines = self.jsonl.read_text(encoding="utf-8").split("\n")
        records: dict[str, Record] = {}
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = Record(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                if number == len(lines):  # no newline after it: cut off mid-write, drop it
                    self.jsonl.write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
                    break
                raise ScanError(f"{self.jsonl}:{number}: not a scan record; remove the file or pass --fresh") from None
            records[record.probe_id] = record
        return records

    def append(self, record: Record) -> None:
        if self._handle is None:
            self._handle = open(self.jsonl, "a", encoding="utf-8")  # noqa: SIM115 (kept open for the run)
        self._handle.write(json.dumps(asdict(record)) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def write_csv(self, records: list[Record]) -> None:
        with open(self.csv, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS)
            writer.writeheader()
            for record in records:
                writer.writerow(asdict(record))
