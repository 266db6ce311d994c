"""Contract of the endpoint client.

- Base URLs are normalised (`/v1`, trailing slash, missing scheme).
- The model is checked against /v1/models; a missing name is one line listing what is served.
- An unreachable server, a persistent HTTP 500 and a 4xx are `ScanError`s with one line;
  5xx is retried with backoff (and succeeds when the server recovers), 4xx is not retried.
- /tokenize support is detected; a missing feedback route is a 404 'Not Found'.
"""

from __future__ import annotations

import asyncio

import pytest

from vllm_chunked_kv.scan.client import EndpointClient, HTTPFailure, normalize_base_url
from vllm_chunked_kv.scan.errors import ScanError
from .fake_server import FakeEndpoint, free_port


def _run(coro):
    return asyncio.run(coro)


async def _with_client(url: str, action, **kwargs):
    async with EndpointClient(url, retries=kwargs.pop("retries", 2), backoff_s=0.01, timeout_s=5, **kwargs) as client:
        return await action(client)


@pytest.mark.parametrize(
    "given", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", "h:8000"]
)
def test_base_url_normalisation(given):
    assert normalize_base_url(given) == "http://h:8000"


def test_resolve_model(fake):
    assert _run(_with_client(fake.base_url, lambda c: c.resolve_model(None))) == "fake-model"
    assert _run(_with_client(fake.base_url, lambda c: c.resolve_model("fake-model"))) == "fake-model"
    with pytest.raises(ScanError, match="model 'nope' is not served .*served: fake-model"):
        _run(_with_client(fake.base_url, lambda c: c.resolve_model("nope")))


def test_unreachable_server_is_one_line():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ScanError) as info:
        _run(_with_client(url, lambda c: c.list_models()))
    assert str(info.value).startswith(f"cannot reach {url}")
    assert "\n" not in str(info.value)


def test_http_500_is_retried_until_it_succeeds():
    with FakeEndpoint(fail_first=2) as fake:
        completion = _run(
            _with_client(
                fake.base_url,
                lambda c: c.complete("fake-model", "k1 v2 ? k1", max_tokens=1, temperature=0, seed=None),
                retries=3,
            )
        )
        assert completion.attempts == 3
        assert completion.request_id == "cmpl-1"  # the first request the server answered
        assert fake.completion_requests == 3


def test_persistent_http_500_fails_after_the_retries():
    with FakeEndpoint(fail_first=100) as fake:
        with pytest.raises(HTTPFailure) as info:
            _run(_with_client(fake.base_url, lambda c: c.complete("fake-model", "a", max_tokens=1, temperature=0, seed=None)))
        assert info.value.status == 500
        assert "HTTP 500: engine dead (after 3 attempts)" in str(info.value)
        assert fake.completion_requests == 3


def test_client_errors_are_not_retried(fake):
    with pytest.raises(HTTPFailure) as info:
        _run(_with_client(fake.base_url, lambda c: c.complete("other", "a", max_tokens=1, temperature=0, seed=None)))
    assert info.value.status == 404
    assert fake.completion_requests == 1


def test_tokenize_detection():
    with FakeEndpoint() as fake:
        assert _run(_with_client(fake.base_url, lambda c: c.can_tokenize("fake-model")))
        tokens = _run(_with_client(fake.base_url, lambda c: c.tokenize("fake-model", "a b a", True)))
        assert tokens[0] == 1 and tokens[1] == tokens[3] != tokens[2]
    with FakeEndpoint(tokenize=False) as fake:
        assert not _run(_with_client(fake.base_url, lambda c: c.can_tokenize("fake-model")))


def test_missing_feedback_route_is_a_plain_404():
    with FakeEndpoint(feedback=False) as fake:
        with pytest.raises(HTTPFailure) as info:
            _run(_with_client(fake.base_url, lambda c: c.post_feedback("cmpl-1", True)))
        assert (info.value.status, info.value.detail) == (404, "Not Found")
