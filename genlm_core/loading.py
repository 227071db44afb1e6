"""Selecting a backend and loading a model: by name, or from a validated config."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from genlm_core.config import ModelConfig, describe_options_error, nest_dotted
from genlm_core.errors import BackendNotFoundError, ConfigError, OptionsError
from genlm_core.plugins import get_plugins
from genlm_core.registry import BackendSpec

if TYPE_CHECKING:  # imported when a model is built: a name that does not resolve fails before torch is imported
    from genlm_core.lm import AsyncLM

log = logging.getLogger(__name__)


def default_backend() -> str:
    """The backend that ``load_model_by_name`` uses when none is named: of the installed backends that
    can run here, the one with the highest default priority, which each backend declares when it
    registers (``register.backend(..., default_priority=...)``; 0 when it declares none). A backend
    whose priority is ``None`` (the built-in ``mock``: its rows are random) is never picked; a tie for
    the highest priority is an error naming the tied backends, as is having no candidate at all.
    Priorities are looked at from the highest down; a backend's ``check`` runs only when its turn comes.
    """
    installed = get_plugins().backends()
    priorities = {name: spec.priority_here() for name, spec in installed.items()}
    cannot_run: dict[str, str] = {}
    for priority in sorted({p for p in priorities.values() if p is not None}, reverse=True):
        candidates = []
        for name in sorted(n for n, p in priorities.items() if p == priority):
            reason = installed[name].unavailable_reason()
            if reason is None:
                candidates.append(name)
            else:
                cannot_run[name] = reason
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise BackendNotFoundError(
                f"no default backend: {' and '.join(map(repr, candidates))} rank equally "
                f"(default priority {priority}); pass backend=..."
            )
    listing = [f"{n} (cannot run here: {cannot_run[n]})" if n in cannot_run else n for n in sorted(installed)]
    never = sorted(n for n, p in priorities.items() if p is None)
    raise BackendNotFoundError(
        f"no default backend: installed are [{', '.join(listing) or 'none'}]"
        + (f", and {', '.join(never)} {'is' if len(never) == 1 else 'are'} never picked by default" if never else "")
        + "; pass backend=... or install a backend plugin (`pip install genlm-<backend>`)"
    )


def validate_options(spec: BackendSpec, options: dict[str, Any] | BaseModel | None) -> BaseModel:
    """Validate backend options with the backend's own pydantic model; errors name option and backend.
    A dotted key sets a field of a nested option: ``{"live.lookback": 2}`` is ``{"live": {"lookback": 2}}``
    (merged with the other fields given for ``live``)."""
    if isinstance(options, spec.options):
        return options
    if isinstance(options, BaseModel):
        options = options.model_dump(exclude_unset=True)
    if options is not None and not isinstance(options, dict):
        raise OptionsError(
            f"options for backend {spec.name!r} must be a dict (or the backend's options model), "
            f"got {type(options).__name__} {options!r}"
        )
    try:
        return spec.options.model_validate(nest_dotted(options or {}))
    except ValidationError as exc:
        raise OptionsError(describe_options_error(exc, spec.options, spec.name)) from None
    except OptionsError as exc:  # dotted keys that contradict each other
        raise OptionsError(
            f"invalid options for backend {spec.name!r}: " + "; ".join(exc.problems), exc.problems
        ) from None


def load_model_by_name(name: str, backend: str | None = None, llm_opts: dict[str, Any] | None = None) -> AsyncLM:
    """Load model ``name`` with ``backend`` (default: :func:`default_backend`) and options ``llm_opts``."""
    if isinstance(name, Path):
        name = str(name)
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a model name or path (a non-empty str), got {name!r}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {backend!r}")
    spec = get_plugins().backend(backend or default_backend())
    options = validate_options(spec, llm_opts)
    location = spec.model_location(name)  # a missing model fails here, before the backend's heavy imports
    _, factory = get_plugins().load_backend(spec.name)
    log.info("loading %r with backend %r", location, spec.name)
    lm = factory(location, options)
    from genlm_core.lm import AsyncLM

    if not isinstance(lm, AsyncLM):
        raise TypeError(f"backend {spec.name!r} (plugin {spec.plugin!r}) returned {type(lm).__name__}, not an AsyncLM")
    return lm


def load_model(config: ModelConfig | dict[str, Any] | str | Path) -> AsyncLM:
    """Load a model from a :class:`ModelConfig`, a dict of its fields, or a ``.toml``/``.json`` path."""
    if isinstance(config, (str, Path)):
        config = ModelConfig.from_file(config)
    elif isinstance(config, dict):
        config = ModelConfig.from_data(config)
    elif not isinstance(config, ModelConfig):
        raise ConfigError(
            f"load_model takes a ModelConfig, a dict or a .toml/.json path, got {type(config).__name__} {config!r}"
        )
    return load_model_by_name(config.model, config.backend, config.options)
