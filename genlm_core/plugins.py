"""The plugin manager: finds plugins through entry points once, and answers what they registered.

Built-ins go through the same hooks as third-party plugins. A plugin that fails to import, collides
with another's name, declares a hook that matches no spec, or whose hook raises, is recorded with
its distribution and error and skipped; the rest still work.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any

import pluggy

from genlm_core import hookspecs
from genlm_core.errors import BackendNotFoundError, PluginError
from genlm_core.registry import BackendSpec, Register, Registry, TrieEngineSpec, plugin_distribution

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "genlm"
ENV_VAR = "GENLM_PLUGINS"
BUILTIN_PLUGINS = ("genlm_core.builtins",)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be used: its import failed, its name collides with another
    distribution's, a hook matches no spec or has a bad signature, a hook raised, or a factory
    string does not resolve."""

    plugin: str
    distribution: str | None
    error: str


def _selected(env: str | None) -> set[str] | None:
    """``GENLM_PLUGINS``: unset means all plugins, ``""`` none, ``"a,b"`` only those."""
    if env is None:
        return None
    return {name.strip() for name in env.split(",") if name.strip()}


class Plugins:
    """Discovers plugins lazily, once, and builds the :class:`Registry` from their hooks.

    Discovery never raises: each entry point is loaded and registered inside its own guard, and
    every problem becomes a :class:`PluginFailure` naming the distribution, while the other plugins
    load. ``discover(retry=True)`` tries the failed entry points again (after a fix or an install).
    """

    def __init__(self, entry_points: Callable[..., Iterable[Any]] | None = None):
        self._entry_points = entry_points or importlib.metadata.entry_points
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self._load_failures: list[PluginFailure] = []
        self._hook_failures: list[PluginFailure] = []
        self._use_failures: list[PluginFailure] = []
        self._distributions: dict[str, str | None] = {}
        self._registry: Registry | None = None
        self._builtins_registered = False
        self._discovered = False
        self._lock = threading.RLock()

    def discover(self, retry: bool = False) -> None:
        """Register built-ins and every selected ``genlm`` entry point. Done once; with ``retry``,
        the entry points not registered yet (those that failed) are tried again."""
        with self._lock:
            if self._discovered and not retry:
                return
            if not self._builtins_registered:
                for module_name in BUILTIN_PLUGINS:
                    self.register(importlib.import_module(module_name), module_name, "genlm-core")
                self._builtins_registered = True
            self._discovered = True
            self._load_failures = []
            self._registry = None
            try:
                entry_points = list(self._entry_points(group=ENTRY_POINT_GROUP))
            except Exception as exc:
                self._fail(self._load_failures, ENTRY_POINT_GROUP, None, f"listing entry points failed: {exc!r}")
                return
            selected = _selected(os.environ.get(ENV_VAR))
            for ep in entry_points:
                ep_dist = getattr(ep, "dist", None)
                dist = ep_dist.name if ep_dist is not None else None
                if selected is not None and ep.name not in selected and dist not in selected:
                    continue
                if ep.name in self._distributions and self._distributions[ep.name] == dist:
                    continue  # registered by an earlier discovery
                problem = self._load_and_register(ep, dist)
                if problem is not None:
                    self._fail(self._load_failures, ep.name, dist, problem)

    def _load_and_register(self, ep: Any, dist: str | None) -> str | None:
        """Load one entry point and register its module; the problem, if any."""
        owner = self.manager.get_plugin(ep.name)
        if owner is not None:
            return (
                f"name collision: entry point {ep.name!r} of {dist or 'an unknown distribution'} is also provided "
                f"by {self._distributions.get(ep.name) or 'another plugin'}; uninstall one of them"
            )
        try:
            plugin = ep.load()
        except Exception as exc:
            return f"import failed: {type(exc).__name__}: {exc}"
        if self.manager.is_registered(plugin):
            return None
        try:
            self.register(plugin, ep.name, dist)
        except PluginError as exc:
            return str(exc)
        return None

    def register(self, plugin: Any, name: str | None = None, distribution: str | None = None) -> None:
        """Register a plugin object (module or instance with ``@hookimpl`` methods).

        Raises :class:`~genlm_core.errors.PluginError` (and registers nothing) if the name is taken,
        a hook's signature does not match its spec, or a hook matches no spec (a misspelling).
        """
        with self._lock:
            if name is not None and self.manager.get_plugin(name) is not None:
                raise PluginError(f"a plugin named {name!r} is already registered")
            try:
                registered = self.manager.register(plugin, name=name)
            except pluggy.PluginValidationError as exc:
                raise PluginError(f"invalid hook: {exc}") from None
            if registered is None:
                return
            unknown = [hc.name for hc in self.manager.get_hookcallers(plugin) or [] if not hc.has_spec()]
            if unknown:
                self.manager.unregister(plugin)
                known = [name for name in dir(hookspecs) if name.startswith("register_")]
                hints = [
                    f"{u!r} (did you mean {get_close_matches(u, known, 1)[0]!r}?)"
                    if get_close_matches(u, known, 1)
                    else repr(u)
                    for u in unknown
                ]
                raise PluginError(f"hook {', '.join(hints)} matches no genlm hook; the hooks are {known}")
            self._distributions[registered] = distribution
            self._registry = None

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered earlier (tests register fakes per test)."""
        with self._lock:
            name = self.manager.get_name(plugin)
            self.manager.unregister(plugin)
            self._distributions.pop(name or "", None)
            self._registry = None

    @property
    def failures(self) -> list[PluginFailure]:
        """Every plugin problem found so far: failed imports, collisions, bad hooks, hooks that
        raised, factories that do not resolve."""
        _ = self.registry
        return self._load_failures + self._hook_failures + self._use_failures

    @staticmethod
    def _fail(into: list[PluginFailure], plugin: str, distribution: str | None, error: str) -> None:
        into.append(PluginFailure(plugin, distribution, error))
        log.warning("genlm plugin %r (distribution %s) failed: %s", plugin, distribution, error)

    @property
    def registry(self) -> Registry:
        """What all loaded plugins registered; rebuilt after (un)registering a plugin."""
        with self._lock:
            self.discover()
            if self._registry is None:
                self._registry = self._build()
            return self._registry

    def _build(self) -> Registry:
        registry = Registry()
        self._hook_failures = []
        for hook in (self.manager.hook.register_trie_engines, self.manager.hook.register_backends):
            for impl in hook.get_hookimpls():  # registration order
                dist = self._distributions.get(impl.plugin_name)
                register = Register(registry, impl.plugin_name, dist)
                try:
                    impl.function(register=register)
                except Exception as exc:
                    error = f"hook {hook.name} raised {type(exc).__name__}: {exc}"
                    self._fail(self._hook_failures, impl.plugin_name, dist, error)
                for problem in register.problems:
                    self._fail(self._hook_failures, impl.plugin_name, dist, problem)
        return registry

    def _failures_note(self, name: str) -> str:
        """What failed that may explain why ``name`` is missing."""
        dist = plugin_distribution(name)
        related = [f for f in self.failures if f.plugin == name or f.distribution == dist]
        shown = related or self.failures
        if not shown:
            return ""
        what = "its plugin failed" if related else "plugins that failed to load"
        return f" ({what}: " + "; ".join(f"{f.plugin} ({f.distribution or '?'}): {f.error}" for f in shown) + ")"

    def _spec(self, kind: str, name: str) -> Any:
        try:
            return self.registry.get(kind, name)
        except BackendNotFoundError as exc:
            raise BackendNotFoundError(f"{exc}{self._failures_note(name)}") from None

    def _resolved(self, spec: Any) -> Callable[..., Any]:
        try:
            return spec.load()
        except Exception as exc:
            error = f"factory {spec.factory!r} of {spec.name!r} does not resolve: {type(exc).__name__}: {exc}"
            with self._lock:
                if not any(f.error == error for f in self._use_failures):
                    self._fail(self._use_failures, spec.plugin, spec.distribution, error)
            raise PluginError(
                f"plugin {spec.plugin!r} ({spec.distribution or '?'}): {error}; {spec.repair_hint()}"
            ) from exc

    # Typed facade: the rest of genlm asks these, never pluggy directly.
    def backends(self) -> dict[str, BackendSpec]:
        return dict(self.registry.backends)

    def backend(self, name: str) -> BackendSpec:
        """The backend registered as ``name``; the error names failed plugins that may explain a miss."""
        spec: BackendSpec = self._spec("backend", name)
        return spec

    def load_backend(self, name: str) -> tuple[BackendSpec, Callable[..., Any]]:
        """The backend's spec and its factory, imported now; a factory that does not resolve is
        recorded as a failure of its plugin and raised as :class:`~genlm_core.errors.PluginError`."""
        spec = self.backend(name)
        return spec, self._resolved(spec)

    def trie_engines(self) -> dict[str, TrieEngineSpec]:
        return dict(self.registry.trie_engines)

    def trie_engine(self, name: str) -> TrieEngineSpec:
        spec: TrieEngineSpec = self._spec("trie engine", name)
        return spec

    def load_trie_engine(self, name: str) -> Callable[..., Any]:
        """The trie engine's factory, imported now (failures as in :meth:`load_backend`)."""
        return self._resolved(self.trie_engine(name))


_plugins: Plugins | None = None
_plugins_lock = threading.Lock()


def get_plugins() -> Plugins:
    """The process-wide plugin manager (created, not yet discovered, on first use)."""
    global _plugins
    with _plugins_lock:
        if _plugins is None:
            _plugins = Plugins()
        return _plugins


def reset_plugins(plugins: Plugins | None = None) -> Plugins:
    """Replace the process-wide manager (tests; after installing a plugin at run time)."""
    global _plugins
    with _plugins_lock:
        _plugins = plugins or Plugins()
        return _plugins
