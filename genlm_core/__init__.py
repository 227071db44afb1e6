"""genlm-core: async, autobatched language models for probabilistic programs, with backend plugins.

Importing the package imports nothing heavy: each public name is imported from its module on first use
(``from genlm_core import AsyncLM`` imports torch then; ``from genlm_core import Register, hookimpl``, what a
plugin module needs, does not), so ``genlm backends`` lists every plugin without importing an engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from genlm_core.batching import AutoBatcher, ContentKey, Failed
    from genlm_core.cache import OutputCache
    from genlm_core.config import BackendOptions, ModelConfig
    from genlm_core.context import Context
    from genlm_core.errors import (
        BackendNotFoundError,
        BatcherError,
        ClosedError,
        ConfigError,
        GenlmError,
        MissingDependencyError,
        ModelNotFoundError,
        OptionsError,
        PluginConflictError,
        PluginError,
        VocabDecodingError,
    )
    from genlm_core.hookspecs import hookimpl
    from genlm_core.lm import AsyncLM, LoRASelection, Request, RowsOut, logits_to_logprobs
    from genlm_core.loading import default_backend, load_model, load_model_by_name
    from genlm_core.plugins import get_plugins
    from genlm_core.proposal import Proposal, masked_proposal
    from genlm_core.registry import Register
    from genlm_core.tokenization import Token, Tokenizer, decode_vocab, decode_vocabulary

#: Where each public name is defined: imported from there on first use (module ``__getattr__``).
_SOURCES: dict[str, str] = {
    **dict.fromkeys(["AutoBatcher", "ContentKey", "Failed"], "genlm_core.batching"),
    "OutputCache": "genlm_core.cache",
    **dict.fromkeys(["BackendOptions", "ModelConfig"], "genlm_core.config"),
    "Context": "genlm_core.context",
    **dict.fromkeys(
        [
            "BackendNotFoundError",
            "BatcherError",
            "ClosedError",
            "ConfigError",
            "GenlmError",
            "MissingDependencyError",
            "ModelNotFoundError",
            "OptionsError",
            "PluginConflictError",
            "PluginError",
            "VocabDecodingError",
        ],
        "genlm_core.errors",
    ),
    "hookimpl": "genlm_core.hookspecs",
    **dict.fromkeys(["AsyncLM", "LoRASelection", "Request", "RowsOut", "logits_to_logprobs"], "genlm_core.lm"),
    **dict.fromkeys(["default_backend", "load_model", "load_model_by_name"], "genlm_core.loading"),
    "get_plugins": "genlm_core.plugins",
    **dict.fromkeys(["Proposal", "masked_proposal"], "genlm_core.proposal"),
    "Register": "genlm_core.registry",
    **dict.fromkeys(["Token", "Tokenizer", "decode_vocab", "decode_vocabulary"], "genlm_core.tokenization"),
}

__all__ = [
    "AsyncLM",
    "AutoBatcher",
    "BackendNotFoundError",
    "BackendOptions",
    "BatcherError",
    "ClosedError",
    "ConfigError",
    "ContentKey",
    "Context",
    "Failed",
    "GenlmError",
    "LoRASelection",
    "MissingDependencyError",
    "ModelConfig",
    "ModelNotFoundError",
    "OptionsError",
    "OutputCache",
    "PluginConflictError",
    "PluginError",
    "Proposal",
    "Register",
    "Request",
    "RowsOut",
    "Token",
    "Tokenizer",
    "VocabDecodingError",
    "decode_vocab",
    "decode_vocabulary",
    "default_backend",
    "get_plugins",
    "hookimpl",
    "load_model",
    "load_model_by_name",
    "logits_to_logprobs",
    "masked_proposal",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for (then kept here)."""
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
