"""Options of the ``hf`` backend."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from genlm_core.config import KVReuseOptions  # import-light: registering the plugin imports no torch


class HFOptions(KVReuseOptions):
    """Options of the ``hf`` backend (transformers); the KV-reuse options are core's."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype; 'auto' is float32 on CPU and the checkpoint's dtype on CUDA."
    )
    device: str | None = Field(
        None, description="Device for the whole model, e.g. 'cpu', 'cuda:0' (default: cuda if available)."
    )
    device_map: str | dict[str, Any] | None = Field(
        None, description="accelerate device_map (e.g. 'auto'); overrides device."
    )
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
    decode_room: int = Field(
        0,
        ge=0,
        description=(
            "Opt-in (0: off). Positions of room kept after the past of a plain step (every row's new tokens "
            "right after a past of the same length: an SMC step), so that the next steps of the same rows "
            "write their states there in place instead of copying the whole past each step, as HF's own "
            "decode does; a full buffer is copied once into one with this much room again. Costs up to this "
            "many positions per row of device memory that kv_cache_bytes does not count."
        ),
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint folder.")
    hf_opts: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for from_pretrained.")
