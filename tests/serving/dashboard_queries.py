"""Every PromQL expression the compose stack ships: the Grafana dashboard's
targets (with Grafana's variables given test values) and the Prometheus
rules' expressions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "chunked-kv.json"
RULES = DOCKER / "prometheus" / "rules.yml"

GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "15s", "$model_name": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict | None = None) -> list[dict]:
    """Every panel, rows' nested panels included."""
    board = board or dashboard()
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def substitute(expr: str, model_name: str = ".*") -> str:
    values = {**GRAFANA_VARIABLES, "$model_name": model_name}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(name, values[name])
    if re.search(r"\$\w", expr):
        raise ValueError(f"unsubstituted Grafana variable in {expr!r}")
    return expr


def dashboard_exprs(model_name: str = ".*") -> dict[str, str]:
    """'panel title / refId' -> expression ready for Prometheus."""
    return {
        f"{panel['title']} / {target['refId']}": substitute(target["expr"], model_name)
        for panel in panels()
        for target in panel.get("targets", [])
    }


def rule_exprs() -> dict[str, str]:
    """'record or alert name' -> expression."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule.get("record") or rule["alert"]: rule["expr"] for group in groups for rule in group["rules"]}


def template_queries() -> list[tuple[str, str]]:
    """(metric, label) of each `label_values(metric, label)` template variable."""
    out = []
    for variable in dashboard()["templating"]["list"]:
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        if match is None:
            raise ValueError(f"unexpected template query {query!r}")
        out.append((match.group(1), match.group(2)))
    return out
