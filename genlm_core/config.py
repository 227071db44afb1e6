"""Pydantic models for configuration: the options every backend shares, the option groups backends nest or
inherit (:class:`LiveOptions`, :class:`KVReuseOptions`), the built-in mock's options, and a model config.

Import-light on purpose (pydantic and numpy, no torch): a plugin's options model is imported when the plugin
registers, so ``genlm backends`` and ``genlm options`` list backends without importing an engine. The option
classes are also importable from the modules that use them (``genlm_core.live.LiveOptions``,
``genlm_core.kv_reuse.KVReuseOptions``, ``genlm_core.mock.MockOptions``).
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from genlm_core.errors import ConfigError, OptionsError

#: When a batch of queued requests is flushed to the model (besides a full batch, at once, and
#: ``timeout`` seconds after the oldest request, always):
#:
#: - ``"idle"``: as soon as nothing else in the program can run (every other task of the event loop
#:   waits: on this batcher, a timer, I/O or a thread). A particle step's requests form one batch
#:   and nobody waits for a timer.
#: - ``"eager"``: as soon as the model is free, and a queue of two or more goes in two halves, the
#:   second as soon as the first is done: the program works on the first half's rows while the model
#:   computes the second half (for a batch function run in a thread or a coroutine function; an
#:   inline one flushes as ``"idle"``). A step costs about the model's time plus half the program's,
#:   at the price of one more model call per step.
#: - ``"timeout"``: only when full or at the timeout (``timeout=0``: after one event-loop pass).
FlushPolicy = Literal["idle", "eager", "timeout"]
FLUSH_POLICIES: tuple[str, ...] = get_args(FlushPolicy)


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
            problems = option_problems(exc, type(self))
            raise OptionsError(f"invalid options for {type(self).__name__}: " + "; ".join(problems), problems) from None

    @model_validator(mode="before")
    @classmethod
    def _dotted_keys(cls, data: Any) -> Any:
        """``{"live.lookback": 2}`` is ``{"live": {"lookback": 2}}`` (see :func:`nest_dotted`)."""
        return nest_dotted(data) if isinstance(data, dict) else data

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


def default_kv_cache_bytes() -> int:
    """At most 4 GiB, and at most a sixth of this machine's memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 * 2**30
    return int(min(4 * 2**30, total // 6))


class KVReuseOptions(BackendOptions):
    """Options of every backend built on :class:`~genlm_core.kv_reuse.KVReuse` (the hf and mlx backends
    inherit them)."""

    kv_cache_bytes: int | None = Field(
        default_factory=default_kv_cache_bytes,
        ge=0,
        description="Most bytes of KV states kept for reuse (None: no limit). Default: min(4 GiB, RAM / 6).",
    )
    kv_cache_entries: PositiveInt = Field(4096, description="Most token sequences whose KV states are kept.")
    reuse_kv: bool = Field(True, description="Reuse KV states of cached prefixes automatically.")
    prefill_chunk_size: PositiveInt = Field(2048, description="Longest stretch of new tokens run in one forward pass.")


class LiveOptions(BaseModel):
    """How an engine keeps particles alive (a backend nests it as its ``live`` option; see
    :mod:`genlm_core.live`)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = Field(
        True,
        description="Keep each row's context alive in the engine, so that a request extending it computes only "
        "its new tokens; False computes every row from its whole context.",
    )
    lookback: PositiveInt = Field(1, description="Most tokens by which a request may extend a live sequence.")
    max_idle_batches: PositiveInt | None = Field(
        None,
        description="Batches in a row a live sequence may go unclaimed before it is released (None: until evicted).",
    )
    max_sequences: PositiveInt | None = Field(
        None, description="Most sequences kept alive between batches (None: as many as the engine holds)."
    )


class MockOptions(BackendOptions):
    """Options of the ``mock`` backend (:class:`~genlm_core.mock.MockAsyncLM`)."""

    seed: int = Field(0, description="Changes every distribution; the same seed gives the same model.")
    scale: float = Field(3.0, gt=0, description="Standard deviation of the logits (larger is peakier).")
    vocab_padding: int = Field(0, ge=0, description="Extra logit columns beyond the tokenizer, as padded models have.")
    delay: float = Field(0.0, ge=0, description="Seconds each batch takes, to simulate model latency.")
    keep_batches: int = Field(1000, ge=0, description="Most recent batches kept in `.batches` (memory stays bounded).")


def nest_dotted(options: dict[str, Any]) -> dict[str, Any]:
    """Options with dotted keys nested: ``{"live.lookback": 2, "live": {"enabled": False}}`` is
    ``{"live": {"enabled": False, "lookback": 2}}`` (what ``-o live.lookback=2`` on the command line and
    ``llm_opts={"live.lookback": 2}`` mean). A key given twice, or a field of an option whose value is
    not a dict, is an :class:`~genlm_core.errors.OptionsError` naming both."""
    if not any(isinstance(k, str) and "." in k for k in options):
        return options
    nested: dict[str, Any] = {}
    for key, value in options.items():
        if not isinstance(key, str) or "." not in key:
            _merge(nested, [key], value)
        else:
            _merge(nested, key.split("."), value)
    return nested


def _merge(into: dict[str, Any], path: list[str], value: Any, done: tuple[str, ...] = ()) -> None:
    head, rest = path[0], path[1:]
    where = (*done, head)
    if "" in path:
        _conflict(f"option {'.'.join((*done, *path))!r}: an empty name between dots")
    if not rest:
        if head in into and not (isinstance(into[head], dict) and isinstance(value, dict)):
            _conflict(f"option {'.'.join(where)!r} is given twice ({into[head]!r} and {value!r})")
        if head in into:
            for k, v in value.items():
                _merge(into[head], [k], v, where)
        else:
            into[head] = dict(value) if isinstance(value, dict) else value
        return
    inner = into.setdefault(head, {})
    if not isinstance(inner, dict):
        _conflict(
            f"option {'.'.join((*where, *rest))!r} sets a field of {'.'.join(where)!r}, which is given as {inner!r}"
        )
    _merge(inner, rest, value, where)


def _conflict(problem: str) -> typing.NoReturn:
    raise OptionsError(f"invalid options: {problem}", [problem])


def nested_model(options: type[BaseModel], path: typing.Sequence[str | int]) -> type[BaseModel] | None:
    """The pydantic model of the option at ``path`` in ``options`` (``("live",)`` -> ``LiveOptions``),
    or None when it is not a model."""
    model: type[BaseModel] | None = options
    for part in path:
        field = None if model is None else model.model_fields.get(str(part))
        if field is None:
            return None
        model = _model_of(field.annotation)
    return model


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [m for m in map(_model_of, typing.get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def option_problems(exc: ValidationError, options: type[BaseModel]) -> list[str]:
    """One phrase per bad option: its dotted path, the problem, and the value given (once); an
    unknown option lists the known ones where it was given (a nested option's own fields)."""
    problems = []
    for err in exc.errors():
        loc = err["loc"]
        where = ".".join(str(p) for p in loc) or "(options)"
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, OptionsError) and cause.problems:  # a nested options model's own error
            prefix = ".".join(str(p) for p in loc)
            problems += [_within(prefix, p) for p in cause.problems]
        elif err["type"] == "extra_forbidden":
            owner = nested_model(options, loc[:-1]) or options
            known = list(owner.model_fields)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])!r}?" if close else ""
            inside = f" in {'.'.join(map(str, loc[:-1]))!r}" if len(loc) > 1 else ""
            problems.append(f"unknown option {where!r} (known{inside}: {', '.join(known)}){hint}")
        else:
            message = str(err["msg"]).removeprefix("Value error, ")
            problems.append(f"option {where!r}: {message} (got {err.get('input')!r})")
    return problems


def _within(prefix: str, problem: str) -> str:
    """A nested model's problem phrase with its option path under ``prefix``."""
    if not prefix:
        return problem
    for start in ("option '", "unknown option '"):
        if problem.startswith(start):
            return f"{start}{prefix}.{problem[len(start) :]}"
    return problem


def describe_options_error(exc: ValidationError, options: type[BaseModel], backend: str | None = None) -> str:
    """One line naming every bad option of ``options`` (and the backend): each option's dotted path,
    the problem and the value given, with the known options (of the nested model) for a typo."""
    owner = f"backend {backend!r}" if backend else options.__name__
    return f"invalid options for {owner}: " + "; ".join(option_problems(exc, options))


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
