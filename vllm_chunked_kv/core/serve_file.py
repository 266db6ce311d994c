"""`chunked_kv_serve.json`: how a model directory trained for chunked attention is meant to be served.

A model fine-tuned under a compression (the demo's staggered model, a model
`adapt` wrote) carries the backend and the `additional_config` it was trained
for, so that it is served the way it learned to read its cache:

    {"attention_backend": "chunked_kv", "additional_config": {"chunked_kv": {...}}}

`vllm serve DIR --attention-backend chunked_kv` reads it by itself, as vLLM
reads a quantised checkpoint's `quantization_config` from its directory
(`settings_source`): an explicit `--additional-config '{"chunked_kv": ...}'`
wins, and startup logs which settings came from where.
"""

from __future__ import annotations

import json
from pathlib import Path

from collections.abc import Mapping

from vllm_chunked_kv.core.config import ADDITIONAL_CONFIG_KEY, ChunkedKVConfig, ChunkedKVConfigError

SERVE_FILE = "chunked_kv_serve.json"
TAKEN_FROM = "chunked_kv_serve_file"  # additional_config key: the serve file its section came from


def serve_settings(cfg: ChunkedKVConfig) -> dict:
    """The `chunked_kv` section of vLLM's additional_config that reproduces `cfg`'s attention."""
    settings = {
        "chunk_size": cfg.chunk_size, "hop": cfg.hop, "window": cfg.window, "sink_tokens": cfg.sink_tokens,
        "pooling": cfg.pooling, "stagger": cfg.stagger,
    }
    if cfg.stagger in ("heads", "layers"):
        settings["stagger_groups"] = cfg.stagger_groups
    if cfg.keep_boundary:
        settings["keep_boundary"] = True
    if not cfg.proportional:
        settings["proportional"] = False
    if cfg.slot_gains is not None:
        settings["slot_gains"] = cfg.slot_gains
    return settings


def write_serve_file(out_dir: Path, cfg: ChunkedKVConfig) -> Path:
    """Write `chunked_kv_serve.json` for `cfg` into `out_dir`."""
    meta = {
        "attention_backend": "chunked_kv",
        "additional_config": {ADDITIONAL_CONFIG_KEY: serve_settings(cfg)},
    }
    path = Path(out_dir) / SERVE_FILE
    path.write_text(json.dumps(meta, indent=2) + "\n")
    return path


def _read(model_dir: Path) -> dict:
    """The model directory's serve file, parsed."""
    return json.loads((Path(model_dir) / SERVE_FILE).read_text())


def read_serve_settings(model_dir: Path) -> dict:
    """The "chunked_kv" section a model directory says it is served with, as written."""
    return _read(model_dir)["additional_config"][ADDITIONAL_CONFIG_KEY]


def read_serve_config(model_dir: Path) -> ChunkedKVConfig:
    """The compression a model directory says it is served with."""
    return ChunkedKVConfig.from_additional_config(_read(model_dir)["additional_config"])


def serve_arguments(model_dir: Path) -> list[str]:
    """`vllm serve` arguments that serve `model_dir` as its serve file says."""
    meta = _read(model_dir)
    return ["--attention-backend", meta["attention_backend"], "--additional-config", json.dumps(meta["additional_config"])]


def serve_file_of(model: str | None) -> Path | None:
    """The model directory's `chunked_kv_serve.json`, or None when it has none."""
    path = Path(str(model)) / SERVE_FILE if model else None
    return path if path is not None and path.is_file() else None


def settings_source(additional_config: Mapping | None, model: str | None) -> tuple[dict | None, str]:
    """Where a server's chunked_kv settings come from: ``(additions, source)``.

    An explicit "chunked_kv" section of `--additional-config` wins; else the
    section of the model directory's serve file; else none (the defaults).
    `additions` is what the caller puts into vLLM's additional_config when the
    file is the source: its section, and under `TAKEN_FROM` the file's path,
    so that a process that reads the config again (vLLM's engine core does)
    still names the file; else None. `source` is one line for the startup log."""
    path = serve_file_of(model)
    has_file = path is not None
    from_file = f'settings from {path} (no "{ADDITIONAL_CONFIG_KEY}" section in --additional-config)'
    if isinstance(additional_config, Mapping) and ADDITIONAL_CONFIG_KEY in additional_config:
        if has_file and additional_config.get(TAKEN_FROM) == str(path):
            return None, from_file
        ignored = f" ({path} is not read: the explicit section wins)" if has_file else ""
        return None, f"settings from --additional-config{ignored}"
    if not has_file:
        return None, f'no "{ADDITIONAL_CONFIG_KEY}" section in --additional-config; running with the defaults'
    try:
        section = _read(path.parent)["additional_config"][ADDITIONAL_CONFIG_KEY]
    except (ValueError, KeyError, TypeError) as exc:
        raise ChunkedKVConfigError(None, f"cannot read {path}: {exc!r}") from None
    return {ADDITIONAL_CONFIG_KEY: dict(section), TAKEN_FROM: str(path)}, from_file
