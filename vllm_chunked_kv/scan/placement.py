"""Where the scan puts its targets: beyond the server's raw window, so it measures compression.

A chunked server keeps the last `window` tokens before the query raw (plus
a partial chunk still filling up) and the first `sink_tokens` raw; only what
lies between is read through compressed rows. A target inside the raw window
is read exactly whatever the mitigation, so a scan that puts its needles
there reports a flat, perfect server (scan/README.md, "Where the targets go").

A target's **distance** is the number of prompt units after its last unit.
The token at position `q` is sealed into a compressed row for the last
prompt token `t = L - 1` once its chunk has left the window, which holds for
`t - q >= window + chunk_size - 1`; with `distance = L - 1 - q` the scan asks
for `distance >= window + chunk_size` (one unit of margin) and
`position >= sink_tokens`.

The geometry comes from the server (`GET /v1/chunked_kv/config`), else from
`--window`, else a long window is assumed (512 tokens): placing needles too
far from the end costs prompt length, placing them too close measures
nothing. In character units (no `/tokenize`) distances are scaled by
`CHARS_PER_TOKEN`.
"""

from __future__ import annotations

from dataclasses import dataclass

ASSUMED_WINDOW = 512  # tokens; used when neither the server nor --window says
ASSUMED_SINKS = 4
CHARS_PER_TOKEN = 4  # English text, roughly; only used in character units


@dataclass(frozen=True)
class Geometry:
    """The server's raw regions, in tokens, and where the numbers came from."""

    window: int
    chunk_size: int
    sink_tokens: int
    source: str  # "server" | "--window" | "assumed"

    def scaled(self, units: str) -> "Geometry":
        """The same geometry in the scan's units (characters are ~4 per token)."""
        if units != "chars":
            return self
        k = CHARS_PER_TOKEN
        return Geometry(self.window * k, self.chunk_size * k, self.sink_tokens * k, self.source)

    @property
    def min_distance(self) -> int:
        """Units a target's last unit must have after it to sit in a sealed chunk."""
        return self.window + self.chunk_size

    def outside(self, position: int, distance: int) -> bool:
        """Whether a target at `position` with `distance` units after it is read compressed."""
        return distance >= self.min_distance and position >= self.sink_tokens

    def to_dict(self) -> dict:
        return {"window": self.window, "chunk_size": self.chunk_size, "sink_tokens": self.sink_tokens,
                "min_distance": self.min_distance, "source": self.source}


def geometry_from(server: dict | None, window: int | None, hop: int) -> Geometry:
    """The geometry to place targets by: `--window` overrides, then the server's, then assumed.

    `server` is the `chunked_kv` block of `GET /v1/chunked_kv/config` (None
    without the route). `hop` stands in for the chunk size when the server
    does not report one.
    """
    server = server or {}
    chunk = server.get("chunk_size") if isinstance(server.get("chunk_size"), int) else hop
    sinks = server.get("sink_tokens") if isinstance(server.get("sink_tokens"), int) else ASSUMED_SINKS
    if window is not None:
        return Geometry(window, chunk, sinks, "--window")
    if isinstance(server.get("window"), int):
        return Geometry(server["window"], chunk, sinks, "server")
    return Geometry(ASSUMED_WINDOW, chunk, sinks, "assumed")
