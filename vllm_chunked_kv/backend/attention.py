"""CHUNKED_KV attention backend: vLLM's four roles in one file.

- `ChunkedKVBackend`: the capability sheet vLLM selects on; its
  `customize_spec` makes the layer's own pages compressed
  (``tokens_per_state``, see `core/layout.py`).
- `ChunkedKVMetadata`: one step of a group's layers: request layout, the
  chosen kernels, and each layer's ready plan.
- `ChunkedKVMetadataBuilder`: chooses the kernels once (`ops/dispatch.py`)
  and plans each step (`ops/plans/policy.py`), joining both cache groups
  (`step_link.py`).
- `ChunkedKVImpl`: `forward` stores the step's raw rows, writes the chunks
  they complete into the compressed pages, and attends, with the kernels and
  plan the metadata carries.

Each layer has two caches, both ``[num_blocks, num_kv_heads, rows_per_page,
head_size + head_size_v]`` (keys then values, vLLM's LBHNC layout): its own
compressed pages, and the raw pages of its companion layer
(`raw_cache.py`), registered after the weights are loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError
from vllm_chunked_kv.ops import dispatch, fp8
from vllm_chunked_kv.ops.plans.policy import decode_plan_on_device, plan_step
from vllm_chunked_kv.ops.plans.step_plan import PagedBatch, StepPlan
from vllm_chunked_kv.backend.raw_cache import PagedRows, RawPagesMetadata, attach_raw_pages
from vllm_chunked_kv.backend import BACKEND_NAME, alignment, settings, startup_checks, step_link
from vllm_chunked_kv.backend.layer_grid import layer_grids
from vllm_chunked_kv.backend.static_plans import StaticPlans

logger = init_logger("vllm.chunked_kv.backend")  # under "vllm" so it uses vLLM's log handler

class ChunkedKVBackend(PagedRows, AttentionBackend):
    """Capability sheet: what vLLM may ask of CHUNKED_KV."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = list(startup_checks.CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ChunkedKVImpl]:
        return ChunkedKVImpl

    @staticmethod
    def get_builder_cls() -> type[ChunkedKVMetadataBuilder]:
        return ChunkedKVMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """A model's sliding-window layers, compressed, when `sliding_window_layers`
        is 'compress' (otherwise they are routed to vLLM's default backend)."""
        cfg = settings.active_config_or_none()
        return cfg is not None and cfg.sliding_window_layers == "compress"

    @classmethod
    def supports_sink(cls) -> bool:
        """Learned attention sinks (GPT-OSS): every kernel has them."""
        return True

    @classmethod
    def validate_selector_config(cls, selector) -> list[str]:
        """Readable reasons why this backend cannot serve `selector` (empty: it can)."""
        fields = selector._asdict()
        reasons = cls.validate_configuration(device_capability=None, **fields)
        if fields.get("kv_cache_dtype") not in (None, *cls.supported_kv_cache_dtypes):
            reasons.append(f"kv_cache_dtype {fields['kv_cache_dtype']!r} is not supported "
                           f"({', '.join(cls.supported_kv_cache_dtypes)} are)")
        return reasons

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Compressed pages: one stored state per `tokens_per_state` tokens.
        vLLM also probes with ``block_size=1``; a block size that cannot hold
        whole slot groups is refused at startup (`startup_checks`)."""
        cfg = settings.active_config()
        if spec.block_size % layout.block_multiple(cfg):
            return spec
        return replace(spec, tokens_per_state=layout.spec_tokens_per_state(cfg))

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        """Compressed pages hold whole slot groups: multiples of hop."""
        cfg = settings.active_config_or_none()
        return [MultipleOf(1 if cfg is None else layout.block_multiple(cfg))]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        """Multiples of hop that suit the settings (`layout.check_block_size`:
        with dynamic boundaries, the window must outlast the slot lag, so
        vLLM's default of 16 may not do where 8 does)."""
        cfg = settings.active_config_or_none()
        if block_size is None or cfg is None:
            return super().supports_block_size(block_size)
        try:
            layout.check_block_size(cfg, block_size)
        except ChunkedKVConfigError:
            return False
        return True

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        """The block size vLLM sets unless --block-size is given (on CUDA,
        `Platform.update_block_size_for_backend`; on CPU, `startup_checks`)."""
        cfg = settings.active_config_or_none()
        return default_block_size if cfg is None else layout.default_block_size(cfg)


@dataclass
class LayerStep:
    """What one layer's forward needs of the step, ready before it runs."""

    plan: StepPlan  # the step's index plan for this layer's grid origins
    raw: RawPagesMetadata  # the raw pages' block table and the new tokens' slots
    cfg: ChunkedKVConfig  # the settings it pools with (`ChunkedKVConfig.for_layer`)


@dataclass
class ChunkedKVMetadata:
    """One step of the group's layers: request layout, the kernels that run,
    and per layer its plan (`layers`, filled by the builder as soon as the
    raw pages' metadata of the same step is built, `step_link.py`). A uniform
    decode batch planned on the device keeps its sequence lengths there
    (`device_seq_lens`; `seq_lens` is then empty): building it waits for
    nothing, as CUDA graphs need."""

    num_actual_tokens: int
    query_start: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs] positions computed after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] compressed pages
    block_size: int  # tokens per compressed page
    ops: dispatch.Ops  # the kernels chosen for this group
    device_seq_lens: torch.Tensor | None = None  # [num_reqs] when the decode plan is built on the device
    grid_shifts: torch.Tensor | None = None  # [num_reqs] each request's grid shift (`align`; None: none),
    # on the device with `device_seq_lens`, else on the host
    num_decodes: int = 0  # leading one-token requests planned as a uniform batch in a mixed step (0: none)
    layers: dict[str, LayerStep] = field(default_factory=dict)  # layer name -> its step


class ChunkedKVMetadataBuilder(AttentionMetadataBuilder[ChunkedKVMetadata]):
    """Plans the step for every layer of the group: `build` reads vLLM's
    common metadata, and the plans are made as soon as the raw pages'
    metadata of the same step exists (`complete`, through `step_link`), one
    per distinct grid and raw group, so `forward` only writes and attends.
    The kernels are chosen here, once (`dispatch.choose`). Uniform decode
    batches (one token per request) are planned on the device when
    `decode_plan_on_device` says so, and may then be captured in CUDA
    graphs; on CPU the decodes of a mixed batch, which vLLM puts first
    (`reorder_batch_threshold`), are planned the same way and only its
    prefill pieces get the Python plan (`plans/policy.py`). With `align`,
    each request's grid shift comes from its prompt length (`alignment`),
    kept on the device in a buffer of fixed address (what a captured graph reads)."""

    reorder_batch_threshold: ClassVar[int | None] = 1  # one-token requests first in every batch

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        model = vllm_config.model_config
        group = model.get_num_attention_heads(vllm_config.parallel_config) // kv_cache_spec.num_kv_heads
        impl = dispatch.choose(device, head_size=kv_cache_spec.head_size, group=group,
                               cache_dtype=vllm_config.cache_config.cache_dtype)
        self.ops = dispatch.ops(impl)
        self.config = ChunkedKVConfig.from_vllm_config(vllm_config)
        self.device_decode_plan = decode_plan_on_device(device, impl, self.config)
        self.grids = layer_grids(self.config, layer_names, kv_cache_spec.num_kv_heads, model.get_total_num_kv_heads())
        self.link = step_link.link_for(vllm_config)
        self.static = None  # full CUDA graphs of decode steps read the plan at fixed addresses
        if self.device_decode_plan and torch.device(device).type == "cuda":
            self.static = StaticPlans(vllm_config.scheduler_config.max_num_seqs)
        self.shift_buffer = None  # [max_num_seqs] device copy of the grid shifts (`align`)
        if self.config.align != "none" and torch.device(device).type != "cpu":
            self.shift_buffer = torch.zeros(vllm_config.scheduler_config.max_num_seqs, dtype=torch.long, device=device)
        logger.info_once("chunked KV: uniform decode batches are planned %s",
                         "on the device (CUDA-graph capturable)" if self.device_decode_plan else "in Python")

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """Uniform single-token decode when its plan is built on the device
        (CUDA devices by default; CPU never captures graphs)."""
        device = vllm_config.device_config.device if vllm_config.device_config is not None else None
        cfg = ChunkedKVConfig.from_additional_config(getattr(vllm_config, "additional_config", None))
        on_device = decode_plan_on_device(torch.device(device) if device is not None else torch.device("cpu"), cfg=cfg)
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE if on_device else AttentionCGSupport.NEVER

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ChunkedKVMetadata:
        m = common_attn_metadata
        uniform_decode = self.device_decode_plan and m.max_query_len == 1 and m.num_actual_tokens == m.num_reqs
        block_table = m.block_table_tensor[: m.num_reqs]
        if uniform_decode and block_table.device.type == "cpu":
            # No graphs to keep shapes for: the decode plan addresses only the
            # pages the longest request has (a page holds block_size tokens).
            block_table = block_table[:, : -(-m.max_seq_len // self.block_size)]
        num_decodes = 0
        query_start = m.query_start_loc_cpu[: m.num_reqs + 1].tolist()  # host tensor: no device wait
        if self.device_decode_plan and not uniform_decode and block_table.device.type == "cpu":
            while num_decodes < m.num_reqs - 1 and query_start[num_decodes + 1] == num_decodes + 1:
                num_decodes += 1  # vLLM puts decodes first (reorder_batch_threshold)
        shifts = None
        if self.config.align != "none":
            shifts = self.config.grid_shift(alignment.prompt_lengths(self.vllm_config, m.num_reqs))  # [num_reqs] host
            if uniform_decode and self.shift_buffer is not None:
                shifts = self.shift_buffer[: m.num_reqs].copy_(shifts, non_blocking=True)
        metadata = ChunkedKVMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start=query_start,
            seq_lens=[] if uniform_decode else m.seq_lens[: m.num_reqs].cpu().tolist(),
            block_table=block_table,
            block_size=self.block_size,
            ops=self.ops,
            device_seq_lens=m.seq_lens[: m.num_reqs] if uniform_decode else None,
            grid_shifts=shifts,
            num_decodes=num_decodes,
        )
        self.link.chunked_built(m, self, metadata)
        return metadata

    def complete(self, metadata: ChunkedKVMetadata, raw_by_layer: dict[str, RawPagesMetadata]) -> bool:
        """Plan every layer of `metadata` once the raw pages' metadata of the
        same step is in `raw_by_layer` (by companion name); whether it could.
        Layers with the same grid and raw group share one plan (a decode
        plan for CUDA graphs held at fixed addresses, `static_plans`)."""
        if any(grid.raw_name not in raw_by_layer for grid in self.grids.values()):
            return False
        plans: dict[tuple, StepPlan] = {}
        group_name: dict[int, str] = {}  # raw metadata -> its first layer's name: the same every step
        for name, grid in self.grids.items():
            raw = raw_by_layer[grid.raw_name]
            key = (grid.origins, group_name.setdefault(id(raw), grid.raw_name))
            if key not in plans:
                plans[key] = self._plan(metadata, raw, grid.origins)
                if self.static is not None and metadata.device_seq_lens is not None:
                    plans[key] = self.static.hold(key, plans[key], metadata.device_seq_lens.shape[0])
            metadata.layers[name] = LayerStep(plans[key], raw, grid.cfg)
        return True

    def _plan(self, metadata: ChunkedKVMetadata, raw: RawPagesMetadata, origins: tuple[int, ...]) -> StepPlan:
        on_device = metadata.device_seq_lens is not None
        shifts = metadata.grid_shifts
        batch = PagedBatch(
            query_start=metadata.query_start, seq_lens=metadata.seq_lens, block_table=metadata.block_table,
            block_size=metadata.block_size, raw_block_table=raw.block_table, raw_block_size=raw.block_size,
            grid_shifts=None if shifts is None or on_device else shifts.tolist(),
        )
        return plan_step(batch, self.config, list(origins), bias=metadata.ops.needs_bias,
                         device_seq_lens=metadata.device_seq_lens, device_shifts=shifts if on_device else None,
                         num_decodes=metadata.num_decodes, native=metadata.ops.native_plans)


class ChunkedKVImpl(AttentionImpl[ChunkedKVMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        vllm_config = get_current_vllm_config()
        self.config = ChunkedKVConfig.from_vllm_config(vllm_config)
        compress_windows = self.config.sliding_window_layers == "compress"
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            # routed to vLLM's default backend unless sliding_window_layers is 'compress'
            "a sliding-window layer": sliding_window is not None and not compress_windows,
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [name for name, present in unsupported.items() if present]
        if bad:
            raise NotImplementedError(f"{BACKEND_NAME} does not support " + ", ".join(bad))
        self.lookback = int(sliding_window or 0)  # the layer's own sliding window, compressed (0: none)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.logits_soft_cap = float(logits_soft_cap or 0.0)  # the model's logit cap (Gemma 2); 0: none
        self.sinks = sinks  # [Hq] the model's learned sink logits (GPT-OSS), filled when weights load; or None
        settings.remember(self.config)
        self._total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._static_forward_context = vllm_config.compilation_config.static_forward_context
        self._raw_pages = None
        logger.info_once("Using %s attention backend with %s, KV pages %s", BACKEND_NAME,
                         json.dumps(self.config.describe()), kv_cache_dtype)

    def _page_format(self, layer: AttentionLayer) -> fp8.PageFormat | None:
        """How this layer's pages store a row: FP8 with the layer's current k/v scales
        (`--calculate-kv-scales` sets them at the first step), or None for the model's dtype."""
        if not fp8.is_fp8(self.kv_cache_dtype):
            return None
        return fp8.PageFormat(self.kv_cache_dtype, self.head_size, float(layer._k_scale_float),
                              float(layer._v_scale_float))

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Register the raw pages' companion layer: the layer is in vLLM's
        static forward context by now, and KV-cache specs are collected later."""
        if self._raw_pages is None:
            keep = layout.model_forever_raw(self.config, self._total_kv_heads)
            self._raw_pages = attach_raw_pages(self, self.config, keep, self._static_forward_context)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ChunkedKVMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not support fused output quantisation")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        query = query[:n].view(n, self.num_heads, self.head_size)  # [n, Hq, D]
        key = key[:n].view(n, self.num_kv_heads, self.head_size)  # [n, Hkv, D]
        value = value[:n].view(n, self.num_kv_heads, -1)  # [n, Hkv, Dv]
        step_rows = torch.cat([key, value], dim=-1)  # [n, Hkv, D + Dv]
        fmt = self._page_format(layer)
        stored, page = step_rows, {}
        if fmt is not None:  # quantised once, here: every op reads the step's rows as the pages will hold them
            stored, page = fp8.quantise(step_rows, fmt), {"fmt": fmt}  # [n, Hkv, D + Dv] bytes
        step = attn_metadata.layers.get(layer.layer_name)
        if step is None:
            raise RuntimeError(f"{BACKEND_NAME}: {layer.layer_name} has no plan for this step: the metadata of its "
                               "raw pages' cache group was not built in the same step (backend/step_link.py)")
        ops, raw_cache = attn_metadata.ops, self._raw_pages.kv_cache
        ops.write_raw(raw_cache, stored, step.raw.slot_mapping[:n], step.plan.raw_writes)
        ops.write_chunks(kv_cache, raw_cache, stored, step.plan.writes, step.cfg, self.head_size, **page)
        out = output[:n].view(n, self.num_heads, -1)  # [n, Hq, Dv]
        if out.dtype != query.dtype:  # e.g. an fp32 output buffer for bf16 activations
            out = None
        result = ops.attend(query, stored, kv_cache, raw_cache, step.plan, self.scale, out=out,
                            softcap=self.logits_soft_cap, sinks=self.sinks, lookback=self.lookback, **page)
        if result is not out:
            output[:n].view_as(result).copy_(result)
        return output
