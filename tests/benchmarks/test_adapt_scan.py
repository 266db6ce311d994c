"""Contract of benchmarks/adapt_scan.py, on the tiny Llama through a real `vllm serve`.

- `measure` serves a model directory as its `chunked_kv_serve.json` says
  (the server reports that file's window on its config route) and scans the shipped prose
  task with the needles placed beyond the requested window: every needle's
  distance is at least that window plus a chunk, and a longer window gives
  longer prompts with the needles further back; `context` asks for the long
  prompts of `demo --context` instead; `resume` goes on with a scan cut off,
  asking only the probes its `out` has no answer for.
- The result counts every probe, its Wilson interval contains the accuracy,
  its phases (0..hop-1) add up to the probes and the correct ones, and the
  distractor misses and the reordered misses are subsets of the misses.
- `reordered` is true for the right digits in another order only;
  `adjacent_swap` names the first of two swapped neighbours, only for a
  single swap of neighbours; the swaps by pair phase, one count per phase,
  add up to at most the reordered misses.
- `hits_by_needle` groups the probes by the needle (task record) they ask
  about, one outcome a phase; `by_needle_ci` takes those groups as clusters:
  when each needle is right at all its phases or at none, its interval is
  the one of the needles alone, wider than the probes' Wilson interval.
- `distractor_code` finds each task line's in-window distractor code, and
  `line_of` maps a scanner record to the line it asked about; a miss counts
  as the distractor's only when it is that prompt's own distractor code.
"""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_chunked_kv.demo import real_model
from vllm_chunked_kv.core.serve_file import SERVE_FILE
from vllm_chunked_kv.runner.server import ONE_PROCESS_ARGS

SETTINGS = {"chunk_size": 4, "window": 32, "sink_tokens": 4, "stagger": "heads"}


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("adapt_scan")


@pytest.fixture
def adapted_dir(tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / SERVE_FILE).write_text(json.dumps({"attention_backend": "chunked_kv",
                                                "additional_config": {"chunked_kv": SETTINGS}}))
    return model


def test_distractor_code_per_line(bench):
    lines = bench.task_lines()
    codes = [bench.distractor_code(line) for line in lines]
    assert len(lines) == len(real_model.TASK_FILE.read_text().splitlines())
    assert all(code and code.isdigit() and len(code) == 4 for code in codes)
    assert all(code not in line["record"] for code, line in zip(codes, lines))  # not the asked code
    assert bench.distractor_code({"template": "no record here"}) is None
    assert bench.line_of({"probe_id": "needle:2:1"}, lines) is lines[1]
    assert bench.line_of({"probe_id": f"needle:0:{len(lines) + 3}"}, lines) is lines[3]


def test_by_needle_ci_clusters_the_phases_of_a_needle(bench):
    lines = bench.task_lines()
    # needles 0..9 asked at 4 phases each (probe ids needle:phase:i, line i mod lines)
    records = [{"probe_id": f"needle:{phase}:{i}", "correct": i < 6} for i in range(10) for phase in range(4)]
    hits = bench.hits_by_needle(records, lines)
    assert len(hits) == 10 and all(len(h) == 4 for h in hits.values())
    assert sorted(sum(h) for h in hits.values()) == [0] * 4 + [4] * 6
    clustered = bench.by_needle_ci(hits)
    assert clustered["n_eff"] == pytest.approx(9, abs=0.05)  # 10 needles, less the finite-cluster factor
    low, high = clustered["ci"]
    plain = bench.wilson(24, 40)
    assert low < plain[0] and high > plain[1]


def test_reordered(bench):
    assert bench.reordered("7313", " 7331.") and bench.reordered("5983", "5938")
    assert not bench.reordered("7313", " 7313.")  # right
    assert not bench.reordered("7313", " 731.\n") and not bench.reordered("7313", "7314")  # a digit lost or wrong


def test_adjacent_swap(bench):
    assert bench.adjacent_swap("7313", " 7331.") == 2 and bench.adjacent_swap("8299", "8929") == 1
    assert bench.adjacent_swap("5983", "9583") == 0
    assert bench.adjacent_swap("7313", "7313") is None  # right
    assert bench.adjacent_swap("1234", "3214") is None and bench.adjacent_swap("1234", "2143") is None  # not one neighbour swap
    assert bench.adjacent_swap("7313", "731") is None and bench.adjacent_swap("7313", "7314") is None


@pytest.mark.slow
@pytest.mark.server
def test_measure_places_needles_beyond_the_window(bench, adapted_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(real_model, "SERVE_DEFAULTS", ONE_PROCESS_ARGS)
    near = bench.measure(adapted_dir, 128, 4, False, tmp_path / "near")
    far = bench.measure(adapted_dir, 256, 4, False, tmp_path / "far")
    for result, window in ((near, 128), (far, 256)):
        assert result["window"] == window and result["served"] == SETTINGS
        assert result["server_window"] == SETTINGS["window"]
        assert result["probes"] == 16 and result["distance"][0] >= window + SETTINGS["chunk_size"]
        lo, hi = result["accuracy_ci"]
        assert lo <= result["accuracy"] <= hi
        lo, hi = result["accuracy_ci_by_needle"]["ci"]
        assert lo <= result["accuracy"] <= hi and result["accuracy_ci_by_needle"]["n_eff"] <= result["probes"]
        assert 0 <= result["misses_distractor"] <= result["probes"] - result["correct"]
        assert 0 < result["needles"] <= result["probes"]
        assert 0 <= result["misses_reordered"] <= result["probes"] - result["correct"]
        phases = result["by_phase"]
        assert sorted(result["swaps_by_pair_phase"]) == sorted(phases)
        assert sum(result["swaps_by_pair_phase"].values()) <= result["misses_reordered"]
        assert sorted(phases) == [str(p) for p in range(SETTINGS["chunk_size"])]
        assert sum(g["n"] for g in phases.values()) == result["probes"]
        assert sum(g["correct"] for g in phases.values()) == result["correct"]
    assert far["prompt_tokens"][0] > near["prompt_tokens"][1] and far["distance"][0] > near["distance"][0]
    assert (near["resumed"], near["sent"]) == (0, 16)
    # a scan cut off after 10 answers goes on with the 6 it had not asked
    records = (tmp_path / "near" / "records.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "near" / "records.jsonl").write_text("".join(records[:10]))
    resumed = bench.measure(adapted_dir, 128, 4, False, tmp_path / "near", resume=True)
    assert (resumed["resumed"], resumed["sent"], resumed["probes"]) == (10, 6, 16)


def test_long_prompts_go_to_the_scan(bench, adapted_dir, tmp_path, monkeypatch):
    """`--context N` reaches the scan as `demo --context N` places its needles, and
    `--kv-cache-dtype` as the server's page format."""
    seen = {}

    def scan_mode(model, settings, per_phase, out, **kwargs):
        seen.update(kwargs, settings=settings)
        raise StopIteration

    monkeypatch.setattr(real_model, "scan_mode", scan_mode)
    with pytest.raises(StopIteration):
        bench.measure(adapted_dir, 128, 4, False, tmp_path / "long", context=4096, kv_cache_dtype="fp8")
    assert seen["context"] == 4096 and seen["settings"] == SETTINGS and seen["kv_cache_dtype"] == "fp8"
