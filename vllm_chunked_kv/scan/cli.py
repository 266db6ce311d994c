"""`vllm-chunked-kv scan`: find the weak phases of any OpenAI-compatible endpoint.

    vllm-chunked-kv scan --base-url http://127.0.0.1:8000 [--model NAME] [--probe all] [--compare-url URL2]
        [--task kv | --task FILE.jsonl] [--hop 4] [--out runs/scan] [--json] [--feedback]

Writes run.json, records.jsonl, records.csv, summary.json and scan.png under
--out; re-running the same command resumes where a failed run stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_chunked_kv.scan.errors import Failed, run_reporting
from vllm_chunked_kv.scan.probes import CHOICES

EPILOG = """\
units: tokens when the server has vLLM's /tokenize (prompts are then sent as
token ids), characters otherwise. Exit status: 0 done, 1 error (one line on
stderr), 130 interrupted; answers already received are kept for a re-run.
"""


class _RangeAction(argparse.Action):
    """`--needle-range LO:HI`, `--needle-range LO HI` or `--needle-range "LO HI"`."""

    def __call__(self, parser, namespace, values, option_string=None):
        text = " ".join(values).replace(":", " ").replace(",", " ")
        try:
            lo, hi = (int(x) for x in text.split())
        except ValueError:
            parser.error(f"{option_string}: expected LO:HI or LO HI (two whole numbers), got {' '.join(values)!r}")
        if not 0 <= lo < hi:
            parser.error(f"{option_string}: expected 0 <= LO < HI, got {lo} {hi}")
        setattr(namespace, self.dest, (lo, hi))


def add_server_arguments(parser: argparse.ArgumentParser, epilog: str) -> None:
    """The options `scan` and `check` share: which server, which model, which hop."""
    parser.epilog = epilog
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server root or its /v1 URL (default: %(default)s)")
    add("--model", help="served model name (default: the only model the server lists)")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)")
    add("--hop", type=int, help="phase = position mod hop (default: the server's, from /v1/chunked_kv/config, else 4)")
    add("--units", choices=["auto", "tokens", "chars"], default="auto", help="filler and position units (default: auto)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, EPILOG)
    add = parser.add_argument
    add("--compare-url", help="A/B scan: send every probe to this endpoint too and report the probes whose answer flips")
    add("--compare-model", help="served model name at --compare-url (default: the only one it lists)")
    add("--probe", choices=list(CHOICES), default="all", help="which probes (axes) to run: offset, needle, length, both (offset and needle) or all (default: all)")
    add("--task", default="kv", help="'kv' (the synthetic key-value task), 'prose-codes' (codes in English prose, for real models) or a JSONL file of your own tasks")
    add("--offsets", type=int, help="offset and length probes: filler units 0..N-1 (default: 2*hop)")
    add("--prompts", type=int, default=128, help="offset and length probes: prompts, each sent at every offset / extra (default: %(default)s)")
    add("--per-phase", type=int, default=256, help="needle probe: prompts per phase, a multiple of hop (default: %(default)s)")
    add("--target-position", type=int, help="offset probe: target position at offset 0 (default: mid-haystack for kv)")
    add("--needle-range", action=_RangeAction, nargs="+", metavar="LO:HI", help="needle probe: target positions, 'LO:HI' or 'LO HI' (default: 16 hops past the sinks and the task's own text; prompts are padded so every target is older than the raw window)")
    add("--window", type=int, help="raw window in tokens to place targets beyond (default: the server's, from /v1/chunked_kv/config, else 512; 0 places them anywhere)")
    add("--kv-haystack-len", type=int, default=240, help="kv task: haystack words (default: %(default)s)")
    add("--kv-records", type=int, default=48, help="kv task: records in the haystack (default: %(default)s)")
    add("--max-tokens", type=int, help="tokens to generate (default: 1 for kv, 16 for JSONL tasks)")
    add("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    add("--seed", type=int, default=0, help="seed of the prompts (and of sampling when temperature > 0)")
    add("--concurrency", type=int, default=16, help="requests in flight (default: %(default)s)")
    add("--timeout", type=float, default=60.0, help="seconds per request (default: %(default)s)")
    add("--retries", type=int, default=4, help="retries per request, exponential backoff (default: %(default)s)")
    add("--backoff", type=float, default=0.5, help="first retry delay in seconds, doubled each time (default: %(default)s)")
    add("--out", default="runs/scan", help="directory for records, summary and plot (default: %(default)s)")
    add("--fresh", action="store_true", help="discard earlier records in --out instead of resuming")
    add("--feedback", action="store_true", help="post each outcome to POST /v1/chunked_kv/feedback")
    add("--json", action="store_true", help="print the summary as JSON on stdout")
    add("--no-plot", action="store_true", help="do not write scan.png")
    add("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from vllm_chunked_kv.scan.session import scan

    try:
        summary = run_reporting(scan(args))
    except KeyboardInterrupt:
        print(f"interrupted: answers so far are in {args.out}; re-run to resume", file=sys.stderr)
        return 130
    if summary is Failed:
        return 1
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_text(summary)
    return 0


def print_text(summary: dict) -> None:
    from vllm_chunked_kv.scan.compare import format_compare
    from vllm_chunked_kv.scan.report_text import format_text

    print(
        f"{summary['model']} at {summary['base_url']}: units {summary['units']}, "
        f"hop {summary['hop']} ({summary['hop_source']})"
    )
    print(format_text(summary["results"], summary["hop"]))
    other = summary.get("compare")
    if other:
        print(f"\ncompared endpoint: {other['model']} at {other['base_url']}")
        print(format_text(other["results"], summary["hop"]))
        print()
        print(format_compare(other["paired"], summary["hop"], (summary["base_url"], other["base_url"])))
    print(f"files: {', '.join(summary['files'].values())}")
