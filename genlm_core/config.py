"""Pydantic models for configuration: the options every backend shares, and a model config."""

from __future__ import annotations

import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, ValidationInfo, field_validator

from genlm_core.batching import FlushPolicy
from genlm_core.errors import ConfigError, OptionsError


def _admits_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_admits_bool(a) for a in typing.get_args(annotation))
    return False


class BackendOptions(BaseModel):
    """Options every backend accepts. A backend subclasses this and adds its own fields.

    Validation is strict where lax parsing hides mistakes: unknown options are errors, floats must
    be finite (``timeout=inf`` would never flush a lone request), and ``True`` is not a number.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise OptionsError(describe_options_error(exc, type(self))) from None

    batch_size: PositiveInt = Field(32, description="Most requests computed in one batch.")
    timeout: float = Field(
        0.02, ge=0, description="Most seconds the oldest queued request waits for its batch (under every flush policy)."
    )
    flush: FlushPolicy = Field(
        "idle",
        description="When a partial batch goes to the model: 'idle' as soon as the program can submit nothing "
        "more (every other task waits); 'eager' as soon as the model is free, a queue in two halves (the program "
        "works on the first half's rows while the model computes the second: for a program with much work per "
        "row on a host whose CPU the model does not need); 'timeout' only at the timeout. A full batch goes at "
        "once (but for 'eager''s halves), and the timeout bounds every wait.",
    )
    cache_size: int = Field(1024, ge=0, description="Most next-token distributions kept in the output cache.")
    cache_bytes: int | None = Field(
        512 * 2**20, ge=0, description="Most bytes of logprob tensors kept in the output cache (None: no limit)."
    )

    @field_validator("*", mode="before")
    @classmethod
    def _bool_is_not_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, (bool, np.bool_)) and info.field_name is not None:
            if not _admits_bool(cls.model_fields[info.field_name].annotation):
                raise ValueError(f"expected a number, got the bool {value!r}")
        return value


def describe_options_error(exc: ValidationError, options: type[BaseModel], backend: str | None = None) -> str:
    """One line naming every bad option of ``options`` (and the backend), with the known options for a typo."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(options)"
        if err["type"] == "extra_forbidden":
            problems.append(f"unknown option {where!r} (known: {', '.join(options.model_fields)})")
        else:
            problems.append(f"option {where!r}: {err['msg']} (got {err.get('input')!r})")
    owner = f"backend {backend!r}" if backend else options.__name__
    return f"invalid options for {owner}: " + "; ".join(problems)


class ModelConfig(BaseModel):
    """Which model to load, with which backend and options (see :func:`genlm_core.load_model`)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="Model name or local path, as the backend understands it.")
    backend: str | None = Field(None, description="Backend name; None picks the default backend.")
    options: dict[str, Any] = Field(default_factory=dict, description="Backend options, validated by the backend.")

    @classmethod
    def from_data(cls, data: Any, source: str = "config") -> ModelConfig:
        """Validate a dict of the fields; ConfigError names every problem and where it came from."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source} must be a dict with keys model, backend, options; got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(config)'}: {e['msg']}"
                + (f" (got {e['input']!r})" if e["type"] != "missing" else "")
                for e in exc.errors()
            )
            raise ConfigError(f"invalid {source}: {problems}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a ``.toml`` or ``.json`` file (top-level keys ``model``, ``backend``, ``options``)."""
        path = Path(path)
        if path.suffix not in (".toml", ".json"):
            raise ConfigError(f"config file {path} must end in .toml or .json")
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {exc}") from None
        return cls.from_data(data, f"config file {path}")
