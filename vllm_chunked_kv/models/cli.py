"""`vllm-chunked-kv models`: fetch and list the real models this package knows.

    vllm-chunked-kv models fetch NAME [--adapted] [--cache-dir DIR] [--force]
    vllm-chunked-kv models list [--cache-dir DIR]

`fetch` prints progress on stderr and the model directory as the last line
of stdout, so this works:

    vllm serve "$(vllm-chunked-kv models fetch smollm2-135m | tail -1)" --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys

from vllm_chunked_kv.models import cache
from vllm_chunked_kv.models.errors import ModelFetchError

EPILOG = f"""\
cache: --cache-dir, else ${cache.ENV_CACHE}, else {cache.DEFAULT_CACHE}; models
live under <cache>/models/<name>. Exit status: 0 done, 1 error (one line on
stderr), 130 interrupted (nothing half-written is left to be reused).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    fetch = sub.add_parser("fetch", help="download, check and convert a model; print its directory")
    fetch.add_argument("name", metavar="NAME", help="a model name from `models list`")
    fetch.add_argument("--adapted", action="store_true",
                       help="the variant with the shipped chunked-KV adapter merged in")
    fetch.add_argument("--cache-dir", help=f"cache directory (default: ${cache.ENV_CACHE} or {cache.DEFAULT_CACHE})")
    fetch.add_argument("--force", action="store_true", help="rebuild the directory even if it is cached")
    list_ = sub.add_parser("list", help="the known models and where they are cached")
    list_.add_argument("--cache-dir", help=f"cache directory (default: ${cache.ENV_CACHE} or {cache.DEFAULT_CACHE})")


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "list":
            return list_models(args.cache_dir)
        from vllm_chunked_kv.models.fetcher import fetch

        path = fetch(args.name, args.cache_dir, adapted=args.adapted, force=args.force)
    except ModelFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: no half-written model directory was left in the cache", file=sys.stderr)
        return 130
    print(path)
    return 0


def list_models(cache_dir: str | None) -> int:
    from vllm_chunked_kv.models.fetcher import adapter_dir
    from vllm_chunked_kv.models.registry import MODELS

    for spec in MODELS.values():
        base = cache.model_dir(spec.name, cache_dir)
        adapted = cache.model_dir(spec.adapted_name, cache_dir)
        has_adapter = (adapter_dir(spec) / "adapter.safetensors").is_file()
        print(f"{spec.name}  {spec.license}  {spec.source} via {spec.pip_spec} ({spec.wheel_mb} MB)")
        print(f"  base:    {base if cache.is_complete(base) else 'not fetched'}")
        if cache.is_complete(adapted):
            print(f"  adapted: {adapted}")
        else:
            print(f"  adapted: {'not fetched' if has_adapter else 'no adapter shipped'}")
    return 0
