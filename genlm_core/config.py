"""Pydantic models for configuration: the options every backend shares, and a model config."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class BackendOptions(BaseModel):
    """Options every backend accepts. A backend subclasses this and adds its own fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    batch_size: PositiveInt = Field(32, description="Most requests computed in one batch.")
    timeout: float = Field(
        0.02, ge=0, description="Seconds after the first queued request at which a partial batch is flushed."
    )
    cache_size: int = Field(1024, ge=0, description="Most next-token distributions kept in the output cache.")
    cache_bytes: int | None = Field(
        512 * 2**20, ge=0, description="Most bytes of logprob tensors kept in the output cache (None: no limit)."
    )

    def lm_kwargs(self) -> dict[str, Any]:
        """The :class:`~genlm_core.AsyncLM` keyword arguments these options set (batching, output cache)."""
        return {
            "batch_size": self.batch_size,
            "timeout": self.timeout,
            "cache_size": self.cache_size,
            "cache_bytes": self.cache_bytes,
        }


class ModelConfig(BaseModel):
    """Which model to load, with which backend and options (see :func:`genlm_core.load_model`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="Model name or local path, as the backend understands it.")
    backend: str | None = Field(None, description="Backend name; None picks the default backend.")
    options: dict[str, Any] = Field(default_factory=dict, description="Backend options, validated by the backend.")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a ``.toml`` or ``.json`` file (top-level keys ``model``, ``backend``, ``options``)."""
        path = Path(path)
        if path.suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ValueError(f"config file {path} must end in .toml or .json")
        return cls.model_validate(data)
