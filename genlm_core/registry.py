"""What plugins provide: backend and trie-engine specs, and the ``register`` object hooks receive."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any

from pydantic import BaseModel

from genlm_core.config import BackendOptions
from genlm_core.errors import BackendNotFoundError, PluginConflictError

#: A callable, or a lazy ``"package.module:attr"`` reference resolved on first use so that heavy
#: imports (torch models, vllm, mlx) happen only when that backend is actually used.
Factory = Callable[..., Any] | str
#: Returns ``None`` when the component can run on this machine, else the reason it cannot.
Check = Callable[[], str | None] | str | None

#: Takes a model name and returns where the model is (a path, or a name the backend can load), or
#: raises :class:`~genlm_core.errors.ModelNotFoundError`; called before the factory is imported.
NameResolver = Callable[[str], str] | str | None

#: Distributions that provide the backends this project maintains, for install hints.
KNOWN_DISTRIBUTIONS = {
    "hf": "genlm-hf",
    "vllm": "genlm-vllm",
    "mlx": "genlm-mlx",
}


def resolve(ref: Factory) -> Callable[..., Any]:
    """Import a ``"module:attr.path"`` reference; callables pass through unchanged."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not attr_path:
        raise ValueError(f"lazy reference {ref!r} must look like 'package.module:attr'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class _Component:
    name: str
    factory: Factory
    plugin: str
    distribution: str | None
    aliases: tuple[str, ...] = ()
    description: str = ""
    check: Check = None
    details: Check = None

    def load(self) -> Callable[..., Any]:
        """The factory, imported if it was given lazily."""
        return resolve(self.factory)

    def unavailable_reason(self) -> str | None:
        """``None`` if this component can run on this machine, else why not."""
        if self.check is None:
            return None
        try:
            return resolve(self.check)()
        except Exception as exc:  # a failing check must not break listings
            return f"availability check failed: {type(exc).__name__}: {exc}"

    def details_here(self) -> str | None:
        """What the component says it can do on this machine (e.g. execution modes), or None."""
        if self.details is None or self.unavailable_reason() is not None:
            return None
        try:
            return resolve(self.details)()
        except Exception as exc:  # a failing probe must not break listings
            return f"could not tell: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class BackendSpec(_Component):
    """A language-model backend: ``factory(model: str, options: Options) -> AsyncLM``."""

    options: type[BaseModel] = BackendOptions
    resolve_name: NameResolver = None

    def model_location(self, name: str) -> str:
        """Where model ``name`` is, by the backend's ``resolve_name`` (``name`` itself without one)."""
        return name if self.resolve_name is None else str(resolve(self.resolve_name)(name))


@dataclass(frozen=True)
class TrieEngineSpec(_Component):
    """A trie engine: ``factory(vocab, **kwargs)`` builds a token-character trie."""


@dataclass
class Registry:
    """Everything the loaded plugins registered, by name, with conflicts kept visible."""

    backends: dict[str, BackendSpec] = field(default_factory=dict)
    trie_engines: dict[str, TrieEngineSpec] = field(default_factory=dict)
    aliases: dict[str, dict[str, str]] = field(default_factory=lambda: {"backend": {}, "trie engine": {}})
    conflicts: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def _table(self, kind: str) -> dict[str, Any]:
        return self.backends if kind == "backend" else self.trie_engines

    def add(self, kind: str, spec: _Component) -> None:
        table, aliases = self._table(kind), self.aliases[kind]
        for name in (spec.name, *spec.aliases):
            owner = table.get(name) or table.get(aliases.get(name, ""))
            if owner is not None:
                self.conflicts.setdefault((kind, name), [owner.plugin]).append(spec.plugin)
        table.setdefault(spec.name, spec)
        for alias in spec.aliases:
            aliases.setdefault(alias, spec.name)

    def get(self, kind: str, name: str) -> Any:
        """The spec registered as ``name`` (or an alias); a clear error otherwise."""
        if (kind, name) in self.conflicts:
            plugins = " and ".join(repr(p) for p in self.conflicts[(kind, name)])
            raise PluginConflictError(
                f"{kind} {name!r} is registered by both {plugins}; uninstall one of them "
                f"or select plugins with GENLM_PLUGINS"
            )
        table = self._table(kind)
        spec = table.get(name) or table.get(self.aliases[kind].get(name, ""))
        if spec is None:
            installed = sorted(table) or ["none"]
            known = sorted({*table, *self.aliases[kind], *(KNOWN_DISTRIBUTIONS if kind == "backend" else ())})
            close = get_close_matches(name, known, n=1, cutoff=0.6)
            if close and close[0] != name:
                raise BackendNotFoundError(
                    f"{kind} {name!r} is not installed; did you mean {close[0]!r}? available: [{', '.join(installed)}]"
                )
            hint = KNOWN_DISTRIBUTIONS.get(name, f"genlm-{name}")
            raise BackendNotFoundError(
                f"{kind} {name!r} is not installed; available: [{', '.join(installed)}]. "
                f"Install the plugin that provides it, e.g. `pip install {hint}`"
                + ("" if name in KNOWN_DISTRIBUTIONS else " (if such a plugin exists)")
            )
        return spec


def reference_problem(ref: Factory, what: str) -> str | None:
    """Why a lazy ``"module:attr"`` reference cannot resolve, found without importing anything
    heavy (only whether its top-level module exists); None if it looks resolvable."""
    if not isinstance(ref, str):
        return None if callable(ref) else f"{what} must be a callable or a 'module:attr' string, got {ref!r}"
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        return f"{what} {ref!r} must look like 'package.module:attr'"
    top = module_name.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{what} {ref!r} does not resolve: no module named {top!r}"


class Register:
    """The object every hook receives: records what one plugin provides, tagged with its name.

    A component whose factory cannot resolve is not registered; the problem is kept in
    :attr:`problems` (discovery reports it as a failure of this plugin) and the others go on.
    """

    def __init__(self, registry: Registry, plugin: str, distribution: str | None = None):
        self._registry = registry
        self.plugin = plugin
        self.distribution = distribution
        self.problems: list[str] = []

    def _valid(self, kind: str, name: str, factory: Factory) -> bool:
        problem = reference_problem(factory, f"{kind} {name!r}: factory")
        if problem is not None:
            self.problems.append(problem)
        return problem is None

    def backend(
        self,
        name: str,
        factory: Factory,
        *,
        options: type[BaseModel] = BackendOptions,
        aliases: tuple[str, ...] = (),
        description: str = "",
        check: Check = None,
        details: Check = None,
        resolve_name: NameResolver = None,
    ) -> None:
        """Provide a backend. ``factory(model, options)`` returns an AsyncLM; ``options`` is the
        pydantic model that validates its options (use ``extra="forbid"``). ``check()`` says why it
        cannot run here (or None); ``details()`` says what it can do here, for ``genlm backends``.
        ``resolve_name(model)`` says where the model is, or raises
        :class:`~genlm_core.errors.ModelNotFoundError`, before the factory's heavy imports
        (``"genlm_core.hub:resolve_model"`` for Hugging Face names)."""
        if not (isinstance(options, type) and issubclass(options, BaseModel)):
            raise TypeError(f"backend {name!r}: options must be a pydantic model class, got {options!r}")
        resolver_problem = (
            None if resolve_name is None else reference_problem(resolve_name, f"backend {name!r}: resolve_name")
        )
        if resolver_problem is not None:
            self.problems.append(resolver_problem)
        elif self._valid("backend", name, factory):
            spec = BackendSpec(
                name,
                factory,
                self.plugin,
                self.distribution,
                tuple(aliases),
                description,
                check,
                details,
                options,
                resolve_name,
            )
            self._registry.add("backend", spec)

    def trie_engine(
        self,
        name: str,
        factory: Factory,
        *,
        aliases: tuple[str, ...] = (),
        description: str = "",
        check: Check = None,
    ) -> None:
        """Provide a trie engine; ``factory(vocab, **kwargs)`` builds it."""
        if self._valid("trie engine", name, factory):
            spec = TrieEngineSpec(name, factory, self.plugin, self.distribution, tuple(aliases), description, check)
            self._registry.add("trie engine", spec)
