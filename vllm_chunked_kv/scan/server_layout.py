"""What the scan learns from the servers before planning: the hop, the geometry, the units.

- hop: `--hop`, else the first server's `phase_hop` from
  `GET /v1/chunked_kv/config`, else 4;
- geometry to place targets by: `--window` (with the servers' chunk and
  sinks), else each server's own; in an A/B scan the one that needs the most
  distance, so the targets sit beyond both raw windows;
- geometry to judge each endpoint's targets by: its server's whenever it
  reports one, else the placement's;
- units: tokens when the (first) server has `/tokenize`; an A/B scan sends
  the same token ids to both, so it checks that both tokenize alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.placement import Geometry, geometry_from

DEFAULT_HOP = 4
SAMPLE = "The quick brown fox jumps over the lazy dog. k1 v2 f3 ? 12345"


@dataclass(frozen=True)
class ServerLayout:
    hop: int
    hop_source: str  # "--hop" | "server" | "default"
    placed: Geometry  # where targets go
    judged: list[Geometry]  # per endpoint: what its inside/outside split is judged by


def resolve_hop(configs: list[dict], requested: int | None) -> tuple[int, str]:
    if requested is not None:
        return requested, "--hop"
    for config in configs:
        served = config.get("phase_hop")
        if isinstance(served, int) and served >= 1:
            return served, "server"
    return DEFAULT_HOP, "default"


def server_layout(configs: list[dict], hop: int | None, window: int | None) -> ServerLayout:
    """configs: each endpoint's config route answer ({} without one)."""
    hop, source = resolve_hop(configs, hop)
    blocks = [c.get("chunked_kv") if isinstance(c.get("chunked_kv"), dict) else None for c in configs]
    placed = max((geometry_from(block, window, hop) for block in blocks), key=lambda g: g.min_distance)
    judged = [geometry_from(block, None, hop) for block in blocks]
    return ServerLayout(hop, source, placed, [g if g.source == "server" else placed for g in judged])


async def scan_units(client: EndpointClient, model: str, requested: str) -> str:
    if requested == "chars":
        return "chars"
    if await client.can_tokenize(model):
        return "tokens"
    if requested == "tokens":
        raise ScanError(f"{client.base_url} has no /tokenize route: use --units chars")
    return "chars"


async def check_same_tokenizer(a: EndpointClient, model_a: str, b: EndpointClient, model_b: str) -> None:
    """Token-id prompts mean the same to B only if B tokenizes like A (B without /tokenize is trusted)."""
    if not await b.can_tokenize(model_b):
        return
    if await a.tokenize(model_a, SAMPLE, True) != await b.tokenize(model_b, SAMPLE, True):
        raise ScanError(
            f"{a.base_url} and {b.base_url} tokenize differently: an A/B scan sends the same token ids "
            "to both, so they must serve the same tokenizer (or pass --units chars)"
        )
