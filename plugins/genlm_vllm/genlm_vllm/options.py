"""Options of the ``vllm`` backend."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt

from genlm_core.config import BackendOptions


class VLLMOptions(BackendOptions):
    """Options of the ``vllm`` backend. ``engine_opts`` go to ``vllm.LLM`` unchanged (tensor_parallel_size,
    pipeline_parallel_size, max_model_len, enforce_eager, kv_cache_memory_bytes, ...)."""

    batch_size: PositiveInt = Field(256, description="Most requests handed to the engine in one generate call.")
    dtype: str = Field("auto", description="Model dtype for vLLM ('auto', 'float32', 'bfloat16', ...).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory for the engine (on CPU builds: of RAM for the KV cache)."
    )
    max_model_len: PositiveInt | None = Field(None, description="Longest context the engine accepts.")
    enable_prefix_caching: bool = Field(True, description="vLLM's automatic prefix caching.")
    enable_lora: bool = Field(False, description="Allow LoRA adapters (load_lora / set_lora).")
    max_lora_rank: PositiveInt = Field(16, description="Largest LoRA rank the engine reserves room for.")
    engine_opts: dict[str, Any] = Field(default_factory=dict, description="More keyword arguments for vllm.LLM.")
