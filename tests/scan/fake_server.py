"""A small OpenAI-compatible HTTP server whose accuracy depends on the phase in a known way.

It speaks the parts of vLLM's API the scanner uses: `GET /v1/models`,
`POST /tokenize`, `POST /v1/completions` and, optionally,
`POST /v1/chunked_kv/feedback`. Tokens are whitespace-separated words (ids
handed out on first sight, `<bos>` in front), as with the demo model.

The answer rule is the key-value task's: the last word is a query key, the
correct answer is the word after that key's first occurrence. That word's
token position `t` decides the phase `t mod len(accuracy)` (`keyed="needle"`,
the default; with `keyed="length"` the prompt's length in tokens decides
it instead, like the DeepSeek-V4 error of vLLM issue #55927), and the server
answers correctly with probability `accuracy[phase]`, drawn from a hash of
the seed and the prompt's words (so a prompt always gets the same answer).

Failure switches for the tests: `fail_first` (the first N completion
requests get HTTP 500), `fail_after` (every completion after N successful
ones gets HTTP 500, until reset), `tokenize=False` (no /tokenize route),
`feedback=False` (no feedback route); `delay_s` slows each completion so
that the tests can see how many requests overlap (`max_in_flight`);
`config_hop` adds `GET /v1/chunked_kv/config` reporting that hop, and
`config` the `chunked_kv` block it reports (window, chunk_size, sink_tokens);
`share_vocab` gives a second server the first one's tokenizer (A/B tests).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def free_port() -> int:
    """A 127.0.0.1 port nothing listens on (for the unreachable-server tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeEndpoint:
    def __init__(
        self,
        accuracy: tuple[float, ...] = (0.95, 0.95, 0.95, 0.55),
        *,
        seed: int = 0,
        model: str = "fake-model",
        tokenize: bool = True,
        feedback: bool = True,
        fail_first: int = 0,
        fail_after: int | None = None,
        delay_s: float = 0.0,
        config_hop: int | None = None,
        config: dict | None = None,
        keyed: str = "needle",
        share_vocab: "FakeEndpoint | None" = None,
    ):
        assert keyed in ("needle", "length"), keyed
        self.keyed = keyed
        self.accuracy = accuracy
        self.seed = seed
        self.model = model
        self.tokenize_enabled = tokenize
        self.feedback_enabled = feedback
        self.fail_first = fail_first
        self.fail_after = fail_after
        self.config_hop = config_hop  # GET /v1/chunked_kv/config answers {"phase_hop": config_hop}
        self.config = config  # ... and {"chunked_kv": config}
        self.delay_s = delay_s  # per completion, to make concurrent requests overlap
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.vocab: dict[str, int] = {"<pad>": 0, "<bos>": 1}
        self.words: list[str] = ["<pad>", "<bos>"]
        if share_vocab is not None:  # another server of the same model: one tokenizer
            self.vocab, self.words, self.lock = share_vocab.vocab, share_vocab.words, share_vocab.lock
        self.completion_requests = 0  # every POST /v1/completions, failed ones included
        self.completions_served = 0
        self.tokenize_requests = 0
        self.issued_ids: set[str] = set()
        self.feedback_posts: list[dict] = []
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle -----------------------------------------------------------
    def __enter__(self) -> "FakeEndpoint":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> str:
        endpoint = self

        class Handler(_Handler):
            fake = endpoint

        self._server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self.base_url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    @property
    def base_url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- model ---------------------------------------------------------------
    def ids(self, text: str, add_special: bool) -> list[int]:
        with self.lock:
            out = [1] if add_special else []
            for word in text.split():
                if word not in self.vocab:
                    self.vocab[word] = len(self.words)
                    self.words.append(word)
                out.append(self.vocab[word])
            return out

    def answer(self, ids: list[int]) -> str:
        """The completion text for a prompt of token ids."""
        words = [self.words[i] for i in ids]
        key = words[-1]
        first = words.index(key)
        if first >= len(words) - 2:
            return " <none>"
        position = first + 1  # token position of the value
        phase = (position if self.keyed == "needle" else len(ids)) % len(self.accuracy)
        # Drawn from the words, not the ids: ids follow the arrival order of
        # concurrent requests, so a draw from them would differ between runs.
        digest = hashlib.sha256(f"{self.seed}:{' '.join(words)}".encode()).digest()
        draw = int.from_bytes(digest[:8], "big") / 2**64
        return " " + words[position] if draw < self.accuracy[phase] else " <wrong>"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog of 5 resets bursts of concurrent connections

    def handle_error(self, request, client_address) -> None:
        pass  # a client that cancels in-flight requests breaks pipes; nothing to report


class _Handler(BaseHTTPRequestHandler):
    fake: FakeEndpoint
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes

    def log_message(self, *args) -> None:  # keep the test output clean
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            return None
        return body if isinstance(body, dict) else None

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.fake.model, "object": "model"}]})
        elif self.path == "/v1/chunked_kv/config" and (self.fake.config_hop or self.fake.config) is not None:
            self._send(200, {"phase_hop": self.fake.config_hop, "chunked_kv": self.fake.config})
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = self._body()
        if self.path == "/tokenize" and self.fake.tokenize_enabled:
            self.fake.tokenize_requests += 1
            tokens = self.fake.ids(body["prompt"], body.get("add_special_tokens", True))
            self._send(200, {"tokens": tokens, "count": len(tokens), "max_model_len": 4096})
        elif self.path == "/v1/completions":
            self._complete(body)
        elif self.path == "/v1/chunked_kv/feedback" and self.fake.feedback_enabled:
            self._feedback(body)
        else:
            self._send(404, {"detail": "Not Found"})

    def _complete(self, body: dict) -> None:
        fake = self.fake
        with fake.lock:
            fake.in_flight += 1
            fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
        try:
            time.sleep(fake.delay_s)
            self._answer(body)
        finally:
            with fake.lock:
                fake.in_flight -= 1

    def _answer(self, body: dict) -> None:
        fake = self.fake
        with fake.lock:
            fake.completion_requests += 1
            failing = fake.completion_requests <= fake.fail_first or (
                fake.fail_after is not None and fake.completions_served >= fake.fail_after
            )
        if failing:
            self._send(500, {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}})
            return
        if body.get("model") != fake.model:
            self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.", "code": 404}})
            return
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else fake.ids(prompt, True)
        text = fake.answer(ids)
        with fake.lock:
            fake.completions_served += 1
            request_id = f"cmpl-{fake.completions_served}"
            fake.issued_ids.add(request_id)
        self._send(
            200,
            {
                "id": request_id,
                "object": "text_completion",
                "model": fake.model,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
            },
        )

    def _feedback(self, body: dict | None) -> None:
        if not body or not isinstance(body.get("request_id"), str) or not isinstance(body.get("correct"), bool):
            self._send(422, {"detail": "request_id (string) and correct (bool) required"})
        elif body["request_id"] not in self.fake.issued_ids:
            self._send(404, {"detail": f"unknown request id {body['request_id']}"})
        else:
            with self.fake.lock:
                self.fake.feedback_posts.append(body)
            self._send(200, {"status": "ok"})
