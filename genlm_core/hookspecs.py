"""The hooks a genlm plugin may implement, and the markers it implements them with.

A plugin is a module (found through the ``genlm`` entry-point group) with functions
decorated by :data:`hookimpl`; it never imports pluggy itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from genlm_core.registry import Register

PROJECT = "genlm"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def register_backends(register: Register) -> None:
    """Declare language-model backends with ``register.backend(name, factory, options=...)``; what else
    a backend declares (its default priority, its install command, ...) is keywords of that call.

    Returns nothing: everything goes through ``register``.
    """


@hookspec
def register_trie_engines(register: Register) -> None:
    """Declare token-character trie engines with ``register.trie_engine(name, factory)``.

    Returns nothing: everything goes through ``register``.
    """
