"""A real Prometheus server for tests: docker/prometheus/prometheus.yml and
rules.yml with the target replaced and the intervals cut to two seconds.

A scrape may take no longer than the interval; two seconds leave a loaded
2-core machine room to answer /metrics of a vLLM server with two API
processes. A wait that times out says how the target's last scrape went."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from vllm_chunked_kv.runner.server import free_port, start_group, stop_group, wait_ready

DOCKER_PROMETHEUS = Path(__file__).resolve().parents[2] / "docker" / "prometheus"
INTERVAL = "2s"  # scrape and rule evaluation; also the scrape timeout


class PrometheusServer:
    def __init__(self, binary: str, target: str, workdir: Path):
        self.binary, self.target, self.workdir = binary, target, Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def write_config(self) -> Path:
        config = yaml.safe_load((DOCKER_PROMETHEUS / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": INTERVAL, "scrape_timeout": INTERVAL, "evaluation_interval": INTERVAL}
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [self.target]}]
        for name in config.get("rule_files", []):
            shutil.copy(DOCKER_PROMETHEUS / name, self.workdir / name)
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self) -> PrometheusServer:
        config = self.write_config()
        self.proc = start_group(
            [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            self.workdir / "prometheus.log",
        )
        wait_ready(self.proc, f"{self.url}/-/ready", 60, "prometheus", lambda: self.log()[-2000:])
        return self

    def log(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")

    def stop(self) -> None:
        stop_group(self.proc)

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; returns the whole JSON answer (status may be "error")."""
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        return response.json()

    def query(self, expr: str) -> list[dict]:
        """Instant query; raises on a PromQL error."""
        answer = self.api("query", query=expr)
        if answer.get("status") != "success":
            raise AssertionError(f"{expr!r}: {answer.get('errorType')}: {answer.get('error')}")
        return answer["data"]["result"]

    def by_label(self, expr: str, label: str) -> dict[str, float]:
        return {item["metric"].get(label, ""): float(item["value"][1]) for item in self.query(expr)}

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "condition"):
        """Poll predicate() until it returns a truthy value; return that value."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = predicate()
                if value:
                    return value
            except AssertionError as exc:
                last_error = exc
            time.sleep(0.5)
        raise TimeoutError(f"prometheus: {what} not reached in {timeout:.0f}s ({last_error}); {self.targets()}")

    def targets(self) -> str:
        """How each scrape target's last scrape went (health, error, duration)."""
        try:
            active = self.api("targets")["data"]["activeTargets"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            return f"targets unknown ({exc!r})"
        return "; ".join(f"{t.get('scrapeUrl')}: {t.get('health')} {t.get('lastError')!r} "
                         f"in {t.get('lastScrapeDuration')} s" for t in active) or "no active targets"
