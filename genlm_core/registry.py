"""What plugins provide: backend and trie-engine specs, and the ``register`` object hooks receive."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
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

#: How much a backend wants to be the default (:func:`~genlm_core.loading.default_backend`): an int,
#: ``None`` (never the default), or a callable (or lazy ``"module:function"``) that says so on this
#: machine, e.g. high only when CUDA is available.
Priority = int | Callable[[], int | None] | str | None

log = logging.getLogger(__name__)


def plugin_distribution(name: str) -> str:
    """The distribution that provides a component not installed, by the naming rule for genlm plugins:
    ``genlm-<name>`` (a backend that is not installed cannot say where it comes from).

    >>> plugin_distribution("vllm"), plugin_distribution("my_engine")
    ('genlm-vllm', 'genlm-my-engine')
    """
    return "genlm-" + re.sub(r"[-_.]+", "-", name).lower()


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
    install: str | None = None

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

    def repair_hint(self) -> str:
        """What to do when this component is installed but does not import: its declared ``install``
        command, else reinstalling the distribution that registered it."""
        if self.install:
            return f"install what it needs: {self.install}"
        return f"`pip install --force-reinstall {self.distribution}`" if self.distribution else "reinstall it"

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
    default_priority: Priority = 0

    def model_location(self, name: str) -> str:
        """Where model ``name`` is, by the backend's ``resolve_name`` (``name`` itself without one)."""
        return name if self.resolve_name is None else str(resolve(self.resolve_name)(name))

    def priority_here(self) -> int | None:
        """This backend's default-selection priority on this machine (``None``: never the default); a
        priority callable that fails counts as 0, the priority of a backend that declares none."""
        if self.default_priority is None or isinstance(self.default_priority, int):
            return self.default_priority
        try:
            priority = resolve(self.default_priority)()
        except Exception as exc:  # a failing probe must not break model loading
            log.warning(
                "default priority of backend %r failed (%s: %s); counted as 0", self.name, type(exc).__name__, exc
            )
            return 0
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            log.warning("default priority of backend %r is %r, not an int or None; counted as 0", self.name, priority)
            return 0
        return priority


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
            close = get_close_matches(name, sorted({*table, *self.aliases[kind]}), n=1, cutoff=0.6)
            if close:
                raise BackendNotFoundError(
                    f"{kind} {name!r} is not installed; did you mean {close[0]!r}? available: [{', '.join(installed)}]"
                )
            raise BackendNotFoundError(
                f"{kind} {name!r} is not installed; available: [{', '.join(installed)}]. "
                f"Install its plugin: `pip install {plugin_distribution(name)}` (genlm plugins are named genlm-<name>)"
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


def priority_problem(priority: Priority, what: str) -> str | None:
    """Why ``priority`` is not a default-selection priority (see :data:`Priority`), or None."""
    if priority is None or (isinstance(priority, int) and not isinstance(priority, bool)):
        return None
    if isinstance(priority, str) or callable(priority):
        return reference_problem(priority, what)
    return f"{what} must be an int, None, a callable or a 'module:function' string, got {priority!r}"


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
        default_priority: Priority = 0,
        install: str | None = None,
    ) -> None:
        """Provide a backend. ``factory(model, options)`` returns an AsyncLM; ``options`` is the
        pydantic model that validates its options (use ``extra="forbid"``). ``check()`` says why it
        cannot run here (or None); ``details()`` says what it can do here, for ``genlm backends``.
        ``resolve_name(model)`` says where the model is, or raises
        :class:`~genlm_core.errors.ModelNotFoundError`, before the factory's heavy imports
        (``"genlm_core.hub:resolve_model"`` for Hugging Face names). ``default_priority`` ranks it for
        :func:`~genlm_core.loading.default_backend` (see :data:`Priority`); ``install`` is the command
        that installs what it needs, shown in errors (default: ``pip install <its distribution>``)."""
        if not (isinstance(options, type) and issubclass(options, BaseModel)):
            raise TypeError(f"backend {name!r}: options must be a pydantic model class, got {options!r}")
        problems = [
            None if resolve_name is None else reference_problem(resolve_name, f"backend {name!r}: resolve_name"),
            priority_problem(default_priority, f"backend {name!r}: default_priority"),
        ]
        self.problems += [p for p in problems if p is not None]
        if not any(problems) and self._valid("backend", name, factory):
            spec = BackendSpec(
                name,
                factory,
                self.plugin,
                self.distribution,
                aliases=tuple(aliases),
                description=description,
                check=check,
                details=details,
                install=install,
                options=options,
                resolve_name=resolve_name,
                default_priority=default_priority,
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
        install: str | None = None,
    ) -> None:
        """Provide a trie engine; ``factory(vocab, **kwargs)`` builds it (``install`` as for backends)."""
        if self._valid("trie engine", name, factory):
            spec = TrieEngineSpec(
                name,
                factory,
                self.plugin,
                self.distribution,
                aliases=tuple(aliases),
                description=description,
                check=check,
                install=install,
            )
            self._registry.add("trie engine", spec)
