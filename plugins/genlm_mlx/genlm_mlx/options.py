"""Options of the ``mlx`` backend."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from genlm_core.config import KVReuseOptions  # import-light: registering the plugin imports no torch


class MLXOptions(KVReuseOptions):
    """Options of the ``mlx`` backend (mlx-lm); the KV-reuse options are core's."""

    model_config_overrides: dict[str, Any] = Field(
        default_factory=dict, description="Model config values passed to mlx_lm.load (model_config=...)."
    )
