"""`vllm.endpoint_plugins` entry point: the feedback and config routes.

- `POST /v1/chunked_kv/feedback`, body `{"request_id": str, "correct": bool}`:
  the id is the `id` of the completion the client received. The route looks
  up the phase the stat logger recorded for that request and counts
  `vllm_chunked_kv_feedback_total{phase, outcome}`. 200 with the phase;
  404 for an id never seen (or already dropped from the bounded registry);
  409 for a second rating of the same request; 422 for a bad body. It can
  change nothing but that counter and the "rated" mark of the request.
- `GET /v1/chunked_kv/config`: the active configuration, resolved.

Ids: vLLM's completions endpoint answers `cmpl-X` but hands the engine
`cmpl-X-<prompt index>` (one engine request per prompt), the chat endpoint
uses `chatcmpl-X` for both; the stat logger sees the engine-side id. A
posted id is therefore looked up as given, then with `-0` appended. For a
completion with several prompts, post `cmpl-X-<prompt index>`.

The record is written in the same event-loop pass that delivers the final
output, but a few awaits lie between the two; an unknown id is therefore
retried for up to `CHUNKED_KV_FEEDBACK_WAIT_S` (default 0.5 s) before 404.

Loaded only when named in `VLLM_PLUGINS` (vLLM's rule for endpoint plugins).
Routes under /v1 are covered by `--api-key` like vLLM's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from vllm_chunked_kv.serving.metric_families import get_metrics
from vllm_chunked_kv.serving.phase_registry import Claim, PhaseRecord, get_phase_registry

FEEDBACK_PATH = "/v1/chunked_kv/feedback"
CONFIG_PATH = "/v1/chunked_kv/config"
ENV_WAIT = "CHUNKED_KV_FEEDBACK_WAIT_S"
MAX_ID_LENGTH = 512

router = APIRouter()


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    correct: bool


def engine_ids(client_id: str) -> list[str]:
    """Engine-side ids a client-visible id may stand for, most likely first."""
    return [client_id, f"{client_id}-0"]


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status_code=status
    )


def _wait_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(ENV_WAIT, "0.5")))
    except ValueError:
        return 0.5


async def _claim(client_id: str) -> tuple[Claim, PhaseRecord | None]:
    registry = get_phase_registry()
    deadline = time.monotonic() + _wait_seconds()
    while True:
        for engine_id in engine_ids(client_id):
            claim, record = registry.claim(engine_id)
            if claim is not Claim.UNKNOWN:
                return claim, record
        if time.monotonic() >= deadline:
            return Claim.UNKNOWN, None
        await asyncio.sleep(0.05)


@router.post(FEEDBACK_PATH)
async def post_feedback(request: Request) -> JSONResponse:
    # Validated here rather than by FastAPI: vLLM turns validation errors into 400.
    raw = await request.body()
    try:
        body = FeedbackBody.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        return _error(422, "UnprocessableEntity", f"{where}: {first['msg']}")
    claim, record = await _claim(body.request_id)
    if claim is Claim.UNKNOWN:
        return _error(404, "NotFound", f"unknown request id {body.request_id!r} (never served here, or expired)")
    if claim is Claim.ALREADY_RATED:
        return _error(409, "Conflict", f"request {body.request_id!r} was already rated")
    outcome = "correct" if body.correct else "incorrect"
    get_metrics()["vllm_chunked_kv_feedback_total"].labels(
        record.model_name, record.engine, str(record.phase), outcome
    ).inc()
    return JSONResponse({"request_id": body.request_id, "phase": record.phase, "outcome": outcome})


@router.get(CONFIG_PATH)
async def get_config(request: Request) -> JSONResponse:
    view = getattr(request.app.state, "chunked_kv_config", None)
    if view is None:
        return _error(503, "ServiceUnavailable", "chunked_kv configuration not initialised")
    return JSONResponse(view)


def config_view(vllm_config: Any) -> dict[str, Any]:
    """What GET /v1/chunked_kv/config answers: settings, backend, footprint."""
    from vllm_chunked_kv.core.config import ChunkedKVConfig
    from vllm_chunked_kv.serving.kv_footprint import attention_backend_name, chunked_backend_active, footprint_from_vllm_config

    cfg = ChunkedKVConfig.from_vllm_config(vllm_config)
    fp = footprint_from_vllm_config(vllm_config, cfg.tokens_per_state)
    registry = get_phase_registry()
    return {
        "chunked_kv": json.loads(json.dumps(cfg.describe())),
        "phase_hop": cfg.hop,
        "attention_backend": attention_backend_name(vllm_config).lower(),
        "compression_active": chunked_backend_active(vllm_config),
        "kv_cache": {
            "uncompressed_bytes_per_token": fp.uncompressed_bytes_per_token,
            "bytes_per_token": fp.bytes_per_token,
            "compression_ratio": fp.compression_ratio,
            "capacity_tokens": fp.capacity_tokens,
        },
        "feedback_store": {"kind": registry.kind, "capacity": registry.capacity},
    }


class ChunkedKVFeedbackPlugin:
    """The `EndpointPlugin` vLLM instantiates (see vllm/plugins/endpoint_plugins)."""

    name = "chunked_kv_feedback"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        vllm_config = getattr(engine_client, "vllm_config", None)
        if vllm_config is not None:
            state.chunked_kv_config = config_view(vllm_config)


def register_routes() -> ChunkedKVFeedbackPlugin:
    """Entry-point factory: a zero-argument callable returning the plugin."""
    return ChunkedKVFeedbackPlugin()
