"""Contract of `vllm_chunked_kv.serving.metric_families` (docs/design.md §6): every metric
is named `vllm_chunked_kv_<noun>_<unit>`, counters end in `_total`, every
metric carries vLLM's base labels, and no label can take unbounded values;
the objects are created once per process and expose exactly the names in
SPECS; docker/README.md carries the table generated from SPECS."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import REGISTRY

from vllm_chunked_kv.serving.metric_families import BASE_LABELS, SPECS, get_metrics, markdown_table

README = Path(__file__).resolve().parents[2] / "docker" / "README.md"
UNIT_SUFFIXES = ("_tokens", "_bytes_per_token", "_ratio", "_info")
# Labels whose values come from a closed set (phase is 0..hop-1).
BOUNDED_LABELS = set(BASE_LABELS) | {
    "phase", "outcome", "backend", "mitigation", "pooling", "keep_boundary", "stagger", "proportional",
}


def test_names_prefix_and_units():
    for spec in SPECS:
        assert re.fullmatch(r"vllm_chunked_kv_[a-z0-9_]+", spec.name), spec.name
        if spec.kind == "counter":
            assert spec.name.endswith("_total"), spec.name
        else:
            assert spec.name.endswith(UNIT_SUFFIXES), spec.name
    assert len({spec.name for spec in SPECS}) == len(SPECS)


def test_labels_are_base_plus_bounded():
    for spec in SPECS:
        assert spec.labels[: len(BASE_LABELS)] == BASE_LABELS, spec.name
        assert set(spec.labels) <= BOUNDED_LABELS, spec.name
        assert "request_id" not in spec.labels


def test_objects_created_once_and_exposed_under_spec_names():
    metrics = get_metrics()
    assert get_metrics() is metrics
    for spec in SPECS:
        base = dict(zip(spec.labels, ["m"] * len(spec.labels)))
        child = metrics[spec.name].labels(**base)
        child.inc(0) if spec.kind == "counter" else child.set(1)
    exposed = {
        sample.name
        for family in REGISTRY.collect()
        if family.name.startswith("vllm_chunked_kv_")
        for sample in family.samples
        if not sample.name.endswith("_created")
    }
    assert exposed == {spec.name for spec in SPECS}


def test_readme_table_matches_code():
    text = README.read_text()
    start, end = "<!-- metrics-table:start -->", "<!-- metrics-table:end -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == markdown_table(), (
        "docker/README.md metrics table is stale; regenerate with "
        "`python -m vllm_chunked_kv.serving.metric_families`"
    )
