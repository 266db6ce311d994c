"""Make `--attention-backend chunked_kv` select our backend, on CUDA and CPU.

Five things, all idempotent:

1. add `CHUNKED_KV` to vLLM's `AttentionBackendEnum` (vLLM's registry);
2. make that dynamically added member picklable: the engine process is
   spawned and unpickles the config before it has loaded plugins, so the
   member reduces to a call that registers the plugin and looks it up by name;
3. when vLLM builds its config and CHUNKED_KV serves some layer of the
   model, by whichever route (`serves_some_layer`: `--attention-backend`
   or `backend_per_kind`), take the model directory's
   `chunked_kv_serve.json` if `--additional-config` has no "chunked_kv"
   section, log where the settings came from, and validate them, so a bad
   value stops startup with one line (`startup_checks`); a serve file that
   no route honours is named in one line;
4. route an explicit CHUNKED_KV selection per layer: a layer with the
   model's own sliding window gets the platform's default backend (it keeps
   exactly its window, in vLLM's sliding-window pages: docs/design.md,
   "Hybrid models") unless `sliding_window_layers` is 'compress', every other
   layer our class. On the CPU platform, whose
   `get_attn_backend_cls` ignores every selection but CPU_ATTN, our class
   is returned here; elsewhere the platform's own choice validates it. The
   default selection (nothing asked) is left alone;
5. let per-request grid alignment reach prompt lengths and salt the
   prefix cache per grid (`alignment`).

The patches go through `compat`, which also warns once when the installed
vLLM is not the release this package was tested with.
"""

from __future__ import annotations

from vllm_chunked_kv.backend import BACKEND_NAME, BACKEND_PATH, alignment, compat, serves_some_layer


def _lookup_member(name: str):
    """Unpickle hook: register the plugin in this process, return the member."""
    register_backend()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        vllm_register(BACKEND_NAME, BACKEND_PATH)
    compat.make_enum_member_picklable(AttentionBackendEnum[BACKEND_NAME], _lookup_member)
    _route_selection()
    _validate_config_at_startup()
    alignment.install()
    from vllm_chunked_kv.backend.startup_checks import install_excepthook

    install_excepthook()


def _route_selection() -> None:
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()

    def make(original):
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if selected_backend is None or getattr(selected_backend, "name", None) != BACKEND_NAME:
                return original(cls, selected_backend, attn_selector_config, num_heads)
            from vllm_chunked_kv.backend.attention import ChunkedKVBackend

            if attn_selector_config.has_sliding_window:
                if not ChunkedKVBackend.supports_sliding_window():  # sliding_window_layers 'window'
                    path = original(cls, None, attn_selector_config, num_heads)  # the model's own window, uncompressed
                    _log_sliding_layers_once(path)
                    return path
                _log_sliding_layers_once(None)

            reasons = ChunkedKVBackend.validate_selector_config(attn_selector_config)
            if reasons:
                raise ValueError(f"{BACKEND_NAME} cannot serve this model: " + "; ".join(reasons))
            return BACKEND_PATH if on_cpu else original(cls, selected_backend, attn_selector_config, num_heads)

        return get_attn_backend_cls

    compat.patch_classmethod(type(current_platform), "get_attn_backend_cls", make)


def _log_sliding_layers_once(path: str | None) -> None:
    """One line on where the model's sliding-window layers run (`path`: the
    default backend's class; None: compressed, `sliding_window_layers`)."""
    from vllm.logger import init_logger

    logger = init_logger("vllm.chunked_kv.layers")
    if path is None:
        logger.info_once("chunked_kv: the model's sliding-window layers are compressed too, each reading only "
                         "within its own window (sliding_window_layers 'compress')")
        return
    logger.info_once(
        "chunked_kv: the model's sliding-window layers keep their window uncompressed on %s; its global layers "
        "are compressed", path.rsplit(".", 1)[-1])


def _take_serve_file(vllm_config) -> str:
    """Put the model directory's `chunked_kv_serve.json` section into vLLM's
    additional_config when --additional-config has no "chunked_kv" section (so
    every process and the metrics read the same); returns where the settings
    come from (`serve_file.settings_source`)."""
    from vllm_chunked_kv.core.serve_file import settings_source

    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    additions, source = settings_source(vllm_config.additional_config, model)
    if additions is not None:
        if not isinstance(vllm_config.additional_config, dict):
            vllm_config.additional_config = {}
        vllm_config.additional_config.update(additions)
    return source


def _log_unused_serve_file(vllm_config) -> None:
    """One line when the model directory carries a serve file but no route gives CHUNKED_KV a layer."""
    from vllm_chunked_kv.core.serve_file import serve_file_of

    path = serve_file_of(getattr(getattr(vllm_config, "model_config", None), "model", None))
    if path is not None:
        from vllm.logger import init_logger

        init_logger("vllm.chunked_kv.config").info_once(
            "chunked_kv: %s is not read: no layer runs on CHUNKED_KV (add --attention-backend chunked_kv "
            "to serve the model as it was trained)", path)


def _log_settings_once(source: str, cfg) -> None:
    import json

    from vllm.logger import init_logger

    settings = {k: v for k, v in cfg.model_dump().items() if v is not None}
    init_logger("vllm.chunked_kv.config").info_once(  # under "vllm": vLLM's handler prints it
        "chunked_kv: %s: %s", source, json.dumps(settings))


def _validate_config_at_startup() -> None:
    """Check our settings whenever vLLM finishes a VllmConfig (every process)."""
    from vllm.platforms import current_platform

    def make(original):
        def check_and_update_config(cls, vllm_config) -> None:
            original(cls, vllm_config)
            if not serves_some_layer(vllm_config):
                _log_unused_serve_file(vllm_config)
            else:
                from vllm_chunked_kv.core.config import ChunkedKVConfig
                from vllm_chunked_kv.backend.startup_checks import check_engine_support

                compat.check_version()
                source = _take_serve_file(vllm_config)
                cfg = ChunkedKVConfig.from_vllm_config(vllm_config)
                _log_settings_once(source, cfg)
                check_engine_support(cfg, vllm_config)

        return check_and_update_config

    compat.patch_classmethod(type(current_platform), "check_and_update_config", make)
