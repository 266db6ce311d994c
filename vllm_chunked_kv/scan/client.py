"""Async client for an OpenAI-compatible completions server (vLLM or any other).

Routes used: `GET /v1/models`, `POST /v1/completions`, and where the server
has them `POST /tokenize` (vLLM's, at the server root),
`GET /v1/chunked_kv/config` and `POST /v1/chunked_kv/feedback` (this
project's routes).

Every request has a timeout and is retried with exponential backoff (and
jitter) on connection errors, timeouts, HTTP 408, 429 and 5xx; other HTTP
errors fail at once. A failure that survives the retries is a `ScanError`
(an `HTTPFailure` when the server answered) whose message is one line.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx

from vllm_chunked_kv.scan.errors import ScanError

RETRY_STATUS = {408, 429}
MAX_DELAY_S = 30.0


class HTTPFailure(ScanError):
    def __init__(self, message: str, status: int, detail: str):
        super().__init__(message)
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class Completion:
    text: str
    request_id: str
    attempts: int
    latency_s: float


def normalize_base_url(url: str) -> str:
    """`http://host:8000/v1/` -> `http://host:8000` (routes are added per call)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def _detail(response: httpx.Response) -> str:
    """The server's error message: vLLM's {"error": {"message"}}, FastAPI's {"detail"} or the text."""
    try:
        body = response.json()
    except ValueError:
        body = None
    message = None
    if isinstance(body, dict):
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else error
        message = message or body.get("detail") or body.get("message")
    text = str(message) if message else response.text or response.reason_phrase
    return " ".join(text.split())[:200]


class EndpointClient:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        concurrency: int = 16,
    ):
        self.base_url = normalize_base_url(base_url)
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
        )

    async def __aenter__(self) -> "EndpointClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, body: dict | None = None) -> tuple[dict, int]:
        """JSON response body and the number of attempts it took."""
        what = f"{method} {self.base_url}{path}"
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                response = await self._http.request(method, path, json=body)
            except httpx.ConnectError as exc:
                problem = ScanError(f"cannot reach {self.base_url}: {exc or 'connection failed'}")
            except httpx.TimeoutException:
                problem = ScanError(f"{what}: no answer within {self.timeout_s:g} s")
            except httpx.TransportError as exc:
                problem = ScanError(f"{what}: {type(exc).__name__}: {exc}")
            else:
                if response.status_code < 400:
                    try:
                        return response.json(), attempt + 1
                    except ValueError:
                        raise ScanError(f"{what}: answer is not JSON: {response.text[:100]!r}") from None
                detail = _detail(response)
                problem = HTTPFailure(f"{what}: HTTP {response.status_code}: {detail}", response.status_code, detail)
                if response.status_code not in RETRY_STATUS and response.status_code < 500:
                    raise problem
            if last:
                suffix = f" (after {attempt + 1} attempts)" if attempt else ""
                problem.args = (str(problem) + suffix,)
                raise problem
            delay = min(MAX_DELAY_S, self.backoff_s * 2**attempt)
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    async def list_models(self) -> list[str]:
        body, _ = await self._request("GET", "/v1/models")
        try:
            return [entry["id"] for entry in body["data"]]
        except (KeyError, TypeError):
            raise ScanError(f"{self.base_url}/v1/models: unexpected answer {str(body)[:100]}") from None

    async def resolve_model(self, requested: str | None) -> str:
        """The model to probe: the requested one if served, else the only one served."""
        served = await self.list_models()
        if requested is None:
            if len(served) == 1:
                return served[0]
            raise ScanError(f"{self.base_url} serves {len(served)} models ({', '.join(served)}): name one with --model")
        if requested not in served:
            raise ScanError(f"model {requested!r} is not served at {self.base_url} (served: {', '.join(served) or 'none'})")
        return requested

    async def tokenize(self, model: str, text: str, add_special_tokens: bool) -> list[int]:
        body = {"model": model, "prompt": text, "add_special_tokens": add_special_tokens}
        answer, _ = await self._request("POST", "/tokenize", body)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            raise ScanError(f"{self.base_url}/tokenize: unexpected answer {str(answer)[:100]}")
        return tokens

    async def can_tokenize(self, model: str) -> bool:
        """Whether the server has vLLM's /tokenize route."""
        try:
            await self.tokenize(model, "a", False)
        except HTTPFailure as exc:
            if exc.status in (404, 405, 501):
                return False
            raise
        return True

    async def complete(
        self, model: str, prompt: str | list[int], *, max_tokens: int, temperature: float, seed: int | None
    ) -> Completion:
        body: dict = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        start = asyncio.get_running_loop().time()
        answer, attempts = await self._request("POST", "/v1/completions", body)
        latency = asyncio.get_running_loop().time() - start
        try:
            return Completion(answer["choices"][0]["text"], str(answer.get("id", "")), attempts, latency)
        except (KeyError, IndexError, TypeError):
            raise ScanError(f"{self.base_url}/v1/completions: unexpected answer {str(answer)[:100]}") from None

    async def server_config(self) -> dict | None:
        """This project's `GET /v1/chunked_kv/config` answer, or None when the server has no such route."""
        try:
            response = await self._http.get("/v1/chunked_kv/config")
            body = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    async def post_feedback(self, request_id: str, correct: bool) -> None:
        """POST the outcome; raises HTTPFailure (404 with detail 'Not Found' = no such route)."""
        await self._request("POST", "/v1/chunked_kv/feedback", {"request_id": request_id, "correct": correct})
