"""Each shipped adapter's card, `models/adapters/<model>/ADAPT.md`, is rendered from the files beside it.

- ADAPT.md is exactly what `render_card` makes now of adapter.json, train_log.jsonl,
  served.json and chunked_kv_serve.json, so the page cannot drift from them
  (regenerate: `python -m vllm_chunked_kv.adapt.report --card DIR`);
- every figure of served.json appears in it, each retrieval figure with its
  interval and sample count;
- every figure of served.json is its result file's, rounded (served.json
  invents nothing), its needles placed as the row's command says, and every
  run's record folder exists;
- every shipped adapter has its card (a served.json beside it);
- `--check` says whether a card is up to date, without writing it.
- A hybrid model's card (gains learned only on the layers that pool, grid
  origins listed per layer, the sliding-window layers' treatment) names the
  pooling layers and summarises only their gains; a run resumed across
  machines shows what each machine's part cost.
- The ADAPT.md that `adapt` writes for a run resumed across processes gives
  the whole run's training time and peak memory, not only its last process's,
  and its time on each machine the steps ran on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_chunked_kv.adapt import report

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = sorted(p.parent for p in (ROOT / "vllm_chunked_kv" / "models" / "adapters").glob("*/served.json"))
ADAPTER = ADAPTERS[0]  # the card renderer's own checks use one of them
SERVED = json.loads((ADAPTER / "served.json").read_text())
each_adapter = pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda p: p.name)


def served(adapter: Path) -> dict:
    return json.loads((adapter / "served.json").read_text())


ROWS = [(adapter, row) for adapter in ADAPTERS for row in served(adapter)["retrieval"]]


def numbers(node):
    """Every number under a served.json node (booleans are not figures)."""
    if isinstance(node, bool):
        return
    if isinstance(node, (int, float)):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from numbers(value)
    elif isinstance(node, list):
        for value in node:
            yield from numbers(value)


def shown(value) -> set[str]:
    """The ways a figure may be written on the page: 1024 as "1,024", 12.8 as "12.8" or "12.80"."""
    if isinstance(value, int):
        return {f"{value:,}", str(value)}
    return {str(value), f"{value:.1f}", f"{value:.2f}", f"{value:.3f}"} - {f"{value:.0f}"}


def test_every_shipped_adapter_has_a_card():
    shipped = sorted(p.parent for p in (ROOT / "vllm_chunked_kv" / "models" / "adapters").glob("*/adapter.json"))
    assert shipped and ADAPTERS == shipped


@each_adapter
def test_the_shipped_card_is_what_the_generator_renders_now(adapter):
    assert (adapter / "ADAPT.md").read_text() == report.render_card(adapter), (
        f"ADAPT.md is out of date: run `python -m vllm_chunked_kv.adapt.report --card {adapter.relative_to(ROOT)}`")


@each_adapter
def test_every_served_figure_appears_on_the_card(adapter):
    card, figures_of = (adapter / "ADAPT.md").read_text(), served(adapter)
    figures = [v for key in ("retrieval", "perplexity", "runs") for v in numbers(figures_of[key])]
    assert len(figures) > 40
    missing = [v for v in figures if not any(s in card for s in shown(v))]
    assert not missing, missing
    for row in figures_of["retrieval"]:
        assert f"{row['percent']:.1f} [{row['ci'][0]:.1f}, {row['ci'][1]:.1f}] | {row['n']:,} |" in card, row["name"]
        assert f"{row['gap']:.1f} [{row['gap_ci'][0]:.1f}, {row['gap_ci'][1]:.1f}]" in card, row["name"]
        assert row["command"] in card and row["result"] in card
    for key in ("base_full_attention", "chunked", "default_backend"):
        assert figures_of["perplexity"][key]["command"] in card and figures_of["perplexity"][key]["result"] in card
    for run in figures_of["runs"]:
        assert run["command"] in card and run["record"] in card


def _pct(x: float) -> float:
    return round(100 * x, 1)


@pytest.mark.parametrize("adapter, row", ROWS, ids=lambda x: x.name if isinstance(x, Path) else x["name"])
def test_retrieval_figures_are_their_result_files(adapter, row):
    scan = json.loads((ROOT / row["result"]).read_text())
    assert row["percent"] == _pct(scan["accuracy"]) and row["n"] == scan["probes"]
    assert row["ci"] == [_pct(c) for c in scan["accuracy_ci"]]
    assert row["gap"] == _pct(scan["gap"]["value"]) and row["gap_ci"] == [_pct(c) for c in scan["gap"]["ci"]]
    assert row["by_phase"] == [_pct(scan["by_phase"][str(p)]["accuracy"]) for p in range(4)]
    assert row["misses"] == scan["probes"] - scan["correct"]
    assert (row["reordered"], row["distractor"]) == (scan["misses_reordered"], scan["misses_distractor"])
    # the needles were placed as the row's command says: for --context prompts, or beyond --window (default 128)
    if scan.get("context"):
        assert f"--context {scan['context']}" in row["command"]
    else:
        window = scan["window"]
        assert f"--window {window}" in row["command"] or (window == 128 and "--window" not in row["command"])
    assert (scan["served"] == "default backend") == ("default backend" in row["serving"])


@each_adapter
def test_perplexity_figures_are_their_result_files(adapter):
    ppl = served(adapter)["perplexity"]

    def mode(fig, name):
        rows = json.loads((ROOT / fig["result"]).read_text())["rows"]
        return next(r for r in rows if r["mode"] == name)

    base = mode(ppl["base_full_attention"], "default")
    chunked, default = mode(ppl["chunked"], "served"), mode(ppl["default_backend"], "default")
    assert ppl["base_full_attention"]["value"] == round(base["ppl"], 2)
    assert ppl["chunked"]["value"] == round(chunked["ppl"], 2)
    assert ppl["default_backend"]["value"] == round(default["ppl"], 2)
    assert ppl["ratio"] == round(chunked["ppl"] / base["ppl"], 3)
    assert ppl["chunked"]["far_repeats"] == round(chunked["ppl_by_repeat"]["far"]["ppl"], 2)
    assert ppl["default_backend"]["far_repeats"] == round(default["ppl_by_repeat"]["far"]["ppl"], 2)
    assert ppl["far_repeat_tokens"] == chunked["ppl_by_repeat"]["far"]["tokens"]


@each_adapter
def test_every_run_has_its_record(adapter):
    runs = served(adapter)["runs"]
    for run in runs:
        assert (ROOT / run["record"]).is_dir(), run["record"]
    assert runs[-1]["steps"] == json.loads((adapter / "adapter.json").read_text())["options"]["steps"]


def test_check_reports_a_stale_card_and_writes_nothing(tmp_path, capsys):
    for name in report.CARD_INPUTS:
        (tmp_path / name).write_bytes((ADAPTER / name).read_bytes())
    assert report.main(["--card", str(tmp_path), "--check"]) == 1
    assert not (tmp_path / "ADAPT.md").exists() and "out of date" in capsys.readouterr().out
    assert report.main(["--card", str(tmp_path)]) == 0
    assert (tmp_path / "ADAPT.md").read_text() == (ADAPTER / "ADAPT.md").read_text()
    assert report.main(["--card", str(tmp_path), "--check"]) == 0


def test_the_card_fetches_the_base_model_served_json_names(tmp_path):
    """The runs' commands start from the base model `served.json` names (`model`), not a fixed one."""
    for name in report.CARD_INPUTS:
        (tmp_path / name).write_bytes((ADAPTER / name).read_bytes())
    served = {**SERVED, "model": "gemma3-270m"}
    (tmp_path / "served.json").write_text(json.dumps(served))
    card = report.render_card(tmp_path)
    assert "B=$(vllm-chunked-kv models fetch gemma3-270m | tail -1)" in card.splitlines()
    assert "B=$(vllm-chunked-kv models fetch smollm2-135m | tail -1)" not in card.splitlines()


def test_a_resumed_run_reports_the_time_of_all_its_processes(tmp_path):
    from vllm_chunked_kv.adapt import train
    from vllm_chunked_kv.core.config import ChunkedKVConfig

    log = tmp_path / "train_log.jsonl"
    steps = [(1, None, None, None), (2, 7, 600.0, "A"), (3, 7, 1200.0, "A"), (3, 9, 660.0, "B"),
             (4, 9, 1260.0, "B")]  # no clock, then two processes on two machines
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0, "kl": 0.5, "ce": 0.5,
                                       **({"process": p, "machine": m, "seconds": t, "cpu_seconds": 2 * t,
                                           "peak_gib": 3.0} if t else {})}) + "\n"
                           for s, p, t, m in steps))
    cfg = ChunkedKVConfig(chunk_size=4, window=16)
    card = report.write_report(tmp_path, ["adapt", "M"], cfg, train.AdaptOptions(), 1260.0, log).read_text()
    assert ("- the whole run, resumed in 2 processes: 41.0 min of training (1.37 CPU hours), peak resident "
            "memory 3.0 GiB (not counted: 1 steps logged without a clock); by machine: "
            "A: 2 steps, 20.0 min (0.67 CPU hours); B: 2 steps, 21.0 min (0.70 CPU hours)") in card


def test_a_hybrid_models_card_summarises_the_layers_that_pool(tmp_path):
    for name in report.CARD_INPUTS:
        (tmp_path / name).write_bytes((ADAPTER / name).read_bytes())
    gains = [[0.25] * 4 for _ in range(18)]
    gains[5], gains[11], gains[17] = [0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1]
    meta = json.loads((tmp_path / "adapter.json").read_text())
    (tmp_path / "adapter.json").write_text(json.dumps({**meta, "slot_gains": gains}))
    stagger = [[layer % 4] for layer in range(18)]
    serve = json.loads((tmp_path / "chunked_kv_serve.json").read_text())
    settings = serve["additional_config"]["chunked_kv"]
    settings.update(slot_gains=gains, stagger=stagger, sliding_window_layers="window")
    settings.pop("stagger_groups", None)
    (tmp_path / "chunked_kv_serve.json").write_text(json.dumps(serve))

    card = report.render_card(tmp_path)
    assert ("grid origins per layer and KV head `stagger: [[0],[1],[2],[3],[0],[1],[2],[3],[0],[1],[2],[3],[0],[1],"
            "[2],[3],[0],[1]]`, the model's sliding-window layers `sliding_window_layers: window`, pooling `gated` "
            "with one set of 4 slot gains per layer (18 layers)") in card
    assert ("Slot gains learned (`adapter.json`), over the 3 layers that pool (5, 11, 17; the other 15 keep the "
            "mean: nothing of theirs is pooled):") in card
    assert "| min | 0.100 | 0.300 | 0.200 | 0.100 |" in card  # the 15 layers at 0.25 left out
    assert "Slot 1 has the largest gain in 2 of the 3 layers" in card


def test_a_run_resumed_across_machines_shows_each_part(tmp_path):
    for name in report.CARD_INPUTS:
        (tmp_path / name).write_bytes((ADAPTER / name).read_bytes())
    run = {**SERVED["runs"][-1], "cpu_hours": 9.5, "by_machine": [
        {"machine": "2 threads of AMD EPYC (AVX2), fp32", "steps": 75, "minutes": 181.0, "cpu_hours": 5.5},
        {"machine": "2 threads of AMD EPYC (AVX-512 BF16), bf16", "steps": 225, "minutes": 250.0, "cpu_hours": 4.0}]}
    (tmp_path / "served.json").write_text(json.dumps({**SERVED, "runs": [*SERVED["runs"][:-1], run]}))
    card = report.render_card(tmp_path)
    assert (f"Run {len(SERVED['runs'])}, resumed across machines (9.50 CPU hours in all): 2 threads of AMD EPYC "
            "(AVX2), fp32: 75 steps, 181.0 min, 5.50 CPU hours; 2 threads of AMD EPYC (AVX-512 BF16), bf16: "
            "225 steps, 250.0 min, 4.00 CPU hours.") in card.splitlines()
