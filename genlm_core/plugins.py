"""The plugin manager: finds plugins through entry points once, and answers what they registered.

Built-ins go through the same hooks as third-party plugins. A plugin that fails to import, or
whose hook raises, is recorded with its distribution and error and skipped; the rest still work.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from genlm_core import hookspecs
from genlm_core.registry import BackendSpec, Register, Registry, TrieEngineSpec

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "genlm"
ENV_VAR = "GENLM_PLUGINS"
BUILTIN_PLUGINS = ("genlm_core.builtins",)


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded or whose hook raised."""

    plugin: str
    distribution: str | None
    error: str


def _selected(env: str | None) -> set[str] | None:
    """``GENLM_PLUGINS``: unset means all plugins, ``""`` none, ``"a,b"`` only those."""
    if env is None:
        return None
    return {name.strip() for name in env.split(",") if name.strip()}


class Plugins:
    """Discovers plugins lazily, once, and builds the :class:`Registry` from their hooks."""

    def __init__(self, entry_points: Callable[..., Iterable[Any]] | None = None):
        self._entry_points = entry_points or importlib.metadata.entry_points
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self._load_failures: list[PluginFailure] = []
        self._hook_failures: list[PluginFailure] = []
        self._distributions: dict[str, str | None] = {}
        self._registry: Registry | None = None
        self._discovered = False
        self._lock = threading.RLock()

    def discover(self) -> None:
        """Register built-ins and every selected ``genlm`` entry point (idempotent)."""
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            for module_name in BUILTIN_PLUGINS:
                self.register(importlib.import_module(module_name), module_name, "genlm-core")
            selected = _selected(os.environ.get(ENV_VAR))
            for ep in self._entry_points(group=ENTRY_POINT_GROUP):
                ep_dist = getattr(ep, "dist", None)
                dist = ep_dist.name if ep_dist is not None else None
                if selected is not None and ep.name not in selected and dist not in selected:
                    continue
                try:
                    plugin = ep.load()
                except Exception as exc:
                    self._fail(self._load_failures, ep.name, dist, f"{type(exc).__name__}: {exc}")
                    continue
                if self.manager.is_registered(plugin):
                    continue
                self.register(plugin, ep.name, dist)

    def register(self, plugin: Any, name: str | None = None, distribution: str | None = None) -> None:
        """Register a plugin object (module or instance with ``@hookimpl`` methods)."""
        with self._lock:
            registered = self.manager.register(plugin, name=name)
            if registered is not None:
                self._distributions[registered] = distribution
            self._registry = None

    def unregister(self, plugin: Any) -> None:
        """Remove a plugin registered earlier (tests register fakes per test)."""
        with self._lock:
            self.manager.unregister(plugin)
            self._registry = None

    @property
    def failures(self) -> list[PluginFailure]:
        """Plugins that failed to import, or whose hooks raised."""
        _ = self.registry
        return self._load_failures + self._hook_failures

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
                try:
                    impl.function(register=Register(registry, impl.plugin_name, dist))
                except Exception as exc:
                    error = f"hook {hook.name} raised {type(exc).__name__}: {exc}"
                    self._fail(self._hook_failures, impl.plugin_name, dist, error)
        return registry

    # Typed facade: the rest of genlm asks these, never pluggy directly.
    def backends(self) -> dict[str, BackendSpec]:
        return dict(self.registry.backends)

    def backend(self, name: str) -> BackendSpec:
        spec: BackendSpec = self.registry.get("backend", name)
        return spec

    def trie_engines(self) -> dict[str, TrieEngineSpec]:
        return dict(self.registry.trie_engines)

    def trie_engine(self, name: str) -> TrieEngineSpec:
        spec: TrieEngineSpec = self.registry.get("trie engine", name)
        return spec


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
