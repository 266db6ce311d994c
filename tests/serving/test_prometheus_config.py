"""Contract of docker/prometheus and docker/grafana, without Docker:
promtool accepts the scrape config and the rules; the rules' unit tests
(rules_test.yml) hold, so the error-rate recording rule computes
incorrect / all per phase and the gap alert fires only on a large gap with
enough ratings; every dashboard expression parses (promtool checks them as
recording rules); every panel uses the provisioned datasource and the
dashboard provider points where compose mounts the dashboards. That every
expression also evaluates against live data is test_serve_prometheus.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from .dashboard_queries import DOCKER, RULES, dashboard, dashboard_exprs, panels, template_queries

HERE = Path(__file__).resolve().parent


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_config(promtool):
    result = _run([promtool, "check", "config", "prometheus.yml"], DOCKER / "prometheus")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules(promtool):
    result = _run([promtool, "check", "rules", RULES.name], RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests(promtool):
    result = _run([promtool, "test", "rules", "rules_test.yml"], HERE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_expression_parses(promtool, tmp_path):
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:expr_{i}", "expr": expr} for i, expr in enumerate(exprs.values())
    ]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = _run([promtool, "check", "rules", str(path)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_panels_use_the_provisioned_datasource():
    datasources = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["url"] == "http://prometheus:9090"
    board = dashboard()
    ids = [panel["id"] for panel in panels(board)]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]
    assert template_queries() == [("vllm_chunked_kv_config_info", "model_name")]


def test_dashboard_covers_the_issue_panels():
    text = " ".join(dashboard_exprs().values())
    for needle in ("vllm_chunked_kv_requests_total", "vllm_chunked_kv_feedback_errors:ratio_rate5m",
                   "vllm_chunked_kv_compression_ratio", "vllm:kv_cache_usage_perc",
                   "vllm:e2e_request_latency_seconds_bucket"):
        assert needle in text, needle


def test_provider_path_matches_compose_mount():
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./grafana/dashboards:{path}:ro" in mounts
