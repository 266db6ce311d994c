"""`vllm-chunked-kv demo` contract: the table has one row per mode with KV
rows per token taken from the config; the "stagger fine-tuned" mode serves
the staggered fine-tune (`--stagger-model`, by default the shipped
`demo/model_stagger`) with the compression that model says it was trained
under, every other mode serves `--model`; the summary's phase groups cover
the prompts; the command runs end to end on the shipped models (quick, two
modes) and writes demo.json and demo.png."""

from __future__ import annotations

import argparse
import json

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.demo import cli
from vllm_chunked_kv.core.serve_file import read_serve_config


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_rows_per_token_follow_the_mitigation_table():
    args = _args()
    rows = {mode: cli.rows_per_token(cli.mode_settings(mode, args)) for mode in cli.MODES}
    assert rows == {"default backend": 1.0, "none": 0.25, "boundary": 0.75, "overlap": 0.5, "stride2": 0.5,
                    "stagger": 0.25, "none aligned": 0.25, "none dynamic": 0.5, "stagger fine-tuned": 0.25}


def test_stagger_fine_tuned_mode_serves_its_model_as_trained():
    args = _args()
    assert cli.mode_model("stagger fine-tuned", args) == cli.DEFAULT_STAGGER_MODEL_DIR
    assert {cli.mode_model(m, args) for m in cli.MODES if m != "stagger fine-tuned"} == {cli.DEFAULT_MODEL_DIR}
    assert cli.mode_model("stagger fine-tuned", _args("--stagger-model", "/elsewhere")).as_posix() == "/elsewhere"
    served = ChunkedKVConfig.from_additional_config({"chunked_kv": cli.mode_settings("stagger fine-tuned", args)})
    trained = read_serve_config(cli.DEFAULT_STAGGER_MODEL_DIR)
    for field in ("chunk_size", "hop", "window", "sink_tokens", "pooling", "keep_boundary", "proportional"):
        assert getattr(served, field) == getattr(trained, field), field
    assert [served.origins(layer, 2) for layer in range(2)] == [trained.origins(layer, 2) for layer in range(2)]


def test_missing_model_directory_is_an_error(tmp_path):
    args = _args("--modes", "none,stagger fine-tuned", "--stagger-model", str(tmp_path / "absent"),
                 "--out", str(tmp_path / "out"))
    assert cli.run(args) == 1


def test_summary_groups_cover_every_prompt():
    prompts = cli.build_prompts(8, seed=1)
    correct = [p.target_position % 4 != 3 for p in prompts]  # phase 3 always wrong
    row = cli.summarise("none", {"mitigation": "none"}, prompts, correct)
    assert sum(g["n"] for g in row["phases"]) == len(prompts) == 64
    assert row["gap"]["worst"] == 3 and row["gap"]["value"] == pytest.approx(1.0)
    assert "| none |" in cli.format_table([row])


@pytest.mark.slow
@pytest.mark.engine
def test_demo_runs_end_to_end(tmp_path):
    if not (cli.DEFAULT_MODEL_DIR / "config.json").exists():
        pytest.fail("the demo model is not shipped in vllm_chunked_kv/demo/model")
    code = cli.run(_args("--per-phase", "8", "--modes", "default backend,stagger fine-tuned", "--out", str(tmp_path)))
    assert code == 0
    data = json.loads((tmp_path / "demo.json").read_text())
    assert [r["mode"] for r in data["rows"]] == ["default backend", "stagger fine-tuned"]
    assert [r["model"] for r in data["rows"]] == [str(cli.DEFAULT_MODEL_DIR), str(cli.DEFAULT_STAGGER_MODEL_DIR)]
    assert (tmp_path / "demo.png").stat().st_size > 1000
