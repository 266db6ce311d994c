"""The demo: a tiny retrieval model trained on CPU, its tokenizer, training, evaluation and command.

The shipped models live inside this package, so they are found wherever it
is installed (a checkout, an editable install, a wheel: pyproject's
package-data carries them). `DEFAULT_MODEL_DIR` is their one definition;
`shipped_model()` is the lookup for callers that need the files to be there.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "model"
DEFAULT_STAGGER_MODEL_DIR = Path(__file__).parent / "model_stagger"


def shipped_model() -> Path:
    """`DEFAULT_MODEL_DIR` when it holds the model's `config.json`; otherwise
    FileNotFoundError naming the directory."""
    path = DEFAULT_MODEL_DIR
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the shipped demo model is missing: no config.json in {path} "
            "(an install without the package data of vllm_chunked_kv/demo/model; reinstall vllm-chunked-kv)"
        )
    return path
