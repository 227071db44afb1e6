"""Options of the ``mlx`` backend."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt

from genlm_core.config import BackendOptions


class MLXOptions(BackendOptions):
    """Options of the ``mlx`` backend (mlx-lm)."""

    kv_cache_bytes: int | None = Field(
        2**32, ge=0, description="Most bytes of KV states kept for reuse (None: no limit)."
    )
    kv_cache_entries: PositiveInt = Field(4096, description="Most token sequences whose KV states are kept.")
    reuse_kv: bool = Field(True, description="Reuse KV states of cached prefixes automatically.")
    prefill_chunk_size: PositiveInt = Field(2048, description="Longest stretch of new tokens run in one forward pass.")
    model_config_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Model config values passed to mlx_lm.load (model_config=...)."
    )
