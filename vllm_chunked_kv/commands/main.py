"""`vllm-chunked-kv` command line: one subcommand per module, imported lazily.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("vllm_chunked_kv.demo.cli", "show the periodic weak spot and its mitigations on the shipped demo model"),
    "scan": ("vllm_chunked_kv.scan.cli", "sweep offsets, needle positions and prompt lengths against an endpoint"),
    "check": ("vllm_chunked_kv.scan.check_cli", "ask one prompt with 0..2*hop-1 filler units in front and at the end"),
    "quickstart": ("vllm_chunked_kv.commands.quickstart", "serve the shipped demo model with chunked_kv and check its answer to one lookup"),
    "build-test-models": ("vllm_chunked_kv.models.tiny", "build the tiny random-weight test models"),
    "models": ("vllm_chunked_kv.models.cli", "fetch a real model (checked, converted to bf16) and print its directory"),
    "adapt": ("vllm_chunked_kv.adapt.cli", "fine-tune a model to read its chunked KV cache (LoRA + distillation)"),
    "doctor": ("vllm_chunked_kv.commands.doctor", "which kernel implementation would run here, and why (no server)"),
}


# name -> the extra that brings its dependencies (the core install is the backend only)
EXTRAS = {"demo": "demo", "scan": "scan", "check": "scan", "models": "models", "adapt": "demo"}
EXTRA_PACKAGES = {"numpy", "scipy", "matplotlib", "openai", "httpx", "safetensors", "gguf", "accelerate"}


def _run(name: str, rest: list[str]) -> int:
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        sub_parser = argparse.ArgumentParser(prog=f"vllm-chunked-kv {name}", description=SUBCOMMANDS[name][1])
        module.add_arguments(sub_parser)
        return int(module.run(sub_parser.parse_args(rest)) or 0)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if name not in EXTRAS or missing not in EXTRA_PACKAGES:
            raise
        print(f"error: `vllm-chunked-kv {name}` needs {missing!r}: pip install 'vllm-chunked-kv[{EXTRAS[name]}]'",
              file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="vllm-chunked-kv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name, rest = argv[0], argv[1:]
    return _run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
