"""What `adapt` shows while it runs (a progress bar) and leaves behind (ADAPT.md)."""

from __future__ import annotations

import json
from dataclasses import asdict
import re
import shlex
import sys
from pathlib import Path

import torch

from vllm_chunked_kv.adapt import train
from vllm_chunked_kv.core.serve_file import read_serve_settings, serve_settings

_STEP = re.compile(r"^step (\d+)/(\d+) (.*)$")


def progress_printer(total: int, stream=None):
    """A log function: step lines redraw one progress bar on a terminal (one line
    every 10 steps otherwise); other messages print on their own line."""
    stream = stream or sys.stderr
    tty = stream.isatty()

    def log(message: str) -> None:
        match = _STEP.match(message)
        if not match:
            stream.write(("\n" if tty else "") + message + "\n")
        else:
            step = int(match.group(1))
            filled = 30 * step // max(total, 1)
            line = f"[{'#' * filled}{'.' * (30 - filled)}] {message}"
            if tty:
                stream.write("\r" + line + ("\n" if step == total else ""))
            elif step % 10 == 0 or step == total or "probe" in message:
                stream.write(line + "\n")
        stream.flush()

    return log


def write_report(out_dir: Path, argv: list[str], cfg, opts, seconds: float, log_path: Path) -> Path:
    """ADAPT.md: the command, the settings, the time, the loss curve summary and the probe scores."""
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    probes = [(r["step"], r["probe_chunked"]) for r in records if "probe_chunked" in r]
    first = records[: min(10, len(records))]
    last = records[-min(10, len(records)) :]
    mean = lambda rs, key: sum(r[key] for r in rs) / max(len(rs), 1)  # noqa: E731
    lines = [
        "# Adapted for chunked KV-cache serving",
        "",
        "Made by `vllm-chunked-kv adapt` (docs/adapt.md):",
        "",
        "```",
        "vllm-chunked-kv adapt " + " ".join(shlex.quote(a) for a in argv[argv.index("adapt") + 1 :] if "adapt" in argv)
        if "adapt" in argv else shlex.join(argv),
        "```",
        "",
        f"- served with: `--attention-backend chunked_kv --additional-config '{json.dumps({'chunked_kv': serve_settings(cfg)})}'`"
        " (also in `chunked_kv_serve.json`)",
        f"- options: `{json.dumps(asdict(opts))}`",
        f"- time of this run: {seconds / 60:.1f} min on {train.machine(opts)}, "
        f"torch {torch.__version__}; steps logged: {len(records)}; "
        f"peak resident memory {train.peak_rss_gib():.1f} GiB",
        f"- loss (KL + CE), first 10 steps {mean(first, 'loss'):.3f} (CE {mean(first, 'ce'):.3f}), "
        f"last 10 steps {mean(last, 'loss'):.3f} (CE {mean(last, 'ce'):.3f})",
    ]
    totals = train.process_totals(records)
    if totals.processes > 1:  # resumed: the cost of the whole run, not of its last process
        untimed = sum("process" not in r for r in records)
        lines.append(f"- the whole run, resumed in {totals.processes} processes: {totals.seconds / 60:.1f} min of "
                     f"training ({totals.cpu_seconds / 3600:.2f} CPU hours), peak resident memory "
                     f"{totals.peak_gib:.1f} GiB" + (f" (not counted: {untimed} steps logged without a clock)"
                                                     if untimed else "")
                     + "; by machine: " + "; ".join(f"{name}: {n} steps, {sec / 60:.1f} min ({cpu / 3600:.2f} CPU hours)"
                                                    for name, (n, sec, cpu) in totals.by_machine.items()))
    if probes:
        lines.append("- in-training retrieval probe (chunked, teacher-forced, "
                     f"{opts.eval_prompts} prompts): " + ", ".join(f"step {s}: {a:.0%}" for s, a in probes))
    path = out_dir / "ADAPT.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# The card of a shipped adapter: its ADAPT.md, rendered from the files beside it, so that its
# figures have one home (served.json) and the page cannot drift from them.

CARD_INPUTS = ("adapter.json", "train_log.jsonl", "served.json", "chunked_kv_serve.json")
CARD_COMMAND = "python -m vllm_chunked_kv.adapt.report --card DIR"


def _ci(pair) -> str:
    return f"[{pair[0]:.1f}, {pair[1]:.1f}]"


def _settings_line(settings: dict, layers: int) -> str:
    line = (f"chunk {settings['chunk_size']} (hop {settings.get('hop', settings['chunk_size'])}), "
            f"window {settings['window']}, {settings['sink_tokens']} sinks")
    stagger = settings.get("stagger", "none")
    if isinstance(stagger, list):  # explicit origins: one list per layer, one origin per KV head
        line += f", grid origins per layer and KV head `stagger: {json.dumps(stagger, separators=(',', ':'))}`"
    elif stagger != "none":
        line += f", grids staggered `stagger: {stagger}` in {settings.get('stagger_groups', 2)} groups"
    if "sliding_window_layers" in settings:
        line += f", the model's sliding-window layers `sliding_window_layers: {settings['sliding_window_layers']}`"
    line += f", pooling `{settings.get('pooling', 'mean')}`"
    gains = settings.get("slot_gains")
    if gains and isinstance(gains[0], list):
        line += f" with one set of {len(gains[0])} slot gains per layer ({layers} layers)"
    elif gains:
        line += f" with the slot gains {gains}"
    return line


def _retrieval_table(rows: list[dict]) -> list[str]:
    out = ["| measure | code back (tokens) | serving | retrieval % [95% CI] | n | phase gap [95% CI] "
           "| by phase 0 / 1 / 2 / 3 | misses: reordered / distractor of all |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        phases = " / ".join(f"{p:.1f}" for p in r["by_phase"])
        out.append(f"| {r['name']} | {r['needle_back']} | {r['serving']} | {r['percent']:.1f} {_ci(r['ci'])} "
                   f"| {r['n']:,} | {r['gap']:.1f} {_ci(r['gap_ci'])} | {phases} "
                   f"| {r['reordered']} / {r['distractor']} of {r['misses']} |")
    return out


def _perplexity_lines(ppl: dict) -> list[str]:
    base, chunked, default = ppl["base_full_attention"], ppl["chunked"], ppl["default_backend"]
    far = f"far repeats ({ppl['far_repeat_tokens']} tokens)"
    return [
        f"| perplexity, held-out text | all tokens | {far} |",
        "| --- | --- | --- |",
        f"| base model, full attention (default backend) | {base['value']:.2f} | |",
        f"| this adapter, chunked as adapted | {chunked['value']:.2f} | {chunked['far_repeats']:.2f} |",
        f"| this adapter, default backend | {default['value']:.2f} | {default['far_repeats']:.2f} |",
        "",
        f"Chunked perplexity is {ppl['ratio']:.3f}x the base model's under full attention "
        f"(the target was {ppl['target_ratio']:.2f}x). Far repeats are the tokens that end a 4-gram last "
        "seen more than a window before them, which only pooled rows can show: that is where pooling "
        "still costs most.",
    ]


def _commands(served: dict) -> list[str]:
    figures = [(r["name"], r) for r in served["retrieval"]]
    labels = {"base_full_attention": "the base model's perplexity", "chunked": "chunked perplexity",
              "default_backend": "default-backend perplexity"}
    figures += [(labels.get(k, k), v) for k, v in served["perplexity"].items() if isinstance(v, dict)]
    names: dict[tuple[str, str], list[str]] = {}  # one line per command, naming every figure it gave
    for name, fig in figures:
        names.setdefault((fig["command"], fig["result"]), []).append(name)
    return [served["model_dir"], ""] + [f"- {' and '.join(n)}: `{cmd}` (result: `{result}`)"
                                         for (cmd, result), n in names.items()]


def _runs(runs: list[dict], model: str) -> list[str]:
    out = ["| run | device | steps | rows a step | minutes | peak memory | record |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, run in enumerate(runs, 1):
        peak = f"{run['peak_gib']:.1f} GiB" if "peak_gib" in run else ""
        out.append(f"| {i} | {run['device']} | {run['steps']} | {run['rows']} | {run['minutes']:.1f} | {peak} "
                   f"| `{run['record']}` |")
    for i, run in enumerate(runs, 1):
        if "by_machine" in run:  # a run resumed on several machines: what each part cost
            parts = "; ".join(f"{m['machine']}: {m['steps']} steps, {m['minutes']:.1f} min, {m['cpu_hours']:.2f} CPU hours"
                              for m in run["by_machine"])
            out += ["", f"Run {i}, resumed across machines ({run['cpu_hours']:.2f} CPU hours in all): {parts}."]
    out += ["", "```", f"B=$(vllm-chunked-kv models fetch {model} | tail -1)"]
    for i, run in enumerate(runs, 1):
        out += [f"# {i}. {run['device']}, {run['minutes']:.1f} min", run["command"]]
    return out + ["```"]


def _last_run(meta: dict, log: list[dict]) -> list[str]:
    first, last = log[: min(10, len(log))], log[-min(10, len(log)) :]
    mean = lambda rs, key: sum(r[key] for r in rs) / max(len(rs), 1)  # noqa: E731
    opts = meta["options"]
    out = [f"Adapters: rank {meta['rank']}, alpha {meta['alpha']:g}, on {', '.join(meta['targets'])}. "
           f"The last run (seed {opts['seed']}, lr {opts['lr']:g}, {opts['warmup']} warm-up steps) logged "
           f"{len(log)} steps in `train_log.jsonl`: loss (KL + CE) over the first 10 steps {mean(first, 'loss'):.3f} "
           f"(CE {mean(first, 'ce'):.3f}), over the last 10 {mean(last, 'loss'):.3f} (CE {mean(last, 'ce'):.3f})."]
    gains = meta.get("slot_gains")
    if gains and isinstance(gains[0], list):
        learned = [i for i, g in enumerate(gains) if max(g) - min(g) > 1e-6]  # a layer that pools nothing keeps the mean
        over = f"over the {len(gains)} layers" if len(learned) == len(gains) else (
            f"over the {len(learned)} layers that pool ({', '.join(map(str, learned))}; the other "
            f"{len(gains) - len(learned)} keep the mean: nothing of theirs is pooled)")
        gains = [gains[i] for i in learned]
        slots = list(zip(*gains))
        out += ["", f"Slot gains learned (`adapter.json`), {over}:", "",
                "| slot | " + " | ".join(str(i) for i in range(len(slots))) + " |",
                "| --- |" + " --- |" * len(slots)]
        for name, fn in (("min", min), ("mean", lambda s: sum(s) / len(s)), ("max", max)):
            out.append(f"| {name} | " + " | ".join(f"{fn(s):.3f}" for s in slots) + " |")
        top = [max(range(len(g)), key=g.__getitem__) for g in gains]
        slot = max(set(top), key=top.count)
        out += ["", f"Slot {slot} has the largest gain in {top.count(slot)} of the {len(gains)} layers: a pooled "
                "row is weighted towards one position of its chunk, so tokens pooled into one row do not become "
                "an order-free mean."]
    return out


def render_card(adapter_dir: Path) -> str:
    """The ADAPT.md of a shipped adapter directory, from the files in `CARD_INPUTS`."""
    meta = json.loads((adapter_dir / "adapter.json").read_text())
    served = json.loads((adapter_dir / "served.json").read_text())
    settings = read_serve_settings(adapter_dir)
    log = [json.loads(line) for line in (adapter_dir / "train_log.jsonl").read_text().splitlines() if line.strip()]
    layers = len(meta["slot_gains"]) if meta.get("slot_gains") and isinstance(meta["slot_gains"][0], list) else 0
    lines = [
        f"# {served['title']}", "",
        f"<!-- Rendered from {', '.join(CARD_INPUTS)} by `{CARD_COMMAND}`: edit those files and run it again. -->",
        "", served["summary"], "",
        "## Serving settings", "",
        f"`chunked_kv_serve.json`: {_settings_line(settings, layers)}. "
        "One KV row per chunk beyond the window: the memory of `mitigation: none`.", "",
        "## Served", "", served["setup"], "",
        *_retrieval_table(served["retrieval"]), "",
        *_perplexity_lines(served["perplexity"]), "",
        "Commands and result files:", "",
        *_commands(served), "",
        "## How it was made", "",
        f"Made by {len(served['runs'])} `vllm-chunked-kv adapt` runs in a row:", "",
        *_runs(served["runs"], served["model"]), "",
        *[f"- {note}" for note in served["notes"]], "",
        "## The last run", "",
        *_last_run(meta, log),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m vllm_chunked_kv.adapt.report",
                                     description="Render a shipped adapter's ADAPT.md from the files beside it.")
    parser.add_argument("--card", type=Path, required=True, help="the adapter directory")
    parser.add_argument("--check", action="store_true", help="only say whether ADAPT.md is up to date (exit 1 if not)")
    args = parser.parse_args(argv)
    text, path = render_card(args.card), args.card / "ADAPT.md"
    if args.check:
        current = path.read_text() if path.is_file() else ""
        print(f"{path}: {'up to date' if current == text else 'out of date'}")
        return 0 if current == text else 1
    path.write_text(text)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
