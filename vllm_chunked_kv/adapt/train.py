"""The adaptation loop: LoRA on the attention projections (optionally the MLPs), distilled from the model's own full attention.

Each step (docs/adapt.md has the reasons, docs/experiments/adapt.md what was tried):

- a batch of `rows` rows of `length` tokens: text, repeat and retrieval rows
  (`adapt.data`), drawn from `Random(f"{seed}:{step}")`;
- the teacher is the same model with its adapters switched off, under full
  attention: its next-token distributions on every row, without gradients;
- the student is the adapted model; the last `full_rows` rows run under full
  attention (so full-attention quality does not decay), the others under the
  chunked attention it will be served with (`hf.attention`, the
  reference's visible set);
- loss = KL(teacher || student) averaged over tokens (or a draw of them,
  on the teacher's top k: `adapt.loss`) + cross-entropy on the
  retrieval answers; AdamW on the adapters only, linear warm-up then cosine
  decay to a tenth, gradients clipped at 1;
- with `learn_gains`, the chunked rows pool each sealed chunk with learned
  per-slot gains (one softmax over `chunk_size` logits, shared by every layer
  and head, or with `gains_per_layer` one per layer; `hf.attention`'s
  gains), trained with the adapters at
  `GAINS_LR_SCALE` times their learning rate; the model is then served with
  `pooling="gated"` and those gains (`serve_config`); an `init_adapter`
  adapted with gains continues from them.

A checkpoint (adapters, gain logits, optimizer, step) is written atomically every
`checkpoint_every` steps; a run started again on the same output directory
continues from it and ends with the same weights as an uninterrupted run
(same torch build and thread count).
"""

from __future__ import annotations

import math
import os
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from vllm_chunked_kv.adapt import data, lora, probe
from vllm_chunked_kv.adapt.loss import loss_terms
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.hf.attention import GAINS_LR_SCALE, chunked_attention, gain_weights, gains_apply
from vllm_chunked_kv.ops.dispatch import cpu_description, native_bf16

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class AdaptOptions:
    """`adapt`'s options; the defaults are the one-run SmolLM2 recipe measured in docs/experiments/adapt.md."""

    steps: int = 360
    rows: int = 4  # rows per batch
    full_rows: int = 1  # of which the last ones run at full attention
    text_rows: int = 1  # of which the first chunked ones are plain text
    repeat_rows: int = 0  # and the next chunked ones text with far verbatim repeats (the rest retrieval)
    length: int = 768  # tokens per row
    lr: float = 1e-3
    warmup: int = 20
    rank: int = 16
    alpha: float = 32.0
    targets: str = ",".join(lora.TARGETS)  # the projections to adapt, comma-separated (lora.TARGETS, MLP_TARGETS)
    ce_weight: float = 1.0
    min_distance: int = 160  # asked facts and copied spans sit at least this many tokens before they are asked
    kl_positions: int = 0  # positions scored per step (plus the answers; adapt/loss.py); 0: every token
    kl_top_k: int = 0  # distil on the teacher's top k tokens and the rest as one; 0: the full distribution
    min_questions: int = 2  # questions per retrieval row, at least (capped by the row's facts)
    max_questions: int = 4  # and at most
    min_facts: int = 2  # facts per retrieval row, at least (2 or more: a hard row leaves one unasked)
    max_facts: int = 6  # and at most
    distractors: float = 0.5  # share of retrieval rows in one phrasing with a recent unasked fact (adapt/data.py)
    seed: int = 0
    checkpoint_every: int = 20
    eval_every: int = 0  # steps between retrieval probes (0: never)
    eval_prompts: int = 16
    init_adapter: str = ""  # an adapter directory to start from (train it further) instead of a fresh one
    precision: str = "auto"  # bf16 autocast or fp32; auto: bf16 where the device computes it natively (AVX-512 BF16, AMX, CUDA)
    device: str = "auto"  # cpu, cuda or cuda:N; auto: the first CUDA GPU if there is one, else the CPU
    learn_gains: bool = False  # learn per-slot pooling gains with the adapters (served as pooling "gated")
    gains_per_layer: bool = False  # with learn_gains: one set of gains per layer instead of one for the model


class Adapted(NamedTuple):
    """What `train` returns."""

    adapters: dict  # name -> lora.LoRALinear, merged into the model
    records: list[dict]  # one per step of this call (train_log.jsonl)
    gains: list | None  # the learned slot gains (normalised; one list per layer with gains_per_layer), None without learn_gains


def check_options(cfg: ChunkedKVConfig, opts: AdaptOptions) -> None:
    """Refuse, by name, options the settings cannot train with."""
    device(opts)
    precision(opts)
    if min(opts.text_rows, opts.repeat_rows, opts.full_rows) < 0 or \
            opts.text_rows + opts.repeat_rows + opts.full_rows > opts.rows:
        raise ValueError(f"rows: {opts.rows} rows cannot hold {opts.text_rows} text, {opts.repeat_rows} repeat "
                         f"and {opts.full_rows} full-attention rows")
    if not 2 <= opts.min_facts <= opts.max_facts:
        raise ValueError(f"min_facts: expected 2 <= min_facts <= max_facts, got {opts.min_facts} and {opts.max_facts}")
    if not 1 <= opts.min_questions <= opts.max_questions:
        raise ValueError(f"min_questions: expected 1 <= min_questions <= max_questions, got {opts.min_questions} "
                         f"and {opts.max_questions}")
    if opts.gains_per_layer and not opts.learn_gains:
        raise ValueError("gains_per_layer: needs learn_gains")
    if opts.learn_gains and not gains_apply(cfg):
        raise ValueError("learn_gains: needs pooling 'mean', hop == chunk_size and no keep_boundary in the settings "
                         "(the gains replace the mean)")


def serve_config(cfg: ChunkedKVConfig, gains: list | None) -> ChunkedKVConfig:
    """The settings to serve the adapted model with: `cfg`, or with learned gains
    the same grid pooled `gated` with them."""
    if gains is None:
        return cfg
    return ChunkedKVConfig.model_validate({**cfg.model_dump(), "pooling": "gated", "slot_gains": gains})


def device(opts: AdaptOptions) -> torch.device:
    """Where training runs: `opts.device`, or with "auto" the first CUDA GPU if torch sees one, else the CPU."""
    if opts.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(opts.device)
    except RuntimeError:
        dev = None  # not a device name torch knows
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu or cuda[:N], got {opts.device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {opts.device!r} asked for, but torch sees no CUDA GPU here")
    return dev


def precision(opts: AdaptOptions) -> str:
    """"bf16" or "fp32": the compute precision of training and the probe (fp32 master weights
    either way); auto: bf16 where the training device computes it natively (`native_bf16`)."""
    if opts.precision == "auto":
        return "bf16" if native_bf16(device(opts)) else "fp32"
    if opts.precision not in ("bf16", "fp32"):
        raise ValueError(f"precision: expected auto, bf16 or fp32, got {opts.precision!r}")
    return opts.precision


def machine(opts: AdaptOptions) -> str:
    """What a step runs on, as the log records it: the GPU's name, or the CPU threads, the
    processor's model name and its widest instruction set for bf16 (AMX, AVX-512 BF16, else
    torch's CPU capability), with the compute precision."""
    dev = device(opts)
    if dev.type == "cuda":
        where = torch.cuda.get_device_name(dev)
    else:
        cpu = cpu_description()
        isa = ("AMX" if cpu["torch_amx"] else "AVX-512 BF16" if cpu["torch_avx512_bf16"]
               else torch.backends.cpu.get_cpu_capability())
        where = f"{torch.get_num_threads()} threads of {cpu['model']} ({isa})"
    return f"{where}, {precision(opts)}"


def autocast(opts: AdaptOptions):
    return torch.autocast(device(opts).type, dtype=torch.bfloat16, enabled=precision(opts) == "bf16")


def lr_at(step: int, opts: AdaptOptions) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to lr / 10 at the last step."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = (step - opts.warmup) / max(opts.steps - opts.warmup, 1)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def step_rows(tokenizer, step: int, opts: AdaptOptions) -> list[data.Row]:
    """The batch of `step`: text rows first, then repeat rows, then retrieval rows (the last
    `full_rows` at full attention: text in odd steps, retrieval in even ones)."""
    rng = random.Random(f"{opts.seed}:{step}")
    bos = data.bos_id(tokenizer)
    length = opts.length - (bos is not None)  # a tokenizer that starts texts with <bos> gets it once, at position 0
    rows = []
    for i in range(opts.rows):
        full = i >= opts.rows - opts.full_rows
        if i < opts.text_rows or (full and step % 2 == 1):
            rows.append(data.text_row(tokenizer, rng, length))
        elif i < opts.text_rows + opts.repeat_rows and not full:
            rows.append(data.repeat_row(tokenizer, rng, length, min_distance=opts.min_distance))
        else:
            rows.append(data.retrieval_row(tokenizer, rng, length, min_distance=opts.min_distance,
                                           questions=(opts.min_questions, opts.max_questions),
                                           distractors=opts.distractors, facts=(opts.min_facts, opts.max_facts)))
    return [data.with_bos(row, bos) for row in rows]


def _save_checkpoint(path: Path, adapters, gains, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"step": step, "adapters": lora.adapter_state(adapters), "optimizer": optimizer.state_dict()}
    if gains is not None:
        state["gain_logits"] = gains.detach().clone()
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, adapters, gains, optimizer) -> int:
    state = torch.load(path, weights_only=True, map_location="cpu")
    saved = state.get("gain_logits")
    if (gains is None) != (saved is None) or (saved is not None and saved.shape != gains.shape):
        kind = "without learned gains" if saved is None else f"with learned gains of shape {list(saved.shape)}"
        raise ValueError(f"{path}: a checkpoint {kind}; resume it with the --learn-gains and "
                         "--gains-per-layer of the run that wrote it")
    for name, a in adapters.items():
        a.lora_a.data.copy_(state["adapters"][f"{name}.lora_a"])
        a.lora_b.data.copy_(state["adapters"][f"{name}.lora_b"])
    if gains is not None:
        gains.data.copy_(state["gain_logits"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Totals(NamedTuple):
    seconds: float  # wall time, pauses included
    cpu_seconds: float  # CPU time of every thread: the cost on a machine shared with other work
    peak_gib: float
    processes: int
    by_machine: dict  # machine (`machine()`, "unrecorded" before logs named it) -> [steps, seconds, cpu_seconds]


def process_totals(records: list[dict]) -> Totals:
    """What a run resumed across processes cost, from its log's records that carry `process`
    (when their process began, Unix time) and that process's `seconds`, `cpu_seconds` and
    `peak_gib` so far; with `machine`, split by what the steps ran on."""
    timed = [r for r in records if "process" in r]
    last: dict[float, dict] = {}
    steps: dict[float, int] = {}
    for r in timed:
        steps[r["process"]] = steps.get(r["process"], 0) + 1
        if r["process"] not in last or r["seconds"] > last[r["process"]]["seconds"]:
            last[r["process"]] = r
    by_machine: dict[str, list] = {}
    for process, r in last.items():
        row = by_machine.setdefault(r.get("machine", "unrecorded"), [0, 0.0, 0.0])
        row[0] += steps[process]
        row[1] += r["seconds"]
        row[2] += r["cpu_seconds"]
    return Totals(sum(row[1] for row in by_machine.values()), sum(row[2] for row in by_machine.values()),
                  max((r["peak_gib"] for r in timed), default=0.0), len(last), by_machine)


def train(model, tokenizer, cfg: ChunkedKVConfig, opts: AdaptOptions, work_dir: Path, log=None,
          stop_after: int | None = None) -> Adapted:
    """Adapt `model` (fp32, transformers Llama-like) in place, on `opts.device` (the model
    is moved there); returns the adapters, this call's log records and the learned
    gains (`Adapted`).

    `work_dir` holds the checkpoint and `train_log.jsonl`; `stop_after`
    ends the run after that many steps of this call (for tests of resuming)."""
    import json

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_options(cfg, opts)  # before the model is touched
    adapters = lora.add_lora(model, opts.rank, opts.alpha, opts.seed, targets=lora.parse_targets(opts.targets))
    dev = device(opts)
    model.to(dev)  # after add_lora: the adapters start from the same CPU draws on any device
    params = [p for a in adapters.values() for p in (a.lora_a, a.lora_b)]
    optimizer = torch.optim.AdamW(params, lr=opts.lr, weight_decay=0.0)
    gains = None
    if opts.learn_gains:
        shape = (model.config.num_hidden_layers, cfg.chunk_size) if opts.gains_per_layer else (cfg.chunk_size,)
        gains = torch.zeros(shape, device=dev, requires_grad=True)  # [(layers,) chunk_size] logits; zeros: mean pooling
        optimizer.add_param_group({"params": [gains], "lr_scale": GAINS_LR_SCALE})
        params = params + [gains]
    work_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = work_dir / CHECKPOINT
    start = _load_checkpoint(checkpoint, adapters, gains, optimizer) if checkpoint.exists() else 0
    if start:
        log(f"resuming from step {start} ({checkpoint})")
    elif opts.init_adapter:
        saved_gains = lora.load_into(adapters, Path(opts.init_adapter))
        log(f"starting from the adapter in {opts.init_adapter}")
        if saved_gains is not None and gains is not None:
            logits = torch.tensor(saved_gains, dtype=torch.float32).clamp(min=1e-12).log()  # softmax: the saved gains
            if logits.shape not in (gains.shape, gains.shape[-1:]):
                raise ValueError(f"{opts.init_adapter}: its slot gains have shape {list(logits.shape)}; this run "
                                 f"learns {list(gains.shape)} (one set per layer needs --gains-per-layer)")
            with torch.no_grad():  # gains of the whole model start every layer's gains
                gains.copy_(logits.expand_as(gains))
            log(f"and from its slot gains {saved_gains}")
        elif saved_gains is not None:
            log(f"note: {opts.init_adapter} was adapted with slot gains {saved_gains}; "
                "without --learn-gains this run pools chunks by their mean")
    prompts = probe.needle_prompts(tokenizer, opts.eval_prompts, span=probe.span(opts.min_distance)) if opts.eval_every else []
    records, done, where = [], 0, machine(opts)
    began, cpu_began, process = time.perf_counter(), time.process_time(), round(time.time(), 3)
    with open(work_dir / "train_log.jsonl", "a") as log_file:
        for step in range(start, opts.steps):
            if stop_after is not None and done >= stop_after:
                _save_checkpoint(checkpoint, adapters, gains, optimizer, step)
                break
            ids, labels = (t.to(dev) for t in data.batch(step_rows(tokenizer, step, opts)))
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, opts) * group.get("lr_scale", 1.0)
            model.train()
            with autocast(opts):
                loss, kl, ce = loss_terms(model, adapters, ids, labels, cfg, opts, gains, seed=f"{opts.seed}:{step}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            rate = done / (time.perf_counter() - began)
            record = {"step": step + 1, "loss": float(loss.detach()), "kl": kl, "ce": ce, "lr": lr_at(step, opts),
                      "steps_per_s": rate, "process": process, "machine": where,
                      "seconds": round(time.perf_counter() - began, 1),
                      "cpu_seconds": round(time.process_time() - cpu_began, 1),
                      "peak_gib": round(peak_rss_gib(), 2)}  # which process on what, its wall and CPU time, its peak
            if gains is not None:
                record["slot_gains"] = gain_weights(gains)
            if opts.eval_every and (step + 1) % opts.eval_every == 0:
                model.eval()
                with torch.no_grad(), autocast(opts), chunked_attention(model, cfg, gains):
                    record["probe_chunked"] = probe.accuracy(model, prompts)
            records.append(record)
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            eta = (opts.steps - step - 1) / rate
            extra = f" probe {record['probe_chunked']:.0%}" if "probe_chunked" in record else ""
            log(f"step {step + 1}/{opts.steps} loss {record['loss']:.3f} (kl {kl:.3f} ce {ce:.3f}) "
                f"{rate:.3f} steps/s eta {eta / 60:.0f} min{extra}")
            if (step + 1) % opts.checkpoint_every == 0 or step + 1 == opts.steps:
                _save_checkpoint(checkpoint, adapters, gains, optimizer, step + 1)
    model.eval()
    return Adapted(adapters, records, None if gains is None else gain_weights(gains))

