"""``install()``: make genlm-backend's loaders and tries build genlm's, for unmodified programs."""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import Any

from genlm_compat.bytes import CompatByteBeamState
from genlm_compat.lm import SEED_CLASSES, CompatLM, seed_class, wrap
from genlm_compat.tries import CompatAsyncCharacterTrie, CompatCharacterTrie, CompatParallelCharacterTrie
from genlm_core import load_model_by_name as genlm_load_model_by_name
from genlm_core.bytes import BeamParams

log = logging.getLogger(__name__)

#: genlm-backend's trie classes -> ours.
TRIES = {
    "TokenCharacterTrie": CompatCharacterTrie,
    "ParallelTokenCharacterTrie": CompatParallelCharacterTrie,
    "AsyncTokenCharacterTrie": CompatAsyncCharacterTrie,
}

_lock = threading.Lock()
_saved: list[tuple[Any, str, Any]] = []  # (owner, attribute, original value), in the order set


def load(name: str, backend: str | None = None, llm_opts: dict[str, Any] | None = None) -> CompatLM:
    """genlm-backend's ``load_model_by_name``, building a genlm LM (wrapped) through the plugin registry."""
    opts = dict(llm_opts or {})
    bnb = opts.pop("bitsandbytes_opts", None)
    if bnb:  # genlm-backend's HF keyword: a BitsAndBytesConfig's arguments
        from transformers import BitsAndBytesConfig

        opts["hf_opts"] = {**opts.get("hf_opts", {}), "quantization_config": BitsAndBytesConfig(**bnb)}
    return wrap(genlm_load_model_by_name(name, backend=backend, llm_opts=opts))


def _from_name(backend: str) -> classmethod:
    def from_name(cls: type, model_name: str, **kwargs: Any) -> CompatLM:
        return load(model_name, backend, kwargs)

    from_name.__doc__ = f"Load ``model_name`` with genlm's ``{backend}`` backend (installed by genlm_compat)."
    return classmethod(from_name)


def _set(owner: Any, attr: str, value: Any) -> None:
    _saved.append((owner, attr, owner.__dict__.get(attr, getattr(owner, attr))))
    setattr(owner, attr, value)


def _replace_everywhere(original: Any, new: Any) -> None:
    """Point every loaded module's global that is ``original`` (``from x import original``) at ``new``."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                _set(module, attr, new)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return bool(_saved)


def install(byte_lm: bool = True) -> None:
    """Make genlm-backend build genlm's models and tries, so that unmodified programs run on genlm.

    After it, ``genlm.backend.load_model_by_name`` and the ``from_name`` of genlm-backend's
    ``AsyncTransformer``, ``AsyncVirtualLM``, ``MockAsyncLM`` and ``AsyncMlxLM`` load the matching
    genlm backend through genlm's plugin registry and return it wrapped (:func:`~genlm_compat.wrap`):
    ``PromptedLLM.from_name``, ``ByteLLM.from_name`` and ``CachedCausalLM.from_pretrained`` build genlm
    models. ``genlm.backend.trie``'s classes become genlm's engines with genlm-backend's attributes.
    With ``byte_lm`` (and genlm-bytes installed), genlm-bytes' ``ByteBeamState`` and ``BeamParams`` become
    genlm's byte LM, so ``ByteLLM`` runs on it too. Modules that imported those names already are updated
    too. Calling it again does nothing; :func:`uninstall` restores genlm-backend and genlm-bytes.
    """
    with _lock:
        if _saved:
            return
        llm = importlib.import_module("genlm.backend.llm")
        _replace_everywhere(llm.load_model_by_name, load)
        for backend in SEED_CLASSES:
            try:
                cls = seed_class(backend)
            except ImportError as exc:  # e.g. genlm-backend's MLX module on a machine without mlx
                log.debug("genlm_compat: genlm-backend has no %s class here (%s)", backend, exc)
                continue
            _set(cls, "from_name", _from_name(backend))
        trie = importlib.import_module("genlm.backend.trie")
        for name, ours in TRIES.items():
            _replace_everywhere(getattr(trie, name), ours)
        if byte_lm:
            try:
                seed_bytes = importlib.import_module("genlm.bytes")
            except ImportError:
                seed_bytes = None
            if seed_bytes is not None:
                _replace_everywhere(seed_bytes.ByteBeamState, CompatByteBeamState)
                _replace_everywhere(seed_bytes.BeamParams, BeamParams)
        log.info("genlm_compat: genlm-backend now builds genlm models and tries")


def uninstall() -> None:
    """Undo :func:`install`; calling it when not installed does nothing."""
    with _lock:
        while _saved:
            owner, attr, value = _saved.pop()
            setattr(owner, attr, value)
