"""`vllm-chunked-kv check`: ask one prompt at 0..2·hop−1 filler units in front and at the end.

    vllm-chunked-kv check --base-url URL "PROMPT"        (or --file F, or the prompt on stdin)
        [--hop N] [--end-before TEXT] [--filler TEXT] [--max-tokens 16] [--json]

Greedy. Prints each answer and whether the answer is stable; if not, the
phases that change it. The hop comes from the server's
`/v1/chunked_kv/config` when it has one, else `--hop`, else 4.
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_chunked_kv.scan.errors import Failed, ScanError, run_reporting

EPILOG = """\
exit status: 0 stable, 3 the answer changes with the filler, 1 error (one line on stderr).
units: tokens when the server has vLLM's /tokenize (the prompt then goes out as token ids), else characters.
"""
UNSTABLE = 3
CONCLUSIONS = {
    "stable": "stable: the same answer with every filler in front and at the end; no sign of a grid-boundary effect",
    "periodic": "UNSTABLE, periodic in the hop: the answer changes at the phases above and again one hop later, "
                "which is what a chunk grid does",
    "unstable": "UNSTABLE, not periodic in the hop: the answer changes with the filler, but the change does not "
                "repeat one hop later, so the grid phase alone does not explain it (check an uncompressed server too)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vllm_chunked_kv.scan.cli import add_server_arguments

    add_server_arguments(parser, EPILOG)
    add = parser.add_argument
    add("prompt", nargs="?", help="the prompt (default: --file, else stdin)")
    add("--file", help="read the prompt from this file")
    add("--filler", help="filler text, cycled unit by unit (default: spaces in characters, a sentence in tokens)")
    add("--end-before", help="put the end filler just before the last occurrence of this text (e.g. the question)")
    add("--max-tokens", type=int, default=16, help="tokens to generate (default: %(default)s)")
    add("--timeout", type=float, default=120.0, help="seconds per request (default: %(default)s)")
    add("--retries", type=int, default=2, help="retries per request (default: %(default)s)")
    add("--json", action="store_true", help="print the result as JSON")


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.file is not None:
        raise ScanError("give the prompt as an argument or with --file, not both")
    if args.file is not None:
        try:
            return open(args.file, encoding="utf-8").read()
        except OSError as exc:
            raise ScanError(f"cannot read {args.file}: {exc.strerror}") from None
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if sys.stdin.isatty():
        raise ScanError("no prompt: pass it as an argument, with --file, or on stdin")
    return sys.stdin.read()


async def check(args: argparse.Namespace) -> dict:
    from vllm_chunked_kv.scan.check import CheckPlan, ask_all, verdict
    from vllm_chunked_kv.scan.client import EndpointClient
    from vllm_chunked_kv.scan.items import DEFAULT_FILLER
    from vllm_chunked_kv.scan.render import Renderer
    from vllm_chunked_kv.scan.server_layout import resolve_hop, scan_units

    prompt = read_prompt(args)
    if not prompt.strip():
        raise ScanError("the prompt is empty")
    client = EndpointClient(args.base_url, api_key=args.api_key, timeout_s=args.timeout, retries=args.retries)
    async with client:
        model = await client.resolve_model(args.model)
        hop, source = resolve_hop([await client.server_config() or {}], args.hop)
        if hop < 2:
            raise ScanError(f"--hop must be at least 2, got {hop}")
        units = await scan_units(client, model, args.units)
        filler = args.filler or (DEFAULT_FILLER if units == "tokens" else " ")
        plan = CheckPlan(prompt, model, hop, filler, args.end_before, args.max_tokens)
        asked = await ask_all(client, Renderer(client if units == "tokens" else None, model), plan)
    return {"model": model, "base_url": client.base_url, "hop": hop, "hop_source": source, "units": units,
            "filler": filler, "end_before": args.end_before, **verdict(asked, hop)}


def format_check(result: dict) -> str:
    hop = result["hop"]
    lines = [f"{result['model']} at {result['base_url']}: hop {hop} ({result['hop_source']}), units {result['units']}, "
             f"greedy, filler {result['filler']!r}"]
    where = {"front": "in front (everything shifts)",
             "end": f"before {result['end_before']!r}" if result["end_before"] else "at the end"}
    for side in ("front", "end"):
        s = result[side]
        lines.append(f"{side}: filler {where[side]}; answer with none: {s['baseline']!r}")
        for a in s["answers"]:
            mark = "changed" if a["extra"] in s["changed_extras"] else "same"
            lines.append(f"  +{a['extra']:<2d} length {a['length']} (length phase {a['length'] % hop}): "
                         f"{a['completion']!r}  {mark}")
        if s["changed_extras"]:
            repeats = "repeats every hop" if s["periodic"] else "does not repeat every hop"
            lines.append(f"  changes at filler mod {hop} in {s['phases']}, prompt length mod {hop} in "
                         f"{s['length_phases']}; {repeats}")
    lines.append(CONCLUSIONS[result["conclusion"]])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = run_reporting(check(args))
    if result is Failed:
        return 1
    print(json.dumps(result, indent=2) if args.json else format_check(result))
    return 0 if result["stable"] else UNSTABLE
