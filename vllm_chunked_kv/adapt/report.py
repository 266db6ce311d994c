"""What `adapt` shows while it runs (a progress bar) and leaves behind (ADAPT.md)."""

from __future__ import annotations

import json
from dataclasses import asdict
import platform
import re
import resource
import shlex
import sys
from pathlib import Path

import torch

from vllm_chunked_kv.adapt import train
from vllm_chunked_kv.core.serve_file import serve_settings

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


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def where_trained(opts) -> str:
    """The GPU's name, or the CPU threads and processor, that `opts` trains on."""
    dev = train.device(opts)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{torch.get_num_threads()} threads ({platform.processor() or platform.machine()})"


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
        f"- time of this run: {seconds / 60:.1f} min in {train.precision(opts)} on {where_trained(opts)}, "
        f"torch {torch.__version__}; steps logged: {len(records)}; "
        f"peak resident memory {peak_rss_gib():.1f} GiB",
        f"- loss (KL + CE), first 10 steps {mean(first, 'loss'):.3f} (CE {mean(first, 'ce'):.3f}), "
        f"last 10 steps {mean(last, 'loss'):.3f} (CE {mean(last, 'ce'):.3f})",
    ]
    if probes:
        lines.append("- in-training retrieval probe (chunked, teacher-forced, "
                     f"{opts.eval_prompts} prompts): " + ", ".join(f"step {s}: {a:.0%}" for s, a in probes))
    path = out_dir / "ADAPT.md"
    path.write_text("\n".join(lines) + "\n")
    return path
