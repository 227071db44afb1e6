"""Options of the ``hf`` backend."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, PositiveInt

from genlm_core.config import BackendOptions


def default_kv_cache_bytes() -> int:
    """At most 4 GiB, and at most a sixth of this machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 * 2**30
    return int(min(4 * 2**30, total // 6))


class HFOptions(BackendOptions):
    """Options of the ``hf`` backend (transformers)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype; 'auto' is float32 on CPU and the checkpoint's dtype on CUDA."
    )
    device: str | None = Field(
        None, description="Device for the whole model, e.g. 'cpu', 'cuda:0' (default: cuda if available)."
    )
    device_map: str | dict[str, Any] | None = Field(
        None, description="accelerate device_map (e.g. 'auto'); overrides device."
    )
    kv_cache_bytes: int | None = Field(
        default_factory=default_kv_cache_bytes,
        ge=0,
        description="Most bytes of KV states kept for reuse (None: no limit).",
    )
    kv_cache_entries: PositiveInt = Field(4096, description="Most token sequences whose KV states are kept.")
    reuse_kv: bool = Field(True, description="Reuse KV states of cached prefixes automatically.")
    prefill_chunk_size: PositiveInt = Field(2048, description="Longest stretch of new tokens run in one forward pass.")
    load_in_8bit: bool = Field(
        False, description="bitsandbytes 8-bit weights (needs genlm-hf[quant] and usually CUDA)."
    )
    load_in_4bit: bool = Field(
        False, description="bitsandbytes 4-bit weights (needs genlm-hf[quant] and usually CUDA)."
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit quantization type.")
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Compute dtype of 4-bit layers."
    )
    lora: dict[str, str] = Field(default_factory=dict, description="LoRA adapters to load at start: {name: path}.")
    active_lora: str | None = Field(None, description="Adapter active after loading (a key of lora).")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint folder.")
    hf_opts: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for from_pretrained.")
