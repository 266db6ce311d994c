"""Convert a GGUF file to a bf16 Hugging Face directory that vLLM serves.

transformers de-quantizes the GGUF (Q4_1, Q4_K_M) to float32 but keeps a
`quantization_config` that makes `save_pretrained` refuse; so the weights go
into a fresh, plain model of the same class (`LlamaForCausalLM`,
`Gemma3ForCausalLM`; every key must match), which is cast to bf16 and saved
with the tokenizer (chat template included); for a model trained with a
BOS token the GGUF's tokenizer does not add (Gemma 3), it is set to.

transformers 5 writes `"tokenizer_class": "TokenizersBackend"`, a name older
readers (and the tokenizer code in vLLM's worker) may not know; the saved
`tokenizer_config.json` names `PreTrainedTokenizerFast` instead, which loads
the same `tokenizer.json`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

from vllm_chunked_kv.models.errors import ModelFetchError
from vllm_chunked_kv.runner import companions

REQUIRED_MODULES = ("torch", "transformers", "gguf", "accelerate")
INSTALL_HINT = "pip install 'vllm-chunked-kv[models]'"
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def check_dependencies() -> None:
    """Fail before downloading when a module the conversion needs is missing,
    or a torchvision (torchaudio, torchcodec) that cannot load would stop
    transformers (`runner.companions`)."""
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelFetchError(f"converting a GGUF model needs {', '.join(missing)} (not installed): {INSTALL_HINT}")
    problem = companions.problem()
    if problem is not None:
        raise ModelFetchError(problem)


def convert_gguf(gguf_path: Path, out_dir: Path, model_type: str = "llama", bos: bool = False) -> dict:
    """Write a bf16 safetensors model + tokenizer for `gguf_path` into `out_dir`
    (which may exist); the GGUF must hold a `model_type` model. With `bos`,
    the tokenizer is made to start every text with its BOS token.

    Returns a summary for the README: parameters, layers, the architecture,
    the transformers version.
    """
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelFetchError(f"cannot import the conversion dependencies ({exc}): {INSTALL_HINT}") from None

    src, name = gguf_path.parent, gguf_path.name
    try:
        with quiet_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
            quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    except ImportError as exc:  # transformers asks for gguf/accelerate this way
        raise ModelFetchError(f"transformers cannot read GGUF here ({exc}): {INSTALL_HINT}") from None

    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    if config_dict.get("model_type") != model_type:
        raise ModelFetchError(f"{name}: expected model_type {model_type!r}, got {config_dict.get('model_type')!r}")
    model_cls, config_cls = type(quantized), type(quantized.config)
    model = model_cls(config_cls.from_dict(config_dict))  # plain: no GGUF quantizer left to refuse saving
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.architectures = [model_cls.__name__]
    model.eval()
    if bos:
        add_bos(tokenizer, name)

    out_dir.mkdir(parents=True, exist_ok=True)
    with quiet_progress_bars(), safetensors_os_errors(out_dir / "model.safetensors"):
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    fix_tokenizer_class(out_dir)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": model.config.num_hidden_layers,
        "architecture": model_cls.__name__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
    }


def add_bos(tokenizer, name: str) -> None:
    """Make the tokenizer start every text with its BOS token when it has one:
    a tokenizer converted from GGUF may not (Gemma 3's does not, and without
    <bos> the model repeats itself), and vLLM tokenizes prompts with it."""
    if tokenizer.bos_token_id is None:
        return
    if tokenizer("a").input_ids[:1] != [tokenizer.bos_token_id]:
        tokenizer.add_bos_token = True
    if tokenizer("a").input_ids[:1] != [tokenizer.bos_token_id]:
        raise ModelFetchError(f"{name}: the tokenizer does not start texts with {tokenizer.bos_token}")


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """No transformers progress bars while loading and saving (the fetch
    prints its own progress lines; the GGUF reader's own bar stays)."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


@contextlib.contextmanager
def safetensors_os_errors(path: Path) -> Iterator[None]:
    """safetensors reports a full disk as `SafetensorError: ... (os error 28)`:
    turn that into the OSError it is, naming the file."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as exc:
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None


def fix_tokenizer_class(model_dir: Path) -> None:
    """Name a tokenizer class every transformers release since 4.x can load."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = TOKENIZER_CLASS
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
