"""A real `vllm serve --api-server-count 2` (vLLM's default attention
backend, the configured hop) scraped by a real Prometheus on 127.0.0.1:
after completions, chats and feedback posts, Prometheus' HTTP API returns
the per-phase request and feedback counts the client produced, and the
error rate by phase (directly and through the recording rule, with the
worst-minus-best gap); every expression of the dashboard and the rules
evaluates without error, and the panels the issue asks for show data.

With two API server processes a feedback post may reach the process that
did not serve the completion: every post must still find its phase. The
per-process counter files in the PROMETHEUS_MULTIPROC_DIR vLLM creates
(read from the API server processes' environment) show which process
served each request and each feedback; the test sends one request per phase
per round until at least one feedback was answered by the other process."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import httpx
import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.runner.server import VllmServer

from .dashboard_queries import dashboard_exprs, rule_exprs, template_queries
from .prometheus_server import PrometheusServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

SECTION = {"chunk_size": 16, "mitigation": "overlap", "window": 32}
HOP = ChunkedKVConfig.from_additional_config({"chunked_kv": SECTION}).hop  # 8
MAX_ROUNDS = 8


def descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def vllm_multiproc_dir(server_pid: int) -> Path:
    """The PROMETHEUS_MULTIPROC_DIR vLLM set before spawning its API servers."""
    for pid in descendants(server_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                return Path(item.split(b"=", 1)[1].decode())
    raise AssertionError("no API server process has PROMETHEUS_MULTIPROC_DIR")


@pytest.fixture(scope="module")
def stack(tiny_llama, prometheus_binary, tmp_path_factory):
    args = ["--api-server-count", "2", "--max-model-len", "128",
            "--additional-config", json.dumps({"chunked_kv": SECTION})]
    with pytest.MonkeyPatch.context() as patch:
        # Left unset, as in production: vLLM creates (and removes) the directory.
        patch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        server = VllmServer(tiny_llama, args)  # its default VLLM_PLUGINS names the three
    with server:
        multiproc_dir = vllm_multiproc_dir(server.proc.pid)
        prometheus = PrometheusServer(prometheus_binary, f"127.0.0.1:{server.port}",
                                      tmp_path_factory.mktemp("prometheus")).start()
        try:
            model = str(server.model)
            # Every phase series scraped at 0 before any traffic.
            prometheus.wait_for(
                lambda: len(prometheus.query(f'vllm_chunked_kv_requests_total{{model_name="{model}"}}')) == HOP,
                what="first scrape of the phase series",
            )
            yield server, prometheus, multiproc_dir
        finally:
            prometheus.stop()


def per_process(multiproc_dir: Path, metric: str) -> dict[str, Counter]:
    """pid file -> Counter(label tuple -> value) of one counter, from prometheus_client's files."""
    from prometheus_client.mmap_dict import MmapedDict

    out: dict[str, Counter] = {}
    for path in multiproc_dir.glob("counter_*.db"):
        values = Counter()
        for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
            _, name, labels, _ = json.loads(key)
            if name == metric:
                values[labels["phase"], labels.get("outcome", "")] += value
        out[path.name] = values
    return out


def served_by(before: dict[str, Counter], after: dict[str, Counter], phase: int) -> set[str]:
    return {pid for pid, values in after.items()
            if sum(v for (p, _), v in values.items() if p == str(phase))
            > sum(v for (p, _), v in before.get(pid, Counter()).items() if p == str(phase))}


def fresh_post(url: str, body: dict) -> httpx.Response:
    # A new connection per call, so the kernel may hand it to either API server.
    return httpx.post(url, json=body, headers={"Connection": "close"}, timeout=60)


@pytest.fixture(scope="module")
def traffic(stack):
    """Send the load once; return what the client knows it sent."""
    server, _, multiproc_dir = stack
    model = str(server.model)
    requests, feedback = Counter(), Counter()
    crossings = 0
    for round_index in range(MAX_ROUNDS):
        ids = {}
        before = per_process(multiproc_dir, "vllm_chunked_kv_requests_total")
        for phase in range(HOP):
            words = (phase - 1) % HOP + HOP  # <bos> + words == phase (mod hop)
            response = fresh_post(f"{server.base_url}/v1/completions", {
                "model": model, "prompt": " ".join(f"w{i}" for i in range(words)), "max_tokens": 1})
            response.raise_for_status()
            body = response.json()
            assert body["usage"]["prompt_tokens"] % HOP == phase
            ids[phase] = body["id"]
            requests[phase] += 1
        after = per_process(multiproc_dir, "vllm_chunked_kv_requests_total")
        fb_before = per_process(multiproc_dir, "vllm_chunked_kv_feedback_total")
        for phase, request_id in ids.items():
            correct = not (phase % 4 == 0 or (round_index == 0 and phase % 2 == 1))
            response = fresh_post(f"{server.base_url}/v1/chunked_kv/feedback",
                                  {"request_id": request_id, "correct": correct})
            assert response.status_code == 200, response.text
            assert response.json()["phase"] == phase
            feedback[phase, "correct" if correct else "incorrect"] += 1
        fb_after = per_process(multiproc_dir, "vllm_chunked_kv_feedback_total")
        crossings += sum(served_by(before, after, p) != served_by(fb_before, fb_after, p) for p in range(HOP))
        if round_index >= 1 and crossings:
            break
    # A few chats too: their phase is whatever the chat template makes it.
    for words in (1, 2, 3):
        response = fresh_post(f"{server.base_url}/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": " ".join(["w5"] * words)}], "max_tokens": 1})
        response.raise_for_status()
        body = response.json()
        phase = body["usage"]["prompt_tokens"] % HOP
        requests[phase] += 1
        assert fresh_post(f"{server.base_url}/v1/chunked_kv/feedback",
                          {"request_id": body["id"], "correct": False}).status_code == 200
        feedback[phase, "incorrect"] += 1
    return {"requests": requests, "feedback": feedback, "crossings": crossings,
            "processes": per_process(multiproc_dir, "vllm_chunked_kv_requests_total")}


def expected_error_rate(feedback: Counter) -> dict[str, float]:
    phases = {phase for phase, _ in feedback}
    return {str(p): feedback[p, "incorrect"] / (feedback[p, "incorrect"] + feedback[p, "correct"]) for p in phases}


def test_feedback_found_its_phase_across_processes(traffic):
    busy = [pid for pid, values in traffic["processes"].items() if sum(values.values()) > 0]
    assert len(busy) == 2, traffic["processes"]
    assert traffic["crossings"] > 0, "no feedback post reached the other API server process"


def test_prometheus_has_the_per_phase_counts(stack, traffic):
    server, prometheus, _ = stack
    selector = f'model_name="{server.model}"'
    expected = {str(p): float(traffic["requests"][p]) for p in range(HOP)}  # 0 for a phase never served
    prometheus.wait_for(
        lambda: prometheus.by_label(f"sum by (phase) (vllm_chunked_kv_requests_total{{{selector}}})", "phase")
        == expected,
        what="request counts by phase",
    )
    expected_feedback = {(str(p), o): float(n) for (p, o), n in traffic["feedback"].items()}

    def feedback_counts():
        result = prometheus.query(f"sum by (phase, outcome) (vllm_chunked_kv_feedback_total{{{selector}}}) > 0")
        return {(m["metric"]["phase"], m["metric"]["outcome"]): float(m["value"][1]) for m in result}

    prometheus.wait_for(lambda: feedback_counts() == expected_feedback, what="feedback counts by phase and outcome")


def test_prometheus_error_rate_by_phase(stack, traffic):
    server, prometheus, _ = stack
    selector = f'model_name="{server.model}"'
    expected = expected_error_rate(traffic["feedback"])
    assert len(set(expected.values())) > 1  # the phases differ, so the gap is not 0

    def matches(expr: str) -> bool:
        got = prometheus.by_label(expr, "phase")
        got = {p: v for p, v in got.items() if v == v}  # NaN: a phase without feedback
        return got.keys() == expected.keys() and all(got[p] == pytest.approx(expected[p], abs=1e-9) for p in got)

    direct = (f'sum by (phase) (vllm_chunked_kv_feedback_total{{{selector},outcome="incorrect"}})'
              f' / sum by (phase) (vllm_chunked_kv_feedback_total{{{selector}}})')
    prometheus.wait_for(lambda: matches(direct), what="error rate by phase")
    recorded = f"model_name_phase:vllm_chunked_kv_feedback_errors:ratio_rate5m{{{selector}}}"
    prometheus.wait_for(lambda: matches(recorded), what="recorded error rate by phase")
    gap = max(expected.values()) - min(expected.values())
    prometheus.wait_for(
        lambda: (got := prometheus.by_label(f"model_name:vllm_chunked_kv_phase_error_gap:ratio_rate5m{{{selector}}}",
                                            "model_name"))
        and got.get(str(server.model)) == pytest.approx(gap, abs=1e-9),
        what="worst-minus-best gap",
    )


def test_every_dashboard_and_rule_expression_evaluates(stack, traffic):
    server, prometheus, _ = stack
    model_regex = str(server.model)  # a path: its '.' and '-' match themselves too
    for title, expr in {**dashboard_exprs(model_regex), **rule_exprs()}.items():
        prometheus.query(expr)  # raises with Prometheus' error message
    # The panels the issue names show data, not just parse.
    nonempty = ["Finished requests by phase / A", "Error rate by phase (5m) / A",
                "Error rate by phase (dashboard range) / A", "Compression ratio / A", "KV cache usage / A",
                "End-to-end latency / B", "KV capacity / A", "Active configuration / A"]
    exprs = dashboard_exprs(model_regex)
    for title in nonempty:
        prometheus.wait_for(lambda: prometheus.query(exprs[title]), what=f"data for {title!r}")
    for metric, label in template_queries():
        values = prometheus.api(f"label/{label}/values", **{"match[]": metric})["data"]
        assert str(server.model) in values


def test_config_route_on_both_processes(stack):
    server, _, _ = stack
    views = [httpx.get(f"{server.base_url}/v1/chunked_kv/config", headers={"Connection": "close"}, timeout=10).json()
             for _ in range(6)]
    assert all(view == views[0] for view in views)
    assert views[0]["feedback_store"]["kind"] == "sqlite"
    assert views[0]["phase_hop"] == HOP and views[0]["compression_active"] is False
