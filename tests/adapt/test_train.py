"""Contract of the adaptation loop (`adapt.train`) on a tiny byte-level Llama.

- The learning rate warms up linearly and decays by cosine to a tenth.
- A step's batch is `text_rows` text rows, then `repeat_rows` repeat rows,
  then retrieval rows, the last `full_rows` at full attention (text in odd
  steps, retrieval in even ones); counts that do not fit in `rows` are
  refused by name; a batch with no full-attention rows, or only those,
  trains too (and the first step's KL shows which attention ran).
- Training lowers the loss: on a batch repeated every step, the loss of the
  last steps is well below that of the first (the update direction is right;
  the real run's curve is in the adapted model's ADAPT.md).
- A run stopped after a few steps and started again on the same work
  directory resumes from its checkpoint and ends with exactly the adapters
  of an uninterrupted run (same seed, same threads).
- Only the adapters change: the base weights are untouched.
- Learned gains (`learn_gains`): the chunked rows' slot gains train with the
  adapters (they leave the uniform start, so the chunked forward used them),
  resume like the adapters, and are served as pooling "gated" on the same
  grid; settings they cannot replace the mean of are refused by name, as is
  a checkpoint written with the other choice. A run started from a saved
  adapter with gains (`init_adapter`) starts from its gains.
- Gains per layer (`gains_per_layer`): each layer learns its own, served as
  per-layer slot_gains (each layer's settings pool with its row); a run of
  them can start from a model-wide set (every layer starts there), not the
  other way round, and a checkpoint of one kind does not resume the other.
- Precision: bf16 autocast only where asked or (auto) where the training
  device has native bf16; fp32 otherwise; anything else is refused by name.
- Device: auto trains on the first CUDA GPU when torch sees one, else on the
  CPU; a GPU asked for where there is none, or a device that is neither, is
  refused by name before the model is touched. On a GPU (skipped elsewhere)
  the adapters train there and the saved state comes back to the CPU.
- Cost: every logged step names its process and what it ran on (the GPU, or
  the CPU's threads, model and instruction set, and the precision) and
  carries that process's wall and CPU time and peak memory, so a run resumed
  across processes, and machines, adds up to what it cost on each
  (`process_totals`).
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_chunked_kv.adapt import lora, train
from vllm_chunked_kv.core.config import ChunkedKVConfig
from tests.adapt.conftest import tiny_byte_llama

pytestmark = pytest.mark.slow

CFG = ChunkedKVConfig(chunk_size=4, window=64, sink_tokens=4, stagger="heads")
OPTS = dict(rows=3, full_rows=1, text_rows=1, length=1024, rank=4, alpha=8, eval_every=0, checkpoint_every=2)


def test_lr_schedule():
    opts = train.AdaptOptions(steps=100, warmup=10, lr=1.0)
    assert train.lr_at(0, opts) == pytest.approx(0.1)
    assert train.lr_at(9, opts) == pytest.approx(1.0)
    assert train.lr_at(99, opts) == pytest.approx(0.1, abs=1e-3)
    assert all(train.lr_at(s, opts) >= train.lr_at(s + 1, opts) for s in range(10, 99))


def test_step_rows_are_text_then_repeat_then_retrieval_then_full(monkeypatch):
    for kind in ("text", "repeat", "retrieval"):
        monkeypatch.setattr(train.data, f"{kind}_row", lambda *a, kind=kind, **k: kind)
    opts = train.AdaptOptions(rows=6, full_rows=2, text_rows=1, repeat_rows=2)
    assert train.step_rows(None, 0, opts) == ["text", "repeat", "repeat", "retrieval", "retrieval", "retrieval"]
    assert train.step_rows(None, 1, opts) == ["text", "repeat", "repeat", "retrieval", "text", "text"]
    assert train.step_rows(None, 0, train.AdaptOptions(rows=3, full_rows=1, text_rows=0, repeat_rows=2)) == \
        ["repeat", "repeat", "retrieval"]
    train.check_options(CFG, train.AdaptOptions(rows=4, full_rows=1, text_rows=1, repeat_rows=2))
    for bad in (dict(text_rows=2, repeat_rows=2), dict(repeat_rows=-1)):
        with pytest.raises(ValueError, match="^rows: "):
            train.check_options(CFG, train.AdaptOptions(rows=4, full_rows=1, **bad))


def test_facts_and_questions_options_reach_the_rows_and_are_checked(monkeypatch):
    seen = []
    monkeypatch.setattr(train.data, "text_row", lambda *a, **k: "text")
    monkeypatch.setattr(train.data, "retrieval_row", lambda *a, **k: seen.append(k) or "retrieval")
    train.step_rows(None, 0, train.AdaptOptions(min_facts=8, max_facts=12, min_questions=5, max_questions=8))
    assert seen and all(k["facts"] == (8, 12) and k["questions"] == (5, 8) for k in seen)
    for field, bad in (("min_facts", dict(min_facts=1)), ("min_facts", dict(min_facts=7, max_facts=6)),
                       ("min_questions", dict(min_questions=0)), ("min_questions", dict(min_questions=5))):
        with pytest.raises(ValueError, match=f"^{field}: "):
            train.check_options(CFG, train.AdaptOptions(**bad))


def test_precision_picks_bf16_only_where_it_is_native(monkeypatch):
    assert train.autocast(train.AdaptOptions(precision="bf16")).fast_dtype == torch.bfloat16
    assert train.autocast(train.AdaptOptions(precision="bf16"))._enabled
    assert not train.autocast(train.AdaptOptions(precision="fp32"))._enabled
    for native in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        assert train.autocast(train.AdaptOptions())._enabled is native
    with pytest.raises(ValueError, match="precision"):
        train.autocast(train.AdaptOptions(precision="fp16"))


def test_device_auto_prefers_a_gpu_and_bad_devices_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.device(train.AdaptOptions()) == torch.device("cpu")
    assert train.autocast(train.AdaptOptions(precision="bf16")).device == "cpu"
    for bad in ("cuda", "cuda:1", "tpu", "gpu"):
        with pytest.raises(ValueError, match="device"):
            train.check_options(CFG, train.AdaptOptions(device=bad))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train.device(train.AdaptOptions()) == torch.device("cuda")
    for native in (False, True):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: native)
        assert train.precision(train.AdaptOptions()) == ("bf16" if native else "fp32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_trains_on_a_gpu(byte_tokenizer, tmp_path):
    model = tiny_byte_llama()
    opts = train.AdaptOptions(steps=3, lr=5e-3, warmup=1, device="cuda", learn_gains=True, **OPTS)
    adapted = train.train(model, byte_tokenizer, CFG, opts, tmp_path, log=lambda m: None)
    assert all(a.lora_b.device.type == "cuda" and a.lora_b.abs().sum() > 0 for a in adapted.adapters.values())
    assert all(t.device.type == "cpu" for t in lora.adapter_state(adapted.adapters).values())


def test_loss_falls_and_base_weights_stay(byte_tokenizer, tmp_path, monkeypatch):
    model = tiny_byte_llama()
    base = {n: p.clone() for n, p in model.named_parameters()}
    opts = train.AdaptOptions(steps=16, lr=5e-2, warmup=2, **OPTS)
    fixed = train.step_rows(byte_tokenizer, 0, opts)
    monkeypatch.setattr(train, "step_rows", lambda tokenizer, step, opts: fixed)
    records = train.train(model, byte_tokenizer, CFG, opts, tmp_path, log=lambda m: None).records
    loss = [r["loss"] for r in records]
    assert sum(loss[-3:]) / 3 < 0.85 * sum(loss[:3]) / 3, loss
    for name, p in model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name


@pytest.mark.parametrize("full_rows", [0, 3])
def test_batches_without_chunked_or_without_full_rows_train(byte_tokenizer, tmp_path, full_rows):
    opts = train.AdaptOptions(steps=2, lr=5e-3, warmup=1, **{**OPTS, "full_rows": full_rows, "text_rows": 0})
    records = train.train(tiny_byte_llama(), byte_tokenizer, CFG, opts, tmp_path, log=lambda m: None).records
    assert [r["step"] for r in records] == [1, 2]
    # adapters start at zero: at full attention the student is the teacher, chunked it is not
    assert (records[0]["kl"] > 1e-4) == (full_rows == 0), records


@pytest.mark.parametrize("learn_gains,per_layer", [(False, False), (True, False), (True, True)])
def test_resume_equals_uninterrupted(byte_tokenizer, tmp_path, learn_gains, per_layer):
    opts = train.AdaptOptions(steps=5, lr=5e-3, warmup=2, learn_gains=learn_gains, gains_per_layer=per_layer, **OPTS)
    whole = train.train(tiny_byte_llama(), byte_tokenizer, CFG, opts, tmp_path / "a", log=lambda m: None)
    train.train(tiny_byte_llama(), byte_tokenizer, CFG, opts, tmp_path / "b", log=lambda m: None, stop_after=3)
    messages = []
    resumed = train.train(tiny_byte_llama(), byte_tokenizer, CFG, opts, tmp_path / "b", log=messages.append)
    assert any("resuming from step 3" in m for m in messages)
    assert [r["step"] for r in resumed.records] == [4, 5]
    for name in whole.adapters:
        assert torch.equal(whole.adapters[name].lora_a, resumed.adapters[name].lora_a), name
        assert torch.equal(whole.adapters[name].lora_b, resumed.adapters[name].lora_b), name
    assert whole.gains == resumed.gains and (whole.gains is None) != learn_gains


def test_learned_gains_train_and_are_served_gated(byte_tokenizer, tmp_path):
    opts = train.AdaptOptions(steps=6, lr=1e-2, warmup=1, learn_gains=True, **OPTS)
    adapted = train.train(tiny_byte_llama(), byte_tokenizer, CFG, opts, tmp_path, log=lambda m: None)
    assert len(adapted.gains) == CFG.chunk_size and sum(adapted.gains) == pytest.approx(1.0, abs=1e-5)
    assert max(abs(g - 0.25) for g in adapted.gains) > 1e-3, adapted.gains  # they moved: the chunked rows used them
    assert [r["slot_gains"] for r in adapted.records][-1] == adapted.gains
    served = train.serve_config(CFG, adapted.gains)
    assert served.pooling == "gated" and served.normalised_gains() == pytest.approx(adapted.gains, abs=1e-5)  # gains are rounded to 6 places
    assert served.model_dump(exclude={"pooling", "slot_gains"}) == CFG.model_dump(exclude={"pooling", "slot_gains"})
    assert train.serve_config(CFG, None) is CFG

    with pytest.raises(ValueError, match="learn_gains"):
        train.check_options(CFG.model_copy(update={"hop": 2}), opts)
    saved = tmp_path / "saved"
    lora.save_adapter(adapted.adapters, saved, {"slot_gains": adapted.gains})
    messages = []
    first = train.train(tiny_byte_llama(), byte_tokenizer, CFG, train.AdaptOptions(
        steps=1, lr=1e-9, warmup=1, learn_gains=True, init_adapter=str(saved), **OPTS), tmp_path / "more", log=messages.append)
    assert first.gains == pytest.approx(adapted.gains, abs=1e-5)  # continued from them (a step of lr 2e-8 moves nothing)
    assert any("slot gains" in m for m in messages)
    with pytest.raises(ValueError, match="with learned gains"):  # a checkpoint with gains, resumed without
        train.train(tiny_byte_llama(), byte_tokenizer, CFG, train.AdaptOptions(steps=7, **OPTS), tmp_path,
                    log=lambda m: None)


def test_gains_per_layer_train_apart_and_are_served_per_layer(byte_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="gains_per_layer"):
        train.check_options(CFG, train.AdaptOptions(gains_per_layer=True, **OPTS))
    opts = train.AdaptOptions(steps=6, lr=1e-2, warmup=1, learn_gains=True, gains_per_layer=True, **OPTS)
    model = tiny_byte_llama()
    layers = model.config.num_hidden_layers
    adapted = train.train(model, byte_tokenizer, CFG, opts, tmp_path / "per", log=lambda m: None)
    assert len(adapted.gains) == layers >= 2 and all(len(row) == CFG.chunk_size for row in adapted.gains)
    assert all(sum(row) == pytest.approx(1.0, abs=1e-5) for row in adapted.gains)
    assert max(abs(a - b) for a, b in zip(adapted.gains[0], adapted.gains[1])) > 1e-4, adapted.gains  # trained apart
    served = train.serve_config(CFG, adapted.gains)
    assert served.per_layer_gains
    for layer, row in enumerate(adapted.gains):
        assert served.for_layer(layer).normalised_gains() == pytest.approx(row, abs=1e-5)

    shared = tmp_path / "shared"
    lora.save_adapter(adapted.adapters, shared, {"slot_gains": [0.1, 0.2, 0.3, 0.4]})
    first = train.train(tiny_byte_llama(), byte_tokenizer, CFG, train.AdaptOptions(
        steps=1, lr=1e-9, warmup=1, learn_gains=True, gains_per_layer=True, init_adapter=str(shared), **OPTS),
        tmp_path / "from_shared", log=lambda m: None)
    assert all(row == pytest.approx([0.1, 0.2, 0.3, 0.4], abs=1e-5) for row in first.gains)  # every layer starts there
    per_layer = tmp_path / "per_layer"
    lora.save_adapter(adapted.adapters, per_layer, {"slot_gains": adapted.gains})
    with pytest.raises(ValueError, match="gains-per-layer"):
        train.train(tiny_byte_llama(), byte_tokenizer, CFG, train.AdaptOptions(
            steps=1, learn_gains=True, init_adapter=str(per_layer), **OPTS), tmp_path / "to_shared", log=lambda m: None)
    with pytest.raises(ValueError, match=rf"learned gains of shape \[{layers}, 4\]"):
        train.train(tiny_byte_llama(), byte_tokenizer, CFG, train.AdaptOptions(steps=7, learn_gains=True, **OPTS),
                    tmp_path / "per", log=lambda m: None)  # a per-layer checkpoint, resumed with one set


def test_process_totals_add_the_processes_of_a_resumed_run():
    """Each record names its process and carries that process's clock and peak memory; a resumed
    run's cost is the sum of every process's last clock and the largest peak (a process that
    logged one short step is counted although the next one's clock starts above it)."""
    log = [{"step": 1, "process": 100, "seconds": 10.0, "cpu_seconds": 19.0, "peak_gib": 1.0},
           {"step": 2, "process": 200, "machine": "B", "seconds": 12.0, "cpu_seconds": 20.0, "peak_gib": 2.5},
           {"step": 3, "process": 200, "machine": "B", "seconds": 25.0, "cpu_seconds": 40.0, "peak_gib": 2.5},
           {"step": 4, "process": 300, "machine": "B", "seconds": 5.0, "cpu_seconds": 9.0, "peak_gib": 0.5},
           {"step": 5, "process": 400, "machine": "C", "seconds": 7.0, "cpu_seconds": 3.0, "peak_gib": 0.5}]
    assert train.process_totals(log) == (47.0, 71.0, 2.5, 4, {"unrecorded": [1, 10.0, 19.0], "B": [3, 30.0, 49.0],
                                                               "C": [1, 7.0, 3.0]})  # steps, seconds, CPU seconds
    assert train.process_totals([{"step": 1}]) == (0, 0, 0.0, 0, {})  # logs written before the clock was logged


def test_records_carry_the_process_clock_and_memory(byte_tokenizer, tmp_path):
    opts = train.AdaptOptions(steps=3, lr=5e-3, warmup=1, **OPTS)
    train.train(tiny_byte_llama(), byte_tokenizer, CFG, opts, tmp_path, log=lambda m: None, stop_after=2)
    train.train(tiny_byte_llama(), byte_tokenizer, CFG, opts, tmp_path, log=lambda m: None)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    assert log[0]["process"] == log[1]["process"] < log[2]["process"] and log[0]["seconds"] < log[1]["seconds"]
    assert log[2]["seconds"] < log[1]["seconds"]  # the resumed process's own clock
    totals = train.process_totals(log)
    assert (totals.seconds, totals.processes) == (log[1]["seconds"] + log[2]["seconds"], 2) and totals.peak_gib > 0.1
    assert totals.cpu_seconds == log[1]["cpu_seconds"] + log[2]["cpu_seconds"] > 0
    # and what the steps ran on: here, the CPU's threads and model name, and the precision
    assert {r["machine"] for r in log} == {train.machine(opts)} and set(totals.by_machine) == {train.machine(opts)}
    assert train.machine(opts).startswith(f"{torch.get_num_threads()} threads of ")
    assert train.machine(opts).endswith(", " + train.precision(opts))
